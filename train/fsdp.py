"""Sharded training with torch's FSDP2 and distributed checkpoints (issue 27).

Built on ``torch.distributed.fsdp.fully_shard`` and ``torch.distributed.checkpoint``
(DCP), not a home-made sharding. What runs here, on CPU and gloo (torch 2.13):

* ``shard_model(model, world)``: every decoder layer is its own FSDP unit, the token
  embeddings and the LM head one unit (the tiny policy ties them: one parameter, so one
  unit with both modules), the decoder's remaining parameters (the final norm) the
  outer unit. ``train.forward.forward_logprobs`` calls the decoder and the head directly
  (the head at loss columns only), never ``model.forward``; each of those calls is an
  FSDP unit's forward, so its parameters are gathered there. Gradients are SUMMED over
  ranks (``set_gradient_divide_factor(1)`` with sum-only collectives: gloo has no
  PREMUL_SUM), so, as in the data-parallel path (``train/distributed.py``), every rank's
  loss is normalised by the GLOBAL denominator and

    g = sum_r sum_{t in rank r} w_t * grad l_t / D,   D = sum_r D_r,

  is the single-rank gradient up to float summation order; each rank keeps 1/W of it.
* Every rank must run the same number of forward/backward passes per optimizer step
  (each is a collective): ``passes_needed`` agrees on the count BEFORE the first pass
  (a reduction between passes would meet another rank's all-gather: a deadlock, seen
  here), and ``dummy_backward`` runs a zero-weight pass on a rank with fewer
  micro-batches (no tokens of its own).
* Mixed precision (``mixed_precision``): bf16 parameters with fp32 gradient reduction on
  CUDA devices that support bf16; none on CPU (fp32 throughout): CPU bf16 matmuls are
  slow and would break the 1e-5 equality with one unsharded rank.
* Checkpoints: ``save_sharded`` writes the model and optimizer state as a DCP checkpoint
  (each rank its shard, ``dcp/``), the HF directory of the FULL weights from rank 0
  (``full_state_dict``: ``hf:PATH`` and ``policy_ref`` load it as before) and the caller's
  files, all in one staging directory published atomically by rank 0
  (``train.rundir.begin_checkpoint`` / ``publish_checkpoint``, the one atomic writer).
  ``load_sharded`` reads the DCP state into a model sharded over ANY number of ranks
  (DCP reshards on load): a run saved by 2 ranks resumes on 1 or 3.

What the trainer calls (``rtrees train --shard fsdp``, ``train.trainer``):

* ``shard_for_training(model, world)``: the model the loop trains, a sharded COPY of the
  loaded one (one rank: the model itself); the loaded model stays whole on every rank
  and is the one the sampler, the held-out evaluation, the scorers and the
  ``policy_version`` hash read (every forward of a sharded unit is a collective, and
  ranks sample different trees with different numbers of forwards);
* ``copy_full_weights(sharded, replica)`` after each iteration's optimizer steps: the
  full parameters gathered (exact: an all-gather concatenates) into the replica;
* ``Shards`` names what a checkpoint is written from; the trainer's checkpoint goes
  through ``save_sharded`` with its HF directory and trainer state as ``fill``.

An optimizer that has not stepped yet (the step-0 checkpoint) is saved WITHOUT its state:
``get_state_dict`` would initialise AdamW's state by a zero-gradient step (step count 1),
and the run would no longer be the unsharded one; ``load_sharded`` then leaves the
optimizer fresh, as a run from step 0 has it.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from train.distributed import World, all_max, barrier
from train.rundir import begin_checkpoint, publish_checkpoint, staging_dir

DCP_DIR = "dcp"  # the sharded model + optimizer state inside a checkpoint
OPTIM_KEY = "optim"  # top-level key of the optimizer state in the DCP checkpoint


class ShardError(RuntimeError):
    """A model FSDP cannot shard as asked; the message names what is missing."""


def mixed_precision(device: torch.device | str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``device``: bf16 parameters, fp32 reduction on a
    CUDA device with bf16; None (fp32) on CPU (module docstring)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_bf16_supported():
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_model(model: torch.nn.Module, world: World,
                device: torch.device | str = "cpu") -> list[Any]:
    """Wrap a Hugging Face causal LM with ``fully_shard`` in place (module docstring);
    returns the FSDP units. One rank: nothing is wrapped (the unsharded model)."""
    if world.size == 1:
        return []
    from torch.distributed.fsdp import FSDPModule, fully_shard

    lm: Any = model  # a Hugging Face PreTrainedModel (get_decoder, get_output_embeddings)
    base = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    layers = getattr(base, "layers", None)
    embed = getattr(base, "embed_tokens", None)
    if base is None or head is None or layers is None or embed is None:
        raise ShardError(f"{type(model).__name__} has no decoder layers, token embeddings "
                         "and LM head to shard (a Llama-style Hugging Face model is needed)")
    mp = mixed_precision(device)
    kw: dict[str, Any] = {} if mp is None else {"mp_policy": mp}
    for layer in layers:
        fully_shard(layer, **kw)
    tied = head.weight is embed.weight
    fully_shard([embed, head] if tied else embed, **kw)
    if not tied:
        fully_shard(head, **kw)
    fully_shard(base, **kw)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # sum over ranks, as all_reduce_grads does
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return units


def passes_needed(world: World, n_mine: int) -> int:
    """The number of forward/backward passes every rank runs in one optimizer step: the
    most micro-batches any rank holds (a rank with fewer runs ``dummy_backward``)."""
    return int(all_max(world, [float(n_mine)])[0])


def dummy_backward(model: torch.nn.Module, pad_id: int = 0) -> None:
    """A forward and backward of one pad token through the decoder and the head with
    weight 0: this rank's part of every unit's all-gather and reduce-scatter, no
    gradient of its own."""
    base = model.get_decoder()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    ids = torch.full((1, 1), pad_id, dtype=torch.long)
    hidden = base(input_ids=ids, use_cache=False).last_hidden_state  # (1, 1, H)
    (head(hidden[:, 0]).float().sum() * 0.0).backward()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU; a collective on every rank, the tensors are
    rank 0's to use (others get an empty dict). One rank: the model's own state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    return {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 with_optim: bool = True) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as DCP reads and writes them (this rank's shards);
    without ``with_optim`` the model alone (module docstring: a fresh optimizer)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not with_optim:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, OPTIM_KEY: osd}


@contextlib.contextmanager
def _quiet_one_process() -> Any:
    """Without a process group (one rank) DCP reads and writes in this process, as asked,
    and would say so in a ``UserWarning`` on every checkpoint: not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        yield


