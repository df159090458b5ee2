"""The checks every dump import makes before it trusts a byte (``rollout_store.importers``
for verl and TRL dumps, ``rollout_store.import_atif`` for ATIF), and the one error they
raise.

Hostile input (issue 50 item 5) is refused in one line naming the file and the field,
never coerced:

* only regular files are read (a symlink is judged by its target): a FIFO, a device
  (``/dev/zero``), a socket or a directory is refused before a byte is read, and the
  file is opened non-blocking and checked again after the open;
* a file holds at most ``MAX_IMPORT_BYTES`` (256 MiB; ``max_bytes`` to change it) and is
  read with a bounded read;
* JSON nests at most ``MAX_NESTING`` (64) levels (deeper input, which Python's parser
  meets with a ``RecursionError``, is one line);
* typed fields: a number is never a boolean (``true`` is not a reward of 1.0); a token
  id is an integer in ``[0, MAX_TOKEN_ID]`` (not ``1.9``, ``null``, ``1e400`` or a
  string); logprobs are finite numbers ``<= 0``; rewards finite numbers; ATIF
  ``metrics``, ``observation`` and ``extra`` are objects as the ATIF schema
  (``rollout_store.exporters.ATIF_SCHEMA``) says, messages strings; a step is an
  integer (a JSON string ``"3"`` is refused). The message says where, e.g.
  ``steps[3].metrics.completion_token_ids[0]: expected an integer token id, got 1.9``.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

_HASH_CHUNK: Final[int] = 1 << 20
# Deepest nesting of lists and objects accepted in one dump row (issue 21: a deeply nested
# field raised a raw RecursionError). Chat messages need 3 or 4 levels.
MAX_NESTING: Final[int] = 64

# Largest dump file read (bytes; ``max_bytes`` overrides it): far above one training
# step's rollouts, low enough that a wrong path (a disk image, /dev/zero behind a link)
# is refused instead of exhausting memory (issue 50 item 5).
MAX_IMPORT_BYTES: Final[int] = 256 * 1024 * 1024
# Token ids are int32 in the store (schema.NODES): a vocabulary index in [0, 2**31).
MAX_TOKEN_ID: Final[int] = 2**31 - 1

# Builds the error for the line or row being read, given the detail.
Fail = Callable[[str], "DumpImportError"]


class DumpImportError(ValueError):
    """A dump cannot be imported; the message names the file and the line or row.

    ``path`` is the file (None for an error about the arguments), ``line`` the
    1-based JSONL line, ``row`` the 0-based Parquet row, ``detail`` the reason.
    """

    def __init__(self, path: str | None, detail: str, *, line: int | None = None,
                 row: int | None = None) -> None:
        self.path = path
        self.line = line
        self.row = row
        self.detail = detail
        where = [] if path is None else [path]
        if line is not None:
            where.append(f"line {line}")
        if row is not None:
            where.append(f"row {row}")
        super().__init__(": ".join([*where, detail]))


def read_regular_file(path: str | Path, max_bytes: int = MAX_IMPORT_BYTES) -> bytes:
    """The bytes of ``path``, a regular file (a symlink is judged by its target) of at
    most ``max_bytes`` bytes; ``DumpImportError`` naming the file otherwise.

    A FIFO, device, socket or directory is refused by ``os.stat`` before it is opened;
    the open is non-blocking (a FIFO swapped in meanwhile cannot hang it) and the opened
    file is checked again (``fstat``: still a regular file, the same inode). The read
    stops after ``max_bytes + 1`` bytes, so a file that grows meanwhile is refused too."""
    shown = str(path)
    if max_bytes < 0:
        raise DumpImportError(None, f"max_bytes must be >= 0, got {max_bytes}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DumpImportError(shown, "no such file") from None
    except OSError as exc:
        raise DumpImportError(shown, f"cannot read it ({exc.strerror or exc})") from None
    _require_regular(shown, path, st.st_mode)
    limit = (f"over the import limit of {max_bytes} bytes ({max_bytes / 2**20:g} MiB; "
             "raise max_bytes to import it)")
    if st.st_size > max_bytes:
        raise DumpImportError(shown, f"{st.st_size} bytes, {limit}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise DumpImportError(shown, f"cannot read it ({exc.strerror or exc})") from None
    try:
        opened = os.fstat(fd)
        _require_regular(shown, path, opened.st_mode)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise DumpImportError(shown, "replaced while it was opened")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(_HASH_CHUNK, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise DumpImportError(shown, f"grew past {max_bytes} bytes while read, {limit}")
        return b"".join(chunks)
    except OSError as exc:
        raise DumpImportError(shown, f"cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def _require_regular(shown: str, path: str | Path, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)"
            if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "not a regular file")
    link = " (a symlink to it)" if os.path.islink(path) else ""
    raise DumpImportError(shown, f"not a regular file: {kind}{link}")


def parse_json_document(raw: bytes, shown: str) -> Any:
    """``raw`` parsed as one JSON document; ``DumpImportError`` naming ``shown`` for bytes
    that are not UTF-8 JSON, or that nest more than ``MAX_NESTING`` levels (or hold a lone
    surrogate: ``check_value``)."""
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DumpImportError(shown, f"not valid JSON ({exc.msg} at line {exc.lineno} "
                              f"column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise DumpImportError(shown, f"not UTF-8 text ({exc.reason})") from None
    except RecursionError:  # Python's parser recurses per level: ~1000 levels
        raise DumpImportError(shown, f"JSON nested too deeply to read (at most "
                              f"{MAX_NESTING} levels)") from None

    def fail(detail: str) -> DumpImportError:
        return DumpImportError(shown, detail)

    check_value(doc, "the document", fail)
    return doc


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_value(value: Any, name: str, fail: Fail) -> None:
    """Refuse ``value`` (a JSON or Arrow value of field ``name``) if it nests deeper than
    ``MAX_NESTING`` or holds a string with a lone UTF-16 surrogate (valid JSON, ``"\\ud800"``,
    but not Unicode text: it could not be stored). Iterative, so any depth is safe."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = item[exc.start]
                raise fail(f"{name} holds a lone surrogate U+{ord(bad):04X} (not valid "
                           "Unicode text)") from None
        elif isinstance(item, dict | list | tuple):
            if depth >= MAX_NESTING:
                raise fail(f"{name} is nested more than {MAX_NESTING} levels deep")
            children = ([*item.keys(), *item.values()] if isinstance(item, dict)
                        else list(item))
            stack.extend((child, depth + 1) for child in children)


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON data: non-finite floats become null, unknown types text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def type_of(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def shown_json(value: Any) -> str:
    """``value`` as its JSON text (strings quoted, floats as written), at most 60
    characters."""
    try:
        text = json.dumps(jsonable(value) if not isinstance(value, float) else value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def finite(value: Any, where: str, fail: Fail) -> float:
    """A finite number (``true`` is not 1.0)."""
    if not is_number(value):
        raise fail(f"{where}: expected a number, got {shown_json(value)}")
    if not math.isfinite(value):
        raise fail(f"{where}: expected a finite number, got {shown_json(value)}")
    return float(value)


__all__ = ["MAX_IMPORT_BYTES", "MAX_NESTING", "MAX_TOKEN_ID", "DumpImportError", "Fail",
           "check_value", "finite", "is_number", "jsonable", "parse_json_document",
           "read_regular_file", "shown_json", "type_of"]
