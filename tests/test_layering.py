"""The import rules of the house (issue 9), checked on the source with ``ast``.

Data flows one way: environments and policies -> samplers and studies -> stores and
study files -> analysis; ``train.jobs`` (with ``train.demo``, the main job) is the
composition root and ``cli`` parses,
calls one library function and prints. Every ``import`` / ``from ... import`` of a
module counts, wherever it sits (top level, inside a function, under
``TYPE_CHECKING``), since a lazy import is a dependency too.

* ``rollout_store`` imports nothing of ``train`` or ``analysis``;
* ``analysis`` imports nothing of ``train.envs``, ``train.policies``,
  ``train.sampling`` or ``train.studies`` (it may call pure ``train.credit``);
* in ``train``, only ``train/jobs.py`` and ``train/demo.py`` import ``analysis``;
* ``train.credit`` imports nothing of ``train.policies``, ``train.envs``,
  ``train.sampling`` (nor the scoring job, the reuse stage, the trainer or its batches);
* ``cli`` holds no loops over trees. The heuristic [R]: no ``for`` statement or
  comprehension in ``cli/`` iterates over an expression that names a tree or a node
  (an identifier or attribute containing ``tree`` or ``node``, case-insensitive), and
  no ``cli`` module imports ``rollout_store.tree`` (the in-memory ``Tree``/``Node``).
  Loops over a literal tuple or list (an option list, table columns) and over report
  rows stay allowed.
* no import circle anywhere (issue 28): the graph of every module of ``train``,
  ``rollout_store``, ``analysis`` and ``cli`` (edges: every import, lazy ones and
  relative ones included; importing ``a.b.c`` from outside ``a.b`` also runs
  ``a.b/__init__.py``, so that is an edge too) has no cycle, nor has the graph of
  ``train``'s subpackages and top-level modules (``train.sampling`` -> ``train.policies``
  one way only); ``train/distributed.py`` (collectives) imports nothing of the trainer
  (``train/launch.py`` starts the ranks).
"""

from __future__ import annotations

import ast
import itertools
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
                              "train.studies", "train.jobs", "train.demo", "cli")) == []


def test_credit_reads_only() -> None:
    """``train.credit`` is pure (issue 28): it loads no policy, replays no environment and
    samples nothing, lazily or not; the scoring job that writes ``policy_scores`` is
    ``train/scoring.py``, on the rollout side."""
    assert _hits("train/credit", ("train.policies", "train.envs", "train.sampling",
                                  "train.scoring", "train.reuse", "train.trainer",
                                  "train.batches", "train.forward", "train.sequences",
                                  "train.jobs", "train.demo")) == []


def test_only_jobs_imports_analysis() -> None:
    assert _hits("train", ("analysis",), skip=("train/jobs.py", "train/demo.py")) == []


# ----------------------------------------------------------------------------- circles

PACKAGES = ("train", "rollout_store", "analysis", "cli")


def _module_files(root: Path, packages: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    out: dict[str, tuple[Path, bool]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES
                 ) -> dict[str, dict[str, int]]:
    """module -> {imported module of ours: first line}, over every Import / ImportFrom
    anywhere in the file (functions, ``TYPE_CHECKING`` blocks), relative ones resolved
    against the module's package. ``from a import b`` names module ``a.b`` when that is
    a module, else ``a``; an import of ``a.b.c`` from outside package ``a.b`` also runs
    ``a.b`` (and ``a``), so those count too."""
    files = _module_files(root, packages)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_pkg) in files.items():
        package = module if is_pkg else module.rpartition(".")[0]
        targets: dict[str, int] = {}

        def add(name: str | None, line: int, module: str = module,
                targets: dict[str, int] = targets) -> None:
            if name is None or name == module:
                return
            targets.setdefault(name, line)
            parts = name.split(".")
            for i in range(1, len(parts)):  # the packages on the way are run too
                parent = ".".join(parts[:i])
                if parent in files and not (module == parent or module.startswith(parent + ".")):
                    targets.setdefault(parent, line)

        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(known(alias.name), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = known(f"{source}.{alias.name}")
                    add(sub if sub != known(source) else known(source), node.lineno)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (iterative DFS in
    sorted order, so the report is stable)."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        path = [start]
        state[start] = 1
        while stack:
            node, todo = stack[-1]
            if not todo:
                state[node] = 2
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop(0)
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, sorted(graph[nxt])))
    return None


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)) + \
        f" -> {cycle[-1]}"


