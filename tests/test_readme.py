"""The README and the docs pages stay true (examples run).

* The README's code blocks run in order in one temporary directory (``tests/docs_blocks.py``:
  its python examples, then its shell block), and leave what they say they make.
* The quickstart's tour (``docs/quickstart.md``): every fenced block whose info string is
  ``bash runnable`` is a runnable block. One test executes them in order with bash (``set
  -euo pipefail``, ``.venv/bin`` first on ``PATH``) in one temporary directory, so later
  blocks use the store earlier blocks made, and after each block checks that the store holds
  what its ``rtrees`` commands create: trees of the run after ``collect``, credit of the
  method after ``credit``, the run's metrics after ``train`` (and reused trees with
  ``--reuse``), the report after ``audit ranking`` / ``study``.
* The other tests run nothing: every ``rtrees`` command line of a runnable block, and of
  a ``bash checked`` block (shown, never run: paper-sized settings, paths of the reader's
  machine) in the README and the docs pages outside ``docs/guides/`` (whose blocks
  ``tests/test_docs_guides.py`` runs and parses), must parse against the typer app
  (click's ``make_context``: the options exist, values convert, required ones are given)
  with known environments, samplers and estimators; every backticked repository path of
  the README and the docs, and every file of the architecture block
  (``docs/architecture.md``), exists; the quickstart's command table lists exactly the
  app's top-level commands; every row of the results page names the command that
  reproduces it.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
QUICKSTART = DOCS / "quickstart.md"
ARCHITECTURE = DOCS / "architecture.md"
RESULTS = DOCS / "results.md"
RUNNABLE = re.compile(r"^```bash runnable[^\n]*\n(.*?)^```", re.S | re.M)
CHECKED = re.compile(r"^```bash checked[^\n]*\n(.*?)^```", re.S | re.M)
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "2>", "2>>", "&>"}


def runnable_blocks(text: str) -> list[str]:
    """The bodies of the ``bash runnable`` fenced blocks of ``text``, in order."""
    return RUNNABLE.findall(text)


def command_lines(block: str) -> list[list[str]]:
    """The simple commands of a shell block as argv lists: continuation lines joined,
    comments and here-document bodies skipped, split at ``&&``, ``;``, ``|``; leading
    ``VAR=value`` assignments and redirections dropped."""
    out: list[list[str]] = []
    lines = block.replace("\\\n", " ").splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
            line = line[:heredoc.start()]
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        argv: list[str] = []
        tokens = list(lex)
        j = 0
        while j < len(tokens):
            token = tokens[j]
            if token in OPERATORS:
                out.append(argv)
                argv = []
            elif token in REDIRECTS:
                j += 1  # and its target
            elif not argv and re.fullmatch(r"[A-Za-z_]\w*=.*", token):
                pass  # an environment assignment before the command
            else:
                argv.append(token)
            j += 1
        out.append(argv)
    return [argv for argv in out if argv]


def rtrees_commands(block: str) -> list[list[str]]:
    """The ``rtrees ...`` argv lists of a shell block."""
    return [argv for argv in command_lines(block) if argv[0] == "rtrees"]


@dataclass
class Parsed:
    """An ``rtrees`` command line parsed by the app: the command path and its values."""

    path: tuple[str, ...]
    params: dict[str, Any]


def parse(argv: list[str]) -> Parsed:
    """Parse ``argv`` (``["rtrees", "collect", ...]``) with the app's click commands, running
    nothing; a bad command, option or value raises click's ``UsageError``."""
    from cli.reference import root_command

    command, args, path = root_command(), list(argv[1:]), ["rtrees"]
    while getattr(command, "commands", None):
        if not args or args[0] not in command.commands:
            raise AssertionError(f"{shlex.join(argv)}: {args[:1] or 'nothing'} is not a "
                                 f"command of {' '.join(path)}")
        path.append(args[0])
        command, args = command.commands[args[0]], args[1:]
    ctx = command.make_context(" ".join(path), args)
    return Parsed(tuple(path), dict(ctx.params))


