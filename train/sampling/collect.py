"""The collection job: sample one tree per task and commit them to a store (issue 6).

``collect(store, env, policy, sampler, tasks, n_total, seed, run_id)``:

* tree ids are ``tree_id_for(run_id, seed, task_id)`` and each tree's seed is
  ``tree_seed(seed, task_id)``, so a tree does not depend on which worker made
  it or on what was collected before (except a ``caliper`` tree, whose bucket
  statistics carry over from the tasks its worker ran before);
* tasks whose tree id is already stored under ``run_id`` are skipped, so a
  rerun with the same run id and seed adds nothing and an interrupted run
  resumes where it stopped: every committed tree stays;
* trees are committed ``commit_trees`` at a time (a bounded commit), each with
  the idempotency key ``commit_key(run_id, seed, tree_ids)``: retrying a commit
  whose acknowledgement was lost stores it once;
* a rich progress bar counts trees (``progress=False`` turns it off);
* ``workers > 1`` runs the tasks in that many processes (spawned; each builds
  its own environment, policy and sampler, so ``env`` and ``policy`` must then
  be a registry name / policy spec or a picklable factory) and commits in the
  parent as chunks finish. A caliper sampler then keeps one ``CaliperState``
  per worker, and the parent's sampler object is not updated;
* ``ray="auto"|"local"|ADDRESS`` runs the same chunks on ``workers`` Ray actors
  instead (``train/sampling/ray_collect.py``, the ``ray`` extra): each actor holds its
  own environment, policy and sampler and commits its chunks itself (the store's
  concurrent appends) under the same ``commit_key``; a chunk whose actor died is rerun
  on a fresh actor, which first skips the trees its dead predecessor committed.

Every executor runs the rollout engine (``train.sampling.engine``) over its tasks: one
process over waves of about ``wave`` trees (whole chunks, each committed
as soon as its trees are done), a worker process or Ray actor over its chunk
(``chunks.sample_trees``); every tree of a wave gets its own environment (``env`` as a
registry name; an ``Environment`` object is shared, so its trees run one at a time). A
chunk is the same ``commit_trees`` tasks, and so the same commit key, whichever executor
runs it.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rollout_store import Store
from rollout_store.tree import Tree
from train.envs import Task, make_env, spec_of
from train.sampling import Sampler, make_sampler
from train.sampling.chunks import (
    ChunkResult,
    EnvSpec,
    PolicyFactory,
    PolicySpec,
    commit_chunk,
    commit_key,
    env_source,
    resolve_policy,
    sample_and_commit_chunk,
    sample_trees,
    stored_tree_ids,
    tree_id_for,
    tree_seed,
)
from train.sampling.engine import DEFAULT_MAX_PROGRAMS


@dataclass
class CollectReport:
    """What a collection did."""

    run_id: str
    seed: int
    n_tasks: int
    skipped: int = 0  # tasks already stored under this run id
    trees: int = 0  # trees committed now
    commits: int = 0
    rollouts: int = 0
    nodes: int = 0
    seconds: float = 0.0
    by_phase: dict[str, int] = field(default_factory=dict)
    retries: int = 0  # chunks rerun after their Ray actor died
    failed: dict[str, str] = field(default_factory=dict)
    """Trees not committed because their environment failed: tree id -> one line (a
    rerun retries them; the other trees of their chunk are committed)."""
    diverged: int = 0
    """Rollouts of the committed trees dropped because restoring a snapshot diverged (a
    non-deterministic environment or agent program): spent without a leaf, the node they
    would have started from marked ``meta["diverged"]`` (``train.sampling.base``)."""

    def add(self, chunk: ChunkResult) -> None:
        """Count one committed chunk."""
        self.commits += 1
        self.trees += chunk.trees
        self.nodes += chunk.nodes
        self.retries += chunk.attempt
        self.diverged += chunk.diverged
        for phase, n in chunk.by_phase.items():
            self.by_phase[phase] = self.by_phase.get(phase, 0) + n
            self.rollouts += n

    @property
    def trees_per_minute(self) -> float:
        return 60.0 * self.trees / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v}" for k, v in sorted(self.by_phase.items())) or "none"
        return (f"run {self.run_id} seed {self.seed}: {self.trees} trees committed in "
                f"{self.commits} commits ({self.skipped} of {self.n_tasks} tasks already "
                f"stored); {self.nodes} nodes, {self.rollouts} rollouts ({phases}); "
                f"{self.seconds:.1f} s, {self.trees_per_minute:.1f} trees/min"
                + (f"; {self.retries} chunks retried after a worker died" if self.retries
                   else "")
                + (f"; {self.diverged} rollouts diverged on replay (dropped, their start "
                   "nodes marked meta.diverged)" if self.diverged else "")
                + (f"; {len(self.failed)} trees FAILED (not committed): "
                   + "; ".join(f"{t}: {e}" for t, e in sorted(self.failed.items())[:3])
                   + (" ..." if len(self.failed) > 3 else "") if self.failed else ""))


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception (a failed tree's reason)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def resolve_sampler(sampler: str | Sampler, params: dict[str, Any] | None = None) -> Sampler:
    if isinstance(sampler, str):
        return make_sampler(sampler, **(params or {}))
    if params:
        raise ValueError("sampler params go with a sampler name, not a Sampler object")
    return sampler


def worker_specs(env: EnvSpec, policy: PolicySpec, what: str
                 ) -> tuple[str, str | PolicyFactory]:
    """Workers build their own environment and policy: refuse objects they cannot rebuild."""
    if not isinstance(env, str) or not (isinstance(policy, str) or (
            callable(policy) and not hasattr(policy, "sample"))):
        raise ValueError(f"{what} needs env as a registry name and policy as a spec string "
                         "or a picklable factory")
    return env, policy


# ----- worker processes -------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(env: str, policy: str | PolicyFactory, sampler: Sampler, threads: int
                 ) -> None:
    make_env(env).close()  # a bad name fails here, once
    _WORKER["env"] = env
    _WORKER["policy"] = resolve_policy(policy, env)
    _WORKER["sampler"] = sampler
    if "torch" in sys.modules:
        # Each worker's share of the cores, as Ray gives an actor (OMP_NUM_THREADS=num_cpus):
        # torch's default of one thread per core in every worker oversubscribes the
        # machine (measured: 2 workers x 2 threads on 2 busy cores, 0.5x one process).
        torch = sys.modules["torch"]  # the policy chose its threads (hf.configure_threads)
        torch.set_num_threads(max(1, min(threads, torch.get_num_threads())))


def _worker_chunk(tasks: list[Task], n_total: int, seed: int, run_id: str
                  ) -> tuple[list[Tree], dict[str, str]]:
    """The chunk's trees, and the trees that failed (tree id -> one line)."""
    failed: dict[str, str] = {}

    def on_failure(i: int, exc: Exception) -> None:
        failed[tree_id_for(run_id, seed, tasks[i].task_id)] = one_line(exc)

    trees = sample_trees(_WORKER["env"], _WORKER["policy"], _WORKER["sampler"], tasks,
                         n_total, seed, run_id, on_failure=on_failure)
    return trees, failed


