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

``save_state(state, json_file, tensor_file, bind)`` / ``load_state``
  nested plain state (dicts, lists, tuples, numbers, strings, tensors, numeric arrays:
  an optimizer's ``state_dict``, RNG states) as JSON plus one safetensors file, in place
  of a pickle; ``load_state`` refuses anything ``save_state`` would not have written.

``StateBinding``: the trainer state bound to what it describes (issue 50 item 7)
  A digest in ``META_FILE`` is no binding by itself: whoever edits ``trainer_state.json``
  can rewrite it. So ``save_state(..., bind)`` also records, under ``"binding"``, the run
  id, the step, the run token and the sha256 of every weights file (``*.safetensors``
  beside the state), and commits to the store's ``metrics`` a record of the state: one
  row per top-level field (``iteration``, ``rng``, ``optimizer``, ``scheduler``,
  ``store_version``, ``sampler_state``, ... and ``binding``), step ``STATE_RECORD_STEP``
  (a bookkeeping row, hidden from training metrics), name
  ``checkpoint_state/STEP/FIELD``, value the first 52 bits of the field's sha256 (exact
  in a float64). ``load_state(..., bind)`` refuses, naming the file and the field:

  * a binding of another step or run id, or an ``iteration`` that is not the step;
  * a run token other than ``config.json``'s and the store's ``run_token`` row;
  * a weights file whose sha256 is not the recorded one (``the weights digest does not
    match model.safetensors``), or weights files added or removed;
  * a ``store_version`` that is not a table -> version map, is newer than the store, or
    older than the commits of the iteration before the checkpoint (its trees and metrics,
    keyed ``RUN:trees:K-1`` / ``RUN:metrics:K-1``);
  * any field whose digest is not the one the store recorded for the step (``rng``,
    ``optimizer``, ... edited since it was written), or a step the store recorded no
    state for.

  The store is the anchor: the checkpoint directory and ``config.json`` can be rewritten
  together, but the store's commits are append-only records the forger must also forge.

Nothing here unpickles or imports anything from a checkpoint: JSON, safetensors and raw
bytes only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rollout_store.store import Store

META_FILE = "rtrees_policy.json"
DIGESTS_KEY = "files"  # META_FILE key: {relative file name: sha256 hex}
BINDING_KEY = "binding"  # trainer-state JSON key beside "state" (StateBinding)
STATE_RECORD_STEP = -4
"""``metrics`` step of the state records (``StateBinding``): a bookkeeping row, below
``rollout_store.attempts.FIRST_METRIC_STEP`` like the run token (-2) and attempts (-3)."""
STATE_RECORD_METRIC = "checkpoint_state"
# The trainer's row naming the run directory that owns a run id (train.trainer.OWNER_METRIC
# and OWNER_STEP; repeated here because the trainer imports this module).
RUN_TOKEN_METRIC = "run_token"
RUN_TOKEN_STEP = -2


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


@dataclass(frozen=True)
class StateBinding:
    """What a checkpoint's trainer state is bound to (module docstring): the run id, the
    checkpoint's step, the run token (``config.json``'s) and the store the run commits to
    (None: the store's records are neither written nor checked)."""

    run_id: str
    step: int
    run_token: int | None
    store: Store | None


def save_state(state: Any, json_file: Path, tensor_file: Path,
               bind: StateBinding | None = None) -> dict[str, str]:
    """Write nested plain state without pickle: structure and scalars as JSON
    (``json_file``), every ``torch.Tensor`` and ``numpy.ndarray`` into one safetensors
    file (``tensor_file``), referenced from the JSON by key. With ``bind``: the binding
    (run id, step, run token, sha256 of the ``*.safetensors`` weights beside
    ``json_file``, which must be written first) goes into the JSON, and the store's
    record of the state is committed (module docstring). Returns the sha256 of each
    top-level field (``state_digests``).

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

    doc: dict[str, Any] = {"format": STATE_FORMAT, "state": enc(state)}
    if bind is not None:
        doc[BINDING_KEY] = {"run_id": bind.run_id, "step": bind.step,
                            "run_token": bind.run_token,
                            "weights": weight_digests(json_file.parent)}
    json_file.write_text(json.dumps(doc) + "\n")
    save_file(tensors, str(tensor_file))
    digests = state_digests(doc, tensors)
    if bind is not None and bind.store is not None:
        record_state(bind.store, bind.run_id, bind.step, digests)
    return digests


def weight_digests(directory: Path) -> dict[str, str]:
    """``{name: sha256}`` of the weights files (``*.safetensors``) directly in
    ``directory``: the HF export a checkpoint loads (FSDP's ``dcp/`` shards are covered
    by ``META_FILE``'s digests only)."""
    return {p.name: sha256_file(p) for p in sorted(directory.glob("*.safetensors"))
            if p.is_file()}


def _tensor_keys(x: Any) -> Iterator[str]:
    """The tensor keys an encoded value references, in order (iterative: any depth)."""
    stack = [x]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for tag in ("$tensor", "$ndarray"):
                if isinstance(item.get(tag), str):
                    yield item[tag]
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list):
            stack.extend(reversed(item))


