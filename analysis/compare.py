"""Comparisons a rollout tree aligns for free (issue 48): siblings at their branch point,
N trajectories by step, two runs' metrics.

Pure functions over ``rollout_store.tree.Tree`` and plain dicts; the viewer
(``analysis.viewer.data.ViewerData``) fetches credit and Mean@k rows and calls them, and
``rtrees diff`` / ``rtrees compare`` print what they return.

* ``sibling_diff(tree, node_id, ...)``: the children of a branching node side by side.
  Siblings share every step up to the branch point (the node), so no alignment is
  guessed: column ``c`` is child ``c``'s continuation, the child then, at each step, its
  first child in preorder down to a leaf. Step ``i`` of every column is at depth
  ``depth(node) + 1 + i``. Each column carries the child's subtree outcome (leaves,
  successes, mean leaf reward), its Mean@k references, its credit under every method,
  and, against a reference column (the first child unless chosen), the first step whose
  action differs (``action_parts_at``) and the first whose outcome (observation text or
  reward) differs (``outcome_parts_at``), with the differing tokens of every action marked
  (``token_diff``).
* ``compare_trajectories(items)``: any root-to-leaf paths (same task, other runs, policy
  versions, samplers or stores) in columns aligned by step (step ``i`` = depth ``i``, the
  prompt is step 0), diffed against the first column the same way.
* ``wilson_interval(k, n)``: the interval the metrics diff draws around a held-out success
  rate.

A step's action is a list of segments ``{"text", "diff"}``: runs of consecutive units
(decoded tokens when a tokenizer is given, else characters of the action text) that all
differ from the reference or all match it, so a page draws a 2k-token action as a handful
of elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from difflib import SequenceMatcher
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout_store.tree import Node, Tree

# Past this many unit pairs (len(a) * len(b) of the part between the common prefix and
# suffix) the middle is marked different whole instead of matched by difflib, whose cost
# is quadratic in the worst case: 4M pairs is ~0.1 s of difflib on this machine.
MAX_DIFF_PAIRS = 4_000_000
# Columns one sibling diff shows at most (a node may have 200k children; a page of 256
# columns of continuations is already past reading): the first in preorder, and the
# answer says how many there are.
MAX_SIBLINGS = 256

Credits = Mapping[str, Mapping[int, float | None]]  # method -> node id -> value
MeanAtK = Mapping[int, Sequence[Mapping[str, Any]]]  # node id -> Mean@k rows
Decoder = Callable[[Sequence[int]], list[str] | None]  # token ids -> texts, or None


def token_diff(ref: Sequence[Any], other: Sequence[Any]) -> list[bool]:
    """For each unit of ``other``, whether it is outside the longest matching blocks of
    ``ref`` and ``other`` (an inserted or replaced unit). The common prefix and suffix
    match by construction; the middle is matched with ``difflib.SequenceMatcher`` (no
    junk heuristic) unless it has more than ``MAX_DIFF_PAIRS`` unit pairs, then it is all
    marked. Shapes: ``ref`` (n,), ``other`` (m,) -> (m,) booleans."""
    n, m = len(ref), len(other)
    lo = 0
    while lo < n and lo < m and ref[lo] == other[lo]:
        lo += 1
    hi = 0
    while hi < n - lo and hi < m - lo and ref[n - 1 - hi] == other[m - 1 - hi]:
        hi += 1
    marks = [False] * m
    a, b = ref[lo:n - hi], other[lo:m - hi]
    if not b:
        return marks
    if not a or len(a) * len(b) > MAX_DIFF_PAIRS:
        for i in range(lo, m - hi):
            marks[i] = True
        return marks
    for i in range(lo, m - hi):
        marks[i] = True
    for block in SequenceMatcher(None, list(a), list(b), autojunk=False).get_matching_blocks():
        for j in range(block.b, block.b + block.size):
            marks[lo + j] = False
    return marks


def segments(texts: Sequence[str], marks: Sequence[bool]) -> list[dict[str, Any]]:
    """Consecutive ``texts`` with equal ``marks`` joined: ``[{"text", "diff"}, ...]``."""
    out: list[dict[str, Any]] = []
    for text, mark in zip(texts, marks, strict=True):
        if out and out[-1]["diff"] == mark:
            out[-1]["text"] += text
        else:
            out.append({"text": text, "diff": bool(mark)})
    return out


def _units(node: Node, decode: Decoder | None) -> tuple[list[Any], list[str]]:
    """What an action is compared by (token ids) and shown as (their decoded texts), or
    the action text's characters for both when no tokenizer decodes the ids."""
    ids = list(node.action_token_ids)
    texts = decode(ids) if decode is not None and ids else None
    if texts is not None:
        return ids, texts
    chars = list(node.action_text or "")
    return chars, chars


