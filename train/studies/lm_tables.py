"""A language-model policy read as a ``workflow`` observable-state policy (docs/METHODS.md
section 8.3, LM1-LM3: the gate study's real-update variant).

Exact values on ``workflow`` need a policy that is a function of the observable state
s = (stage, t, broken) (``train.envs.workflow_model.PolicyValues``). A language model
conditions on its whole transcript, so it is *read* as such a policy [R]: per observable
state s of a task, the model is scored on one canonical transcript that reaches s, and

    pi_LM(a | s) = p(a | h(s)) / sum_b p(b | h(s)),      a, b valid tools of s     (LM1)

where p(a | h) = prod_k p(a_k | h, a_<k) is the probability of the canonical action
string of a (its tokens, ``policy.encode``) after the rendered transcript h. The mass
1 - sum_b p(b | h(s)) (malformed or non-canonical text) is reported per state, not
modelled (``residual``). The canonical history h(s) of s = (k, t, b) [R]:

    careful succeeds on stages 0 .. k-1, then careful fails t - k - b times on stage k,
    then (b = 1) fast fails on stage k (the stage breaks),                       (LM2)

each step rendered exactly as ``WorkflowEnv.step`` renders it (``model.render_step``),
after the task's prompt (``WorkflowEnv.reset``). Every reachable observable state has
t >= k + b, so (LM2) always exists; the histories of one task form a tree (a state's
history extends that of (k, t-1, 0) or (k-1, t-1, 0)), which is scored in one pass in
the trainer's tree layout (``train.reuse.score.score_actions``: shared prefixes are
computed once), with one candidate child per valid tool under each state's node.

How far the real model, which sees its true history, is from (LM1) is measured, not
assumed: ``outcome_starts`` gives, per task, one start per (forced root tool, outcome),
and the study runs K rollouts of the real model from each (the Mean@K references'
``run_references``, through the engine), so that

    Q_MC(s0, a) = sum_o P(o | s0, a) * successes_o / K                        (LM3)

(P(o | s0, a) the known outcome probability of the forced tool) is compared with the
exact Q of (LM1) at the root.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rollout_store import Node, Tree
from train.envs.base import Task
from train.envs.workflow import WorkflowEnv
from train.envs.workflow_model import ACTION_TEXTS, ObsKey, State, Tool, WorkflowModel
from train.envs.workflow_policy import TabularPolicy
from train.policies.base import Policy, Turn
from train.reuse.score import score_actions
from train.sampling.continuation import NodeStart
from train.sequences import build_sequences
from train.studies.workflow_study import observable_keys

TREES_PER_PASS = 16
"""Canonical-history trees scored together (``score_actions`` micro-batches them)."""
MICRO_TOKENS = 16_384


class LMTableError(ValueError):
    """A policy that cannot be read as a workflow policy (no model or tokenizer), or a
    state whose canonical history does not reach it."""


@dataclass
class LMTable:
    """One task's reading of a language model (LM1): the tabular policy, and per state
    the probability mass the model puts outside the valid canonical action strings."""

    policy: TabularPolicy
    residual: dict[ObsKey, float] = field(default_factory=dict)

    @property
    def mean_residual(self) -> float:
        return float(np.mean(list(self.residual.values()))) if self.residual else 0.0


def canonical_steps(model: WorkflowModel, key: ObsKey) -> list[tuple[Tool, bool]]:
    """(tool, success) of each step of the canonical history (LM2) of ``key``."""
    if key.t < key.stage + int(key.broken):
        raise LMTableError(f"{key} is not reachable: t < stage + broken")
    steps: list[tuple[Tool, bool]] = [("careful", True)] * key.stage
    steps += [("careful", False)] * (key.t - key.stage - int(key.broken))
    if key.broken:
        steps.append(("fast", False))
    return steps


def _advance(model: WorkflowModel, s: State, tool: Tool, success: bool) -> State:
    _, on_success, on_failure = model.outcomes(s, tool)
    return on_success if success else on_failure


def canonical_tree(model: WorkflowModel, prompt: str, encode: Callable[[str], list[int]],
                   tree_id: str) -> tuple[Tree, dict[ObsKey, list[int]]]:
    """The tree of every canonical history (LM2) of the task's reachable observable
    states, with one candidate child per valid tool under each state's node (action tokens
    ``encode(action string)``, zero old logprobs); returns it and, per state, the node ids
    of its candidates in ``model.valid_tools`` order."""
    nodes = [Node(0, None, kind="prompt", observation_text=prompt)]
    at: dict[tuple[tuple[Tool, bool], ...], tuple[int, State]] = {(): (0, model.initial_state())}
    candidates: dict[ObsKey, list[int]] = {}
    tokens = {tool: encode(text) for tool, text in ACTION_TEXTS.items()}

    def add(parent: int, tool: Tool, observation: str) -> int:
        ids = tokens[tool]
        nodes.append(Node(len(nodes), parent, action_text=ACTION_TEXTS[tool],
                          action_token_ids=list(ids), action_logprobs=[0.0] * len(ids),
                          observation_text=observation))
        return len(nodes) - 1

    for key in observable_keys(model):
        path = canonical_steps(model, key)
        for depth in range(1, len(path) + 1):
            if tuple(path[:depth]) in at:
                continue
            parent, s = at[tuple(path[:depth - 1])]
            tool, success = path[depth - 1]
            s2 = _advance(model, s, tool, success)
            node = add(parent, tool, model.render_step(s, tool, None, success, s2))
            at[tuple(path[:depth])] = (node, s2)
        node, s = at[tuple(path)]
        if model.observe(s) != key:
            raise LMTableError(f"the canonical history of {key} reaches {model.observe(s)}")
        candidates[key] = [add(node, tool, "") for tool in model.valid_tools(key)]
    return Tree(tree_id=tree_id, nodes=nodes, env="workflow"), candidates


def lm_tables(policy: Policy, tasks: Sequence[Task],
              models: Sequence[WorkflowModel] | None = None,
              trees_per_pass: int = TREES_PER_PASS,
              micro_tokens: int = MICRO_TOKENS) -> list[LMTable]:
    """(LM1) for every task: one no-grad forward pass of ``policy``'s model over the
    canonical-history trees of ``trees_per_pass`` tasks at a time (shared prefixes once).
    ``models``: the tasks' exact models the tables belong to (default: built from each
    task's config). ``policy`` must have ``model``, ``encode``, ``prompt_ids`` and
    ``pad_id`` (the tiny and hf backends)."""
    needed = ("model", "encode", "prompt_ids", "pad_id")
    missing = [name for name in needed if not hasattr(policy, name)]
    if missing:
        raise LMTableError(f"policy {type(policy).__name__} cannot be read as a workflow "
                           f"policy: it has no {', '.join(missing)} (use a tiny or hf policy)")
    env = WorkflowEnv()
    out: list[LMTable] = []
    for start in range(0, len(tasks), trees_per_pass):
        chunk = tasks[start:start + trees_per_pass]
        built = []
        for j, task in enumerate(chunk, start):
            model = models[j] if models is not None else WorkflowModel.from_config(task.config)
            tree, cand = canonical_tree(model, env.reset(task), policy.encode,  # type: ignore[attr-defined]
                                        f"lm-table/{task.task_id}")
            built.append((model, tree, cand))
        seqs = [build_sequences(tree, policy.prompt_ids)  # type: ignore[attr-defined]
                for _, tree, _ in built]
        logp = score_actions(policy.model, seqs, "tree", micro_tokens,  # type: ignore[attr-defined]
                             policy.pad_id)  # type: ignore[attr-defined]
        for model, tree, cand in built:
            table = LMTable(TabularPolicy(model))
            for key, ids in cand.items():
                lp = np.array([logp[(tree.tree_id, i)].sum() for i in ids])
                table.policy.set_logits(key, lp.tolist())  # softmax renormalises (LM1)
                table.residual[key] = float(max(0.0, 1.0 - np.exp(lp).sum()))
            out.append(table)
    env.close()
    return out


@dataclass(frozen=True)
class OutcomeStart:
    """One (root tool, outcome) of a task for (LM3): P(o | s0, tool) and where the real
    model continues from (the transcript after the step, its snapshot)."""

    tool: Tool
    success: bool
    p: float
    start: NodeStart


def outcome_starts(task: Task, max_tries: int = 200) -> list[OutcomeStart]:
    """The starts of (LM3) for one task, one per (valid root tool, outcome) with positive
    probability. Outcomes are found by reseeding the environment (``reseed(j)``, j = 0, 1,
    ...) until the tool's step gives them; a step that ends the episode is a leaf (its
    reward is the outcome's value)."""
    env = WorkflowEnv()
    prompt = env.reset(task)
    ctx = env.snapshot()
    model = env.model
    s0 = model.initial_state()
    out: list[OutcomeStart] = []
    for tool in model.valid_tools(s0):
        p, on_success, on_failure = model.outcomes(s0, tool)
        for success, prob in ((True, p), (False, 1.0 - p)):
            if prob <= 0.0 or (not success and on_failure == on_success):
                continue
            target = on_success if success else on_failure
            for j in range(max_tries):
                env.restore(ctx)
                env.reseed(j)
                result = env.step(ACTION_TEXTS[tool])
                if env.state == target:
                    break
            else:
                raise LMTableError(f"task {task.task_id}: no {tool} outcome "
                                   f"{'success' if success else 'failure'} in {max_tries} "
                                   "reseeds")
            turns: tuple[Turn, ...] = (("prompt", prompt), ("action", ACTION_TEXTS[tool]),
                                       ("observation", result.observation))
            out.append(OutcomeStart(tool, success, prob, NodeStart(
                task.task_id, len(out) + 1, turns, None if result.done else env.snapshot(),
                1, model.horizon, result.reward_parts["reward"] if result.done else None)))
    env.close()
    return out


__all__ = ["LMTable", "LMTableError", "OutcomeStart", "canonical_steps", "canonical_tree",
           "lm_tables", "outcome_starts"]
