"""Helpers of the data-parallel and FSDP trainer tests: a single-process reference run
with a rank's threads, and killing one rank of a real ``rtrees train --nproc 2`` run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def train_with_rank_threads(config: Any) -> None:
    """``train(config)`` in this process with each rank's intra-op threads (``launch``:
    usable cores // 2), so a comparison with N ranks sees the distributed arithmetic, not
    another BLAS blocking (AdamW's normalised step amplifies float-order noise)."""
    import torch

    from train.trainer import train

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // 2))
    try:
        train(config)
    finally:
        torch.set_num_threads(threads)


def kill_rank_then_resume(train_args: Sequence[str], out: str, steps: int) -> None:
    """Start ``rtrees train`` with ``train_args`` (``--out out --steps steps --nproc 2``
    among them), SIGKILL rank 1 (the second spawned) once ``step-000002`` is published,
    check the launcher exits non-zero with a one-line message naming the rank and
    ``--resume``, that fewer than ``steps`` checkpoints exist, then ``--resume --nproc 2``
    and check it ends cleanly."""
    import psutil

    from train.trainer import latest_checkpoint

    rtrees = str(Path(sys.executable).with_name("rtrees"))
    proc = subprocess.Popen([rtrees, "train", *train_args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    target = Path(out) / "checkpoints" / "step-000002"
    deadline = time.time() + 600
    while not target.is_dir() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before a rank could be killed"
    ranks = sorted((c for c in psutil.Process(proc.pid).children()
                    if "spawn_main" in " ".join(c.cmdline())), key=lambda c: c.create_time())
    assert len(ranks) == 2
    os.kill(ranks[1].pid, signal.SIGKILL)  # rank 1 (spawned second)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "rank" in err and "--resume" in err and "Traceback" not in err
    done = latest_checkpoint(Path(out))
    assert done is not None and int(done.name.split("-")[1]) < steps
    res = subprocess.run([rtrees, "train", "--out", out, "--resume", "--nproc", "2"],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr
