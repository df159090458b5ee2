"""Reading a table's Delta log defensively, and making our commits durable.

delta-rs reports a damaged log (a garbled or truncated commit, a gap in the versions, a
``_last_checkpoint`` pointing nowhere) as a bare ``DeltaError`` with a Rust backtrace.
``log_problems`` scans a table's ``_delta_log`` itself and names the file and what is
wrong with it, so that every command can say which table and which log file is damaged
(``store.open_delta``) and ``store validate`` can list every such problem.

``checkpoint_if_due`` writes a Delta checkpoint every ``store.CHECKPOINT_EVERY`` commits,
so that opening a table replays a bounded log (memory and time per open stay flat).

``fsync_commit`` makes a commit durable: delta-rs writes the commit file but never
fsyncs it or its directory, so after a power cut a later table's commit could survive
while an earlier one's is lost. Appends call it after each table's commit, before the
next table's.

A store on object storage passes its ``pyarrow.fs`` filesystem (``fs``) and its table URI
(``s3://bucket/prefix/table``): the same checks run over listed and fetched objects.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

_COMMIT = re.compile(r"^(\d{20})\.json$")
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(\.\d+\.\d+)?\.parquet$")


def log_problems(table_dir: str | os.PathLike[str],
                 fs: pafs.FileSystem | None = None) -> list[str]:
    """What is wrong with the ``_delta_log`` of ``table_dir`` (empty when it reads cleanly).

    Checks: the commit versions are contiguous from 0 (or from the last checkpoint),
    every commit file is non-empty and each of its lines is one JSON object, and
    ``_last_checkpoint`` (when present) is JSON naming a checkpoint file that exists.
    """
    if fs is not None:
        return _remote_log_problems(str(table_dir).rstrip("/") + "/_delta_log", fs)
    log = Path(table_dir) / "_delta_log"
    if not log.is_dir():
        return [f"{log}: missing"]
    problems: list[str] = []
    names = sorted(os.listdir(log))
    versions = sorted(int(m.group(1)) for n in names if (m := _COMMIT.match(n)))
    checkpoints = sorted({int(m.group(1)) for n in names if (m := _CHECKPOINT.match(n))})
    hint = log / "_last_checkpoint"
    if hint.exists():
        problems += _hint_problems(str(hint), hint.read_bytes(), checkpoints)
    problems += _version_problems(str(log), versions, checkpoints, _local_read)
    return problems


def _hint_problems(hint: str, raw: bytes, checkpoints: list[int]) -> list[str]:
    try:
        data = json.loads(raw.decode())
        cp = int(data["version"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return [f"{hint}: not a valid checkpoint hint ({type(exc).__name__})"]
    if cp not in checkpoints:
        return [f"{hint}: names checkpoint version {cp}, but no checkpoint file of that "
                "version exists"]
    return []


def _local_read(path: str) -> bytes:
    return Path(path).read_bytes()


def _version_problems(log: str, versions: list[int], checkpoints: list[int],
                      read: Callable[[str], bytes]) -> list[str]:
    problems: list[str] = []
    if not versions:
        problems.append(f"{log}: no commit files")
        return problems
    start = max([c for c in checkpoints if c <= versions[-1]], default=0)
    wanted = [v for v in versions if v >= start]
    if not checkpoints and versions[0] != 0:
        problems.append(f"{log}/{_name(0)}: missing (the log starts at version {versions[0]})")
    for a, b in itertools.pairwise(wanted):
        if b != a + 1:
            problems.append(f"{log}/{_name(a + 1)}: missing (gap between versions {a} and {b})")
    for v in wanted:
        path = f"{log}/{_name(v)}"
        problem = _commit_problem(path, read)
        if problem:
            problems.append(f"{path}: {problem}")
    return problems


def _remote_log_problems(log: str, fs: pafs.FileSystem) -> list[str]:
    """``log_problems`` for a ``_delta_log`` on object storage (``log`` is its URI)."""
    import pyarrow.fs as pafs

    def fs_path(uri: str) -> str:
        return uri.split("://", 1)[1] if "://" in uri else uri

    def read(uri: str) -> bytes:
        with fs.open_input_stream(fs_path(uri)) as fh:
            return bytes(fh.read())

    listed = fs.get_file_info(pafs.FileSelector(fs_path(log), allow_not_found=True))
    names = sorted(i.base_name for i in listed if i.type == pafs.FileType.File)
    if not names:
        return [f"{log}: missing"]
    versions = sorted(int(m.group(1)) for n in names if (m := _COMMIT.match(n)))
    checkpoints = sorted({int(m.group(1)) for n in names if (m := _CHECKPOINT.match(n))})
    problems: list[str] = []
    if "_last_checkpoint" in names:
        hint = f"{log}/_last_checkpoint"
        problems += _hint_problems(hint, read(hint), checkpoints)
    problems += _version_problems(log, versions, checkpoints, read)
    return problems


def _name(version: int) -> str:
    return f"{version:020d}.json"


def _commit_problem(path: str, read: Callable[[str], bytes]) -> str | None:
    try:
        data = read(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not data.strip():
        return "empty commit file"
    for i, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return f"line {i} is not valid JSON (garbled or truncated commit)"
        if not isinstance(obj, dict) or len(obj) != 1:
            return f"line {i} is not a Delta action"
    return None


def describe_failure(uri: str, exc: BaseException, what: str = "",
                     fs: pafs.FileSystem | None = None) -> str:
    """One line: which table's log failed to load, which file, and why."""
    label = what or uri
    try:
        problems = log_problems(uri, fs)
    except OSError:  # the store itself cannot be reached: say so below
        problems = []
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        return f"{label}: damaged Delta log: {problems[0]}{more}"
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    return f"{label}: cannot read its Delta log at {uri}/_delta_log: {first}"


def fsync_commit(table_dir: str | os.PathLike[str], after: int, upto: int) -> None:
    """fsync the table's commit files of versions ``after + 1 .. upto`` (ours is among
    them: another writer may have committed in between) and the ``_delta_log`` directory."""
    log = Path(table_dir) / "_delta_log"
    for version in range(after + 1, upto + 1):
        fsync_file(log / _name(version))
    fsync_dir(log)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync one file's contents; a file that does not exist is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory, so that the names of the files just created in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_if_due(dt: DeltaTable, before: int, every: int,
                      table_dir: str | os.PathLike[str] | None = None) -> int | None:
    """Write a Delta checkpoint of ``dt`` (just committed, loaded at its latest version)
    when its commits since ``before`` crossed a multiple of ``every``; returns its version.

    A checkpoint is one Parquet file holding the table's whole state at a version; opening
    the table then replays only the commits after it, so memory and time per open stay
    bounded by ``every`` commits instead of growing with the log (delta-rs checkpoints
    every 100 commits by default). The log stays complete (time travel and ``history``
    still read every commit). ``table_dir`` (a local table) gets the checkpoint and the
    ``_last_checkpoint`` hint fsync'd, so a power cut cannot leave a hint naming a lost
    file. A checkpoint that cannot be written is skipped: the commit has landed, and the
    table reads the same from its log (the next due checkpoint tries again)."""
    version = dt.version()
    if every <= 0 or version // every <= before // every:
        return None
    try:
        dt.create_checkpoint()
    except (DeltaError, OSError):
        return None
    if table_dir is not None:
        log = Path(table_dir) / "_delta_log"
        for name in (f"{version:020d}.checkpoint.parquet", "_last_checkpoint"):
            fsync_file(log / name)
        fsync_dir(log)
    return version
