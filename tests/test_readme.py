"""The README stays true (examples run).

* Every fenced block whose info string is ``bash runnable`` is a runnable block. One
  test executes them in order with bash (``set -euo pipefail``, ``.venv/bin`` first on
  ``PATH``) in one temporary directory, so later blocks use the store earlier blocks made,
  and after each block checks that the store holds what its ``rtrees`` commands create:
  trees of the run after ``collect``, credit of the method after ``credit``, the run's
  metrics after ``train`` (and reused trees with ``--reuse``), the report after ``audit
  ranking`` / ``study``.
* The default tests run nothing: every ``rtrees`` command line of a runnable block, and of
  a ``bash checked`` block (shown, never run: paper-sized settings, paths of the reader's
  machine), must
  parse against the typer app (click's ``make_context``: the options exist, values
  convert, required ones are given) with known environments, samplers and estimators;
  every backticked repository path and every file of the architecture block exists; the
  README's command table lists exactly the app's top-level commands.
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
BLOCKS = runnable_blocks(README_TEXT)
CHECKED_BLOCKS = CHECKED.findall(README_TEXT)  # parsed, never run


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
        assert step in flat, f"no runnable README block runs rtrees {step}"
    assert any("--reuse" in argv for block in BLOCKS for argv in rtrees_commands(block)), \
        "no runnable README block trains with --reuse"


@pytest.mark.parametrize("argv", [argv for block in BLOCKS + CHECKED_BLOCKS
                                  for argv in rtrees_commands(block)],
                         ids=lambda argv: " ".join(argv[1:3]))
def test_readme_commands_parse(argv: list[str]) -> None:
    """Each ``rtrees`` line of a runnable or checked block is a valid command line (not run
    here)."""
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
    return bool(glob.glob(str(ROOT / rel.rstrip("/"))))


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
    assert match, "README.md has no '## Architecture as built' section with a code block"
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
    paths = readme_paths(README_TEXT)
    assert len(paths) > 20  # the parser found the paths
    missing = [p for p in paths if not _exists(p)]
    assert missing == [], f"README.md names paths that do not exist: {missing}"


def test_architecture_files_exist() -> None:
    files = architecture_files(README_TEXT)
    assert "rollout_store/schema.py" in files and "train/trainer.py" in files
    missing = [f for f in files if not _exists(f)]
    assert missing == [], f"the architecture section names files that do not exist: {missing}"


def test_command_table_lists_the_apps_commands() -> None:
    """The README's command table has one row per top-level ``rtrees`` command."""
    from cli.reference import top_level_commands

    section = re.search(r"## Command line\n(.*?)\n## ", README_TEXT, re.S)
    assert section, "README.md has no '## Command line' section"
    listed = re.findall(r"^\| `rtrees (\S+)[^`]*` \|", section.group(1), re.M)
    app = [name for name, _ in top_level_commands()]
    assert sorted(listed) == app, (
        f"README.md's command table lists {sorted(set(listed) - set(app))} that the app "
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


# In the default run (~40 s on 2 quiet cores), so CI keeps the tour true.
def test_the_tour_runs(tmp_path: Path) -> None:
    """Every runnable block, in order, in one directory; each leaves what it creates."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{ROOT / '.venv' / 'bin'}" \
                  f"{os.pathsep}{env.get('PATH', '')}"
    env["RTREES_DEBUG"] = "1"  # a failure shows its traceback
    assert BLOCKS, "README.md has no runnable block"
    for i, block in enumerate(BLOCKS):
        res = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, (f"runnable block {i} failed ({res.returncode}):\n{block}"
                                     f"\n--- stdout\n{res.stdout[-3000:]}"
                                     f"\n--- stderr\n{res.stderr[-3000:]}")
        for argv in rtrees_commands(block):
            check_effects(tmp_path, parse(argv))


def test_every_benchmark_row_names_its_command() -> None:
    """Each row of the README's benchmark table ends with the command that reproduces it: a
    script under ``benchmarks/`` that exists and declares every option the command gives."""
    section = re.search(r"## Benchmarks\n(.*?)(\n## |\Z)", README_TEXT, re.S)
    assert section, "README.md has no '## Benchmarks' section"
    rows = [r for r in re.findall(r"^\|(.*)\|$", section.group(1), re.M)
            if not set(r) <= {"-", "|", " "}][1:]  # minus the header
    assert len(rows) >= 5
    for row in rows:
        command = re.fullmatch(r".*\| `([^`]+)` ", row)
        assert command, f"benchmark row without a command: {row}"
        words = command.group(1).split()
        scripts = [w for w in words if w.startswith("benchmarks/") and w.endswith(".py")]
        assert len(scripts) == 1 and (ROOT / scripts[0]).is_file(), f"no script: {row}"
        source = (ROOT / scripts[0]).read_text()
        for option in (w for w in words if w.startswith("--")):
            assert f'"{option}"' in source, f"{scripts[0]} declares no {option}"


def test_backticked_commands_exist() -> None:
    """Every backticked ``rtrees ...`` in the README names an existing command, and every
    ``--option`` in it is an option of that command."""
    from cli.reference import root_command

    spans = re.findall(r"`(rtrees [^`]*)`", README_TEXT)
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
