"""Shared setup of the workflow studies (credit drift, gate evaluation, localization).

What the three audits of ``analysis.drift``, ``analysis.gates`` and
``analysis.localization`` share:

* tasks (``WorkflowEnv.generate_tasks``) and their exact models;
* the old policy mu (``base_policy``) and policy updates mu -> pi of
  controlled size (``make_updates``: matched global KL, METHODS.md section 5, L1);
* the *collection* side: trajectories sampled through the real environment
  step API (``rollout``), interventional trees with a forced root action per
  route (``route_tree``), and reading them back from a store
  (``load_route_data``). The one-way data flow (docs/architecture.md)
  keeps analysis off environments; these helpers are the studies' collection jobs
  (they write to the store that the analysis then reads), kept here because a study
  needs its own small collection protocol. They belong in ``train.sampling`` if other
  code needs them.

Choices not fixed by METHODS.md are marked [R] (our reconstruction).

Interventional tree layout (DSC-Gate's three-action setting, section 5)::

    root (kind "prompt"; observation = the context, snapshot "ctx")
     +- route node (depth 1; kind "decision", phase "intervention", no action text,
     |   meta {"forced_action": text}): one per candidate root action a, b, c
     |   +- forced step (depth 2): action text = the forced root action, observation = its
     |   |   tool response; one per trajectory, because the tool outcome differs;
     |   |   every step node: meta {"state": [stage, t, broken]} (where its action was taken)
     |   |   +- downstream steps (depth >= 3) sampled from the route's policy, one chain per
     |   |       trajectory; the last node is terminal and holds the reward
     ...

Depth-1 nodes are the root actions of ``train.credit.dsc``; its "downstream
steps" are the depth >= 2 nodes, and the forced step there gets the ratio 1
(both policies take it with probability 1), so z = 0 and it drops out of the
transport (D3: "the forced root action is excluded").
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from rollout_store import Node, Store, Tree, connect
from rollout_store.schema import NODE_INPUT
from train.credit.base import TreeArrays, from_tables
from train.envs.base import Task
from train.envs.workflow import DEFAULT_HORIZONS, WorkflowEnv
from train.envs.workflow_model import ACTION_TEXTS, ObsKey, State, WorkflowModel
from train.envs.workflow_policy import TabularPolicy
from train.sampling.continuation import Continuing
from train.studies.sensitivity import occupancy

UpdateKind = Literal["ordinary", "branch_selective"]
UPDATE_KINDS: tuple[UpdateKind, ...] = ("ordinary", "branch_selective")
# METHODS.md section 5, L1: "matched-KL updates (targets .15/.35/.60/.85)".
DEFAULT_KL_TARGETS: tuple[float, ...] = (0.15, 0.35, 0.60, 0.85)
CONTEXT_SNAPSHOT = "ctx"


# ----------------------------------------------------------------- tasks and policies
def make_tasks(n: int, seed: int, horizons: Sequence[int] = DEFAULT_HORIZONS,
               deterministic: bool = False) -> list[Task]:
    """``n`` workflow tasks (horizons cycle through ``horizons``; DSC-Gate uses 6/9/12)."""
    return WorkflowEnv.generate_tasks(n, seed, horizons=horizons, deterministic=deterministic)


def task_model(task: Task) -> WorkflowModel:
    """The exact model of a task (its own deterministic flag)."""
    return WorkflowModel.from_config(task.config)


def stream_key(*parts: object) -> int:
    """A 63-bit seed from any printable parts (for ``env.reseed`` and ``random.Random``).

    The studies' key of a trajectory (blake2b of ``repr(parts)``). It differs from
    ``train.sampling.base.mix_seed`` only in the hash; it is kept so that every study
    reproduces its archived numbers (moving to ``mix_seed`` would redraw them all)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def config_hash(config: Any, fields: Sequence[str] | None = None) -> str:
    """8 hex digits identifying a frozen config dataclass (or the given fields of it)."""
    data = asdict(config)
    if fields is not None:
        data = {k: data[k] for k in fields}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()
                          ).hexdigest()[:8]


