"""Samplers and the collection job (issue 6).

* budget: no sampler spends more than ``n_total``; per-phase counts add up to
  the recorded total and equal the phases of the leaves (property test over
  samplers, seeds and budgets with a tabular policy on ``workflow``);
* BEL on deterministic ``workflow`` finds the exact first irrecoverable step
  with at most ceil(log2 K) + 1 probes;
* branching restores the parent's snapshot (byte for byte) and never replays;
  the policy only ever gets transcripts of existing paths;
* trees validate and round-trip through a real store; CALIPER trees are what
  ``train.credit.caliper`` reads; collection is idempotent and resumable.

The tabular policy here is a protocol adapter over
``train.envs.workflow_policy.TabularPolicy`` (one action string = one token),
used until ``train.policies.load_policy("tabular", "workflow")`` lands.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli.main import app
from rollout_store import Store, read_trees
from rollout_store.tree import Segment, Tree
from train.credit.base import from_trees
from train.credit.caliper import CaliperParams, caliper_groups
from train.envs import Task, make_env
from train.envs.calc import CalcEnv, answer_text, call_text
from train.envs.workflow import (
    ACTION_TEXTS,
    TOOLS,
    State,
    TabularPolicy,
    WorkflowEnv,
    WorkflowModel,
)
from train.policies.base import Continuation, SampleConfig, Transcript
from train.policies.tabular import UniformWorkflowPolicy
from train.sampling import (
    SAMPLERS,
    BelSampler,
    Budget,
    BudgetError,
    CaliperSampler,
    CaliperState,
    EntropySampler,
    Sampler,
    SamplerConfig,
    TreeBuilder,
    action_segments,
    caliper_extras,
    make_sampler,
)
from train.sampling.bel import BelConfig
from train.sampling.collect import collect, commit_key, stored_tree_ids, tree_id_for
from train.sampling.engine import Request

_TOOL_OF = {text: tool for tool, text in ACTION_TEXTS.items()}


# ----------------------------------------------------------------- test policies
def tabular_policies(tasks: Sequence[Task], bias: float = 0.0,
                     root_bias: float = 0.0) -> list[TabularPolicy]:
    """One ``TabularPolicy`` per task: uniform, plus ``bias`` on the optimal action of every
    observable state (suffix success likelier) and ``root_bias`` on ``careful`` at the start
    (a peaked first step)."""
    out = []
    for task in tasks:
        model = WorkflowModel.from_config(task.config)
        pol = TabularPolicy(model)
        if bias:
            opt = model.optimal_values()
            for key in model.keys_by_text().values():
                pol.update(key, opt.best_action(State(key.stage, key.t, key.broken)), bias)
        if root_bias:
            pol.update(model.initial_state(), "careful", root_bias)
        out.append(pol)
    return out


class TabularAdapter:
    """The Policy protocol over per-task ``TabularPolicy`` objects (keyed by prompt), for
    when ``train.policies.load_policy("tabular", ...)`` is not there.

    One action string is one token (its index in ``TOOLS``); the logprob is
    log pi(a|s) and the entropy that of pi(.|s).
    """

    policy_version = "tabular-test"
    policy_ref = None

    def __init__(self, policies: Sequence[TabularPolicy]) -> None:
        self.policies = {pol.model.prompt(): pol for pol in policies}

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        rng = np.random.default_rng(config.seed)
        out = []
        for tr in transcripts:
            pol = self.policies[tr[0][1]]
            key = pol.model.key_from_text(tr[-1][1])
            assert key is not None
            h = pol.entropy(key)
            conts = []
            for _ in range(config.n):
                a = pol.sample(key, rng)
                conts.append(Continuation(a, [TOOLS.index(_TOOL_OF[a])], [pol.log_prob(key, a)],
                                          [h]))
            out.append(conts)
        return out

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        raise NotImplementedError


def uniform_factory(env_name: str) -> UniformWorkflowPolicy:
    """A picklable policy factory for worker processes."""
    return UniformWorkflowPolicy("uniform-test")


class NoisyCalcPolicy:
    """A transcript-only noisy expert for ``calc``: one token per character.

    Before any tool response: call calc on the task's expression (p=0.7) or on a
    wrong one. After a numeric response: answer it (p=0.7, with a short
    reasoning prefix) or call again.
    """

    policy_version = "noisy-calc"
    policy_ref = None

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        rng = np.random.default_rng(config.seed)
        out = []
        for tr in transcripts:
            expr = re.match(r"Compute (.*)\.$", tr[0][1].strip())
            assert expr is not None
            value = re.fullmatch(r"<tool_response>(-?[0-9/.]+)</tool_response>", tr[-1][1])
            conts = []
            for _ in range(config.n):
                good = rng.random() < 0.7
                if value is None:
                    text = call_text(expr.group(1) if good else f"{expr.group(1)}+1")
                else:
                    text = ("The tool said so. " + answer_text(value.group(1)) if good
                            else call_text(expr.group(1)))
                h = -(0.7 * math.log(0.7) + 0.3 * math.log(0.3))
                lp = math.log(0.7 if good else 0.3)
                conts.append(Continuation(text, [ord(c) for c in text],
                                          [lp] + [0.0] * (len(text) - 1),
                                          [h] + [0.05] * (len(text) - 1)))
            out.append(conts)
        return out

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        raise NotImplementedError


class Recording:
    """Delegates to a policy and records every transcript it is asked to continue."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.policy_version, self.policy_ref = policy.policy_version, policy.policy_ref
        self.seen: list[tuple[Any, ...]] = []

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        self.seen.extend(tuple(t) for t in transcripts)
        out: list[list[Continuation]] = self.policy.sample(transcripts, config)
        return out

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        raise NotImplementedError


