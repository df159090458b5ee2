"""Readers of a run's training metrics see the latest, non-bookkeeping rows only (issue 26).

A real store written by the trainer's own writers: the run-token row (``claim_run_id``,
step -2), two recorded attempts (``record_attempt``, step -3), iterations -1, 0 and 1
committed by attempt 1 (``train.run.commit_metrics``), and attempt 2 re-committing iteration 1 as a
retry (``KEY@a2``) with other values. Every reader (``training_metrics``, the viewer,
``analysis.table1``, the demo report, ``train.trainer.read_metrics``) must give attempt 2's
iteration 1, attempt 1's -1 and 0, and neither the run token nor the attempt rows."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from analysis import demo_report, table1
from analysis.viewer.data import ViewerData
from rollout_store import Store, connect
from rollout_store.attempts import TRAINING_METRICS, training_metrics
from rollout_store.maintenance import record_attempt
from train.run import OWNER_METRIC, claim_run_id, commit_metrics, read_metrics

RUN = "r"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
EXPECTED = {"loss": [(-1, 0.0), (0, 1.0), (1, 9.0)],
            "reward": [(-1, 0.5), (0, 1.5), (1, 9.5)]}
"""Attempt 1's steps -1 and 0, attempt 2's retry of step 1 (9.0, 9.5, not 2.0, 2.5)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    s = Store(tmp_path_factory.mktemp("metrics") / "s", create=True)
    claim_run_id(s, RUN, token=12345, fresh=True)
    record_attempt(s, RUN, 0, started_at=T0)
    for it in (-1, 0, 1):
        commit_metrics(s, RUN, it, {"loss": float(it + 1), "reward": it + 1.5})
    record_attempt(s, RUN, 1)  # attempt 2 resumes at iteration 1, now
    commit_metrics(s, RUN, 1, {"loss": 9.0, "reward": 9.5}, retry=2)
    return s


def test_the_store_holds_the_bookkeeping_and_superseded_rows(store: Store) -> None:
    """The fixture is what the readers must see through: raw ``metrics`` has the run token,
    both attempts and both writes of iteration 1 (so the reader tests can fail)."""
    con = connect(store)
    rows = con.execute("SELECT step, name, value FROM metrics ORDER BY step, name, value"
                       ).fetchall()
    assert (-2, OWNER_METRIC, 12345.0) in rows
    assert [r for r in rows if r[0] == -3] == [(-3, "attempt", 0.0), (-3, "attempt", 1.0)]
    assert [r for r in rows if r[0] == 1] == [(1, "loss", 2.0), (1, "loss", 9.0),
                                              (1, "reward", 2.5), (1, "reward", 9.5)]


def test_training_metrics_relation_and_helper(store: Store) -> None:
    con = connect(store)
    assert training_metrics(con, RUN) == EXPECTED
    rows = con.execute(f"SELECT step, name, value FROM {TRAINING_METRICS} ORDER BY step, name"
                       ).fetchall()
    assert rows == sorted((s, n, v) for n, sv in EXPECTED.items() for s, v in sv)


def test_trainer_read_metrics(store: Store) -> None:
    assert read_metrics(store, RUN) == EXPECTED


def test_table1_reads_latest_rows(store: Store) -> None:
    assert table1.read_run_metrics(store.path, RUN) == {
        name: dict(rows) for name, rows in EXPECTED.items()}


def test_demo_report_reads_latest_rows(store: Store) -> None:
    assert demo_report.read_run_metrics(connect(store), RUN) == EXPECTED


def test_viewer_metrics_and_runs(store: Store) -> None:
    data = ViewerData(store)
    assert data.metrics(RUN) == {name: [[s, v] for s, v in rows]
                                 for name, rows in EXPECTED.items()}
    [run] = data.runs()
    assert run["run_id"] == RUN
    assert run["metrics"] == len(EXPECTED)  # not run_token nor attempt
