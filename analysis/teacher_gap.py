"""Can FACTOR's teacher read the feedback? The F3 likelihood gap on format vs content tokens.

FACTOR (docs/METHODS.md F3-F5) moves an action's credit toward the tokens whose likelihood
the feedback raises (in a success) or lowers (in a failure). That only assigns credit to
the step's *content* if the teacher's extra context does not, by itself, shift the tokens
that every action of a kind shares. This module measures both sides on stored scores
(``policy_scores`` rows of kind ``plain`` and a hindsight kind, written by
``train.scoring``) and stored trees, reading nothing else (section F7 of METHODS):

* per scored action token ``j`` of node ``v``, ``Delta_{v,j} = teacher - student`` (F3),
  for nodes whose teacher and student rows have the same length (the rest are counted as
  ``mismatched`` and left out, as F3 leaves them at Delta = 0);
* **format tokens**: the first and the last token of an action of at least two tokens (the
  opening ``<tool_call>...`` / ``<answer>`` piece and the closing tag, in the tiny
  policies' tokenizers, where the JSON boilerplate and tags are single tokens); every other
  token is **content** (a one-token action, such as a workflow tool call, is all content:
  the token is the choice) [R: a positional rule, so no tokenizer is needed];
* **later success** of node ``v``: the share of the trajectories below ``v`` whose leaf
  reward is ``>= success_threshold``;
* **informativeness**: Pearson's ``r`` between each node's mean content gap and its later
  success, over nodes with at least one content token, with a percentile interval from a
  bootstrap that resamples whole trees (``analysis.stats.cluster_bootstrap_means`` on the
  five moments of ``r``).

The pre-registered bounds (``FORMAT_BOUND``) are: the teacher is *format-neutral* when
the median ``|Delta|`` over format tokens is at most 0.1 nats, and *informative* when the
interval of ``r`` lies above 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from analysis.stats import cluster_bootstrap_means, percentile_ci
from rollout_store.reader import connect, read_trees
from rollout_store.store import Store
from rollout_store.tree import Tree

FORMAT_BOUND: Final[float] = 0.1
"""Pre-registered (issue 47): the largest median |teacher - student| (nats) over format
tokens at which the teacher counts as format-neutral."""
PLAIN_KIND: Final[str] = "plain"


@dataclass(frozen=True)
class GapCheck:
    """The F3 gap of one teacher context on one store (module docstring)."""

    kind: str
    format_gap: np.ndarray
    """(F,) Delta of every format token."""
    content_gap: np.ndarray
    """(C,) Delta of every content token."""
    node_gap: np.ndarray
    """(M,) mean content Delta of each node with a content token."""
    node_success: np.ndarray
    """(M,) later success of those nodes."""
    node_tree: np.ndarray
    """(M,) index of each node's tree (the bootstrap's cluster)."""
    mismatched: int
    """Scored nodes left out: teacher and student rows of different lengths."""

    def correlation(self, n_boot: int = 2000, seed: int = 0, level: float = 0.95
                    ) -> tuple[float, list[float]]:
        """Pearson r of ``node_gap`` and ``node_success`` and its tree-bootstrap interval
        (NaN where either side is constant)."""
        x, y = self.node_gap, self.node_success
        if x.size < 2 or np.ptp(x) == 0.0 or np.ptp(y) == 0.0:
            return math.nan, [math.nan, math.nan]
        r = float(np.corrcoef(x, y)[0, 1])
        m = cluster_bootstrap_means({"x": x, "y": y, "xx": x * x, "yy": y * y, "xy": x * y},
                                    self.node_tree, n_boot, seed)
        with np.errstate(invalid="ignore", divide="ignore"):
            boot = (m["xy"] - m["x"] * m["y"]) / np.sqrt(
                (m["xx"] - m["x"] ** 2) * (m["yy"] - m["y"] ** 2))
        return r, percentile_ci(boot, level)

    def summary(self, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
        """The numbers the check reports, and its two verdicts."""
        r, ci = self.correlation(n_boot, seed)
        fmt_med = float(np.median(np.abs(self.format_gap))) if self.format_gap.size else 0.0
        return {
            "kind": self.kind,
            "format_tokens": int(self.format_gap.size),
            "content_tokens": int(self.content_gap.size),
            "format_median_abs_gap": fmt_med,
            "format_mean_gap": _mean(self.format_gap),
            "content_median_abs_gap": (float(np.median(np.abs(self.content_gap)))
                                       if self.content_gap.size else math.nan),
            "content_mean_gap": _mean(self.content_gap),
            "nodes": int(self.node_gap.size),
            "trees": int(np.unique(self.node_tree).size),
            "mismatched": self.mismatched,
            "r_content_gap_success": r,
            "r_ci95": ci,
            "format_neutral": bool(fmt_med <= FORMAT_BOUND),
            "informative": bool(np.isfinite(ci[0]) and ci[0] > 0.0),
        }


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)


def _mean(a: np.ndarray) -> float:
    return float(a.mean()) if a.size else math.nan


def later_success(tree: Tree, success_threshold: float = 1.0) -> dict[int, float]:
    """node id -> share of the trajectory leaves below it (itself included) whose reward is
    ``>= success_threshold``; nodes without a rewarded leaf below are absent."""
    children = tree.children()
    order = [n.node_id for n in tree.preorder()]
    by_id = {n.node_id: n for n in tree.nodes}
    wins: dict[int, float] = {}
    count: dict[int, float] = {}
    for nid in reversed(order):  # children before their parent
        n = by_id[nid]
        w = c = 0.0
        if not children[nid] and n.reward is not None:
            w, c = float(n.reward >= success_threshold), 1.0
        for k in children[nid]:
            w += wins.get(k, 0.0)
            c += count.get(k, 0.0)
        wins[nid], count[nid] = w, c
    return {k: wins[k] / count[k] for k in order if count[k] > 0}


def format_mask(length: int) -> np.ndarray:
    """(length,) True at an action's format tokens: first and last of >= 2 tokens."""
    mask = np.zeros(length, bool)
    if length >= 2:
        mask[[0, -1]] = True
    return mask