def workflow_policy(tasks: Sequence[Task], **kw: Any) -> Any:
    """``load_policy("tabular", "workflow")`` over these tasks' policies (our adapter
    while the backend has not landed)."""
    policies = tabular_policies(tasks, **kw)
    try:
        from train.policies import load_policy  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return TabularAdapter(policies)
    return load_policy("tabular", "workflow", policies=policies)


class SpyWorkflowEnv(WorkflowEnv):
    """Logs resets, restores (with their bytes), reseeds and steps."""

    def __init__(self, deterministic: bool | None = None) -> None:
        super().__init__(deterministic)
        self.log: list[tuple[str, Any]] = []

    def reset(self, task: Task) -> str:
        self.log.append(("reset", task.task_id))
        return super().reset(task)

    def restore(self, state: bytes) -> None:
        self.log.append(("restore", bytes(state)))
        super().restore(state)

    def reseed(self, key: int) -> None:
        self.log.append(("reseed", key))
        super().reseed(key)

    def step(self, action_text: str) -> Any:
        self.log.append(("step", action_text))
        return super().step(action_text)


WF_TASKS = WorkflowEnv.generate_tasks(12, seed=5)
WF_POLICY = workflow_policy(WF_TASKS)
WF_PEAKED = workflow_policy(WF_TASKS, root_bias=3.0)  # low H_root: entropy branching fires
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def sample(name: str, task: Task, n_total: int, seed: int = 0, policy: Any = None,
           env: Any = None, **params: Any) -> Tree:
    sampler = make_sampler(name, **params)
    return sampler.sample_tree(env or make_env("workflow"), policy or WF_POLICY, task, n_total,
                               seed=seed, tree_id=f"t-{name}-{seed}")


# ----------------------------------------------------------------- budget
@SETTINGS
@given(name=st.sampled_from(sorted(SAMPLERS)), task=st.sampled_from(WF_TASKS),
       n_total=st.integers(1, 20), seed=st.integers(0, 2**31), peaked=st.booleans())
def test_budget_is_spent_exactly_and_accounted_by_phase(name: str, task: Task, n_total: int,
                                                        seed: int, peaked: bool) -> None:
    tree = sample(name, task, n_total, seed, policy=WF_PEAKED if peaked else WF_POLICY)
    tree.validate()
    assert tree.budget == n_total
    assert sum(tree.rollouts_by_phase.values()) == n_total
    leaves = tree.leaves()
    assert len(leaves) == n_total  # one leaf per rollout
    # every node of a rollout carries its phase, so the leaves count the phases
    assert Counter(leaf.phase for leaf in leaves) == Counter(tree.rollouts_by_phase)
    assert all(leaf.reward == leaf.reward_parts["reward"] for leaf in leaves)
    root = tree.root()
    assert root.kind == "prompt" and root.observation_text == task.prompt
    assert all(n.kind in ("decision", "feedback_response") for n in tree.nodes if n is not root)
    kids = tree.children()
    for node in tree.nodes:  # steps never continue past the episode's end
        assert not (node.terminal and kids[node.node_id])
        assert len(tree.path_to(node.node_id)) - 1 <= task.max_steps


@SETTINGS
@given(task=st.sampled_from(WF_TASKS), n_total=st.integers(1, 40), seed=st.integers(0, 999),
       b_max=st.one_of(st.none(), st.integers(1, 5)), x_min=st.integers(1, 4),
       x_extra=st.integers(0, 6), n_initial=st.one_of(st.none(), st.integers(1, 30)))
def test_bel_budget_with_any_configuration(task: Task, n_total: int, seed: int,
                                           b_max: int | None, x_min: int, x_extra: int,
                                           n_initial: int | None) -> None:
    tree = sample("bel", task, n_total, seed, b_max=b_max, x_min=x_min, x_max=x_min + x_extra,
                  n_initial=n_initial)
    assert sum(tree.rollouts_by_phase.values()) == n_total == len(tree.leaves())
    info = tree.meta["bel"] if tree.meta else {}
    if "probes" in info:
        assert b_max is None or len(info["probes"]) <= b_max
        assert tree.rollouts_by_phase.get("probe", 0) == sum(p["x"] for p in info["probes"])
        assert all(p["x"] <= x_min + x_extra for p in info["probes"])


