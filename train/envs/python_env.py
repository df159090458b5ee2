"""``python``: a sandboxed code interpreter tool for tool-integrated reasoning
as in ToRL and ELPO.

Episode format (the text protocol of ``train.envs.base``)::

    reset  -> "A bakery sells muffins ... How many dollars did it take in? ..."
    action -> <tool_call>{"name": "python", "arguments": {"code": "print(3*47 + 2*85)"}}</tool_call>
    obs    <- <tool_response>311\n</tool_response>
    action -> <answer>311</answer>
    obs    <- ""                                          done=True, reward 1.0

* One tool, ``python``, one string argument ``code`` (``TOOL_SCHEMA``). The code
  runs in a bubblewrap sandbox (``train.envs.sandbox``: read-only system
  directories, a private tmpfs work directory, no network, all namespaces
  unshared, no capabilities, an unprivileged uid, rlimits on CPU, memory, file
  size, open files and processes, a wall-clock limit). The response is the
  call's stdout, then its stderr, then the last line of its exception
  (``ZeroDivisionError: division by zero``); each stream is capped at
  ``output_bytes`` with a note of how much was cut. As in a notebook, a final
  bare expression is echoed (``2+3`` answers ``5``).
* The interpreter keeps its state across the calls of an episode: variables,
  imports, functions, and files written under the work directory ``/sandbox``.
  Before every call ``random`` is seeded with ``"{seed}:{call index}"`` (and
  ``numpy.random`` if the code imported numpy), and ``PYTHONHASHSEED=0``, so
  calls are reproducible; code that reads the clock, the pid or memory addresses
  is not, and nothing can make it so.
* A call that breaks a sandbox limit is rolled back: past the wall-clock limit,
  killing the interpreter (``os._exit``, a fatal signal, the CPU limit), or
  leaving processes or threads running after it ends. The sandbox is killed
  (with everything in it), the observation is an ``error:``, and the next call
  runs in a fresh interpreter holding the state from before the failed call. A
  Python exception (``MemoryError`` from the address-space limit included) is
  not a limit: the call stays in the history with whatever it did before raising.
* Any action that is not a well-formed ``python`` call or an answer (bad JSON,
  unknown tool, missing or non-string ``code``, code over ``max_code_chars``)
  gets a deterministic ``<tool_response>error: ...</tool_response>``; it never
  raises.
* ``<answer>X</answer>`` ends the episode, observation ``""``; reward 1.0 when
  ``X`` equals the gold answer (``python_tasks.answers_match``: numbers by exact
  value, so ``311``, ``311.0`` and ``\\boxed{311}`` all count), else 0.0.
  After ``Task.max_steps`` steps without an answer the episode ends with reward
  0.0. Steps after the end return ``error: episode is over`` and change nothing.
* ``reward_parts``: ``reward`` (0.0 until the end), ``tool_calls`` (actions that
  parsed as a tool call, any tool), ``tool_errors`` (steps answered with an error
  or an exception), ``truncated`` (1.0 when the step limit ended the episode).

Snapshots are **replay-based**: a snapshot is canonical JSON of the episode
(task, counters, seed) plus the source of every call that is part of the
interpreter's state. ``restore`` is lazy and needs no replay by the caller: the
next call (or ``sync()``) brings an interpreter to that state, re-running the
missing calls inside the sandbox in one round trip with their output discarded,
in the live interpreter when its history is a prefix of the target, else in a
fresh one (``prewarm`` keeps one started in the background, so that costs a
replay, not a startup). So a restore costs the CPU time of the episode's calls,
which for typical calls is far below the sandbox's startup time, but it does grow
with the episode (``benchmarks/bench_python_tool.py`` reports the ratio to
replaying the episode from the start through ``step``). Pickling the namespace
instead would miss files, processes' effects, functions and classes defined in
cells (not picklable by reference), and would change set iteration orders after
an unpickle, breaking byte-identical restores; replay has none of these problems
as long as the calls are deterministic.

Tasks come from ``PythonEnv.generate_tasks`` (20 built-in word problems with
integer answers and reference solutions, or a user JSONL/Parquet file); the
scripted expert runs the reference solution and answers what it printed.

Example::

    >>> env = PythonEnv()                                          # doctest: +SKIP
    >>> env.reset(PythonEnv.generate_tasks(1, seed=0)[0])          # doctest: +SKIP
    >>> env.step(python_call("x = 6 * 7"))                         # doctest: +SKIP
    StepResult(observation='<tool_response></tool_response>', done=False, ...)
    >>> env.step(python_call("print(x)")).observation              # doctest: +SKIP
    '<tool_response>42\\n</tool_response>'
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from train.envs.base import OneToolEnv, Task, error_response, load_snapshot, tool_response
from train.envs.preamble import system_preamble
from train.envs.python_tasks import (
    DEFAULT_MAX_STEPS,
    answers_match,
    builtin_tasks,
    load_task_file,
)
from train.envs.sandbox import (
    CellRequest,
    CellResult,
    RunOutcome,
    Sandbox,
    sandbox_mode,
)
from train.envs.sandbox_isolation import SandboxConfig

TOOL_NAME = "python"
TOOL_SCHEMA: dict[str, Any] = {
    "name": TOOL_NAME,
    "description": "Run Python 3 code in a sandboxed interpreter that keeps its state between "
                   "calls; returns what the code prints (and the last line of an exception). "
                   "A final bare expression is echoed. No network; standard library only.",
    "parameters": {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "e.g. print(17 * 23)"}},
        "required": ["code"],
        "additionalProperties": False,
    },
}
SNAPSHOT_FORMAT = "python/1"


@dataclass(frozen=True)
class PythonEnvConfig(SandboxConfig):
    """Configuration of ``PythonEnv``: every ``SandboxConfig`` field (limits, paths,
    ``allow_unsafe``) plus the episode-level ones below. ``make_env("python", **kw)``
    and ``PythonEnv(**kw)`` take any of them as keywords."""

    seed: int = 0
    """Seeds ``random`` before call i with ``"{seed}:{i}"``; stored in snapshots."""
    prewarm: bool = True
    """Keep a second sandbox started in the background, so that a reset or a restore
    that needs a fresh interpreter does not wait for one to start."""
    max_code_chars: int = 65536
    """Longer ``code`` is refused with an error observation (bounds the replay cost)."""
    system_prompt_chars: int = 0
    """Characters of a shared system prompt rendered ahead of every task
    (``train.envs.preamble``); 0 (the default) renders none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_code_chars < 1:
            raise ValueError("PythonEnvConfig.max_code_chars must be positive")