def package_graph(graph: dict[str, dict[str, int]], package: str = "train"
                  ) -> dict[str, dict[str, int]]:
    """``graph`` collapsed to ``package``'s subpackages and top-level modules
    (``train.sampling.collect`` -> ``train.sampling``); the line is the first import."""
    def unit(m: str) -> str | None:
        parts = m.split(".")
        return ".".join(parts[:2]) if parts[0] == package and len(parts) > 1 else None

    out: dict[str, dict[str, int]] = {}
    for a, targets in graph.items():
        ua = unit(a)
        if ua is None:
            continue
        out.setdefault(ua, {})
        for b, line in targets.items():
            ub = unit(b)
            if ub is not None and ub != ua:
                out[ua].setdefault(ub, line)
    return out


def test_the_cycle_checker(tmp_path: Path) -> None:
    """It sees a circle through a lazy, relative import and through a package's
    ``__init__``, names the path, and passes an acyclic package."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from p import a\n")
    (pkg / "sub" / "__init__.py").write_text("from p.sub import c\n")
    (pkg / "sub" / "c.py").write_text("from p.sub import d\n")  # inside: no edge to p.sub
    (pkg / "sub" / "d.py").write_text("import p.b\n")
    graph = import_graph(tmp_path, ("p",))
    assert graph["p.a"] == {"p.b": 2} and graph["p.b"] == {"p.a": 1}
    assert find_cycle(graph) == ["p.a", "p.b", "p.a"]
    assert _describe(graph, ["p.a", "p.b", "p.a"]) == "p.a (line 2) -> p.b (line 1) -> p.a"
    (pkg / "b.py").write_text("def g():\n    pass\n")
    assert find_cycle(import_graph(tmp_path, ("p",))) is None
    (pkg / "b.py").write_text("def g():\n    from p.sub.d import x\n")  # runs p.sub
    graph = import_graph(tmp_path, ("p",))
    assert "p.sub" in graph["p.b"]
    assert find_cycle(graph) == ["p.b", "p.sub", "p.sub.c", "p.sub.d", "p.b"]


def test_no_import_circle_between_modules() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {_describe(graph, cycle)}"


def test_no_import_circle_between_train_packages() -> None:
    graph = package_graph(import_graph())
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle: {_describe(graph, cycle)}"


def test_distributed_imports_nothing_of_the_trainer() -> None:
    """The collectives know nothing of the training loop; ``train/launch.py`` (the
    launcher) is what imports the trainer."""
    graph = import_graph()
    assert not [m for m in graph["train.distributed"] if m.startswith("train.trainer")
                or m in ("train.launch", "train.jobs", "train.demo", "cli")]
    assert "train.launch" not in graph["train.trainer"]


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
                   "train.forward", "train.sequences", "train.trainer")


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


def _credit_names(source: str) -> list[int]:
    """Lines of ``source`` holding a credit method's name as a string constant, or
    comparing a ``.credit`` / ``.credit_params`` attribute (``==``, ``in``, ...)."""
    from train.credit import ESTIMATORS

    return sorted(n.lineno for n in ast.walk(ast.parse(source)) if (
        isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in ESTIMATORS)
        or (isinstance(n, ast.Compare) and any(
            isinstance(x, ast.Attribute) and x.attr in ("credit", "credit_params")
            for x in (n.left, *n.comparators))))


def test_trainer_names_no_credit_method() -> None:
    """No string constant of ``train/trainer.py`` is a credit method's name (issue 46): the
    trainer holds ``make_credit(config)`` and calls ``credit.step``; what a method needs
    (gold or token scores, trainer support) is declared on its params type. No
    ``config.credit ==`` / ``in config.credit_params`` comparison either."""
    assert _credit_names((ROOT / "train" / "trainer.py").read_text()) == []


@pytest.mark.parametrize("snippet,caught", [
    ('x = "trace"\n', True),
    ("if config.credit == name:\n    pass\n", True),
    ('if "ref" in config.credit_params:\n    pass\n', True),
    ('x = "reward"\n', False),
])
def test_the_credit_name_check(snippet: str, caught: bool) -> None:
    assert bool(_credit_names(snippet)) == caught


# ---- environments are named as data, never to decide behaviour (issue 44) -------------

def _builtin_env_names() -> frozenset[str]:
    from train.envs.registry import BUILTIN

    return frozenset(BUILTIN)


def _names_env(node: ast.AST, names: frozenset[str]) -> bool:
    """``node`` is a string literal naming a built-in env, or a tuple / list / set literal
    holding one, or a dict literal with one as a key."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in names
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_env(e, names) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(k is not None and _names_env(k, names) for k in node.keys)
    return False