def test_budget_refuses_to_overspend() -> None:
    budget = Budget(3)
    budget.spend("a", 2)
    with pytest.raises(BudgetError, match="1 of 3 left"):
        budget.spend("b", 2)
    assert budget.by_phase == {"a": 2}

    class Greedy(Sampler):
        name = "greedy"

        def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
            yield from builder.run([(0, builder.budget.n_total + 1, "x")])

    with pytest.raises(BudgetError):
        Greedy().sample_tree(make_env("workflow"), WF_POLICY, WF_TASKS[0], 4, seed=0)

    class Lazy(Sampler):
        name = "lazy"

        def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
            yield from builder.run([(0, 1, "x")])

    with pytest.raises(BudgetError, match="unspent"):
        Lazy().sample_tree(make_env("workflow"), WF_POLICY, WF_TASKS[0], 4, seed=0)


def test_phases_of_each_sampler() -> None:
    task = WF_TASKS[1]
    assert sample("group", task, 8).rollouts_by_phase == {"group": 8}
    assert set(sample("random", task, 16).rollouts_by_phase) == {"explore", "expand"}
    caliper = sample("caliper", task, 16).rollouts_by_phase
    assert caliper["explore"] >= 8 and set(caliper) <= {"explore", "local"}
    bel = sample("bel", task, 16).rollouts_by_phase
    assert bel["explore"] == 7 and set(bel) <= {"explore", "probe", "fill"}


def test_rooted_gives_each_root_action_its_share_of_trajectories() -> None:
    for task in WF_TASKS[:4]:
        tree = sample("rooted", task, 32, seed=3, n_root=2)
        kids = tree.children()
        root = tree.root().node_id
        assert len(kids[root]) == 2
        below = Counter(tree.path_to(leaf.node_id)[1].node_id for leaf in tree.leaves())
        assert sorted(below.values()) == [16, 16]  # 1 + 15 continuations each
        assert tree.rollouts_by_phase == {"root": 2, "continue": 30}
    uneven = sample("rooted", WF_TASKS[0], 10, seed=1, n_root=3)
    per_action = Counter(uneven.path_to(leaf.node_id)[1].node_id for leaf in uneven.leaves())
    assert sorted(per_action.values()) == [3, 3, 4]
    with pytest.raises(ValueError, match="n_root must be >= 1"):
        make_sampler("rooted", n_root=0)


def test_same_seed_same_tree_and_other_seed_differs() -> None:
    for name in SAMPLERS:
        a, b, c = (sample(name, WF_TASKS[2], 12, seed) for seed in (7, 7, 8))
        key = [(n.node_id, n.parent_id, n.action_text, n.observation_text, n.phase)
               for n in a.nodes]
        assert key == [(n.node_id, n.parent_id, n.action_text, n.observation_text, n.phase)
                       for n in b.nodes]
        assert a.snapshots == b.snapshots
        assert key != [(n.node_id, n.parent_id, n.action_text, n.observation_text, n.phase)
                       for n in c.nodes]


# ----------------------------------------------------------------- BEL localization
def _truth(task: Task, tree: Tree, leaf: int) -> int | None:
    model = WorkflowModel.from_config(task.config)
    path = tree.path_to(leaf)[1:]
    states = model.path_states([n.action_text for n in path], [n.observation_text for n in path])
    return model.first_irrecoverable_step(states)


def test_bel_finds_the_exact_first_irrecoverable_step() -> None:
    tasks = WorkflowEnv.generate_tasks(80, seed=3, deterministic=True)
    policy = workflow_policy(tasks, bias=1.0)
    sampler = BelSampler(BelConfig(b_max=None, x_min=8, x_max=8, n_initial=4))
    env = make_env("workflow")
    hits = searched = 0
    for i, task in enumerate(tasks):
        tree = sampler.sample_tree(env, policy, task, 4 + 4 * 8, seed=i)
        info = tree.meta["bel"] if tree.meta else {}
        if not info.get("n_failed"):
            assert tree.critical_node_id is None
            continue
        searched += 1
        k = info["k"]
        assert len(info["probes"]) <= math.ceil(math.log2(k)) + 1
        assert info["converged"]
        assert tree.critical_node_id is not None
        critical = tree.path_to(tree.critical_node_id)  # root .. step t_crit of tau*
        assert critical[-1].node_id == tree.path_to(info["trajectory_leaf"])[len(critical) - 1] \
            .node_id
        hits += _truth(task, tree, info["trajectory_leaf"]) == len(critical) - 1
        for probe in info["probes"]:  # suffixes hang below the anchor, beside step m+1
            kids = tree.children()[probe["anchor_node"]]
            assert sum(tree.node(c).phase == "probe" for c in kids) == probe["x"]
    assert searched >= 60
    assert hits >= 0.95 * searched, (hits, searched)


def test_bel_defaults_follow_the_algorithm() -> None:
    config = BelConfig()
    assert (config.b_max, config.x_min, config.x_max, config.beta) == (3, 1, 3, 5.0)
    assert config.initial_rollouts(16) == 7
    assert config.suffix_count(2.0, 0.0) == 3 and config.suffix_count(-2.0, 0.0) == 1
    assert config.suffix_count(0.0, 0.0) == 2  # X_min + (X_max - X_min) / 2, rounded half up
    tasks = WorkflowEnv.generate_tasks(20, seed=11)
    policy = workflow_policy(tasks)
    for i, task in enumerate(tasks):
        tree = BelSampler().sample_tree(make_env("workflow"), policy, task, 16, seed=i)
        info = tree.meta["bel"] if tree.meta else {}
        if "probes" in info:
            assert len(info["probes"]) <= 3 and tree.critical_node_id is not None
            t_crit = len(tree.path_to(tree.critical_node_id)) - 1
            assert t_crit == info["t_crit"] and 1 <= t_crit <= info["k"]