def teacher_gap_check(store: Store, kind: str, version: str | None = None,
                      success_threshold: float = 1.0) -> GapCheck:
    """``GapCheck`` of the teacher scores of ``kind`` against the ``plain`` ones in
    ``store`` (both of policy ``version``; None: the one version that scored ``kind``)."""
    con = connect(store)
    if version is None:
        found = [v for (v,) in con.execute(
            "SELECT DISTINCT policy_version FROM policy_scores WHERE kind = $k",
            {"k": kind}).fetchall()]
        if len(found) != 1:
            raise ValueError(f"the store holds {kind!r} scores of {len(found)} policy "
                             f"versions {sorted(found)}; name one")
        version = found[0]
    teachers: dict[str, dict[int, list[float]]] = {}
    students: dict[tuple[str, int], list[float]] = {}
    for k, t, n, lp in con.execute(
            "SELECT kind, tree_id, node_id, token_logprobs FROM policy_scores "
            "WHERE policy_version = $v AND kind IN ($k, $p)",
            {"v": version, "k": kind, "p": PLAIN_KIND}).fetchall():
        if k == kind:
            teachers.setdefault(t, {})[int(n)] = list(lp or [])
        else:
            students[(t, int(n))] = list(lp or [])
    tree_ids = sorted(teachers)
    trees = {t.tree_id: t for t in read_trees(store, tree_ids)} if tree_ids else {}
    fmt: list[np.ndarray] = []
    content: list[np.ndarray] = []
    node_gap: list[float] = []
    node_success: list[float] = []
    node_tree: list[int] = []
    mismatched = 0
    for ti, tree_id in enumerate(tree_ids):
        success = later_success(trees[tree_id], success_threshold)
        for nid, teacher in sorted(teachers[tree_id].items()):
            student = students.get((tree_id, nid))
            if student is None or len(student) != len(teacher) or not teacher:
                mismatched += 1
                continue
            gap = np.asarray(teacher, np.float64) - np.asarray(student, np.float64)
            mask = format_mask(gap.size)
            fmt.append(gap[mask])
            content.append(gap[~mask])
            if (~mask).any() and nid in success:
                node_gap.append(float(gap[~mask].mean()))
                node_success.append(success[nid])
                node_tree.append(ti)
    return GapCheck(kind, _cat(fmt), _cat(content), np.asarray(node_gap, np.float64),
                    np.asarray(node_success, np.float64), np.asarray(node_tree, np.int64),
                    mismatched)


__all__ = ["FORMAT_BOUND", "GapCheck", "format_mask", "later_success", "teacher_gap_check"]
