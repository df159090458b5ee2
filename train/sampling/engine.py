"""The rollout engine: many trees (or episodes) advanced together (issue 22).

Every piece of code that samples rollouts (the samplers, held-out evaluation, the Mean@k
references) is written as a *program*: a generator that yields what it needs and receives
the answer, so its logic reads sequentially (BEL's binary search is a ``while`` loop) while
the engine interleaves every program in flight:

* ``Decode(rows, config)``: one agent step for each ``Rows(transcript, n, seed)``; the
  program receives ``list[list[Continuation]]`` (requests in order, n each);
* ``Work(fn)``: environment work (reset, restore, step, snapshot); ``fn()`` runs in a
  bounded thread pool (the python sandbox's calls are subprocess-bound, so they overlap
  with decoding and with each other) and its return value is sent back.

A tree program is ``Sampler.grow`` wrapped by ``Sampler.tree_program``
(``train.sampling.base``, which imports this module and not the other way: the engine
sees a job's sampler only through ``TreeSampler``); ``TreeBuilder.run`` (one
lockstep round per ``Decode``, the round's steps in one ``Work``) is the only place that
yields, so samplers only write ``leaves = yield from builder.run(starts)``. Why
generators rather than threads blocking on futures: a sampler's decisions stay plain
sequential code, the engine owns all concurrency (no locks in samplers, one thread
touches the policy), and a program's order of events is fixed by its own code, never by
thread timing.

Scheduling (``Engine.run``). Programs are admitted up to ``max_programs`` at a time (new
ones join as old ones finish). The engine advances every program that has an answer
until each waits on a ``Decode`` or a ``Work``; ``Work`` goes to the pool at once. A
policy call is made when rows wait and either no environment work is running or
``max_rows`` rows wait (or ``tool_wait`` seconds passed since the last one finished):
it takes the waiting requests in arrival order up to ``max_rows`` rows (a request with
more branches is split: branch k of ``Rows(t, n, s)`` draws from stream ``s + k``, so
its parts draw what the whole would), as ONE ``sample_rows`` call per distinct
``SampleConfig``. A program whose round is split over several calls receives it when
all its parts came back. The granularity is one agent step: a row joins the batch at
the start of a policy call, and the backend drops rows as they finish their step.

Batch independence. A program's content depends only on its own inputs: each row of a
request carries its own seed (``TreeBuilder`` keys them by (seed, node, draw)), the
backends draw each row from its own stream (``train.policies.base.stream_uniforms``),
and a program sees its answers in its own order. Trees collected with any ``max_rows``
are the same up to the float reductions of batched matmuls (``tests/test_engine.py``
measures it). ``caliper``'s bucket statistics are the one shared state: a tree reads
them as of the start of its ``sample_trees`` call (``Sampler.begin_wave``), and the
counts of every tree of the call are added when it ends.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from rollout_store.tree import Tree
from train.envs.base import Environment, Task
from train.policies.base import Continuation, Policy, Rows, SampleConfig, sample_rows


@dataclass(frozen=True)
class Decode:
    """Ask for one agent step of each request (answer: ``list[list[Continuation]]``)."""

    rows: Sequence[Rows]
    config: SampleConfig


@dataclass(frozen=True)
class Work:
    """Run ``fn()`` in the tool pool (answer: its return value; an exception is thrown
    into the program)."""

    fn: Callable[[], Any]


Request = Decode | Work
Program = Generator[Request, Any, Any]

DEFAULT_MAX_ROWS = 128
DEFAULT_MAX_PROGRAMS = 64


def default_tool_threads() -> int:
    """Threads for environment work: 4 per usable CPU, at most 16 (tools mostly wait on
    subprocesses or are short Python calls)."""
    return max(2, min(16, 4 * len(os.sched_getaffinity(0))))


@dataclass
class EngineStats:
    """What one ``Engine.run`` did: policy calls, rows decoded, environment work items."""

    policy_calls: int = 0
    rows: int = 0
    work: int = 0
    max_call_rows: int = 0

    @property
    def rows_per_call(self) -> float:
        return self.rows / self.policy_calls if self.policy_calls else 0.0


@dataclass
class _Waiting:
    """A program's pending ``Decode``: the parts not yet sampled and the answers so far."""

    program: int
    decode: Decode
    parts: deque[tuple[int, int, int]]  # (request, first branch, branches)
    answers: list[list[Continuation | None]] = field(default_factory=list)
    outstanding: int = 0


