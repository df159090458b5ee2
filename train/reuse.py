"""Training from stored plus fresh trees: reuse, transport or refresh historical credit
(issue 12). The trainer (``train.trainer``) calls ``select_stored``, ``score_actions``,
``resolve_tree`` and ``refresh_routes`` each iteration; the math and the store I/O of
reuse live here.

Which stored trees. ``select_stored`` reads the store's ``trees`` view filtered by
``TrainConfig.reuse_from`` (default: this run's trees) and keeps the trees of *earlier*
policy versions: a tree's version index is the checkpoint step of its ``policy_ref``
(``.../checkpoints/step-NNNNNN``); staleness = current iteration - that step. Refresh
trees (sampler ``refresh``, below) are training data of their iteration, never reused. Trees
are skipped and counted by a named reason (``SKIP_REASONS``): ``stale`` (staleness >
``max_staleness``), ``other_env``, ``unknown_version`` (no parseable checkpoint step, or
another run's checkpoint that is gone), ``other_tokenizer`` (another run whose
checkpoint tokenizer differs), ``no_logprobs`` (an action without its stored sampling
logprobs mu) and ``no_snapshot`` (refresh / dsc only: no root snapshot to continue
from). ``reuse_per_step`` trees are drawn from the eligible ones with
``mix_seed(seed, "reuse", it)``; their nodes are streamed with ``iter_tree_batches``
(bounded memory), so a resumed run draws the same trees.

Sibling comparisons. A stored tree's comparisons are its root actions (the depth-1
nodes, DSC's "forced root actions"); the leader is the root action with the best
stored mean return, and every other root action is a competitor (``dsc_gate``'s pairs).
Per leaf, the return the credit estimator sees is chosen by the rule:

* ``all``: R_i, the stored return (the credit equals the stored credit exactly);
* ``transport``: T_i of D4, with z_t = pi_prox(A_t|S_t) / mu(A_t|S_t) - 1 (D3) from a
  forward pass of the stored action tokens under the current (pre-update) weights
  (``score_actions``; no environment step), the cross-fitted baseline of
  ``train.credit.dsc``, no products of ratios;
* ``dsc``: the gate D8-D10 per leader-versus-competitor pair with radii r_X = kappa_X
  s_X (D7; kappas from ``TrainConfig.reuse_params``): a reused competitor keeps R_i, a
  transported one gets T_i, a refreshed one is refreshed; the leader is transported if
  any of its pairs is not reused and refreshed if any is refreshed [R];
* ``refresh``: every root action of the tree is refreshed.

Refresh (``refresh_routes``) runs the refresh protocol of ``train.sampling.refresh``
(``refresh_protocol`` over ``RefreshSampler``; the prior of a route from the returns
above, D-section 5) with draws built on the continuation primitive: restore the stored
root snapshot, reseed, force the stored root action, continue with the current policy
(``Continuing`` + ``sample_round``). The leaves of a refreshed route then get the
route's posterior mean. The new trajectories are committed as one new tree per stored
tree (sampler ``refresh``, the current ``policy_version`` / ``policy_ref``), with its
lineage in ``trees.meta``: ``refresh_of`` (the stored tree id),
``refresh_of_version`` (its policy version) and ``lineage`` ({new depth-1 node id:
stored root-action node id}); each forced node's ``nodes.meta`` also holds
``refresh_of``. The forced action's tokens keep the stored logprobs mu (they were
sampled by mu), so the behaviour weight (G8) corrects them as on any stored token.

The credit used for a stored tree is committed to ``credits`` under method
``{credit}+{reuse|transport|dsc|refresh}`` with the *current* policy version (the
version the credit is for), so audits can compare it with fresh credit.

Restriction [R]: comparisons below the root (BEL / entropy branching at inner nodes)
are resolved with the root-level rule too; D3's downstream steps are the depth >= 2
nodes of ``train.credit.dsc``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rollout_store.reader import connect, iter_tree_batches
from rollout_store.snapshots import from_stored
from rollout_store.store import Store
from rollout_store.tree import Node, Tree, trees_from_tables
from train.batches import (
    NodeCredit,
    ProxLogp,
    TreeSeqs,
    forward_logprobs,
    make_rows,
    micro_batches,
)
from train.credit.base import from_trees
from train.credit.dsc import RATIO, STATE, transport_returns
from train.credit.dsc_gate import DSCGateParams, dsc_gate
from train.envs.base import Environment, parse_action
from train.loss import IS_MODES
from train.policies.base import Policy, SampleConfig, Turn
from train.sampling.base import Continuing, mix_seed, sample_round
from train.sampling.refresh import RefreshSampler, refresh_protocol
from train.sampling.segments import action_segments, token_char_starts

REUSE_MODES: tuple[str, ...] = ("none", "all", "transport", "dsc", "refresh")
METHOD_SUFFIX: dict[str, str] = {"all": "reuse", "transport": "transport", "dsc": "dsc",
                                 "refresh": "refresh"}
SKIP_REASONS: tuple[str, ...] = ("stale", "other_env", "unknown_version", "other_tokenizer",
                                 "no_logprobs", "no_snapshot")
DECISIONS: tuple[str, ...] = ("reuse", "transport", "refresh")
_STEP = re.compile(r"step-(\d+)/?$")


class ReuseError(ValueError):
    """Reuse cannot start: a bad ``reuse_from`` filter or bad ``reuse_params``."""


@dataclass(frozen=True)
class ReuseParams:
    """Gate (D7) and refresh-protocol knobs (``TrainConfig.reuse_params``)."""

    kappa_R: float = 2.0
    """D7 multiplier of s_R (not calibrated by the trainer: see the report)."""
    kappa_delta: float = 2.0
    """D7 multiplier of s_Delta."""
    kappa_T: float = 2.0
    """D7 multiplier of s_T."""
    kappa_e: float = 2.0
    """Refresh protocol: a pair is resolved when |m_L - m_c| > kappa_e sqrt(v_L + v_c)."""
    refresh_batch: int = 4
    """Refresh protocol: new trajectories per round."""
    refresh_cap: int = 32
    """Refresh protocol: cap on the new tool steps spent on one stored tree."""

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> ReuseParams:
        names = {f.name: f for f in fields(cls)}
        out: dict[str, Any] = {}
        for key, value in values.items():
            if key not in names:
                raise ValueError(f"unknown key {key!r}; keys: {', '.join(names)}")
            kind = int if key in ("refresh_batch", "refresh_cap") else float
            out[key] = kind(value)
        p = cls(**out)
        if min(p.kappa_R, p.kappa_delta, p.kappa_T, p.kappa_e) < 0:
            raise ValueError("kappas must be >= 0")
        if p.refresh_batch < 1 or p.refresh_cap < 1:
            raise ValueError("refresh_batch and refresh_cap must be >= 1")
        return p

    def gate(self) -> DSCGateParams:
        return DSCGateParams(kappa_R=self.kappa_R, kappa_delta=self.kappa_delta,
                             kappa_T=self.kappa_T)


# ------------------------------------------------------------------------- selection

def policy_step(policy_ref: str | None) -> int | None:
    """The checkpoint step (policy version index) named by a trainer ``policy_ref``."""
    if not policy_ref:
        return None
    m = _STEP.search(str(policy_ref))
    return int(m.group(1)) if m else None


def _tokenizer_fingerprint(directory: str | Path) -> str | None:
    path = Path(directory) / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def reuse_filter(reuse_from: str, run_id: str) -> str:
    """The SQL filter over ``trees``: ``reuse_from`` or this run's own trees."""
    return reuse_from or "run_id = '" + run_id.replace("'", "''") + "'"


