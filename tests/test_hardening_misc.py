"""Issue 21, item 10: the smaller rough edges, each refused with a one-line named error.

* ``rtrees audit report --study DIR`` of a study that was not built exits non-zero;
* ``rtrees import`` refuses wrong column and field types (a TRL integer ``prompt`` was
  summed into the reward, verl ``output`` lists and integer inputs were stored as text),
  JSON nested too deeply and lone surrogates, naming the file, line and field;
* ``rtrees env play --snapshot-in`` reads a regular file of bounded size only
  (``/dev/zero`` was read without bound, a FIFO blocked);
* resuming a finished training run prints its stored result (it printed ``nan``);
* a full disk and a read-only ``--out`` read ``cannot write PATH: REASON``.

Everything runs for real: real stores, real Parquet/JSONL files, the ``rtrees`` command in
a subprocess, a read-only bind mount and a full tmpfs (root only: skipped with the reason
where mounting is not allowed).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli._common import one_line_error
from cli.main import app
from rollout_store import Store, connect
from rollout_store.importers import MAX_NESTING, DumpImportError, import_files
from rollout_store.synthetic import bel_shaped_batch

ROOT = Path(__file__).resolve().parents[1]
GOOD_VERL = {"input": "What is 2+2?", "output": "4", "score": 1.0, "step": 1}
GOOD_TRL = {"step": [1, 1], "prompt": ["2+2?", "2+2?"], "completion": ["4", "5"],
            "accuracy": [1.0, 0.0]}


def rtrees(*args: str, timeout: float = 120, limit_as: int | None = None
           ) -> subprocess.CompletedProcess[str]:
    """The real command line (``python -m cli.main``), optionally under an address-space
    limit so that an unbounded read fails fast instead of eating the machine's memory."""
    def limit() -> None:
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, preexec_fn=limit,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def assert_one_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def counts(store: Store) -> tuple[int, int]:
    con = connect(store)
    trees = con.execute("SELECT count(*) FROM trees").fetchone()
    nodes = con.execute("SELECT count(*) FROM nodes").fetchone()
    assert trees is not None and nodes is not None
    return int(trees[0]), int(nodes[0])


# ------------------------------------------------------------------ audit report exit code
def test_audit_report_fails_when_a_requested_study_was_not_built(tmp_path: Path) -> None:
    study = tmp_path / "drift-study"
    study.mkdir()  # never run: no study.json
    result = CliRunner().invoke(app, ["audit", "report", "--study", str(study),
                                      "--out", str(tmp_path / "reports")])
    assert result.exit_code == 1, result.output  # main: 0, with a "not built" note
    assert f"error: requested study {study} was not built" in result.output
    assert "holds no study.json" in result.output
    # The store's own audits with nothing to report are notes, as before: exit 0.
    store = Store(tmp_path / "store", create=True)
    store.append_trees(bel_shaped_batch(2, seed=1), key="a")
    result = CliRunner().invoke(app, ["audit", "report", "--store", str(tmp_path / "store"),
                                      "--out", str(tmp_path / "reports2")])
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------------------ imports
def _parquet(path: Path, cols: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)
    return path


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_trl_integer_prompt_is_refused_not_summed_into_the_reward(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", create=True)
    path = _parquet(tmp_path / "run" / "completions" / "completions_00001.parquet",
                    {**GOOD_TRL, "prompt": [1, 1], "accuracy": [3.0, 0.0]})
    with pytest.raises(DumpImportError, match=r"column 'prompt' is int64: expected text"):
        import_files(store, [path], "trl-parquet")  # main: stored reward 1 + 3 = 4
    assert counts(store) == (0, 0)
    path = _parquet(tmp_path / "run" / "completions" / "completions_00002.parquet",
                    {**GOOD_TRL, "completion": [1.5, 2.5]})
    with pytest.raises(DumpImportError, match=r"column 'completion' is double"):
        import_files(store, [path], "trl-parquet")
    # Explicitly naming a text column as a reward column is refused too.
    good = _parquet(tmp_path / "run" / "completions" / "completions_00003.parquet", GOOD_TRL)
    with pytest.raises(DumpImportError, match=r"reward column 'prompt' is string"):
        import_files(store, [good], "trl-parquet", reward_columns=["prompt"])
    assert counts(store) == (0, 0)
    # Chat messages (TRL's conversational format) are still accepted.
    chat = _parquet(tmp_path / "chat" / "completions_00001.parquet", {
        **GOOD_TRL, "prompt": [[{"role": "user", "content": "2+2?"}]] * 2})
    assert import_files(store, [chat], "trl-parquet")[0].n_trees == 1
    rewards = connect(store).execute(
        "SELECT reward FROM nodes WHERE reward IS NOT NULL ORDER BY reward").fetchall()
    assert rewards == [(0.0,), (1.0,)]


@pytest.mark.parametrize(("row", "message"), [
    ({**GOOD_VERL, "output": ["4", "5"]}, "output must be text (a string), got list"),
    ({**GOOD_VERL, "output": 4}, "output must be text (a string), got int 4"),
    ({**GOOD_VERL, "input": 7}, "input must be text (a string) or chat messages"),
    ({**GOOD_VERL, "input": {"q": "2+2"}}, "input must be text (a string) or chat messages"),
])
def test_verl_wrong_field_types_are_refused(tmp_path: Path, row: dict[str, Any],
                                            message: str) -> None:
    store = Store(tmp_path / "store", create=True)
    path = _jsonl(tmp_path / "run" / "1.jsonl", [json.dumps(GOOD_VERL), json.dumps(row)])
    with pytest.raises(DumpImportError) as info:
        import_files(store, [path], "verl-jsonl")  # main: stored as the value's JSON text
    assert str(info.value).startswith(f"{path}: line 2: {message}"), str(info.value)
    assert counts(store) == (0, 0)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("line", "message"), [
    (json.dumps(GOOD_VERL)[:-1] + ', "extra": ' + _deep(20000) + "}",
     "JSON nested too deeply to read"),
    (json.dumps(GOOD_VERL)[:-1] + ', "extra": ' + _deep(900) + "}",
     f"extra is nested more than {MAX_NESTING} levels deep"),
    (json.dumps({**GOOD_VERL, "output": "\ud800"}),
     "output holds a lone surrogate U+D800"),
    (json.dumps({**GOOD_VERL, "notes": {"k": ["\udfff"]}}),
     "notes holds a lone surrogate U+DFFF"),
    (json.dumps({**GOOD_VERL, "\ud83d": 1.0}), "a field name holds a lone surrogate U+D83D"),
])
def test_deep_nesting_and_lone_surrogates_are_named_errors(tmp_path: Path, line: str,
                                                           message: str) -> None:
    """On main: a raw RecursionError, a raw UnicodeEncodeError inside a [column_type]
    error, or (a surrogate in an extra field) silently stored."""
    path = _jsonl(tmp_path / "run" / "3.jsonl", [line])
    proc = rtrees("import", str(path), "--format", "verl-jsonl", "--store",
                  str(tmp_path / "store"))
    assert_one_line(proc, f"{path}: line 1: {message}")
    if (tmp_path / "store").exists():
        assert counts(Store(tmp_path / "store")) == (0, 0)


