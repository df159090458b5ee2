"""docs/guides/add-an-environment.md ("Bring your own environment") stays true:
``tests/test_docs_guides.py`` runs its blocks in order in one temporary directory and parses
its ``bash checked`` command lines; ``check_the_guide_ran`` (called there) checks that the
run left what the guide says it makes; here, its ``python`` blocks define environments that
pass ``check_env``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollout_store import Store, read_trees

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "guides" / "add-an-environment.md"
RUNNABLE = re.compile(r"^```bash runnable[^\n]*\n(.*?)^```", re.S | re.M)
CHECKED = re.compile(r"^```bash checked[^\n]*\n(.*?)^```", re.S | re.M)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def check_the_guide_ran(tmp_path: Path, stdout: str) -> None:
    """What the guide's blocks leave in their directory after ``tests/test_docs_guides.py``
    ran them (in order, one bash script, the venv's ``bin`` first on ``PATH``)."""
    # every env check: replay byte-identical (the TextWorld block's too, where it ran)
    checks = 3 if (tmp_path / "tw").exists() else 2
    assert stdout.count("ok    replay:") == checks
    byo = read_trees(Store(tmp_path / "byo"))  # the collected trees, then the trainer's
    assert {t.env for t in byo} == {"mytools:MyCalc"}
    assert len([t for t in byo if not t.run_id.startswith("train-")]) == 8
    audit = json.loads((tmp_path / "byo-audit" / "results.json").read_text())
    assert audit["coverage"]["n_pairs"] > 0
    assert "held-out success" in stdout and (tmp_path / "byo-train" / "config.json").is_file()
    gym = read_trees(Store(tmp_path / "gym"))
    assert len(gym) == 4 and {t.env for t in gym} == {"gym-frozenlake"}


def test_the_guide_has_its_blocks() -> None:
    assert len(RUNNABLE.findall(DOC.read_text())) >= 3
    assert len(CHECKED.findall(DOC.read_text())) >= 2


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