def check_reuse(store: Store, reuse_from: str, run_id: str) -> None:
    """Refuse (before training) a ``reuse_from`` filter the store's ``trees`` view cannot
    evaluate, or an explicit one that selects no tree."""
    con = connect(store)
    try:
        [(count,)] = con.execute(
            f"SELECT count(*) FROM trees WHERE {reuse_filter(reuse_from, run_id)}").fetchall()
    except Exception as exc:  # duckdb raises its own error classes
        raise ReuseError(f"reuse_from {reuse_from!r} is not a valid filter over trees: "
                         f"{str(exc).splitlines()[0]}") from exc
    if reuse_from and not count:
        raise ReuseError(f"reuse_from {reuse_from!r} selects no stored tree in {store.path}")


@dataclass
class Selection:
    """The stored trees drawn for one iteration and what was skipped (per reason)."""

    trees: list[Tree]
    staleness: list[int]
    skipped: Counter[str] = field(default_factory=Counter)


def select_stored(store: Store, *, reuse_from: str, run_id: str, env: str, iteration: int,
                  max_staleness: int, per_step: int, seed: int, need_snapshots: bool,
                  tokenizer_dir: str | None) -> Selection:
    """Stored trees of earlier policy versions for ``iteration`` (module docstring)."""
    con = connect(store)
    rows = con.execute(
        "SELECT tree_id, env, run_id, policy_ref FROM trees WHERE sampler <> 'refresh' AND "
        f"({reuse_filter(reuse_from, run_id)}) ORDER BY tree_id").fetchall()
    mine = _tokenizer_fingerprint(tokenizer_dir) if tokenizer_dir else None
    prints: dict[str, str | None] = {}
    skipped: Counter[str] = Counter()
    eligible: list[tuple[str, int]] = []
    for tree_id, tree_env, tree_run, ref in rows:
        step = policy_step(ref)
        if step is not None and step >= iteration:
            continue  # this or a later version: not historical
        if tree_env != env:
            skipped["other_env"] += 1
            continue
        if step is None:
            skipped["unknown_version"] += 1
            continue
        if tree_run != run_id:
            d = str(Path(ref))
            if d not in prints:
                prints[d] = _tokenizer_fingerprint(d) if Path(d).is_dir() else None
            if prints[d] is None:
                skipped["unknown_version"] += 1
                continue
            if mine is not None and prints[d] != mine:
                skipped["other_tokenizer"] += 1
                continue
        if iteration - step > max_staleness:
            skipped["stale"] += 1
            continue
        eligible.append((tree_id, iteration - step))
    if not eligible:
        return Selection([], [], skipped)
    rng = np.random.default_rng(mix_seed(seed, "reuse", iteration))
    picks = sorted(rng.choice(len(eligible), size=min(per_step, len(eligible)),
                              replace=False).tolist())
    wanted = [eligible[i] for i in picks]
    trees = load_trees(store, [t for t, _ in wanted], with_snapshots=True)
    by_id = {t.tree_id: t for t in trees}
    out: list[Tree] = []
    stale: list[int] = []
    for tree_id, staleness in wanted:
        tree = by_id[tree_id]
        reason = tree_problem(tree, need_snapshots)
        if reason is not None:
            skipped[reason] += 1
            continue
        out.append(tree)
        stale.append(staleness)
    return Selection(out, stale, skipped)


