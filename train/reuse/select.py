"""Which stored trees an iteration trains on, and why the others are skipped
(docs/METHODS.md section 9, "Which stored trees").

``select_stored`` reads the store's ``trees`` view filtered by ``TrainConfig.reuse_from``
(default: this run's trees; a user's filter is one boolean expression over the view's
columns, checked by ``reuse_filter`` and run on the locked-down connection of ``rtrees
sql``) and keeps the trees of earlier policy versions (staleness = current iteration -
the checkpoint step of the tree's ``policy_ref``). Skips are counted by ``SKIP_REASONS``;
the calibration split (``in_calib_split``) is held apart for D7 and never trained on;
``reuse_per_step`` trees are drawn from the rest with ``mix_seed(seed, "reuse", it)``.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollout_store.reader import connect, read_trees
from rollout_store.sqlguard import (
    QueryLimitError,
    QueryLimits,
    UnsafeSQLError,
    checked_filter,
    run_limited,
)
from rollout_store.store import Store
from rollout_store.tree import Tree
from train.reuse.params import CALIB_FRAC, ReuseError
from train.reuse.resolve import thickest_gated_pair
from train.sampling.base import mix_seed

SKIP_REASONS: tuple[str, ...] = ("stale", "other_env", "unknown_version", "other_tokenizer",
                                 "no_logprobs", "no_snapshot", "thin")
"""Why a stored tree is not trained on; ``thin`` is the gated rules' refusal
(``refuse_thin``)."""
_STEP = re.compile(r"step-(\d+)/?$")


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
    access off, memory and time bounded, the process's memory growth too:
    ``sqlguard.run_limited``)."""
    con = connect(store, restricted=True)
    limits = QueryLimits()
    try:
        return run_limited(con, lambda: con.execute(query, params).fetchall(), limits)
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


def refuse_thin(sel: Selection, need: int, *, rule: str, iteration: int) -> Selection:
    """``sel`` without its thin trees (``thickest_gated_pair`` below ``need``; counted as
    skip reason ``thin``). ``ReuseError`` when every selected tree is thin: a gated rule
    could then only refresh, at the cost of collecting them again."""
    keep: list[int] = []
    most = 0
    for i, tree in enumerate(sel.trees):
        got = thickest_gated_pair(tree)
        if got is None or got >= need:
            keep.append(i)
        else:
            most = max(most, got)
    if sel.trees and not keep:
        raise ReuseError(
            f"reuse {rule}: all {len(sel.trees)} stored trees of iteration {iteration} are "
            f"too thin to gate (the best pair has {most} trajector{'y' if most == 1 else 'ies'}"
            f" a side, the gate needs {need}): store denser trees (e.g. --sampler rooted "
            f"--sampler-param n_root=2 --set n_total={2 * need}), use --reuse transport or "
            f"refresh, or pass --reuse-param min_trajectories=1 to gate them anyway")
    skipped = Counter(sel.skipped)
    skipped["thin"] += len(sel.trees) - len(keep)
    return Selection([sel.trees[i] for i in keep], [sel.staleness[i] for i in keep],
                     skipped, sel.calib, sel.store)


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


__all__ = ["SKIP_REASONS", "Selection", "check_reuse", "in_calib_split", "policy_step",
           "refuse_thin", "reuse_filter", "select_stored", "split_hash", "tree_problem"]
