"""Checkpoint directories: written whole or not at all, checked before they are trusted.

A checkpoint is a flat directory of files (an ordinary Hugging Face directory, plus what
its writer adds) and ``META_FILE`` (``rtrees_policy.json``), a JSON object that names the
weights' ``policy_version`` and records, under ``"files"``, the sha256 of every other file.

``write_checkpoint(path, fill, meta)``
  1. ``fill(tmp)`` writes the files into a sibling temporary directory ``.NAME.tmp-PID``
     (a name readers skip);
  2. the digest of each file goes into ``meta["files"]`` and ``META_FILE`` is written
     last;
  3. every file and the directory are fsynced, then the directory is renamed into place
     (an existing one moved aside first and removed after), and the parent is fsynced.
  A reader never sees half a checkpoint; an interrupted write leaves the old one intact.

  ``begin_checkpoint`` / ``publish_checkpoint`` are these steps apart, for a checkpoint
  written by several ranks (a sharded save: every rank fills the one staging directory
  rank 0 made; rank 0 publishes after a barrier). Files may lie in subdirectories.

``verify_checkpoint(path, require)``
  ``META_FILE`` must parse as a JSON object; every file it lists must exist with that
  digest (truncated, edited, flipped or replaced files fail here), and every name in
  ``require`` must be among the listed files. ``CheckpointError`` names the file.

``save_state(state, json_file, tensor_file)`` / ``load_state``
  nested plain state (dicts, lists, tuples, numbers, strings, tensors, numeric arrays:
  an optimizer's ``state_dict``, RNG states) as JSON plus one safetensors file, in place
  of a pickle; ``load_state`` refuses anything ``save_state`` would not have written.

Nothing here unpickles or imports anything from a checkpoint: JSON, safetensors and raw
bytes only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

META_FILE = "rtrees_policy.json"
DIGESTS_KEY = "files"  # META_FILE key: {relative file name: sha256 hex}


class CheckpointError(ValueError):
    """A checkpoint that is damaged, incomplete, edited, or belongs elsewhere; the message
    names the checkpoint and the file."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digests(directory: Path) -> dict[str, str]:
    """``{name: sha256}`` of every file under ``directory`` but ``META_FILE`` (names are
    POSIX paths relative to it, sorted)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    return {p.relative_to(directory).as_posix(): sha256_file(p) for p in files
            if p.relative_to(directory).as_posix() != META_FILE}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_dir(path: Path, token: int | None = None) -> Path:
    """The temporary sibling ``.NAME.tmp-TOKEN`` a checkpoint ``path`` is written in
    (``token``: the writer's pid by default; the ranks of a sharded save agree on rank
    0's, so every rank writes its shard into one directory)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid() if token is None else token}")


def begin_checkpoint(path: Path, token: int | None = None) -> Path:
    """Step 1 of ``write_checkpoint`` without the filling: an empty ``staging_dir``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(path, token)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def publish_checkpoint(path: Path, tmp: Path, meta: dict[str, Any],
                       mode: int | None = None) -> Path:
    """Steps 2-3 of ``write_checkpoint`` on a filled ``tmp`` (``begin_checkpoint``): the
    digests and ``META_FILE``, fsync, the rename into place."""
    path = Path(path)
    record = {**meta, DIGESTS_KEY: file_digests(tmp)}
    (tmp / META_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    for file in tmp.rglob("*"):
        if file.is_file():
            if mode is not None:
                file.chmod(mode)
            _fsync(file)
    for sub in sorted((d for d in tmp.rglob("*") if d.is_dir()), reverse=True):
        _fsync(sub)
    _fsync(tmp)
    if path.exists():  # a rewrite of the same checkpoint: move the old one aside first
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
    _fsync(path.parent)
    return path


def write_checkpoint(path: Path, fill: Callable[[Path], None], meta: dict[str, Any],
                     mode: int | None = None) -> Path:
    """Write the checkpoint ``path`` atomically (module docstring): ``fill(tmp)`` writes
    its files, ``meta`` plus their digests becomes ``META_FILE``. ``mode``: permissions
    set on every file (e.g. 0o644 for a shared cache; safetensors writes 0600). A writer
    whose files come from several processes (``train.fsdp``: each rank's shard) calls
    ``begin_checkpoint`` and ``publish_checkpoint`` itself, with a barrier between."""
    tmp = begin_checkpoint(path)
    fill(tmp)
    return publish_checkpoint(path, tmp, meta, mode)


def read_meta(path: Path) -> dict[str, Any] | None:
    """``path``'s ``META_FILE`` as a dict, None when there is none; ``CheckpointError``
    when it is not a JSON object."""
    file = Path(path) / META_FILE
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_bytes())
    except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, too deep
        raise CheckpointError(f"{file} is not valid JSON (damaged or edited): "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                              ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} is not a JSON object (damaged or edited)")
    return data


def verify_checkpoint(path: Path, require: Iterable[str] = ()) -> dict[str, Any]:
    """``path``'s metadata after checking every recorded file digest (module docstring);
    ``require``: file names that must be recorded (and so present and intact)."""
    path = Path(path)
    meta = read_meta(path)
    if meta is None:
        raise CheckpointError(f"{path} has no {META_FILE} (incomplete or not a checkpoint)")
    digests = meta.get(DIGESTS_KEY)
    if not isinstance(digests, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in digests.items()):
        raise CheckpointError(f"{path / META_FILE} records no file digests "
                              f"({DIGESTS_KEY!r}): damaged, edited or not written by rtrees")
    for name in require:
        if name not in digests:
            raise CheckpointError(f"{path / META_FILE} does not record {name}")
    root = path.resolve()
    for name, digest in sorted(digests.items()):
        file = (path / name)
        if not file.resolve().is_relative_to(root) or name == META_FILE:
            raise CheckpointError(f"{path / META_FILE} records a file outside the "
                                  f"checkpoint: {name!r}")
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{file} does not match the sha256 recorded in {META_FILE} "
                                  "(damaged or edited)")
    return meta


# ----------------------------------------------------------------- plain state, no pickle

STATE_FORMAT = 1
_TAGS = ("$tensor", "$ndarray", "$tuple", "$dict")


def save_state(state: Any, json_file: Path, tensor_file: Path) -> None:
    """Write nested plain state without pickle: structure and scalars as JSON
    (``json_file``), every ``torch.Tensor`` and ``numpy.ndarray`` into one safetensors
    file (``tensor_file``), referenced from the JSON by key.

    Encodings: a tensor is ``{"$tensor": KEY}``; an array ``{"$ndarray": KEY, "dtype",
    "shape"}`` (its bytes as a uint8 tensor); a tuple ``{"$tuple": [...]}``; a dict with
    a non-string key (or a key starting with ``$``) ``{"$dict": [[k, v], ...]}``.
    Floats round-trip exactly (``repr``). Anything else is a ``TypeError``."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = x.detach().cpu().contiguous().clone()
            return {"$tensor": key}
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "biuf":
                raise TypeError(f"cannot store an array of dtype {x.dtype}")
            key = f"t{len(tensors)}"
            tensors[key] = torch.frombuffer(bytearray(np.ascontiguousarray(x).tobytes()),
                                            dtype=torch.uint8)
            return {"$ndarray": key, "dtype": x.dtype.str, "shape": list(x.shape)}
        if isinstance(x, tuple):
            return {"$tuple": [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: enc(v) for k, v in x.items()}
            return {"$dict": [[enc(k), enc(v)] for k, v in x.items()]}
        if x is None or isinstance(x, bool | int | float | str):
            return x
        raise TypeError(f"cannot store a {type(x).__name__} in trainer state")

    doc = {"format": STATE_FORMAT, "state": enc(state)}
    json_file.write_text(json.dumps(doc) + "\n")
    save_file(tensors, str(tensor_file))


def load_state(json_file: Path, tensor_file: Path) -> Any:
    """The state ``save_state`` wrote; ``CheckpointError`` naming the file for anything
    it would not have written. Reads JSON and safetensors only: nothing can run code."""
    import numpy as np
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        doc = json.loads(json_file.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{json_file} is not valid JSON ({type(exc).__name__})"
                              ) from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or "state" not in doc:
        raise CheckpointError(f"{json_file} is not trainer state of format {STATE_FORMAT}")
    try:
        tensors = load_file(str(tensor_file))
    except (OSError, SafetensorError, ValueError) as exc:
        raise CheckpointError(f"{tensor_file} is not a safetensors file "
                              f"({type(exc).__name__})") from None

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{json_file}: {what}")

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            tags = [t for t in _TAGS if t in x]
            if not tags:
                if any(k.startswith("$") for k in x):
                    raise bad(f"unknown tag in {sorted(x)}")
                return {k: dec(v) for k, v in x.items()}
            tag = tags[0]
            if tag == "$tuple":
                if not isinstance(x[tag], list):
                    raise bad("a $tuple that is not a list")
                return tuple(dec(v) for v in x[tag])
            if tag == "$dict":
                pairs = x[tag]
                if not isinstance(pairs, list) or not all(
                        isinstance(p, list) and len(p) == 2 for p in pairs):
                    raise bad("a $dict that is not a list of pairs")
                out = {}
                for k, v in pairs:
                    key = dec(k)
                    if not isinstance(key, int | str | float | bool | tuple) and key is not None:
                        raise bad(f"an unhashable $dict key {type(key).__name__}")
                    out[key] = dec(v)
                return out
            key = x[tag]
            if not isinstance(key, str) or key not in tensors:
                raise bad(f"tensor {key!r} is not in {tensor_file.name}")
            if tag == "$tensor":
                return tensors[key]
            dtype, shape = x.get("dtype"), x.get("shape")
            try:
                dt = np.dtype(dtype) if isinstance(dtype, str) else None
            except TypeError:
                dt = None
            if dt is None or dt.kind not in "biuf" or not isinstance(shape, list) or not all(
                    isinstance(n, int) and n >= 0 for n in shape):
                raise bad(f"array {key!r} has a bad dtype or shape")
            raw = tensors[key].numpy().tobytes()
            if len(raw) != dt.itemsize * int(np.prod(shape, dtype=np.int64)):
                raise bad(f"array {key!r} has {len(raw)} bytes, not {dt} x {shape}")
            return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
        return x

    try:
        return dec(doc["state"])
    except RecursionError:
        raise bad("nested too deeply") from None


__all__ = ["DIGESTS_KEY", "META_FILE", "STATE_FORMAT", "CheckpointError", "begin_checkpoint",
           "file_digests", "load_state", "publish_checkpoint", "read_meta", "save_state",
           "sha256_file", "staging_dir", "verify_checkpoint", "write_checkpoint"]
