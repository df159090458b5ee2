"""``rtrees search`` under hostile input (issue 50, items 2 and 4).

* The token index stays inside its store: a ``.search-index`` that is a symbolic link (or
  a file), or a ``trees*-nodes*`` entry in it that is a link, is refused in one line and
  nothing it points at is deleted or read; a read-only store (``chmod 555``, even for
  root; a store another user cannot write, searched as ``nobody``) is searched without
  writing anything into it.
* A regex is at most 1,000 characters and a token run at most 1,000 ids; a regex search
  is stopped at its deadline (``--timeout``) with one line, the child process killed.
* Stored text in the hits (a tree id holding a terminal escape) is printed escaped.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from rollout_store import Store, StoreError
from rollout_store.search import (
    INDEX_DIR,
    MAX_PATTERN,
    MAX_TOKEN_IDS,
    load_index,
    search_regex,
    search_tokens,
)
from rollout_store.sqlguard import QueryLimitError
from rollout_store.tree import Node, Tree

ROOT = Path(__file__).resolve().parents[1]
EVIL = "evil\x1b[2J\nrow"  # a stored tree id with a terminal escape and a newline


def _tree(tid: str, text: str = "", nodes: int = 3) -> Tree:
    """A chain: prompt (obs tokens 1 2) -> node 1 (3 | 4) -> ... each decision's action
    text ``text`` (default ``act i``)."""
    out = [Node(0, None, "prompt", observation_text="obs 0", observation_token_ids=[1, 2])]
    for i in range(1, nodes):
        out.append(Node(i, i - 1, "decision", action_text=text or f"act {i}",
                        action_token_ids=[3], action_logprobs=[-0.1],
                        action_entropies=[0.1], observation_text=text or f"obs {i}",
                        observation_token_ids=[4], terminal=i == nodes - 1,
                        reward=1.0 if i == nodes - 1 else None))
    return Tree(tid, out)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "store", create=True)
    s.append_trees([_tree("a"), _tree("b")], key="one")
    return s


def _dir(s: Store) -> Path:
    """A local store's directory."""
    assert isinstance(s.path, Path)
    return s.path


