"""Collection on Ray (issue 16): ``collect(..., ray=ADDRESS, workers=N)``.

Ray is one more executor of the chunks ``collect`` makes (``collect.py``; a chunk's work is
``train/sampling/chunks.py``, which both import, so ``collect`` importing this module
lazily closes no circle): ``workers``
actors, each holding its own environment, policy and sampler (``CollectWorker``), run
``sample_and_commit_chunk`` on one chunk at a time and commit it themselves, under the
chunk's ``commit_key``, with the store's concurrent appends. The driver only hands out
chunks and counts what came back. A tree's id and seed depend on its task only, so the
trees equal those of a single-process ``collect`` with the same seed (except
``caliper``'s, which depend on the tasks their worker ran before).

Failures: a chunk whose actor died (killed, out of memory, node lost) is rerun on a
fresh actor, up to ``max_attempts`` runs in all; the rerun reads back any trees the dead
actor had committed instead of sampling them again, and a commit that landed before its
acknowledgement was lost is skipped by its key, so every tree is stored once. An
exception raised by the sampler or the policy is not retried: it is raised in the
driver as itself.

The store must be reachable at the same path from every actor (this machine, or a
shared file system on a cluster whose nodes have this package installed); the append
lock is per host (``Store._append_lock``).

``ray`` (the ``ray`` extra) is imported only here, and only when asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from rollout_store import Store
from train.envs import Task, make_env
from train.sampling import Sampler
from train.sampling.chunks import (
    ChunkResult,
    PolicySpec,
    resolve_policy,
    sample_and_commit_chunk,
)

INSTALL_HINT = "pip install 'rollout-trees[ray]'"
NAMESPACE = "rtrees"  # actors are named rtrees/collect-TOKEN-SLOT.GENERATION


def import_ray() -> ModuleType:
    """The ``ray`` module, or a one-line RuntimeError naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def connect(ray: ModuleType, address: str, workers: int) -> bool:
    """Connect this process to Ray; True when it did (and so must ``ray.shutdown()``).

    ``address``: ``auto`` (the cluster in ``RAY_ADDRESS`` or the latest one started on
    this machine with ``ray start``, else a new local instance), ``local`` (always a new
    local instance), or a cluster address (``HOST:PORT``, ``ray://HOST:PORT``). A process
    already connected (a notebook's, a test's) is used as it is. A new local instance
    gets ``max(workers, cpu count)`` CPUs and no dashboard.
    """
    if ray.is_initialized():
        return False
    quiet: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    local: dict[str, Any] = {"num_cpus": max(workers, os.cpu_count() or 1),
                             "include_dashboard": False, **quiet}
    try:
        if address == "auto":
            if os.environ.get("RAY_ADDRESS"):
                _probe(os.environ["RAY_ADDRESS"])
            try:
                ray.init(address="auto", **quiet)
            except ConnectionError:  # no running cluster: start one
                ray.init(address="local", **local)
        elif address == "local":
            ray.init(address="local", **local)
        else:
            _probe(address)
            ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise RuntimeError(f"--ray {address}: cannot connect to Ray: {_first_line(exc)}"
                           ) from None
    return True


def _probe(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``HOST:PORT`` that nothing listens on (``ray.init`` retries for
    minutes); ``ray://`` client addresses and anything else are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address} ({exc.strerror or exc}); start "
                              "a cluster with `ray start --head`, or use --ray local") from None


class CollectWorker:
    """A Ray actor's state: the store, its own environment, policy and sampler.

    An error building them is kept and raised by ``run``, so it reaches the driver as
    the task's exception (not retried) instead of as a dead actor.
    """

    def __init__(self, store_path: str, env: str, policy: PolicySpec, sampler: Sampler
                 ) -> None:
        self._error: Exception | None = None
        try:
            self.store = Store(store_path)
            make_env(env).close()  # a bad name fails here; each tree makes its own
            self.env = env
            self.policy = resolve_policy(policy, env)
            self.sampler = sampler
        except Exception as exc:
            self._error = exc

    def pid(self) -> int:
        """This actor's process id (answered while ``run`` works: max_concurrency 2)."""
        return os.getpid()

    def run(self, tasks: Sequence[Task], n_total: int, seed: int, run_id: str, rerun: bool
            ) -> ChunkResult:
        if self._error is not None:
            raise self._error
        return sample_and_commit_chunk(self.store, self.env, self.policy, self.sampler, tasks,
                                       n_total, seed, run_id, rerun=rerun)