def save_sharded(path: Path, world: World, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, meta: dict[str, Any],
                 fill: Callable[[Path, dict[str, torch.Tensor]], None] | None = None,
                 gather_full: bool = True) -> Path:
    """Checkpoint ``path`` written by every rank (module docstring): each rank's shard of
    the model and optimizer under ``dcp/`` (the optimizer only once it has state);
    rank 0's ``fill(tmp, full_weights)`` (the HF export, trainer state); ``meta`` and the
    digests, published atomically by rank 0. ``gather_full=False``: ``fill`` gets an
    empty dict (the caller holds the full weights already: the trainer's replica).
    Called on every rank; a rank killed before the publish leaves no checkpoint."""
    import torch.distributed.checkpoint as dcp

    token = [os.getpid()]  # rank 0's pid names the one staging directory
    if world.size > 1:
        dist.broadcast_object_list(token, src=0)
    tmp = staging_dir(path, token[0])
    if world.is_main:
        begin_checkpoint(path, token[0])
    barrier(world)  # the staging directory exists before any rank writes its shard
    with _quiet_one_process():
        dcp.save(_state_dicts(model, optimizer, with_optim=bool(optimizer.state)),
                 checkpoint_id=str(tmp / DCP_DIR), no_dist=not dist.is_initialized())
    full = full_state_dict(model) if gather_full else {}
    barrier(world)  # every shard is written
    if world.is_main:
        if fill is not None:
            fill(tmp, full)
        publish_checkpoint(path, tmp, meta)
    barrier(world)  # published before any rank goes on (a resume may read it at once)
    return Path(path)


_METADATA_MODULES = ("torch.distributed.checkpoint.", "collections")
_METADATA_TORCH = {"Size", "device"}
_METADATA_NAMES = {("torch.serialization", "_get_layout"),  # a layout by its name
                   ("pathlib", "PosixPath")}  # the storage metadata's checkpoint id


class CheckpointPickleError(ValueError):
    """A DCP checkpoint's metadata names something other than DCP's own plain records."""


