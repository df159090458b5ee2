"""docs/guides/log-from-your-trainer.md runs as written.

Its ```` ```python ```` blocks run in document order as one script in one temporary
directory outside the repository, then its ```` ```bash ```` blocks there (``rtrees`` is
this checkout's CLI), and the files they make are checked. The ```` ```python trl ```` and
```` ```bash trl ```` blocks (a two-step TRL run) follow them in a slow test that is
skipped when the ``trl`` extra is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "log-from-your-trainer.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks(info: str) -> list[str]:
    """Bodies of the fenced blocks whose info string is exactly ``info``, in order."""
    return [body for tag, body in FENCE.findall(GUIDE.read_text()) if tag.strip() == info]


def _run(tmp: Path, python: list[str], bash: list[str]) -> subprocess.CompletedProcess[str]:
    """The python blocks as one script, then the bash blocks, in ``tmp``."""
    (tmp / "guide.py").write_text("\n\n".join(python))
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    rtrees = bin_dir / "rtrees"
    rtrees.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cli.main "$@"\n')
    rtrees.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    script = f'set -euo pipefail\n"{sys.executable}" guide.py\n' + "\n".join(bash)
    return subprocess.run(["bash", "-c", script], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_guide_has_its_blocks() -> None:
    assert len(blocks("python")) >= 2 and len(blocks("bash")) >= 1
    assert len(blocks("python trl")) == 1 and len(blocks("bash trl")) == 1
    tags = {tag.strip() for tag, _ in FENCE.findall(GUIDE.read_text())}
    assert tags <= {"python", "bash", "python trl", "bash trl"}, tags  # nothing unrun


def test_the_guides_code_runs(tmp_path: Path) -> None:
    out = _run(tmp_path, blocks("python"), blocks("bash"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "'grpo': 1.0" in out.stdout
    assert (tmp_path / "audit" / "report.md").is_file()
    assert (tmp_path / "page" / "index.html").is_file()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="TRL is not installed (the optional extra `trl`)")
def test_the_guides_trl_example_runs(tmp_path: Path) -> None:
    out = _run(tmp_path, blocks("python") + blocks("python trl"),
               blocks("bash") + blocks("bash trl"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "trl-audit" / "report.md").is_file()
    assert (tmp_path / "trl-page" / "index.html").is_file()
