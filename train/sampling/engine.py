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
until each waits on a ``Decode`` or a ``Work``; ``Work`` goes to the pool at once.

*Continuous mode* (the default, for a policy with a ``decoder``: the HF backend). The
engine keeps one running decoding batch (rows of any ``SampleConfig``: each row samples
with its own temperature, ``top_p`` and token cap) and ticks: (1) advance the
programs that have answers; (2) admit waiting rows into the batch, in arrival order, up
to ``max_rows`` live rows (a request is split at the budget: branch k of
``Rows(t, n, s)`` draws from stream ``s + k``, so its parts draw what the whole would),
once they are worth a prefill (``ADMIT_EVERY``); (3) one decode step, one token for
every live row, rows whose agent step ended leave and are handed back (a program whose
round is complete becomes ready); (4) wait for the work submitted in (1), which ran in
the pool during the step, and queue its answers in submission order. So a row never
waits for the slowest row of a call, and new rows join as old ones finish; step (4)
makes the order of events a function of the programs alone, never of thread timing,
so a run is reproducible bit for bit (exact resume, goldens).

*Whole-call mode* (``continuous=False``, or a policy without a decoder: tabular,
vLLM). A policy call is made when rows wait and either no environment work is running
or ``max_rows`` rows wait (or ``tool_wait`` seconds passed since the last one
finished): it takes the waiting requests in arrival order up to ``max_rows`` rows, as
ONE ``sample_rows`` call per distinct ``SampleConfig`` (vLLM: one ``generate`` over the
wavefront). A program whose round is split over several calls receives it when all its
parts came back.

Why continuous batching on the tiny model: calc steps take 10-20 tokens but a sampled
row can ramble to ``max_new_tokens``; a whole call lasts as long as its longest row,
so most forwards of a call carried a few rows (measured, 64 calc trees x 16 rollouts,
128-token cap: 28.7 rows per forward of a 128-row budget).

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
from typing import Any, Protocol, cast

from rollout_store.tree import Tree
from train.envs.base import Environment, Task
from train.policies.base import (
    Continuation,
    Decoder,
    Policy,
    Rows,
    SampleConfig,
    sample_rows,
)


@dataclass(frozen=True)
class Decode:
    """Ask for one agent step of each request (answer: ``list[list[Continuation]]``)."""

    rows: Sequence[Rows]
    config: SampleConfig


@dataclass(frozen=True)
class Work:
    """Run ``fn()`` in the tool pool (answer: its return value; an exception is thrown
    into the program).

    ``lag`` (continuous mode): decode steps the work may take without holding up the
    decoder. Its answer is collected ``lag`` decode steps after it was submitted (when
    no row is decoding, at once), so slow tools overlap that many steps of the other
    trees' decoding. Which step an answer arrives at is a function of the programs, never
    of thread timing: 0 (the default) collects it after the next decode step. Lagged
    work runs in its own larger pool (``LAGGED_TOOL_THREADS``: such tools mostly wait)."""

    fn: Callable[[], Any]
    lag: int = 0


Request = Decode | Work
Program = Generator[Request, Any, Any]

DEFAULT_MAX_ROWS = 128
DEFAULT_MAX_PROGRAMS = 64
LAGGED_TOOL_THREADS = 64
"""Threads of the pool for lagged work (``Work.lag`` > 0: tools that wait, e.g. on a
remote call; one per program in flight)."""


def default_tool_threads() -> int:
    """Threads for environment work: 4 per usable CPU, at most 16 (tools mostly wait on
    subprocesses or are short Python calls)."""
    return max(2, min(16, 4 * len(os.sched_getaffinity(0))))


@dataclass
class EngineStats:
    """What one ``Engine.run`` did: policy calls (in continuous mode, decode steps: one
    token of every live row), rows decoded, environment work items, and the most rows
    of one call."""

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


@dataclass
class _Lane:
    """The continuous decoder and how many steps since rows last joined it."""

    decoder: Decoder
    steps_since_admit: int = 0


