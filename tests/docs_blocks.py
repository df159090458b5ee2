"""The fenced code blocks of a documentation page, and how the tests run them.

The convention (``docs/writing-docs.md``), by the fence's info string:

* ``bash`` and ``bash runnable``: shell, run;
* ``python`` (optionally ``python title="NAME.py"``): written to a file (its title, else
  ``block_N.py``) and run with the virtual environment's ``python``;
* ``bash checked``: shown, never run; its ``rtrees`` command lines are parsed against the
  app (for commands that need a GPU, a Ray cluster, S3, or hours);
* ``text``: output, not run; ``toml`` and ``json``: parsed (``tomllib``, ``json``);
* ``python EXTRA`` and ``bash EXTRA``, where EXTRA names an optional extra in ``EXTRAS``
  (``trl``, ``textworld``): run only where that extra is installed, skipped (and said so) elsewhere.

A page's runnable blocks run in document order as one bash script (``set -euo pipefail``)
in one directory, so later blocks see the files earlier ones made.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^`\n]*)\n(?P<body>.*?)"
                   r"^(?P=indent)(?P=ticks)[ \t]*$", re.S | re.M)
KINDS = {("bash", ""), ("bash", "runnable"), ("bash", "checked"), ("python", ""),
         ("text", ""), ("toml", ""), ("json", "")}
RUN = {("bash", ""), ("bash", "runnable"), ("python", "")}
# Optional extras a block may need, by marker: the module whose presence means installed.
EXTRAS = {"trl": "trl", "textworld": "textworld"}
KINDS |= {(lang, extra) for lang in ("bash", "python") for extra in EXTRAS}


def installed(extra: str) -> bool:
    """Whether the optional extra ``extra`` (a key of ``EXTRAS``) is importable here."""
    return importlib.util.find_spec(EXTRAS[extra]) is not None


@dataclass(frozen=True)
class Block:
    """One fenced block: language, test marker (``runnable``, ``checked`` or empty), the
    ``title="..."`` it gives, its body (indentation of the fence removed) and its line."""

    lang: str
    marker: str
    title: str | None
    body: str
    line: int

    @property
    def runs(self) -> bool:
        if self.marker in EXTRAS and self.lang in ("bash", "python"):
            return installed(self.marker)
        return (self.lang, self.marker) in RUN


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown page, in document order."""
    out = []
    for m in FENCE.finditer(text):
        info = m.group("info").strip()
        title = re.search(r'title="([^"]*)"', info)
        words = re.sub(r'\w+="[^"]*"', "", info).split()
        indent = len(m.group("indent"))
        body = "".join(line[indent:] if line[:indent].isspace() else line
                       for line in m.group("body").splitlines(keepends=True))
        out.append(Block(words[0] if words else "", " ".join(words[1:]),
                         title.group(1) if title else None, body,
                         text.count("\n", 0, m.start()) + 1))
    return out


def script(page: list[Block]) -> str:
    """One bash script running the page's runnable blocks in order (python blocks are
    written to their file, then run with ``python``)."""
    lines = ["set -euo pipefail"]
    for i, block in enumerate(page):
        if not block.runs:
            continue
        lines.append(f"# block {i} (line {block.line})")
        if block.lang == "python":
            name = block.title or f"block_{i}.py"
            assert re.fullmatch(r"[\w./-]+\.py", name), f"line {block.line}: bad title {name}"
            delimiter = f"RTREES_DOCS_BLOCK_{i}"
            assert delimiter not in block.body
            lines += [f"mkdir -p \"$(dirname '{name}')\"", f"cat > '{name}' <<'{delimiter}'",
                      block.body.rstrip("\n"), delimiter, f"python '{name}'"]
        else:
            lines.append(block.body.rstrip("\n"))
    return "\n".join(lines) + "\n"


def environment() -> dict[str, str]:
    """The environment a page runs in: this interpreter's directory first on ``PATH`` (the
    virtual environment's ``python`` and ``rtrees``), the repository on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), str(ROOT / ".venv" / "bin"),
                                   env.get("PATH", "")])
    env["PYTHONPATH"] = str(ROOT)
    env["RTREES_DEBUG"] = "1"  # a failure shows its traceback
    return env


def run_blocks(page: list[Block], cwd: Path, timeout: float = 900
               ) -> subprocess.CompletedProcess[str]:
    """Run the page's runnable blocks in ``cwd`` (the script is kept there as
    ``docs-page.sh``)."""
    path = cwd / "docs-page.sh"
    path.write_text(script(page))
    return subprocess.run(["bash", str(path)], cwd=cwd, env=environment(),
                          capture_output=True, text=True, timeout=timeout)


def failure(run: subprocess.CompletedProcess[str], what: str) -> str:
    """A failed run's message: its exit status and the end of its output."""
    return (f"{what} failed ({run.returncode})\n--- stdout\n{run.stdout[-3000:]}"
            f"\n--- stderr\n{run.stderr[-4000:]}")
