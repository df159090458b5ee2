"""A user's environment package, made in a temporary directory and installed with pip (into
a target directory on ``PYTHONPATH``, as a site-packages would be) with a
``rollout_trees.envs`` entry point, is collected, credited, audited and trained through the
CLI without touching the project's files; the same environment registered in-process with
``register_env`` goes through the library API (collect, credit, audit, train)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout_store import Store, read_trees

PACKAGE = '''
"""A user's world: a calculator tool of their own, arithmetic tasks, exact reward."""
import ast
import operator
import random
from fractions import Fraction

from train.envs import Task
from train.envs.tools import function_tool_env, tool_call

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression exactly."""
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        raise ValueError("only integers and + - *")
    return str(value(ast.parse(expr, mode="eval").body))


def reward(answer, task):
    return float(answer.strip() == task.answer)


def expert(task, history):
    if not history:
        return tool_call("calc", expr=task.config["expr"])
    return f"<answer>{task.answer}</answer>"


rng = random.Random(1)
TASKS = []
for _ in range(300):
    expr = f"{rng.randint(2, 20)}{rng.choice('+-*')}{rng.randint(2, 20)}"
    TASKS.append({"prompt": f"Compute {expr}.", "answer": calc(expr),
                  "config": {"expr": expr}})
UserCalc = function_tool_env("usercalc", tools=[calc], tasks=TASKS, reward=reward,
                             expert=expert)
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``usercalc_pkg`` built and installed by pip into a target directory."""
    src = tmp_path_factory.mktemp("usercalc-src")
    (src / "usercalc_pkg").mkdir()
    (src / "usercalc_pkg" / "__init__.py").write_text("")
    (src / "usercalc_pkg" / "env.py").write_text(PACKAGE)
    (src / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "usercalc-pkg"
        version = "0.1"

        [project.entry-points."rollout_trees.envs"]
        usercalc = "usercalc_pkg.env:UserCalc"
    """))
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(src)],
                   check=True, capture_output=True, timeout=300)
    assert (site / "usercalc_pkg" / "env.py").is_file()
    assert any(p.name.endswith(".dist-info") for p in site.iterdir())
    return site


def rtrees(site: Path, cwd: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([str(Path(sys.executable).parent / "rtrees"), *args], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (args, run.stdout[-2000:], run.stderr[-2000:])
    return run.stdout


def test_an_installed_package_is_collected_credited_audited_and_trained(
        installed: Path, tmp_path: Path) -> None:
    out = rtrees(installed, tmp_path, "env", "check", "usercalc", "--prefixes", "3")
    assert "supports: group, random" in out and "FAIL" not in out
    rtrees(installed, tmp_path, "collect", "--store", "s", "--env", "usercalc", "--policy",
           "tiny:calc", "--sampler", "bel", "--tasks", "6", "--n-total", "6", "--no-progress")
    rtrees(installed, tmp_path, "credit", "--store", "s", "--method", "grpo")
    rtrees(installed, tmp_path, "audit", "ranking", "--store", "s", "--methods", "grpo",
           "--k", "4", "--bootstrap", "100", "--out", "audit")
    rtrees(installed, tmp_path, "train", "--env", "usercalc", "--policy", "tiny:calc",
           "--store", "s", "--out", "run", "--set", "steps=2", "--set", "tasks_per_step=2",
           "--set", "n_total=3", "--set", "heldout_tasks=2", "--set", "max_new_tokens=24",
           "--set", "progress=false")
    trees = read_trees(Store(tmp_path / "s"))
    assert {t.env for t in trees} == {"usercalc"} and len(trees) == 6 + 2 * 2
    results = json.loads((tmp_path / "audit" / "results.json").read_text())
    assert results["coverage"]["n_trees"] == 6
    refs = Store(tmp_path / "s").delta_table("mc_references").to_pyarrow_table()
    assert refs.num_rows > 0  # the reference job rebuilt the env from the stored name
    # without the package on the path, the stored name no longer resolves: one line
    run = subprocess.run([str(Path(sys.executable).parent / "rtrees"), "collect", "--store",
                          "s2", "--env", "usercalc", "--policy", "tiny:calc", "--sampler",
                          "group", "--tasks", "1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode != 0 and "unknown environment 'usercalc'" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "s2").exists()


def test_register_env_through_the_library(installed: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook's path: the class registered under a name of the notebook's choosing."""
    monkeypatch.syspath_prepend(str(installed))
    from analysis.ranking import RankingConfig, ranking_audit
    from train.config import load_config
    from train.envs import register_env, unregister_env
    from train.envs.registry import resolve_env
    from train.policies import load_policy
    from train.sampling.collect import collect
    from train.sampling.references import ReferenceConfig, collect_references
    from train.scoring import score_and_credit
    from train.trainer import read_metrics, train

    resolve_env.cache_clear()
    import usercalc_pkg.env as user  # type: ignore[import-not-found]

    register_env("my-calc", user.UserCalc)
    try:
        store = Store(tmp_path / "s", create=True)
        tasks = user.UserCalc.generate_tasks(4, seed=0)
        collect(store, "my-calc", load_policy("tiny:calc", "my-calc"), "bel", tasks, 6, 0,
                "nb", progress=False)
        score_and_credit(store, "grpo")
        collect_references(store, ReferenceConfig(k=2), progress=False)
        result = ranking_audit(store, RankingConfig(("grpo",), k=2, n_boot=50))
        assert result.stats.n_trees == 4
        cfg = load_config(None, {"env": "my-calc", "policy": "tiny:calc", "steps": 1,
                                 "tasks_per_step": 2, "n_total": 2, "heldout_tasks": 0,
                                 "max_new_tokens": 16, "progress": False, "run_id": "nbt",
                                 "store": str(tmp_path / "s"), "out": str(tmp_path / "r")})
        train(cfg)
        assert len(read_metrics(cfg.store, "nbt")["loss"]) == 1
    finally:
        unregister_env("my-calc")
    # the class is importable, so the name was recorded by its path: a spawned process (a
    # worker, a later job) resolves the stored trees' env without the registration
    envs = {t.env for t in read_trees(Store(tmp_path / "s"))}
    assert envs == {"usercalc_pkg.env:UserCalc"}