def tree_problem(tree: Tree, need_snapshots: bool) -> str | None:
    """The ``SKIP_REASONS`` entry that rules out training on ``tree``, or None."""
    for n in tree.nodes:
        if n.parent_id is not None and (not n.action_token_ids or
                                        len(n.action_logprobs) != len(n.action_token_ids)):
            return "no_logprobs"
    if need_snapshots:
        root = tree.root()
        if root.snapshot_id is None or root.snapshot_id not in tree.snapshots:
            return "no_snapshot"
    return None


def load_trees(store: Store, tree_ids: Sequence[str], with_snapshots: bool) -> list[Tree]:
    """Whole trees ``tree_ids``: nodes streamed with ``iter_tree_batches`` (bounded memory),
    tree rows and (optionally) snapshots from the DuckDB views of just these trees."""
    wanted = pa.array(list(tree_ids), pa.string())
    con = connect(store)
    con.register("_reuse_ids", pa.table({"tree_id": wanted}))
    trees = con.sql("SELECT * FROM trees WHERE tree_id IN (SELECT tree_id FROM _reuse_ids)"
                    ).to_arrow_table()
    parts = [b.filter(pc.is_in(b.column("tree_id"), value_set=wanted))
             for b in iter_tree_batches(store)]
    parts = [p for p in parts if p.num_rows]
    if not parts:
        return []
    nodes = pa.concat_tables(parts).sort_by([("tree_id", "ascending"), ("node_id", "ascending")])
    snaps = None
    if with_snapshots:
        stored = con.sql("SELECT * FROM snapshots WHERE tree_id IN "
                         "(SELECT tree_id FROM _reuse_ids)").to_arrow_table()
        snaps = from_stored(stored)
    return trees_from_tables(trees, nodes, snaps)


