"""Stored text made safe to print on a terminal (issue 50, item 6).

Text in a store (label keys and values, task ids, actions, observations, ``meta``) comes
from users, environments and models. Printed raw, a newline forges an extra output row, a
NUL or a carriage return hides what precedes it, and a terminal escape (``ESC [ 2 J``,
``ESC ] 0 ; title BEL``) clears or retitles the terminal. ``printable(text)`` shows every
such character the way Python's ``repr`` does (``\\n``, ``\\t``, ``\\x1b``, ``\\x00``,
``\\u202e``) and leaves all other text alone (accents, CJK, emoji, spaces);
``printable_table(data)`` does the same to every text value and column name of an Arrow
table. ``rtrees sql`` prints through them; any command that prints stored text can import
them from here.

What is escaped (``UNSAFE``): the ASCII control characters and DEL (``\\x00``-``\\x1f``, ``\\x7f``:
newline, tab, ESC, BEL, backspace), the C1 controls (``\\x80``-``\\x9f``: ``\\x9b`` is a
one-byte CSI on some terminals, ``\\x85`` a line break), the Unicode line and paragraph
separators (U+2028, U+2029), the bidirectional controls that reorder what is shown
(U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069: "Trojan Source", CVE-2021-42574),
and lone surrogates (text decoded with ``surrogateescape``: printing them raises
``UnicodeEncodeError``). A backslash is left as is: the output is for eyes, not a format
to parse back (use ``rtrees sql --format json`` for exact values).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow as pa

UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e"
                    "\u2066-\u2069\ud800-\udfff]")
"""The characters ``printable`` escapes (module docstring)."""


def _escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]  # '\n', '\x1b', '\u202e', '\udcff'


def printable(text: str, *, newlines: bool = False) -> str:
    """``text`` with every ``UNSAFE`` character shown as Python's ``repr`` shows it
    (``"a\\x1b[2Jb\\n"`` -> ``a\\x1b[2Jb\\n`` as plain characters); other text unchanged.
    ``newlines``: keep ``\\n`` as a line break (for a message that is then joined into one
    line, ``cli._common.one_line``)."""
    text = str(text)
    if newlines:
        return "\n".join(UNSAFE.sub(_escape, line) for line in text.split("\n"))
    return UNSAFE.sub(_escape, text)


def printable_value(value: Any) -> str | None:
    """One value as printable text: None stays None, a string goes through ``printable``,
    bytes as their ``repr`` (``b'\\x1b...'``), a list, dict or struct as JSON, anything
    else (numbers, dates) as ``str``."""
    if value is None:
        return None
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return repr(bytes(value))
    if isinstance(value, list | tuple | dict):
        return printable_json(value)
    return printable(str(value))


def printable_table(data: pa.Table) -> pa.Table:
    """``data`` with its column names through ``printable``, and every text, binary or
    nested column as a text column of ``printable_value``; number, boolean and date
    columns are kept (they print no control character)."""
    columns = []
    for field, column in zip(data.schema, data.columns, strict=True):
        kind = field.type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                or pa.types.is_fixed_size_binary(kind) or pa.types.is_nested(kind)
                or pa.types.is_string_view(kind) or pa.types.is_binary_view(kind)):
            column = pa.array([printable_value(v) for v in column.to_pylist()], pa.string())
        columns.append(column)
    return pa.table(columns, names=[printable(n) for n in data.column_names])


def printable_json(value: Any) -> str:
    """``json.dumps(value, default=str)`` with no raw control character: JSON escapes
    control characters in strings itself (``\\u001b``) and, with ``ensure_ascii``, every
    non-ASCII one; DEL (``\\x7f``) is the one it leaves raw."""
    return json.dumps(value, default=str).replace("\x7f", "\\u007f")


__all__ = ["UNSAFE", "printable", "printable_json", "printable_table", "printable_value"]
