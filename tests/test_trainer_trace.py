"""``credit="trace"`` in the trainer (issue 11): the frozen initial policy scores the gold
answer at every node (T2), the scores are committed to ``policy_scores`` (keyed), and the
committed trace credit is a function of the stored trees and scores alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rollout_store.reader import connect, read_trees
from rollout_store.store import open_store
from train.config import load_config
from train.credit.scores import GOLD, is_answer_tail, stored_scores
from train.credit.store_io import credit_trees
from train.policies import load_policy
from train.trainer import read_metrics, train


def test_trace_scores_and_credit_from_stored_data(tmp_path: Path) -> None:
    cfg = load_config(None, {
        "credit": "trace", "steps": 1, "tasks_per_step": 2, "n_total": 2, "minibatches": 2,
        "heldout_tasks": 0, "max_new_tokens": 40, "progress": False, "run_id": "tr",
        "credit_params": {"horizon": 2},
        "store": str(tmp_path / "store"), "out": str(tmp_path / "run")})
    train(cfg)
    trees = read_trees(cfg.store)
    assert len(trees) == 2
    ref_version = load_policy("tiny", "calc").policy_version  # the frozen initial policy
    con = connect(cfg.store)
    rows = con.sql("SELECT tree_id, node_id, kind, policy_version, policy_ref, value "
                   "FROM policy_scores").fetchall()
    scored = {(t, n) for t, n, *_ in rows}
    assert len(scored) == len(rows)  # each node scored once
    assert {(k, v, r) for _, _, k, v, r, _ in rows} == {(GOLD, ref_version, "tiny")}
    assert all(np.isfinite(v) and v < 0 for *_, v in rows)  # mean log-probs of y*
    want = {(t.tree_id, n.node_id) for t in trees for n in t.nodes if not is_answer_tail(t, n)}
    assert scored == want
    # the committed credit: method trace, the reference's version in the params, and equal
    # to a recomputation from the stored trees and stored scores
    stored = {(t, n): (m, h, v, list(tv or [])) for t, n, m, h, v, tv in con.sql(
        "SELECT tree_id, node_id, method, method_params_hash, value, token_values "
        "FROM credits").fetchall()}
    assert len(stored) == sum(len(t.nodes) for t in trees)
    assert {m for m, *_ in stored.values()} == {"trace"}
    scores = stored_scores(open_store(cfg.store), [t.tree_id for t in trees], GOLD,
                           ref_version)
    again = credit_trees(trees, "trace", {"horizon": "2", "ref": ref_version}, scores=scores)
    assert again.num_rows == len(stored)
    hashes = {h for _, h, _, _ in stored.values()}
    assert hashes == set(again.column("method_params_hash").to_pylist())
    nonzero = 0
    for t, n, v, tv in zip(*(again.column(c).to_pylist() for c in (
            "tree_id", "node_id", "value", "token_values")), strict=True):
        _, _, sv, stv = stored[(t, n)]
        assert sv == v
        np.testing.assert_array_equal(np.asarray(stv), np.asarray(tv or []))
        nonzero += any(x != 0 for x in (tv or []))
    assert nonzero  # T4-T7 gave some tokens credit: the check can fail
    m = read_metrics(cfg.store, "tr")
    assert [s for s, _ in m["loss"]] == [0]
