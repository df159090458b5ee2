"""Every equation tag the code cites is defined in docs/METHODS.md (issue 9).

Tags are a letter of E, C, S, D, T, G, F, Q, V and a number (``E7``, ``D10``), read from the
comments and string literals (docstrings, messages) of every module under
``rollout_store/``, ``analysis/``, ``train/``, ``cli/`` and ``benchmarks/``. METHODS.md
defines a tag as ``**(X1)**``. Not tags: a linter code after ``noqa:``, a quoted name
(``"F3"``, a CALIPER bucket) and the F1 score.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout_store", "analysis", "train", "cli", "benchmarks")
METHODS = ROOT / "docs" / "METHODS.md"

TAG = re.compile(r"(?<![\w\"'`])([ECSDTGFQV]\d+)\b(?![\"'`])")
DEFINED = re.compile(r"\*\*\(([ECSDTGFQV]\d+)\)\*\*")
NOT_TAGS = (re.compile(r"noqa:[\w ,-]*"), re.compile(r"\bF1[ -]score\b|\bmultiset F1\b"))


def cited_tags(source: str) -> set[str]:
    """Tags cited in the comments and string literals of one module's source."""
    found: set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        text = tok.string
        for pattern in NOT_TAGS:
            text = pattern.sub(" ", text)
        found.update(TAG.findall(text))
    return found


def defined_tags() -> set[str]:
    return set(DEFINED.findall(METHODS.read_text()))


def test_scanner_finds_tags_and_skips_non_tags() -> None:
    src = ('"""Credit (METHODS G1, E5-E7; D10)."""\n'
           'x = 1  # noqa: E501 - long\n'
           'y = "multiset F1 of names"  # the "F3" bucket, T2\n')
    assert cited_tags(src) == {"G1", "E5", "E7", "D10", "T2"}


def test_every_cited_tag_is_defined() -> None:
    defined = defined_tags()
    assert {"G1", "G4", "G8", "E7", "C9", "S1", "D3", "T2", "F2", "F5", "Q4"} <= defined
    missing: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for tag in cited_tags(path.read_text()) - defined:
                missing.setdefault(tag, []).append(str(path.relative_to(ROOT)))
    assert not missing, ("tags cited in code but not defined in docs/METHODS.md: "
                         + "; ".join(f"{t} ({', '.join(sorted(set(p)))})"
                                     for t, p in sorted(missing.items())))