def key_to_json(key: ObsKey) -> list[int]:
    """An observable state as data (``[stage, t, broken]``, the node meta ``state``)."""
    return [int(key.stage), int(key.t), int(key.broken)]


def key_from_json(data: Sequence[int]) -> ObsKey:
    """The inverse of ``key_to_json``."""
    stage, t, broken = data
    return ObsKey(int(stage), int(t), bool(broken))


def visible_state(key: ObsKey) -> State:
    """The state an observable key shows, with the hidden flags off."""
    return State(key.stage, key.t, key.broken)


def observable_keys(model: WorkflowModel) -> list[ObsKey]:
    """Observable keys of the non-terminal states reachable from the initial state, sorted."""
    return sorted({model.observe(s) for s in model.reachable_states()
                   if not model.is_terminal(s)})


def base_policy(model: WorkflowModel, rng: np.random.Generator, beta: float = 3.0,
                noise: float = 0.5) -> TabularPolicy:
    """The old policy mu [R]: logits = beta * Q*(s, u) + noise * N(0, 1) per observable state.

    The paper's base policy is an LM (SmolLM2-360M, section 5 L1); here mu is a
    mediocre softmax policy that prefers good actions without being optimal, so
    updates can still change credit. Q* is evaluated on the visible state (hidden
    flags off: in a corrupt state every action has Q* = 0 anyway).
    """
    optimal = model.optimal_values()
    policy = TabularPolicy(model)
    for key in observable_keys(model):
        s = visible_state(key)
        policy.set_logits(key, [beta * optimal.q(s, tool) + noise * float(rng.normal())
                                for tool in model.valid_tools(key)])
    return policy


def policy_to_json(policy: TabularPolicy) -> dict[str, dict[str, float]]:
    """The non-default logits keyed ``"stage,t,broken"``."""
    return {f"{k.stage},{k.t},{int(k.broken)}": {str(a): v for a, v in row.items()}
            for k, row in sorted(policy.state_dict().items())}


def policy_from_json(model: WorkflowModel, data: Mapping[str, Mapping[str, float]]
                     ) -> TabularPolicy:
    policy = TabularPolicy(model)
    for text, row in data.items():
        stage, t, broken = (int(x) for x in text.split(","))
        policy.set_logits(ObsKey(stage, t, bool(broken)), dict(row))
    return policy


# ----------------------------------------------------------------- updates mu -> pi
Direction = dict[ObsKey, list[float]]


@dataclass
class Update:
    """One update mu -> pi: its kind, matched-KL target, step size and achieved KL.

    ``kl`` is the exact global KL(P_mu || P_pi) (``UpdateAnalysis.global_kl``);
    it falls short of ``kl_target`` only when the direction cannot reach it
    (``eta`` then sits at the search's upper end).
    """

    kind: str
    """An ``UpdateKind``, or the label of a language-model checkpoint (``pi1``, ...: the
    gate study's real-update variant, docs/METHODS.md 8.3, LM1-LM3)."""
    kl_target: float
    eta: float
    kl: float
    policy: TabularPolicy = field(repr=False)
    branch_action: str | None = None


def runner_up_action(model: WorkflowModel, mu: TabularPolicy, s: State | None = None) -> str:
    """The valid action of ``s`` (default: the initial state) with the second-highest Q_mu."""
    s = model.initial_state() if s is None else s
    q = mu.values().q_values(s)
    ranked = sorted(q, key=lambda a: (-q[a], model.valid_actions(s).index(a)))
    return ranked[1] if len(ranked) > 1 else ranked[0]


