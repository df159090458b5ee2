"""The process launcher of ``rtrees train --nproc N`` (issue 16): N spawned ranks on this
machine, each calling ``train.trainer.train``; rank 0's report comes back. With
``--shard fsdp`` (``TrainConfig.shard``) the same ranks shard the model (``train.fsdp``);
nothing here changes.

Ranks get the environment ``torchrun`` would set (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` = 127.0.0.1, ``MASTER_PORT`` a free port) and join the
process group in ``train.distributed.init_world``. If one rank dies (an error,
``kill -9``) the others are stopped and ``DistributedError`` names the rank; the run
continues with ``--resume`` from the newest checkpoint. This module sits above both the
collectives (``train/distributed.py``) and the trainer, which import neither it nor each
other's launcher (issue 28).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import tempfile
from pathlib import Path

import torch

from train.config import ConfigError, TrainConfig
from train.distributed import DistributedError, leave_process
from train.trainer import TrainError, TrainReport, check_config, train

ERROR_FILE = "rank-{rank}.error"
REPORT_FILE = "report.pkl"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, size: int, port: int, config: TrainConfig, resume: bool,
            scratch: str) -> None:
    """One rank of ``launch`` (a spawned process): the torchrun environment, then
    ``train``. A named error is written to ``scratch`` and ends the rank with code 2."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun: do not oversubscribe the cores
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    try:
        report = train(config, resume=resume)
    except (ConfigError, TrainError, DistributedError) as exc:
        Path(scratch, ERROR_FILE.format(rank=rank)).write_text(f"{type(exc).__name__}: {exc}")
        raise SystemExit(2) from None
    if rank == 0:
        Path(scratch, REPORT_FILE).write_bytes(pickle.dumps(report))
    leave_process(0)  # everything is on disk: skip the teardown that can abort (see there)


def launch(config: TrainConfig, resume: bool = False, nproc: int = 1) -> TrainReport:
    """Run ``train(config, resume)`` on ``nproc`` ranks on this machine (``nproc`` = 1:
    in this process) and return rank 0's report.

    Ranks are spawned processes (``torch.multiprocessing``, gloo on 127.0.0.1 and a free
    port). If a rank fails or is killed, the others are stopped and ``DistributedError``
    names the rank (the run resumes with ``resume=True``).
    """
    if nproc < 1:
        raise DistributedError(f"nproc must be >= 1, got {nproc}")
    if nproc == 1:
        return train(config, resume=resume)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DistributedError("already inside a distributed launch (WORLD_SIZE is set); "
                               "pass --nproc only outside torchrun")
    check_config(config, world_size=nproc)  # named errors before any process starts
    import torch.multiprocessing as mp

    # the failed rank is reported by DistributedError in one line; torch's own notice of
    # stopping the other ranks would be a second one
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="rtrees-ddp-") as scratch:
        try:
            mp.start_processes(_worker, args=(nproc, free_port(), config, resume, scratch),
                               nprocs=nproc, join=True, start_method="spawn")
        except mp.ProcessExitedException as exc:
            errors = sorted(Path(scratch).glob("rank-*.error"))
            if errors:
                raise DistributedError(errors[0].read_text()) from None
            code = exc.exit_code
            how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exited with code {code}")
            raise DistributedError(f"rank {exc.error_index} {how}; the other ranks were "
                                   "stopped; continue the run with --resume") from None
        except mp.ProcessRaisedException as exc:
            last = [ln for ln in str(exc).splitlines() if ln.strip()][-1]
            raise DistributedError(f"rank {exc.error_index} failed: {last}; continue the run "
                                   "with --resume") from None
        report: TrainReport = pickle.loads(Path(scratch, REPORT_FILE).read_bytes())
        return report


__all__ = ["ERROR_FILE", "REPORT_FILE", "free_port", "launch"]
