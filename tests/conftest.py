"""Shared fixtures: a fresh store per test, in tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from rollout_store import Store

# Generation-speed health checks are noise on a shared 2-core machine,
# not failures of the code under test; deadlines likewise. Tests that set their
# own suppress list must include these (see GENERATION_CHECKS).
GENERATION_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("rollout-trees", deadline=None,
                          suppress_health_check=GENERATION_CHECKS)
settings.load_profile("rollout-trees")


def pytest_report_header() -> str:
    """Which CPU kernels ran: goldens must hold under any (``make test-kernels``)."""
    import os

    import torch

    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "best")
    return (f"torch cpu capability: {torch.backends.cpu.get_cpu_capability()} "
            f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', 'unset')}, "
            f"MKL_ENABLE_INSTRUCTIONS={mkl})")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", create=True)


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    """A headless Chromium (``tests/test_viewer_browser.py``'s), one per test module; the
    test skips, saying why, where none is installed."""
    from test_viewer_browser import browser, make_driver

    found = browser()
    if isinstance(found, str):
        pytest.skip(found)
    d = make_driver(found)
    try:
        yield d
    finally:
        d.quit()