class Engine:
    """Runs programs (module docstring) against one ``policy``.

    ``max_rows``: the row (branch) budget of one policy call; ``max_programs``: programs
    in flight (each holds its environment); ``tool_threads``: the environment pool
    (default ``default_tool_threads()``); ``tool_wait``: how long a policy call waits
    for running environment work to add rows before it starts with what is there.
    """

    def __init__(self, policy: Policy, *, max_rows: int = DEFAULT_MAX_ROWS,
                 max_programs: int = DEFAULT_MAX_PROGRAMS, tool_threads: int | None = None,
                 tool_wait: float = 0.05) -> None:
        if max_rows < 1 or max_programs < 1:
            raise ValueError(f"max_rows and max_programs must be >= 1, got {max_rows}, "
                             f"{max_programs}")
        self.policy = policy
        self.max_rows, self.max_programs = max_rows, max_programs
        self.tool_threads = tool_threads or default_tool_threads()
        self.tool_wait = tool_wait
        self.stats = EngineStats()

    # ----- the core -------------------------------------------------------------------

    def run(self, programs: Iterable[Callable[[], Program]],
            on_done: Callable[[int, Any], None] | None = None) -> list[Any]:
        """Run every program (given as factories, created when admitted) to its end;
        returns their return values in order. ``on_done(i, value)`` is called as each
        one ends. An exception in a program closes the others and is raised."""
        factories = list(programs)
        results: list[Any] = [None] * len(factories)
        live: dict[int, Program] = {}
        ready: deque[tuple[int, Any, BaseException | None]] = deque()
        waiting: deque[_Waiting] = deque()
        futures: dict[cf.Future[Any], int] = {}
        admitted = 0
        with cf.ThreadPoolExecutor(self.tool_threads, thread_name_prefix="rtrees-env") as pool:
            try:
                while True:
                    while admitted < len(factories) and len(live) < self.max_programs:
                        live[admitted] = factories[admitted]()
                        ready.append((admitted, None, None))
                        admitted += 1
                    while ready:
                        i, value, exc = ready.popleft()
                        try:
                            req = live[i].throw(exc) if exc is not None else live[i].send(value)
                        except StopIteration as stop:
                            del live[i]
                            results[i] = stop.value
                            if on_done is not None:
                                on_done(i, stop.value)
                            continue
                        if isinstance(req, Work):
                            self.stats.work += 1
                            futures[pool.submit(req.fn)] = i
                        elif isinstance(req, Decode):
                            waiting.append(_new_waiting(i, req))
                        else:
                            raise TypeError(f"a program yielded {type(req).__name__}, "
                                            "not Decode or Work")
                    if not live and admitted == len(factories):
                        break
                    rows_waiting = sum(n for w in waiting for _, _, n in w.parts)
                    if waiting and (not futures or rows_waiting >= self.max_rows):
                        self._decode(waiting, ready)
                        continue
                    if not futures:
                        if admitted < len(factories):
                            continue
                        raise RuntimeError("rollout engine: programs wait on nothing")
                    done, _ = cf.wait(list(futures), return_when=cf.FIRST_COMPLETED,
                                      timeout=self.tool_wait if waiting else None)
                    for fut in done:
                        i = futures.pop(fut)
                        err = fut.exception()
                        ready.append((i, None if err else fut.result(), err))
                    if not done and waiting:
                        self._decode(waiting, ready)
            except BaseException:
                for fut in futures:
                    fut.cancel()
                cf.wait(list(futures))  # work already running ends before its env closes
                for prog in live.values():
                    prog.close()
                raise
        return results

    def _decode(self, waiting: deque[_Waiting],
                ready: deque[tuple[int, Any, BaseException | None]]) -> None:
        """One policy call: waiting parts in arrival order up to ``max_rows`` rows, of the
        first waiting request's ``SampleConfig``."""
        config = waiting[0].decode.config
        budget = self.max_rows
        taken: list[tuple[_Waiting, int, int, int]] = []
        for w in waiting:
            if budget <= 0:
                break
            if w.decode.config != config:
                continue
            while w.parts and budget > 0:
                req, k0, n = w.parts.popleft()
                m = min(n, budget)
                if m < n:
                    w.parts.appendleft((req, k0 + m, n - m))
                taken.append((w, req, k0, m))
                budget -= m
        rows = [Rows(w.decode.rows[req].transcript, m, w.decode.rows[req].seed + k0)
                for w, req, k0, m in taken]
        got = sample_rows(self.policy, rows, replace(config, n=1, seed=None))
        n_rows = sum(r.n for r in rows)
        self.stats.policy_calls += 1
        self.stats.rows += n_rows
        self.stats.max_call_rows = max(self.stats.max_call_rows, n_rows)
        for (w, req, k0, m), conts in zip(taken, got, strict=True):
            w.answers[req][k0:k0 + m] = conts
            w.outstanding -= m
        for w in [w for w in waiting if w.outstanding == 0]:
            waiting.remove(w)
            ready.append((w.program, [list(a) for a in w.answers], None))

    # ----- trees ----------------------------------------------------------------------

    def sample_trees(self, jobs: Sequence[TreeJob],
                     on_tree: Callable[[int, Tree], None] | None = None) -> list[Tree]:
        """One tree per job, all advanced together; ``on_tree(i, tree)`` as each ends."""
        samplers = list({id(j.sampler): j.sampler for j in jobs}.values())
        shared = [j.env for j in jobs if isinstance(j.env, Environment)]
        if len({id(e) for e in shared}) < len(shared):
            raise ValueError("jobs that share one Environment object cannot run together; "
                             "give each job its own or an env factory")
        for s in samplers:
            s.begin_wave()
        try:
            trees: list[Tree] = self.run(
                [partial(job.sampler.tree_program, job, self.policy) for job in jobs], on_tree)
        finally:
            for s in samplers:
                s.end_wave()
        return trees


