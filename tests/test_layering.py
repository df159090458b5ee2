"""The import rules of the house (issue 9), checked on the source with ``ast``.

Data flows one way: environments and policies -> samplers and studies -> stores and
study files -> analysis; ``train.jobs`` is the composition root and ``cli`` parses,
calls one library function and prints. Every ``import`` / ``from ... import`` of a
module counts, wherever it sits (top level, inside a function, under
``TYPE_CHECKING``), since a lazy import is a dependency too.

* ``rollout_store`` imports nothing of ``train`` or ``analysis``;
* ``analysis`` imports nothing of ``train.envs``, ``train.policies``,
  ``train.sampling`` or ``train.studies`` (it may call pure ``train.credit``);
* in ``train``, only ``train/jobs.py`` imports ``analysis``;
* ``cli`` holds no loops over trees. The heuristic [R]: no ``for`` statement or
  comprehension in ``cli/`` iterates over an expression that names a tree or a node
  (an identifier or attribute containing ``tree`` or ``node``, case-insensitive), and
  no ``cli`` module imports ``rollout_store.tree`` (the in-memory ``Tree``/``Node``).
  Loops over a literal tuple or list (an option list, table columns) and over report
  rows stay allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every import in ``path`` (``from a.b import c`` gives
    ``a.b`` and ``a.b.c``, so importing a submodule by name counts)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def _hits(package: str, forbidden: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
    found = []
    for path in _modules(package):
        rel = path.relative_to(ROOT).as_posix()
        if rel in skip:
            continue
        for line, module in _imports(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                found.append(f"{rel}:{line} imports {module}")
    return found


def test_imports_parse_every_form(tmp_path: Path) -> None:
    """The checker itself: it sees lazy, aliased and TYPE_CHECKING imports."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    import train.envs as e\n"
                   "def f():\n    from train import sampling\n    from .x import y\n")
    modules = {m for _, m in _imports(src)}
    assert {"train.envs", "train", "train.sampling"} <= modules
    assert not any(m.endswith(".x") or m == "y" for m in modules)  # relative: not ours


def test_rollout_store_imports_no_train_or_analysis() -> None:
    assert _hits("rollout_store", ("train", "analysis")) == []


def test_analysis_reads_only() -> None:
    assert _hits("analysis", ("train.envs", "train.policies", "train.sampling",
                              "train.studies", "train.jobs", "cli")) == []


def test_only_jobs_imports_analysis() -> None:
    assert _hits("train", ("analysis",), skip=("train/jobs.py",)) == []


def _names(expr: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(expr):
        if isinstance(node, ast.Name):
            names.append(node.id)
        elif isinstance(node, ast.Attribute):
            names.append(node.attr)
    return names


def _tree_loops(source: str, label: str) -> list[str]:
    tree = ast.parse(source, filename=label)
    found = []
    for node in ast.walk(tree):
        iters: list[ast.expr] = []
        if isinstance(node, ast.For | ast.AsyncFor):
            iters.append(node.iter)
        elif isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
            iters += [gen.iter for gen in node.generators]
        for it in iters:
            if isinstance(it, ast.Tuple | ast.List):  # a literal option list
                continue
            bad = [n for n in _names(it) if "tree" in n.lower() or "node" in n.lower()]
            if bad:
                found.append(f"{label}:{it.lineno} loops over {bad}")
    return found


def test_cli_holds_no_loops_over_trees() -> None:
    loops = [hit for path in _modules("cli")
             for hit in _tree_loops(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert loops == []
    assert _hits("cli", ("rollout_store.tree",)) == []


@pytest.mark.parametrize("snippet,caught", [
    ("for t in trees:\n    pass\n", True),
    ("x = [n.reward for n in tree.nodes]\n", True),
    ("for line in report.lines():\n    pass\n", False),
    ("for o, v in (('--n-trees', n_trees),):\n    pass\n", False),  # an option list
    ("for col in table.columns:\n    pass\n", False),
])
def test_the_loop_heuristic(snippet: str, caught: bool) -> None:
    assert bool(_tree_loops(snippet, "probe.py")) == caught


# ---- the reuse package (issue 28) ----------------------------------------------------

REUSE_FORBIDDEN = ("torch", "train.envs", "train.policies", "train.sampling",
                   "rollout_store.store", "rollout_store.reader", "train.batches",
                   "train.trainer")


def test_reuse_resolve_is_pure() -> None:
    """``train/reuse/resolve.py`` (and ``params.py``, all it imports of the package)
    imports no torch, environments, policies, samplers or store: statically, and at run
    time in a fresh interpreter (where ``torch`` never loads)."""
    import subprocess
    import sys

    found = []
    for rel in ("train/reuse/resolve.py", "train/reuse/params.py"):
        for line, module in _imports(ROOT / rel):
            if any(module == f or module.startswith(f + ".") for f in REUSE_FORBIDDEN):
                found.append(f"{rel}:{line} imports {module}")
            if module.startswith("train.reuse") and module not in (
                    "train.reuse.params", "train.reuse.params.REUSE_MODES",
                    "train.reuse.params.ReuseParams"):
                found.append(f"{rel}:{line} imports {module}")
    assert found == []
    code = ("import sys, train.reuse.resolve; bad = sorted(m for m in sys.modules if "
            "m.split('.')[0] == 'torch' or m.startswith(('train.envs', 'train.policies', "
            "'train.sampling', 'train.batches'))); print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr


def test_config_imports_only_reuse_params() -> None:
    """``train/config.py`` imports ``train.reuse.params`` and nothing else of the package."""
    got = [m for _, m in _imports(ROOT / "train" / "config.py") if m.startswith("train.reuse")]
    assert got and all(m == "train.reuse.params" or m.startswith("train.reuse.params.")
                       for m in got), got


def test_trainer_names_no_reuse_mode() -> None:
    """No string constant of ``train/trainer.py`` is a reuse mode's name (``none``
    included): the trainer holds ``make_reuse(config)`` and asks the stage, never the
    mode; no ``config.reuse ==`` / ``!=`` comparison either."""
    from train.reuse.params import REUSE_MODES

    tree = ast.parse((ROOT / "train" / "trainer.py").read_text())
    literals = [(n.lineno, n.value) for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and n.value in REUSE_MODES]
    compares = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare) and any(
        isinstance(x, ast.Attribute) and x.attr in ("reuse", "dynamic_sampling")
        for x in (n.left, *n.comparators))]
    assert literals == [] and compares == [], (literals, compares)