# --------------------------------------------------------------------- scoring (D3)

def score_actions(model: Any, seqs: Sequence[TreeSeqs], layout: Any, micro_tokens: int,
                  pad_id: int, max_row_tokens: int | None = None) -> ProxLogp:
    """log pi_prox of every stored action token under ``model`` (the current, pre-update
    weights): one no-grad forward pass over the trees' token layout, no environment
    step. Returns {(tree id, node id): (len A_v,) float64}."""
    zero = {(ts.tree_id, n.node_id): NodeCredit(np.zeros(len(n.old_logp)))
            for ts in seqs for n in ts.nodes}
    rows = make_rows(seqs, zero, layout, max_row_tokens=max_row_tokens)
    out: dict[tuple[str, int], np.ndarray] = {
        k: np.zeros(len(v.advantage)) for k, v in zero.items()}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for mb in micro_batches(rows, layout, micro_tokens, pad_id=pad_id):
            if not mb.n_loss_tokens:
                continue
            logp = forward_logprobs(model, mb)[0].double().cpu().numpy()
            for (b, i, k), value in zip(mb.keys, logp, strict=True):
                ts = seqs[b]
                out[(ts.tree_id, ts.nodes[i].node_id)][k] = value
    model.train(was_training)
    return out


def dsc_extras(tree: Tree, prox: ProxLogp) -> dict[str, np.ndarray]:
    """``extras`` of ``train.credit.dsc`` for one tree (rows follow ``tree.nodes``):
    ``dsc_ratio`` (N,) = exp(sum log pi_prox - sum log mu) of each action (D3) and
    ``dsc_state`` (N,) = the parent's node id (siblings share their state [R])."""
    ratio = np.ones(len(tree.nodes))
    state = np.full(len(tree.nodes), -1, np.int64)
    for r, n in enumerate(tree.nodes):
        if n.parent_id is None:
            continue
        state[r] = n.parent_id
        lp = prox.get((tree.tree_id, n.node_id))
        if lp is not None:
            ratio[r] = float(np.exp(min(float(np.sum(lp)) - float(np.sum(n.action_logprobs)),
                                        20.0)))
    return {RATIO: ratio, STATE: state}


# ------------------------------------------------------------------- resolution

@dataclass
class Resolution:
    """How one stored tree's comparisons were resolved.

    ``returns`` {leaf node id: the return its credit uses}; ``route_of`` {leaf: its root
    action}; ``refresh`` the root actions to refresh; ``pairs`` decisions counted per
    ``DECISIONS``; ``prior`` {root action: (mean, variance of the mean, N)} of the returns
    used; ``transported`` / ``reward`` the D4 T_i and the stored R_i per leaf.
    """

    returns: dict[int, float]
    route_of: dict[int, int]
    refresh: list[int]
    pairs: Counter[str]
    prior: dict[int, tuple[float, float, int]]
    transported: dict[int, float]
    reward: dict[int, float]