# ----------------------------------------------------------------- restore, never replay
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_branches_restore_the_parent_snapshot_and_never_replay(name: str) -> None:
    env = SpyWorkflowEnv()
    policy = Recording(workflow_policy(WF_TASKS))
    task = WF_TASKS[3]
    tree = make_sampler(name).sample_tree(env, policy, task, 16, seed=3, tree_id="spy")
    log = env.log
    assert [e for e in log if e[0] == "reset"] == [("reset", task.task_id)]
    steps = [e for e in log if e[0] == "step"]
    assert len(steps) == len(tree.nodes) - 1  # one env step per step node: no replay
    # each rollout starts with a restore of its start node's snapshot, then a reseed
    by_id = {n.node_id: n for n in tree.nodes}
    stored = set(tree.snapshots.values())
    assert all(state in stored for kind, state in log if kind == "restore")
    reseeds = [i for i, e in enumerate(log) if e[0] == "reseed"]
    assert len(reseeds) == 16 == len(tree.leaves())
    for i in reseeds:
        assert log[i - 1][0] == "restore"
    # a node's first step after a restore starts from that restored state, byte for byte
    step_nodes = iter(n for n in tree.nodes if n.parent_id is not None)
    current: bytes | None = None
    for kind, payload in log:
        if kind == "restore":
            current = payload
        elif kind == "step":
            node = next(step_nodes)
            parent = by_id[node.parent_id]  # type: ignore[index]
            assert payload == node.action_text
            assert current is not None
            assert WorkflowEnv.snapshot_state(current) == \
                WorkflowEnv.snapshot_state(tree.snapshots[parent.snapshot_id])  # type: ignore[index]
            current = tree.snapshots[node.snapshot_id]  # type: ignore[index]
    # the policy only ever saw transcripts of the tree's own paths (the prefix, never redone)
    paths = set()
    for node in tree.nodes:
        turns: list[tuple[str, str]] = [("prompt", task.prompt)]
        for step in tree.path_to(node.node_id)[1:]:
            turns += [("action", step.action_text), ("observation", step.observation_text)]
        paths.add(tuple(turns))
    assert {t for t in policy.seen if t[0][1] == task.prompt} <= paths


def test_restore_without_reseed_is_byte_identical_on_calc() -> None:
    """calc has no reseed hook: restoring a parent's snapshot into a fresh env and taking
    the child's action gives the child's observation and snapshot byte for byte."""
    tasks = CalcEnv.generate_tasks(6, seed=2)
    for i, task in enumerate(tasks):
        tree = make_sampler("random").sample_tree(make_env("calc"), NoisyCalcPolicy(), task, 12,
                                                  seed=i)
        tree.validate()
        by_id = {n.node_id: n for n in tree.nodes}
        for node in tree.nodes:
            if node.parent_id is None:
                continue
            fresh = make_env("calc")
            fresh.restore(tree.snapshots[by_id[node.parent_id].snapshot_id])  # type: ignore[index]
            result = fresh.step(node.action_text)
            assert result.observation == node.observation_text
            assert fresh.snapshot() == tree.snapshots[node.snapshot_id]  # type: ignore[index]


def test_reseed_gives_sibling_rollouts_fresh_outcomes() -> None:
    """Stochastic workflow: without ``reseed`` every rollout from the root would draw the
    same outcome for the same first action; with it the outcomes vary."""
    task = next(t for t in WF_TASKS if 0.65 < WorkflowModel.from_config(t.config)
                .spec.stages[0].p_fast < 0.9)
    tree = sample("group", task, 64, seed=1)
    outcomes = {n.observation_text.split("\n")[0] for n in tree.nodes
                if n.parent_id == 0 and n.action_text == ACTION_TEXTS["fast"]}
    assert len(outcomes) == 2


# ----------------------------------------------------------------- node contents
def test_node_contents_on_calc() -> None:
    task = CalcEnv.generate_tasks(1, seed=4)[0]
    tree = make_sampler("group").sample_tree(make_env("calc"), NoisyCalcPolicy(), task, 8, seed=0)
    tree.validate()
    for node in tree.nodes:
        if node.parent_id is None:
            continue
        assert node.action_token_ids == [ord(c) for c in node.action_text]
        assert len(node.action_logprobs) == len(node.action_entropies) == node.n_gen_tokens
        assert node.snapshot_id in tree.snapshots
        parent = tree.node(node.parent_id)
        expect = "feedback_response" if "<tool_response>" in parent.observation_text \
            and parent.parent_id is not None else "decision"
        assert node.kind == expect
        assert node.tool_calls == int(node.action_text.startswith("<tool_call>"))
        covered = sum(s.end - s.start for s in node.segments)
        assert covered == len(node.action_token_ids)
        for seg in node.segments:
            piece = node.action_text[seg.start:seg.end]
            if seg.kind == "tool_call":
                assert piece.startswith("<tool_call>") and piece.endswith("</tool_call>")
            elif seg.kind == "answer":
                assert piece.startswith("<answer>") and piece.endswith("</answer>")
            else:
                assert seg.kind == "summary" and "<" not in piece
        if node.reward is not None:
            assert node.reward == node.reward_parts["reward"]
            assert node.terminal or (node.meta or {}).get("truncated")
    assert any(n.kind == "feedback_response" for n in tree.nodes)


