"""Training from stored plus fresh trees: reuse, transport or refresh historical credit
(issue 12). The trainer (``train.trainer``) calls ``write_params``, ``select_stored``,
``score_actions`` and ``resolve_stored`` each iteration; the math and the store I/O of
reuse live here.

Which stored trees. ``select_stored`` reads the store's ``trees`` view filtered by
``TrainConfig.reuse_from`` (default: this run's trees; a user's filter must be one boolean
expression over the view's columns, checked by ``reuse_filter`` and run on the locked-down
connection of ``rtrees sql``, issue 21) and keeps the trees of *earlier*
policy versions: a tree's version index is the checkpoint step of its ``policy_ref``
(``.../checkpoints/step-NNNNNN``); staleness = current iteration - that step. Refresh
trees (sampler ``refresh``, below) are training data of their iteration, never reused. Trees
are skipped and counted by a named reason (``SKIP_REASONS``): ``stale`` (staleness >
``max_staleness``), ``other_env``, ``unknown_version`` (no parseable checkpoint step, or
another run's checkpoint that is gone), ``other_tokenizer`` (another run whose
checkpoint tokenizer differs), ``no_logprobs`` (an action without its stored sampling
logprobs mu) and ``no_snapshot`` (refresh / dsc only: no root snapshot to continue
from). The eligible trees of the calibration split (``in_calib_split``: sha256 of the
tree id, as a fraction of 2^64, below ``CALIB_FRAC``) are held apart for the D7
calibration and never trained on, whatever the rule (so every rule trains on the same
pool). ``reuse_per_step`` trees are drawn from the other eligible ones with
``mix_seed(seed, "reuse", it)``; only they are read (``read_trees`` with their ids, the
filter pushed down to the scans), so a resumed run draws the same trees.

Sibling comparisons (D4 anchored at each branching node). Every node of a stored tree
with two or more children is a comparison; its children are the forced actions, the
trajectories the leaves below it, and transport is anchored there
(``dsc.transport_returns(anchor=...)``: z_t of the steps two or more levels below the
node only). The leader of a comparison is the child with the best stored mean return
(``dsc_gate``'s pairs). Per comparison, each child's value is chosen by the rule:

* ``all``: the plain mean of the stored returns R_i (Q_R);
* ``transport``: the mean of T_i of D4 (Q_T), z_t = pi_prox(A_t|S_t) / mu(A_t|S_t) - 1
  (D3) from a forward pass of the stored action tokens under the current (pre-update)
  weights (``score_actions``; no environment step), the cross-fitted baseline of
  ``train.credit.dsc``, no products of ratios;
* ``dsc``: the gate D8-D10 per leader-versus-competitor pair with radii r_X = kappa_X
  s_X (D7): a reused competitor keeps Q_R, a transported one gets Q_T, a refreshed one
  is refreshed; the leader is transported if any of its pairs is not reused and
  refreshed if any is refreshed [R];
* ``refresh``: every child is refreshed.

A comparison whose children are all leaves is reused under every rule [R]: there is no
step below its forced actions, so T_i = R_i and no policy can change the children's
values; a refresh would only redraw the environment's noise.

The credit estimator sees leaf returns, so the values are composed top-down
(``Resolution.compose``) [R]: leaves start at R_i; at each comparison in preorder (the
root first) the leaves below child c are shifted by one constant so that child c's
leaf mean becomes M + Q(c) - Qbar, M the current leaf mean below the node and Qbar the
leaf-weighted mean of the children's Q (at the root M = Qbar). The shifts below a node
keep its leaf sum, so after the pass the child means at *every* comparison differ by
exactly that comparison's values; with ``all`` the returns are the stored ones.

D7 calibration (``dsc`` only, ``calibrate_gate``). Unless kappas are given in
``reuse_params``, the gate starts with kappas 2 and is calibrated once, at the first
iteration with ``calib_trees`` eligible calibration-split trees: per tree (the most
recent versions first) the root comparison's pairs (kappas 1, zero residuals) against
targets from ``calib_draws`` new trajectories per root action under mu (the tree's own
checkpoint, ``load_policy_ref``) and under pi (the current weights): c_mu, c_pi of
those means. Trees alternate between ``calib`` and ``dev`` in hash order and
``dsc_gate.calibrate_radii`` (the gate study's calibration) gives the residual
variances (dev) and kappas (calib, level ``calib_level``). Where the calib trees are
too few to certify the level (ceil((n + 1) level) > n: n < 19 at 0.95) the order
statistic falls back to the maximum, and the kappa is then never below its start value
(a small calibration may widen the radii, not narrow them) [R]. The noise of the targets'
means enters the residual variance, so it widens the radii (conservative) [R]. The
draws are new tool steps and are counted in the iteration's ``new_tool_steps``. The
split, the trees, the kappas and their provenance are written to
``OUT/reuse_params.json`` and a ``calibration`` line of ``OUT/reuse.jsonl``; every tree
line of ``reuse.jsonl`` carries the kappas it was gated with.

Refresh (``refresh_routes``) runs the refresh protocol of ``train.sampling.refresh``
(``refresh_protocol`` over ``RefreshSampler``; the prior of a child from the values
above, D-section 5) per refreshed comparison, in preorder, with draws by
``PolicyRefresh``: restore the node's stored snapshot, reseed, force the stored child
action (its stored tokens and logprobs mu), continue with the current policy; cost in
tool calls, at most ``refresh_cap`` per stored tree. A comparison at a node without a
stored snapshot keeps its prior values. The refreshed children take the protocol's
posterior means in the composition. The new trajectories are committed as one new
tree per stored tree (sampler ``refresh``, the current ``policy_version`` /
``policy_ref``): the stored path from the root to each refreshed node is copied
(``nodes.meta.copy_of``, ``tool_calls`` 0: nothing new was spent there), the draws hang
below it; lineage in ``trees.meta``: ``refresh_of`` (the stored tree id),
``refresh_of_version``, ``refreshed_nodes`` and ``lineage`` ({new node id: stored child
node id} for each forced child); each forced node's ``nodes.meta`` also holds
``refresh_of``. The forced action's tokens keep the stored logprobs mu (they were
sampled by mu), so the behaviour weight (G8) corrects them as on any stored token.

The credit used for a stored tree is committed to ``credits`` under method
``{credit}+{reuse|transport|dsc|refresh}`` with the *current* policy version (the
version the credit is for), so audits can compare it with fresh credit.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rollout_store.reader import connect, read_trees
from rollout_store.sqlguard import (
    QueryLimitError,
    QueryLimits,
    UnsafeSQLError,
    checked_filter,
    run_limited,
)
from rollout_store.store import Store
from rollout_store.tree import Node, Tree
from train.batches import (
    NodeCredit,
    ProxLogp,
    TreeSeqs,
    forward_logprobs,
    make_rows,
    micro_batches,
)
from train.credit.base import TreeArrays, from_trees
from train.credit.dsc import RATIO, STATE, transport_returns
from train.credit.dsc_gate import DSCGateParams, calibrate_radii, dsc_gate
from train.credit.scores import score_trees, transcripts
from train.envs.base import Environment
from train.loss import IS_MODES
from train.policies.base import Policy
from train.sampling.base import SamplerConfig, mix_seed
from train.sampling.refresh import (
    Drawn,
    Forced,
    PolicyRefresh,
    RefreshSampler,
    refresh_protocol,
)

REUSE_MODES: tuple[str, ...] = ("none", "all", "transport", "dsc", "refresh")
METHOD_SUFFIX: dict[str, str] = {"all": "reuse", "transport": "transport", "dsc": "dsc",
                                 "refresh": "refresh"}
SKIP_REASONS: tuple[str, ...] = ("stale", "other_env", "unknown_version", "other_tokenizer",
                                 "no_logprobs", "no_snapshot")
DECISIONS: tuple[str, ...] = ("reuse", "transport", "refresh")
CALIB_FRAC: float = 0.25
"""Fraction of stored tree ids (by hash) held apart as the D7 calibration split."""
_STEP = re.compile(r"step-(\d+)/?$")
_KAPPAS = ("kappa_R", "kappa_delta", "kappa_T")
# ReuseParams repeats these fields of DSCGateParams flat, as ``--reuse-param`` keys
_GATE_FIELDS = tuple(f.name for f in fields(DSCGateParams))


class ReuseError(ValueError):
    """Reuse cannot start: a bad ``reuse_from`` filter or bad ``reuse_params``."""


@dataclass(frozen=True)
class ReuseParams:
    """Gate (D7), calibration and refresh-protocol knobs (``TrainConfig.reuse_params``)."""

    kappa_R: float = 2.0
    """D7 multiplier of s_R (the start value; calibrated when ``calibrate``)."""
    kappa_delta: float = 2.0
    """D7 multiplier of s_Delta."""
    kappa_T: float = 2.0
    """D7 multiplier of s_T."""
    residual_var_R: float = 0.0
    """D7 residual variance of c_R (set by the calibration's dev trees)."""
    residual_var_delta: float = 0.0
    """D7 residual variance of delta."""
    residual_var_T: float = 0.0
    """D7 residual variance of c_T."""
    calibrate: bool = True
    """``dsc``: calibrate the kappas (D7) on the calibration split; off when any kappa is
    given (unless ``calibrate`` is given too)."""
    calib_trees: int = 6
    """Calibration-split trees the calibration waits for and uses."""
    calib_draws: int = 4
    """New trajectories per root action and policy (mu, pi) for the calibration targets."""
    calib_level: float = 0.95
    """D7 conformal level of the kappas."""
    kappa_e: float = 2.0
    """Refresh protocol: a pair is resolved when |m_L - m_c| > kappa_e sqrt(v_L + v_c)."""
    refresh_batch: int = 4
    """Refresh protocol: new trajectories per round."""
    refresh_cap: int = 0
    """Refresh protocol: cap on the new tool steps spent on one stored tree; 0 (default):
    the tree's own tool steps, so refreshing a tree never costs more than collecting it
    again (the refresh-all baseline of the metrics)."""

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> ReuseParams:
        from train.coerce import coerce_fields

        names = {f.name: f for f in fields(cls)}
        for key in values:
            if key not in names:
                raise ValueError(f"unknown key {key!r}; keys: {', '.join(names)}")
        # train.coerce: text parsed by the field types, typed values checked, floats finite
        out: dict[str, Any] = coerce_fields(cls, values)
        if "calibrate" not in out and any(k in out for k in _KAPPAS):
            out["calibrate"] = False  # the kappas given are the ones to use
        p = cls(**out)
        if min(p.kappa_R, p.kappa_delta, p.kappa_T, p.kappa_e) < 0 or min(
                p.residual_var_R, p.residual_var_delta, p.residual_var_T) < 0:
            raise ValueError("kappas and residual variances must be >= 0")
        if p.refresh_cap < 0:
            raise ValueError("refresh_cap must be >= 0 (0: the stored tree's own tool steps)")
        if p.refresh_batch < 1 or p.calib_trees < 1 or p.calib_draws < 1:
            raise ValueError("refresh_batch, calib_trees and calib_draws must "
                             "be >= 1")
        if not 0.0 < p.calib_level < 1.0:
            raise ValueError(f"calib_level must be in (0, 1), got {p.calib_level}")
        return p

    def gate(self) -> DSCGateParams:
        return DSCGateParams(**self.kappas())

    def with_kappas(self, values: Mapping[str, float]) -> ReuseParams:
        """A copy with the kappas / residual variances in ``values`` (keys of ``kappas``)."""
        unknown = set(values) - set(_GATE_FIELDS)
        if unknown:
            raise ValueError(f"not a kappa or residual variance: {sorted(unknown)}")
        changes: dict[str, Any] = {k: float(v) for k, v in values.items()}
        return replace(self, **changes)

    def kappas(self) -> dict[str, float]:
        """The gate's fields (those of ``DSCGateParams``): kappas and residual variances."""
        return {name: getattr(self, name) for name in _GATE_FIELDS}


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


def reuse_filter(reuse_from: str, run_id: str) -> tuple[str, list[Any]]:
    """The filter over ``trees`` and its bound parameters: ``reuse_from`` checked to be one
    boolean expression over the view's columns (``rollout_store.sqlguard.checked_filter``:
    no statements, no table functions, no subqueries, no file access; ``ReuseError``
    otherwise), or this run's own trees (``run_id = ?``)."""
    if not reuse_from:
        return "run_id = ?", [run_id]
    try:
        return checked_filter(reuse_from, what="reuse_from"), []
    except UnsafeSQLError as exc:
        raise ReuseError(str(exc)) from exc


def _filtered(store: Store, query: str, params: list[Any]) -> list[tuple[Any, ...]]:
    """Rows of ``query`` (a filter over ``trees`` built by ``reuse_filter``) on the
    locked-down connection of ``rtrees sql`` (``connect(restricted=True)``: external
    access off, memory and time bounded)."""
    con = connect(store, restricted=True)
    limits = QueryLimits()
    try:
        return run_limited(con, lambda: con.execute(query, params).fetchall(),
                           limits.timeout_s, limits.memory)
    finally:
        con.close()


def check_reuse(store: Store, reuse_from: str, run_id: str) -> None:
    """Refuse (before training) a ``reuse_from`` filter that is not a checked expression
    over ``trees`` (``reuse_filter``), one the view cannot evaluate, or an explicit one
    that selects no tree."""
    where, params = reuse_filter(reuse_from, run_id)
    try:
        [(count,)] = _filtered(store, f"SELECT count(*) FROM trees WHERE {where}", params)
    except QueryLimitError as exc:
        raise ReuseError(f"reuse_from {reuse_from!r}: {exc}") from exc
    except Exception as exc:  # duckdb raises its own error classes
        import duckdb

        if not isinstance(exc, duckdb.Error):
            raise
        raise ReuseError(f"reuse_from {reuse_from!r} is not a valid filter over trees: "
                         f"{str(exc).splitlines()[0]}") from exc
    if reuse_from and not count:
        raise ReuseError(f"reuse_from {reuse_from!r} selects no stored tree in {store.path}")


def split_hash(tree_id: str) -> float:
    """sha256 of ``tree_id`` as a fraction in [0, 1) (its first 8 bytes over 2^64)."""
    return int.from_bytes(hashlib.sha256(tree_id.encode()).digest()[:8], "big") / 2.0**64


def in_calib_split(tree_id: str) -> bool:
    """The tree belongs to the D7 calibration split (held apart, never trained on)."""
    return split_hash(tree_id) < CALIB_FRAC


@dataclass
class Selection:
    """The stored trees drawn for one iteration (training), what was skipped (per
    reason), and the eligible calibration-split trees (id, staleness), never trained on."""

    trees: list[Tree]
    staleness: list[int]
    skipped: Counter[str] = field(default_factory=Counter)
    calib: list[tuple[str, int]] = field(default_factory=list)
    store: Store | None = None


def select_stored(store: Store, *, reuse_from: str, run_id: str, env: str, iteration: int,
                  max_staleness: int, per_step: int, seed: int, need_snapshots: bool,
                  tokenizer_dir: str | None) -> Selection:
    """Stored trees of earlier policy versions for ``iteration`` (module docstring)."""
    where, params = reuse_filter(reuse_from, run_id)
    rows = _filtered(store, "SELECT tree_id, env, run_id, policy_ref FROM trees WHERE "
                            f"sampler <> 'refresh' AND {where} ORDER BY tree_id", params)
    mine = _tokenizer_fingerprint(tokenizer_dir) if tokenizer_dir else None
    prints: dict[str, str | None] = {}
    skipped: Counter[str] = Counter()
    eligible: list[tuple[str, int]] = []
    calib: list[tuple[str, int]] = []
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
        (calib if in_calib_split(tree_id) else eligible).append((tree_id, iteration - step))
    if not eligible:
        return Selection([], [], skipped, calib, store)
    rng = np.random.default_rng(mix_seed(seed, "reuse", iteration))
    picks = sorted(rng.choice(len(eligible), size=min(per_step, len(eligible)),
                              replace=False).tolist())
    wanted = [eligible[i] for i in picks]
    # with snapshots whatever the rule: nodes name them, and a batch (credit_for) must
    # hold every snapshot its nodes name
    trees = read_trees(store, [t for t, _ in wanted], snapshots=True)
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
    return Selection(out, stale, skipped, calib, store)


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
class Comparison:
    """One branching node of a stored tree and how its children were resolved.

    ``node`` the node id; ``children`` its child node ids (the forced actions);
    ``use`` {child: "reuse" | "transport" | "refresh"}; ``value`` {child: Q under the rule
    before any refresh}; ``prior`` {child: (mean, variance of the mean, N)} of the
    per-leaf values used (the refresh protocol's prior); ``leaves`` {child: leaf ids};
    ``plain`` {child: Q_R, the plain mean of the stored returns}.
    """

    node: int
    children: list[int]
    use: dict[int, str]
    value: dict[int, float]
    prior: dict[int, tuple[float, float, int]]
    leaves: dict[int, list[int]]
    plain: dict[int, float]

    @property
    def refresh(self) -> list[int]:
        return [c for c in self.children if self.use[c] == "refresh"]


@dataclass
class Resolution:
    """How one stored tree's comparisons were resolved.

    ``comparisons`` in preorder; ``route_of`` {leaf: its root action}; ``pairs``
    decisions counted per ``DECISIONS`` over all comparisons; ``transported`` /
    ``reward`` the root-anchored D4 T_i and the stored R_i per leaf; ``root`` the root's
    node id.
    """

    comparisons: list[Comparison]
    route_of: dict[int, int]
    pairs: Counter[str]
    transported: dict[int, float]
    reward: dict[int, float]
    root: int = 0

    @property
    def refresh(self) -> list[int]:
        """The root's children to refresh (empty when the root is not a comparison)."""
        at_root = [c for c in self.comparisons if c.node == self.root]
        return at_root[0].refresh if at_root else []

    @property
    def returns(self) -> dict[int, float]:
        """{leaf: the return its credit uses} without refresh posteriors."""
        return self.compose({})

    def compose(self, posterior: Mapping[tuple[int, int], float]) -> dict[int, float]:
        """Leaf returns whose child means at every comparison differ by its values
        (module docstring); ``posterior`` {(node, child): posterior mean} overrides the
        value of a refreshed child."""
        ret = dict(self.reward)
        for k, comp in enumerate(self.comparisons):
            q = {c: float(posterior.get((comp.node, c), comp.value[c])) for c in comp.children}
            if q == comp.plain:  # the stored means: every shift above kept their gaps
                continue
            n = {c: len(comp.leaves[c]) for c in comp.children}
            qbar = sum(n[c] * q[c] for c in comp.children) / sum(n.values())
            below = [leaf for c in comp.children for leaf in comp.leaves[c]]
            level = qbar if k == 0 else float(np.mean([ret[leaf] for leaf in below]))
            for c in comp.children:
                shift = level + q[c] - qbar - float(np.mean([ret[x] for x in comp.leaves[c]]))
                for leaf in comp.leaves[c]:
                    ret[leaf] += shift
        return ret


def _stats(values: Sequence[float]) -> tuple[float, float, int]:
    vals = np.asarray(values, np.float64)
    var = float(vals.var(ddof=1)) / vals.size if vals.size > 1 else 0.0
    return float(vals.mean()), var, int(vals.size)


def resolve_tree(tree: Tree, mode: str, prox: ProxLogp, params: ReuseParams) -> Resolution:
    """Resolve every branching node's leader-versus-competitor pairs by ``mode``
    (module docstring): D3-D5 via ``transport_returns`` and D7-D10 via ``dsc_gate``,
    both anchored at the node (D4)."""
    if mode not in REUSE_MODES[1:]:
        raise ValueError(f"unknown reuse mode {mode!r}; choose from {REUSE_MODES[1:]}")
    arrays = from_trees([tree], dsc_extras(tree, prox))
    ids = arrays.node_ids
    root_tr = transport_returns(arrays)
    leaves = [int(ids[r]) for r in root_tr.leaf]
    route_of = {leaf: int(ids[a]) for leaf, a in zip(leaves, root_tr.action, strict=True)}
    reward = {leaf: float(v) for leaf, v in zip(leaves, root_tr.reward, strict=True)}
    transported = {leaf: float(v)
                   for leaf, v in zip(leaves, root_tr.transported, strict=True)}
    parent = arrays.parent
    n_children = np.bincount(parent[parent >= 0], minlength=arrays.n_nodes)
    pairs: Counter[str] = Counter()
    comparisons: list[Comparison] = []
    gate = params.gate()
    for row in np.flatnonzero(n_children >= 2).tolist():  # preorder
        anchor = np.array([row])
        tr = transport_returns(arrays, anchor)
        child_of = {int(ids[lf]): int(ids[a]) for lf, a in zip(tr.leaf, tr.action, strict=True)}
        r_of = {int(ids[lf]): float(v) for lf, v in zip(tr.leaf, tr.reward, strict=True)}
        t_of = {int(ids[lf]): float(v) for lf, v in zip(tr.leaf, tr.transported, strict=True)}
        children = [int(ids[c]) for c in np.flatnonzero(parent == row)]
        below = {c: [lf for lf, a in child_of.items() if a == c] for c in children}
        use: dict[int, str] = {}
        if not any(n_children[c] for c in np.flatnonzero(parent == row)):
            # every child is a leaf: no step below the forced actions, so no policy can
            # change their values (T = R) and a refresh would redraw only the env's noise
            pairs["reuse"] += len(children) - 1
            use = {c: "reuse" for c in children}
        elif mode == "dsc":
            g = dsc_gate(arrays, gate, anchor)
            comps = [int(ids[r]) for r in g.competitor]
            for comp, decision in zip(comps, g.decision.tolist(), strict=True):
                use[comp] = decision
                pairs[decision] += 1
            others = [use[c] for c in comps]
            for lead in {int(ids[r]) for r in g.leader}:
                use[lead] = ("refresh" if "refresh" in others else
                             "transport" if "transport" in others else "reuse")
        else:
            decision = {"all": "reuse", "transport": "transport", "refresh": "refresh"}[mode]
            pairs[decision] += len(children) - 1
            use = {c: decision for c in children}
        prior = {c: _stats([(r_of if use[c] == "reuse" else t_of)[lf] for lf in below[c]])
                 for c in children}
        plain = {c: _stats([r_of[lf] for lf in below[c]])[0] for c in children}
        comparisons.append(Comparison(int(ids[row]), children, use,
                                      {c: prior[c][0] for c in children}, prior, below, plain))
    return Resolution(comparisons, route_of, pairs, transported, reward, tree.root().node_id)


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

def forced(node: Node) -> Forced:
    """A stored node's action, to be forced first by ``PolicyRefresh``."""
    return Forced(node.action_text, tuple(node.action_token_ids), tuple(node.action_logprobs),
                  tuple(node.action_entropies), tuple(node.segments))


def node_draws(tree: Tree, node_id: int, children: Sequence[int], env: Environment,
               policy: Policy, *, seed: int, max_new_tokens: int, temperature: float,
               records: bool) -> PolicyRefresh | None:
    """``PolicyRefresh`` from stored node ``node_id`` (its snapshot, transcript and depth)
    with ``children``'s stored actions forced first; key parts (tree id, child id); cost
    in tool calls. None when the node has no stored snapshot."""
    n = tree.node(node_id)
    if n.snapshot_id is None or n.snapshot_id not in tree.snapshots:
        return None
    path = tree.path_to(node_id)
    return PolicyRefresh(
        env, policy, transcripts(tree)[node_id], tree.snapshots[n.snapshot_id],
        [forced(tree.node(c)) for c in children],
        max_steps=(tree.env_config or {}).get("max_steps"), seed=seed,
        config=SamplerConfig(max_new_tokens=max_new_tokens, temperature=temperature),
        key_parts=[(tree.tree_id, c) for c in children], budget="tool_calls",
        records=records, depth=len(path) - 1)


@dataclass
class Refreshed:
    """The outcome of refreshing one stored tree: the new tree (None when the protocol
    drew nothing), the posterior mean per refreshed (node, child), new tool steps spent,
    and the refreshed comparisons that had no snapshot to continue from."""

    tree: Tree | None
    posterior: dict[tuple[int, int], float]
    steps: int
    no_snapshot: int = 0


def refresh_routes(tree: Tree, res: Resolution, env: Environment, policy: Policy, *,
                   tree_id: str, run_id: str, seed: int, params: ReuseParams,
                   max_new_tokens: int, temperature: float) -> Refreshed:
    """Refresh the refreshed children of every comparison of ``res`` (preorder) with the
    refresh protocol of ``train.sampling.refresh`` (prior from the comparison's
    ``prior``) and ``PolicyRefresh`` draws from the node's stored snapshot, at most
    ``params.refresh_cap`` new tool steps for the tree (0: ``tool_steps(tree)``); returns
    the new tree with its lineage (module docstring)."""
    posterior: dict[tuple[int, int], float] = {}
    groups: list[tuple[int, list[int], list[Drawn]]] = []
    spent = missing = 0
    cap = params.refresh_cap or max(tool_steps(tree), 1)
    for comp in res.comparisons:
        routes = comp.refresh
        if len(routes) < 2 or spent >= cap:
            continue
        draw = node_draws(tree, comp.node, routes, env, policy, seed=seed,
                          max_new_tokens=max_new_tokens, temperature=temperature,
                          records=True)
        if draw is None:
            missing += 1
            continue
        sampler = RefreshSampler(draw)
        mean = np.array([comp.prior[c][0] for c in routes])
        var = np.array([comp.prior[c][1] for c in routes])
        n_old = np.array([comp.prior[c][2] for c in routes], np.float64)
        # the protocol's Beta prior takes returns in [0, 1] (transported ones are clipped)
        out = refresh_protocol(mean, var, n_old, list(range(len(routes))), sampler,
                               kappa_e=params.kappa_e, cap_steps=cap - spent,
                               batch=params.refresh_batch)
        posterior.update({(comp.node, c): float(out.mean[i]) for i, c in enumerate(routes)})
        drawn = [d for _, d in sorted(sampler.cache.items())]
        spent += sum(d.steps for d in drawn)
        if drawn:
            groups.append((comp.node, routes, drawn))
    if not groups:
        return Refreshed(None, posterior, spent, missing)
    new = _refresh_tree(tree, groups, tree_id=tree_id, run_id=run_id, policy=policy,
                        seed=seed)
    return Refreshed(new, posterior, spent, missing)


def _refresh_tree(tree: Tree, groups: Sequence[tuple[int, list[int], list[Drawn]]], *,
                  tree_id: str, run_id: str, policy: Policy, seed: int) -> Tree:
    root = tree.root()
    encode: Callable[[str], list[int]] | None = getattr(policy, "encode", None)
    nodes = [Node(node_id=0, parent_id=None, kind="prompt",
                  observation_text=root.observation_text, snapshot_id=f"{tree_id}/0")]
    snapshots = {f"{tree_id}/0": tree.snapshots[root.snapshot_id or ""]}
    copied = {root.node_id: 0}  # stored node id -> new node id (the copied paths)
    lineage: dict[str, int] = {}
    n_drawn = env_steps = 0
    for node_id, routes, drawn in groups:
        for stored in tree.path_to(node_id)[1:]:
            if stored.node_id in copied:
                continue
            nid = len(nodes)
            has = stored.snapshot_id is not None and stored.snapshot_id in tree.snapshots
            nodes.append(replace(
                stored, node_id=nid, parent_id=copied[stored.parent_id or 0],
                snapshot_id=f"{tree_id}/{nid}" if has else None, tool_calls=0,
                phase="refresh", reward=None, reward_parts={}, terminal=False,
                meta={**(stored.meta or {}), "copy_of": stored.node_id}))
            if has:
                snapshots[f"{tree_id}/{nid}"] = tree.snapshots[stored.snapshot_id or ""]
            copied[stored.node_id] = nid
        for d in drawn:
            n_drawn += 1
            env_steps += len(d.records)
            parent = copied[node_id]
            for j, s in enumerate(d.records):
                nid = len(nodes)
                leaf = s.done or j == len(d.records) - 1
                meta: dict[str, Any] | None = None
                if j == 0:
                    child = tree.node(routes[d.route])
                    kind = child.kind
                    meta = {"refresh_of": {"tree_id": tree.tree_id, "node_id": child.node_id}}
                    lineage[str(nid)] = child.node_id
                else:
                    feedback = "<tool_response>" in nodes[parent].observation_text
                    kind = "feedback_response" if feedback else "decision"
                if s.truncated:
                    meta = {**(meta or {}), "truncated": True}
                nodes.append(Node(
                    node_id=nid, parent_id=parent, kind=kind,
                    action_text=s.action_text, action_token_ids=list(s.token_ids),
                    action_logprobs=list(s.logprobs), action_entropies=list(s.entropies),
                    observation_text=s.observation,
                    observation_token_ids=[int(i) for i in encode(s.observation)]
                    if callable(encode) and s.observation else [],
                    segments=list(s.segments), terminal=s.done,
                    reward=float(s.reward_parts.get("reward", 0.0))
                    if leaf and not s.truncated else (0.0 if leaf else None),
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
        budget=n_drawn, rollouts_by_phase={"refresh": n_drawn}, seed=seed,
        meta={"refresh_of": tree.tree_id, "refresh_of_version": tree.policy_version,
              "refreshed_nodes": [g[0] for g in groups], "lineage": lineage,
              "env_steps": env_steps},
        snapshots=snapshots)


# ------------------------------------------------------------------- calibration (D7)

def _ratio_scores(trees: Sequence[Tree], policy: Policy) -> ProxLogp:
    """{(tree id, node id): (1,) sum log pi} of every depth >= 2 action under ``policy``
    (``score_trees``, kind ``action``: the action text re-scored by the policy)."""
    table = score_trees(trees, policy, "action")
    return {(t, n): np.array([v]) for t, n, v in zip(
        table.column("tree_id").to_pylist(), table.column("node_id").to_pylist(),
        table.column("value").to_pylist(), strict=True)}


def _route_means(tree: Tree, children: Sequence[int], env: Environment, policy: Policy, *,
                 k: int, seed: int, max_new_tokens: int, temperature: float
                 ) -> tuple[np.ndarray, int]:
    """(A,) mean return of ``k`` new trajectories per root child under ``policy`` and the
    tool steps they spent."""
    draw = node_draws(tree, tree.root().node_id, children, env, policy, seed=seed,
                      max_new_tokens=max_new_tokens, temperature=temperature, records=False)
    assert draw is not None  # calibration trees passed tree_problem(need_snapshots=True)
    got = [[draw(a, j) for j in range(k)] for a in range(len(children))]
    return (np.array([np.mean([d.reward for d in ds]) for ds in got]),
            sum(d.steps for ds in got for d in ds))


def calibrate_gate(trees: Sequence[Tree], params: ReuseParams, env: Environment,
                   policy: Policy, *, seed: int, max_new_tokens: int, temperature: float,
                   load_mu: Callable[[Tree], Policy]) -> tuple[ReuseParams, dict[str, Any]]:
    """D7 on calibration-split ``trees`` (module docstring): the root comparison's pairs
    (kappas 1, zero residuals; ratios pi/mu from ``policy``'s scores) against c_mu, c_pi
    of ``params.calib_draws`` new trajectories per root action under ``load_mu(tree)``
    and ``policy``; trees alternate calib / dev in the given order. Returns the params
    with the calibrated kappas and residual variances (a kappa without calib pairs keeps
    its start value; one from too few calib trees to certify the level is at least its
    start value) and the record written to the run."""
    split: dict[str, str] = {}
    usable: list[Tree] = []
    problems: Counter[str] = Counter()
    mus: list[Policy] = []
    for tree in trees:
        if len(tree.children()[tree.root().node_id]) < 2:
            problems["one_root_action"] += 1
            continue
        try:
            mus.append(load_mu(tree))
        except (OSError, ValueError, RuntimeError):  # a pruned or foreign checkpoint
            problems["no_mu_checkpoint"] += 1
            continue
        split[tree.tree_id] = "calib" if len(usable) % 2 == 0 else "dev"
        usable.append(tree)
    record: dict[str, Any] = {"split": f"sha256(tree_id)/2^64 < {CALIB_FRAC}",
                              "trees": split, "skipped": dict(problems), "tool_steps": 0}
    if not usable:
        record["status"] = "no usable calibration tree: start kappas kept"
        return params, record
    prox = _ratio_scores(usable, policy)
    extras = [dsc_extras(t, prox) for t in usable]
    arrays: TreeArrays = from_trees(list(usable), {
        k: np.concatenate([e[k] for e in extras]) for k in (RATIO, STATE)})
    pairs = dsc_gate(arrays, DSCGateParams(kappa_R=1.0, kappa_delta=1.0, kappa_T=1.0))
    steps = 0
    at_row: list[np.ndarray] = [np.zeros(arrays.n_nodes), np.zeros(arrays.n_nodes)]
    row_of = {(arrays.tree_ids[int(arrays.node_tree[r])], int(arrays.node_ids[r])): r
              for r in range(arrays.n_nodes)}
    for tree, mu in zip(usable, mus, strict=True):
        children = tree.children()[tree.root().node_id]
        key = mix_seed(seed, "calibrate", tree.tree_id)
        for which, pol in enumerate((mu, policy)):
            means, spent = _route_means(tree, children, env, pol, k=params.calib_draws,
                                        seed=mix_seed(key, which), max_new_tokens=max_new_tokens,
                                        temperature=temperature)
            steps += spent
            for c, m in zip(children, means, strict=True):
                at_row[which][row_of[(tree.tree_id, c)]] = m
    c_mu = at_row[0][pairs.leader] - at_row[0][pairs.competitor]
    c_pi = at_row[1][pairs.leader] - at_row[1][pairs.competitor]
    calib = calibrate_radii([(pairs, c_mu, c_pi)],
                            [split[arrays.tree_ids[b]] for b in range(arrays.n_trees)],
                            params.calib_level)
    new: dict[str, float] = {}
    start = params.kappas()
    for x in ("R", "delta", "T"):
        kappa = calib[x]["kappa"]
        if calib[x]["kappa_fallback_to_max"]:
            # too few calib trees to certify the level: the calibration may only widen
            kappa = max(kappa, start[f"kappa_{x}"])
            calib[x]["kappa_floored_at_start"] = True
        if math.isfinite(kappa):
            new[f"kappa_{x}"] = float(kappa)
        new[f"residual_var_{x}"] = float(calib[x]["residual_var"])
    record.update({"status": "calibrated", "tool_steps": steps, "n_pairs": len(c_mu),
                   "level": params.calib_level, "draws_per_action": params.calib_draws,
                   "radii": calib})
    return params.with_kappas(new), record


def _read_record(out: Path) -> dict[str, Any]:
    path = out / "reuse_params.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def gate_params(sel: Selection, params: ReuseParams, env: Environment, policy: Policy, *,
                out: Path | None, iteration: int, seed: int, max_new_tokens: int,
                temperature: float) -> tuple[ReuseParams, int, dict[str, Any] | None]:
    """The gate's params for ``iteration`` of a ``dsc`` run: the calibration recorded in
    ``out/reuse_params.json`` by an earlier iteration, or a calibration now (when
    ``params.calibrate`` and ``calib_trees`` calibration-split trees are eligible), or
    the start kappas. Returns (params, new tool steps the calibration spent now, its
    record when it ran now). A resumed iteration that had calibrated calibrates again
    (the same draws), so its counts match an uninterrupted run."""
    if not params.calibrate or out is None:
        return params, 0, None
    done = _read_record(out).get("calibration") or {}
    if isinstance(done, dict) and done.get("status") == "calibrated" and \
            int(done.get("iteration", iteration)) < iteration:
        return params.with_kappas(done["kappas"]), 0, None
    if len(sel.calib) < params.calib_trees or sel.store is None:
        return params, 0, None
    order = sorted(sel.calib, key=lambda t: (t[1], split_hash(t[0])))[:params.calib_trees]
    trees = [t for t in read_trees(sel.store, [i for i, _ in order])
             if tree_problem(t, True) is None]
    by_id = {t.tree_id: t for t in trees}
    trees = [by_id[i] for i, _ in order if i in by_id]
    from train.policies import load_policy_ref

    cache: dict[str, Policy] = {}

    def load_mu(tree: Tree) -> Policy:
        ref = str(tree.policy_ref)
        if ref not in cache:
            cache[ref] = load_policy_ref(ref, tree.env, tree.policy_version)
        return cache[ref]

    new, record = calibrate_gate(trees, params, env, policy, seed=seed,
                                 max_new_tokens=max_new_tokens, temperature=temperature,
                                 load_mu=load_mu)
    record.update({"iteration": iteration, "kappas": new.kappas(),
                   "start_kappas": params.kappas()})
    if record.get("status") == "calibrated":
        write_params(out, new, record)
    return new, int(record["tool_steps"]), record


@dataclass
class StoredStep:
    """One iteration's stored trees after resolution: ``credited`` (copies carrying the
    rule's returns, for the credit estimator), ``refreshed`` (new trees to commit), pair
    decisions per ``DECISIONS`` and the new tool steps the refreshes (and a D7
    calibration, when one ran) spent."""

    credited: list[Tree]
    refreshed: list[Tree]
    pairs: Counter[str]
    new_tool_steps: int
    calibration_tool_steps: int = 0
    """Of ``new_tool_steps``, those the D7 calibration draws spent (0 but once)."""


def resolve_stored(sel: Selection, mode: str, prox: ProxLogp, params: ReuseParams,
                   env: Environment, policy: Policy, *, run_id: str, iteration: int,
                   seed: int, max_new_tokens: int, temperature: float,
                   log: Path | None = None) -> StoredStep:
    """``resolve_tree`` then ``refresh_routes`` for every selected tree, returns composed
    with the protocol's posterior means. Refresh tree ids are
    ``RUN/itNNNNNN/refresh/JJJ``; draws are seeded by (seed, "refresh", iteration). With
    ``dsc`` the gate's params come from ``gate_params`` (the D7 calibration lives in
    ``log``'s directory, the run's OUT)."""
    step = StoredStep([], [], Counter(), 0)
    calibrated = False
    if mode == "dsc":
        params, spent, record = gate_params(
            sel, params, env, policy, out=None if log is None else log.parent,
            iteration=iteration, seed=seed, max_new_tokens=max_new_tokens,
            temperature=temperature)
        step.new_tool_steps += spent
        step.calibration_tool_steps = spent
        if log is not None and record is not None:
            log_line(log, {"iteration": iteration, "calibration": record})
        done = _read_record(log.parent).get("calibration") if log is not None else None
        calibrated = isinstance(done, dict) and done.get("status") == "calibrated"
    for j, (old, stale) in enumerate(zip(sel.trees, sel.staleness, strict=True)):
        res = resolve_tree(old, mode, prox, params)
        step.pairs.update(res.pairs)
        got = refresh_routes(old, res, env, policy,
                             tree_id=f"{run_id}/it{iteration:06d}/refresh/{j:03d}",
                             run_id=run_id, seed=mix_seed(seed, "refresh", iteration),
                             params=params, max_new_tokens=max_new_tokens,
                             temperature=temperature)
        returns = res.compose(got.posterior)
        step.credited.append(with_returns(old, returns))
        step.new_tool_steps += got.steps
        if got.tree is not None:
            step.refreshed.append(got.tree)
        if log is not None:
            values = {str(r): float(np.mean([v for x, v in returns.items()
                                             if res.route_of[x] == r]))
                      for r in sorted(set(res.route_of.values()))}
            record = {"iteration": iteration, "tree_id": old.tree_id, "staleness": stale,
                      "pairs": dict(res.pairs), "refresh": res.refresh,
                      "refreshed_nodes": sorted({n for n, _ in got.posterior}),
                      "refresh_no_snapshot": got.no_snapshot, "refresh_steps": got.steps,
                      "route_values": values, "mode": mode}
            if mode == "dsc":
                record.update({"kappas": params.kappas(), "calibrated": calibrated})
            log_line(log, record)
    return step


def rename_method(rows: pa.Table, suffix: str, policy_version: str) -> pa.Table:
    """``credits`` rows with method ``METHOD+suffix`` and the current policy version."""
    n = rows.num_rows
    methods = [f"{m}+{suffix}" for m in rows.column("method").to_pylist()]
    i, j = rows.schema.get_field_index("method"), rows.schema.get_field_index("policy_version")
    rows = rows.set_column(i, rows.schema.field(i), pa.array(methods, pa.string()))
    return rows.set_column(j, rows.schema.field(j), pa.array([policy_version] * n, pa.string()))


def write_params(out: Path, params: ReuseParams,
                 calibration: Mapping[str, Any] | None = None) -> Path:
    """Record the gate's kappas, refresh and calibration knobs in
    ``OUT/reuse_params.json`` with the D7 calibration: ``calibration`` when given (what
    ``gate_params`` ran), else the one already recorded there (a resumed run keeps it),
    else a pending note naming the split."""
    path = out / "reuse_params.json"
    out.mkdir(parents=True, exist_ok=True)
    if calibration is None:
        kept = _read_record(out).get("calibration")
        if isinstance(kept, dict) and kept.get("status") == "calibrated":
            calibration = kept
            params = params.with_kappas(kept["kappas"])
        else:
            calibration = {"status": "pending" if params.calibrate else
                           "off: the kappas given are used",
                           "split": f"sha256(tree_id)/2^64 < {CALIB_FRAC} (held apart, "
                           "never trained on)"}
    text = json.dumps({**asdict(params), "calibration": dict(calibration)}, indent=2)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)  # a kill never leaves half a record
    return path


def log_line(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line to the run's ``reuse.jsonl`` (per stored tree per iteration:
    decisions, route values; the benchmark reads it for decision regret)."""
    cut = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as fh:  # a line a kill cut stays alone on its line
        fh.write(("\n" if cut else "") + json.dumps(record, sort_keys=True) + "\n")


__all__ = [
    "CALIB_FRAC",
    "DECISIONS",
    "IS_MODES",
    "METHOD_SUFFIX",
    "REUSE_MODES",
    "SKIP_REASONS",
    "Comparison",
    "Refreshed",
    "Resolution",
    "ReuseError",
    "ReuseParams",
    "Selection",
    "StoredStep",
    "calibrate_gate",
    "check_reuse",
    "dsc_extras",
    "forced",
    "gate_params",
    "in_calib_split",
    "log_line",
    "node_draws",
    "policy_step",
    "refresh_routes",
    "rename_method",
    "resolve_stored",
    "resolve_tree",
    "reuse_filter",
    "score_actions",
    "select_stored",
    "split_hash",
    "tool_steps",
    "tree_problem",
    "with_returns",
    "write_params",
]