def resolve_tree(tree: Tree, mode: str, prox: ProxLogp, params: ReuseParams) -> Resolution:
    """Resolve ``tree``'s leader-versus-competitor pairs of root actions by ``mode``
    (module docstring). D3-D5 via ``transport_returns``, D7-D10 via ``dsc_gate``."""
    if mode not in REUSE_MODES[1:]:
        raise ValueError(f"unknown reuse mode {mode!r}; choose from {REUSE_MODES[1:]}")
    arrays = from_trees([tree], dsc_extras(tree, prox))
    tr = transport_returns(arrays)
    ids = arrays.node_ids
    leaves = [int(ids[r]) for r in tr.leaf]
    route_of = {leaf: int(ids[a]) for leaf, a in zip(leaves, tr.action, strict=True)}
    reward = {leaf: float(v) for leaf, v in zip(leaves, tr.reward, strict=True)}
    transported = {leaf: float(v) for leaf, v in zip(leaves, tr.transported, strict=True)}
    gate = dsc_gate(arrays, params.gate())
    lead = {int(ids[r]) for r in gate.leader}
    comps = [int(ids[r]) for r in gate.competitor]
    routes = sorted(set(route_of.values()))
    pairs: Counter[str] = Counter()
    use: dict[int, str] = {}  # root action -> "reuse" | "transport" | "refresh"
    if mode == "dsc":
        for comp, decision in zip(comps, gate.decision.tolist(), strict=True):
            use[comp] = decision
            pairs[decision] += 1
        others = [use[c] for c in comps]
        for leader in lead:
            use[leader] = ("refresh" if "refresh" in others else
                           "transport" if "transport" in others else "reuse")
    else:
        decision = {"all": "reuse", "transport": "transport", "refresh": "refresh"}[mode]
        pairs[decision] += len(comps)
        use = {r: decision for r in routes}
    if len(routes) < 2:  # nothing to compare: no refresh
        use = {r: "reuse" if mode in ("all", "refresh") else "transport" for r in routes}
    returns = {leaf: (reward[leaf] if use.get(route_of[leaf], "reuse") == "reuse"
                      else transported[leaf]) for leaf in leaves}
    prior: dict[int, tuple[float, float, int]] = {}
    for r in routes:
        vals = np.array([returns[leaf] for leaf in leaves if route_of[leaf] == r])
        var = float(vals.var(ddof=1)) / vals.size if vals.size > 1 else 0.0
        prior[r] = (float(vals.mean()), var, int(vals.size))
    refresh = sorted(r for r in routes if use.get(r) == "refresh")
    return Resolution(returns, route_of, refresh, pairs, prior, transported, reward)


def with_returns(tree: Tree, returns: Mapping[int, float]) -> Tree:
    """A copy of ``tree`` whose leaves carry ``returns`` (node id -> reward), so the
    credit estimator compares siblings with the rule's returns."""
    nodes = [replace(n, reward=float(returns[n.node_id])) if n.node_id in returns else n
             for n in tree.nodes]
    return replace(tree, nodes=nodes)


def tool_steps(tree: Tree) -> int:
    """Tool steps a tree's trajectories spent (what a refresh of all of them would cost)."""
    return sum(int(n.tool_calls or 0) for n in tree.nodes)


# ------------------------------------------------------------------------ refresh

@dataclass(frozen=True)
class NewStep:
    """One step of a refresh draw: the action (tokens, logprobs) and what followed."""

    action_text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    entropies: tuple[float, ...]
    segments: tuple[Any, ...]
    observation: str
    done: bool
    reward_parts: dict[str, float]
    snapshot: bytes
    truncated: bool
    tool_call: bool


