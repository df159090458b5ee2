"""The attempt views (`trees_latest`, `nodes_latest`, `credits_latest`, `metrics_latest`,
`attempts`) and `rtrees store info`'s rows per attempt (issue 26), over real stores: one
whose second attempt re-committed an iteration as a retry (KEY@aN), and real resumed
`rtrees train` runs."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from rollout_store import Store, connect
from rollout_store.attempts import as_retry, retry_key
from rollout_store.maintenance import info, record_attempt
from rollout_store.schema import CREDITS, METRICS
from rollout_store.store import CommitKeyConflictError
from rollout_store.synthetic import bel_shaped_batch

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _metrics(run: str, step: int, value: float, at: datetime) -> pa.Table:
    return pa.table({"run_id": [run, run], "step": pa.array([step, step], pa.int64()),
                     "name": ["loss", "reward"], "value": [value, value + 1],
                     "created_at": pa.array([at, at], METRICS.field("created_at").type)},
                    schema=METRICS)


def _credits(trees: list, at: datetime, value: float) -> pa.Table:
    rows = [(t.tree_id, n.node_id) for t in trees for n in t.nodes]
    n = len(rows)
    return pa.table({
        "run_id": ["r"] * n, "method": ["grpo"] * n, "method_params_hash": ["h"] * n,
        "method_params": ["{}"] * n, "tree_id": [r[0] for r in rows],
        "node_id": pa.array([r[1] for r in rows], pa.int64()),
        "value": [value] * n, "token_values": pa.nulls(n, pa.list_(pa.float32())),
        "policy_version": ["v"] * n,
        "created_at": pa.array([at] * n, CREDITS.field("created_at").type),
        "clip_low": pa.nulls(n, CREDITS.field("clip_low").type),
        "clip_high": pa.nulls(n, CREDITS.field("clip_high").type)}, schema=CREDITS)


def _iteration(it: int, seed: int, at: datetime) -> list:
    trees = bel_shaped_batch(2, rollouts=2, depth=2, seed=seed,
                             tree_prefix=f"r/it{it}", run_id="r").to_trees()
    for t in trees:
        t.created_at = at
    return trees


def test_retry_supersedes_the_earlier_attempts_rows(tmp_path: Path) -> None:
    """Attempt 1 commits iterations 0 and 1; attempt 2 resumes at 1 and its replay of 1
    differs: the plain key is refused, the retry (KEY@a2, ids ID@a2) lands, and the
    *_latest views show iteration 0 of attempt 1 and iteration 1 of attempt 2 only."""
    store = Store(tmp_path / "s", create=True)
    assert record_attempt(store, "r", 0, started_at=T0) == 1
    first = {it: _iteration(it, seed=it, at=T0 + timedelta(minutes=1 + it)) for it in (0, 1)}
    for it, trees in first.items():
        store.append_trees(trees, key=f"r:trees:{it}")
        store.append_credits(_credits(trees, T0 + timedelta(minutes=1 + it), 0.5),
                             key=f"r:credit:{it}")
        store.append_metrics(_metrics("r", it, 0.1 * it, T0 + timedelta(minutes=1 + it)),
                             key=f"r:metrics:{it}")
    later = T0 + timedelta(hours=1)
    assert record_attempt(store, "r", 1, started_at=later) == 2
    replay = _iteration(1, seed=7, at=later + timedelta(minutes=1))  # other content
    with pytest.raises(CommitKeyConflictError):
        store.append_trees(replay, key="r:trees:1")
    replay = as_retry(replay, 2)
    store.append_trees(replay, key=retry_key("r:trees:1", 2))
    store.append_credits(_credits(replay, later + timedelta(minutes=1), -1.0),
                         key=retry_key("r:credit:1", 2))
    store.append_metrics(_metrics("r", 1, 9.0, later + timedelta(minutes=1)),
                         key=retry_key("r:metrics:1", 2))

    con = connect(store)
    ids = {r[0] for r in con.execute("SELECT tree_id FROM trees_latest").fetchall()}
    assert ids == {t.tree_id for t in first[0]} | {t.tree_id for t in replay}
    assert all(i.endswith("@a2") for i in ids if i.startswith("r/it1"))
    assert con.execute("SELECT count(*) FROM trees").fetchall() == [(6,)]  # history kept
    [(n_latest,)] = con.execute("SELECT count(*) FROM nodes_latest").fetchall()
    assert n_latest == sum(len(t.nodes) for t in first[0] + replay)
    [(bad,)] = con.execute("SELECT count(*) FROM nodes_latest n ANTI JOIN trees_latest t "
                           "USING (tree_id)").fetchall()
    assert bad == 0
    credit = con.execute("SELECT tree_id LIKE '%@a2', min(value), max(value), count(*) "
                         "FROM credits_latest GROUP BY ALL ORDER BY 1").fetchall()
    assert credit == [(False, 0.5, 0.5, sum(len(t.nodes) for t in first[0])),
                      (True, -1.0, -1.0, sum(len(t.nodes) for t in replay))]
    metrics = con.execute("SELECT step, name, value FROM metrics_latest WHERE step >= 0 "
                          "ORDER BY step, name").fetchall()
    assert metrics == [(0, "loss", 0.0), (0, "reward", 1.0), (1, "loss", 9.0),
                       (1, "reward", 10.0)]
    assert con.execute("SELECT attempt, start_iteration FROM attempts ORDER BY 1"
                       ).fetchall() == [(1, 0), (2, 1)]
    [(kept,)] = con.execute("SELECT count(*) FROM metrics_latest WHERE step = -3").fetchall()
    assert kept == 2  # bookkeeping rows are never superseded

    per = {a["attempt"]: a for a in info(store)["attempts"]}
    assert per[1]["trees"] == {"rows": 4, "superseded": 2}
    assert per[1]["credits"]["superseded"] == sum(len(t.nodes) for t in first[1])
    assert per[1]["metrics"] == {"rows": 5, "superseded": 2}  # 4 values + the attempt row
    assert per[2]["trees"] == {"rows": 2, "superseded": 0}
    assert per[2]["metrics"] == {"rows": 3, "superseded": 0}
    assert per[2]["start_iteration"] == 1


def test_store_info_cli_prints_rows_per_attempt(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    store = Store(tmp_path / "s", create=True)
    record_attempt(store, "run-a", 0, started_at=T0)
    store.append_metrics(_metrics("run-a", 0, 1.0, T0 + timedelta(seconds=1)), key="m0")
    record_attempt(store, "run-a", 3, started_at=T0 + timedelta(hours=1))
    result = CliRunner().invoke(app, ["store", "info", "--store", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    assert "attempts" in result.output and "run-a" in result.output
    data = json.loads(CliRunner().invoke(app, ["store", "info", "--store",
                                               str(tmp_path / "s"), "--json"]).output)
    assert [(a["attempt"], a["start_iteration"], a["metrics"]["rows"])
            for a in data["attempts"]] == [(1, 0, 3), (2, 3, 1)]


def test_store_without_attempts_views_equal_tables(tmp_path: Path) -> None:
    """No attempt recorded (every store before this): the views hide nothing."""
    store = Store(tmp_path / "s", create=True)
    trees = _iteration(0, seed=1, at=T0)
    store.append_trees(trees, key="k")
    store.append_credits(_credits(trees, T0, 1.0), key="c")
    con = connect(store)
    for name in ("trees", "nodes", "credits", "metrics"):
        assert (con.execute(f"SELECT count(*) FROM {name}").fetchall()
                == con.execute(f"SELECT count(*) FROM {name}_latest").fetchall())
    assert info(store)["attempts"] == []


@pytest.mark.slow
def test_resumed_training_run_records_attempts_and_supersedes_nothing(tmp_path: Path
                                                                      ) -> None:
    """A real run: two iterations, its last checkpoint removed (a kill after iteration 1
    committed, before its checkpoint), resumed: attempt 2 starts at iteration 1, replays
    it exactly (the store skips the same-key commits), so nothing is superseded and the
    views equal the tables."""
    from train.config import load_config
    from train.trainer import read_metrics, train

    cfg = load_config(None, {"tasks_per_step": 2, "n_total": 2, "heldout_tasks": 0,
                             "max_new_tokens": 40, "minibatches": 2, "progress": False,
                             "run_id": "r", "steps": 2, "store": str(tmp_path / "s"),
                             "out": str(tmp_path / "run")})
    train(cfg)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-000002")
    train(cfg, resume=True)
    store = Store(tmp_path / "s")
    con = connect(store)
    assert con.execute("SELECT attempt, start_iteration FROM attempts ORDER BY 1"
                       ).fetchall() == [(1, 0), (2, 1)]
    for name in ("trees", "credits"):
        assert (sorted(con.execute(f"SELECT * FROM {name}").fetchall(), key=str)
                == sorted(con.execute(f"SELECT * FROM {name}_latest").fetchall(), key=str))
    per = {a["attempt"]: a for a in info(store)["attempts"]}
    assert per[1]["trees"] == {"rows": 4, "superseded": 0}
    assert per[2]["trees"]["rows"] == 0  # its replay of iteration 1 was the same trees
    assert [s for s, _ in read_metrics(store, "r")["loss"]] == [0, 1]
