"""Chunks of a collection (issue 6): tree ids and seeds, sampling a chunk's trees with
the rollout engine, and committing it under its idempotency key.

The unit of work every executor of ``collect`` runs (``train/sampling/collect.py``: one
process or worker processes; ``train/sampling/ray_collect.py``: Ray actors). Both import
this module and neither imports the other's executor back, so the launcher and its
executors form no import circle (issue 28).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import pyarrow.compute as pc

from rollout_store import Store, read_arrow
from rollout_store.tree import Tree
from train.envs import Environment, Task, make_env
from train.policies.base import Policy
from train.sampling.base import Sampler, mix_seed
from train.sampling.engine import DEFAULT_MAX_PROGRAMS, Engine, TreeJob

PolicyFactory = Callable[[str], Policy]  # env name -> policy
PolicySpec = str | Policy | PolicyFactory
EnvSpec = str | Environment


def tree_id_for(run_id: str, seed: int, task_id: str) -> str:
    """The deterministic tree id of ``task_id`` in a run."""
    return f"{run_id}/s{seed}/{task_id}"


def tree_seed(seed: int, task_id: str) -> int:
    """The seed of one task's tree (independent of worker and order)."""
    return mix_seed(seed, "tree", task_id)


def commit_key(run_id: str, seed: int, tree_ids: Sequence[str]) -> str:
    """The idempotency key of a commit holding ``tree_ids``."""
    digest = hashlib.sha256("\n".join(sorted(tree_ids)).encode()).hexdigest()[:32]
    return f"collect:{run_id}:s{seed}:{digest}"


@dataclass
class ChunkResult:
    """What committing one chunk of trees stored (small: a Ray actor sends it back)."""

    tree_ids: list[str]
    nodes: int
    by_phase: dict[str, int]
    already_stored: bool = False  # a rerun found the chunk committed by its dead first run
    attempt: int = 0  # 0: first run of the chunk; k: its k-th rerun
    diverged: int = 0
    """Rollouts dropped because a snapshot restore diverged (the trees'
    ``meta["diverged_rollouts"]``, ``train.sampling.base``): spent, without a leaf."""

    @property
    def trees(self) -> int:
        return len(self.tree_ids)

    @classmethod
    def of(cls, trees: Sequence[Tree], already_stored: bool = False) -> ChunkResult:
        by_phase: dict[str, int] = {}
        diverged = 0
        for t in trees:
            for phase, n in t.rollouts_by_phase.items():
                by_phase[phase] = by_phase.get(phase, 0) + n
            lost = (t.meta or {}).get("diverged_rollouts") or {}
            diverged += sum(int(n) for n in lost.values())
        return cls([t.tree_id for t in trees], sum(len(t.nodes) for t in trees), by_phase,
                   already_stored, diverged=diverged)


def stored_tree_ids(store: Store, run_id: str) -> set[str]:
    """Tree ids committed under ``run_id``."""
    table = read_arrow(store, "trees", columns=["tree_id", "run_id"])
    mask = pc.equal(table.column("run_id"), run_id)
    return set(table.filter(mask).column("tree_id").to_pylist())


def resolve_policy(policy: PolicySpec, env_name: str) -> Policy:
    """A policy from a ``load_policy`` spec string, a factory ``env -> Policy``, or as is.

    Shared by collection and the reference job (``references.py``).
    """
    if isinstance(policy, str):
        from train.policies import load_policy

        return load_policy(policy, env_name)
    if callable(policy) and not hasattr(policy, "sample"):
        return policy(env_name)
    return policy  # type: ignore[return-value]


def env_source(env: EnvSpec) -> Environment | Callable[[], Environment]:
    """What a ``TreeJob`` gets: a factory for a registry name (each tree its own
    environment, so the engine runs them together), the object itself otherwise."""
    return partial(make_env, env) if isinstance(env, str) else env


def sample_trees(env: EnvSpec, policy: Policy, sampler: Sampler, tasks: Sequence[Task],
                 n_total: int, seed: int, run_id: str,
                 on_tree: Callable[[int, Tree], None] | None = None,
                 on_failure: Callable[[int, Exception], None] | None = None) -> list[Tree]:
    """The trees of ``tasks`` (ids ``tree_id_for``, seeds ``tree_seed``), all advanced
    together by one ``Engine.sample_trees`` call; ``on_tree(i, tree)`` as each ends
    (``on_failure(i, exc)``: a tree whose environment failed, left out; without it the
    failure is raised). An ``Environment`` object (not a name) is shared, so its trees
    run one at a time."""
    source = env_source(env)
    engine = Engine(policy, max_programs=1 if isinstance(source, Environment)
                    else DEFAULT_MAX_PROGRAMS)
    jobs = [TreeJob(sampler, source, task, n_total, tree_seed(seed, task.task_id),
                    tree_id_for(run_id, seed, task.task_id), run_id) for task in tasks]
    if isinstance(source, Environment):  # one shared object: one tree at a time
        trees = []
        for i, job in enumerate(jobs):
            alone: Callable[[int, Exception], None] | None = None
            if on_failure is not None:
                alone = partial(_reindexed, on_failure, i)
            one = engine.sample_trees([job], on_failure=alone)
            trees.extend(one)
            if one and on_tree is not None:
                on_tree(i, one[0])
        return trees
    return engine.sample_trees(jobs, on_tree, on_failure)


def _reindexed(on_failure: Callable[[int, Exception], None], i: int, _: int,
               exc: Exception) -> None:
    on_failure(i, exc)


def _sample_chunk(env: EnvSpec, policy: Policy, sampler: Sampler, tasks: Sequence[Task],
                  n_total: int, seed: int, run_id: str) -> list[Tree]:
    return sample_trees(env, policy, sampler, tasks, n_total, seed, run_id)


def commit_chunk(store: Store, trees: Sequence[Tree], run_id: str, seed: int) -> ChunkResult:
    """Commit one chunk under its idempotency key (a retry of a landed commit stores nothing)."""
    landed = store.append_trees(list(trees), key=commit_key(run_id, seed,
                                                            [t.tree_id for t in trees]))
    return ChunkResult.of(trees, already_stored=landed.already_committed)


def sample_and_commit_chunk(store: Store, env: EnvSpec, policy: Policy, sampler: Sampler,
                            tasks: Sequence[Task], n_total: int, seed: int, run_id: str, *,
                            rerun: bool = False) -> ChunkResult:
    """``_sample_chunk`` then ``commit_chunk``: the unit of work of a Ray actor.

    ``rerun``: the chunk's previous worker died, possibly after its commit landed; if
    the chunk's trees are stored they are read back instead of sampled again (a chunk
    commits atomically: all of them or none; a part stored fails the commit loudly).
    Sampling again and relying on the commit key alone would do for every sampler but
    ``caliper``, whose trees depend on the tasks its worker ran before, so a new
    worker's trees differ.
    """
    if rerun:
        ids = [tree_id_for(run_id, seed, t.task_id) for t in tasks]
        if set(ids) <= set(store.stored_tree_ids().to_pylist()):
            from rollout_store import read_trees

            return ChunkResult.of(read_trees(store, ids), already_stored=True)
    trees = _sample_chunk(env, policy, sampler, tasks, n_total, seed, run_id)
    return commit_chunk(store, trees, run_id, seed)


__all__ = ["ChunkResult", "EnvSpec", "PolicyFactory", "PolicySpec", "commit_chunk", "commit_key",
           "env_source", "resolve_policy", "sample_and_commit_chunk", "sample_trees",
           "stored_tree_ids", "tree_id_for", "tree_seed"]