def _safe_unpickler(stream: Any) -> Any:
    """An unpickler for DCP's ``.metadata``, which torch writes with ``pickle``: it may build
    only DCP's metadata records, ``collections`` containers, ``torch.Size``, devices,
    dtypes, layouts (by name) and a path, so a planted payload (``os.system``,
    ``builtins.eval``, ...) is refused by name and never runs."""
    import pickle

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            ok = module.startswith(_METADATA_MODULES) or (module, name) in \
                _METADATA_NAMES or (module == "torch" and (name in _METADATA_TORCH
                                       or isinstance(getattr(torch, name, None), torch.dtype)))
            if not ok:
                raise CheckpointPickleError(f"DCP metadata names {module}.{name}, which a "
                                            "checkpoint's metadata never holds")
            return super().find_class(module, name)

    return Unpickler(stream)


def _safe_storage(where: str) -> tuple[Any, Any]:
    """(reader, planner) for ``dcp.load`` that run no pickled code: the metadata through
    ``_safe_unpickler``; tensors are read by torch with ``weights_only=True`` already,
    and the planner reads the non-tensor entries (optimizer ``param_groups``) the same way
    instead of DCP's default ``weights_only=False``."""
    import io

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import ReadItem

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            with open(os.path.join(where, ".metadata"), "rb") as f:
                metadata = _safe_unpickler(f).load()
            if not isinstance(metadata, Metadata):
                raise CheckpointPickleError(f"{where}/.metadata holds no DCP metadata")
            meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            meta.load_id = self.load_id
            metadata.storage_meta = meta
            return metadata

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return Reader(where), Planner()


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore the model and optimizer state of a ``save_sharded`` checkpoint into
    ``model`` (sharded over any number of ranks, or unsharded) in place; every rank.
    A checkpoint saved before the optimizer's first step holds no optimizer state: the
    optimizer is left as it is (fresh). No pickled code runs (``_safe_storage``): a
    planted payload is a ``CheckpointPickleError`` naming what it asked for."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    where = str(Path(path) / DCP_DIR)
    reader, planner = _safe_storage(where)
    stored = reader.read_metadata().state_dict_metadata
    with_optim = any(k.split(".")[0] == OPTIM_KEY for k in stored)
    state = _state_dicts(model, optimizer, with_optim)
    with _quiet_one_process():
        dcp.load(state, storage_reader=reader, planner=planner,
                 no_dist=not dist.is_initialized())
    if with_optim:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state[OPTIM_KEY])
    else:
        set_model_state_dict(model, state["model"])


@dataclass(frozen=True)
class Shards:
    """What a sharded checkpoint is written from (``save_sharded``): this rank's place,
    the sharded model, its optimizer."""

    world: World
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def shard_for_training(model: torch.nn.Module, world: World,
                       device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model the trainer trains (module docstring): one rank, ``model`` itself
    (unsharded); more, a copy of it sharded by ``shard_model``; ``model`` stays whole,
    the replica that samples. ``ShardError`` for a model without decoder layers."""
    if world.size == 1:
        return model
    sharded = copy.deepcopy(model)
    shard_model(sharded, world, device)
    return sharded


def copy_full_weights(sharded: torch.nn.Module, replica: torch.nn.Module) -> None:
    """``replica``'s parameters <- the full parameters of ``sharded`` (one all-gather per
    parameter, in the same order on every rank: a collective); nothing when they are one
    model (one rank). The copy is exact (an all-gather concatenates the shards)."""
    if sharded is replica:
        return
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for (name, p), (other, q) in zip(sharded.named_parameters(),
                                         replica.named_parameters(), strict=True):
            if name != other:
                raise ShardError(f"the sampling replica's parameter {other} is not {name}")
            q.copy_(p.full_tensor() if isinstance(p, DTensor) else p)


def full_value(x: torch.Tensor) -> float:
    """A scalar that may be a ``DTensor`` (the gradient norm of sharded parameters), as a
    float (every rank: a collective for a DTensor)."""
    from torch.distributed.tensor import DTensor

    return float(x.full_tensor() if isinstance(x, DTensor) else x)


__all__ = ["DCP_DIR", "OPTIM_KEY", "ShardError", "Shards", "copy_full_weights",
           "dummy_backward", "full_state_dict", "full_value", "load_sharded",
           "mixed_precision", "passes_needed", "save_sharded", "shard_for_training",
           "shard_model"]
