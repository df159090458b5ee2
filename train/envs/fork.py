"""The ``fork`` snapshot strategy: the environment lives in a worker process, and a snapshot is
a frozen copy-on-write fork of that process (issue 44, item 3).

Why: an environment whose state cannot be serialised (open handles, generators, C
libraries) gets exact snapshots without writing ``snapshot``/``restore``; and an
environment that must run on a main thread (its constructor installs a signal handler) or
on one thread only works from the engine's tool-pool threads, because its worker builds and
steps it on the worker's own main thread.

Processes. ``ForkEnv`` starts one *supervisor* per instance (``python -m train.envs.fork_worker``,
a new session and process group, never a fork of the caller: it holds torch threads). The
supervisor imports the environment class (``resolve_env(spec)``), is the subreaper of its
group (Linux ``PR_SET_CHILD_SUBREAPER``: it reaps every orphaned descendant), and forks
the *live worker*, which builds the environment on its main thread and serves requests.

* ``snapshot()``: the single-threaded live worker forks: the child is a *frozen* copy of
  the whole process that waits on its own socket (the worker reaps its exited copies by
  pid; the supervisor reaps those whose parent is gone). The snapshot bytes are canonical JSON
  ``{"strategy": "fork", "handle": {"id", "path", "token", "env"}, "replay": <a replay
  snapshot>}``, where ``replay`` is exactly what ``ReplayEnv.snapshot`` gives for the
  same episode (the task and the log of steps with their ``outcome_digest`` and reseeds).
* ``restore(bytes)``: when the handle's frozen process is in this instance's pool, it is
  asked to fork again; the new copy takes over that request's connection and becomes the
  live worker, and the old one exits as its connection closes (``ForkStats.fork_restores``;
  two process wake-ups, no step). Otherwise (evicted, killed, taken by another instance or
  in an earlier run: references, the reuse refresh) the restore falls back to replay: the
  live worker is reset to the task and the log replayed, each step's digest checked
  (``ReplayDivergenceError`` naming the step when it parts; ``replay_restores``). A plain
  replay snapshot is accepted too. Restoring the handle the worker is still at (no step
  since) does nothing (``noop_restores``).

Modules. The supervisor, the live worker and the frozen copies, and the length-prefixed
JSON they speak, are ``train.envs.fork_worker`` (its docstring: tokens, the operations a
request may name); the caller process's pool of frozen copies is ``train.envs.fork_pool``;
this module is the caller's side: ``ForkEnv`` and the snapshot format.

Bounds. Frozen processes are held in an LRU pool: at most ``pool_size`` per instance and
``RTREES_FORK_POOL`` (default 64) in the caller process in all; an evicted copy exits and
its handles restore by replay. ``pool_size=0`` (or ``RTREES_FORK_POOL=0``) forks no copy:
every restore replays. A fork copies the process's memory (copy-on-write: a copy costs the
pages it later writes, ``benchmarks/bench_env_strategies.py``), not its files, sockets,
child processes or other threads: an environment whose state lives there is not
fork-safe; use ``native`` or ``replay`` for it. ``env.close()`` runs once, in the live
worker, at ``ForkEnv.close()``.

Failures, each one line naming the environment, never a hang:

* every request waits at most ``timeout`` seconds (``RTREES_FORK_TIMEOUT``, default
  120): a worker that does not answer is killed and the call raises ``TimeoutError``;
* a worker that died (``kill -9``, a crash) is replaced by the next call, which replays
  the last known state into the new one and retries once; a second death, or a state
  that cannot be replayed, raises ``ForkError`` (or ``ReplayDivergenceError``);
* ``close()`` kills the supervisor's whole process group (the worker and every frozen
  copy); an instance never closed is killed when it is garbage-collected or at exit; and
  every process of the group also exits when the caller process dies (each one waits on
  a pipe whose only write end the caller holds).

Only POSIX: where ``os.fork`` or Unix sockets are missing this module does not register
``fork`` in ``SNAPSHOT_STRATEGIES``, and ``with_snapshots`` says the strategy is unknown.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from train.envs.base import Environment, StepResult, Task
from train.envs.fork_pool import POOL, Frozen, pool_cap, stop_frozen
from train.envs.fork_worker import canonical, recv, send
from train.envs.strategies import (
    SNAPSHOT_STRATEGIES,
    ReplayDivergenceError,
    outcome_digest,
    parse_replay,
)

FORK = "fork"
SUPPORTED = os.name == "posix" and hasattr(os, "fork") and hasattr(socket, "AF_UNIX")
"""Whether this platform can run the strategy (it is registered only where it can)."""
TIMEOUT_ENV = "RTREES_FORK_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes on Linux, 104 on macOS
_REMOTE_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, TypeError, KeyError, IndexError, RuntimeError,
                            NotImplementedError, ReplayDivergenceError)}
"""Exception types a worker's error keeps; any other arrives as ``ForkError``."""


