"""The trainer's background writes (``train.writer``): jobs run in order, a failure stops
the queue and surfaces unchanged on the loop's thread, and a run with background writes
leaves the same store rows and checkpoints as one that writes inline."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from rollout_store.reader import connect, read_trees
from rollout_store.store import Store
from train.config import TrainConfig, load_config
from train.rundir import load_state
from train.trainer import (
    STATE_FILE,
    STATE_TENSORS,
    TrainError,
    checkpoints,
    latest_checkpoint,
    read_metrics,
    train,
)
from train.writer import Writes

SMALL = {"tasks_per_step": 2, "n_total": 2, "heldout_tasks": 4, "eval_every": 1,
         "max_new_tokens": 40, "minibatches": 2, "progress": False, "run_id": "w"}


def _cfg(tmp: Path, name: str, **kw: object) -> TrainConfig:
    return load_config(None, {**SMALL, "store": str(tmp / f"store-{name}"),
                              "out": str(tmp / f"run-{name}"), **kw})


def test_jobs_run_in_order_on_another_thread() -> None:
    writes = Writes(background=True)
    done: list[tuple[int, str]] = []
    def job(i: int) -> None:
        time.sleep(0.002 * (20 - i) / 20)  # earlier jobs sleep longer: order must hold
        done.append((i, threading.current_thread().name))

    for i in range(20):
        writes.submit(partial(job, i))
    writes.wait()
    assert [i for i, _ in done] == list(range(20))
    assert {name for _, name in done} == {"rtrees-writes"}
    writes.close()
    inline = Writes(background=False)
    ran: list[str] = []
    inline.submit(lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name]  # at once, on the caller's thread


def test_a_failure_stops_the_queue_and_raises_on_the_callers_thread() -> None:
    writes = Writes(background=True)
    ran: list[int] = []
    gate = threading.Event()

    def fail() -> None:
        gate.wait(5)
        raise OSError("disk full")

    writes.submit(lambda: ran.append(1))
    writes.submit(fail)
    writes.submit(lambda: ran.append(3))  # queued behind the failure: dropped
    gate.set()
    with pytest.raises(OSError, match=r"^disk full$"):
        writes.wait()
    assert ran == [1]
    writes.wait()  # raised once; the thread is gone and later jobs run inline
    writes.submit(lambda: ran.append(4))
    assert ran == [1, 4]
    # a failure found when the next job is submitted
    writes = Writes(background=True)
    writes.submit(lambda: (_ for _ in ()).throw(ValueError("bad rows")))
    while writes._done < 1:  # the failed job has run (not waited for: submit must raise)
        time.sleep(0.001)
    with pytest.raises(ValueError, match="bad rows"):
        writes.submit(lambda: ran.append(5))
    assert ran == [1, 4]


def test_release_after_a_run_failed_reports_the_write_failure_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    writes = Writes(background=True)
    writes.submit(lambda: (_ for _ in ()).throw(OSError("no space left")))
    writes.release()  # the run is already failing: no second exception
    assert capsys.readouterr().err == ("warning: a background write also failed: "
                                       "no space left\n")


def _rows(store: str) -> dict[str, list[tuple[object, ...]]]:
    """The store's rows that a run determines (no timestamps, timings or memory)."""
    con = connect(store)
    return {
        "trees": con.execute("SELECT tree_id, policy_version FROM trees ORDER BY 1").fetchall(),
        "credits": con.execute("SELECT tree_id, node_id, method, value FROM credits "
                               "ORDER BY 1, 2, 3").fetchall(),
        "evaluations": con.execute("SELECT step, mode, task_id, reward FROM evaluations "
                                   "ORDER BY 1, 2, 3").fetchall(),
    }


def test_background_writes_leave_what_inline_writes_leave(tmp_path: Path) -> None:
    inline = _cfg(tmp_path, "inline", steps=3, background_writes=False)
    background = _cfg(tmp_path, "background", steps=3)
    assert background.background_writes
    train(inline)
    train(background)
    assert _rows(inline.store) == _rows(background.store)
    a, b = read_metrics(inline.store, "w"), read_metrics(background.store, "w")
    for name in ("loss", "reward", "grad_norm", "heldout_sampled", "heldout_greedy"):
        assert a[name] == b[name], name
    assert [s for s, _ in b["seconds_wait_writes"]] == [0, 1, 2]
    assert [p.name for p in checkpoints(Path(inline.out))] == [
        p.name for p in checkpoints(Path(background.out))]
    for step in checkpoints(Path(background.out)):
        other = Path(inline.out) / "checkpoints" / step.name
        for name in ("model.safetensors",):
            assert (step / name).read_bytes() == (other / name).read_bytes(), step.name
    # the last checkpoint records the store as its iteration's commits left it
    last = latest_checkpoint(Path(background.out))
    assert last is not None
    state = load_state(last / STATE_FILE, last / STATE_TENSORS)
    now = dict(Store(background.store).version())  # and then the state's record (metrics)
    assert state["store_version"] == {**now, "metrics": now["metrics"] - 1}
    # and the background run resumes like any other
    train(background.replace(steps=4), resume=True)
    assert len(read_trees(background.store)) == 4 * 2


def test_a_failed_background_commit_stops_the_run_with_its_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit failing on the writer thread stops the run with that error; what was
    written before it stays, and no checkpoint is published after the failed commit."""
    cfg = _cfg(tmp_path, "fail", steps=4, heldout_tasks=0)
    real = Store.append_credits

    def append_credits(self: Store, table: object, key: str | None = None) -> object:
        if key is not None and key.endswith(":credit:1"):
            raise OSError(f"{self.path}: no space left on device")
        return real(self, table, key=key)

    monkeypatch.setattr(Store, "append_credits", append_credits)
    with pytest.raises(OSError, match="no space left on device"):
        train(cfg)
    names = [p.name for p in checkpoints(Path(cfg.out))]
    assert names[-1] == "step-000001"  # iteration 0's; iteration 1 never published
    assert {t.tree_id.split("/")[1] for t in read_trees(cfg.store)} == {"it000000",
                                                                        "it000001"}
    monkeypatch.setattr(Store, "append_credits", real)
    train(cfg, resume=True)  # the lost iteration is re-run; its trees land once
    assert len(read_trees(cfg.store)) == 4 * 2
    assert torch.isfinite(torch.tensor([v for _, v in read_metrics(cfg.store, "w")["loss"]])
                          ).all()


def test_diverged_weights_stop_the_run_before_they_are_sampled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The finite check of the weights to publish runs on the loop's thread (the
    checkpoint itself is written in the background): the run stops with the one-line
    'training diverged' error, the last good checkpoint published, nothing after it."""
    from train import fsdp

    cfg = _cfg(tmp_path, "nan", steps=3, heldout_tasks=0)
    real = fsdp.copy_full_weights
    calls: list[int] = []

    def poison(sharded: torch.nn.Module, replica: torch.nn.Module) -> None:
        real(sharded, replica)
        calls.append(1)
        if len(calls) == 2:  # after iteration 1's optimizer steps
            with torch.no_grad():
                next(replica.parameters()).fill_(float("nan"))

    monkeypatch.setattr(fsdp, "copy_full_weights", poison)
    with pytest.raises(TrainError, match=r"training diverged, checkpoint step-000002 not "
                                         r"written \(lower lr or set grad_clip\)$"):
        train(cfg)
    assert [p.name for p in checkpoints(Path(cfg.out))][-1] == "step-000001"
    assert {t.tree_id.split("/")[1] for t in read_trees(cfg.store)} == {"it000000",
                                                                        "it000001"}
