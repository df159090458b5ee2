"""docs/guides/agent-programs.md ("Bring your own agent program") stays true: its
``bash`` and ``python`` blocks run in document order in one temporary directory (slow:
it collects, credits, audits, serves and trains); by default every ``rtrees`` command
line of it parses against the app and every python block compiles."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import check_names, parse, rtrees_commands

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "guides" / "agent-programs.md"
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    return [(kind, body) for kind, body in BLOCK.findall(DOC.read_text())]


def test_the_guides_commands_parse_and_python_compiles() -> None:
    blocks = _blocks()
    kinds = [k for k, _ in blocks]
    assert kinds.count("bash") >= 3 and kinds.count("python") >= 2
    argvs = [argv for kind, body in blocks if kind == "bash" for argv in rtrees_commands(body)]
    assert len(argvs) >= 6
    for argv in argvs:
        check_names(parse(argv))
    for i, (kind, body) in enumerate(blocks):
        if kind == "python":
            compile(body, f"agent-programs.md block {i}", "exec")


@pytest.mark.slow
def test_the_guide_runs(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    shim = tmp_path / "bin" / "rtrees"  # this checkout's CLI, whatever is installed
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}:$PYTHONPATH" exec "{sys.executable}" '
                    '-m cli.main "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}  # block 1's export, carried on
    out = []
    for i, (kind, body) in enumerate(_blocks()):
        argv = ["bash", "-euo", "pipefail", "-c", body] if kind == "bash" else \
            [sys.executable, "-c", body]
        run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=900)
        assert run.returncode == 0, f"block {i}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
        out.append(run.stdout)
    text = "".join(out)
    assert "ok    native" in text and "replay diverged at call 2" in text
    assert "messages[2].content" in (tmp_path / "noisy-check.txt").read_text()
    assert re.search(r"[1-9][0-9]* rollouts diverged on replay", text)  # and committed
    assert "2 trees committed" in " ".join((tmp_path / "noisy-collect.txt").read_text().split())
    audit = json.loads((tmp_path / "agent-audit" / "results.json").read_text())
    assert audit["coverage"]["n_pairs"] > 0
    assert "reward" in text and (tmp_path / "calls.jsonl").is_file()
    assert (tmp_path / "agent-train" / "config.json").is_file()
