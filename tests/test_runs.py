"""Runs never mix (issue 21 item 5): one trainer per run directory, one run directory per
run id in a store.

Real ``rtrees train`` processes: a second trainer on a running ``--out`` is refused with a
named error while the first goes on unharmed; two trainers started at once on one fresh
``--out`` leave exactly one run, whose seed ``config.json`` holds; a run directory with the
same name in another place (``/a/run``, ``/b/run``: the default run id ``train-run``) is
refused on the shared store; a killed run's lock dies with it and ``--resume`` continues
it with its own config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from rollout_store import Store, connect
from rollout_store.schema import METRICS
from rollout_store.store import now_utc
from train.config import create_config, load_config, read_run_token
from train.trainer import (
    OWNER_METRIC,
    OWNER_STEP,
    RunIdTakenError,
    RunInUseError,
    TrainError,
    claim_run_id,
    latest_checkpoint,
    lock_run_dir,
    read_metrics,
    train,
)

ROOT = Path(__file__).resolve().parents[1]
RTREES = str(Path(sys.executable).with_name("rtrees"))
SMALL = {"tasks_per_step": 2, "n_total": 2, "heldout_tasks": 0, "max_new_tokens": 40,
         "minibatches": 2, "progress": False, "train_tasks": 200}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _args(store: Path, out: Path, steps: int, seed: int, *extra: str) -> list[str]:
    sets = [f"--set={k}={v}" for k, v in {**SMALL, "seed": seed}.items()]
    return [RTREES, "train", "--store", str(store), "--out", str(out), "--steps", str(steps),
            *sets, *extra]


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    assert "Traceback" not in stderr
    return lines[0]


def _wait_for(path: Path, proc: subprocess.Popen[bytes], seconds: float = 400) -> None:
    deadline = time.time() + seconds
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared (trainer exit code {proc.poll()})"


def _seed(out: Path) -> int:
    return int(json.loads((out / "config.json").read_text())["seed"])


@pytest.mark.slow
def test_second_trainer_on_a_running_out_is_refused(tmp_path: Path) -> None:
    """A runs; B (``--resume``) and C (a fresh run, another seed) on A's ``--out`` are
    refused with named errors; A goes on with its config; killed, A's lock is gone and
    ``--resume`` continues A's run (its seed), every iteration once."""
    store, out = tmp_path / "store", tmp_path / "run"
    a = subprocess.Popen(_args(store, out, 500, 1), env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        _wait_for(out / "checkpoints" / "step-000001", a)
        config_before = (out / "config.json").read_bytes()
        b = subprocess.run([RTREES, "train", "--out", str(out), "--resume"], env=ENV,
                           capture_output=True, text=True, timeout=300)
        line = _one_error_line(b.stderr)
        assert b.returncode != 0
        assert "RunInUseError" in line and "in use by another trainer" in line, line
        assert f"pid {a.pid}" in line, line
        c = subprocess.run(_args(store, out, 3, 2), env=ENV, capture_output=True, text=True,
                           timeout=300)
        assert c.returncode != 0 and "already holds a run" in _one_error_line(c.stderr)
        assert a.poll() is None, "the first trainer stopped"
        assert (out / "config.json").read_bytes() == config_before
        done = latest_checkpoint(out)
        assert done is not None
        _wait_for(out / "checkpoints" / f"step-{int(done.name[5:]) + 1:06d}", a)  # goes on
    finally:
        a.kill()
        a.wait()
    reached = int(latest_checkpoint(out).name[5:])  # type: ignore[union-attr]
    resumed = subprocess.run([RTREES, "train", "--out", str(out), "--resume", "--steps",
                              str(reached + 1)], env=ENV, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    after, before = json.loads((out / "config.json").read_text()), json.loads(config_before)
    assert after.pop("steps") == reached + 1 and before.pop("steps") == 500
    assert after == before  # A's config and run token: seed 1, not C's 2
    steps = [s for s, _ in read_metrics(str(store), "train-run")["loss"]]
    assert steps == list(range(reached + 1))  # every iteration once, none of another seed


@pytest.mark.slow
def test_two_trainers_started_at_once_leave_one_run(tmp_path: Path) -> None:
    store, out = tmp_path / "store", tmp_path / "run"
    procs = {seed: subprocess.Popen(_args(store, out, 1, seed), env=ENV,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True) for seed in (11, 12)}
    results = {seed: (p.wait(timeout=600), p.stderr.read() if p.stderr else "")
               for seed, p in procs.items()}
    winners = [seed for seed, (code, _) in results.items() if code == 0]
    assert len(winners) == 1, results
    [(code, err)] = [r for seed, r in results.items() if seed not in winners]
    assert code != 0
    line = _one_error_line(err)
    assert "RunInUseError" in line or "already holds a run" in line, line
    assert _seed(out) == winners[0]
    assert [s for s, _ in read_metrics(str(store), "train-run")["loss"]] == [0]


@pytest.mark.slow
def test_same_directory_name_elsewhere_is_refused_on_one_store(tmp_path: Path) -> None:
    """``/a/run`` trained into a store; ``/b/run`` (default run id ``train-run`` too) is
    refused in a real process, naming the run id, the other directory and ``--run-id``,
    and writes nothing; ``--run-id`` makes it a run of its own; ``/a/run`` resumes."""
    store = tmp_path / "store"
    first = load_config(None, {**SMALL, "store": str(store), "out": str(tmp_path / "a" / "run"),
                               "steps": 1})
    train(first)
    b = tmp_path / "b" / "run"
    proc = subprocess.run(_args(store, b, 1, 0), env=ENV, capture_output=True, text=True,
                          timeout=300)
    line = _one_error_line(proc.stderr)
    assert proc.returncode != 0
    for needle in ("RunIdTakenError", "'train-run'", str(tmp_path / "a" / "run"), "--run-id"):
        assert needle in line, (needle, line)
    assert not (tmp_path / "b").exists(), "the refused run left its directory behind"
    assert [s for s, _ in read_metrics(str(store), "train-run")["loss"]] == [0]
    # the remedy the error names, and the first run's own resume
    other = load_config(None, {**SMALL, "store": str(store), "out": str(b), "steps": 1,
                               "run_id": "train-run-b"})
    train(other)
    train(first.replace(steps=2), resume=True)
    assert [s for s, _ in read_metrics(str(store), "train-run")["loss"]] == [0, 1]
    assert [s for s, _ in read_metrics(str(store), "train-run-b")["loss"]] == [0]


def test_run_id_written_before_tokens_is_refused_for_a_fresh_run(tmp_path: Path) -> None:
    """A store holding rows of the run id but no owner row (a run of an earlier version):
    a fresh run with that id is refused before anything is written."""
    store = Store(tmp_path / "store", create=True)
    store.append_metrics(pa.table({
        "run_id": ["train-run"], "step": pa.array([0], pa.int64()), "name": ["loss"],
        "value": [0.5], "created_at": pa.array([now_utc()], METRICS.field("created_at").type)},
        schema=METRICS), key="old")
    cfg = load_config(None, {**SMALL, "store": str(store.path), "out": str(tmp_path / "run"),
                             "steps": 1})
    with pytest.raises(RunIdTakenError, match="--run-id"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_claims_and_locks(tmp_path: Path) -> None:
    """The pieces: one owner per run id even when two claims race (one key, one row); an
    exclusive lock per directory (a second open in the same process is refused too);
    ``config.json`` created exclusively."""
    store = Store(tmp_path / "store", create=True)
    claim_run_id(store, "r", 7, fresh=True)
    claim_run_id(store, "r", 7, fresh=False)  # the owner again: fine
    with pytest.raises(RunIdTakenError):
        claim_run_id(store, "r", 8, fresh=False)
    # a racing claim that passed its check before the first committed: same key, skipped
    store.append_metrics(pa.table({
        "run_id": ["r"], "step": pa.array([OWNER_STEP], pa.int64()), "name": [OWNER_METRIC],
        "value": [8.0], "created_at": pa.array([now_utc()], METRICS.field("created_at").type)},
        schema=METRICS), key="r:owner")
    rows = connect(store).execute("SELECT value FROM metrics WHERE run_id = 'r'").fetchall()
    assert rows == [(7.0,)]
    assert read_metrics(store, "r") == {}  # the owner row is not a metric

    run = tmp_path / "a" / "run"
    lock = lock_run_dir(run)
    with pytest.raises(RunInUseError, match=f"pid {os.getpid()}"):
        lock_run_dir(run)
    lock.release()
    lock_run_dir(run).release()
    cfg = load_config(None, {"store": "s", "out": str(run)})
    create_config(cfg, run, 123)
    with pytest.raises(FileExistsError):
        create_config(cfg.replace(seed=5), run, 456)
    assert read_run_token(run) == 123 and _seed(run) == 0
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


def test_refused_fresh_run_in_existing_run_dir(tmp_path: Path) -> None:
    cfg = load_config(None, {**SMALL, "store": str(tmp_path / "s"), "out": str(tmp_path / "o"),
                             "steps": 1})
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "config.json").write_text("{}")
    with pytest.raises(TrainError, match="pass --resume"):
        train(cfg)
    assert (tmp_path / "o" / "config.json").read_text() == "{}"


def test_resume_under_a_lock_sees_signals(tmp_path: Path) -> None:
    """A lock held by a process that is stopped (SIGSTOP) still refuses; killed, it is
    released by the kernel."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from train.trainer import lock_run_dir; "
        f"lock = lock_run_dir(Path({str(run)!r})); print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, env={**ENV, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        with pytest.raises(RunInUseError, match=f"pid {holder.pid}"):
            lock_run_dir(run)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        lock_run_dir(run).release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
