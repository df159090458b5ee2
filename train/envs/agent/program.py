"""Agent programs as environments: any program that talks to an OpenAI-compatible
endpoint becomes a tool world the samplers branch.

A *program* is a Python callable ``run(task, base_url, api_key) -> reward``: it builds
its own client (``openai.OpenAI(base_url=base_url, api_key=api_key)``), calls
``chat.completions.create`` as often as it likes, runs its tools, and returns a finite
number. ``agent:module:function`` (``agent_env_class``) is the environment of it:

* ``reset(task)`` starts the program in a worker thread against a per-episode endpoint
  (a path and key of one loopback server per process, ``train.envs.agent.http``) and
  waits for its first call; the first observation (the prompt) is that call's messages
  rendered as text (``wire.render_messages``);
* ``step(action)`` answers the pending call with ``action`` as the completion (a
  ``<tool_call>{json}</tool_call>`` block becomes structured ``tool_calls``, as vLLM's
  hermes parser does: ``wire.completion_message``), then waits for the program's next
  call, whose new messages (tool results, user turns) are the observation, or for its
  return, which ends the episode with that reward. So a node is one model call, its
  action the completion, its observation what the program sent next, and its
  ``meta["call"]`` the call itself (``step_meta``, ``call_meta``: the request's new
  messages and the completion's parsed tool calls, which the viewer shows);
* a snapshot is the task, the answers given so far and a fingerprint of every request
  received (``fingerprint``): canonical JSON, ``{"strategy": "agent", ...}`` (one
  fingerprint fewer than answers plus one when the program had returned);
* ``restore`` continues a live program when one is parked at exactly that state (each
  branch of a tree keeps its own program thread, so lockstep rollouts re-run nothing),
  or steps a live one forward when its answers are a prefix of the state's, else
  re-runs the program and replays the recorded answers. Every replayed request must
  match its fingerprint field by field: a program that sends anything else before the
  branch point (a non-deterministic tool, a clock, a seed it does not take from the
  task) raises ``AgentDivergenceError`` naming the call and the field, and the branch
  is never attached to the recorded prefix: the tree builder drops that rollout, marks
  the node it would have started from (``meta["diverged"]``) and goes on with the rest
  of the tree (``train.sampling.base``); ``rtrees env check --agent SPEC`` reports the
  first divergent call. A parked program is found by the task, the answers *and* the
  fingerprints of its calls: another run that was given the same answers but sent other
  requests (a random tool) is never continued in the recorded one's place.

Why not the generic ``replay`` strategy (``ReplayEnv``): it digests step outcomes only,
so a first request that differs (the prompt) goes unseen, it cannot say which field
parted, and it re-runs the whole program for every lockstep step of every branch; a
parked live program costs nothing to return to.

Requests are appended conversations: each call's messages must start with the previous
call's messages (the echoed assistant message is read loosely: clients add null fields);
a program that rewrites its history fails its episode by name. In this environment the
sampler decides how to sample: a request's ``temperature``, ``top_p``, ``max_tokens`` and
``seed`` are recorded (and fingerprinted) but not used, and ``n`` must be 1.

Failures. A program that raises, does not call the model or return within its timeout
(``run.timeout_s``, default ``DEFAULT_TIMEOUT_S``), returns before its first call or
returns a non-number raises ``AgentProgramError`` from ``reset``/``step``: the engine
fails that tree by name and commits the others (``on_failure``).

Tools: the module's ``TOOLS`` (OpenAI function tools), when it declares them, are the
class's ``tool_schemas()``. Tasks: ``generate_tasks(n, seed)`` draws from the program
module's ``TASKS`` (task dicts as in a task file, ``train.envs.tools.read_task_file``, or a
JSONL path relative to the module), in a seeded order; ``rtrees collect --agent
module:function --tasks FILE`` reads a task file instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from train.envs.agent.http import Endpoint, LoopbackServer, Unauthorized, same_key
from train.envs.agent.wire import (
    ChatRequest,
    Choice,
    WireError,
    completion_message,
    render_messages,
    response_body,
)
from train.envs.base import (
    Environment,
    SnapshotDivergence,
    StepResult,
    Task,
    error_response,
)

AGENT_PREFIX = "agent:"
DEFAULT_TIMEOUT_S = 60.0
"""Seconds a program may take between two model calls (or before returning)."""
MAX_PARKED = 64
"""Live programs kept per environment at states a branch may return to (least recently
parked out)."""
SNAPSHOT_STRATEGY_TAG = "agent"

Program = Callable[..., Any]


class AgentProgramError(RuntimeError):
    """The agent program failed its episode (raised, hung, returned a non-number)."""


class AgentDivergenceError(AgentProgramError, SnapshotDivergence):
    """A re-run program sent a request other than the recorded one before the branch
    point. ``call`` (1-based) and ``field`` name the first difference (also ``where``,
    as every ``SnapshotDivergence``: the tree builder drops the branch and marks the
    node)."""

    def __init__(self, message: str, call: int, field: str) -> None:
        SnapshotDivergence.__init__(self, message, call=call, field=field)
        self.call, self.field = call, field


@dataclasses.dataclass
class AgentStats:
    """Process-wide counters of every agent environment (benchmarks read them): calls
    answered live and the seconds from an answer to the program's next call or return
    (the program's own work, HTTP and JSON), calls answered from the record by a replay
    (no policy decoding: the answer is the recorded text) and their seconds, and program
    runs started."""

    live_calls: int = 0
    live_seconds: float = 0.0
    replayed_calls: int = 0
    replay_seconds: float = 0.0
    runs: int = 0

    def reset(self) -> None:
        self.live_calls = self.replayed_calls = self.runs = 0
        self.live_seconds = self.replay_seconds = 0.0


STATS = AgentStats()
_STATS_LOCK = threading.Lock()


def _count(**deltas: float) -> None:
    with _STATS_LOCK:
        for name, delta in deltas.items():
            setattr(STATS, name, getattr(STATS, name) + delta)


# ----- fingerprints -------------------------------------------------------------------------

def _digest(value: Any) -> str:
    body = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      default=str)
    return hashlib.sha256(body.encode("ascii")).hexdigest()[:16]


def fingerprint(body: dict[str, Any]) -> dict[str, Any]:
    """What a request is compared by: a 16-hex digest of every top-level field and, for
    ``messages``, of every key of every message; an assistant message (the echo of an
    answer we gave: clients add null fields to it) by its role and tool call ids only."""
    out: dict[str, Any] = {k: _digest(v) for k, v in sorted(body.items()) if k != "messages"}
    msgs = []
    for m in body.get("messages") or []:
        if m.get("role") == "assistant":
            ids = [c.get("id") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
            msgs.append({"role": _digest("assistant"), "tool_calls": _digest(ids)})
        else:
            msgs.append({k: _digest(v) for k, v in sorted(m.items())})
    out["messages"] = msgs
    return out


def diverging_field(recorded: dict[str, Any], got: dict[str, Any]) -> str | None:
    """The first field in which two fingerprints differ (``messages[3].content``,
    ``tools``, ``messages (length)``), or None."""
    for key in sorted(set(recorded) | set(got)):
        if key == "messages":
            continue
        if recorded.get(key) != got.get(key):
            return key
    a, b = recorded.get("messages", []), got.get("messages", [])
    for i, (ma, mb) in enumerate(zip(a, b, strict=False)):
        for k in sorted(set(ma) | set(mb)):
            if ma.get(k) != mb.get(k):
                return f"messages[{i}].{k}"
    if len(a) != len(b):
        return f"messages (length {len(b)}, recorded {len(a)})"
    return None


# ----- the per-process hub and its sessions -------------------------------------------------

@dataclasses.dataclass
class _Call:
    request: ChatRequest
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    response: dict[str, Any] | None = None


class _Session:
    """One run of a program: its thread, its endpoint and what it was answered."""

    def __init__(self, hub: _Hub, program: Program, task: Task) -> None:
        self.hub, self.task = hub, task
        self.generation = _GENERATION
        self.sid = secrets.token_hex(8)
        self.key = secrets.token_urlsafe(24)
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.pending: _Call | None = None
        self.answers: list[str] = []
        self.fingerprints: list[dict[str, Any]] = []
        self.messages: list[dict[str, Any]] = []
        self.new_from = 0  # where the pending call's messages new since the last one start
        self.finished = False
        self.reward = 0.0
        self.closed = False
        self._lock = threading.Lock()
        self._in_flight = False
        hub.sessions[self.sid] = self
        base_url = hub.server.url(f"/s/{self.sid}/v1")

        def main() -> None:
            try:
                value = program(task, base_url, self.key)
            except BaseException as exc:  # the program's failure is its episode's outcome
                self.events.put(("raise", exc))
            else:
                self.events.put(("return", value))

        self.thread = threading.Thread(target=main, name=f"rtrees-agent-{self.sid}",
                                       daemon=True)
        self.thread.start()

    # the endpoint (HTTP threads)
    @property
    def models(self) -> tuple[str, ...] | None:
        return None

    def complete(self, request: ChatRequest) -> dict[str, Any]:
        if request.n != 1:
            raise WireError("n must be 1 in an agent program's call (the sampler branches)")
        with self._lock:
            if self.closed:
                raise WireError("this episode's endpoint is closed")
            if self._in_flight:
                raise WireError("one call at a time per episode")
            self._in_flight = True
        call = _Call(request)
        self.events.put(("call", call))
        call.done.wait()
        with self._lock:
            self._in_flight = False
        if call.response is None:
            raise WireError("this episode's endpoint is closed")
        return call.response

    # the environment side
    def answer(self, text: str) -> None:
        call = self.pending
        if call is None:
            raise AgentProgramError("no model call is waiting for an answer")
        self.pending = None
        call.response = response_body(call.request, [Choice(text)], 0,
                                      f"chatcmpl-{self.sid}-{len(self.answers)}")
        self.answers.append(text)
        call.done.set()

    def close(self) -> None:
        with self._lock:
            self.closed = True
        call, self.pending = self.pending, None
        if call is not None:
            call.done.set()  # its response stays None: the program gets a 400
        self.hub.sessions.pop(self.sid, None)


class _Hub:
    """The loopback server of this process and its live sessions."""

    def __init__(self) -> None:
        self.sessions: dict[str, _Session] = {}
        self.server = LoopbackServer(self.route)

    def route(self, path: str, key: str) -> Endpoint:
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "s" or parts[2] != "v1":
            raise KeyError(path)
        session = self.sessions.get(parts[1])
        if session is None:
            raise KeyError(path)
        if not same_key(key, session.key):
            raise Unauthorized(path)
        return session


_HUB: _Hub | None = None
_HUB_LOCK = threading.Lock()
_GENERATION = 0
"""Counts forks: a forked child has neither the server thread nor the program threads of
its parent, so the sessions it inherits are dead (``train.envs.fork``)."""


def _after_fork_in_child() -> None:
    global _HUB, _HUB_LOCK, _GENERATION
    _HUB, _HUB_LOCK = None, threading.Lock()
    _GENERATION += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def hub() -> _Hub:
    """This process's agent endpoint (started on first use)."""
    global _HUB
    with _HUB_LOCK:
        if _HUB is None:
            _HUB = _Hub()
        return _HUB


# ----- the environment ----------------------------------------------------------------------

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}".rstrip(": ")