def check_names(parsed: Parsed) -> None:
    """Environment, sampler and estimator names a command line gives are registered."""
    from train.credit import ESTIMATORS
    from train.envs import env_class
    from train.sampling import SAMPLERS

    p = parsed.params
    if isinstance(p.get("env"), str) and ":" not in p["env"]:  # module:Class: the reader's
        env_class(p["env"])  # a name that does not resolve raises
    for key, known in (("sampler", SAMPLERS), ("method", ESTIMATORS), ("credit", ESTIMATORS)):
        value = p.get(key)
        if isinstance(value, str):
            assert value in known, f"{' '.join(parsed.path)} --{key} {value}: unknown"
    if parsed.path[-1] == "ranking":
        for method in p["methods"].split(","):
            assert method.split("@")[0] in ESTIMATORS, f"audit ranking: unknown {method}"


README_TEXT = README.read_text()
DOC_PAGES = sorted(DOCS.glob("**/*.md"))
PAGES = {README: README_TEXT} | {p: p.read_text() for p in DOC_PAGES}  # what a reader reads
QUICKSTART_TEXT = PAGES[QUICKSTART]
BLOCKS = runnable_blocks(QUICKSTART_TEXT)  # the tour
CHECKED_BLOCKS = [block for page, text in PAGES.items()  # parsed, never run
                  if DOCS / "guides" not in page.parents
                  for block in CHECKED.findall(text)]
OTHER_RUNNABLE = [block for page, text in PAGES.items()  # guides: tests/test_docs_guides.py
                  if page != QUICKSTART and DOCS / "guides" not in page.parents
                  for block in runnable_blocks(text)]


def test_the_block_parser() -> None:
    """The parser itself, on a block with every form the README uses."""
    block = ("# a comment\nX=1 rtrees sql \"SELECT 1\" --store s  # trailing\n"
             "cat > c.toml <<'EOF'\nrtrees not-a-command\nEOF\n"
             "rtrees collect --store s \\\n    --env calc && ls | wc -l\n")
    assert rtrees_commands(block) == [["rtrees", "sql", "SELECT 1", "--store", "s"],
                                      ["rtrees", "collect", "--store", "s", "--env", "calc"]]
    assert runnable_blocks("```bash runnable\nrtrees a\n```\n```bash\nrtrees b\n```\n") \
        == ["rtrees a\n"]


def test_the_tour_covers_the_steps() -> None:
    """The runnable blocks collect, query, credit, audit, train and reuse."""
    commands = [argv[:3] for block in BLOCKS for argv in rtrees_commands(block)]
    flat = {" ".join(c[1:2]) for c in commands} | {" ".join(c[1:3]) for c in commands}
    for step in ("collect", "sql", "credit", "audit ranking", "train"):
        assert step in flat, f"no runnable quickstart block runs rtrees {step}"
    assert any("--reuse" in argv for block in BLOCKS for argv in rtrees_commands(block)), \
        "no runnable quickstart block trains with --reuse"


def test_runnable_blocks_live_where_a_test_runs_them() -> None:
    """``bash runnable`` outside the quickstart and the guides would run nowhere."""
    assert OTHER_RUNNABLE == [], "a `bash runnable` block outside docs/quickstart.md and " \
        "docs/guides/ is run by no test: mark it `bash checked`, or move it"


@pytest.mark.parametrize("argv", [argv for block in BLOCKS + CHECKED_BLOCKS
                                  for argv in rtrees_commands(block)],
                         ids=lambda argv: " ".join(argv[1:3]))
def test_readme_commands_parse(argv: list[str]) -> None:
    """Each ``rtrees`` line of a runnable or checked block of the README and the docs
    pages outside the guides is a valid command line (not run here)."""
    check_names(parse(argv))


def test_a_bad_command_line_fails_to_parse() -> None:
    from typer._click.exceptions import UsageError

    with pytest.raises(UsageError):
        parse(["rtrees", "collect", "--store", "s", "--no-such-option"])
    with pytest.raises(UsageError):  # a required option is missing
        parse(["rtrees", "credit", "--store", "s"])
    with pytest.raises(AssertionError):
        parse(["rtrees", "colect"])