def _new_waiting(program: int, decode: Decode) -> _Waiting:
    parts = deque((i, 0, r.n) for i, r in enumerate(decode.rows))
    return _Waiting(program, decode, parts, [[None] * r.n for r in decode.rows],
                    sum(r.n for r in decode.rows))


EnvSource = Environment | Callable[[], Environment]


class TreeSampler(Protocol):
    """What the engine needs of a job's sampler (``train.sampling.base.Sampler``)."""

    def begin_wave(self) -> None: ...

    def end_wave(self) -> None: ...

    def tree_program(self, job: TreeJob, policy: Policy) -> Generator[Request, Any, Tree]:
        """The program of one tree (``Sampler.tree_program``)."""
        ...


@dataclass(frozen=True)
class TreeJob:
    """One tree to sample: ``Sampler.sample_tree``'s arguments. ``env`` is an environment
    (owned by the caller) or a factory (the engine makes one and closes it after)."""

    sampler: TreeSampler
    env: EnvSource
    task: Task
    n_total: int
    seed: int
    tree_id: str
    run_id: str = "default"
    phase_seeds: Mapping[str, int] | None = None


__all__ = ["DEFAULT_MAX_PROGRAMS", "DEFAULT_MAX_ROWS", "Decode", "Engine", "EngineStats",
           "EnvSource", "Program", "Request", "TreeJob", "TreeSampler", "Work",
           "default_tool_threads"]