def update_direction(model: WorkflowModel, mu: TabularPolicy, kind: UpdateKind,
                     rng: np.random.Generator, noise_frac: float = 0.5,
                     branch_action: str | None = None) -> Direction:
    """A logit direction per observable state [R].

    ``ordinary``: a natural policy-gradient step direction A_mu(s, u) = Q_mu(s, u) -
    V_mu(s) (visible state), scaled to unit RMS over all (state, action) entries,
    plus ``noise_frac`` * N(0, 1) per entry (real updates are noisy).
    ``branch_selective``: the same direction multiplied per state by how
    selectively the branch of ``branch_action`` (default: the runner-up root
    action, so the update can reverse the root ranking) visits it:
    w(s) = clip((d_x(s) - max_{y != x} d_y(s)) / d_x(s), 0, 1), d_x the occupancy
    after root action x under mu (summed over states with the same observable key).
    This concentrates the change where branch sensitivity |G| is large (D2).
    """
    values = mu.values()
    keys = observable_keys(model)
    pg = {k: [values.q(visible_state(k), tool) - values.v(visible_state(k))
              for tool in model.valid_tools(k)] for k in keys}
    rms = math.sqrt(float(np.mean([a * a for row in pg.values() for a in row])) or 1.0)
    direction = {k: [a / rms + noise_frac * float(rng.normal()) for a in row]
                 for k, row in pg.items()}
    if kind == "ordinary":
        return direction
    if kind != "branch_selective":
        raise ValueError(f"unknown update kind {kind!r}; one of {UPDATE_KINDS}")
    s0 = model.initial_state()
    x = branch_action or runner_up_action(model, mu)
    by_action: dict[str, dict[ObsKey, float]] = {}
    for a in model.valid_actions(s0):
        occ: dict[ObsKey, float] = {}
        for s, d in occupancy(model, mu, s0, a).items():
            if not model.is_terminal(s):
                occ[model.observe(s)] = occ.get(model.observe(s), 0.0) + d
        by_action[a] = occ
    out: Direction = {}
    for k, row in direction.items():
        d_x = by_action[x].get(k, 0.0)
        d_other = max((by_action[y].get(k, 0.0) for y in by_action if y != x), default=0.0)
        w = min(1.0, max(0.0, (d_x - d_other) / d_x)) if d_x > 0.0 else 0.0
        out[k] = [w * v for v in row]
    return out


def apply_update(mu: TabularPolicy, direction: Direction, eta: float) -> TabularPolicy:
    """pi = mu with logits[s] += eta * direction[s]."""
    pi = mu.copy()
    for key, row in direction.items():
        pi.set_logits(key, [lg + eta * d for lg, d in zip(mu.logits(key), row, strict=True)])
    return pi


def matched_update(model: WorkflowModel, mu: TabularPolicy, direction: Direction,
                   kl_target: float, kind: UpdateKind, eta_max: float = 200.0,
                   iterations: int = 60, kl_tol: float = 1e-3,
                   branch_action: str | None = None) -> Update:
    """The step size eta along ``direction`` whose global KL(P_mu || P_pi) is ``kl_target``
    within a relative ``kl_tol`` (bisection on eta; the KL grows with eta along a fixed
    direction in practice)."""
    if kl_target <= 0.0:
        return Update(kind, kl_target, 0.0, 0.0, mu.copy(), branch_action)
    # d_mu is fixed along the search, so KL(P_mu || P_pi) = sum_s d_mu(s) KL_s is a
    # weighted sum over observable keys: one occupancy pass, then numpy per eta.
    weight: dict[ObsKey, float] = {}
    for s, d in occupancy(model, mu).items():
        if not model.is_terminal(s):
            weight[model.observe(s)] = weight.get(model.observe(s), 0.0) + d
    keys = [k for k in direction if weight.get(k, 0.0) > 0.0]
    width = 3
    w = np.array([weight[k] for k in keys])
    base = np.full((len(keys), width), -np.inf)
    step = np.zeros((len(keys), width))
    for i, k in enumerate(keys):
        row = mu.logits(k)
        base[i, :len(row)] = row
        step[i, :len(row)] = direction[k]
    valid = np.isfinite(base)
    log_mu = base - np.logaddexp.reduce(base, axis=1, keepdims=True)
    p_mu = np.where(valid, np.exp(log_mu), 0.0)
    log_mu = np.where(valid, log_mu, 0.0)

    def kl_at(eta: float) -> float:
        logits = base + eta * step
        log_pi = np.where(valid, logits - np.logaddexp.reduce(logits, axis=1, keepdims=True),
                          0.0)
        return float(w @ (p_mu * (log_mu - log_pi)).sum(axis=1))

    lo, hi = 0.0, 1.0
    while kl_at(hi) < kl_target and hi < eta_max:
        lo, hi = hi, min(2.0 * hi, eta_max)
    if kl_at(hi) < kl_target:  # unreachable along this direction
        lo = hi
    kl_hi = kl_at(hi)
    for _ in range(iterations):
        if hi - lo <= 1e-9 * hi or abs(kl_hi - kl_target) <= kl_tol * kl_target:
            break
        mid = 0.5 * (lo + hi)
        kl_mid = kl_at(mid)
        if kl_mid < kl_target:
            lo = mid
        else:
            hi, kl_hi = mid, kl_mid
    return Update(kind, kl_target, hi, kl_hi, apply_update(mu, direction, hi), branch_action)


