"""docs/guides/add-an-environment.md ("Bring your own environment") stays true: its ``bash runnable``
blocks run in order in one temporary directory (one bash script, ``.venv/bin`` first on
``PATH``) and leave what they say they make; its ``python`` blocks define environments that
pass ``check_env``; every ``rtrees`` command line of its ``bash checked`` blocks parses
against the app (``tests/test_readme.py``'s parser)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import check_names, parse, rtrees_commands

from rollout_store import Store, read_trees

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "guides" / "add-an-environment.md"
RUNNABLE = re.compile(r"^```bash runnable[^\n]*\n(.*?)^```", re.S | re.M)
CHECKED = re.compile(r"^```bash checked[^\n]*\n(.*?)^```", re.S | re.M)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_guide_runs(tmp_path: Path) -> None:
    blocks = RUNNABLE.findall(DOC.read_text())
    assert len(blocks) >= 3
    script = tmp_path / "guide.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(blocks))
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    run = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("ok    replay:") == 2  # both env checks: replay byte-identical
    byo = read_trees(Store(tmp_path / "byo"))  # the collected trees, then the trainer's
    assert {t.env for t in byo} == {"mytools:MyCalc"}
    assert len([t for t in byo if not t.run_id.startswith("train-")]) == 8
    audit = json.loads((tmp_path / "byo-audit" / "results.json").read_text())
    assert audit["coverage"]["n_pairs"] > 0
    assert "held-out success" in run.stdout and (tmp_path / "byo-train" / "config.json").is_file()
    gym = read_trees(Store(tmp_path / "gym"))
    assert len(gym) == 4 and {t.env for t in gym} == {"gym-frozenlake"}


def test_the_guides_python_blocks_define_conforming_environments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each python block saved as a module (as a reader would) defines environments that
    pass ``rtrees env check`` (its library function), named by ``module:Class``."""
    import importlib

    from train.envs import Environment
    from train.envs.check import check_env

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the fork check's worker imports it
    for i, block in enumerate(PYTHON.findall(DOC.read_text())):
        (tmp_path / f"guide_block_{i}.py").write_text(block)
        module = importlib.import_module(f"guide_block_{i}")
        classes = [name for name, v in vars(module).items() if isinstance(v, type)
                   and issubclass(v, Environment) and v.__module__ == module.__name__]
        assert classes, f"python block {i} defines no Environment"
        for name in classes:
            report = check_env(f"guide_block_{i}:{name}", prefixes=5)
            failed = [r for r in report.checks if r.status == "FAIL"]
            assert not failed and report.passed, failed


@pytest.mark.parametrize("argv", [argv for block in CHECKED.findall(DOC.read_text())
                                  for argv in rtrees_commands(block)],
                         ids=lambda argv: " ".join(argv[1:3]))
def test_the_guides_shown_commands_parse(argv: list[str]) -> None:
    check_names(parse(argv))
