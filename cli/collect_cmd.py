"""``rtrees collect``: sample rollout trees into a store (issue 6)."""

from __future__ import annotations


def register(app: object) -> None:
    """Add the ``collect`` command to the ``rtrees`` app (filled in by the samplers work)."""
