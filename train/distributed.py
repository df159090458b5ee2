"""Data-parallel training over ``torch.distributed`` (issue 16): process group, ranks'
shares, reductions, and the ``rtrees train --nproc N`` launcher.

The trainer (``train.trainer``) runs the same global computation on any number of ranks:

* iteration ``it`` draws the same ``tasks_per_step`` tasks on every rank; tree ``j``
  (seeded ``mix_seed(seed, "tree", it, j)``) is sampled by rank ``j mod W``
  (``World.shard``), and every rank receives every tree (``gather_shards``, in ``j``
  order), so credit, metrics and the mini-batch partition are those of one rank;
* rank 0 alone commits trees, policy scores, credit and metrics, with the keys of a
  single-process run (one commit per iteration, identical store contents for any W, and a
  resume may use another W);
* in each mini-batch a rank computes the loss of the trees it sampled, normalised by the
  GLOBAL denominator (G4: ``all_sum`` of the token / trajectory counts); the gradients are
  summed over ranks once per optimizer step (``all_reduce_grads``), so every rank applies
  the gradient of the whole mini-batch,

    g = sum_r sum_{t in rank r} w_t * grad l_t / D,   D = sum_r D_r,

  which is the single-rank gradient up to float summation order. These are DDP's
  semantics (one all-reduce of the accumulated gradients per step). We all-reduce
  ourselves rather than wrapping the model in ``DistributedDataParallel`` because
  ``train.batches.forward_logprobs`` calls the decoder and the LM head directly (the
  head runs at loss columns only), never ``model.forward``, which DDP's reducer needs;
  and because a rank may hold no tokens of a mini-batch (uneven trees), where DDP would
  need a dummy forward.

Backends: ``gloo`` for CPU tensors, ``nccl`` for CUDA ones (``backend_for``). Ranks are
started by ``torchrun --nproc-per-node N -m cli.main train ...`` (it sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or by ``launch`` (what
``rtrees train --nproc N`` calls): N spawned processes, a free port on 127.0.0.1, the same
environment variables; if one rank dies (an error, ``kill -9``) the others are stopped and
the run continues with ``--resume`` from the newest checkpoint.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import socket
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from train.config import TrainConfig
    from train.trainer import TrainReport

T = TypeVar("T")
ERROR_FILE = "rank-{rank}.error"
REPORT_FILE = "report.pkl"


class DistributedError(RuntimeError):
    """A rank failed or could not start; the message names the rank and the cause."""


@dataclass(frozen=True)
class World:
    """This process's place in the run: ``rank`` of ``size`` (1: no process group)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    owns_group: bool = False
    """True when ``init_world`` created the process group (``finish`` destroys it)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: commits to the store, writes checkpoints, metrics, evaluates."""
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of ``items``: positions j with j mod size == rank."""
        return list(items[self.rank::self.size])

    def owns(self, j: int) -> bool:
        return j % self.size == self.rank


def backend_for(device: torch.device | str) -> str:
    """``nccl`` where the tensors live on CUDA devices, ``gloo`` on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_world(device: torch.device | str = "cpu") -> World:
    """The world from the environment ``torchrun`` / ``launch`` set; joins the process
    group (``env://``) when ``WORLD_SIZE`` > 1 and it is not joined yet."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed")
    owns = False
    if not dist.is_initialized():
        # 60 min: the other ranks wait in a collective while rank 0 evaluates the held-out
        # split and writes a checkpoint (a killed peer is noticed at once: its socket closes)
        dist.init_process_group(backend_for(device), init_method="env://",
                                timeout=datetime.timedelta(minutes=60))
        owns = True
    return World(dist.get_rank(), dist.get_world_size(),
                 int(os.environ.get("LOCAL_RANK", dist.get_rank())), owns)


def finish(world: World) -> None:
    """Leave the process group if ``init_world`` joined it."""
    if world.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def _all_reduce(world: World, values: Sequence[float], op: Any) -> list[float]:
    if world.size == 1:
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_sum(world: World, values: Sequence[float]) -> list[float]:
    """Elementwise sum over ranks (float64; counts stay exact)."""
    return _all_reduce(world, values, dist.ReduceOp.SUM)


def all_max(world: World, values: Sequence[float]) -> list[float]:
    """Elementwise maximum over ranks."""
    return _all_reduce(world, values, dist.ReduceOp.MAX)


def reduce_sums(world: World, sums: dict[str, float]) -> dict[str, float]:
    """``sums`` (same keys on every rank) summed over ranks."""
    keys = sorted(sums)
    return dict(zip(keys, all_sum(world, [sums[k] for k in keys]), strict=True))


def gather_shards(world: World, shard: Sequence[T], n: int) -> list[T]:
    """The ``n`` items of which each rank holds ``shard`` (its ``World.shard``), on every
    rank, in global order (item j from rank j mod size)."""
    if world.size == 1:
        return list(shard)
    parts: list[Any] = [None] * world.size
    dist.all_gather_object(parts, list(shard))
    out: list[T] = [parts[j % world.size][j // world.size] for j in range(n)]
    return out


def gather_list(world: World, items: Sequence[T]) -> list[T]:
    """Every rank's ``items``, concatenated in rank order, on every rank."""
    if world.size == 1:
        return list(items)
    parts: list[Any] = [None] * world.size
    dist.all_gather_object(parts, list(items))
    return [x for part in parts for x in part]


def all_reduce_grads(world: World, params: Iterable[torch.nn.Parameter]) -> None:
    """Sum ``p.grad`` over ranks, in one flat buffer per dtype and device.

    A parameter none of the ranks produced a gradient for keeps ``grad = None`` (as on
    one rank, so AdamW skips it); one that some rank lacks counts zeros there.
    """
    if world.size == 1:
        return
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                       device=params[0].device)
    dist.all_reduce(has, op=dist.ReduceOp.SUM)
    live = [p for p, h in zip(params, has.tolist(), strict=True) if h > 0]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in live:
        groups.setdefault((p.dtype, p.device), []).append(p)
    for group in groups.values():
        grads = [p.grad for p in group if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # (sum numel,)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


# ----------------------------------------------------------------------------- launcher

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
    from train.config import ConfigError
    from train.trainer import TrainError, train

    try:
        report = train(config, resume=resume)
    except (ConfigError, TrainError, DistributedError) as exc:
        Path(scratch, ERROR_FILE.format(rank=rank)).write_text(f"{type(exc).__name__}: {exc}")
        raise SystemExit(2) from None
    if rank == 0:
        Path(scratch, REPORT_FILE).write_bytes(pickle.dumps(report))


def launch(config: TrainConfig, resume: bool = False, nproc: int = 1) -> TrainReport:
    """Run ``train(config, resume)`` on ``nproc`` ranks on this machine (``nproc`` = 1:
    in this process) and return rank 0's report.

    Ranks are spawned processes (``torch.multiprocessing``, gloo on 127.0.0.1 and a free
    port). If a rank fails or is killed, the others are stopped and ``DistributedError``
    names the rank (the run resumes with ``resume=True``).
    """
    from train.trainer import check_config, train

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


__all__ = ["DistributedError", "World", "all_max", "all_reduce_grads", "all_sum", "backend_for",
           "barrier", "finish", "free_port", "gather_list", "gather_shards", "init_world",
           "launch", "reduce_sums"]
