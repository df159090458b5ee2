"""Labels on trees and nodes (issue 26): ``rtrees label``, the viewer, ``labels_latest``.

A label is ``(tree_id, node_id or None for the whole tree, key, value, author,
created_at)``. Writes only append (``schema.LABELS``): the history stays, and the current
value of a key is the latest row (the reader's ``labels_latest`` view: last write wins).
Clearing a key appends a row with a null value.

What a label may hold (issue 50; ``label_rows`` checks it before anything is written,
``ValueError`` naming the field): a key of 1 to ``MAX_KEY`` (100) characters, a value of
at most ``MAX_VALUE`` (10,000) and an author of 1 to ``MAX_AUTHOR`` (100), none holding
a control character (Unicode category Cc: newline, tab, NUL, ESC, DEL, C1 controls), a
line or paragraph separator (U+2028, U+2029) or a bidirectional-text control (U+061C,
U+200E, U+200F, U+202A to U+202E, U+2066 to U+2069); a key or an author also no other
format character (category Cf: zero-width and invisible characters), which a value may
hold (a zero-width joiner inside an emoji). Labels are printed in terminals, where such
characters rewrite or reorder what is shown (a lone surrogate, category Cs, is refused
too: it cannot be stored as UTF-8). Commands print stored labels through
``rollout_store.textsafe.printable`` anyway (labels written before these checks, or by
another tool).
"""

from __future__ import annotations

import getpass
import os
import unicodedata
from collections.abc import Mapping
from datetime import UTC, datetime

import pyarrow as pa

from rollout_store.schema import LABELS, MAX_NODE_ID
from rollout_store.store import CommitReport, Store

MAX_KEY = 100  # characters
MAX_VALUE = 10_000
MAX_AUTHOR = 100
# Bidirectional-text controls (Unicode category Cf): they reorder what a terminal shows
# (CVE-2021-42574, "Trojan Source").
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                          "\u2066\u2067\u2068\u2069")
_SEPARATORS = frozenset("\u2028\u2029")  # categories Zl, Zp: line breaks to some programs


def _unsafe(ch: str, strict: bool) -> bool:
    """Whether ``ch`` may not appear in a label field (module docstring); ``strict``:
    a key or an author, where every format character (Cf) is refused too."""
    cat = unicodedata.category(ch)
    return (cat in ("Cc", "Cs") or ch in _SEPARATORS or ch in BIDI_CONTROLS
            or (strict and cat == "Cf"))


def check_text(text: str, field: str, strict: bool = True) -> None:
    """``ValueError`` naming ``field`` and the character when ``text`` holds one that a
    label may not hold (module docstring)."""
    for i, ch in enumerate(text):
        if _unsafe(ch, strict):
            raise ValueError(f"{field} {text[:40]!r}: holds the control "
                             f"character U+{ord(ch):04X} at position {i} (labels may hold "
                             "no control, line-separator or bidi characters)")


def default_author() -> str:
    """``$RTREES_AUTHOR``, else the login name."""
    try:
        return os.environ.get("RTREES_AUTHOR") or getpass.getuser()
    except (KeyError, OSError):  # no login name (a container without passwd entry)
        return "unknown"


def label_rows(tree_id: str, node_id: int | None, values: Mapping[str, str | None],
               author: str | None = None, now: datetime | None = None) -> pa.Table:
    """``labels`` rows setting (or, with a None value, clearing) each key of ``values``;
    ``ValueError`` naming the field for an empty or over-long key (1 to ``MAX_KEY``
    characters), value (at most ``MAX_VALUE``) or author (1 to ``MAX_AUTHOR``), one holding
    a control character (module docstring), or a node id outside 0..``MAX_NODE_ID``."""
    if not values:
        raise ValueError("give at least one label (KEY=VALUE)")
    for key, value in values.items():
        if not key.strip() or len(key) > MAX_KEY:
            raise ValueError(f"label key {key[:MAX_KEY]!r}: 1 to {MAX_KEY} "
                             f"characters, got {len(key):,}")
        check_text(key, "label key")
        if value is not None and len(value) > MAX_VALUE:
            raise ValueError(f"label {key!r}: value longer than {MAX_VALUE:,} characters")
        if value is not None:
            check_text(value, f"label {key!r}: value", strict=False)
    if node_id is not None and (isinstance(node_id, bool | float)
                                or not isinstance(node_id, int)):
        raise ValueError(f"node id must be an integer, got {node_id!r}")
    if node_id is not None and not 0 <= node_id <= MAX_NODE_ID:
        raise ValueError(f"node id {node_id}: not in 0..{MAX_NODE_ID}")
    stamp = now or datetime.now(UTC)
    who = author or default_author()
    if len(who) > MAX_AUTHOR:
        raise ValueError(f"label author {who[:40]!r}...: 1 to {MAX_AUTHOR} "
                         f"characters, got {len(who):,}")
    check_text(who, "label author")
    return pa.Table.from_pylist([
        {"tree_id": tree_id, "node_id": node_id, "key": key.strip(), "value": value,
         "author": who, "created_at": stamp} for key, value in values.items()],
        schema=LABELS)


def write_labels(store: Store, tree_id: str, node_id: int | None,
                 values: Mapping[str, str | None], author: str | None = None,
                 key: str | None = None) -> CommitReport:
    """Append labels of one tree (or one of its nodes); ``TreeValidationError`` when the
    tree or node is not stored, ``ValueError`` for a bad key, value, author or node id
    (``label_rows``), raised before anything is written."""
    return store.append_labels(label_rows(tree_id, node_id, values, author), key=key)


__all__ = ["BIDI_CONTROLS", "MAX_AUTHOR", "MAX_KEY", "MAX_VALUE", "check_text",
           "default_author", "label_rows", "write_labels"]