@dataclass(frozen=True)
class RefreshDraw:
    """A new trajectory from a stored root action (``Trajectory`` of the protocol)."""

    route: int
    steps_taken: tuple[NewStep, ...]
    steps: int  # new tool steps (the protocol's budget unit)
    reward: float


class _Draws:
    """``draw(route, k)`` for ``RefreshSampler``: the continuation primitive from the
    stored root snapshot, the stored root action forced first, then the policy."""

    def __init__(self, env: Environment, policy: Policy, tree: Tree, routes: Sequence[int],
                 seed: int, max_new_tokens: int, temperature: float) -> None:
        self.env, self.policy, self.tree, self.routes = env, policy, tree, list(routes)
        self.seed, self.max_new_tokens, self.temperature = seed, max_new_tokens, temperature
        root = tree.root()
        assert root.snapshot_id is not None
        self.snapshot = tree.snapshots[root.snapshot_id]
        self.prompt: list[Turn] = [("prompt", root.observation_text)]
        self.max_steps = (tree.env_config or {}).get("max_steps")

    def __call__(self, route: int, k: int) -> RefreshDraw:
        forced = self.tree.node(self.routes[route])
        key = mix_seed(self.seed, "refresh", self.tree.tree_id, forced.node_id, k)
        run = Continuing.begin(self.env, self.snapshot, key, self.prompt, 0, self.max_steps)
        steps: list[NewStep] = []
        calls = 0
        text, ids, lps = forced.action_text, forced.action_token_ids, forced.action_logprobs
        ents, segs = forced.action_entropies, tuple(forced.segments)
        while True:
            result = run.step(text)
            steps.append(NewStep(text, tuple(ids), tuple(lps), tuple(ents), segs,
                                 result.observation, result.done,
                                 dict(result.reward_parts), self.env.snapshot(),
                                 run.truncated, parse_action(text).kind == "tool_call"))
            if run.over:
                break
            calls += 1
            config = partial(self._config, seed=mix_seed(key, "call", calls))
            cont = sample_round(self.policy, [(1, run.turns)], config)[0][0]
            text, ids, lps = cont.text, list(cont.token_ids), list(cont.logprobs)
            ents = list(cont.entropies)
            segs = tuple(action_segments(cont.text, token_char_starts(self.policy, cont)))
        reward = 0.0 if run.truncated else run.reward
        return RefreshDraw(route, tuple(steps), sum(s.tool_call for s in steps), reward)

    def _config(self, n: int, seed: int) -> SampleConfig:
        return SampleConfig(n=n, max_new_tokens=self.max_new_tokens,
                            temperature=self.temperature, seed=seed)


@dataclass
class Refreshed:
    """The outcome of refreshing one stored tree: the new tree (None when the protocol
    drew nothing), the posterior mean per refreshed root action, new tool steps spent."""

    tree: Tree | None
    posterior: dict[int, float]
    steps: int


def refresh_routes(tree: Tree, res: Resolution, env: Environment, policy: Policy, *,
                   tree_id: str, run_id: str, seed: int, params: ReuseParams,
                   max_new_tokens: int, temperature: float) -> Refreshed:
    """Refresh ``res.refresh`` (root actions of ``tree``) with the refresh protocol of
    ``train.sampling.refresh`` (prior from ``res.prior``) and draws from the stored
    snapshot (``_Draws``); returns the new tree with its lineage (module docstring)."""
    routes = res.refresh
    if len(routes) < 2:
        return Refreshed(None, {}, 0)
    draws = RefreshSampler(_Draws(env, policy, tree, routes, seed, max_new_tokens,
                                  temperature))
    mean = np.array([res.prior[r][0] for r in routes])
    var = np.array([res.prior[r][1] for r in routes])
    n_old = np.array([res.prior[r][2] for r in routes], np.float64)
    # the protocol's Beta prior takes returns in [0, 1] (transported ones are clipped by it)
    out = refresh_protocol(mean, var, n_old, list(range(len(routes))), draws,
                           kappa_e=params.kappa_e, cap_steps=params.refresh_cap,
                           batch=params.refresh_batch)
    posterior = {r: float(out.mean[i]) for i, r in enumerate(routes)}
    drawn = [d for _, d in sorted(draws.cache.items())]
    if not drawn:
        return Refreshed(None, posterior, 0)
    new = _refresh_tree(tree, drawn, routes, tree_id=tree_id, run_id=run_id, policy=policy,
                        seed=seed)
    return Refreshed(new, posterior, sum(d.steps for d in drawn))


