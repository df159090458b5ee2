"""The store on object storage (``s3://bucket/prefix``), against a real S3-compatible server.

A session fixture starts moto's server mode on 127.0.0.1 at a free port and creates a
bucket; every test writes under its own prefix. Needs the ``.[s3]`` extra (moto[server],
boto3). The same batches go into a local-directory store, and every reader must give the
same answer for both.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest

pytest.importorskip("moto", reason="needs the s3 extra: pip install -e '.[s3]'")
boto3 = pytest.importorskip("boto3", reason="needs the s3 extra: pip install -e '.[s3]'")

from typer.testing import CliRunner  # noqa: E402

from cli.main import app  # noqa: E402
from rollout_store import Store, connect, read_arrow, read_polars, read_trees  # noqa: E402
from rollout_store.maintenance import compact, info, verify  # noqa: E402
from rollout_store.moto_server import (  # noqa: E402
    create_bucket_when_up,
    free_port,
    start_moto_server,
    stop_process,
)
from rollout_store.objectstore import (  # noqa: E402
    LeaseLock,
    LockLostError,
    ObjectStoreError,
)
from rollout_store.reader import iter_tree_batches  # noqa: E402
from rollout_store.store import (  # noqa: E402
    CommitKeyConflictError,
    DamagedLogError,
    StoreError,
)
from rollout_store.synthetic import bel_shaped_batch  # noqa: E402
from rollout_store.testing import assert_trees_equal  # noqa: E402
from rollout_store.validate import TreeValidationError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "rtrees-test"
LEASE_S = "3"  # short leases, so a killed holder's lock expires within the test


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """moto's S3 server on 127.0.0.1 and the AWS variables pointing at it (also for the
    worker processes, which inherit the environment)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")  # noqa: SIM115
    proc = start_moto_server(port, log)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
           "ROLLOUT_STORE_LOCK_LEASE_S": LEASE_S}
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


@pytest.fixture
def s3_uri(s3_server: dict[str, str]) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}/store"


def _client(env: dict[str, str]) -> Any:
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")


def _batch(i: int, n: int = 6) -> Any:
    return bel_shaped_batch(n, rollouts=4, depth=4, seed=i, tree_prefix=f"b{i}",
                            snapshot_bytes=32)


QUERIES = {
    "trees": "SELECT tree_id, n_nodes, commit_key FROM trees ORDER BY tree_id",
    "siblings": "SELECT * FROM siblings ORDER BY tree_id, parent_id, child_id",
    "paths": "SELECT * FROM paths ORDER BY tree_id, leaf_id",
    "snapshots": "SELECT count(*), sum(octet_length(state)), min(state_hash) FROM snapshots",
}


def _answers(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    con = connect(store)
    return {name: con.execute(q).fetchall() for name, q in QUERIES.items()}


def test_append_and_every_reader_match_a_local_store(s3_uri: str, tmp_path: Path) -> None:
    remote = Store(s3_uri, create=True)
    local = Store(tmp_path / "local", create=True)
    for i in range(3):
        batch = _batch(i)
        for store in (remote, local):
            report = store.append_trees(batch, key=f"k{i}")
            assert report.rows["trees"] == 6
    assert str(remote.path) == s3_uri
    assert remote.version() == local.version()
    assert _answers(remote) == _answers(local)
    assert _answers(remote)["siblings"], "the data must have branching nodes"
    assert_trees_equal(read_trees(local), read_trees(remote))
    for table in ("trees", "nodes", "snapshots"):
        order = [(c, "ascending") for c in ("tree_id", "node_id", "snapshot_id")
                 if c in read_arrow(local, table).column_names]
        a = read_arrow(remote, table).sort_by(order)
        b = read_arrow(local, table).sort_by(order)
        assert a.equals(b), table
        assert (read_polars(remote, table).collect().height
                == read_polars(local, table).collect().height)
    streamed = [b.num_rows for b in iter_tree_batches(remote, max_rows=50)]
    assert sum(streamed) == read_arrow(local, "nodes").num_rows and len(streamed) > 1
    assert info(remote)["tables"]["nodes"]["rows"] == info(local)["tables"]["nodes"]["rows"]
    # A pinned view keeps its rows while a writer appends; time travel works too.
    pinned = remote.version()
    remote.append_trees(_batch(9), key="k9")
    assert connect(remote, pinned).execute("SELECT count(*) FROM trees").fetchall() == [(18,)]
    assert connect(remote, 1).execute("SELECT count(*) FROM trees").fetchall() == [(6,)]
    # The locked-down SQL surface reads the remote views and still refuses host files.
    con = connect(remote, restricted=True)
    assert con.execute("SELECT count(*) FROM trees").fetchall() == [(24,)]
    with pytest.raises(Exception, match=r"(?i)permission|disabled"):
        con.execute("SELECT * FROM read_text('/etc/hostname')").fetchall()


def test_retries_conflicts_and_duplicates_on_s3(s3_uri: str) -> None:
    store = Store(s3_uri, create=True)
    store.append_trees(_batch(0), key="run:0")
    again = store.append_trees(_batch(0), key="run:0")
    assert again.already_committed
    with pytest.raises(CommitKeyConflictError):
        store.append_trees(_batch(0, n=7), key="run:0")
    with pytest.raises(TreeValidationError, match="duplicate_tree_id"):
        store.append_trees(_batch(0), key="run:other")
    assert read_arrow(store, "trees").num_rows == 6
    assert Store(s3_uri).version()["trees"] == 1  # reopened from the bucket alone


def _worker(uri: str, prefix: str, n: int, tmp: Path, per_batch: int = 8
            ) -> subprocess.Popen[str]:
    err = open(tmp / f"{prefix}.stderr", "w")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.append_worker", uri, prefix, str(n),
         str(per_batch)], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)