class ForkError(RuntimeError):
    """The worker machinery failed (a worker that died twice, a state it cannot reach)."""


class _Dead(Exception):
    """The peer closed the connection or never answered properly."""


class _Hung(Exception):
    """The peer did not answer within the timeout."""



# ----- the caller's side ----------------------------------------------------------------

_GLOBALS_LOCK = threading.Lock()
_GLOBALS: dict[str, Any] = {}


def _remove_root(pid: int, root: str) -> None:
    if os.getpid() == pid:  # not in a forked child of the process that made it
        shutil.rmtree(root, ignore_errors=True)


def _process_globals() -> tuple[int, str]:
    """(lifeline read fd, private directory) of this process, made on first use (again in a
    forked child, which must not share its parent's)."""
    with _GLOBALS_LOCK:
        if _GLOBALS.get("pid") != os.getpid():
            r, w = os.pipe()  # w stays open for this process's life: its end is the signal
            root = tempfile.mkdtemp(prefix="rtrees-fork-")
            os.chmod(root, 0o700)
            if len(root) + 40 > _SUN_PATH_MAX:
                raise ForkError(f"fork env: the temp dir {root!r} is too long for a Unix "
                                "socket path; set TMPDIR to a short directory")
            atexit.register(_remove_root, os.getpid(), root)
            _GLOBALS.update(pid=os.getpid(), lifeline=(r, w), root=root)
        return _GLOBALS["lifeline"][0], _GLOBALS["root"]



@dataclass
class ForkStats:
    """What one ``ForkEnv`` did: snapshots (frozen copies made), restores by path
    (``fork_restores`` + ``replay_restores`` + ``noop_restores`` = ``restores``), steps
    replayed, copies it evicted, workers started, and dead workers replaced
    (``recoveries``)."""

    snapshots: int = 0
    restores: int = 0
    fork_restores: int = 0
    replay_restores: int = 0
    noop_restores: int = 0
    replayed_steps: int = 0
    evictions: int = 0
    worker_starts: int = 0
    recoveries: int = 0