class AgentEnv(Environment):
    """The environment of one agent program (module docstring); ``agent_env_class`` makes
    the class of a program (``PROGRAM``, its spec ``PROGRAM_SPEC``, its ``TASKS``)."""

    name: ClassVar[str] = "agent"
    snapshot_strategy = "native"
    tool_lag: ClassVar[int] = 8
    """A step waits on the program (its tool, HTTP, JSON: ~8 ms a call here) for several
    decode steps of the tiny policy (~1-2 ms): the engine's rule of thumb, latency over
    one decode step. Measured with ``benchmarks/bench_agent.py`` (32 trees x 8 BEL
    rollouts): 0.34x native at lag 0, 0.53x at 8, 0.35x at 32 (noisy shared cores)."""
    PROGRAM: ClassVar[Program | None] = None
    PROGRAM_SPEC: ClassVar[str] = ""
    TASKS: ClassVar[Any] = None
    TOOLS: ClassVar[list[dict[str, Any]] | None] = None
    TASKS_BASE: ClassVar[Path | None] = None

    def __init__(self, timeout_s: float | None = None, max_parked: int = MAX_PARKED) -> None:
        program = type(self).PROGRAM
        if program is None:
            raise TypeError("AgentEnv needs a program: use agent_env_class(spec)")
        self.program: Program = program
        given = getattr(program, "timeout_s", None)
        self.timeout_s = float(timeout_s if timeout_s is not None else
                               given if isinstance(given, int | float) else DEFAULT_TIMEOUT_S)
        self.max_parked = max_parked
        hub()  # the server starts before the first episode
        self._session: _Session | None = None
        self._parked: OrderedDict[str, _Session] = OrderedDict()
        self.replayed_calls = 0
        self.reruns = 0
        self._call_meta: dict[str, Any] | None = None

    # --- helpers
    def _who(self) -> str:
        return f"agent program {self.PROGRAM_SPEC}"

    def _start(self, task: Task) -> _Session:
        self.reruns += 1
        _count(runs=1)
        return _Session(hub(), self.program, task)

    def _next(self, s: _Session) -> tuple[str, Any]:
        if s.generation != _GENERATION:
            raise AgentProgramError(f"{self._who()}: its program thread does not survive a "
                                    "fork (snapshot_strategy 'fork' cannot hold an agent "
                                    "program; its own snapshots replay it)")
        try:
            return s.events.get(timeout=self.timeout_s)
        except queue.Empty:
            s.close()
            raise AgentProgramError(
                f"{self._who()} neither called the model nor returned within "
                f"{self.timeout_s:g} s (task {s.task.task_id!r}, after {len(s.answers)} "
                "answers)") from None

    def _await_call(self, s: _Session) -> tuple[str, _Call] | tuple[str, float]:
        """The next event: ``("call", call)`` with ``s.pending`` set, or ``("return",
        reward)``; ``AgentProgramError`` when it raised, hung or returned a non-number."""
        kind, value = self._next(s)
        if kind == "raise":
            s.close()
            raise AgentProgramError(f"{self._who()} raised on task {s.task.task_id!r}: "
                                    f"{_first_line(value)}")
        if kind == "return":
            s.finished = True
            s.close()
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not math.isfinite(value):
                raise AgentProgramError(f"{self._who()} returned {str(value)[:80]!r} on task "
                                        f"{s.task.task_id!r}, not a finite number")
            s.reward = float(value)
            return "return", s.reward
        call: _Call = value
        s.pending = call
        s.fingerprints.append(fingerprint(call.request.body))
        return "call", call

    def _observation(self, s: _Session, call: _Call) -> str:
        """The new messages of ``call`` as text; the conversation must be appended to."""
        new = call.request.messages
        prev = s.messages
        s.messages = list(new)
        s.new_from = len(prev)
        if not prev:
            return render_messages(new)
        k = len(prev)
        if len(new) <= k or new[:k] != prev:
            s.close()
            raise AgentProgramError(
                f"{self._who()} rewrote its conversation at call {len(s.answers) + 1} of "
                f"task {s.task.task_id!r}: only conversations that grow by appending "
                "messages are branched")
        rest = new[k:]
        if rest and rest[0].get("role") == "assistant":  # the echo of our answer
            rest = rest[1:]
        return render_messages(rest)

    # --- Environment
    def reset(self, task: Task) -> str:
        self._drop(self._session)
        s = self._session = self._start(task)
        got = self._await_call(s)
        if got[0] == "return":
            raise AgentProgramError(f"{self._who()} returned before its first model call "
                                    f"(task {task.task_id!r})")
        return self._observation(s, got[1])  # type: ignore[arg-type]

    def step(self, action_text: str) -> StepResult:
        s = self._session
        if s is not None and s.finished:
            return StepResult(error_response("episode is over"), True, {"reward": s.reward})
        if s is None or s.pending is None:
            raise AgentProgramError(f"{self._who()}: no model call waits (call reset() or "
                                    "restore() first, or the episode is over)")
        start = time.perf_counter()
        self._call_meta = {"call": call_meta(s, action_text)}
        s.answer(action_text)
        kind, value = self._await_call(s)
        _count(live_calls=1, live_seconds=time.perf_counter() - start)
        if kind == "return":
            return StepResult("", True, {"reward": float(value)})  # type: ignore[arg-type]
        return StepResult(self._observation(s, value), False,  # type: ignore[arg-type]
                          {"reward": 0.0})

    def step_meta(self) -> dict[str, Any] | None:
        """The model call the last ``step`` answered, for its tree node's ``meta``
        (``call_meta``; None after it was taken once)."""
        meta, self._call_meta = self._call_meta, None
        return meta

    def snapshot(self) -> bytes:
        s = self._session
        if s is None:
            raise RuntimeError(f"{self._who()}: call reset() or restore() before snapshot()")
        return _dump(s.task, s.answers, s.fingerprints)

    def restore(self, state: bytes) -> None:
        task, answers, prints = parse_agent_snapshot(state)
        key = _key(task, answers, prints)
        over = len(prints) == len(answers)  # the program had returned
        cur = self._session
        if cur is not None and cur.task == task and cur.answers == answers and \
                cur.fingerprints == prints and (
                cur.pending is not None or (over and cur.finished)):
            return
        self._park(cur)
        self._session = None
        found = self._parked.pop(key, None)
        if found is not None:
            self._session = found
            return
        # the live program furthest along a prefix of the answers, else a fresh run
        best: _Session | None = None
        for cand in self._parked.values():
            if cand.task == task and cand.answers == answers[:len(cand.answers)] and \
                    cand.fingerprints == prints[:len(cand.fingerprints)] and (
                    best is None or len(cand.answers) > len(best.answers)):
                best = cand
        if best is not None:
            del self._parked[_key(best.task, best.answers, best.fingerprints)]
            s = best
        else:
            s = self._start(task)
            self._expect(s, prints, 0)
        self._session = s
        for i in range(len(s.answers), len(answers)):
            start = time.perf_counter()
            s.answer(answers[i])
            self.replayed_calls += 1
            self._expect(s, prints, i + 1)
            _count(replayed_calls=1, replay_seconds=time.perf_counter() - start)

    def _expect(self, s: _Session, prints: list[dict[str, Any]], index: int) -> None:
        """Wait for call ``index`` (0-based) of a replay and check it against the record
        (``index == len(prints)``: the record has the program's return there)."""
        got = self._await_call(s)
        if index == len(prints):
            if got[0] != "return":
                s.close()
                raise AgentDivergenceError(
                    f"{self._who()}: replay diverged at call {index + 1} of task "
                    f"{s.task.task_id!r}: the program called the model where the record has "
                    "its return", index + 1, "return")
            return
        if got[0] == "return":
            raise AgentDivergenceError(
                f"{self._who()}: replay diverged at call {index + 1} of task "
                f"{s.task.task_id!r}: the program returned where the record has another "
                "call", index + 1, "return")
        call: _Call = got[1]  # type: ignore[assignment]
        if index < len(prints):
            field = diverging_field(prints[index], s.fingerprints[-1])
            if field is not None:
                s.close()
                raise AgentDivergenceError(
                    f"{self._who()}: replay diverged at call {index + 1} of task "
                    f"{s.task.task_id!r}: {field} differs from the recorded request (a tool, "
                    "clock or random seed that is not a function of the task and the "
                    "answers)", index + 1, field)
        self._observation(s, call)

    def _park(self, s: _Session | None) -> None:
        if s is None:
            return
        if s.pending is None or s.closed:
            s.close()
            return
        key = _key(s.task, s.answers, s.fingerprints)
        old = self._parked.pop(key, None)
        if old is not None:
            old.close()
        self._parked[key] = s
        while len(self._parked) > self.max_parked:
            _, evicted = self._parked.popitem(last=False)
            evicted.close()

    def _drop(self, s: _Session | None) -> None:
        if s is not None:
            s.close()

    def close(self) -> None:
        self._drop(self._session)
        self._session = None
        for s in self._parked.values():
            s.close()
        self._parked.clear()

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]] | None:
        """The program module's ``TOOLS`` (OpenAI function tools), if it declares them:
        ``hf:`` chat templates and ``rtrees env check``'s random tool calls use them."""
        return cls.TOOLS

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        """``n`` tasks of the program module's ``TASKS`` in a seeded order (cycled; a
        repeat's id gets ``#k``)."""
        from train.envs.tools import FunctionToolEnv, read_task_file

        if mix:
            raise ValueError(f"{cls.PROGRAM_SPEC}: tasks come from TASKS; no option "
                             f"{sorted(mix)[0]!r}")
        source = cls.TASKS
        if source is None:
            raise ValueError(f"agent program {cls.PROGRAM_SPEC}: its module defines no TASKS "
                             "(a list of task dicts or a JSONL path); give --tasks FILE")
        spec = AGENT_PREFIX + cls.PROGRAM_SPEC
        if isinstance(source, str | Path):
            path = Path(source)
            if not path.is_absolute() and cls.TASKS_BASE is not None:
                path = cls.TASKS_BASE / path
            tasks: Any = tuple(read_task_file(path, spec))
        else:
            from train.envs.tools import _task_of

            seen: set[str] = set()
            tasks = tuple(t if isinstance(t, Task) else _task_of(
                t, f"{spec} TASKS[{i}]", spec, f"task-{i}", seen) for i, t in enumerate(source))
        helper: type[FunctionToolEnv] = type("_Tasks", (FunctionToolEnv,),
                                             {"name": spec, "TASKS": tasks})
        return helper.generate_tasks(n, seed)