def state_digests(doc: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, str]:
    """sha256 of each top-level field of an encoded state document (``save_state``'s
    ``doc``; a non-dict state is one field, ``state``), over its canonical JSON and the
    bytes, dtype and shape of every tensor it references, plus ``binding``'s."""
    import torch

    state = doc.get("state")
    fields: dict[str, Any] = dict(state) if isinstance(state, dict) and not any(
        k.startswith("$") for k in state) else {"state": state}
    if BINDING_KEY in doc:
        fields[BINDING_KEY] = doc[BINDING_KEY]
    out = {}
    for name, value in fields.items():
        h = hashlib.sha256(json.dumps(value, sort_keys=True).encode())
        for key in _tensor_keys(value):
            t = tensors.get(key)
            if t is None:
                h.update(f"missing:{key}".encode())
                continue
            h.update(f"{key}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                     .tobytes())
        out[name] = h.hexdigest()
    return out


def _record_value(digest: str) -> float:
    """The first 52 bits of a hex digest, as the float64 a metrics row holds exactly."""
    return float(int(digest[:13], 16))


def _record_name(step: int, field: str) -> str:
    return f"{STATE_RECORD_METRIC}/{step:06d}/{field}"


def record_state(store: Store, run_id: str, step: int, digests: Mapping[str, str]) -> None:
    """Commit the store's record of the trainer state of checkpoint ``step`` (module
    docstring), keyed by its digests: a rewrite of the same state lands once."""
    from rollout_store.schema import metrics_table
    from rollout_store.store import CommitKeyConflictError, now_utc

    whole = hashlib.sha256(json.dumps(dict(digests), sort_keys=True).encode()).hexdigest()
    rows = {_record_name(step, k): _record_value(v) for k, v in sorted(digests.items())}
    # the same digests under the same key are recorded already (only the time differs)
    with contextlib.suppress(CommitKeyConflictError):
        store.append_metrics(metrics_table(run_id, STATE_RECORD_STEP, rows, now_utc()),
                             key=f"{run_id}:{STATE_RECORD_METRIC}:{step}:{whole[:32]}")


def load_state(json_file: Path, tensor_file: Path, bind: StateBinding | None = None) -> Any:
    """The state ``save_state`` wrote; ``CheckpointError`` naming the file for anything
    it would not have written. Reads JSON and safetensors only: nothing can run code.
    With ``bind``: also every check of the state's binding (module docstring,
    ``check_binding``)."""
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
        state = dec(doc["state"])
    except RecursionError:
        raise bad("nested too deeply") from None
    if bind is not None:
        check_binding(json_file, doc, tensors, state, bind)
    return state


def check_binding(json_file: Path, doc: Mapping[str, Any], tensors: Mapping[str, Any],
                  state: Any, bind: StateBinding) -> None:
    """``CheckpointError`` naming ``json_file`` and the field unless the state document
    ``doc`` (with its ``tensors``; ``state`` decoded) is bound to ``bind``: the checks of
    the module docstring, in its order."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{json_file}: {what}")

    binding = doc.get(BINDING_KEY)
    if not isinstance(binding, dict):
        raise bad("records no binding to its weights, run and store (written before "
                  "trainer states were bound, or edited)")
    step = binding.get("step")
    if step != bind.step or not isinstance(state, dict) or state.get("iteration") != bind.step:
        got = state.get("iteration") if isinstance(state, dict) else None
        raise bad(f"step {step!r} (iteration {got!r}) is not this checkpoint's step "
                  f"{bind.step}")
    if binding.get("run_id") != bind.run_id:
        raise bad(f"run id {binding.get('run_id')!r} is not this run's {bind.run_id!r}")
    token = binding.get("run_token")
    if token != bind.run_token:
        raise bad(f"run token {token!r} does not match the run directory's config.json "
                  f"({bind.run_token!r})")
    weights = binding.get("weights")
    here = weight_digests(json_file.parent)
    if not isinstance(weights, dict) or sorted(weights) != sorted(here):
        names = sorted(weights) if isinstance(weights, dict) else weights
        raise bad(f"records weights files {names!r}, but the checkpoint holds {sorted(here)}")
    for name, digest in sorted(here.items()):
        if weights[name] != digest:
            raise bad(f"the weights digest does not match {name}")
    if bind.store is None:
        return
    from rollout_store.reader import connect

    con = connect(bind.store)
    owners = [int(v) for (v,) in con.execute(
        "SELECT value FROM metrics WHERE run_id = $r AND name = $n AND step = $s "
        "ORDER BY created_at", {"r": bind.run_id, "n": RUN_TOKEN_METRIC,
                                "s": RUN_TOKEN_STEP}).fetchall()]
    if not owners or owners[0] != token:
        raise bad(f"run token {token!r} does not match the store's run_token row of run "
                  f"{bind.run_id!r} ({owners[0] if owners else 'none'})")
    _check_store_version(state.get("store_version"), bind, bad)
    _check_record(con, doc, tensors, bind, bad)


def _check_store_version(version: Any, bind: StateBinding, bad: Callable[[str], CheckpointError]
                         ) -> None:
    """``store_version``: a table -> version map of the store's tables, no newer than the
    store, no older than the commits of the iteration before the checkpoint."""
    assert bind.store is not None
    current = dict(bind.store.version())
    if not isinstance(version, dict) or not version or not all(
            k in current and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in version.items()):
        raise bad(f"store_version {version!r} is not a version of the store's tables "
                  f"({', '.join(sorted(current))})")
    for table, v in sorted(version.items()):
        if v > current[table]:
            raise bad(f"store_version {table}={v} is newer than the store ({table} is at "
                      f"version {current[table]})")
    if bind.step == 0:
        return
    tables: tuple[Literal["trees"], Literal["metrics"]] = ("trees", "metrics")
    for table in tables:
        if table not in version:
            continue
        key = f"{bind.run_id}:{table}:{bind.step - 1}"  # the trainer's commit keys
        if bind.store.delta_table(table).transaction_version(key) is None:
            continue  # committed under a retry key (another attempt), or never
        if bind.store.delta_table(table, version[table]).transaction_version(key) is None:
            raise bad(f"store_version {table}={version[table]} predates the commit of "
                      f"iteration {bind.step - 1}'s {table}, which the checkpoint comes after")


def _check_record(con: Any, doc: Mapping[str, Any], tensors: Mapping[str, Any],
                  bind: StateBinding, bad: Callable[[str], CheckpointError]) -> None:
    """Each field's digest must be the store's record of this step's state (one of them:
    a rerun iteration records its rewrite too)."""
    prefix = _record_name(bind.step, "")
    rows = con.execute(
        "SELECT created_at, name, value FROM metrics WHERE run_id = $r AND step = $s AND "
        "starts_with(name, $p) ORDER BY created_at",
        {"r": bind.run_id, "s": STATE_RECORD_STEP, "p": prefix}).fetchall()
    records: dict[Any, dict[str, float]] = {}
    for created, name, value in rows:
        records.setdefault(created, {})[str(name)[len(prefix):]] = float(value)
    if not records:
        raise bad(f"the store records no trainer state for step {bind.step} of run "
                  f"{bind.run_id!r} (written before trainer states were bound, or not "
                  "this store's run)")
    mine = {k: _record_value(v) for k, v in state_digests(doc, tensors).items()}
    best: list[str] | None = None
    for record in records.values():
        differ = sorted(k for k in set(record) | set(mine) if record.get(k) != mine.get(k))
        if not differ:
            return
        if best is None or len(differ) < len(best):
            best = differ
    raise bad(f"{', '.join(best or [])} differ{'s' if len(best or []) == 1 else ''} from "
              f"the trainer state the store recorded for step {bind.step} (edited since it "
              "was written)")


__all__ = ["BINDING_KEY", "DIGESTS_KEY", "META_FILE", "STATE_FORMAT", "STATE_RECORD_METRIC",
           "STATE_RECORD_STEP", "CheckpointError", "StateBinding", "begin_checkpoint",
           "check_binding", "file_digests", "load_state", "publish_checkpoint", "read_meta",
           "record_state", "save_state", "sha256_file", "staging_dir", "state_digests",
           "verify_checkpoint", "weight_digests", "write_checkpoint"]
