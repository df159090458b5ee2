"""MkDocs hooks for the documentation site (``mkdocs.yml``: ``hooks``).

The docs mark what the tests do with a fenced block in its info string: ``bash runnable``
(run), ``bash checked`` (parsed against the app, never run), plain ``bash`` and ``python``
(run; ``docs/writing-docs.md``). Markdown's fence parsers take only a language (and
``key="value"`` options), so the marker is dropped before the page is rendered and the
block shows as plain ``bash``.
"""

from __future__ import annotations

import re
from typing import Any

MARKER = re.compile(r"^(\s*```+\s*\w+)[ \t]+(?:runnable|checked)\b[^\n]*$", re.M)


def strip_markers(markdown: str) -> str:
    """``markdown`` with the test markers removed from fence info strings."""
    return MARKER.sub(r"\1", markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """MkDocs event: a page's markdown before it is rendered."""
    return strip_markers(markdown)