@contextmanager
def progress_bar(enabled: bool, total: int, description: str, unit: str = "",
                 transient: bool = False) -> Iterator[Callable[[int], None]]:
    """A rich progress bar of ``total`` items (``unit`` names them), yielding
    ``advance(n)``; a no-op when not ``enabled``. ``transient`` clears it at the end."""
    if not enabled:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    named = (TextColumn(unit), TimeElapsedColumn(), TextColumn("eta")) if unit else (
        TimeElapsedColumn(),)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  *named, TimeRemainingColumn(), transient=transient) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def collect(store: Store, env: EnvSpec, policy: PolicySpec, sampler: str | Sampler,
            tasks: Sequence[Task], n_total: int, seed: int, run_id: str, *, workers: int = 1,
            commit_trees: int = 16, progress: bool = True,
            sampler_params: dict[str, Any] | None = None,
            ray: str | None = None, wave: int = DEFAULT_MAX_PROGRAMS) -> CollectReport:
    """Sample one tree per task with ``sampler`` and commit them (see the module docstring).

    ``env``: an ``Environment`` or a registry name; ``policy``: a ``Policy``, a
    ``load_policy`` spec string, or a factory ``env_name -> Policy``;
    ``sampler``: a ``Sampler`` or a name (with ``sampler_params``); ``ray``: None (this
    machine), or where ``workers`` Ray actors run: ``auto``, ``local`` or a cluster
    address (``ray_collect.connect``); ``wave``: trees one process samples together
    (rounded down to whole chunks, at least one; an interrupt loses the wave in flight).
    """
    if n_total < 1:
        raise ValueError(f"n_total must be >= 1, got {n_total}")
    if commit_trees < 1:
        raise ValueError(f"commit_trees must be >= 1, got {commit_trees}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if wave < 1:
        raise ValueError(f"wave must be >= 1, got {wave}")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("task ids must be unique: they name the trees")
    samp = resolve_sampler(sampler, sampler_params)
    start = time.perf_counter()
    report = CollectReport(run_id=run_id, seed=seed, n_tasks=len(tasks))
    done = stored_tree_ids(store, run_id)
    todo = [t for t in tasks if tree_id_for(run_id, seed, t.task_id) not in done]
    report.skipped = len(tasks) - len(todo)
    chunks = [list(todo[i:i + commit_trees]) for i in range(0, len(todo), commit_trees)]

    def commit(trees: list[Tree]) -> None:
        report.add(commit_chunk(store, trees, run_id, seed))

    if ray is not None:
        env_name, pol_spec = worker_specs(env, policy, "ray")
        from train.sampling.ray_collect import run_chunks_on_ray  # ray is an optional extra

        with progress_bar(progress, len(todo), f"collect {samp.name} on ray") as advance:
            for done_chunk in run_chunks_on_ray(ray, workers, store, env_name, pol_spec, samp,
                                                chunks, n_total, seed, run_id):
                report.add(done_chunk)
                advance(done_chunk.trees)
        report.seconds = time.perf_counter() - start
        return report

    with progress_bar(progress, len(todo), f"collect {samp.name}") as advance:
        if workers == 1 or len(chunks) <= 1:
            env_name = env if isinstance(env, str) else spec_of(env)
            pol = resolve_policy(policy, env_name)
            # waves of whole chunks, about ``wave`` trees each: the engine keeps them in
            # flight and each chunk is committed as soon as its trees are done (caliper's
            # bucket counts carry over from wave to wave)
            per_wave = max(1, wave // commit_trees)
            for w0 in range(0, len(chunks), per_wave):
                group = chunks[w0:w0 + per_wave]
                flat = [task for chunk in group for task in chunk]
                owner = [c for c, chunk in enumerate(group) for _ in chunk]
                got: list[dict[int, Tree | None]] = [{} for _ in group]

                def on_tree(i: int, tree: Tree | None, group: list[list[Task]] = group,
                            owner: list[int] = owner,
                            got: list[dict[int, Tree | None]] = got) -> None:
                    c = owner[i]
                    got[c][i] = tree  # None: the tree failed
                    advance(1)
                    if len(got[c]) == len(group[c]):
                        done = [t for _, t in sorted(got[c].items()) if t is not None]
                        if done:
                            commit(done)

                def on_failure(i: int, exc: Exception, flat: list[Task] = flat) -> None:
                    report.failed[tree_id_for(run_id, seed, flat[i].task_id)] = one_line(exc)
                    on_tree(i, None)

                sample_trees(env, pol, samp, flat, n_total, seed, run_id, on_tree,
                             on_failure)
        else:
            env_name, pol_spec = worker_specs(env, policy, "workers > 1")
            ctx = multiprocessing.get_context("spawn")
            with cf.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                        initargs=(env_name, pol_spec, samp,
                                                  max(1, (os.cpu_count() or 1) // workers))
                                        ) as pool:
                futures = [pool.submit(_worker_chunk, chunk, n_total, seed, run_id)
                           for chunk in chunks]
                try:
                    for fut in cf.as_completed(futures):
                        trees, failed = fut.result()
                        if trees:
                            commit(trees)
                        report.failed.update(failed)
                        advance(len(trees) + len(failed))
                except BaseException:
                    for fut in futures:
                        fut.cancel()
                    raise
    report.seconds = time.perf_counter() - start
    return report


__all__ = ["ChunkResult", "CollectReport", "EnvSpec", "PolicyFactory", "PolicySpec",
           "collect", "commit_chunk", "commit_key", "env_source", "progress_bar",
           "resolve_policy", "resolve_sampler", "sample_and_commit_chunk", "sample_trees",
           "stored_tree_ids", "tree_id_for", "tree_seed", "worker_specs"]