def call_meta(s: _Session, completion: str) -> dict[str, Any]:
    """What a tree node stores of its model call (``meta["call"]``; the viewer shows it):
    ``index`` (1-based call number), the request's ``messages`` from index ``first`` on
    (those new since the previous call: the earlier ones are on the node's path, so a
    path stores each message once), and the completion's ``tool_calls`` as the program
    received them (``wire.completion_message``: id, name, arguments as JSON text)."""
    message, _ = completion_message(completion)
    calls = [{"id": c["id"], "name": c["function"]["name"],
              "arguments": c["function"]["arguments"]} for c in message.get("tool_calls", [])]
    return {"index": len(s.answers) + 1, "first": s.new_from,
            "messages": s.messages[s.new_from:], "tool_calls": calls}


def _key(task: Task, answers: list[str], prints: list[dict[str, Any]]) -> str:
    """A parked program's key: the state a snapshot records (task, answers, requests)."""
    return _digest([dataclasses.asdict(task), answers, prints])


def _dump(task: Task, answers: list[str], prints: list[dict[str, Any]]) -> bytes:
    return json.dumps({"strategy": SNAPSHOT_STRATEGY_TAG, "task": dataclasses.asdict(task),
                       "answers": answers, "calls": prints}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=True).encode("ascii")


