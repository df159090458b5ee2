"""The documentation site builds with warnings as errors (``mkdocs build --strict``, what
``make docs`` runs), into a temporary directory: every page in the nav and in ``docs/``,
every internal link and anchor, the API reference from the docstrings (mkdocstrings).

Needs the ``docs`` extra (``make setup`` installs it); without it the test skips, naming it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from docs_hooks import strip_markers  # noqa: E402


def _nav_pages(text: str) -> list[str]:
    """The ``*.md`` pages named in mkdocs.yml's nav."""
    nav = text[text.index("\nnav:"):]
    return re.findall(r":\s*(\S+\.md)\s*$", nav, re.M)


def test_the_site_builds_strict(tmp_path: Path) -> None:
    for name in ("mkdocs", "material", "mkdocstrings"):
        pytest.importorskip(name, reason="the docs extra is not installed: pip install -e "
                                         "'.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                          str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "WARNING" not in run.stderr, run.stderr[-5000:]
    pages = _nav_pages((ROOT / "mkdocs.yml").read_text())
    assert "index.md" in pages and "reference/api.md" in pages
    for page in pages:
        built = tmp_path / "site" / ("index.html" if page == "index.md"
                                     else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), f"{page} was not built"
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("rollout_store.Store", "rollout_store.connect", "train.credit.register",
                 "analysis.ranking.ranking_audit"):
        assert f'id="{name}"' in api, f"the API reference lacks {name}"


def test_the_test_markers_leave_the_rendered_fences() -> None:
    text = "a\n```bash runnable\nrtrees x\n```\n  ```bash checked\ny\n```\n```python\nz\n```\n"
    assert strip_markers(text) == \
        "a\n```bash\nrtrees x\n```\n  ```bash\ny\n```\n```python\nz\n```\n"