def test_deep_json_in_options_and_snapshots_is_a_named_error(tmp_path: Path) -> None:
    proc = rtrees("env", "play", "--env", "calc", "--mix", f"difficulties={_deep(20000)}")
    assert_one_line(proc, "--mix difficulties=...: JSON nested too deeply")
    snap = tmp_path / "deep.snapshot"
    snap.write_text('{"format": "rtrees-env-snapshot/1", "env": "calc", "state": '
                    + _deep(20000) + "}")
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", str(snap))
    assert_one_line(proc, "malformed snapshot file: JSON nested too deeply")


# ------------------------------------------------------------------- env play snapshots
def test_snapshot_in_reads_only_a_bounded_regular_file(tmp_path: Path) -> None:
    # /dev/zero: main read it until memory ran out (here: under a 4 GiB address-space
    # limit, MemoryError); now it is refused before reading.
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", "/dev/zero",
                  timeout=60, limit_as=4 << 30)
    assert_one_line(proc, "/dev/zero is not a regular file")
    assert proc.returncode == 2
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # main blocked in open() until a writer came
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", str(fifo), timeout=60)
    assert_one_line(proc, f"{fifo} is not a regular file")
    big = tmp_path / "big.snapshot"
    with open(big, "wb") as fh:  # sparse: no disk used
        fh.truncate(100 << 20)
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", str(big), timeout=60)
    assert_one_line(proc, f"{big} is 104,857,600 bytes, larger than a snapshot file can be")
    # A real snapshot still round-trips.
    out = tmp_path / "ok.snapshot"
    proc = rtrees("env", "play", "--env", "calc", "--seed", "3", "--snapshot-out", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0])["restored"] is True


# --------------------------------------------------------------- resume of a finished run
def test_resuming_a_finished_run_prints_its_stored_result(tmp_path: Path) -> None:
    from train.config import load_config
    from train.trainer import read_metrics, train

    cfg = load_config(None, {"tasks_per_step": 2, "n_total": 2, "heldout_tasks": 2,
                             "eval_every": 1, "max_new_tokens": 24, "minibatches": 2,
                             "progress": False, "run_id": "fin", "steps": 1,
                             "store": str(tmp_path / "store"), "out": str(tmp_path / "run")})
    first = train(cfg)
    again = train(cfg, resume=True)
    stored = read_metrics(cfg.store, "fin")["heldout_sampled"][-1][1]
    assert first.summary().endswith(f"held-out success {stored:.3f} "
                                    f"(greedy {first.heldout[1]['heldout_greedy']:.3f})")
    text = again.summary()
    assert "nan" not in text  # main: "held-out success nan (greedy nan)"
    assert "already finished" in text and again.iterations == 1
    assert f"held-out success {stored:.3f}" in text
    assert again.heldout[1]["heldout_sampled"] == stored
    # A run without held-out evaluation says so instead of printing nan.
    off = cfg.replace(heldout_tasks=0, run_id="off", out=str(tmp_path / "run-off"))
    assert train(off).summary().endswith("held-out success not evaluated")


# ------------------------------------------------------------ disk full, read-only --out
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
