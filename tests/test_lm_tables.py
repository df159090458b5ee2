"""A language model read as a workflow observable-state policy (docs/METHODS.md 8.3,
LM1-LM3), and the Monte Carlo check of (LM3), with a real (random-weight) tiny
transformers model and the real environment and engine."""

from __future__ import annotations

import math

import numpy as np
import pytest

from train.envs.workflow import WorkflowEnv
from train.envs.workflow_model import WorkflowModel
from train.envs.workflow_policy import TabularPolicy
from train.policies import load_policy
from train.policies.tiny import random_tiny_policy
from train.sampling.references import ReferenceConfig, run_references
from train.studies.lm_tables import canonical_steps, canonical_tree, lm_tables, outcome_starts
from train.studies.workflow_study import make_tasks, observable_keys


def test_canonical_histories_reach_every_observable_state() -> None:
    for task in make_tasks(6, 5, horizons=(6, 9, 12)):
        model = WorkflowModel.from_config(task.config)
        tree, cand = canonical_tree(model, WorkflowEnv().reset(task), lambda s: [1, 2],
                                    "t")  # raises if a history misses its state
        keys = observable_keys(model)
        assert list(cand) == keys
        by_id = {n.node_id: n for n in tree.nodes}
        for key in keys:
            assert [len(ids) for ids in [cand[key]]] == [len(model.valid_tools(key))]
            # the state node sits at depth t: one tree edge per step of the history
            depth, node = 0, by_id[by_id[cand[key][0]].parent_id or 0]
            while node.parent_id is not None:
                depth, node = depth + 1, by_id[node.parent_id]
            assert depth == key.t == len(canonical_steps(model, key))
        # histories share prefixes: one node per distinct step sequence, not per state
        chain = len(tree.nodes) - 1 - sum(len(v) for v in cand.values())
        assert chain <= sum(k.t for k in keys) and chain <= len(keys) + model.n_stages


def test_the_reading_equals_the_models_own_scores() -> None:
    """(LM1) from one tree-layout pass equals the model's per-transcript ``score``."""
    policy = random_tiny_policy(seed=3)
    tasks = make_tasks(3, 7, horizons=(6, 9))
    tables = lm_tables(policy, tasks, trees_per_pass=2)
    env = WorkflowEnv()
    for task, table in zip(tasks, tables, strict=True):
        model = table.policy.model
        tree, cand = canonical_tree(model, env.reset(task), policy.encode, "x")
        turns = tree.transcripts()
        for key in list(cand)[::5]:
            actions = model.valid_actions(key)
            context = turns[tree.nodes[cand[key][0]].parent_id or 0]
            lp = np.array([float(x.sum()) for x in policy.score([context] * len(actions),
                                                                  actions)])
            want = np.exp(lp - np.logaddexp.reduce(lp))
            assert table.policy.probs(key) == pytest.approx(want, abs=1e-5)
            assert table.residual[key] == pytest.approx(max(0.0, 1 - np.exp(lp).sum()),
                                                        abs=1e-5)
            assert 0.0 <= table.residual[key] <= 1.0


def test_outcome_starts_cover_each_root_tools_outcomes() -> None:
    for task in make_tasks(8, 2, horizons=(6,)):
        model = WorkflowModel.from_config(task.config)
        s0 = model.initial_state()
        starts = outcome_starts(task)
        for tool in model.valid_tools(s0):
            mine = [o for o in starts if o.tool == tool]
            assert sum(o.p for o in mine) == pytest.approx(1.0)
            p, on_success, on_failure = model.outcomes(s0, tool)
            for o in mine:
                target = on_success if o.success else on_failure
                assert o.p == pytest.approx(p if o.success else 1 - p)
                if model.is_terminal(target):  # e.g. fast crashing: a leaf, no snapshot
                    assert o.start.state is None
                    assert o.start.leaf_reward == model.reward(target)
                else:
                    assert o.start.state is not None and o.start.leaf_reward is None
                    assert WorkflowEnv.snapshot_state(o.start.state) == target
                assert o.start.transcript[-1][0] == "observation"


def test_monte_carlo_of_l53_matches_exact_q_for_a_memoryless_policy() -> None:
    """The tabular backend is a function of the state line, so (LM3) must agree with its
    exact Q within sampling error: the mixing over outcomes is right."""
    policy = load_policy("tabular", "workflow")
    k = 400
    for task in make_tasks(3, 11, horizons=(6, 9)):
        model = WorkflowModel.from_config(task.config)
        exact = TabularPolicy(model).values()  # uniform: the backend's unregistered policy
        starts = outcome_starts(task)
        wins = run_references(policy, WorkflowEnv, [o.start for o in starts],
                              ReferenceConfig(k=k, seed=1))
        for tool in model.valid_tools(model.initial_state()):
            parts = [(o.p, w / k) for o, w in zip(starts, wins, strict=True) if o.tool == tool]
            q_mc = sum(p * q for p, q in parts)
            se = math.sqrt(sum(p * p * q * (1 - q) for p, q in parts) / k)
            q = exact.q(model.initial_state(), model.valid_actions(model.initial_state())[
                model.valid_tools(model.initial_state()).index(tool)])
            assert abs(q_mc - q) <= 4 * se + 1e-9, (task.task_id, tool, q_mc, q, se)
