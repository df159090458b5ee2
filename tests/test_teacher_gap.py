"""The teacher-gap check of issue 47 (``analysis.teacher_gap``, docs/METHODS.md F7): its
arithmetic on a small hand-made store, against values computed by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from credit_helpers import node

from analysis.teacher_gap import format_mask, later_success, teacher_gap_check
from rollout_store.schema import POLICY_SCORES
from rollout_store.store import Store, now_utc
from rollout_store.tree import Tree


def _trees() -> list[Tree]:
    # a: root -> 1 -> {2 (R=1), 3 (R=0)};  root -> 4 (R=1)
    # b: root -> 1 (R=0)
    return [Tree("a", [node(0, None, 0, 2), node(1, 0, 4, 1), node(2, 1, 3, 0, reward=1.0),
                       node(3, 1, 1, 0, reward=0.0), node(4, 0, 2, 0, reward=1.0)],
                 task_id="x"),
            Tree("b", [node(0, None, 0, 2), node(1, 0, 3, 0, reward=0.0)], task_id="y")]


def _rows(entries: list[tuple[str, int, str, list[float]]]) -> pa.Table:
    n = len(entries)
    lps = [e[3] for e in entries]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in lps])]).astype(np.int32)
    return pa.table({
        "run_id": pa.array(["s"] * n, pa.string()),
        "tree_id": pa.array([e[0] for e in entries], pa.string()),
        "node_id": pa.array([e[1] for e in entries], pa.int64()),
        "kind": pa.array([e[2] for e in entries], pa.string()),
        "policy_version": pa.array(["v"] * n, pa.string()),
        "policy_ref": pa.array([None] * n, pa.string()),
        "value": pa.array([float(sum(x)) for x in lps], pa.float64()),
        "token_logprobs": pa.ListArray.from_arrays(
            pa.array(offsets), pa.array(np.concatenate(lps).astype(np.float32))),
        "created_at": pa.array([now_utc()] * n, POLICY_SCORES.field("created_at").type),
    }, schema=POLICY_SCORES)


def test_format_mask_and_later_success_by_hand() -> None:
    assert format_mask(1).tolist() == [False]
    assert format_mask(2).tolist() == [True, True]
    assert format_mask(4).tolist() == [True, False, False, True]
    assert later_success(_trees()[0]) == {0: 2 / 3, 1: 0.5, 2: 1.0, 3: 0.0, 4: 1.0}
    assert later_success(_trees()[0], success_threshold=2.0)[0] == 0.0


def test_the_gap_check_splits_format_and_content_tokens_by_hand(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "s"), create=True)
    store.append_trees(_trees())
    t, p = "hindsight_turn", "plain"
    store.append_policy_scores(_rows([
        ("a", 1, p, [-1.0, -1.0, -1.0, -1.0]), ("a", 1, t, [-3.0, -0.5, -1.0, -2.0]),
        ("a", 2, p, [-1.0, -2.0, -1.0]), ("a", 2, t, [-1.0, -1.0, -1.5]),
        ("a", 3, p, [-1.0]), ("a", 3, t, [-1.5]),
        ("a", 4, p, [-1.0, -1.0]), ("a", 4, t, [-1.0, -1.0, -1.0]),  # length mismatch
        ("b", 1, p, [-1.0, -1.0, -1.0]), ("b", 1, t, [-1.25, -1.5, -1.0]),
        ("b", 1, "hindsight", [-1.0, -1.0, -1.0]),  # another kind: not read
    ]), key="k")
    check = teacher_gap_check(store, t)
    assert check.mismatched == 1
    np.testing.assert_allclose(np.sort(check.format_gap),
                               np.sort([-2.0, -1.0, 0.0, -0.5, -0.25, 0.0]), atol=1e-6)
    np.testing.assert_allclose(np.sort(check.content_gap), np.sort([0.5, 0.0, 1.0, -0.5, -0.5]),
                               atol=1e-6)
    # node means of content gaps and later success: a1 (0.25, 0.5), a2 (1.0, 1), a3 (-0.5,
    # 0), b1 (-0.5, 0)
    pairs = sorted(zip(check.node_gap.tolist(), check.node_success.tolist(), strict=True))
    np.testing.assert_allclose(pairs, [[-0.5, 0.0], [-0.5, 0.0], [0.25, 0.5], [1.0, 1.0]],
                               atol=1e-6)
    s = check.summary(n_boot=200)
    x, y = np.array([0.25, 1.0, -0.5, -0.5]), np.array([0.5, 1.0, 0.0, 0.0])
    assert s["r_content_gap_success"] == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-6)
    assert s["format_median_abs_gap"] == pytest.approx(0.375, abs=1e-6)
    assert not s["format_neutral"] and s["nodes"] == 4 and s["trees"] == 2
    lo, hi = s["r_ci95"]
    assert lo <= s["r_content_gap_success"] <= hi or np.isnan(lo)
    with pytest.raises(ValueError, match="policy versions"):
        teacher_gap_check(store, "contrast:template")
