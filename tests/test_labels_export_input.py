"""``rtrees label`` and ``rtrees export`` under hostile input (issue 50, item 6).

* Label keys, values and authors holding control characters (newline, NUL, ESC, DEL, a C1
  CSI, a line separator, bidi overrides), over-long ones, and a ``--node`` past int64 are
  refused in one line naming the field or option, and the ``labels`` table is unchanged
  (no new Delta version, no file).
* ``rtrees export --out`` that is the store, inside it (a table's ``_delta_log``
  included), reached through ``..``, a relative path or a symbolic link, or whose
  ``data`` folder is a link into the store, is refused in one line; nothing is written
  into the store or at ``--out``.
* A stored tree id holding a terminal escape is printed escaped by ``rtrees label``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import viewer_store  # tests/viewer_store.py
from typer.testing import CliRunner

from rollout_store import Store, read_arrow
from rollout_store.exporters import export_paths
from rollout_store.labels import MAX_AUTHOR, MAX_KEY, MAX_VALUE, label_rows
from rollout_store.tree import Node, Tree

EVIL = "evil\x1b]0;pwned\x07\x1b[2J"  # a tree id: retitles and clears a terminal


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    s = viewer_store.build(tmp_path_factory.mktemp("hostile") / "store")
    s.append_trees([Tree(EVIL, [
        Node(0, None, "prompt", observation_text="p", observation_token_ids=[1]),
        Node(1, 0, "decision", action_text="a", action_token_ids=[2], action_logprobs=[-0.1],
             action_entropies=[0.1], terminal=True, reward=1.0)])], key="evil")
    return s


def _dir(s: Store) -> Path:
    """A local store's directory."""
    assert isinstance(s.path, Path)
    return s.path


