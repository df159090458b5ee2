"""docs/guides/log-from-your-trainer.md says what it runs: its blocks are the kinds it
claims, and ``check_the_log_guide_ran`` checks what the page made after
tests/test_docs_guides.py ran it in document order in a temporary directory outside the
repository (the ``python trl`` and ``bash trl`` blocks, a two-step TRL run, only where the
``trl`` extra is installed; the page is then slow-marked).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "log-from-your-trainer.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks(info: str) -> list[str]:
    """Bodies of the fenced blocks whose info string is exactly ``info``, in order."""
    return [body for tag, body in FENCE.findall(GUIDE.read_text()) if tag.strip() == info]


def test_the_guide_has_its_blocks() -> None:
    assert len(blocks("python")) >= 2 and len(blocks("bash")) >= 1
    assert len(blocks("python trl")) == 1 and len(blocks("bash trl")) == 1
    tags = {tag.strip() for tag, _ in FENCE.findall(GUIDE.read_text())}
    assert tags <= {"python", "bash", "python trl", "bash trl"}, tags  # nothing unrun


def check_the_log_guide_ran(tmp_path: Path, stdout: str) -> None:
    """What the page's run made (tests/test_docs_guides.py runs it, the ``trl`` blocks only
    where TRL is installed): the GRPO audit's accuracy, its report and the exported page."""
    assert "'grpo': 1.0" in stdout
    assert (tmp_path / "audit" / "report.md").is_file()
    assert (tmp_path / "page" / "index.html").is_file()
    if importlib.util.find_spec("trl") is not None:
        assert (tmp_path / "trl-audit" / "report.md").is_file()
        assert (tmp_path / "trl-page" / "index.html").is_file()
