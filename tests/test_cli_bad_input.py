"""Every command with bad values of each option: one line on stderr, a non-zero exit,
no traceback, and the store untouched (issue 13 item 11; issue 13 item 4 for ``sql``).

The app is called as the console script calls it (``app(args)``), so the top-level
handler of ``cli._common.RtreesApp`` is part of what is tested; a few cases also run
as real processes.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_process import assert_one_line, rtrees

from cli._common import one_line_error
from cli.main import app
from rollout_store import Store, StoreError, connect
from rollout_store.maintenance import verify
from rollout_store.synthetic import bel_shaped_batch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = Store(tmp_path_factory.mktemp("cli") / "store", create=True)
    store.append_trees(bel_shaped_batch(3, rollouts=3, depth=3, snapshot_bytes=8), key="k")
    return store.path


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        app(args)
    out = capsys.readouterr()
    code = info.value.code
    return (code if isinstance(code, int) else 1), out.out, out.err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") or lines[0].startswith("problem:"), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, err)


def _cases(store: str, regular_file: str) -> list[tuple[list[str], str]]:
    s = ["--store", store]
    collect = ["collect", "--store", store + "-new", "--env", "calc", "--policy", "tabular",
               "--sampler", "group", "--no-progress"]
    return [
        # store info / validate / compact
        (["store", "info", "--store", "/nonexistent/store"], "no such store"),
        (["store", "info", "--store", regular_file], "not a directory"),
        (["store", "validate", "--store", regular_file], "not a directory"),
        (["store", "compact", *s, "--target-size", "-1"], "--target-size"),
        (["store", "compact", *s, "--target-size", "0"], "--target-size"),
        (["store", "compact", *s, "--retention-hours", "-5"], "--retention-hours"),
        (["store", "compact", *s, "--target-size", "lots"], "--target-size"),
        # sql
        (["sql", "select 'x'::INT", *s], "Could not convert"),
        (["sql", "select nope from trees", *s], "nope"),
        (["sql", "select 1", *s, "--version", "99"], "no trees version 99"),
        (["sql", "select 1", *s, "--version", "-1"], "no trees version -1"),
        (["sql", "select 1", *s, "--format", "xml"], "--format"),
        (["sql", "select 1; select 2", *s], "exactly one"),
        (["sql", "", *s], "exactly one"),
        (["sql", "select 1", "--store", regular_file], "not a directory"),
        # import
        (["import", "/nonexistent.jsonl", "--store", regular_file, "--format", "verl-jsonl"],
         "not a directory"),
        (["import", "/nonexistent.jsonl", *s, "--format", "verl-jsonl"], "nonexistent"),
        (["import", "/nonexistent.jsonl", *s, "--format", "csv"], "--format"),
        # credit
        (["credit", *s, "--method", "nope"], "nope"),
        (["credit", *s, "--method", "grpo", "--param", "novalue"], "expected KEY=VALUE"),
        (["credit", *s, "--method", "grpo", "--param", "=1"], "expected KEY=VALUE"),
        (["credit", "--store", "/nonexistent/store", "--method", "grpo"], "no such store"),
        # collect
        ([*collect, "--tasks", "0"], "--tasks"),
        ([*collect, "--tasks", "-3"], "--tasks"),
        ([*collect, "--n-total", "0"], "--n-total"),
        ([*collect, "--workers", "0"], "--workers"),
        ([*collect, "--commit-trees", "-1"], "--commit-trees"),
        ([*collect, "--param", "b_max"], "expected KEY=VALUE"),
        ([*collect, "--tasks", "two"], "--tasks"),
        (["collect", "--store", regular_file, "--env", "calc", "--policy", "tabular",
          "--sampler", "group", "--tasks", "1", "--no-progress"], "not a directory"),
        (["collect", "--store", store + "-env", "--env", "nope", "--policy", "tabular",
          "--sampler", "group", "--no-progress"], "unknown environment"),
        (["collect", "--store", store + "-s", "--env", "calc", "--policy", "tabular",
          "--sampler", "nope", "--tasks", "1", "--no-progress"], "nope"),
        (["collect", "--store", store + "-p", "--env", "calc", "--policy", "hf:/nonexistent",
          "--sampler", "group", "--tasks", "1", "--no-progress"], "/nonexistent"),
        # env
        (["env", "play", "--env", "nope"], "unknown environment"),
        (["env", "play", "--env", "calc", "--mix", "x"], "expected KEY=VALUE"),
        (["env", "play", "--env", "calc", "--snapshot-in", "/nonexistent"], "/nonexistent"),
        (["env", "play", "--env", "calc", "--seed", "x"], "--seed"),
        # policy
        (["policy", "init", "--env", "nope"], "nope"),
        (["policy", "init", "--env", "calc", "--minutes", "-1"], "--minutes"),
        (["policy", "info", "--policy", "hf:/nonexistent"], "/nonexistent"),
        # audit, train, study
        (["audit", "ranking", *s, "--methods", "nope", "--out", store + "-o", "--no-collect"],
         "nope"),
        (["audit", "ranking", "--store", regular_file, "--methods", "grpo", "--out",
          store + "-o"], "not a directory"),
        (["audit", "drift", "--out", "/proc/nope", "--tasks", "1"], "/proc/nope"),
        (["audit", "drift", "--out", store + "-d", "--tasks", "0"], "tasks"),
        (["audit", "report", "--store", "/nonexistent/store", "--out", store + "-r"],
         "no such store"),
        (["train", "--env", "calc", "--steps", "0", *s, "--out", store + "-t"], "steps"),
        (["train", "--env", "nope", "--steps", "1", *s, "--out", store + "-t"], "nope"),
        (["train", "--config", "/nonexistent.toml"], "/nonexistent.toml"),
        (["train", "--set", "nofield=1", "--out", store + "-t"], "nofield"),
        (["train", "--set", "novalue", "--out", store + "-t"], "expected KEY=VALUE"),
        (["study", "nope"], "unknown study"),
        (["study", "table1"], "--out is required"),
        # unknown command / option
        (["nope"], "nope"),
        (["store", "info", *s, "--bogus"], "--bogus"),
    ]


def test_every_bad_value_is_one_line_and_non_zero(filled: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    regular = tmp_path / "a-file"
    regular.write_text("not a store")
    failures = []
    for args, needle in _cases(str(filled), str(regular)):
        code, _, err = run(args, capsys)
        try:
            assert_one_line_error(code, err, needle)
        except AssertionError:
            failures.append(f"{' '.join(args)} -> exit {code}: {err.strip()[:300]!r}")
    assert not failures, "\n".join(failures)
    assert regular.read_text() == "not a store"
    assert verify(Store(filled)).ok


def test_sql_cannot_write_the_store_or_read_the_host(filled: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = connect(Store(filled)).sql("SELECT count(*) FROM nodes").fetchall()
    data_file = Store(filled).files("nodes")[0].path
    log = filled / "trees" / "_delta_log" / "00000000000000000001.json"
    attacks = [
        f"COPY (SELECT 1) TO '{log}'",
        f"COPY nodes TO '{data_file}' (FORMAT parquet)",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM read_csv('/etc/hostname')",
        "SELECT * FROM glob('/etc/*')",
        "SET enable_external_access = true",
        f"ATTACH '{filled}/x.duckdb'",
        "SELECT * FROM query('COPY nodes TO ''/tmp/rtrees-leak.csv''')",
        "INSTALL httpfs",
    ]
    for q in attacks:
        code, out, err = run(["sql", q, "--store", str(filled)], capsys)
        assert_one_line_error(code, err)
        assert "root:" not in out
    assert connect(Store(filled)).sql("SELECT count(*) FROM nodes").fetchall() == before
    assert verify(Store(filled)).ok
    assert not Path("/tmp/rtrees-leak.csv").exists()
    # What must still work: reading the store, including its own files.
    code, out, _ = run(["sql", "SELECT count(*) AS n FROM trees", "--store", str(filled),
                        "--format", "json"], capsys)
    assert code == 0 and json.loads(out) == [{"n": 3}]


def test_sql_csv_encodes_list_columns_as_json(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(tmp_path / "s", create=True)
    store.append_trees(bel_shaped_batch(1, rollouts=2, depth=2), key="k")
    code, out, err = run(["sql", "SELECT node_id, action_token_ids, reward_parts, segments "
                                 "FROM nodes WHERE len(action_token_ids) > 0 LIMIT 1", "--store",
                          str(store.path), "--format", "csv"], capsys)
    assert code == 0, err
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["node_id", "action_token_ids", "reward_parts", "segments"]
    tokens = json.loads(rows[1][1])
    assert isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)
    assert rows[1][2] == "" or isinstance(json.loads(rows[1][2]), list)  # "" is NULL


def test_unexpected_errors_are_one_line_with_a_debug_hint() -> None:
    """A bug is not dressed up as bad input: its type is named, with the debug hint."""
    line = one_line_error(KeyError("tree_id"))
    assert line.startswith("KeyError: 'tree_id'") and "RTREES_DEBUG=1" in line
    assert one_line_error(StoreError("a\nb")) == "a | b"


def test_errors_as_real_processes(tmp_path: Path) -> None:
    """The console-script path: one line on stderr, exit 1."""
    regular = tmp_path / "file"
    regular.write_text("x")
    cmd = [sys.executable, "-m", "cli.main", "store", "info", "--store", str(regular)]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "not a directory" in result.stderr
    cmd = [sys.executable, "-m", "cli.main", "collect", "--store", str(tmp_path / "s"),
           "--env", "calc", "--policy", "tabular", "--sampler", "group", "--tasks", "0"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.startswith("error: --tasks")


# ---- disk full, read-only --out (issue 21 item 10) -------------------------------
def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here ({proc.stderr.strip() or proc.returncode}): needs "
                    "root with CAP_SYS_ADMIN for a tmpfs or a read-only bind mount")


@contextlib.contextmanager
def mounted(target: Path, *args: str) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    _mount(*args, str(target))
    try:
        yield target
    finally:  # a file a failed library write left open keeps it busy: detach it then
        if subprocess.run(["umount", str(target)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(target)], check=False)


@contextlib.contextmanager
def full_tmpfs(target: Path, size: str = "64k") -> Iterator[Path]:
    with mounted(target, "-t", "tmpfs", "-o", f"size={size}", "tmpfs"):
        with contextlib.suppress(OSError), open(target / "filler", "wb") as fh:
            while True:  # fill it to the last block
                fh.write(b"\0" * 4096)
                fh.flush()
        yield target


@pytest.fixture
def small_store(tmp_path: Path) -> Path:
    Store(tmp_path / "store", create=True).append_trees(bel_shaped_batch(2, seed=1), key="a")
    return tmp_path / "store"


def test_read_only_out_names_the_path(tmp_path: Path, small_store: Path) -> None:
    (tmp_path / "src").mkdir()
    with mounted(tmp_path / "ro", "-o", "bind,ro", str(tmp_path / "src")) as ro:
        proc = rtrees("audit", "report", "--store", str(small_store), "--out", str(ro / "rep"))
        # main: "error: OSError: [Errno 30] Read-only file system: '...' (unexpected: ...)"
        line = assert_one_line(proc, f"cannot write {ro / 'rep'}: read-only file system")
        assert "unexpected" not in line and "OSError" not in line


def test_full_disk_names_the_out_directory(tmp_path: Path, small_store: Path) -> None:
    with full_tmpfs(tmp_path / "full") as full:
        proc = rtrees("audit", "report", "--store", str(small_store), "--out",
                      str(full / "rep"))
        # main: "error: OSError: [Errno 28] No space left on device (unexpected: ...)"
        line = assert_one_line(proc, f"cannot write under --out {full / 'rep'}: no space "
                               "left on the device")
        assert "unexpected" not in line


def test_library_write_failures_on_a_full_disk_name_the_out_directory(tmp_path: Path
                                                                      ) -> None:
    """torch and safetensors wrap ENOSPC in their own errors (torch's names no cause at
    all): the message still names --out and the reason."""
    import torch
    from safetensors.torch import save_file

    tensors = {"w": torch.zeros(100_000)}
    with full_tmpfs(tmp_path / "full") as full:
        for write in (lambda: torch.save(tensors, full / "x.pt"),
                      lambda: save_file(tensors, str(full / "x.safetensors"))):
            with pytest.raises(Exception) as info:
                write()
            text = one_line_error(info.value, str(full))
            assert text.startswith(f"cannot write under --out {full}: no space left on the "
                                   "device"), text


@pytest.mark.slow
def test_training_into_a_disk_that_fills_names_the_out_directory(tmp_path: Path) -> None:
    """``rtrees train`` whose first checkpoint does not fit: one line naming --out (main: a
    raw RuntimeError/SafetensorError text)."""
    with mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as small:
        proc = rtrees("train", "--out", str(small / "run"), "--store", str(tmp_path / "st"),
                      "--steps", "1", "--set", "heldout_tasks=0", "--set", "tasks_per_step=2",
                      "--set", "n_total=2", "--set", "minibatches=2", timeout=300)
        assert_one_line(proc, f"cannot write under --out {small / 'run'}: no space left")