REPO_PREFIXES = ("rollout_store/", "train/", "analysis/", "cli/", "docs/", "tests/",
                 "benchmarks/", "scripts/", "notebooks/", ".github/")


def _exists(rel: str) -> bool:
    """A path, a glob (``docs/guides/**/*.md``) or a pytest node id
    (``tests/test_readme.py::test_the_tour_runs``: its file) names something."""
    return bool(glob.glob(str(ROOT / rel.split("::")[0].rstrip("/")), recursive=True))


def readme_paths(text: str) -> list[str]:
    """Backticked repository paths of ``text`` (``train/loss.py``, ``tests/golden/``), and
    bare file names after a path in the same line (``groups.py`` after
    ``train/credit/grpo.py``) resolved against that path's directory."""
    out = []
    for line in text.splitlines():
        folder = None
        for span in re.findall(r"`([^`]+)`", line):
            words = span.split()
            for word in words:  # a command names its script: `python benchmarks/x.py --n 3`
                token = word.strip("'\"").rstrip(".,:;")
                if token.startswith(REPO_PREFIXES) or token in ("Makefile", "pyproject.toml"):
                    out.append(token)
                    folder = token if token.endswith("/") else token.rsplit("/", 1)[0] + "/"
                elif folder and len(words) == 1 and re.fullmatch(r"[\w*]+\.(py|md)", token):
                    out.append(folder + token)
    return out


def architecture_files(text: str) -> list[str]:
    """Every ``*.py`` / ``*.md`` file the architecture block names, with its folder."""
    match = re.search(r"## Architecture as built\n.*?```\n(.*?)```", text, re.S)
    assert match, "docs/architecture.md has no '## Architecture as built' section with a " \
        "code block"
    out, folder = [], ""
    for line in match.group(1).splitlines():
        tokens = re.findall(r"[\w*./+-]+", line)
        if tokens and not line.startswith(" ") and "/" in tokens[0]:
            first = tokens[0]
            folder = first if first.endswith("/") else first.rsplit("/", 1)[0] + "/"
            out.append(folder)
        for token in tokens:
            token = token.rstrip(".,")
            if re.fullmatch(r"[\w*./-]+\.(py|md)", token):
                out.append(token if "/" in token else folder + token)
    return out


def test_readme_paths_exist() -> None:
    assert len(readme_paths(README_TEXT)) >= 3  # the parser found the README's paths
    paths = {page.relative_to(ROOT).as_posix(): readme_paths(text)
             for page, text in PAGES.items()}
    assert sum(map(len, paths.values())) > 100
    missing = [f"{page}: {p}" for page, found in paths.items() for p in found
               if not _exists(p)]
    assert missing == [], f"the README or the docs name paths that do not exist: {missing}"


def test_readme_links_exist() -> None:
    """The README's relative links (``[quickstart](docs/quickstart.md)``) open a file
    (the site build checks the docs pages' links)."""
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", README_TEXT)
             if "://" not in link]
    assert len(links) > 10
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert missing == [], f"README.md links to files that do not exist: {missing}"


def test_readme_is_short() -> None:
    """A newcomer reads it in five minutes; the rest lives in docs/."""
    assert len(README_TEXT.splitlines()) <= 250


def test_architecture_files_exist() -> None:
    files = architecture_files(ARCHITECTURE.read_text())
    assert "rollout_store/schema.py" in files and "train/trainer.py" in files
    missing = [f for f in files if not _exists(f)]
    assert missing == [], f"the architecture section names files that do not exist: {missing}"


def test_command_table_lists_the_apps_commands() -> None:
    """The quickstart's command table has one row per top-level ``rtrees`` command."""
    from cli.reference import top_level_commands

    section = re.search(r"## Command line\n(.*?)(\n## |\Z)", QUICKSTART_TEXT, re.S)
    assert section, "docs/quickstart.md has no '## Command line' section"
    listed = re.findall(r"^\| `rtrees (\S+)[^`]*` \|", section.group(1), re.M)
    app = [name for name, _ in top_level_commands()]
    assert sorted(listed) == app, (
        f"docs/quickstart.md's command table lists {sorted(set(listed) - set(app))} that the app "
        f"lacks and lacks {sorted(set(app) - set(listed))} (or lists one twice)")