def _refresh_tree(tree: Tree, drawn: Sequence[RefreshDraw], routes: Sequence[int], *,
                  tree_id: str, run_id: str, policy: Policy, seed: int) -> Tree:
    root = tree.root()
    encode: Callable[[str], list[int]] | None = getattr(policy, "encode", None)
    nodes = [Node(node_id=0, parent_id=None, kind="prompt",
                  observation_text=root.observation_text, snapshot_id=f"{tree_id}/0")]
    snapshots = {f"{tree_id}/0": tree.snapshots[root.snapshot_id or ""]}
    lineage: dict[str, int] = {}
    for d in drawn:
        parent = 0
        for j, s in enumerate(d.steps_taken):
            nid = len(nodes)
            leaf = s.done or j == len(d.steps_taken) - 1
            feedback = j > 0 and "<tool_response>" in nodes[parent].observation_text
            meta: dict[str, Any] | None = None
            if j == 0:
                meta = {"refresh_of": {"tree_id": tree.tree_id, "node_id": routes[d.route]}}
                lineage[str(nid)] = routes[d.route]
            if s.truncated:
                meta = {**(meta or {}), "truncated": True}
            nodes.append(Node(
                node_id=nid, parent_id=parent,
                kind="feedback_response" if feedback else "decision",
                action_text=s.action_text, action_token_ids=list(s.token_ids),
                action_logprobs=list(s.logprobs), action_entropies=list(s.entropies),
                observation_text=s.observation,
                observation_token_ids=[int(i) for i in encode(s.observation)]
                if callable(encode) and s.observation else [],
                segments=list(s.segments), terminal=s.done,
                reward=float(s.reward_parts.get("reward", 0.0)) if leaf and not s.truncated
                else (0.0 if leaf else None),
                reward_parts=dict(s.reward_parts) if leaf else {},
                snapshot_id=f"{tree_id}/{nid}", n_gen_tokens=len(s.token_ids),
                tool_calls=int(s.tool_call), phase="refresh", meta=meta))
            snapshots[f"{tree_id}/{nid}"] = s.snapshot
            parent = nid
    ref = getattr(policy, "policy_ref", None)
    return Tree(
        tree_id=tree_id, nodes=nodes, run_id=run_id, task_id=tree.task_id, env=tree.env,
        sampler="refresh", env_config=dict(tree.env_config or {}),
        policy_version=str(policy.policy_version), policy_ref=None if ref is None else str(ref),
        budget=len(drawn), rollouts_by_phase={"refresh": len(drawn)}, seed=seed,
        meta={"refresh_of": tree.tree_id, "refresh_of_version": tree.policy_version,
              "lineage": lineage, "env_steps": sum(len(d.steps_taken) for d in drawn)},
        snapshots=snapshots)


@dataclass
class StoredStep:
    """One iteration's stored trees after resolution: ``credited`` (copies carrying the
    rule's returns, for the credit estimator), ``refreshed`` (new trees to commit), pair
    decisions per ``DECISIONS`` and the new tool steps the refreshes spent."""

    credited: list[Tree]
    refreshed: list[Tree]
    pairs: Counter[str]
    new_tool_steps: int