def env_name_constants(source: str, names: frozenset[str] | None = None) -> set[str]:
    """Module-level names bound to a literal collection of built-in env names
    (``TINY_ENVS = ("calc", "workflow", "sgls")``): ``x in TINY_ENVS`` decides by name too."""
    names = _builtin_env_names() if names is None else names
    out = set()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else []
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if value is not None and not isinstance(value, ast.Constant) \
                and _names_env(value, names):
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _env_name_decisions(source: str, label: str, names: frozenset[str] | None = None,
                        constants: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Where ``source`` decides by a built-in env's name: a comparison (``==``, ``!=``,
    ``in``, ``not in``, any operator) with a literal naming one on either side (``env ==
    "calc"``, ``"workflow" in envs``, ``env in ("calc", "sgls")``) or with one of
    ``constants`` (``env in TINY_ENVS``: ``env_name_constants`` of every module); a dict
    literal keyed by two or more of them (a per-env dispatch table), or one indexed on the
    spot (``{"calc": ...}[env]``, ``{...}.get(env)``); a ``match`` case on one. A name as
    plain data (an argument, a default, help text, a docstring) is none of these."""
    names = _builtin_env_names() if names is None else names
    found = []

    def constant(x: ast.expr) -> bool:
        return (isinstance(x, ast.Name) and x.id in constants) or (
            isinstance(x, ast.Attribute) and x.attr in constants)

    for node in ast.walk(ast.parse(source, filename=label)):
        what = None
        if isinstance(node, ast.Compare) and any(
                _names_env(x, names) or constant(x) for x in (node.left, *node.comparators)):
            what = "compares with an env name"
        elif isinstance(node, ast.Dict) and sum(
                isinstance(k, ast.Constant) and k.value in names for k in node.keys) >= 2:
            what = "is a table keyed by env names"
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) \
                and _names_env(node.value, names):
            what = "indexes a dict keyed by an env name"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and isinstance(node.func.value, ast.Dict) \
                and _names_env(node.func.value, names):
            what = "looks up a dict keyed by an env name"
        elif isinstance(node, ast.MatchValue) and _names_env(node.value, names):
            what = "matches an env name"
        if what is not None:
            found.append(f"{label}:{getattr(node, 'lineno', '?')} {what}: "
                         f"{ast.unparse(node)[:80]}")
    return found


def test_no_module_decides_by_an_env_name() -> None:
    """No module of ``rollout_store``, ``analysis``, ``train`` (but ``train/envs/``) or
    ``cli`` names a built-in environment to decide behaviour (issue 44): it asks the env's
    class (``exact_values``, ``tabular_policy``, ``task_group_key``, ``tiny_sft``,
    ``tiny_phrases``, ``expert_action``), so a user's environment gets the same treatment.
    Studies about a built-in world pass its name as data (``make_env("calc")``)."""
    sources = {path.relative_to(ROOT).as_posix(): path.read_text()
               for package in ("rollout_store", "analysis", "train", "cli")
               for path in _modules(package)}
    sources = {rel: src for rel, src in sources.items() if not rel.startswith("train/envs/")}
    constants = set().union(*(env_name_constants(src) for src in sources.values()))
    found = [hit for rel, src in sources.items()
             for hit in _env_name_decisions(src, rel, constants=constants)]
    assert found == []


@pytest.mark.parametrize("snippet,caught", [
    ('if env == "workflow":\n    pass\n', True),
    ('x = 1 if task.env != "sgls" else 2\n', True),
    ('if "calc" in config.envs:\n    pass\n', True),
    ('ok = env not in ("calc", "workflow", "sgls")\n', True),
    ('n = {"calc": 1, "workflow": 2}\n', True),
    ('n = {"sgls": 64}.get(env, 48)\n', True),
    ('n = {"python": 1}[env]\n', True),
    ('match env:\n    case "calc":\n        pass\n', True),
    ('def f(env: str = "calc") -> None:\n    """Runs on calc."""\n', False),
    ('make_env("workflow")\nCONFIGS = {"a": ("calc", "group", "grpo")}\n', False),
    ('state = {"python": 1, "numpy": 2}\n', False),  # one env-named key, not indexed
    ('if kind == "tiny":\n    pass\n', False),
])
def test_the_env_name_heuristic(snippet: str, caught: bool) -> None:
    assert bool(_env_name_decisions(snippet, "probe.py")) == caught


def test_the_env_name_constants() -> None:
    """A module constant listing env names makes ``x in CONST`` a decision by name, in
    that module and in one that imports it; other constants do not."""
    src = ('TINY_ENVS: tuple[str, ...] = ("calc", "workflow")\nCHUNK = 8\n'
           'CONFIGS = {"a": ("calc", "group")}\nNAME = "calc"\n')
    assert env_name_constants(src) == {"TINY_ENVS"}
    user = "if env not in tiny_train.TINY_ENVS:\n    pass\nok = name in CONFIGS\n"
    assert len(_env_name_decisions(user, "probe.py", constants={"TINY_ENVS"})) == 1
