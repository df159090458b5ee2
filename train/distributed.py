"""Data-parallel training over ``torch.distributed`` (issue 16): process group, ranks'
shares and reductions (collectives only: ``train/launch.py`` starts the ranks and calls
the trainer, so this module imports nothing of ``train.trainer``, issue 28).

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
  ``train.forward.forward_logprobs`` calls the decoder and the LM head directly (the
  head runs at loss columns only), never ``model.forward``, which DDP's reducer needs;
  and because a rank may hold no tokens of a mini-batch (uneven trees), where DDP would
  need a dummy forward.

Backends: ``gloo`` for CPU tensors, ``nccl`` for CUDA ones (``backend_for``). Ranks are
started by ``torchrun --nproc-per-node N -m cli.main train ...`` (it sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or by
``train.launch.launch`` (what ``rtrees train --nproc N`` calls): N spawned processes, a
free port on 127.0.0.1, the same environment variables; if one rank dies (an error,
``kill -9``) the others are stopped and the run continues with ``--resume`` from the
newest checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


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


def leave_process(code: int = 0) -> NoReturn:
    """End a spawned rank now, skipping the interpreter's finalization: flush the
    standard streams and logging, then ``os._exit(code)``.

    A rank that returned normally could still abort at exit ("terminate called without
    an active exception", SIGABRT) after every result was written: ``destroy_process_group``
    only drops c10d's own references, the FSDP device mesh keeps the gloo group alive,
    and gloo's worker threads are then torn down while the interpreter finalizes. Call
    it only when everything the rank produces is already on disk.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)


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


__all__ = ["DistributedError", "World", "all_max", "all_reduce_grads", "all_sum", "backend_for",
           "barrier", "finish", "gather_list", "gather_shards", "init_world", "leave_process",
           "reduce_sums"]