def _acks(out: str) -> list[str]:
    return [ln.split()[1] for ln in out.splitlines() if ln.startswith("ACK ")]


def test_concurrent_appends_from_two_processes(s3_uri: str, tmp_path: Path) -> None:
    Store(s3_uri, create=True)
    procs = [_worker(s3_uri, p, 3, tmp_path) for p in ("a", "b")]
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, (tmp_path / "a.stderr").read_text()[-2000:]
        outs.append(out)
    acked = {k for out in outs for k in _acks(out)}
    assert len(acked) == 6
    store = Store(s3_uri)
    keys = set(pc.unique(read_arrow(store, "trees").column("commit_key")).to_pylist())
    assert keys == acked
    assert store.version()["trees"] == 6  # every commit landed, none overwrote another
    assert read_arrow(store, "trees").num_rows == 48
    report = verify(store)
    assert report.ok, report.problems


_RAW_COMMITS = """
import sys, time
import pyarrow as pa
from deltalake.transaction import AddAction, CommitProperties
from rollout_store.store import Store
who = sys.argv[2]
sys.stdin.readline()
store = Store(sys.argv[1], create=True)  # both create the new store at once
for i in range(int(sys.argv[3])):
    rel, size, stats = store.write_data_file("metrics", [pa.table({
        "run_id": [who], "step": [i], "name": ["m"], "value": [float(i)],
        "created_at": pa.array([0], pa.timestamp("us", tz="UTC"))})])
    store.delta_table("metrics").create_write_transaction(
        [AddAction(rel, size, {}, int(time.time() * 1000), True, stats)], mode="append",
        schema=store.delta_table("metrics").schema(),
        commit_properties=CommitProperties(max_commit_retries=1000))
print("done", flush=True)
"""