def resolve_stored(sel: Selection, mode: str, prox: ProxLogp, params: ReuseParams,
                   env: Environment, policy: Policy, *, run_id: str, iteration: int,
                   seed: int, max_new_tokens: int, temperature: float,
                   log: Path | None = None) -> StoredStep:
    """``resolve_tree`` then ``refresh_routes`` for every selected tree; the refreshed
    routes' leaves take the protocol's posterior means. Refresh tree ids are
    ``RUN/itNNNNNN/refresh/JJJ``; draws are seeded by (seed, "refresh", iteration)."""
    step = StoredStep([], [], Counter(), 0)
    for j, (old, stale) in enumerate(zip(sel.trees, sel.staleness, strict=True)):
        res = resolve_tree(old, mode, prox, params)
        step.pairs.update(res.pairs)
        got = refresh_routes(old, res, env, policy,
                             tree_id=f"{run_id}/it{iteration:06d}/refresh/{j:03d}",
                             run_id=run_id, seed=mix_seed(seed, "refresh", iteration),
                             params=params, max_new_tokens=max_new_tokens,
                             temperature=temperature)
        returns = {leaf: got.posterior.get(res.route_of[leaf], value)
                   for leaf, value in res.returns.items()}
        step.credited.append(with_returns(old, returns))
        step.new_tool_steps += got.steps
        if got.tree is not None:
            step.refreshed.append(got.tree)
        if log is not None:
            values = {str(r): float(np.mean([v for x, v in returns.items()
                                             if res.route_of[x] == r]))
                      for r in sorted(set(res.route_of.values()))}
            log_line(log, {"iteration": iteration, "tree_id": old.tree_id,
                           "staleness": stale, "pairs": dict(res.pairs),
                           "refresh": res.refresh, "refresh_steps": got.steps,
                           "route_values": values, "mode": mode})
    return step


def rename_method(rows: pa.Table, suffix: str, policy_version: str) -> pa.Table:
    """``credits`` rows with method ``METHOD+suffix`` and the current policy version."""
    n = rows.num_rows
    methods = [f"{m}+{suffix}" for m in rows.column("method").to_pylist()]
    i, j = rows.schema.get_field_index("method"), rows.schema.get_field_index("policy_version")
    rows = rows.set_column(i, rows.schema.field(i), pa.array(methods, pa.string()))
    return rows.set_column(j, rows.schema.field(j), pa.array([policy_version] * n, pa.string()))


def write_params(out: Path, params: ReuseParams) -> Path:
    """Record the gate's kappas and refresh knobs in ``OUT/reuse_params.json``, with the
    calibration used: none yet (the D7 defaults of 2; ``dsc_gate.calibrate_kappa`` on a
    calibration split is not run by the trainer)."""
    from dataclasses import asdict

    path = out / "reuse_params.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(params), "calibration": "none: placeholder "
                                "kappas (D7 not calibrated by the trainer)"}, indent=2) + "\n")
    return path


def log_line(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line to the run's ``reuse.jsonl`` (per stored tree per iteration:
    decisions, route values; the benchmark reads it for decision regret)."""
    cut = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as fh:  # a line a kill cut stays alone on its line
        fh.write(("\n" if cut else "") + json.dumps(record, sort_keys=True) + "\n")


__all__ = [
    "DECISIONS",
    "IS_MODES",
    "METHOD_SUFFIX",
    "REUSE_MODES",
    "SKIP_REASONS",
    "RefreshDraw",
    "Refreshed",
    "Resolution",
    "ReuseError",
    "ReuseParams",
    "Selection",
    "StoredStep",
    "check_reuse",
    "dsc_extras",
    "load_trees",
    "log_line",
    "policy_step",
    "refresh_routes",
    "rename_method",
    "resolve_stored",
    "resolve_tree",
    "reuse_filter",
    "score_actions",
    "select_stored",
    "tool_steps",
    "tree_problem",
    "with_returns",
]