def run_chunks_on_ray(address: str, workers: int, store: Store, env: str, policy: PolicySpec,
                      sampler: Sampler, chunks: Sequence[Sequence[Task]], n_total: int,
                      seed: int, run_id: str, *, max_attempts: int = 3
                      ) -> Iterator[ChunkResult]:
    """Run every chunk on ``workers`` actors; yield each chunk's result as it commits.

    ``result.attempt`` is how many times the chunk was rerun. Raises RuntimeError when a
    chunk's actor died ``max_attempts`` times, and a worker's own exception as itself.
    """
    ray = import_ray()  # even with nothing to do: a missing extra is said at once
    if not chunks:
        return
    owned = connect(ray, address, workers)
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < workers:
            raise ValueError(f"--workers {workers} needs {workers} CPUs on the Ray cluster; "
                             f"it has {cpus:g}")
        yield from _schedule(ray, min(workers, len(chunks)), store, env, policy, sampler,
                             chunks, n_total, seed, run_id, max_attempts)
    finally:
        if owned:
            ray.shutdown()


def _schedule(ray: ModuleType, n_actors: int, store: Store, env: str, policy: PolicySpec,
              sampler: Sampler, chunks: Sequence[Sequence[Task]], n_total: int, seed: int,
              run_id: str, max_attempts: int) -> Iterator[ChunkResult]:
    """One chunk in flight per actor; a dead actor is replaced and its chunk queued first."""
    from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

    remote = ray.remote(CollectWorker)
    token = uuid.uuid4().hex[:8]
    generation = [0] * n_actors

    def spawn(slot: int) -> Any:
        return remote.options(num_cpus=1, max_restarts=0, max_concurrency=2,
                              name=f"collect-{token}-{slot}.{generation[slot]}",
                              namespace=NAMESPACE).remote(str(store.path), env, policy, sampler)

    actors = [spawn(slot) for slot in range(n_actors)]
    pending: deque[tuple[int, int]] = deque((i, 0) for i in range(len(chunks)))  # chunk, attempt
    inflight: dict[Any, tuple[int, int, int]] = {}  # ref -> slot, chunk, attempt
    try:
        while pending or inflight:
            busy = {slot for slot, _, _ in inflight.values()}
            for slot in range(n_actors):
                if slot not in busy and pending:
                    i, attempt = pending.popleft()
                    ref = actors[slot].run.remote(list(chunks[i]), n_total, seed, run_id,
                                                  attempt > 0)
                    inflight[ref] = (slot, i, attempt)
            [ref], _ = ray.wait(list(inflight), num_returns=1)
            slot, i, attempt = inflight.pop(ref)
            try:
                result: ChunkResult = ray.get(ref)
            except RayTaskError as exc:  # the sampler's or the policy's own error
                cause = exc.cause if isinstance(exc.cause, BaseException) else None
                raise (cause or RuntimeError(_first_line(exc))) from None
            except (RayActorError, WorkerCrashedError) as exc:
                if attempt + 1 >= max_attempts:
                    raise RuntimeError(f"chunk {i} of run {run_id}: its Ray worker died "
                                       f"{max_attempts} times; last: {_first_line(exc)}"
                                       ) from None
                _kill(ray, actors[slot])
                generation[slot] += 1
                actors[slot] = spawn(slot)
                pending.appendleft((i, attempt + 1))
                continue
            result.attempt = attempt
            yield result
    finally:
        for actor in actors:
            _kill(ray, actor)


def _kill(ray: ModuleType, actor: Any) -> None:
    with contextlib.suppress(Exception):  # already gone
        ray.kill(actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
