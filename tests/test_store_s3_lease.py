"""Issue 21, item 7: a writer stalled past its lease cannot commit a clash on S3.

Against a real S3-compatible server (moto's server mode on 127.0.0.1) and real writer
processes. Writer A stops itself with SIGSTOP right after the lease check of its
``trees`` commit (the last check before its commit point) and stays stopped for longer
than the lease. Writer B breaks the expired lease, takes the lock and commits the same
trees. A gets SIGCONT and goes on with its commit: on main it committed the trees a
second time (issue 21: 3 rounds out of 3). Now its commit is refused before it becomes
visible (``Store._commit_table`` commits at exactly the version its checks read), and
``store validate`` finds every tree id once; a store with a tree stored twice is named
with the commit keys holding it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow.compute as pc
import pytest

pytest.importorskip("moto", reason="needs the s3 extra: pip install -e '.[s3]'")
pytest.importorskip("boto3", reason="needs the s3 extra: pip install -e '.[s3]'")

from typer.testing import CliRunner

from cli.main import app
from rollout_store import Store, read_arrow
from rollout_store.maintenance import verify
from rollout_store.moto_server import (
    create_bucket_when_up,
    free_port,
    start_moto_server,
    stop_process,
)
from rollout_store.synthetic import bel_shaped_batch

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "rtrees-lease"
LEASE_S = 2.0  # short, so B breaks A's lease within seconds

# A writer: appends 3 BEL-shaped trees ``same-*`` under key argv[2]. With argv[3] == "stall"
# it stops itself (SIGSTOP) right after the lease check before its ``trees`` commit, the
# moment issue 21 found; the parent resumes it with SIGCONT. It prints what happened.
_WRITER = """
import os, signal, sys
from rollout_store import objectstore
from rollout_store.store import Store
from rollout_store.synthetic import bel_shaped_batch

uri, key, mode = sys.argv[1], sys.argv[2], sys.argv[3]
state = {"trees": False, "stalled": False}
real_check, real_commit = objectstore.LeaseLock.check, Store._commit_table

def commit_table(self, name, *args, **kwargs):
    state["trees"] = name == "trees"
    return real_commit(self, name, *args, **kwargs)

def check(self):
    real_check(self)
    if mode == "stall" and state["trees"] and not state["stalled"]:
        state["stalled"] = True
        os.kill(os.getpid(), signal.SIGSTOP)  # stalled right after the last lease check

Store._commit_table = commit_table
objectstore.LeaseLock.check = check
store = Store(uri)
batch = bel_shaped_batch(3, rollouts=4, depth=4, seed=7, tree_prefix="same",
                         snapshot_bytes=32)
try:
    report = store.append_trees(batch, key=key)
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
    sys.exit(3)
print("ALREADY" if report.already_committed else "COMMITTED", flush=True)
"""


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """moto's S3 server on 127.0.0.1 with a bucket, and the environment pointing at it."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")  # noqa: SIM115
    proc = start_moto_server(port, log)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "ROLLOUT_STORE_LOCK_LEASE_S": str(LEASE_S)}
    saved = {k: os.environ.get(k) for k in [*env, "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"]}
    os.environ.update(env)
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        os.environ.pop(k, None)
    try:
        create_bucket_when_up(env["AWS_ENDPOINT_URL"], BUCKET, proc)
        yield env
    finally:
        stop_process(proc)
        log.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _writer(uri: str, key: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _WRITER, uri, key, mode], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_stopped(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> None:
    """Block until ``proc`` has stopped itself (WUNTRACED), bounded by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid and os.WIFSTOPPED(status):
            return
        assert pid == 0, f"writer exited instead of stalling: status {status}"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("writer never reached its trees commit")


def _stall_round(uri: str, key_a: str, key_b: str) -> tuple[str, str]:
    """A stalls after its last lease check; B commits the same trees; A resumes. Returns
    both writers' last output lines (and checks B's lease wait really outlived A's)."""
    a = _writer(uri, key_a, "stall")
    try:
        _wait_stopped(a)
        stopped_at = time.monotonic()
        b = _writer(uri, key_b, "plain")
        out_b, err_b = b.communicate(timeout=120)
        assert b.returncode == 0, err_b[-2000:]
        assert time.monotonic() - stopped_at > LEASE_S  # A stayed stopped past its lease
    finally:
        a.send_signal(signal.SIGCONT)
    out_a, err_a = a.communicate(timeout=120)
    assert "Traceback" not in err_a, err_a[-2000:]
    return out_a.strip().splitlines()[-1], out_b.strip().splitlines()[-1]


@pytest.mark.parametrize(("key_a", "key_b"), [
    ("run-a:0", "run-b:0"),  # other keys, same trees (two collectors given the same tasks)
    ("run:0", "run:0"),  # the same key: a retry started while the first attempt hung
])
def test_a_writer_stalled_past_its_lease_cannot_commit_the_same_trees(
        s3_env: dict[str, str], key_a: str, key_b: str) -> None:
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}/store"
    Store(uri, create=True)
    line_a, line_b = _stall_round(uri, key_a, key_b)
    assert line_b == "COMMITTED"
    if key_a == key_b:
        assert line_a == "ALREADY" or line_a.startswith("REFUSED LockLostError"), line_a
    else:  # on main: "COMMITTED", a second copy of every tree
        assert line_a.startswith("REFUSED"), line_a
        assert "duplicate_tree_id" in line_a or "LockLostError" in line_a, line_a
    store = Store(uri)
    trees = read_arrow(store, "trees")
    assert trees.num_rows == 3
    assert pc.count_distinct(trees.column("tree_id")).as_py() == 3
    assert set(trees.column("commit_key").to_pylist()) == {key_b}
    assert read_arrow(store, "nodes").num_rows == bel_shaped_batch(
        3, rollouts=4, depth=4, seed=7, tree_prefix="same").nodes.num_rows
    report = verify(store)
    assert report.ok, report.problems
    result = CliRunner().invoke(app, ["store", "validate", "--store", uri])
    assert result.exit_code == 0, result.output


def test_validate_names_a_tree_stored_twice_on_s3_and_locally(
        s3_env: dict[str, str], tmp_path: Path) -> None:
    """A store that already holds a tree twice (written by main's race): validate names the
    tree id and the commit keys holding it, on S3 and in a local directory."""
    batch = bel_shaped_batch(2, rollouts=3, depth=3, seed=4, tree_prefix="dup")
    for path in (f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}/store", str(tmp_path / "local")):
        store = Store(path, create=True)
        store.append_trees(batch, key="first")
        # What the stalled writer left on main: the same trees under a second key.
        store._refuse_stored_trees = lambda ids: None  # type: ignore[method-assign,assignment]
        store.append_trees(batch, key="second")
        result = CliRunner().invoke(app, ["store", "validate", "--store", path])
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        assert "stored more than once: 'dup-4-0000000' x2 (commit keys 'first', 'second')" \
            in result.output, result.output
