"""Shared fixtures: a fresh store per test, in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_store import Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", create=True)