class _Group:
    """A ``ForkEnv``'s supervisor (its process group) and directory; ``kill`` ends them all
    (also run by ``weakref.finalize`` when the env is dropped unclosed)."""

    def __init__(self, owner: str, directory: str) -> None:
        self.owner, self.directory = owner, directory
        self.proc: subprocess.Popen[bytes] | None = None
        self.ctl: socket.socket | None = None

    def stop_supervisor(self) -> None:
        proc, self.proc = self.proc, None
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if proc is not None:
            with contextlib.suppress(OSError):  # not yet reaped: the pgid is still ours
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(10)

    def kill(self) -> None:
        POOL.drop_owner(self.owner)
        self.stop_supervisor()
        shutil.rmtree(self.directory, ignore_errors=True)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class ForkEnv(Environment):
    """An ``env_class(**config)`` that lives in a worker process, with snapshots by fork and
    replay as the fallback (module docstring). Made by ``make_fork_env`` or the ``fork``
    entry of ``SNAPSHOT_STRATEGIES``.

    ``spec``: how the worker resolves the class (``resolve_env``; default its
    ``module:Class`` path); ``config``: the constructor's keyword arguments (JSON);
    ``pool_size``: most frozen copies this instance keeps (default ``pool_cap()``);
    ``timeout``: seconds any request may take (default ``RTREES_FORK_TIMEOUT`` or 120).
    """

    snapshot_strategy = "fork"

    def __init__(self, env_class: type[Environment], spec: str | None = None,
                 config: dict[str, Any] | None = None, *, pool_size: int | None = None,
                 timeout: float | None = None) -> None:
        if not SUPPORTED:
            raise ValueError(f"{env_class.__name__}: snapshot strategy 'fork' needs os.fork "
                             "and Unix sockets (POSIX)")
        self.env_class = env_class
        self.spec = spec or _class_path(env_class)
        self.config = dict(config or {})
        try:
            fingerprint = canonical([self.spec, self.config])
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{self.spec}: a fork env's config must be JSON ({exc})") from None
        self._fingerprint = hashlib.sha256(fingerprint).hexdigest()[:16]
        if pool_size is not None and pool_size < 0:
            raise ValueError(f"{self.spec}: pool_size must be >= 0, got {pool_size}")
        self.pool_size = pool_size
        self.timeout = float(timeout if timeout is not None
                             else os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT)
        if not self.timeout > 0:
            raise ValueError(f"{self.spec}: timeout must be > 0 seconds, got {self.timeout}")
        self.stats = ForkStats()
        self._task: Task | None = None
        self._log: list[list[Any]] = []
        self._at: str | None = None  # the frozen copy the live worker equals (no step since)
        self._conn: socket.socket | None = None
        self._token = ""
        self.worker_pid: int | None = None
        self._has_reseed = False
        self._closed = False
        self._owner = secrets.token_hex(8)
        self._lifeline, root = _process_globals()
        self._group = _Group(self._owner, tempfile.mkdtemp(prefix="", dir=root))
        self._finalizer = weakref.finalize(self, self._group.kill)
        try:
            self._start_worker()
        except BaseException:
            self.close()
            raise

    # ----- what the wrapped class says ---------------------------------------------------

    @property  # the wrapped class's name, per instance
    def name(self) -> str:  # type: ignore[override]
        return self.env_class.name

    def tool_schemas(self) -> list[dict[str, Any]] | None:  # type: ignore[override]
        return self.env_class.tool_schemas()

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        raise TypeError("generate_tasks belongs to the wrapped environment's class")

    def pids(self) -> list[int]:
        """The processes of this instance now: the supervisor, the live worker and the
        frozen copies in its pool."""
        out = [self._group.proc.pid] if self._group.proc is not None else []
        out += [self.worker_pid] if self.worker_pid is not None else []
        return out + POOL.pids(self._owner)

    # ----- the episode -------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        obs = self._call("reset", replay=False, task=dataclasses.asdict(task))
        self._task, self._log, self._at = task, [], None
        return str(obs)

    def step(self, action_text: str) -> StepResult:
        obs, done, parts = self._call("step", action=action_text)
        result = StepResult(obs, bool(done), {str(k): float(v) for k, v in parts.items()})
        self._log.append(["step", action_text, outcome_digest(result)])
        self._at = None
        return result

    def reseed(self, key: int) -> None:
        if self._has_reseed:
            self._call("reseed", key=int(key))
            self._log.append(["reseed", int(key)])
            self._at = None

    def expert_action(self) -> str:
        return str(self._call("expert_action"))

    def snapshot(self) -> bytes:
        if self._task is None:
            raise RuntimeError(f"{self.name}: call reset() or restore() before snapshot()")
        hid, token = secrets.token_hex(8), secrets.token_hex(16)
        path = os.path.join(self._group.directory, f"{hid}.sock")
        owner_cap = pool_cap() if self.pool_size is None else self.pool_size
        global_cap = pool_cap()
        if min(owner_cap, global_cap) > 0:
            pid = int(self._call("snapshot", path=path, frozen_token=token))
            self.stats.snapshots += 1
            evicted = POOL.add(Frozen(hid, path, token, pid, self._owner),
                                owner_cap, global_cap)
            for e in evicted:
                stop_frozen(e, min(self.timeout, 5.0))
            self.stats.evictions += len(evicted)
            self._at = hid
        replay = {"strategy": "replay", "task": dataclasses.asdict(self._task),
                  "log": self._log}
        return canonical({"strategy": FORK, "replay": replay, "handle": {
            "id": hid, "path": path, "token": token, "env": self._fingerprint}})

    def restore(self, state: bytes) -> None:
        self._check_open()
        task, log, handle = parse_fork(state)
        self.stats.restores += 1
        if handle is not None:
            if handle["id"] == self._at and self._conn is not None and task == self._task:
                self.stats.noop_restores += 1
                return
            entry = (POOL.take(self._owner, handle["id"], handle["token"])
                     if handle["env"] == self._fingerprint else None)
            if entry is not None:
                if self._fork_from(entry):
                    self._task, self._log, self._at = task, [list(e) for e in log], entry.hid
                    self.stats.fork_restores += 1
                    return
                POOL.discard(entry.hid)
        self._replay_to(task, log)
        self.stats.replay_restores += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._conn is not None:
            with contextlib.suppress(_Dead, _Hung, Exception):
                self._ask(self._conn, {"op": "close", "token": self._token},
                          min(self.timeout, 10.0))
            self._conn.close()
            self._conn = None
        self.worker_pid = None
        self._finalizer()  # _Group.kill: the pool entries, the process group, the directory

    # ----- workers -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: this fork env is closed")

    def _ask(self, sock: socket.socket, msg: dict[str, Any], timeout: float | None = None
             ) -> Any:
        sock.settimeout(self.timeout if timeout is None else timeout)
        try:
            send(sock, msg)
            reply = recv(sock)
        except TimeoutError:
            raise _Hung from None
        except (EOFError, OSError, ValueError):
            raise _Dead from None
        if not isinstance(reply, dict):
            raise _Dead
        if not reply.get("ok"):
            kind = str(reply.get("type"))
            message = f"{self.name} (fork worker): {reply.get('error')}"
            raise _REMOTE_ERRORS.get(kind, ForkError)(
                message if kind in _REMOTE_ERRORS else f"{message} ({kind})")
        return reply.get("value")

    def _start_supervisor(self) -> None:
        self._group.stop_supervisor()
        POOL.drop_owner(self._owner)  # the old group's copies died with it
        self._at = None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        try:
            self._group.proc = subprocess.Popen(
                [sys.executable, "-m", "train.envs.fork_worker", "--supervisor",
                 str(theirs.fileno()), str(self._lifeline)],
                pass_fds=(theirs.fileno(), self._lifeline), start_new_session=True,
                stdin=subprocess.DEVNULL, env=environ)
        finally:
            theirs.close()
        self._group.ctl = mine

    def _start_worker(self) -> None:
        """A new live worker (and supervisor, when it has none or it died), connected."""
        hid, token = secrets.token_hex(8), secrets.token_hex(16)
        path = os.path.join(self._group.directory, f"{hid}.sock")
        msg = {"op": "spawn", "spec": self.spec, "fallback": _class_path(self.env_class),
               "config": self.config, "path": path, "token": token, "timeout": self.timeout}
        for attempt in range(2):
            if self._group.ctl is None:
                self._start_supervisor()
            assert self._group.ctl is not None
            try:
                self._ask(self._group.ctl, msg)
                break
            except _Dead:
                self._group.stop_supervisor()
                if attempt:
                    raise ForkError(f"{self.spec}: the fork env's supervisor process died "
                                    "twice while starting a worker") from None
            except _Hung:
                self._group.stop_supervisor()
                raise TimeoutError(f"{self.spec}: the fork env's supervisor did not start a "
                                   f"worker within {self.timeout:g} s") from None
        self.stats.worker_starts += 1
        self._connect(path, token)

    def _connect(self, path: str, token: str) -> None:
        """Connect to a new live worker at ``path``; the old one (if any) exits as its
        connection closes."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(path)
            info = self._ask(sock, {"op": "hello", "token": token})
        except (_Dead, OSError):
            sock.close()
            raise ForkError(f"{self.spec}: the new fork worker did not answer "
                            f"(it died building the environment?)") from None
        except _Hung:
            sock.close()
            raise TimeoutError(f"{self.spec}: the new fork worker did not answer within "
                               f"{self.timeout:g} s") from None
        except Exception:
            sock.close()
            raise
        if self._conn is not None:
            self._conn.close()
        self._conn, self._token = sock, token
        self.worker_pid, self._has_reseed = int(info["pid"]), bool(info["has_reseed"])

    def _drop_worker(self, kill: bool) -> None:
        if self._conn is not None:
            self._conn.close()
        if kill and self.worker_pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self.worker_pid, signal.SIGKILL)
        self._conn, self.worker_pid, self._at = None, None, None

    def _call(self, op: str, replay: bool = True, **args: Any) -> Any:
        """One request to the live worker; a dead one is replaced (the last known state
        replayed into it, ``replay``) and the request retried once."""
        self._check_open()
        for attempt in range(2):
            if self._conn is None:
                self._recover(replay)
            assert self._conn is not None
            try:
                return self._ask(self._conn, {"op": op, "token": self._token, **args})
            except _Dead:
                self._drop_worker(kill=True)
                if attempt:
                    raise ForkError(f"{self.name}: its fork worker died twice running {op!r} "
                                    "(the environment crashes its process?)") from None
            except _Hung:
                self._drop_worker(kill=True)
                raise TimeoutError(f"{self.name}: its fork worker did not answer {op!r} within "
                                   f"{self.timeout:g} s and was killed (the next call starts "
                                   "a new one)") from None
        raise AssertionError("unreachable")

    def _recover(self, replay: bool) -> None:
        """A new live worker holding the last known state (the task and log replayed)."""
        self._start_worker()
        self.stats.recoveries += 1
        if not replay or self._task is None:
            return
        task, log = self._task, self._log
        self._task, self._log = None, []
        try:
            self._replay_log(task, log, 0, reset=True)
        except (ReplayDivergenceError, _Dead, _Hung) as exc:
            self._drop_worker(kill=True)
            raise ForkError(f"{self.name}: its fork worker died and the last state "
                            f"(task {task.task_id!r}, {len(log)} log entries) could not be "
                            f"replayed into a new one: {type(exc).__name__} {exc}") from None

    def _replay_log(self, task: Task, log: list[list[Any]], start: int, reset: bool) -> None:
        """Reset (``reset``) and replay ``log[start:]`` on the live worker with raw requests
        (no recovery), checking digests; ``self._task``/``_log`` follow."""
        assert self._conn is not None
        conn, token = self._conn, self._token
        if reset:
            self._ask(conn, {"op": "reset", "token": token, "task": dataclasses.asdict(task)})
            self._task, self._log = task, []
        self._at = None
        for i in range(start, len(log)):
            entry = log[i]
            if entry[0] == "reseed":
                if self._has_reseed:
                    self._ask(conn, {"op": "reseed", "token": token, "key": int(entry[1])})
                self._log.append(list(entry))
                continue
            obs, done, parts = self._ask(conn, {"op": "step", "token": token,
                                                "action": entry[1]})
            self.stats.replayed_steps += 1
            got = outcome_digest(StepResult(obs, bool(done), parts))
            if got != entry[2]:
                self._task, self._log = None, []
                at = sum(e[0] == "step" for e in log[:i + 1])
                raise ReplayDivergenceError(
                    f"{self.name}: replay diverged at step {at} of task {task.task_id!r} "
                    f"(the action {entry[1][:60]!r} gave another observation or reward than "
                    "when it was recorded): the fork copy was gone and its reset and step "
                    "are not deterministic given the task", step=at)
            self._log.append(list(entry))

    def _replay_to(self, task: Task, log: list[list[Any]]) -> None:
        """The replay fallback of ``restore``: step on from the live episode when it is a
        prefix of ``log``, else reset and replay it all."""
        for attempt in range(2):
            if self._conn is None:
                self._start_worker()
                self.stats.recoveries += 1
                self._task, self._log = None, []
            prefix = self._task == task and self._log == log[:len(self._log)]
            try:
                self._replay_log(task, log, len(self._log) if prefix else 0, reset=not prefix)
                return
            except _Dead:
                self._drop_worker(kill=True)
                self._task, self._log = None, []
                if attempt:
                    raise ForkError(f"{self.name}: its fork worker died twice replaying "
                                    f"task {task.task_id!r}") from None
            except _Hung:
                self._drop_worker(kill=True)
                self._task, self._log = None, []
                raise TimeoutError(f"{self.name}: its fork worker did not answer within "
                                   f"{self.timeout:g} s while replaying task "
                                   f"{task.task_id!r}; it was killed") from None

    def _fork_from(self, entry: Frozen) -> bool:
        """Make a fork of the frozen copy ``entry`` the live worker (it answers on the
        connection that asked for it); False when the copy is gone (the caller replays)."""
        token = secrets.token_hex(16)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(entry.path)
            info = self._ask(sock, {"op": "fork", "token": entry.token, "live_token": token})
        except (OSError, _Dead, _Hung, ForkError, RuntimeError, ValueError):
            sock.close()
            return False
        if self._conn is not None:
            self._conn.close()  # the old live worker exits as its connection closes
        self._conn, self._token = sock, token
        self.worker_pid, self._has_reseed = int(info["pid"]), bool(info["has_reseed"])
        return True


def parse_fork(state: bytes) -> tuple[Task, list[list[Any]], dict[str, str] | None]:
    """The task, log and handle of a fork snapshot (the handle is None for a plain replay
    snapshot, which restores by replay); ``ValueError`` for anything else."""
    try:
        doc = json.loads(state)
    except (ValueError, RecursionError):
        raise ValueError("not a fork snapshot: not JSON") from None
    if isinstance(doc, dict) and doc.get("strategy") == "replay":
        task, log = parse_replay(state)
        return task, log, None
    if not isinstance(doc, dict) or doc.get("strategy") != FORK:
        raise ValueError("not a fork snapshot")
    handle = doc.get("handle")
    if not (isinstance(handle, dict) and set(handle) == {"id", "path", "token", "env"}
            and all(isinstance(v, str) for v in handle.values())):
        raise ValueError("not a fork snapshot: malformed handle")
    task, log = parse_replay(canonical(doc.get("replay")))
    return task, log, handle


def make_fork_env(spec: str, env_class: type[Environment] | None = None,
                  **config: Any) -> ForkEnv:
    """A ``ForkEnv`` of ``spec`` built in its worker, never in this process: what ``make_env``
    calls for a class whose ``snapshot_strategy`` is ``fork`` (its constructor may need a
    main thread, so it must not run on the caller's tool-pool thread), instead of building
    it and wrapping the instance (``fork_env``)."""
    from train.envs.registry import resolve_env

    cls = env_class or resolve_env(spec)
    if not SUPPORTED:
        raise ValueError(f"{cls.__name__}: unknown snapshot strategy {FORK!r}; choose from "
                         f"{', '.join(sorted(SNAPSHOT_STRATEGIES))}")
    return ForkEnv(cls, spec, config)


def fork_env(env: Environment) -> Environment:
    """The ``fork`` entry of ``SNAPSHOT_STRATEGIES``: close the instance made in this process
    and rebuild it in a worker from its class, spec and ``_make_config`` (the keyword
    arguments ``make_env`` got; none when it does not record them)."""
    cls, spec = type(env), getattr(env, "spec", None)
    config = dict(getattr(env, "_make_config", None) or {})
    env.close()
    return ForkEnv(cls, spec, config)


if SUPPORTED:
    SNAPSHOT_STRATEGIES[FORK] = fork_env

__all__ = ["DEFAULT_TIMEOUT", "FORK", "SUPPORTED", "TIMEOUT_ENV", "ForkEnv", "ForkError",
           "ForkStats", "fork_env", "make_fork_env", "parse_fork"]