# ------------------------------------------------------------------- the tour, run

def _store_rows(store: Path, sql: str) -> list[tuple[Any, ...]]:
    from rollout_store import Store, connect

    return connect(Store(store)).execute(sql).fetchall()


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def check_effects(cwd: Path, parsed: Parsed) -> None:
    """The store or output directory holds what the command creates."""
    from cli.collect_cmd import default_run_id

    p, name = parsed.params, " ".join(parsed.path[1:])
    if name == "collect":
        run = p["run_id"] or default_run_id(p["env"], p["sampler"], p["policy"], p["n_total"])
        (n,), = _store_rows(cwd / p["store"], f"SELECT count(*) FROM trees WHERE run_id = "
                                               f"{_q(run)}")
        assert n == p["tasks"], f"collect: {n} trees of run {run}, expected {p['tasks']}"
    elif name == "credit":
        (n,), = _store_rows(cwd / p["store"], f"SELECT count(*) FROM credits WHERE method = "
                                               f"{_q(p['method'])}")
        assert n > 0, f"credit: no {p['method']} credit in the store"
    elif name == "train":
        assert p["store"] is not None and p["out"] is not None, "train: give --store and --out"
        run = f"train-{(cwd / p['out']).resolve().name}"
        rows = dict(_store_rows(cwd / p["store"], "SELECT name, sum(value) FROM metrics "
                                                  f"WHERE run_id = {_q(run)} GROUP BY name"))
        assert rows, f"train: no metrics of run {run}"
        assert "heldout_sampled" in rows, f"train: run {run} has no held-out success"
        if p["reuse"] not in (None, "none"):
            assert rows.get("reuse_trees", 0) > 0, f"train --reuse: run {run} reused no tree"
    elif name in ("audit ranking", "study"):
        assert (cwd / p["out"] / "report.md").is_file(), f"{name}: no report.md in {p['out']}"


def test_the_readme_runs(tmp_path: Path) -> None:
    """The README's examples, in order in one directory (``tests/docs_blocks.py``): the
    Python example logs, credits and audits trees; the environment example is checked,
    collected and credited."""
    from docs_blocks import blocks, failure, run_blocks

    from rollout_store import Store, read_trees

    page = blocks(README_TEXT)
    assert [b.lang for b in page if b.runs] == ["python", "python", "bash"]
    run = run_blocks(page, tmp_path, timeout=600)
    assert run.returncode == 0, failure(run, "README.md's blocks")
    # the audit printed: GRPO orders every group's completions by outcome, the trainer's
    # length-based advantages do not
    assert "{'grpo': 1.0, 'source_advantage': " in run.stdout
    assert "'source_advantage': 1.0" not in run.stdout
    logged = read_trees(Store(tmp_path / "my-store"))
    assert len(logged) == 8 and all(len(t.nodes) == 5 for t in logged)
    methods = _store_rows(tmp_path / "my-store", "SELECT DISTINCT method FROM credits")
    assert sorted(m for (m,) in methods) == ["grpo", "source_advantage"]
    assert run.stdout.count("ok    replay:") == 1  # the env check: replay byte-identical
    byo = read_trees(Store(tmp_path / "byo"))
    assert len(byo) == 2 and {t.env for t in byo} == {"mytools:Adder"}
    (n,), = _store_rows(tmp_path / "byo", "SELECT count(*) FROM credits WHERE method = 'elpo'")
    assert n > 0