@pytest.mark.slow  # importing torch and transformers alone takes 3-6 s here
def test_with_an_untrained_tiny_hf_model() -> None:
    """The real backend: multi-token steps, token-aligned segments, observation tokens."""
    tiny = pytest.importorskip("train.policies.tiny")
    hf = pytest.importorskip("train.policies.hf")
    tok = tiny.build_tokenizer()
    policy = hf.HFPolicy(tiny.init_model(tok), tok)
    task = CalcEnv.generate_tasks(1, seed=0)[0]
    texts = policy.token_texts()
    for name in ("bel",):  # explore, probes and fill in one tree
        tree = make_sampler(name, max_new_tokens=6).sample_tree(make_env("calc"), policy, task,
                                                                4, seed=0)
        tree.validate()
        assert sum(tree.rollouts_by_phase.values()) == 4 == len(tree.leaves())
        for node in tree.nodes[1:]:
            assert node.observation_token_ids == policy.encode(node.observation_text)
            pos = 0
            for seg in node.segments:  # segment borders fall on the tokens' text borders
                piece = "".join(texts[i] for i in node.action_token_ids[seg.start:seg.end])
                assert node.action_text[pos:].startswith(piece) or seg.end == len(
                    node.action_token_ids)
                pos += len(piece)


def test_action_segments() -> None:
    text = 'think <tool_call>{"a": 1}</tool_call> more'
    segs = action_segments(text, list(range(len(text))))
    assert segs == [Segment("text", 0, 6), Segment("tool_call", 6, 37),
                    Segment("text", 37, len(text))]
    text = "So: <answer>4</answer>"
    assert action_segments(text, list(range(len(text)))) == [
        Segment("summary", 0, 4), Segment("answer", 4, len(text))]
    # coarse tokens: a token belongs to the span holding its first character
    assert action_segments(text, [0, 4, 12]) == [Segment("summary", 0, 1),
                                                 Segment("answer", 1, 3)]
    assert action_segments("", []) == []


# ----------------------------------------------------------------- entropy and CALIPER
def test_entropy_sampler_branches_where_entropy_rises() -> None:
    # a peaked first step (low H_root), uniform afterwards: feedback steps exceed H_root
    policy = workflow_policy(WF_TASKS, root_bias=3.0)
    tree = EntropySampler().sample_tree(make_env("workflow"), policy, WF_TASKS[4], 16, seed=0)
    tree.validate()
    assert tree.rollouts_by_phase.get("branch", 0) > 0
    kids = tree.children()
    for trig in tree.meta["entropy"]["branches"]:  # type: ignore[index]
        node = tree.node(trig["node"])
        assert node.kind == "feedback_response" and trig["delta_h"] > 0
        siblings = [tree.node(c) for c in kids[node.parent_id]]  # type: ignore[index]
        assert any(s.phase == "branch" for s in siblings)


def test_caliper_trees_are_what_the_credit_estimator_reads() -> None:
    sampler = CaliperSampler()
    env = make_env("workflow")
    trees = [sampler.sample_tree(env, WF_POLICY, task, 16, seed=i, tree_id=f"c{i}")
             for i, task in enumerate(WF_TASKS)]
    batch = from_trees(trees, caliper_extras(trees))
    groups = caliper_groups(batch, CaliperParams())
    row = {(batch.tree_ids[int(batch.node_tree[r])], int(batch.node_ids[r])): r
           for r in range(batch.n_nodes)}
    n_positions = 0
    for tree in trees:
        for pos in tree.meta["caliper"]["positions"]:  # type: ignore[index]
            n_positions += 1
            y0 = row[(tree.tree_id, pos["node"])]
            member = np.flatnonzero(groups.member == y0)
            assert member.size == 1 and groups.is_y0[member[0]]
            assert groups.k[member[0]] == pos["k"]
            assert groups.ret[member[0]] == 0.0  # y_0 is a failed rollout
            assert tree.node(pos["node"]).phase == "explore"
    assert n_positions > 0
    total = sum(s + f for s, f in sampler.state.counts.values())
    assert total == sum(t.rollouts_by_phase.get("local", 0) for t in trees)
    assert CaliperState.from_dict(sampler.state.to_dict()) == sampler.state