def _listing(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``path`` (links not followed): (mode, size, mtime_ns)."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(path))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _cli(*args: str) -> tuple[int, str]:
    from cli.main import app

    res = CliRunner().invoke(app, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res.exit_code, res.output


# ------------------------------------------------------------------ the index stays home

def test_a_symlinked_index_folder_is_refused_and_nothing_outside_is_deleted(
        store: Store, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    for name in ("trees-nodes-x", "trees1-nodes1"):  # both matched the old cleanup glob
        (outside / name).mkdir(parents=True)
        (outside / name / "keep").write_text("mine")
    before = _listing(outside)
    os.symlink(outside, _dir(store) / INDEX_DIR)
    with pytest.raises(StoreError, match="search index is a symbolic link"):
        search_tokens(store, [3, 4])
    code, out = _cli("search", "--store", str(_dir(store)), "--tokens", "3,4")
    assert code == 1 and len(out.splitlines()) == 1 and "symbolic link" in out, out
    assert _listing(outside) == before  # nothing deleted, nothing written
    assert search_tokens(store, [3, 4], cache=False).total == 4  # --no-index still works
    code, out = _cli("search", "--store", str(_dir(store)), "--tokens", "3,4", "--no-index",
                     "--format", "json")
    assert code == 0 and json.loads(out)["total"] == 4, out
    assert _listing(outside) == before


def test_a_file_in_place_of_the_index_folder_is_refused(store: Store) -> None:
    (_dir(store) / INDEX_DIR).write_text("not an index")
    with pytest.raises(StoreError, match="search index is not a directory"):
        search_tokens(store, [3, 4])
    assert (_dir(store) / INDEX_DIR).read_text() == "not an index"


def test_a_symlinked_index_entry_is_refused(store: Store, tmp_path: Path) -> None:
    assert search_tokens(store, [3, 4]).total == 4  # builds the index
    root = _dir(store) / INDEX_DIR
    (built,) = root.iterdir()
    outside = tmp_path / "outside"
    shutil.copytree(built, outside / built.name)  # a valid index, but not the store's own
    shutil.rmtree(built)
    os.symlink(outside / built.name, built)  # the current version's entry: a link out
    os.symlink(outside, root / "trees0-nodes0")  # an old entry: a link out
    before = _listing(outside)
    with pytest.raises(StoreError, match="entry of the search index is a symbolic link"):
        search_tokens(store, [3, 4])
    assert _listing(outside) == before
    assert built.is_symlink() and (root / "trees0-nodes0").is_symlink()  # left as found


def test_stale_indexes_are_removed_but_only_inside_the_index(store: Store,
                                                            tmp_path: Path) -> None:
    root = _dir(store) / INDEX_DIR
    (root / "trees0-nodes0").mkdir(parents=True)  # a stale index of an older version
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    os.symlink(outside, root / "trees0-nodes0" / "link")  # a link inside a stale entry
    search_tokens(store, [3, 4])
    assert not (root / "trees0-nodes0").exists()  # removed, the link with it...
    assert (outside / "keep").read_text() == "mine"  # ...but not what it pointed at
    assert [p.name for p in root.iterdir()] == [
        f"trees{store.version()['trees']}-nodes{store.version()['nodes']}"]


# --------------------------------------------------------------- a read-only store

def test_a_chmod_555_store_is_searched_without_writing(store: Store) -> None:
    """Root writes through ``chmod 555``; the search honours the mode all the same."""
    before = _listing(_dir(store))
    os.chmod(_dir(store), 0o555)
    try:
        assert search_tokens(store, [3, 4]).total == 4
        index = load_index(store)
        assert sorted(index.node_ids.tolist()) == [0, 0, 1, 1, 2, 2]
        code, out = _cli("search", "--store", str(_dir(store)), "--tokens", "2,3",
                         "--format", "json")
        assert code == 0 and json.loads(out)["total"] == 2, out
    finally:
        os.chmod(_dir(store), 0o755)
    assert not (_dir(store) / INDEX_DIR).exists()
    assert _listing(_dir(store)) == before


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A temporary directory other users can enter (pytest's ``tmp_path`` is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="rtrees-ro-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0
                    or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run the search as nobody")
def test_a_store_the_user_cannot_write_is_searched_without_writing(
        store: Store, shared_dir: Path) -> None:
    """``rtrees search`` as uid 65534 (nobody) over a copy of the store owned by root: the
    copy's files are readable, not writable, by nobody; nothing in it changes."""
    copy = shared_dir / "store"
    shutil.copytree(_dir(store), copy)
    for dirpath, dirs, files in os.walk(copy):
        for name in dirs:
            os.chmod(Path(dirpath) / name, 0o755)
        for name in files:
            os.chmod(Path(dirpath) / name, 0o644)
    os.chmod(copy, 0o755)
    before = _listing(copy)

    def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOME": str(shared_dir), "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": str(ROOT)}
        return subprocess.run(
            ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
             sys.executable, "-c", "from cli.main import app; app()", "search", "--store",
             str(copy), "--format", "json", *args],
            capture_output=True, text=True, cwd=shared_dir, env=env, timeout=120,
            check=False)

    probe = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                            "--clear-groups", "touch", str(copy / "probe")],
                           capture_output=True, check=False)
    assert probe.returncode != 0  # nobody really cannot write the copy
    res = as_nobody("--tokens", "3,4")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["total"] == 4
    res = as_nobody("--tokens", "2,3")  # again: nothing was cached, nothing is read stale
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["total"] == 2
    assert _listing(copy) == before
    # (--regex writes nothing anywhere: DuckDB in memory, the index is the tokens'; its
    # child interpreter is not run here, as the venv's python may lie under root's 0700
    # home, which nobody cannot enter.)


# ------------------------------------------------------------------- bounds and deadline

def test_pattern_and_token_run_lengths_are_bounded(store: Store) -> None:
    assert search_regex(store, "x" * MAX_PATTERN).total == 0  # at the bound: runs
    with pytest.raises(ValueError, match="at most 1,000"):
        search_regex(store, "x" * (MAX_PATTERN + 1))
    t = time.monotonic()
    code, out = _cli("search", "--store", str(_dir(store)), "--regex", "a" * 30_000)
    assert code == 1 and out.count("\n") == 1, out
    assert "30,000 characters; at most 1,000" in out and "aaaa" not in out
    assert time.monotonic() - t < 5  # refused before any search
    assert search_tokens(store, [3] * MAX_TOKEN_IDS).total == 0
    with pytest.raises(ValueError, match="1,001 token ids: at most 1,000"):
        search_tokens(store, [3] * (MAX_TOKEN_IDS + 1))
    code, out = _cli("search", "--store", str(_dir(store)), "--tokens",
                     ",".join(["3"] * 200_000))
    assert code == 1 and "200,000 token ids: at most 1,000" in out, out
    # an id past int64 matches nothing (token ids are int32), it does not overflow
    code, out = _cli("search", "--store", str(_dir(store)), "--tokens", str(2**63),
                     "--format", "json")
    assert code == 0 and json.loads(out) == {"total": 0, "hits": []}, out
    code, out = _cli("search", "--store", str(_dir(store)), "--regex", "a", "--timeout", "0")
    assert code == 1 and "--timeout must be > 0" in out, out


@pytest.fixture(scope="module")
def big_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """About 1.2 MB of random text: a 12-character RE2 pattern takes tens of seconds."""
    rnd = random.Random(0)
    s = Store(tmp_path_factory.mktemp("big") / "store", create=True)
    trees = [_tree(f"t{k}", "".join(rnd.choices(string.ascii_lowercase + " ", k=2000)),
                   nodes=16) for k in range(20)]
    s.append_trees(trees, key="one")
    return s


def test_a_slow_regex_stops_at_its_deadline(big_store: Store) -> None:
    assert search_regex(big_store, "zq", timeout_s=120).total > 0  # the child works
    me = psutil.Process()
    t = time.monotonic()
    with pytest.raises(QueryLimitError, match=r"regex search exceeded 3 s"):
        search_regex(big_store, "(?:a|.){900}", timeout_s=3)
    assert time.monotonic() - t < 13
    assert me.children(recursive=True) == []  # the child was killed and reaped
    t = time.monotonic()
    code, out = _cli("search", "--store", str(_dir(big_store)), "--regex", "(?:a|.){900}",
                     "--timeout", "2")
    assert code == 1 and out.count("\n") == 1, out
    assert "regex search exceeded 2 s (the time limit; see --timeout)" in out
    assert time.monotonic() - t < 12


# --------------------------------------------------------------------- printed text

def test_stored_text_in_hits_is_printed_escaped(tmp_path: Path) -> None:
    s = Store(tmp_path / "store", create=True)
    s.append_trees([_tree(EVIL)], key="one")
    for fmt in ("table", "csv", "json"):
        code, out = _cli("search", "--store", str(_dir(s)), "--tokens", "3,4", "--format",
                         fmt)
        assert code == 0, out
        assert "\x1b" not in out and "2J\nrow" not in out, (fmt, out)
        assert ("\\u001b[2J\\nrow" if fmt == "json" else "evil\\x1b[2J\\nrow") in out, out
    code, out = _cli("search", "--store", str(_dir(s)), "--regex", "obs", "--format", "csv")
    assert code == 0 and "\x1b" not in out and "evil\\x1b[2J\\nrow" in out, out