def _descent(by_id: Mapping[int, Node], kids: Mapping[int, list[int]], start: int
             ) -> list[Node]:
    """``start`` then, at each step, its first child in preorder, down to a leaf."""
    path = [by_id[start]]
    while kids.get(path[-1].node_id):
        path.append(by_id[kids[path[-1].node_id][0]])
    return path


def _children(tree: Tree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for n in tree.preorder():
        if n.parent_id is not None:
            kids.setdefault(n.parent_id, []).append(n.node_id)
    return kids


def _leaves_below(by_id: Mapping[int, Node], start: int, kids: Mapping[int, list[int]]
                  ) -> list[float]:
    """Rewards of the leaves (nodes with a reward) in ``start``'s subtree."""
    out, stack = [], [start]
    while stack:
        nid = stack.pop()
        r = by_id[nid].reward
        if r is not None:
            out.append(float(r))
        stack.extend(kids.get(nid, []))
    return out


def _clean(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _columns(paths: Sequence[Sequence[Node]], decode: Decoder | None, ref: int,
             credits: Sequence[Credits]) -> tuple[list[list[dict[str, Any]]],
                                                  list[int | None], list[int | None]]:
    """The steps of each path with their actions diffed against path ``ref``'s step at
    the same index, and per path the first step whose action (``action_parts_at``) and
    whose outcome (observation or reward; ``outcome_parts_at``) differ from ``ref``'s
    (None: no step differs; a step ``ref`` lacks differs)."""
    units = [[_units(n, decode) for n in p] for p in paths]
    out, action_at, outcome_at = [], [], []
    for c, path in enumerate(paths):
        steps = []
        first_action: int | None = None
        first_outcome: int | None = None
        for i, node in enumerate(path):
            keys, texts = units[c][i]
            other = paths[ref][i] if i < len(paths[ref]) else None
            if c == ref:
                marks = [False] * len(keys)
            elif other is None:
                marks = [True] * len(keys)
            else:
                marks = token_diff(units[ref][i][0], keys)
            differs = other is None or (c != ref and units[ref][i][0] != keys)
            outcome = other is None or (c != ref and (
                (other.observation_text or "") != (node.observation_text or "")
                or _clean(other.reward) != _clean(node.reward)))
            if differs and first_action is None:
                first_action = i
            if outcome and first_outcome is None:
                first_outcome = i
            steps.append({
                "node": node.node_id, "depth": None, "kind": node.kind,
                "action": segments(texts, marks), "action_differs": differs,
                "observation": node.observation_text or "", "outcome_differs": outcome,
                "reward": _clean(node.reward), "tokens": len(node.action_token_ids),
                "credit": {m: _clean(v.get(node.node_id)) for m, v in credits[c].items()
                           if node.node_id in v}})
        if c != ref and first_action is None and len(paths[ref]) > len(path):
            first_action = first_outcome = len(path)  # ref goes on where this one stops
        out.append(steps)
        action_at.append(first_action)
        outcome_at.append(first_outcome)
    return out, action_at, outcome_at


def sibling_diff(tree: Tree, node_id: int, credits: Credits | None = None,
                 mean_at_k: MeanAtK | None = None, decode: Decoder | None = None,
                 ref: int | None = None, max_children: int = MAX_SIBLINGS) -> dict[str, Any]:
    """The children of ``node_id`` side by side, aligned at it (module docstring).

    ``credits``: {method: {node id: value}}; ``mean_at_k``: {node id: [{k, successes,
    mean, ...}]}; ``decode``: token ids -> texts (None: compare characters of the action
    text); ``ref``: the child the others are diffed against (default the first);
    ``max_children``: the columns shown at most (the first children in preorder, the
    reference always among them; ``n_children`` says how many there are).
    ``KeyError`` for a node the tree lacks; ``ValueError`` for a node with fewer than two
    children or a ``ref`` that is not one of them."""
    by_id = {n.node_id: n for n in tree.nodes}
    if node_id not in by_id:
        raise KeyError(f"no node {node_id} in tree {tree.tree_id!r}")
    kids = _children(tree)
    children = kids.get(node_id, [])
    if len(children) < 2:
        branching = sorted(p for p, k in kids.items() if len(k) >= 2)
        raise ValueError(f"node {node_id} of tree {tree.tree_id!r} is not a branch point "
                         f"({len(children)} children); branching nodes: "
                         f"{', '.join(map(str, branching[:20])) or 'none'}")
    if ref is not None and ref not in children:
        raise ValueError(f"reference {ref} is not a child of node {node_id} (children: "
                         f"{', '.join(map(str, children))})")
    n_children = len(children)
    if n_children > max_children:
        keep = children[:max_children]
        if ref is not None and ref not in keep:
            keep = [*keep[:-1], ref]
        children = keep
    ref_index = children.index(ref) if ref is not None else 0
    credits = credits or {}
    mean_at_k = mean_at_k or {}
    paths = [_descent(by_id, kids, c) for c in children]
    steps, action_at, outcome_at = _columns(paths, decode, ref_index,
                                            [credits] * len(children))
    depth = len(_up(by_id, node_id)) - 1
    columns = []
    for c, child in enumerate(children):
        leaves = _leaves_below(by_id, child, kids)
        for i, s in enumerate(steps[c]):
            s["depth"] = depth + 1 + i
        columns.append({
            "child": child, "leaves": len(leaves),
            "successes": sum(r >= 1.0 for r in leaves),
            "reward": sum(leaves) / len(leaves) if leaves else None,
            "branches_below": sum(len(kids.get(n.node_id, [])) >= 2 for n in paths[c]),
            "mc": [dict(r) for r in mean_at_k.get(child, [])],
            "credit": {m: _clean(v.get(child)) for m, v in credits.items() if child in v},
            "action_parts_at": action_at[c], "outcome_parts_at": outcome_at[c],
            "steps": steps[c]})
    prefix = [{"node": n.node_id, "kind": n.kind, "action": n.action_text or "",
               "observation": n.observation_text or ""} for n in _up(by_id, node_id)]
    parts = [a for a in action_at if a is not None]
    outcomes = [a for a in outcome_at if a is not None]
    return {"tree_id": tree.tree_id, "run_id": tree.run_id, "task_id": tree.task_id,
            "node": node_id, "depth": depth, "reference": children[ref_index],
            "n_children": n_children,
            "methods": sorted(credits), "prefix": prefix[::-1],
            "first_action_difference": min(parts) if parts else None,
            "first_outcome_difference": min(outcomes) if outcomes else None,
            "unit": "token" if decode is not None and _decodes(paths, decode) else "char",
            "columns": columns}


def _decodes(paths: Sequence[Sequence[Node]], decode: Decoder) -> bool:
    first = next((n for p in paths for n in p if n.action_token_ids), None)
    return first is not None and decode(list(first.action_token_ids[:1])) is not None


def _up(by_id: Mapping[int, Node], node_id: int) -> list[Node]:
    """``node_id`` and its ancestors, up to the root."""
    path = [by_id[node_id]]
    while path[-1].parent_id is not None:
        path.append(by_id[path[-1].parent_id])
    return path


def root_path(tree: Tree, leaf_id: int | None = None) -> list[Node]:
    """The nodes from the root to ``leaf_id``; None: the leaf with the highest reward,
    the first in preorder among equals (a tree's best trajectory). ``KeyError`` for a node
    the tree lacks; ``ValueError`` for a node that is not a leaf."""
    if leaf_id is None:
        leaves = [n for n in tree.preorder() if n.reward is not None]
        if not leaves:
            raise ValueError(f"tree {tree.tree_id!r} has no leaf with a reward")
        best = max(leaves, key=lambda n: float(n.reward) if n.reward is not None
                   and math.isfinite(n.reward) else -math.inf)
        leaf_id = best.node_id
    by_id = {n.node_id: n for n in tree.nodes}
    if leaf_id not in by_id:
        raise KeyError(f"no node {leaf_id} in tree {tree.tree_id!r}")
    if _children(tree).get(leaf_id):
        raise ValueError(f"node {leaf_id} of tree {tree.tree_id!r} is not a leaf")
    return _up(by_id, leaf_id)[::-1]


def compare_trajectories(items: Sequence[Mapping[str, Any]], decode_of: Callable[
        [Tree], Decoder | None] | None = None) -> dict[str, Any]:
    """N root-to-leaf paths in columns aligned by step (module docstring).

    ``items``: each ``{"label", "tree": Tree, "leaf": int | None, "credits": Credits}``
    (``label`` names the column, e.g. ``store:tree:leaf``; ``leaf`` None picks the best
    leaf, ``root_path``); ``decode_of(tree)`` gives the decoder of a tree's tokens (None:
    characters). Every column is diffed against the first. Returns ``{"steps": the most
    steps of any column, "columns": [{label, tree_id, run_id, task_id, sampler,
    policy_version, leaf, reward, action_parts_at, outcome_parts_at, steps}]}``."""
    if len(items) < 2:
        raise ValueError(f"compare needs two or more trajectories, got {len(items)}")
    paths = [root_path(it["tree"], it.get("leaf")) for it in items]
    decoders = [decode_of(it["tree"]) if decode_of else None for it in items]
    # one decoder for all columns only when every tree decodes alike: otherwise characters
    same = all(d is not None for d in decoders) and len(
        {it["tree"].policy_ref for it in items}) == 1
    steps, action_at, outcome_at = _columns(
        paths, decoders[0] if same else None, 0,
        [it.get("credits") or {} for it in items])
    columns = []
    for c, it in enumerate(items):
        t: Tree = it["tree"]
        for i, s in enumerate(steps[c]):
            s["depth"] = i
        columns.append({"label": it["label"], "tree_id": t.tree_id, "run_id": t.run_id,
                        "task_id": t.task_id, "sampler": t.sampler, "env": t.env,
                        "policy_version": t.policy_version, "leaf": paths[c][-1].node_id,
                        "reward": _clean(paths[c][-1].reward),
                        "action_parts_at": action_at[c], "outcome_parts_at": outcome_at[c],
                        "steps": steps[c]})
    return {"steps": max(len(p) for p in paths), "unit": "token" if same else "char",
            "columns": columns}


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054
                    ) -> tuple[float, float]:
    """The Wilson score interval of a success rate p = k / n (Wilson 1927), z = 1.96 for
    95%: centre (p + z^2 / 2n) / (1 + z^2 / n), half-width
    z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2). ``ValueError`` for n < 1 or k
    outside 0..n."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"a success rate needs 0 <= k <= n and n >= 1, got {successes}/{n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def metrics_diff(a: Mapping[str, Sequence[Sequence[float]]],
                 b: Mapping[str, Sequence[Sequence[float]]]) -> list[dict[str, Any]]:
    """Two runs' learning curves by metric name ({name: [[step, value], ...]} each): one
    row per name either has, with both curves (missing: []) and, at the last step both
    runs share, both values and ``b - a``."""
    out = []
    for name in sorted(set(a) | set(b)):
        pa_, pb = [list(p) for p in a.get(name, [])], [list(p) for p in b.get(name, [])]
        da, db = {int(s): v for s, v in pa_}, {int(s): v for s, v in pb}
        shared = sorted(set(da) & set(db))
        last = shared[-1] if shared else None
        out.append({"name": name, "a": pa_, "b": pb, "shared_step": last,
                    "a_value": da.get(last) if last is not None else None,
                    "b_value": db.get(last) if last is not None else None,
                    "delta": (db[last] - da[last]) if last is not None else None})
    return out