def branch_action_for(model: WorkflowModel, mu: TabularPolicy) -> str:
    """The root action a branch-selective update targets [R]: the runner-up by Q_mu, or,
    when no state is selective to its branch (e.g. its failure ends the episode) or the
    branch is dead, the next action by Q_mu that has one (the leader last)."""
    s0 = model.initial_state()
    q = mu.values().q_values(s0)
    ranked = sorted(q, key=lambda a: (-q[a], model.valid_actions(s0).index(a)))
    order = ranked[1:] + ranked[:1]
    # A dead branch (e.g. skipping a required stage) has Q = 0 under every policy:
    # updating it moves no credit of its own, so it goes last.
    optimal = model.optimal_values()
    order.sort(key=lambda a: optimal.q(s0, a) == 0.0)
    zero = np.random.default_rng(0)
    for a in order:
        direction = update_direction(model, mu, "branch_selective", zero, 0.0, a)
        if any(v != 0.0 for row in direction.values() for v in row):
            return a
    return order[0]


def make_updates(model: WorkflowModel, mu: TabularPolicy, rng: np.random.Generator,
                 kinds: Sequence[UpdateKind] = UPDATE_KINDS,
                 kl_targets: Sequence[float] = DEFAULT_KL_TARGETS,
                 noise_frac: float = 0.5) -> list[Update]:
    """One update per (kind, KL target): one random direction per kind, scaled to each
    target (the sweep of update sizes), so sizes differ only in eta."""
    out: list[Update] = []
    for kind in kinds:
        branch = branch_action_for(model, mu) if kind == "branch_selective" else None
        direction = update_direction(model, mu, kind, rng, noise_frac, branch)
        out.extend(matched_update(model, mu, direction, target, kind, branch_action=branch)
                   for target in kl_targets)
    return out