# ----------------------------------------------------------------- store and collection
def test_trees_round_trip_through_a_store(store: Store) -> None:
    trees = [sample(name, WF_TASKS[i], 10, seed=i) for i, name in enumerate(sorted(SAMPLERS))]
    store.append_trees(trees, key="roundtrip")
    back = {t.tree_id: t for t in read_trees(store)}
    for tree in trees:
        got = back[tree.tree_id]
        assert got.rollouts_by_phase == tree.rollouts_by_phase
        assert (got.critical_node_id, got.sampler, got.budget, got.seed) == \
            (tree.critical_node_id, tree.sampler, tree.budget, tree.seed)
        assert got.snapshots == tree.snapshots
        assert got.meta == tree.meta
        mine = sorted(tree.nodes, key=lambda n: n.node_id)
        for a, b in zip(mine, got.nodes, strict=True):
            assert (a.node_id, a.parent_id, a.kind, a.phase, a.action_text, a.action_token_ids,
                    a.observation_text, a.segments, a.reward, a.reward_parts, a.snapshot_id,
                    a.terminal, a.meta) == \
                   (b.node_id, b.parent_id, b.kind, b.phase, b.action_text, b.action_token_ids,
                    b.observation_text, b.segments, b.reward, b.reward_parts, b.snapshot_id,
                    b.terminal, b.meta)
            # stored at 12 mantissa bits (rollout_store/precision.py): relative error <= 2^-13
            np.testing.assert_allclose(b.action_logprobs, a.action_logprobs, rtol=2.0**-13)


def _nodes_by_tree(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    return {t.tree_id: [(n.node_id, n.action_text, n.observation_text) for n in t.nodes]
            for t in read_trees(store)}


def test_collect_is_idempotent_and_resumes(tmp_path: Path) -> None:
    tasks = WF_TASKS[:7]
    full = Store(tmp_path / "full", create=True)
    report = collect(full, "workflow", WF_POLICY, "bel", tasks, 8, seed=1, run_id="r",
                     commit_trees=3, progress=False)
    assert (report.trees, report.commits, report.skipped) == (7, 3, 0)
    assert report.rollouts == 56 == sum(report.by_phase.values())
    assert stored_tree_ids(full, "r") == {tree_id_for("r", 1, t.task_id) for t in tasks}
    again = collect(full, "workflow", WF_POLICY, "bel", tasks, 8, seed=1, run_id="r",
                    commit_trees=3, progress=False)
    assert (again.trees, again.commits, again.skipped) == (0, 0, 7)
    assert len(read_trees(full)) == 7

    # "interrupted": a subset first, then the whole set; same trees as one full run
    part = Store(tmp_path / "part", create=True)
    collect(part, "workflow", WF_POLICY, "bel", tasks[:4], 8, seed=1, run_id="r",
            commit_trees=3, progress=False)
    first = _nodes_by_tree(part)
    rest = collect(part, "workflow", WF_POLICY, "bel", tasks, 8, seed=1, run_id="r",
                   commit_trees=3, progress=False)
    assert (rest.trees, rest.skipped) == (3, 4)
    resumed = _nodes_by_tree(part)
    assert {k: resumed[k] for k in first} == first  # committed trees kept as they were
    assert resumed == _nodes_by_tree(full)  # tree content does not depend on chunking

    # another seed or run id is another set of trees
    other = collect(full, "workflow", WF_POLICY, "bel", tasks[:2], 8, seed=2, run_id="r",
                    progress=False)
    assert other.trees == 2


def test_crash_mid_collection_keeps_committed_trees(tmp_path: Path) -> None:
    # the engine advances the trees of a wave together (4 here): crash in a later wave
    counting = Recording(WF_POLICY)
    collect(Store(tmp_path / "count", create=True), "workflow", counting, "group", WF_TASKS,
            4, seed=0, run_id="x", commit_trees=2, progress=False, wave=4)
    limit = int(0.6 * len(counting.seen))

    class Crashing(Recording):
        def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
                   ) -> list[list[Continuation]]:
            if len(self.seen) > limit:
                raise KeyboardInterrupt
            return super().sample(transcripts, config)

    store = Store(tmp_path / "s", create=True)
    with pytest.raises(KeyboardInterrupt):
        collect(store, "workflow", Crashing(WF_POLICY), "group", WF_TASKS, 4, seed=0,
                run_id="x", commit_trees=2, progress=False, wave=4)
    kept = stored_tree_ids(store, "x")
    assert kept and len(kept) % 2 == 0 and len(kept) < len(WF_TASKS)
    report = collect(store, "workflow", WF_POLICY, "group", WF_TASKS, 4, seed=0, run_id="x",
                     commit_trees=2, progress=False)
    assert report.skipped == len(kept)
    assert stored_tree_ids(store, "x") == {tree_id_for("x", 0, t.task_id) for t in WF_TASKS}


def test_commit_keys_are_deterministic() -> None:
    a = commit_key("r", 0, ["t1", "t2"])
    assert a == commit_key("r", 0, ["t2", "t1"])
    assert a != commit_key("r", 1, ["t1", "t2"]) and a != commit_key("r", 0, ["t1"])


def test_make_sampler_options() -> None:
    sampler = make_sampler("bel", b_max="none", x_max="4", beta="2.5")
    assert isinstance(sampler.config, BelConfig)
    assert (sampler.config.b_max, sampler.config.x_max, sampler.config.beta) == (None, 4, 2.5)
    with pytest.raises(ValueError, match="no options"):
        make_sampler("group", beta=1)
    with pytest.raises(ValueError, match="unknown sampler"):
        make_sampler("nope")
    with pytest.raises(ValueError, match="x_min <= x_max"):
        make_sampler("bel", x_min=4, x_max=2)
    with pytest.raises(TypeError):
        BelSampler(SamplerConfig())


