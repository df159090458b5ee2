"""Collection on Ray (issue 16): same trees as one process, a killed actor's chunk retried.

Every Ray test runs on one local Ray instance this module starts (2 CPUs, no dashboard)
and skips, saying so, when the ``ray`` extra is not installed. The chunk rerun and the
missing-extra error need no Ray.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.main import app
from rollout_store import Store, read_arrow, read_trees
from rollout_store.maintenance import verify
from rollout_store.testing import assert_trees_equal
from rollout_store.tree import Tree
from train.envs import make_env
from train.envs.workflow import WorkflowEnv
from train.policies import load_policy
from train.sampling import make_sampler
from train.sampling.collect import (
    CollectReport,
    collect,
    commit_chunk,
    sample_and_commit_chunk,
    tree_id_for,
)

needs_ray = pytest.mark.skipif(find_spec("ray") is None,
                               reason="Ray is an optional extra: pip install -e '.[ray]'")
TASKS = WorkflowEnv.generate_tasks(16, seed=3)


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[Any]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    yield ray
    ray.shutdown()


def _collect(store: Store, n_tasks: int, n_total: int, **kw: Any) -> CollectReport:
    return collect(store, "workflow", "tabular", "bel", TASKS[:n_tasks], n_total, seed=7,
                   run_id="ray", commit_trees=2, progress=False, **kw)


def _assert_same_trees(expected: list[Tree], actual: list[Tree]) -> None:
    """Equal trees up to ``created_at``, the wall-clock time each was made."""
    made = {t.tree_id: t.created_at for t in expected}
    for t in actual:
        t.created_at = made.get(t.tree_id, t.created_at)
    assert_trees_equal(expected, actual)


def _assert_each_tree_once(store: Store, n_tasks: int) -> None:
    ids = read_arrow(store, "trees", columns=["tree_id"]).column("tree_id").to_pylist()
    assert sorted(ids) == sorted(tree_id_for("ray", 7, t.task_id) for t in TASKS[:n_tasks])
    nodes = read_arrow(store, "nodes", columns=["tree_id", "node_id"])
    pairs = {(a, b) for a, b in zip(nodes.column("tree_id").to_pylist(),
                                     nodes.column("node_id").to_pylist(), strict=True)}
    assert len(pairs) == nodes.num_rows  # no node stored twice
    checked = verify(store)
    assert checked.ok, checked.problems


@needs_ray
def test_ray_gives_the_trees_of_one_process(ray_instance: Any, tmp_path: Path) -> None:
    one = Store(tmp_path / "one", create=True)
    on_ray = Store(tmp_path / "ray", create=True)
    single = _collect(one, 8, 8)
    report = _collect(on_ray, 8, 8, ray="auto", workers=2)
    assert (report.trees, report.commits, report.nodes, report.rollouts, report.by_phase,
            report.retries) == (single.trees, single.commits, single.nodes, single.rollouts,
                                single.by_phase, 0) == (8, 4, single.nodes, 64,
                                                        single.by_phase, 0)
    _assert_same_trees(read_trees(one), read_trees(on_ray))
    _assert_each_tree_once(on_ray, 8)
    # the commit keys are the chunks' keys of a single-process run: the same commits
    keys = read_arrow(one, "trees", columns=["commit_key"]).column("commit_key")
    assert set(read_arrow(on_ray, "trees", columns=["commit_key"]).column("commit_key")
               .to_pylist()) == set(keys.to_pylist())
    again = _collect(on_ray, 8, 8, ray="auto", workers=2)  # a rerun adds nothing
    assert (again.trees, again.skipped) == (0, 8)


@needs_ray
def test_ray_refuses_more_workers_than_cpus(ray_instance: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--workers 3 needs 3 CPUs on the Ray cluster; it has 2"):
        _collect(Store(tmp_path / "s", create=True), 8, 4, ray="auto", workers=3)


@needs_ray
def test_ray_raises_a_worker_error_as_itself(ray_instance: Any, tmp_path: Path) -> None:
    store = Store(tmp_path / "s", create=True)
    with pytest.raises(ValueError, match="tabular policy exists for the workflow environment"):
        collect(store, "calc", "tabular", "group", TASKS[:2], 4, seed=0, run_id="x",
                progress=False, ray="auto", workers=2)


def _kill_one_actor_after_first_commit(ray: Any, path: Path, killed: list[int]) -> None:
    """Poll (no fixed sleep decides anything) until a tree is stored, then SIGKILL an actor."""
    watcher = Store(path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith("collect-"))
        if names and len(watcher.stored_tree_ids()) > 0:
            actor = ray.get_actor(names[-1], namespace="rtrees")
            pid = ray.get(actor.pid.remote(), timeout=60)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.02)


@needs_ray
def test_killed_actor_chunk_is_retried_without_duplicates(ray_instance: Any, tmp_path: Path
                                                           ) -> None:
    on_ray = Store(tmp_path / "ray", create=True)
    killed: list[int] = []
    killer = threading.Thread(target=_kill_one_actor_after_first_commit,
                              args=(ray_instance, on_ray.path, killed))
    killer.start()
    try:
        report = _collect(on_ray, 16, 96, ray="auto", workers=2)
    finally:
        killer.join()
    assert killed, "no actor was killed: the run ended before its first commit was seen"
    assert report.retries >= 1, "the kill came after the last chunk: nothing was retried"
    assert report.trees == 16
    _assert_each_tree_once(on_ray, 16)
    one = Store(tmp_path / "one", create=True)
    _collect(one, 16, 96)
    _assert_same_trees(read_trees(one), read_trees(on_ray))


def test_rerun_of_a_committed_chunk_stores_each_tree_once(tmp_path: Path) -> None:
    """What a fresh actor does with the chunk of one that died after its commit landed."""
    store = Store(tmp_path / "s", create=True)
    env, policy, sampler = make_env("workflow"), load_policy("tabular", "workflow"), \
        make_sampler("bel")
    chunk = TASKS[:3]
    first = sample_and_commit_chunk(store, env, policy, sampler, chunk, 8, 7, "ray")
    assert (first.trees, first.already_stored) == (3, False)
    rerun = sample_and_commit_chunk(store, env, policy, sampler, chunk, 8, 7, "ray", rerun=True)
    assert (rerun.tree_ids, rerun.nodes, rerun.by_phase, rerun.already_stored) == \
        (first.tree_ids, first.nodes, first.by_phase, True)
    # a retried commit whose acknowledgement was lost: the same key stores nothing more
    again = commit_chunk(store, read_trees(store), "ray", 7)
    assert again.already_stored
    _assert_each_tree_once(store, 3)
    # a rerun of a chunk that had not landed samples it: the same trees as a first run
    other = Store(tmp_path / "t", create=True)
    fresh = sample_and_commit_chunk(other, env, policy, sampler, chunk, 8, 7, "ray", rerun=True)
    assert (fresh.tree_ids, fresh.nodes, fresh.already_stored) == \
        (first.tree_ids, first.nodes, False)
    _assert_same_trees(read_trees(store), read_trees(other))


def test_cli_ray_without_ray_names_the_extra(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    result = CliRunner().invoke(app, ["collect", "--store", str(tmp_path / "s"), "--env",
                                      "workflow", "--policy", "tabular", "--sampler", "bel",
                                      "--tasks", "2", "--ray", "auto", "--no-progress"])
    assert result.exit_code == 1
    assert "pip install 'rollout-trees[ray]'" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


@needs_ray
def test_cli_collect_on_a_ray_address(ray_instance: Any, tmp_path: Path) -> None:
    """``rtrees collect --ray HOST:PORT`` in another process joins this module's instance."""
    address = ray_instance.get_runtime_context().gcs_address
    args = ["collect", "--env", "workflow", "--policy", "tabular", "--sampler", "bel",
            "--tasks", "6", "--n-total", "8", "--seed", "7", "--run-id", "ray",
            "--commit-trees", "2", "--no-progress"]
    rtrees = str(Path(sys.executable).with_name("rtrees"))
    run = subprocess.run([rtrees, *args, "--store", str(tmp_path / "ray"), "--ray", address,
                          "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "6 trees committed in 3 commits" in run.stdout
    single = CliRunner().invoke(app, [*args, "--store", str(tmp_path / "one")])
    assert single.exit_code == 0, single.output
    _assert_same_trees(read_trees(Store(tmp_path / "one")), read_trees(Store(tmp_path / "ray")))
    bad = subprocess.run([rtrees, *args, "--store", str(tmp_path / "bad"), "--ray",
                          "127.0.0.1:1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "cannot connect to Ray" in bad.stderr
    assert "Traceback" not in bad.stderr