@dataclass
class _State:
    """A python episode; its snapshot is the task, the counters, the seed and the source of
    every call in the interpreter's state."""

    task: Task
    seed: int
    cells: list[str] = field(default_factory=list)
    """Source of every call that is part of the interpreter's state, in order."""
    steps: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    reward: float = 0.0
    truncated: bool = False
    last_code: str | None = None
    """The last python call's code, its stdout and whether it ran cleanly (for the expert)."""
    last_stdout: str = ""
    last_ok: bool = False


_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "seed": int, "cells": list, "steps": int, "tool_calls": int, "tool_errors": int,
    "done": bool, "reward": float, "truncated": bool, "last_code": (str, type(None)),
    "last_stdout": str, "last_ok": bool}


@dataclass
class _Interpreter:
    """A live sandbox and the calls it has run (a prefix of some episode's history)."""

    sandbox: Sandbox
    cells: list[str]


def python_call(code: str) -> str:
    """The action text of a ``python`` call, in the canonical spelling the expert uses."""
    return f"<tool_call>{json.dumps({'name': TOOL_NAME, 'arguments': {'code': code}})}</tool_call>"


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def _safe_text(text: str) -> str:
    """No lone surrogates reach a tokenizer (an exception message can carry one)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def format_output(result: CellResult, output_bytes: int) -> str:
    """The tool response body: stdout, stderr, then the exception's last line; each
    stream cut at ``output_bytes`` with a note of how much more there was."""
    text = ""
    for name, body, size in (("stdout", result.stdout, result.stdout_bytes),
                             ("stderr", result.stderr, result.stderr_bytes)):
        text += body
        if size > output_bytes:
            text += ("" if text.endswith("\n") else "\n") + \
                f"[{size - output_bytes} more bytes of {name} cut]\n"
    if result.error is not None:
        text += ("" if not text or text.endswith("\n") else "\n") + result.error
    return _safe_text(text)


class PythonEnv(OneToolEnv[_State]):
    """A sandboxed Python interpreter tool with word-problem tasks (see the module docstring).

    Holds up to two sandbox processes (the live interpreter and, with ``prewarm``, a
    spare); ``close()`` or the context manager ends them. Raises ``SandboxUnavailable``
    at construction when bwrap cannot run here and ``allow_unsafe`` is not set.
    """

    name: ClassVar[str] = "python"
    tool: ClassVar[dict[str, Any]] = TOOL_SCHEMA
    snapshot_format: ClassVar[str] = SNAPSHOT_FORMAT

    def __init__(self, config: PythonEnvConfig | None = None, **overrides: Any) -> None:
        config = config or PythonEnvConfig()
        if overrides:
            known = {f.name for f in dataclasses.fields(PythonEnvConfig)}
            unknown = sorted(set(overrides) - known)
            if unknown:
                raise TypeError(f"unknown PythonEnv option(s) {unknown}; choose from "
                                f"{sorted(known)}")
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self.unsafe = sandbox_mode(config) == "unsafe"
        self._state: _State | None = None
        self._live: _Interpreter | None = None
        self._spare: Sandbox | None = None
        self._dying: list[Sandbox] = []  # killed, not yet reaped (teardown takes ms)

    # -- episode -----------------------------------------------------------

    def reset(self, task: Task) -> str:
        solution = task.config.get("solution")
        if solution is not None and not isinstance(solution, str):
            raise ValueError(f"python task {task.task_id!r}: config['solution'] must be code")
        self._state = _State(task=task, seed=self.config.seed)
        if self._live is not None and self._live.cells:
            self._discard_live()
        if self.config.prewarm and self._live is None and self._spare is None:
            self._spare = self._new_sandbox()
        return system_preamble(self.name, [self.tool], self.config.system_prompt_chars) \
            + task.prompt

    def _grade(self, s: _State, answer: str) -> float:
        return 1.0 if answers_match(answer, s.task.answer) else 0.0

    def _run_tool(self, s: _State, arguments: dict[str, Any]) -> tuple[str, bool]:
        code: str = arguments["code"]
        if len(code) > self.config.max_code_chars:
            return error_response(f"code is longer than {self.config.max_code_chars} "
                                  f"characters"), True
        return self._call(s, code)

    # -- the interpreter ---------------------------------------------------

    def _new_sandbox(self) -> Sandbox:
        return Sandbox(self.config, unsafe=self.unsafe)

    def _discard(self, sandbox: Sandbox) -> None:
        sandbox.close(wait=False)
        self._dying.append(sandbox)

    def _discard_live(self) -> None:
        if self._live is not None:
            self._discard(self._live.sandbox)
            self._live = None

    def _reap(self, block: bool) -> None:
        self._dying = [sandbox for sandbox in self._dying if not sandbox.reap(block)]

    def _interpreter(self, cells: list[str]) -> tuple[_Interpreter, list[CellRequest]]:
        """An interpreter whose history is a prefix of ``cells``, and the replay that
        brings it to ``cells``: the live one when it fits, else a fresh sandbox."""
        self._reap(block=False)
        live = self._live
        if (live is None or not live.sandbox.alive or len(live.cells) > len(cells)
                or live.cells != cells[:len(live.cells)]):
            self._discard_live()
            sandbox = self._spare if self._spare is not None and self._spare.alive \
                else self._new_sandbox()
            if self._spare is not None and self._spare is not sandbox:
                self._discard(self._spare)
            self._spare = self._new_sandbox() if self.config.prewarm else None
            live = self._live = _Interpreter(sandbox, [])
        seed = self._require().seed
        replay = [CellRequest(code, f"{seed}:{i}", output=False)
                  for i, code in enumerate(cells) if i >= len(live.cells)]
        return live, replay

    def _run(self, cells: list[str], new: CellRequest | None) -> tuple[RunOutcome, str | None]:
        """Bring an interpreter to ``cells`` and run ``new`` after them. Returns the outcome
        and, when the replay itself failed, an error message (the interpreter is then gone)."""
        live, replay = self._interpreter(cells)
        outcome = live.sandbox.run(replay + ([new] if new is not None else []))
        done = outcome.results[:len(replay)]
        live.cells.extend(cells[len(live.cells):len(live.cells) + len(done)])
        bad = next((i for i, r in enumerate(done) if r.strays or r.threads), None)
        if bad is None and len(done) == len(replay):
            return outcome, None
        index = len(cells) - len(replay) + (bad if bad is not None else len(done))
        reason = "left processes or threads running" if bad is not None else outcome.status
        self._discard_live()
        return outcome, (f"the interpreter could not be restored to this episode's state "
                         f"(re-running call {index + 1} of {len(cells)} failed: {reason}); "
                         f"the call was not run")

    def _call(self, s: _State, code: str) -> tuple[str, bool]:
        """Run one call; returns (observation, is_error) and commits it to the history
        unless it broke a limit (then the interpreter is killed: the call is rolled back)."""
        request = CellRequest(code, f"{s.seed}:{len(s.cells)}", output=True)
        outcome, replay_error = self._run(s.cells, request)
        s.last_code, s.last_stdout, s.last_ok = code, "", False
        if replay_error is not None:
            return error_response(replay_error), True
        rolled_back = "the interpreter was restarted with its state from before this call"
        if outcome.status != "ok":
            self._discard_live()
            if outcome.status == "timeout":
                message = (f"the call exceeded the {self.config.timeout_s:g} s time limit and "
                           f"was stopped; {rolled_back}")
            elif outcome.status == "memory":
                message = (f"the call's processes used more than "
                           f"{self.config.total_memory_bytes >> 20} MiB of memory together "
                           f"and were stopped; {rolled_back}")
            elif outcome.status == "died":
                message = ("the interpreter exited during the call (os._exit, a fatal signal "
                           f"or the CPU-time limit); {rolled_back}")
            else:
                message = f"the call broke the interpreter's answer channel; {rolled_back}"
            return error_response(message), True
        result = outcome.results[-1]
        if result.strays or result.threads:
            self._discard_live()
            left = (f"{result.strays} background process(es)" if result.strays
                    else f"{result.threads} background thread(s)")
            return error_response(f"the call left {left} running; they were stopped and "
                                  f"{rolled_back}"), True
        assert self._live is not None
        s.cells.append(code)
        self._live.cells.append(code)
        s.last_stdout, s.last_ok = result.stdout, result.error is None
        return tool_response(format_output(result, self.config.output_bytes)), \
            result.error is not None

    def sync(self) -> None:
        """Bring the interpreter to the current state now (``restore`` is lazy: the next
        call would otherwise do it). ``RuntimeError`` if the history cannot be replayed."""
        s = self._require()
        outcome, error = self._run(s.cells, None)
        if error is not None:
            raise RuntimeError(f"PythonEnv.sync: {error}; {outcome.detail}")

    def wait_ready(self) -> None:
        """Block until the sandboxes this env holds have started (the spare starts in the
        background) and discarded ones are gone; for predictable latency, e.g. in
        benchmarks. Never raises: a sandbox that failed to start is replaced on the next
        call."""
        self._reap(block=True)
        for sandbox in (self._live.sandbox if self._live else None, self._spare):
            if sandbox is not None:
                sandbox.wait_ready()

    # -- snapshot ----------------------------------------------------------

    def restore(self, state: bytes) -> None:
        """Return to a snapshot's state (``ValueError`` if it is not a python snapshot).

        Lazy: the interpreter is brought to the state by the next call or ``sync()``.
        """
        try:
            data = load_snapshot(state, SNAPSHOT_FORMAT)
            restored = _State(task=Task(**data.pop("task")), **data)
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a python snapshot: {exc}") from None
        for name, kind in _STATE_TYPES.items():
            if not isinstance(getattr(restored, name), kind):
                raise ValueError(f"not a python snapshot: {name!r} must be {kind}")
        if not all(isinstance(c, str) for c in restored.cells):
            raise ValueError("not a python snapshot: 'cells' must be a list of strings")
        t = restored.task
        if not (isinstance(t.task_id, str) and isinstance(t.prompt, str)
                and isinstance(t.max_steps, int) and isinstance(t.config, dict)
                and (t.answer is None or isinstance(t.answer, str))):
            raise ValueError("not a python snapshot: malformed task")
        self._state = restored

    # -- expert and tasks --------------------------------------------------

    def expert_action(self) -> str:
        """Run the task's reference solution, then answer the last line it printed.

        Tasks without a solution are answered with the gold answer directly; with one
        step left, the expert answers at once (what was printed, else the gold answer).
        """
        s = self._require()
        if s.done:
            raise RuntimeError("PythonEnv.expert_action: the episode is over")
        solution = s.task.config.get("solution")
        printed = (s.last_stdout.strip().splitlines()[-1].strip()
                   if s.last_ok and s.last_code == solution and s.last_stdout.strip() else None)
        if printed is not None:
            return answer_text(printed)
        if not isinstance(solution, str) or not solution or s.steps + 1 >= s.task.max_steps:
            return answer_text(s.task.answer or "")
        return python_call(solution)

    @classmethod
    def generate_tasks(cls, n: int, seed: int, task_file: str | Path | None = None,
                       **mix: Any) -> list[Task]:
        """``n`` tasks drawn from the built-in problems, or from ``task_file``.

        Draws go through seeded shuffles of the whole pool, one after another, so every
        task appears once before any repeats and ``generate_tasks(k, s)`` is a prefix of
        ``generate_tasks(n, s)``. A task keeps its id when drawn again (it is the same
        problem). Mix option: ``max_steps`` (default 6; rows of a task file may set their
        own).
        """
        options: dict[str, Any] = {"max_steps": DEFAULT_MAX_STEPS}
        unknown = sorted(set(mix) - set(options))
        if unknown:
            raise ValueError(f"unknown python task option(s) {unknown}; choose from "
                             f"{sorted(options)}")
        options.update(mix)
        max_steps = options["max_steps"]
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        pool = (load_task_file(task_file, max_steps) if task_file is not None
                else builtin_tasks(max_steps))
        rng = random.Random(seed)
        order: list[int] = []
        while len(order) < n:
            epoch = list(range(len(pool)))
            rng.shuffle(epoch)
            order += epoch
        return [pool[i] for i in order[:n]]

    def close(self) -> None:
        """Kill the interpreter and the spare sandbox (the env can still be reset)."""
        self._discard_live()
        if self._spare is not None:
            self._discard(self._spare)
            self._spare = None
        self._reap(block=True)

    def __enter__(self) -> PythonEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