def test_cli_collect_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["collect", "--store", str(tmp_path / "s"), "--env", "workflow",
                                 "--policy", "tabular", "--sampler", "nope", "--tasks", "2",
                                 "--no-progress"])
    assert result.exit_code == 1 and "unknown sampler" in result.output
    result = runner.invoke(app, ["collect", "--store", str(tmp_path / "s"), "--env", "workflow",
                                 "--policy", "tabular", "--sampler", "bel", "--param", "b_max"])
    assert result.exit_code == 1 and "KEY=VALUE" in result.output


def _load_policy_or_skip() -> Any:
    try:
        from train.policies import load_policy  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        pytest.skip("train.policies.load_policy has not landed yet")
    return load_policy


def test_cli_collect_with_a_registered_policy(tmp_path: Path) -> None:
    _load_policy_or_skip()
    runner = CliRunner()
    args = ["collect", "--store", str(tmp_path / "s"), "--env", "workflow", "--policy",
            "tabular", "--sampler", "bel", "--tasks", "4", "--n-total", "8", "--seed", "0",
            "--run-id", "cli", "--no-progress"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "4 trees committed" in result.output
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "0 trees committed" in result.output


@pytest.mark.slow
def test_collect_with_worker_processes(tmp_path: Path) -> None:
    tasks = WF_TASKS[:6]
    one = Store(tmp_path / "one", create=True)
    two = Store(tmp_path / "two", create=True)
    collect(one, "workflow", uniform_factory, "random", tasks, 6, seed=0, run_id="w",
            commit_trees=2, progress=False)
    report = collect(two, "workflow", uniform_factory, "random", tasks, 6, seed=0, run_id="w",
                     workers=2, commit_trees=2, progress=False)
    assert (report.trees, report.commits) == (6, 3)
    assert _nodes_by_tree(one) == _nodes_by_tree(two)


# ----------------------------------------------------------------- the continuation primitive
def _stochastic_task(seed: int = 3) -> Task:
    tasks = WorkflowEnv.generate_tasks(8, seed=seed, deterministic=False)
    return max(tasks, key=lambda t: t.max_steps)


def test_continuing_restores_reseeds_and_cuts_at_the_limit() -> None:
    from train.sampling.continuation import Continuing

    env = WorkflowEnv()
    task = _stochastic_task()
    prompt = env.reset(task)
    start = env.snapshot()
    fast = ACTION_TEXTS["fast"]

    def run(key: int, limit: int) -> Continuing:
        c = Continuing.begin(env, start, key, [("prompt", prompt)], depth=1, max_steps=limit)
        while not c.over:
            c.step(fast if "fast" in env.valid_actions() else env.valid_actions()[0])
        return c

    a, b = run(7, 3), run(7, 3)
    assert a.turns == b.turns  # same key: same outcome stream after the restore
    assert a.steps == len(a.turns[1:]) // 2 <= 2 and a.depth == 1 + a.steps
    assert a.truncated == (not a.done) and (a.done or a.depth == 3)
    outcomes = {tuple(t for _, t in run(key, 40).turns) for key in range(12)}
    assert len(outcomes) > 1  # other keys: other tool outcomes (stochastic task)
    c = Continuing.begin(env, start, None, max_steps=None)
    assert not c.at_limit and c.reward == 0.0 and env.state == env.model.initial_state()


def test_phase_seeds_share_the_explore_phase() -> None:
    tasks = WorkflowEnv.generate_tasks(4, seed=11, deterministic=False)
    policy = TabularAdapter(tabular_policies(tasks))
    sampler = BelSampler(BelConfig(b_max=None, x_min=2, x_max=2, n_initial=6))
    env = WorkflowEnv()
    for task in tasks:
        plain = sampler.sample_tree(env, policy, task, 14, seed=5)
        same = sampler.sample_tree(env, policy, task, 14, seed=5, phase_seeds={})
        assert [n.action_text for n in plain.nodes] == [n.action_text for n in same.nodes]
        trees = [sampler.sample_tree(env, policy, task, 14, seed=5,
                                     phase_seeds={"probe": p, "fill": p}) for p in (1, 2)]
        explore = [[(n.node_id, n.action_text, n.observation_text) for n in t.nodes
                    if n.phase == "explore"] for t in (plain, *trees)]
        assert explore[0] == explore[1] == explore[2]  # one explore phase for all
        assert all(t.seed == 5 for t in trees)


def _refresh_of(tree: Tree, env: Any, policy: Any, *, seed: int = 1, max_rows: int = 128,
                cap: int = 40) -> Any:
    """``refresh_program`` on the root comparison of ``tree`` (flat priors) in an engine."""
    from functools import partial

    from train.sampling.engine import Engine
    from train.sampling.refresh import Site, refresh_program

    root = tree.root().node_id
    children = tuple(tree.children()[root])
    site = Site(root, children, tuple((0.5, 0.05, 4.0) for _ in children))
    return Engine(policy, max_rows=max_rows).run([partial(
        refresh_program, tree, [site], env, policy, config=SamplerConfig(), seed=seed,
        tree_id="fresh", run_id="r", cap=cap)])[0]


def test_refresh_program_forces_the_route_and_is_reproducible() -> None:
    """Every draw starts with a stored root child's action, forced with its tokens and
    logprobs; the protocol observes the draws in order (counts, cost); the same seed
    gives the same tree whatever the row budget."""
    task = _stochastic_task(5)
    policy = TabularAdapter(tabular_policies([task]))
    stored = make_sampler("group").sample_tree(WorkflowEnv(), policy, task, 4, seed=3,
                                               tree_id="s")
    out = _refresh_of(stored, WorkflowEnv, policy)
    again = _refresh_of(stored, WorkflowEnv, policy, max_rows=1)
    tree, other = out.builder.finish(), again.builder.finish()
    assert [(n.action_text, n.observation_text, n.reward) for n in tree.nodes] == [
        (n.action_text, n.observation_text, n.reward) for n in other.nodes]
    draws = out.draws[0]
    assert draws and out.results[0].n_new.sum() <= len(draws)
    assert {d.first for d in draws} == set(tree.children()[0])
    for d in draws:
        first = tree.node(d.first)
        stored_child = stored.node(stored.children()[0][d.route])
        assert (first.action_text, first.action_token_ids, first.action_logprobs) == (
            stored_child.action_text, stored_child.action_token_ids,
            stored_child.action_logprobs)
    assert out.steps == sum(n.tool_calls or 0 for n in tree.nodes)
    assert out.results[0].steps <= out.steps
    assert tree.rollouts_by_phase == {"refresh": len(draws)}


class _ProgressWorkflow(WorkflowEnv):
    """The workflow with a progress reward on every step (``reward`` 0.25 until the end),
    so a leaf cut by the step limit has a non-zero ``reward_parts["reward"]``."""

    def step(self, action: str) -> Any:
        result = super().step(action)
        if result.done:
            return result
        return type(result)(result.observation, False, {**result.reward_parts, "reward": 0.25})


def test_a_refreshed_truncated_leaf_has_the_reward_tree_builder_gives() -> None:
    """Stored tree and refresh share ``TreeBuilder``'s leaf rule: a leaf cut by the step
    limit keeps its last step's ``reward_parts["reward"]`` (the refresh's own builder
    used to write 0 there); the protocol observes that same reward."""
    task = replace(_stochastic_task(5), max_steps=2)
    policy = TabularAdapter(tabular_policies([task]))
    stored = make_sampler("group").sample_tree(_ProgressWorkflow(), policy, task, 4, seed=3,
                                               tree_id="s")
    cut = [n for n in stored.nodes if (n.meta or {}).get("truncated")]
    assert cut and all(n.reward == 0.25 for n in cut)
    out = _refresh_of(stored, _ProgressWorkflow, policy)
    tree = out.builder.finish()
    leaves = [n for n in tree.nodes if n.reward is not None]
    refreshed_cut = [n for n in leaves if (n.meta or {}).get("truncated")]
    assert refreshed_cut
    for n in refreshed_cut:
        assert n.reward == n.reward_parts["reward"] == 0.25 and not n.terminal
    by_leaf = {d.leaf: d.reward for d in out.draws[0]}
    assert by_leaf and all(by_leaf[n.node_id] == n.reward for n in leaves)


def test_a_site_the_cap_leaves_undrawn_leaves_no_empty_copy() -> None:
    """A refresh of several comparisons whose tool-step cap runs out before the last site
    draws commits a valid tree: a site's stored path is copied only when it draws (the
    grafted copy of an undrawn site used to stay a leaf without a reward, and the store
    refused the whole refresh step)."""
    from functools import partial

    from train.sampling.engine import Engine
    from train.sampling.refresh import Site, refresh_program

    task = _stochastic_task(5)
    policy = TabularAdapter(tabular_policies([task]))
    stored = make_sampler("rooted", n_root=2).sample_tree(WorkflowEnv(), policy, task, 12,
                                                         seed=3, tree_id="s")
    kids = stored.children()
    sites = [Site(v, tuple(kids[v]), tuple((0.5, 0.05, 4.0) for _ in kids[v]))
             for v in (stored.root().node_id, *kids[stored.root().node_id]) if len(kids[v]) > 1]
    assert len(sites) == 3
    out = Engine(policy).run([partial(
        refresh_program, stored, sites, WorkflowEnv, policy, config=SamplerConfig(), seed=1,
        tree_id="fresh", run_id="r", cap=3)])[0]
    assert any(out.draws) and not all(out.draws)  # the cap stopped some site from drawing
    tree = out.builder.finish()
    tree.validate()
    assert all(n.reward is not None for n in tree.nodes if not tree.children()[n.node_id])


def test_bel_takes_the_first_of_gaps_tied_up_to_float_noise() -> None:
    """E1's argmax: trajectories with the same tokens have gaps that differ only in the
    last bits of the batch they were decoded in; the first of them is tau*, whatever
    the noise, and a real maximum still wins."""
    from train.sampling.bel import GAP_TIE, first_maximum

    assert first_maximum([0.3, 0.5, 0.5 + 1e-7, 0.1]) == 1
    assert first_maximum([0.3, 0.5 + 1e-7, 0.5, 0.1]) == 1
    assert first_maximum([0.3, 0.5, 0.5 + 10 * GAP_TIE]) == 2
    assert first_maximum([-1.0]) == 0
