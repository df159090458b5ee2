"""The store's base error, shared by ``store.py`` and ``objectstore.py`` (no import cycle)."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The store cannot be opened or read as asked (missing, corrupt, not a store)."""