# ----------------------------------------------------------------- collection
@dataclass
class Rollout:
    """One trajectory sampled through the environment.

    ``keys[k]`` is the observable state action k was taken in; ``states`` are the
    full states s_0 .. s_K (ground truth only: the agent never sees the hidden flags);
    ``snapshots[k]`` (when asked for) the env snapshot after step k (``[0]`` = start).
    ``complete`` is False when ``max_steps`` stopped it before the episode ended.
    """

    actions: list[str]
    observations: list[str]
    keys: list[ObsKey]
    states: list[State]
    reward: float
    complete: bool
    snapshots: list[bytes] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Tool steps spent (every env step is one tool call)."""
        return len(self.actions)


def rollout(env: WorkflowEnv, policy: TabularPolicy, rng: random.Random,
            first_action: str | None = None, max_steps: int | None = None,
            snapshots: bool = False, *, start: Continuing | None = None) -> Rollout:
    """Continue the episode in ``env`` from its current state (or the begun continuation
    ``start``) with ``policy`` (the first action forced when ``first_action`` is given):
    ``Continuing.step`` under the step limit ``max_steps`` (None: none)."""
    run = start if start is not None else Continuing(env, [], 0, max_steps)
    out = Rollout([], [], [], [env.state], 0.0, True,
                  [env.snapshot()] if snapshots else [])
    while not env.done:
        if run.at_limit:
            out.complete = False
            break
        s = env.state
        action = first_action if first_action is not None and not out.actions \
            else policy.sample(s, rng)
        result = run.step(action)
        out.actions.append(action)
        out.observations.append(result.observation)
        out.keys.append(env.model.observe(s))
        out.states.append(env.state)
        if snapshots:
            out.snapshots.append(env.snapshot())
        if result.done:
            out.reward = run.reward
    return out


def sample_from(env: WorkflowEnv, snapshot: bytes, policy: TabularPolicy, key: int,
                first_action: str | None = None, max_steps: int | None = None,
                snapshots: bool = False) -> Rollout:
    """One rollout from ``snapshot`` with its own outcome stream and action RNG (``key``):
    ``Continuing.begin`` (restore, reseed) then ``rollout``."""
    run = Continuing.begin(env, snapshot, key, max_steps=max_steps)
    return rollout(env, policy, random.Random(key), first_action, max_steps, snapshots,
                   start=run)


def route_tree(task: Task, tree_id: str, run_id: str, context: tuple[str, bytes],
               routes: Mapping[str, Sequence[Rollout]], phase: str, *,
               sampler: str = "interventional", policy_version: str | None = None,
               seed: int | None = None, meta: dict[str, Any] | None = None) -> Tree:
    """An interventional tree (module docstring) from complete rollouts per forced action.

    ``context`` is (prompt or current observation, env snapshot of the context).
    """
    prompt, snapshot = context
    nodes = [Node(0, None, kind="prompt", observation_text=prompt,
                  snapshot_id=CONTEXT_SNAPSHOT)]
    next_id = 1
    for forced, rollouts in routes.items():
        route_id = next_id
        nodes.append(Node(route_id, 0, kind="decision", phase="intervention",
                          meta={"forced_action": forced}))
        next_id += 1
        for r in rollouts:
            if not r.complete or not r.actions or r.actions[0] != forced:
                raise ValueError("route trees take complete rollouts that start with "
                                 "their forced action")
            parent = route_id
            for k, (action, obs) in enumerate(zip(r.actions, r.observations, strict=True)):
                last = k == r.steps - 1
                nodes.append(Node(next_id, parent, kind="decision", phase=phase,
                                  action_text=action, observation_text=obs, terminal=last,
                                  reward=r.reward if last else None,
                                  reward_parts={"reward": r.reward} if last else {},
                                  tool_calls=1, meta={"state": key_to_json(r.keys[k])}))
                parent = next_id
                next_id += 1
    n_rollouts = sum(len(v) for v in routes.values())
    return Tree(tree_id=tree_id, nodes=nodes, run_id=run_id, task_id=task.task_id,
                env="workflow", sampler=sampler, env_config=task.config,
                policy_version=policy_version, budget=n_rollouts,
                rollouts_by_phase={phase: n_rollouts}, seed=seed, meta=meta,
                snapshots={CONTEXT_SNAPSHOT: snapshot})


# ----------------------------------------------------------------- reading back
@dataclass
class RouteData:
    """Interventional trees read back from a store, as one ``TreeArrays`` batch.

    Per node (N,): ``key`` the observable state its action was taken in (None at the
    root and route nodes; from the node's ``meta["state"]``), ``action`` its action text;
    per tree (B,): ``models``, ``meta`` (the tree's JSON meta), ``tasks`` (task ids),
    ``routes`` (the depth-1 rows, in preorder) and ``route_actions`` (their forced
    actions); ``state_code`` (N,) the integer code of ``key`` (``state_code``, 0 at None).
    """

    batch: TreeArrays
    key: list[ObsKey | None]
    action: list[str]
    models: list[WorkflowModel]
    meta: list[dict[str, Any]]
    tasks: list[str]
    routes: list[np.ndarray]
    route_actions: list[list[str]]
    state_code: np.ndarray = field(repr=False)  # (N,) state_code of key, 0 where None
    route_index: np.ndarray = field(repr=False)  # (N,) index of a route row among its
    # tree's routes (preorder), -1 at other rows

    def ratios(self, numerator: Sequence[TabularPolicy],
               denominator: Sequence[TabularPolicy]) -> np.ndarray:
        """(N,) pi(A|S)/mu(A|S) of each downstream action (depth >= 3) with per-tree
        policies; 1 at the forced step (depth 2), NaN at depths 0-1. Each distinct
        (tree, state, action) is evaluated once and scattered to its nodes."""
        b = self.batch
        out = np.full(b.n_nodes, np.nan)
        out[b.depth == 2] = 1.0
        rows = np.flatnonzero(b.depth >= 3)
        if rows.size == 0:
            return out
        actions, action_ids = np.unique(np.asarray([self.action[v] for v in rows], object),
                                        return_inverse=True)
        combos, inverse = np.unique(
            np.stack([b.node_tree[rows], self.state_code[rows], action_ids.ravel()], 1),
            axis=0, return_inverse=True)
        values = np.empty(len(combos))
        for c, (tree, code, a) in enumerate(combos.tolist()):  # distinct combos, not nodes
            key, action = self._key_of_code(int(code)), str(actions[int(a)])
            values[c] = numerator[tree].prob(key, action) / denominator[tree].prob(key, action)
        out[rows] = values[inverse.ravel()]
        return out

    def state_ids(self) -> np.ndarray:
        """(N,) integer id of each node's (S_t, h_t) (``extras["dsc_state"]``), 0 at
        depths 0-1; unique within a tree."""
        return self.state_code.copy()

    @staticmethod
    def _key_of_code(code: int) -> ObsKey:
        return ObsKey(code // 2048, (code // 2) % 1024, bool(code % 2))


def state_code(stage: np.ndarray, t: np.ndarray, broken: np.ndarray) -> np.ndarray:
    """(N,) ``(stage * 1024 + t) * 2 + broken`` (t < 1024): one integer per state."""
    return (stage.astype(np.int64) * 1024 + t.astype(np.int64)) * 2 + broken.astype(np.int64)


def load_route_data(store: Store, run_id: str) -> RouteData:
    """Every interventional tree of ``run_id`` in ``store`` (trees in ``tree_id`` order);
    states from each step node's ``meta["state"]`` (read by SQL, no text parsing)."""
    import pyarrow.compute as pc

    con = connect(store)
    trees = con.sql("SELECT * FROM trees WHERE run_id = $run_id "
                    "AND sampler = 'interventional' ORDER BY tree_id",
                    params={"run_id": run_id}).to_arrow_table()
    if trees.num_rows == 0:
        raise ValueError(f"no interventional trees of run {run_id!r} in the store")
    columns = ", ".join([*NODE_INPUT.names, "depth", "preorder", "subtree_size"])
    nodes = con.sql(f"""
        SELECT {columns},
               json_extract(meta, '$.state[0]')::BIGINT AS s_stage,
               json_extract(meta, '$.state[1]')::BIGINT AS s_t,
               json_extract(meta, '$.state[2]')::BIGINT AS s_broken,
               json_extract_string(meta, '$.forced_action') AS forced_action
        FROM nodes WHERE tree_id IN (SELECT tree_id FROM trees WHERE run_id = $run_id
                                     AND sampler = 'interventional')""",
                    params={"run_id": run_id}).to_arrow_table()
    batch = from_tables(trees, nodes)
    # from_tables orders rows by (tree, preorder): the same order for the extra columns
    node_tree = pc.index_in(nodes.column("tree_id"), value_set=trees.column("tree_id"))
    order = np.lexsort((nodes.column("preorder").to_numpy(),
                        node_tree.to_numpy(zero_copy_only=False)))
    extra = nodes.select(["action_text", "s_stage", "s_t", "s_broken", "forced_action"]
                         ).take(pa.array(order))
    step = batch.depth >= 2
    stage, t, broken = (extra.column(c).to_numpy(zero_copy_only=False)
                        for c in ("s_stage", "s_t", "s_broken"))
    missing = np.flatnonzero(step & np.isnan(stage.astype(np.float64)))
    if missing.size:
        v = int(missing[0])
        raise ValueError(f"tree {batch.tree_ids[batch.node_tree[v]]}: node "
                         f"{batch.node_ids[v]} has no meta['state'] (stored by an older "
                         "study version; rerun the study into a fresh directory)")
    grid = np.stack([np.where(step, np.nan_to_num(x.astype(np.float64)), 0).astype(np.int64)
                     for x in (stage, t, broken)], axis=1)  # (N, 3)
    codes = np.where(step, state_code(grid[:, 0], grid[:, 1], grid[:, 2]), 0)
    key: list[ObsKey | None] = [key_from_json(row) if s else None
                                for row, s in zip(grid.tolist(), step.tolist(), strict=True)]
    action = [a or "" for a in extra.column("action_text").to_pylist()]
    forced = extra.column("forced_action").to_pylist()
    configs = [json.loads(c) for c in trees.column("env_config").to_pylist()]
    models = [WorkflowModel.from_config(c) for c in configs]
    route_rows = np.flatnonzero(batch.depth == 1)
    routes = [route_rows[batch.node_tree[route_rows] == b] for b in range(batch.n_trees)]
    route_actions = [[str(forced[r]) for r in rows] for rows in routes]
    route_index = np.full(batch.n_nodes, -1, np.int64)
    for rows in routes:
        route_index[rows] = np.arange(len(rows))
    return RouteData(
        batch=batch, key=key, action=action, models=models,
        meta=[json.loads(m) if m else {} for m in trees.column("meta").to_pylist()],
        tasks=trees.column("task_id").to_pylist(), routes=routes, route_actions=route_actions,
        state_code=codes, route_index=route_index)


def context_snapshots(store: Store, run_id: str) -> dict[str, bytes]:
    """The raw env snapshot of the context (root) of every tree of ``run_id``."""
    from rollout_store.snapshots import from_stored

    con = connect(store)
    rows = con.sql("SELECT * FROM snapshots WHERE snapshot_id = $snapshot AND "
                   "tree_id IN (SELECT tree_id FROM trees WHERE run_id = $run_id)",
                   params={"snapshot": CONTEXT_SNAPSHOT, "run_id": run_id}).to_arrow_table()
    raw = from_stored(rows)
    return {t: bytes(s) for t, s in zip(raw.column("tree_id").to_pylist(),
                                       raw.column("state").to_pylist(), strict=True)}


# ----------------------------------------------------------------- small shared helpers
def make_study_dir(out_dir: str | Path) -> Path:
    """A study's output folder ``out_dir``, created (with its parents) if missing."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


Log = Callable[[str], None]
"""Where a study's progress lines go (``rtrees study`` prints them; None: nowhere)."""


def log_progress(log: Log | None, what: str, done: int, total: int, start: float) -> None:
    """``what: done/total (N s)`` to ``log`` at about every tenth of ``total`` and at its
    end, N the seconds since ``start`` (``time.perf_counter()``): progress on a long study."""
    if log is None or total <= 0:
        return
    if done == total or done % max(1, total // 10) == 0:
        log(f"{what}: {done}/{total} ({time.perf_counter() - start:.0f} s)")


def write_study(path: Path, doc: Mapping[str, Any]) -> Path:
    """Write a study's ``study.json`` (what the study did: kind, config, run id, data file
    names, timings); plain JSON (NaN and inf as JSON's ``NaN`` / ``Infinity``), read back
    by ``analysis`` to build the report."""
    path.write_text(json.dumps(dict(doc), indent=2, default=str) + "\n")
    return path


_TOOL_OF: dict[str, str] = {text: tool for tool, text in ACTION_TEXTS.items()}


def tool_name(action: str) -> str:
    """The tool name of a canonical action string (the string itself otherwise)."""
    return _TOOL_OF.get(action, action)


__all__ = [
    "CONTEXT_SNAPSHOT",
    "DEFAULT_KL_TARGETS",
    "UPDATE_KINDS",
    "Direction",
    "Log",
    "Rollout",
    "RouteData",
    "Update",
    "UpdateKind",
    "apply_update",
    "base_policy",
    "branch_action_for",
    "config_hash",
    "context_snapshots",
    "key_from_json",
    "key_to_json",
    "load_route_data",
    "log_progress",
    "make_study_dir",
    "make_tasks",
    "make_updates",
    "matched_update",
    "observable_keys",
    "policy_from_json",
    "policy_to_json",
    "rollout",
    "route_tree",
    "runner_up_action",
    "sample_from",
    "state_code",
    "stream_key",
    "task_model",
    "tool_name",
    "update_direction",
    "visible_state",
    "write_study",
]
