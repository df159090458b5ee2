"""Every document the project cites is in the repository.

Docstrings, comments and docs cite documents by name (``docs/METHODS.md``, ``README.md``);
a reader of the project must be able to open each one. Cited names are the upper-case
``NAME.md`` tokens (lower-case ``*.md`` names in the code are files the code writes, such as
a report's ``report.md``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[A-Z][A-Z0-9_]*\.md)\b")
SCANNED = (".py", ".md", ".toml", ".cfg", ".txt", ".jinja")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    this = Path(__file__).resolve()
    return [ROOT / f for f in out
            if f.endswith(SCANNED) and (ROOT / f).is_file() and (ROOT / f) != this]


def test_cited_documents_exist_in_the_repository() -> None:
    files = _tracked()
    assert len(files) > 100, "git ls-files found too few files to check"
    docs = {p.relative_to(ROOT).as_posix() for p in files if p.suffix == ".md"}
    names = {d.rsplit("/", 1)[-1] for d in docs}
    missing: list[str] = []
    for path in files:
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for cited in CITED.findall(line):
                ok = cited in docs if "/" in cited else cited in names
                if not ok:
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: {cited}")
    assert not missing, "cited documents not in the repository:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_document() -> None:
    assert CITED.findall("see DESIGN.md section 3 and docs/METHODS.md") == [
        "DESIGN.md", "docs/METHODS.md"]
    assert CITED.findall("writes report.md") == []
