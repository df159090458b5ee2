"""``check_env(spec)``: the conformance check a user runs before collecting (``rtrees env
check``, issue 44).

Each check is one ``CheckResult`` (``ok``, ``FAIL``, ``warn`` or ``skip`` and a one-line
message); ``FAIL`` is a required check that failed (the CLI exits 1), ``warn`` one that only
limits what the env supports. In order:

* ``build``: ``make_env(spec)`` builds an instance (a spec that does not resolve, or names no
  ``Environment``, is ``EnvSpecError`` from ``check_env`` itself: nothing to report on);
* ``tasks``: ``generate_tasks(tasks, seed)`` gives that many valid tasks (unique ids,
  JSON-able config, positive ``max_steps``), equal across two calls;
* ``tools``: ``tool_schemas()``, when the env has any, pass ``check_tool_schemas``;
* ``expert`` and ``episodes``: one episode per task with the scripted expert (when
  ``expert_action`` is not ``NotImplementedError``) and one with random actions: tool calls
  with random arguments of the declared types and enums, answers, and malformed or hostile
  text. A step that raises, or returns something other than ``(str, bool, {str: float})``
  with a ``"reward"`` part, fails, named by the exception and the action;
* ``native`` (when the class implements ``snapshot``/``restore``), ``replay`` (always) and
  ``fork`` (when ``train.envs.fork`` registers it): over ``prefixes`` random prefixes, a
  snapshot at a random depth (it must be ``bytes``), a random suffix recording observations,
  ``done`` and reward parts, then a restore in the same instance and in a fresh one (as
  another process would) and the same suffix again: the outcomes must be identical, else
  the first diverging step and field are named. Snapshot and restore times are reported
  (p50/p99, ms) beside one env step's. A failure of the class's own ``snapshot_strategy`` is
  ``FAIL``, of another strategy ``warn``;
* ``reseed`` (when the env has ``reseed``): restore + ``reseed(k)`` twice, the same ``k``,
  gives identical outcomes, for each strategy that passed;
* ``thread``: an instance built and stepped on a non-main thread (the engine's tool pool
  does this); an env that needs the main thread must declare ``snapshot_strategy = "fork"``.

The pieces the checks are made of (the actions an ``Actor`` sends, one step checked by
``checked_step``, outcomes compared by ``diverging_field``, the task rules, timings) are
``train.envs.check_steps``; this module runs them in the order above and reports.

``CheckReport.supports`` then lists what the env can be used with: every sampler needs a
restore (any strategy that passed), ``rtrees policy init`` an expert, ``hf:`` policies'
chat templates get tools from ``tool_schemas``, and references, audit and refresh need
snapshots that outlive the process (native or replay; fork falls back to replay).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from train.envs.base import Environment, StepResult, Task
from train.envs.check_steps import (
    Actor,
    CheckFailed,
    checked_step,
    diverging_field,
    first_line,
    fmt_ms,
    guard,
    percentile,
    raised_message,
    to_ms,
    validate_tasks,
)
from train.envs.registry import resolve_env
from train.envs.strategies import SNAPSHOT_STRATEGIES, with_snapshots
from train.envs.tools import ToolSchemaError, check_tool_schemas

Status = Literal["ok", "FAIL", "warn", "skip"]
"""``FAIL``: a required check failed; ``warn``: an optional one did."""

MAX_EPISODE_STEPS = 64
"""Steps after which a check stops an episode that has not ended (and says so)."""
MAX_SUFFIX_STEPS = 16
"""The longest suffix stepped after a snapshot."""
THREAD_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class CheckResult:
    """One check: its name, its status and a one-line message; ``metrics`` holds the
    numbers behind it (timings in ms, counts)."""

    name: str
    status: Status
    message: str
    metrics: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        """``ok    tasks: 3 deterministic``."""
        return f"{self.status:<5} {self.name}: {self.message}"


@dataclass
class CheckReport:
    """Every check of one environment spec, and what the env supports and lacks."""

    spec: str
    env_class: str
    snapshot_strategy: str
    checks: list[CheckResult] = field(default_factory=list)
    supports: list[str] = field(default_factory=list)
    lacks: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Whether no required check failed."""
        return all(c.status != "FAIL" for c in self.checks)

    def summary_lines(self) -> list[str]:
        """The ``supports:`` line and, where something is missing, the ``lacks:`` line."""
        lines = [f"supports: {'; '.join(self.supports) or 'nothing'}"]
        if self.lacks:
            lines.append(f"lacks: {'; '.join(self.lacks)}")
        return lines

    def lines(self) -> list[str]:
        """The report as the CLI prints it: one line per check, then the summary."""
        return [c.line() for c in self.checks] + self.summary_lines()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the report (``--json``)."""
        return {**asdict(self), "passed": self.passed}


class _Checker:
    """The state of one ``check_env`` run."""

    def __init__(self, spec: str, cls: type[Environment], prefixes: int, seed: int,
                 n_tasks: int, emit: Callable[[CheckResult], None] | None) -> None:
        self.spec, self.cls = spec, cls
        self.prefixes, self.seed, self.n_tasks = prefixes, seed, n_tasks
        self.declared = str(getattr(cls, "snapshot_strategy", "native"))
        self.report = CheckReport(spec, f"{cls.__module__}:{cls.__qualname__}", self.declared)
        self.emit = emit
        self.tasks: list[Task] = []
        self.schemas: list[dict[str, Any]] = []
        self.schemas_ok = False
        self.schemas_declared = False
        self.has_expert = False
        self.has_reseed = False
        self.step_times: list[float] = []
        self.passed: list[str] = []

    def add(self, name: str, status: Status, message: str, **metrics: float) -> CheckResult:
        result = CheckResult(name, status, message, dict(metrics))
        self.report.checks.append(result)
        if self.emit is not None:
            self.emit(result)
        return result

    def raw(self) -> Environment:
        """A fresh unwrapped instance (as ``make_env`` builds it, before the strategy)."""
        env = self.cls()
        env.spec = self.spec
        return env

    def made(self) -> Environment:
        """A fresh instance with the class's own strategy (what ``make_env`` returns)."""
        if self.declared == "fork":  # as make_env does: the module registers the strategy
            import train.envs.fork  # noqa: F401
        return with_snapshots(self.raw())

    # ----- build, tasks, tools, expert, episodes -----------------------------------------

    def check_build(self) -> bool:
        try:
            env = self.made()
        except Exception as exc:
            self.add("build", "FAIL", raised_message(f"make_env({self.spec!r})", exc))
            return False
        self.has_reseed = callable(getattr(self.cls, "reseed", None))
        self._close(env)
        self.add("build", "ok", f"{self.report.env_class} (snapshot_strategy "
                                f"{self.declared!r})")
        return True

    def check_tasks(self) -> bool:
        try:
            tasks = self.cls.generate_tasks(self.n_tasks, self.seed)
            again = self.cls.generate_tasks(self.n_tasks, self.seed)
        except Exception as exc:
            self.add("tasks", "FAIL", raised_message(f"generate_tasks({self.n_tasks}, {self.seed})",
                                              exc))
            return False
        problem = validate_tasks(tasks, again, self.n_tasks, self.seed)
        if problem:
            self.add("tasks", "FAIL", problem)
            return False
        self.tasks = tasks
        self.add("tasks", "ok", f"{len(tasks)} deterministic")
        return True

    def check_tools(self) -> None:
        try:
            schemas = self.cls.tool_schemas()
        except Exception as exc:
            self.add("tools", "FAIL", raised_message("tool_schemas()", exc))
            return
        self.schemas_declared = schemas is not None
        if schemas is None:
            self.add("tools", "skip", "tool_schemas() is None (hf: policies get no tool "
                                      "list; random actions are answers and malformed text)")
            return
        if isinstance(schemas, list):  # random calls use them even when they fail below
            self.schemas = [entry for entry in schemas if isinstance(entry, dict)]
        try:
            check_tool_schemas(schemas, self.cls.__name__)
        except ToolSchemaError as exc:
            self.add("tools", "FAIL", str(exc))
            return
        self.schemas_ok = True
        names = ", ".join(str(s["function"]["name"]) for s in schemas)
        self.add("tools", "ok", f"{len(schemas)} valid ({names})")

    def check_expert(self) -> None:
        env = self.made()
        try:
            with guard("reset()"):
                env.reset(self.tasks[0])
            try:
                action = env.expert_action()
            except NotImplementedError:
                self.add("expert", "skip", "none (expert_action raises NotImplementedError): "
                                           "random actions only")
                return
            except Exception as exc:
                self.add("expert", "FAIL", raised_message("expert_action()", exc))
                return
            if not isinstance(action, str):
                self.add("expert", "FAIL", f"expert_action() returned "
                                           f"{type(action).__name__}, not str")
                return
            self.has_expert = True
            self.add("expert", "ok", "expert_action available")
        except CheckFailed as exc:
            self.add("expert", "FAIL", str(exc))
        finally:
            self._close(env)

    def _episode(self, env: Environment, task: Task, actor: Actor) -> tuple[float, int, bool]:
        """One episode: (reward, steps, whether it ended within ``MAX_EPISODE_STEPS``)."""
        with guard(f"reset({task.task_id!r})"):
            first = env.reset(task)
        if not isinstance(first, str):
            raise CheckFailed(f"reset({task.task_id!r}) returned {type(first).__name__}, not str")
        for n in range(1, MAX_EPISODE_STEPS + 1):
            result = checked_step(env, actor.next_action(env), self.step_times)
            if result.done:
                return float(result.reward_parts["reward"]), n, True
        return 0.0, MAX_EPISODE_STEPS, False

    def check_episodes(self) -> None:
        kinds = (["expert"] if self.has_expert else []) + ["random"]
        summary: list[str] = []
        unended = 0
        env = self.made()
        try:
            for kind in kinds:
                rewards, lengths = [], []
                for i, task in enumerate(self.tasks):
                    actor = Actor(random.Random(self.seed * 7919 + i), self.schemas, task,
                                  p_expert=1.0 if kind == "expert" else 0.0)
                    try:
                        reward, steps, ended = self._episode(env, task, actor)
                    except CheckFailed as exc:
                        self.add("episodes", "FAIL", f"{kind} episode of task "
                                                     f"{task.task_id!r}: {exc}")
                        return
                    rewards.append(reward)
                    lengths.append(steps)
                    unended += not ended
                summary.append(f"{len(rewards)} {kind} (mean reward "
                               f"{sum(rewards) / len(rewards):.2f}, "
                               f"{sum(lengths) / len(lengths):.1f} steps)")
        finally:
            self._close(env)
        step = to_ms(percentile(self.step_times, 0.5))
        if unended:
            self.add("episodes", "warn", f"{unended} episode(s) did not end within "
                                         f"{MAX_EPISODE_STEPS} steps (a step limit should "
                                         "end them); " + ", ".join(summary), step_ms=step)
        else:
            self.add("episodes", "ok", ", ".join(summary) + "; no step raised; "
                                       f"step p50 {fmt_ms(step)}", step_ms=step)

    # ----- strategies and reseed ---------------------------------------------------------

    def _prefix(self, i: int, make: Callable[[], Environment], reseed: int | None,
                snaps: list[float], restores: list[float]) -> str | None:
        """One random prefix: snapshot, suffix, restore and the suffix again (same instance,
        then a fresh one). With ``reseed``, every run of the suffix follows a restore and
        ``reseed(reseed)``. The divergence found, or None."""
        rng = random.Random(self.seed * 1_000_003 + i)
        task = self.tasks[i % len(self.tasks)]
        actor = Actor(rng, self.schemas, task, p_expert=0.5 if self.has_expert else 0.0)
        env = make()
        fresh: Environment | None = None
        try:
            with guard("reset()"):
                env.reset(task)
            actions: list[str] = []
            for _ in range(MAX_EPISODE_STEPS):
                actions.append(actor.next_action(env))
                if checked_step(env, actions[-1]).done:
                    break
            depth = rng.randrange(len(actions))
            with guard("reset()"):
                env.reset(task)
            done = False
            for n, action in enumerate(actions[:depth]):
                if checked_step(env, action).done:
                    depth, done = n + 1, True  # not deterministic from reset: snapshot here
                    break
            start = time.perf_counter()
            with guard("snapshot()"):
                snap = env.snapshot()
            snaps.append(time.perf_counter() - start)
            if not isinstance(snap, bytes):
                raise CheckFailed(f"snapshot() returned {type(snap).__name__}, not bytes")
            if reseed is not None:
                self._restore(env, snap, reseed, restores)
            suffix: list[str] = []
            recorded: list[StepResult] = []
            while not done and len(suffix) < MAX_SUFFIX_STEPS:
                suffix.append(actor.next_action(env))
                recorded.append(checked_step(env, suffix[-1]))
                done = recorded[-1].done
            after = "restore" if reseed is None else f"restore+reseed({reseed})"
            for where in ("", " in a fresh instance"):
                if where:
                    with guard("building a fresh instance"):
                        fresh = make()
                target = fresh if fresh is not None else env
                self._restore(target, snap, reseed, restores)
                for j, action in enumerate(suffix):
                    differ = diverging_field(recorded[j], checked_step(target, action))
                    if differ:
                        return (f"prefix {i} (task {task.task_id!r}, snapshot after step "
                                f"{depth}) diverged at step {depth + j + 1} after "
                                f"{after}{where} ({differ})")
            return None
        except CheckFailed as exc:
            return f"prefix {i} (task {task.task_id!r}): {exc}"
        finally:
            self._close(env)
            if fresh is not None:
                self._close(fresh)

    @staticmethod
    def _restore(env: Environment, snap: bytes, reseed: int | None,
                 restores: list[float]) -> None:
        start = time.perf_counter()
        with guard("restore()"):
            env.restore(snap)
        restores.append(time.perf_counter() - start)
        if reseed is not None:
            with guard(f"reseed({reseed})"):
                env.reseed(reseed)  # type: ignore[attr-defined]

    def check_strategy(self, name: str, make: Callable[[], Environment]) -> None:
        bad: Status = "FAIL" if name == self.declared else "warn"
        snaps: list[float] = []
        restores: list[float] = []
        for i in range(self.prefixes):
            problem = self._prefix(i, make, None, snaps, restores)
            if problem:
                self.add(name, bad, problem)
                return
        self.passed.append(name)
        s50, s99 = to_ms(percentile(snaps, 0.5)), to_ms(percentile(snaps, 0.99))
        r50, r99 = to_ms(percentile(restores, 0.5)), to_ms(percentile(restores, 0.99))
        step = to_ms(percentile(self.step_times, 0.5))
        self.add(name, "ok", f"{self.prefixes} prefixes byte-identical; snapshot p50 "
                             f"{fmt_ms(s50)} p99 {fmt_ms(s99)}, restore p50 {fmt_ms(r50)} "
                             f"p99 {fmt_ms(r99)} (step {fmt_ms(step)})",
                 snapshot_p50_ms=s50, snapshot_p99_ms=s99, restore_p50_ms=r50,
                 restore_p99_ms=r99, step_ms=step)

    def strategies(self) -> dict[str, Callable[[], Environment] | str]:
        """Each strategy: how to build an instance with it, or why it is skipped."""
        out: dict[str, Callable[[], Environment] | str] = {}
        cls = self.cls
        if cls.snapshot is not Environment.snapshot or cls.restore is not Environment.restore:
            out["native"] = self.raw
        elif self.declared == "native":
            out["native"] = (f"{cls.__name__} declares snapshot_strategy 'native' but "
                             "implements neither snapshot() nor restore(): implement them, "
                             "or set snapshot_strategy = 'replay'")
        else:
            out["native"] = f"{cls.__name__} does not implement snapshot()/restore()"
        out["replay"] = lambda: with_snapshots(self.raw(), "replay")
        try:
            import train.envs.fork  # noqa: F401  # registers "fork" where the platform can
        except Exception as exc:
            out["fork"] = f"train.envs.fork does not import ({type(exc).__name__}: " \
                          f"{first_line(exc)})"
        else:
            out["fork"] = (lambda: with_snapshots(self.raw(), "fork")) \
                if "fork" in SNAPSHOT_STRATEGIES else "not registered on this platform"
        return out

    def check_strategies(self) -> None:
        for name, how in self.strategies().items():
            if isinstance(how, str):
                required = name == self.declared
                self.add(name, "FAIL" if required else "skip", how)
            else:
                self.check_strategy(name, how)

    def check_reseed(self) -> None:
        if not self.has_reseed:
            self.add("reseed", "skip", "the env has no reseed()")
            return
        builders = self.strategies()
        checked: list[str] = []
        for name in self.passed:
            make = builders[name]
            assert not isinstance(make, str)
            for i in range(self.prefixes):
                problem = self._prefix(i, make, 1 + i % 3, [], [])
                if problem:
                    bad: Status = "FAIL" if name == self.declared else "warn"
                    self.add("reseed", bad, f"{name}: {problem}")
                    return
            checked.append(name)
        if not checked:
            self.add("reseed", "skip", "no strategy passed")
            return
        self.add("reseed", "ok", f"restore+reseed(k) twice gave identical outcomes over "
                                 f"{self.prefixes} prefixes ({', '.join(checked)})")

    # ----- threads and support -----------------------------------------------------------

    def check_thread(self) -> None:
        task = self.tasks[0]

        def work() -> int:
            env = self.made()
            try:
                env.reset(task)
                actor = Actor(random.Random(self.seed), self.schemas, task,
                              p_expert=0.5 if self.has_expert else 0.0)
                steps = 0
                for steps in range(1, 5):  # noqa: B007 - the count is the result
                    if checked_step(env, actor.next_action(env)).done:
                        break
                env.restore(env.snapshot())
                return steps
            finally:
                env.close()

        try:  # on this thread first: a failure here is no threading problem
            work()
        except Exception as exc:
            why = str(exc) if isinstance(exc, CheckFailed) else raised_message(
                "building and stepping it", exc)
            self.add("thread", "skip", f"not tried: fails on the main thread too ({why})")
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="env-check")
        try:
            steps = pool.submit(work).result(timeout=THREAD_TIMEOUT_S)
        except Exception as exc:
            why = str(exc) if isinstance(exc, CheckFailed) else raised_message(
                "building and stepping it", exc)
            if self.declared == "fork":
                self.add("thread", "ok", f"needs the main thread ({why}); snapshot_strategy "
                                         "'fork' runs it on a worker process's main thread")
            else:
                self.add("thread", "FAIL", f"off the main thread: {why}; the engine steps "
                                           "envs on tool-pool threads: an env that needs "
                                           "the main thread sets snapshot_strategy = 'fork'")
            return
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        self.add("thread", "ok", f"built, stepped ({steps} steps), snapshotted and restored "
                                 "on a non-main thread")

    def summarise(self, samplers: Sequence[str] | None) -> None:
        supports, lacks = self.report.supports, self.report.lacks
        if self.passed:
            supports.append(f"{', '.join(samplers)} samplers" if samplers else "all samplers")
        else:
            lacks.append("samplers (every sampler restores snapshots: no strategy passed)")
        if "native" in self.passed or "replay" in self.passed:
            supports += ["references", "audit", "refresh"]
        else:
            lacks.append("references, audit, refresh (they need snapshots that outlive the "
                         "process: native or replay)")
        if self.has_expert:
            supports.append("policy init (expert)")
        else:
            lacks.append("policy init (no expert_action)")
        if self.schemas_ok and self.schemas:
            supports.append("hf: policies get its tools")
        else:
            why = "tool_schemas() failed the check" if self.schemas_declared else \
                "tool_schemas() is None"
            lacks.append(f"tools for hf: policies ({why})")

    @staticmethod
    def _close(env: Environment) -> None:
        with suppress(Exception):  # a close that fails must not hide the check's result
            env.close()


def check_env(spec: str, *, prefixes: int = 20, seed: int = 0, tasks: int = 3,
              samplers: Sequence[str] | None = None,
              on_result: Callable[[CheckResult], None] | None = None) -> CheckReport:
    """Check the environment of ``spec`` (module docstring) over ``tasks`` tasks of
    ``seed`` and ``prefixes`` random prefixes per strategy; ``on_result`` sees each check
    as it finishes. ``samplers`` names the samplers in ``supports`` (the caller passes
    ``train.sampling.SAMPLERS``: envs do not import samplers, data flows the other way).
    ``EnvSpecError`` when the spec does not resolve to an ``Environment`` class; every
    other problem is a ``FAIL`` in the report."""
    if prefixes < 1 or tasks < 1:
        raise ValueError(f"prefixes and tasks must be at least 1, got {prefixes} and {tasks}")
    cls = resolve_env(spec)
    run = _Checker(spec, cls, prefixes, seed, tasks, on_result)
    if run.check_build() and run.check_tasks():
        run.check_tools()
        run.check_expert()
        run.check_episodes()
        run.check_strategies()
        run.check_reseed()
        run.check_thread()
    run.summarise(samplers)
    return run.report


__all__ = ["CheckReport", "CheckResult", "Status", "check_env"]