ADMIT_EVERY = 4
"""Continuous mode: rows waiting for a running decoder join it once they are at least an
eighth of ``max_rows`` (or fill every free position), or after this many steps (each
admission is one prefill forward: admitting one row per step would nearly double the
forwards)."""


class Engine:
    """Runs programs (module docstring) against one ``policy``.

    ``max_rows``: the row (branch) budget of one policy call, or of the rows decoding at
    once in continuous mode; ``max_programs``: programs in flight (each holds its
    environment); ``tool_threads``: the environment pool (default
    ``default_tool_threads()``); ``tool_wait``: in whole-call mode, how long a policy
    call waits for running environment work to add rows before it starts with what is
    there. ``continuous`` (default): when the policy has a ``decoder`` (the HF backend),
    rows join and leave one decoding batch between tokens; else, and with
    ``continuous=False``, each ``Decode`` round is answered by whole ``sample_rows``
    calls.
    """

    def __init__(self, policy: Policy, *, max_rows: int = DEFAULT_MAX_ROWS,
                 max_programs: int = DEFAULT_MAX_PROGRAMS, tool_threads: int | None = None,
                 tool_wait: float = 0.05, continuous: bool = True) -> None:
        if max_rows < 1 or max_programs < 1:
            raise ValueError(f"max_rows and max_programs must be >= 1, got {max_rows}, "
                             f"{max_programs}")
        self.policy = policy
        self.max_rows, self.max_programs = max_rows, max_programs
        self.tool_threads = tool_threads or default_tool_threads()
        self.tool_wait = tool_wait
        self.continuous = continuous and callable(getattr(policy, "decoder", None))
        self.stats = EngineStats()

    # ----- the core -------------------------------------------------------------------

    def run(self, programs: Iterable[Callable[[], Program]],
            on_done: Callable[[int, Any], None] | None = None,
            on_failure: Callable[[int, Exception], None] | None = None) -> list[Any]:
        """Run every program (given as factories, created when admitted) to its end;
        returns their return values in order. ``on_done(i, value)`` is called as each
        one ends. An exception in a program closes the others and is raised; with
        ``on_failure``, an ``Exception`` escaping program ``i`` (its environment raised,
        every rollout of its tree diverged on replay, its budget was not spent; a tree
        builder drops a single divergent rollout itself, ``train.sampling.base``) is
        passed to ``on_failure(i, exc)``
        instead, its result stays None and the others go on. A failure of the policy
        (outside any program) is always raised."""
        factories = list(programs)
        results: list[Any] = [None] * len(factories)
        live: dict[int, Program] = {}
        ready: deque[tuple[int, Any, BaseException | None]] = deque()
        waiting: deque[_Waiting] = deque()
        futures: dict[cf.Future[Any], int] = {}
        due: dict[cf.Future[Any], int] = {}  # continuous mode: the decode step it is due
        lane = _Lane(getattr(self.policy, "decoder")()) if self.continuous else None  # noqa: B009
        admitted = 0
        clock = 0  # decode steps so far (continuous mode)
        lagged: cf.ThreadPoolExecutor | None = None
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
                        except Exception as failed:  # the program's own failure
                            if on_failure is None:
                                raise
                            del live[i]  # it ended (its finally closed its environment)
                            on_failure(i, failed)
                            continue
                        if isinstance(req, Work):
                            self.stats.work += 1
                            if req.lag > 0 and lane is not None:
                                if lagged is None:
                                    lagged = cf.ThreadPoolExecutor(
                                        LAGGED_TOOL_THREADS, thread_name_prefix="rtrees-tool")
                                fut = lagged.submit(req.fn)
                            else:
                                fut = pool.submit(req.fn)
                            futures[fut] = i
                            if lane is not None:
                                due[fut] = clock + max(0, req.lag)
                        elif isinstance(req, Decode):
                            waiting.append(_new_waiting(i, req))
                        else:
                            raise TypeError(f"a program yielded {type(req).__name__}, "
                                            "not Decode or Work")
                    if not live and admitted == len(factories):
                        break
                    if lane is not None:  # continuous mode
                        self._admit(waiting, lane)
                        busy = bool(lane.decoder.live)
                        if busy:
                            self._step(lane, ready)
                            clock += 1
                        elif futures:  # nothing decodes: the next due work is due now
                            clock = max(clock, min(due.values()))
                        if futures:  # the work due by this step, in submission order
                            _collect_due(futures, due, clock, ready)
                            continue
                        if busy:
                            continue
                    else:
                        rows_waiting = sum(n for w in waiting for _, _, n in w.parts)
                        if waiting and (not futures or rows_waiting >= self.max_rows):
                            self._decode(waiting, ready)
                            continue
                    if not futures:
                        if admitted < len(factories):
                            continue
                        raise RuntimeError("rollout engine: programs wait on nothing")
                    timeout = self.tool_wait if waiting and not self.continuous else None
                    if not _collect(futures, ready, timeout) and waiting \
                            and not self.continuous:
                        self._decode(waiting, ready)
            except BaseException:
                for fut in futures:
                    fut.cancel()
                cf.wait(list(futures))  # work already running ends before its env closes
                for prog in live.values():
                    prog.close()
                raise
            finally:
                if lagged is not None:
                    lagged.shutdown(wait=True)
        return results

    def _take(self, waiting: deque[_Waiting], config: SampleConfig | None, budget: int
              ) -> list[tuple[_Waiting, int, int, int]]:
        """Waiting parts (of ``config``; of any when None) in arrival order up to
        ``budget`` rows, as ``(waiting, request, first branch, branches)`` (a request split
        at the budget keeps its other branches waiting); fully taken entries leave
        ``waiting``."""
        taken: list[tuple[_Waiting, int, int, int]] = []
        for w in waiting:
            if budget <= 0:
                break
            if config is not None and w.decode.config != config:
                continue
            while w.parts and budget > 0:
                req, k0, n = w.parts.popleft()
                m = min(n, budget)
                if m < n:
                    w.parts.appendleft((req, k0 + m, n - m))
                taken.append((w, req, k0, m))
                budget -= m
        for w in {id(w): w for w, *_ in taken}.values():
            if not w.parts:
                waiting.remove(w)
        return taken

    def _decode(self, waiting: deque[_Waiting],
                ready: deque[tuple[int, Any, BaseException | None]]) -> None:
        """Whole-call mode: one policy call over waiting parts in arrival order up to
        ``max_rows`` rows, of the first waiting request's ``SampleConfig``."""
        config = waiting[0].decode.config
        taken = self._take(waiting, config, self.max_rows)
        rows = [Rows(w.decode.rows[req].transcript, m, w.decode.rows[req].seed + k0)
                for w, req, k0, m in taken]
        got = sample_rows(self.policy, rows, replace(config, n=1, seed=None))
        n_rows = sum(r.n for r in rows)
        self.stats.policy_calls += 1
        self.stats.rows += n_rows
        self.stats.max_call_rows = max(self.stats.max_call_rows, n_rows)
        for (w, req, k0, _), conts in zip(taken, got, strict=True):
            for k, cont in enumerate(conts):
                _answer(w, req, k0 + k, cont, ready)

    def _admit(self, waiting: deque[_Waiting], lane: _Lane) -> None:
        """Continuous mode: waiting rows join the decoder in arrival order, whatever their
        ``SampleConfig`` (``ADMIT_EVERY``)."""
        decoder = lane.decoder
        free = self.max_rows - decoder.live
        if not waiting or free <= 0 or not decoder.accepting:
            return
        rows_waiting = sum(n for w in waiting for _, _, n in w.parts)
        if decoder.live and rows_waiting < min(free, max(1, self.max_rows // 8)) \
                and lane.steps_since_admit < ADMIT_EVERY:
            return
        taken = self._take(waiting, None, free)
        by_config: dict[SampleConfig, list[tuple[_Waiting, int, int, int]]] = {}
        for part in taken:
            by_config.setdefault(part[0].decode.config, []).append(part)
        for config, parts in by_config.items():
            decoder.add([Rows(w.decode.rows[req].transcript, m, w.decode.rows[req].seed + k0)
                         for w, req, k0, m in parts],
                        [(w, req, k0) for w, req, k0, _ in parts],
                        replace(config, n=1, seed=None))
        lane.steps_since_admit = 0
        self.stats.rows += sum(m for *_, m in taken)

    def _step(self, lane: _Lane, ready: deque[tuple[int, Any, BaseException | None]]
              ) -> None:
        """Continuous mode: one token for every row of ``lane``'s decoder."""
        self.stats.policy_calls += 1
        self.stats.max_call_rows = max(self.stats.max_call_rows, lane.decoder.live)
        lane.steps_since_admit += 1
        for tag, k, cont in lane.decoder.step():
            w, req, k0 = cast(tuple[_Waiting, int, int], tag)  # the tags _admit gave
            _answer(w, req, k0 + k, cont, ready)

    # ----- trees ----------------------------------------------------------------------

    def sample_trees(self, jobs: Sequence[TreeJob],
                     on_tree: Callable[[int, Tree], None] | None = None,
                     on_failure: Callable[[int, Exception], None] | None = None
                     ) -> list[Tree]:
        """One tree per job, all advanced together; ``on_tree(i, tree)`` as each ends.
        With ``on_failure`` (``run``), a tree whose program failed is reported there and
        left out of the returned list; without it, the failure is raised."""
        samplers = list({id(j.sampler): j.sampler for j in jobs}.values())
        shared = [j.env for j in jobs if isinstance(j.env, Environment)]
        if len({id(e) for e in shared}) < len(shared):
            raise ValueError("jobs that share one Environment object cannot run together; "
                             "give each job its own or an env factory")
        for s in samplers:
            s.begin_wave()
        try:
            trees: list[Tree | None] = self.run(
                [partial(job.sampler.tree_program, job, self.policy) for job in jobs], on_tree,
                on_failure)
        finally:
            for s in samplers:
                s.end_wave()
        return [t for t in trees if t is not None]


def _answer(w: _Waiting, request: int, branch: int, cont: Continuation,
            ready: deque[tuple[int, Any, BaseException | None]]) -> None:
    """Record one row's continuation; the program is ready once its round is complete."""
    w.answers[request][branch] = cont
    w.outstanding -= 1
    if w.outstanding == 0:
        ready.append((w.program, [list(a) for a in w.answers], None))


def _collect(futures: dict[cf.Future[Any], int],
             ready: deque[tuple[int, Any, BaseException | None]],
             timeout: float | None) -> bool:
    """Move finished environment work to ``ready`` (waiting up to ``timeout`` seconds for
    the first; ``None``: until one finishes); whether any finished."""
    if not futures:
        return False
    done, _ = cf.wait(list(futures), return_when=cf.FIRST_COMPLETED, timeout=timeout)
    for fut in done:
        i = futures.pop(fut)
        err = fut.exception()
        ready.append((i, None if err else fut.result(), err))
    return bool(done)


def _collect_due(futures: dict[cf.Future[Any], int], due: dict[cf.Future[Any], int],
                 clock: int, ready: deque[tuple[int, Any, BaseException | None]]) -> None:
    """Wait for every work item due by decode step ``clock`` (``Work.lag``) and move them
    to ``ready`` in submission order (continuous mode: which step a program's answer
    arrives at never depends on thread timing)."""
    now = [fut for fut in futures if due[fut] <= clock]
    cf.wait(now)
    for fut in now:
        i = futures.pop(fut)
        del due[fut]
        err = fut.exception()
        ready.append((i, None if err else fut.result(), err))


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