def test_delta_commits_race_safely_without_our_lock(s3_uri: str) -> None:
    """Two processes create one new store at the same moment, then commit to one table as
    fast as they can, bypassing the append lock: delta-rs's conditional put must keep every
    commit (none overwritten, no gaps)."""
    n = 12
    procs = [subprocess.Popen([sys.executable, "-c", _RAW_COMMITS, s3_uri, who, str(n)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for who in ("x", "y")]
    time.sleep(2.0)  # both imported and waiting: start them together
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and "done" in out, err[-2000:]
    store = Store(s3_uri)
    assert store.version()["metrics"] == 2 * n
    assert store.version()["trees"] == 0  # created once: no second version 0 over the first
    rows = read_arrow(store, "metrics")
    assert sorted(zip(rows["run_id"].to_pylist(), rows["step"].to_pylist(), strict=True)) == \
        sorted((w, i) for w in ("x", "y") for i in range(n))


def test_kill_9_during_an_append_leaves_only_whole_commits(s3_uri: str, tmp_path: Path
                                                           ) -> None:
    Store(s3_uri, create=True)
    rng = random.Random(0)
    acked: set[str] = set()
    for run in range(3):
        proc = _worker(s3_uri, f"kill{run}", -1, tmp_path, per_batch=rng.choice([4, 12]))
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(rng.uniform(0.3, 1.5))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        acked |= set(_acks(out))
    store = Store(s3_uri)
    con = connect(store)
    per_tree = con.execute("""SELECT t.tree_id, t.n_nodes, count(n.node_id)
                              FROM trees t LEFT JOIN nodes n USING (tree_id)
                              GROUP BY ALL""").fetchall()
    assert all(n == got for _, n, got in per_tree), "a committed tree is not whole"
    committed = {k for (k,) in con.execute("SELECT DISTINCT commit_key FROM trees").fetchall()}
    assert acked <= committed
    # The killed writer's lease lock expires; the store accepts the next append.
    start = time.monotonic()
    store.append_trees(_batch(50), key="after")
    assert time.monotonic() - start < float(LEASE_S) + 20
    report = verify(store)
    assert report.ok, report.problems


def test_validate_and_compact_from_the_command_line(s3_uri: str, tmp_path: Path,
                                                    s3_server: dict[str, str]) -> None:
    remote = Store(s3_uri, create=True)
    local = Store(tmp_path / "local", create=True)
    for i in range(3):
        batch = _batch(i)
        for store in (remote, local):
            store.append_trees(batch, key=f"k{i}")
    before = _answers(remote)
    runner = CliRunner()
    result = runner.invoke(app, ["store", "validate", "--store", s3_uri])
    assert result.exit_code == 0, result.output
    assert "ok: 9 files and 18 trees checked" in result.output
    result = runner.invoke(app, ["store", "compact", "--store", s3_uri, "--retention-hours",
                                 "1"])
    assert result.exit_code == 0, result.output
    assert "nodes: 3 files -> 1" in result.output
    compact(local)
    assert len(remote.files("nodes")) == 1
    assert _answers(remote) == before == _answers(local)
    result = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM siblings", "--store",
                                 s3_uri, "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["n"] == len(before["siblings"])
    # Damage the one nodes object: validate names it, exit 1, no traceback.
    victim = remote.files("nodes")[0]
    client = _client(s3_server)
    key = victim.path.removeprefix(f"s3://{BUCKET}/")
    data = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=data[: len(data) // 2])
    result = runner.invoke(app, ["store", "validate", "--store", s3_uri])
    assert result.exit_code == 1
    assert victim.path in result.output and "Traceback" not in result.output


def test_a_damaged_log_on_s3_is_named(s3_uri: str, s3_server: dict[str, str]) -> None:
    store = Store(s3_uri, create=True)
    store.append_trees(_batch(0), key="k0")
    log = f"{s3_uri}/nodes/_delta_log/00000000000000000001.json"
    _client(s3_server).put_object(Bucket=BUCKET, Key=log.removeprefix(f"s3://{BUCKET}/"),
                                  Body=b'{"add": {"path": "part-')
    with pytest.raises(DamagedLogError, match=f"{log}: line 1 is not valid JSON"):
        Store(s3_uri)
    result = CliRunner().invoke(app, ["store", "validate", "--store", s3_uri])
    assert result.exit_code == 1 and log in result.output


def test_compaction_lock_and_lease_rules(s3_server: dict[str, str]) -> None:
    client = _client(s3_server)
    key = f"{uuid.uuid4().hex[:8]}/.compact.lock"
    a = LeaseLock(client, BUCKET, key, lease_s=2.0)
    a.acquire()
    b = LeaseLock(client, BUCKET, key, lease_s=2.0, timeout_s=1.0)
    with pytest.raises(ObjectStoreError, match="still held"):
        b.acquire()  # a renews its lease, so waiting does not help
    a.check()
    a.release()
    b.timeout_s = 10.0
    b.acquire()  # free again
    # A holder that stalls past its lease (no heartbeat) loses the lock to a contender and
    # finds out at its next check, before it would commit.
    b._stop.set()
    assert b._thread is not None
    b._thread.join()
    c = LeaseLock(client, BUCKET, key, lease_s=2.0, timeout_s=15.0)
    start = time.monotonic()
    c.acquire()
    assert time.monotonic() - start >= 1.0  # waited for b's lease to run out
    with pytest.raises(LockLostError):
        b.check()
    b.release()  # must not delete c's lock
    assert client.head_object(Bucket=BUCKET, Key=key)["ETag"] == c.etag
    c.release()
    with pytest.raises(Exception):  # noqa: B017 - released: the object is gone
        client.head_object(Bucket=BUCKET, Key=key)


def test_bad_locations_fail_in_one_line(s3_server: dict[str, str]) -> None:
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist"):
        Store("s3://no-such-bucket/x", create=True)
    with pytest.raises(StoreError, match="no such store"):
        Store(f"s3://{BUCKET}/{uuid.uuid4().hex}/missing")
    with pytest.raises(StoreError, match="no bucket"):
        Store("s3://")
    result = CliRunner().invoke(app, ["store", "info", "--store", "s3://no-such-bucket/x"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "does not exist" in result.output


def test_plain_http_needs_a_loopback_endpoint(s3_server: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://storage.example:9000")
    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    with pytest.raises(StoreError, match="plain http"):
        Store(f"s3://{BUCKET}/x")


@pytest.mark.slow
def test_compact_while_two_processes_append(s3_uri: str, tmp_path: Path) -> None:
    """Compaction beside appenders on S3: nothing lost, nothing duplicated."""
    store = Store(s3_uri, create=True)
    for i in range(3):
        store.append_trees(_batch(100 + i), key=f"pre{i}")
    procs = [_worker(s3_uri, p, 5, tmp_path) for p in ("c", "d")]
    for _ in range(3):
        compact(store)
        time.sleep(0.5)
    acked = set()
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        acked |= set(_acks(out))
    compact(store)
    trees = read_arrow(store, "trees")
    assert trees.num_rows == 18 + 80
    assert pc.count_distinct(trees.column("tree_id")).as_py() == trees.num_rows
    assert acked <= set(trees.column("commit_key").to_pylist())
    assert verify(store).ok
