"""Weight versions of a transformers checkpoint: the file hash (``weights_version``),
the in-memory hash (``state_dict_version``), the version a checkpoint's
``rtrees_policy.json`` names once the loaded weights reproduce it (``recorded_version``),
and the checks every loader makes first (``require_checkpoint_dir``, ``check_finite``)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from train.rundir import META_FILE, CheckpointError


def weights_version(path: str | Path) -> str:
    """First 12 hex digits of the sha256 of a checkpoint's safetensors file (of the
    per-file digests, in name order, when the checkpoint is sharded)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    digests = []
    for file in files:
        h = hashlib.sha256()
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digests.append(h.hexdigest())
    if len(digests) == 1:
        return digests[0][:12]
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:12]


def state_dict_version(model: torch.nn.Module) -> str:
    """A hash of in-memory weights (names, shapes, dtypes, bytes), for unsaved models."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "mem-" + h.hexdigest()[:12]


def check_finite(model: torch.nn.Module, where: str | Path) -> None:
    """``CheckpointError`` naming the first parameter or buffer with a NaN or inf."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{where} holds non-finite weights (NaN or inf in {name})")


def recorded_version(path: Path, model: torch.nn.Module, meta: dict[str, Any],
                     as_saved: Callable[[], torch.nn.Module] | None = None) -> str | None:
    """The ``policy_version`` that ``meta`` (a checkpoint's ``rtrees_policy.json``) names,
    once recomputed from the loaded ``model``; None when it names none.

    A version is accepted only when the weights reproduce it: the trainer's
    ``RUN-mem-HASH`` (``state_dict_version``: HASH is recomputed), a bare ``mem-HASH``,
    or the file hash ``weights_version(path)``. ``as_saved`` reloads the weights in
    their saved dtype, for a ``model`` loaded in another one. Anything else (a label the
    weights cannot confirm, or weights edited after it was written) is a
    ``CheckpointError`` naming both versions."""
    version = meta.get("policy_version")
    if version is None:
        return None
    memory = state_dict_version(model)
    if not (isinstance(version, str) and version.endswith(memory)) and as_saved is not None:
        memory = state_dict_version(as_saved())  # the dtype on disk, as the trainer hashed
    if isinstance(version, str) and (version == memory or version.endswith("-" + memory)):
        return version
    try:
        on_disk = weights_version(path)
    except FileNotFoundError:
        on_disk = None
    if isinstance(version, str) and version == on_disk:
        return version
    raise CheckpointError(
        f"{path / META_FILE} names policy version {version!r}, but the weights hash to "
        f"{memory!r} (file hash {on_disk!r}): the weights or the metadata were changed "
        "after the checkpoint was written")


@contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' progress bars off (loading and saving a tiny model is instant)."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def require_checkpoint_dir(path: Path) -> None:
    """``FileNotFoundError`` unless ``path`` holds a transformers ``config.json`` (the first
    check of every loader of a transformers checkpoint)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a transformers checkpoint (no config.json)")