# In the default run (~40 s on 2 quiet cores), so CI keeps the tour true.
def test_the_tour_runs(tmp_path: Path) -> None:
    """Every runnable block, in order, in one directory; each leaves what it creates."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{ROOT / '.venv' / 'bin'}" \
                  f"{os.pathsep}{env.get('PATH', '')}"
    env["RTREES_DEBUG"] = "1"  # a failure shows its traceback
    assert BLOCKS, "docs/quickstart.md has no runnable block"
    for i, block in enumerate(BLOCKS):
        res = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, (f"runnable block {i} failed ({res.returncode}):\n{block}"
                                     f"\n--- stdout\n{res.stdout[-3000:]}"
                                     f"\n--- stderr\n{res.stderr[-3000:]}")
        for argv in rtrees_commands(block):
            check_effects(tmp_path, parse(argv))


def _table_rows(section: str) -> list[str]:
    """The body rows of the markdown tables in ``section`` (header and rule dropped)."""
    out = []
    for table in re.findall(r"((?:^\|.*\|\n)+)", section + "\n", re.M):
        rows = [r for r in re.findall(r"^\|(.*)\|$", table, re.M) if not set(r) <= {"-", "|", " "}]
        out += rows[1:]
    return out


def _section(text: str, title: str) -> str:
    section = re.search(rf"^## {title}\n(.*?)(\n## |\Z)", text, re.S | re.M)
    assert section, f"docs/results.md has no '## {title}' section"
    return section.group(1)


def _last_cell_command(row: str) -> str:
    command = re.fullmatch(r".*\| `([^`]+)` ", row)
    assert command, f"results row without a command in its last cell: {row}"
    return command.group(1)


def _check_benchmark_command(command: str, row: str) -> None:
    """``command`` runs one script under ``benchmarks/`` that exists and declares every
    option the command gives."""
    words = command.split()
    scripts = [w for w in words if w.startswith("benchmarks/") and w.endswith(".py")]
    assert len(scripts) == 1 and (ROOT / scripts[0]).is_file(), f"no script: {row}"
    source = (ROOT / scripts[0]).read_text()
    for option in (w for w in words if w.startswith("--")):
        assert f'"{option}"' in source, f"{scripts[0]} declares no {option}"


def test_every_benchmark_row_names_its_command() -> None:
    """Each row of the results page's benchmark table ends with the command that reproduces
    it: a script under ``benchmarks/`` that exists and declares every option the command
    gives."""
    rows = _table_rows(_section(RESULTS.read_text(), "Benchmarks"))
    assert len(rows) >= 5
    for row in rows:
        _check_benchmark_command(_last_cell_command(row), row)


def test_every_claim_row_names_its_command() -> None:
    """Each paper claim on the results page ends with the command that reproduces it: an
    ``rtrees`` command line the app parses (known names), or a benchmark script."""
    rows = _table_rows(_section(RESULTS.read_text(), "The seed papers' claims"))
    assert len(rows) >= 10
    for row in rows:
        command = _last_cell_command(row)
        if command.startswith("rtrees "):
            check_names(parse(shlex.split(command)))
        else:
            _check_benchmark_command(command, row)


def test_every_running_time_names_its_command() -> None:
    """The running times (the README's two commands among them) name a Makefile target or
    a test file that exists."""
    rows = _table_rows(_section(RESULTS.read_text(), "Running times"))
    makefile = (ROOT / "Makefile").read_text()
    assert len(rows) >= 2
    for row in rows:
        words = _last_cell_command(row).split()
        if "make" in words:
            target = words[words.index("make") + 1]
            assert re.search(rf"^{target}:", makefile, re.M), f"no make target {target}: {row}"
        else:
            tests = [w for w in words if w.startswith("tests/")]
            assert tests and all((ROOT / t).is_file() for t in tests), f"no test file: {row}"
    readme = [r for r in rows if r.lstrip().startswith("`make demo`")
              or r.lstrip().startswith("`make test`")]
    assert len(readme) == 2, "the results page times `make demo` and `make test`"


def test_backticked_commands_exist() -> None:
    """Every backticked ``rtrees ...`` in the README and the docs names an existing command,
    and every ``--option`` in it is an option of that command."""
    from cli.reference import root_command

    spans = [span for page, text in PAGES.items() if page != DOCS / "CLI.md"  # generated
             for span in re.findall(r"`(rtrees [^`]*)`", text)]
    assert len(spans) > 15
    for span in spans:
        command, words = root_command(), span.split()[1:]
        while getattr(command, "commands", None) and words and words[0] in command.commands:
            command, words = command.commands[words[0]], words[1:]
        assert not getattr(command, "commands", None) or not words, f"`{span}`: no such command"
        known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        for word in words:
            if word.startswith("--"):
                assert word.split("=")[0] in known, f"`{span}`: no option {word}"