def _listing(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``path`` (links not followed): (size, mtime_ns)."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns)
    return out


def _cli(*args: str) -> tuple[int, str]:
    from cli.main import app

    res = CliRunner().invoke(app, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res.exit_code, res.output


HOSTILE_LABELS = [  # (extra arguments, text the one-line error holds)
    (["--set", "a\nb=v"], "label key 'a\\nb': holds the control character U+000A"),
    (["--set", "a\x00b=v"], "U+0000"),
    (["--set", "\x1b[31mred=v"], "label key '\\x1b[31mred'"),
    (["--set", "a\x7fb=v"], "U+007F"),
    (["--set", "a\x9bb=v"], "U+009B"),  # a one-byte CSI
    (["--set", "a\u2066b=v"], "U+2066"),  # bidi isolate
    (["--set", "a\u200bb=v"], "U+200B"),  # zero-width space: a format character in a key
    (["--set", "k=\x1b]0;pwned\x07"], "label 'k': value"),
    (["--set", "k=line1\nline2"], "U+000A"),
    (["--set", "k=x\u2028y"], "U+2028"),  # line separator
    (["--set", "k=abc\u202edef"], "U+202E"),  # right-to-left override
    (["--set", "k" * (MAX_KEY + 1) + "=v"], f"1 to {MAX_KEY} characters, got 101"),
    (["--set", "k=" + "v" * (MAX_VALUE + 1)], "value longer than 10,000 characters"),
    (["--clear", "\x1b[2J"], "label key '\\x1b[2J'"),
    (["--set", "k=v", "--author", "me\x1b[2J"], "label author"),
    (["--set", "k=v", "--author", "m" * (MAX_AUTHOR + 1)], "label author"),
    (["--set", "k=v", "--node", str(2**63)], "--node 9223372036854775808: a node id"),
    (["--set", "k=v", "--node", str(-2**63 - 1)], "--node -9223372036854775809"),
    (["--set", "k=v", "--node", "-1"], "--node -1: a node id is an integer in 0..2147483647"),
    (["--set", "k=v", "--node", str(2**31)], "--node 2147483648"),
]


@pytest.mark.parametrize(("args", "msg"), HOSTILE_LABELS,
                         ids=[f"case{i}" for i in range(len(HOSTILE_LABELS))])
def test_hostile_labels_are_refused_and_nothing_is_written(
        store: Store, args: list[str], msg: str) -> None:
    labels = _dir(store) / "labels"
    before, rows = _listing(labels), read_arrow(store, "labels").num_rows
    code, out = _cli("label", "--store", str(_dir(store)), "--tree", "bel-0", *args)
    assert code == 1 and out.count("\n") == 1 and out.startswith("error: "), out
    assert msg in out, out
    assert "\x1b" not in out and "\x00" not in out and "\u202e" not in out, out
    assert _listing(labels) == before  # no new version, no data file
    assert read_arrow(store, "labels").num_rows == rows


def test_label_rows_checks_every_field() -> None:
    with pytest.raises(ValueError, match="label key 'a\\\\tb'"):
        label_rows("t", None, {"a\tb": "v"}, "me")
    with pytest.raises(ValueError, match="U\\+202D"):
        label_rows("t", None, {"k": "\u202dx"}, "me")
    with pytest.raises(ValueError, match="U\\+DCFF"):  # a lone surrogate: not UTF-8
        label_rows("t", None, {"k": "x\udcff"}, "me")
    with pytest.raises(ValueError, match="node id 9223372036854775808: not in"):
        label_rows("t", 2**63, {"k": "v"}, "me")
    with pytest.raises(ValueError, match="label author"):
        label_rows("t", None, {"k": "v"}, "a\nb")
    # what stays allowed: accents, CJK, emoji with a zero-width joiner in a value, spaces
    table = label_rows("t", 3, {"verdict": "très bien 好 👩\u200d💻 ok", "n": None}, "José")
    assert table.column("value").to_pylist() == ["très bien 好 👩\u200d💻 ok", None]
    assert label_rows("t", None, {"k" * MAX_KEY: "v" * MAX_VALUE}, "a").num_rows == 1


def test_a_stored_tree_id_is_printed_escaped(store: Store) -> None:
    code, out = _cli("label", "--store", str(_dir(store)), "--tree", EVIL, "--set", "k=v")
    assert code == 0, out
    assert "\x1b" not in out and "\x07" not in out, out
    assert "tree evil\\x1b]0;pwned\\x07\\x1b[2J: 1 label rows written" in out, out


def test_export_refuses_an_out_in_the_store(store: Store, tmp_path: Path) -> None:
    root = _dir(store)
    link = tmp_path / "link-into-store"
    os.symlink(root / "trees", link)
    decoy = tmp_path / "decoy"  # --out outside, but its data/ folder a link into the store
    decoy.mkdir()
    os.symlink(root / "nodes", decoy / "data")
    outs: dict[str, tuple[str, str]] = {
            "the store": (str(root), "hf"), "inside": (str(root / "exp"), "adp"),
            "a _delta_log": (str(root / "trees" / "_delta_log"), "atif"),
            "through ..": (str(tmp_path / "nowhere" / ".." / ".." / root.parent.name
                               / root.name / "x"), "adp"),
            "relative": (os.path.relpath(root / "rel"), "adp"),
            "a link": (str(link / "y"), "adp"),
            "data/ a link": (str(decoy), "hf")}
    before = _listing(root)
    for name, (out, fmt) in outs.items():
        code, text = _cli("export", "--store", str(root), "--format", fmt, "--out", out)
        assert code == 1 and text.count("\n") == 1, (name, text)
        assert f"in the store {root.resolve()}" in text, (name, text)
        with pytest.raises(ValueError, match="export to a directory outside the store"):
            export_paths(store, fmt, out)
    assert _listing(root) == before  # nothing written into the store
    assert not (root / "exp").exists() and not (root / "x").exists()
    assert sorted(p.name for p in decoy.iterdir()) == ["data"]  # no metadata.json either
    report = export_paths(store, "adp", tmp_path / "fine")  # outside: still exports
    assert report.paths > 0 and (tmp_path / "fine" / "metadata.json").is_file()
