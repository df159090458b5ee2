"""``rtrees train --tensorboard``: the event files hold the metrics the store holds.

A two-iteration tiny run through the CLI (the flag parsed by ``cli/train_cmd.py``, the
writer opened by ``train.trainer.train``) writes ``OUT/tensorboard/events.out.tfevents.*``;
read back with tensorboard's own ``EventAccumulator``, every scalar equals (at float32,
the precision of a TensorBoard scalar) the value committed to the store's ``metrics``
table for the same name and iteration, and the two hold the same (name, step) pairs.
Skipped, with the reason, when the tensorboard package is not installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from train.trainer import read_metrics

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="tensorboard is not installed (a dev extra: pip install tensorboard)")

SMALL = {"tasks_per_step": 1, "n_total": 2, "heldout_tasks": 0, "max_new_tokens": 16,
         "minibatches": 1, "progress": False, "run_id": "tb"}


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in the event files under ``log_dir``."""
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_equal_store_metrics(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    store, out = tmp_path / "store", tmp_path / "run"
    args = ["train", "--store", str(store), "--out", str(out), "--steps", "2", "--tensorboard"]
    args += [f"--set={k}={v}" for k, v in SMALL.items()]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))

    stored = read_metrics(str(store), "tb")
    board = _scalars(out / "tensorboard")
    assert stored and "loss" in stored and "seconds_train" in stored
    # the store keeps the finite values only; TensorBoard gets every value
    finite = {tag: [(s, v) for s, v in pts if np.isfinite(v)] for tag, pts in board.items()}
    finite = {tag: pts for tag, pts in finite.items() if pts}
    assert set(finite) == set(stored)
    for name, points in stored.items():
        assert [s for s, _ in points] == [0, 1], name
        assert [s for s, _ in finite[name]] == [0, 1], name
        want = np.array([v for _, v in points], dtype=np.float32)
        got = np.array([v for _, v in finite[name]], dtype=np.float32)
        np.testing.assert_array_equal(got, want, err_msg=name)