def parse_agent_snapshot(state: bytes) -> tuple[Task, list[str], list[dict[str, Any]]]:
    """The task, answers and call fingerprints of an agent snapshot (``ValueError`` for
    anything else)."""
    try:
        doc = json.loads(state)
    except (ValueError, RecursionError):
        raise ValueError("not an agent snapshot: not JSON") from None
    if not isinstance(doc, dict) or doc.get("strategy") != SNAPSHOT_STRATEGY_TAG:
        raise ValueError("not an agent snapshot")
    raw, answers, prints = doc.get("task"), doc.get("answers"), doc.get("calls")
    names = {f.name for f in dataclasses.fields(Task)}
    if not isinstance(raw, dict) or set(raw) != names or not isinstance(answers, list) or \
            not all(isinstance(a, str) for a in answers) or not isinstance(prints, list) or \
            len(prints) not in (len(answers), len(answers) + 1) or \
            not all(isinstance(p, dict) for p in prints):
        raise ValueError("not an agent snapshot: malformed task, answers or calls")
    return Task(**raw), answers, prints


@lru_cache(maxsize=256)
def agent_env_class(spec: str) -> type[AgentEnv]:
    """The environment class of ``agent:module:function`` (``ValueError`` naming the spec
    when the module does not import or the attribute is not callable)."""
    import importlib
    import sys

    path = spec[len(AGENT_PREFIX):] if spec.startswith(AGENT_PREFIX) else spec
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"agent program {path!r}: module {module_name!r} does not import "
                         f"({_first_line(exc)})") from None
    program = getattr(module, attr, None)
    if not callable(program) or isinstance(program, type):
        raise ValueError(f"agent program {path!r}: {attr!r} is not a function of module "
                         f"{module_name!r}")
    file = getattr(sys.modules.get(module_name), "__file__", None)
    return type(f"Agent_{attr}", (AgentEnv,), {
        "name": AGENT_PREFIX + path, "PROGRAM": staticmethod(program), "PROGRAM_SPEC": path,
        "TASKS": getattr(module, "TASKS", None), "TOOLS": getattr(module, "TOOLS", None),
        "TASKS_BASE": Path(file).parent if file else None,
        "__module__": __name__, "__qualname__": f"Agent_{attr}"})


__all__ = ["AGENT_PREFIX", "DEFAULT_TIMEOUT_S", "STATS", "AgentDivergenceError", "AgentEnv",
           "AgentProgramError", "AgentStats", "agent_env_class", "call_meta", "diverging_field",
           "fingerprint", "hub", "parse_agent_snapshot"]
