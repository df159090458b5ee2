"""The processes of a ``fork`` environment's group and the wire they speak
(``train.envs.fork``'s docstring says what the strategy does; this is the far side of it).

Processes. The *supervisor* (``python -m train.envs.fork_worker --supervisor CTL LIFELINE``,
started by ``ForkEnv``) imports the environment class, is the subreaper of its group and
forks *live workers* on request (``_supervise``); a live worker builds the environment on
its main thread and serves the caller's one connection (``_serve_live``, ``_serve_conn``);
``snapshot`` forks a *frozen copy* of the worker (``_freeze``), which waits on its own socket
and forks a new live worker from its state when asked (``_serve_frozen``). Every process
waits on the caller's lifeline pipe as well and exits when it closes.

Wire. Unix stream sockets in a private directory (``tempfile.mkdtemp``: mode 700, one
per caller process, a subdirectory per instance); every message is a 4-byte big-endian
length and canonical JSON, at most ``MAX_MESSAGE`` bytes. Every process (live or frozen)
has its own random 128-bit token, sent with every request and compared in constant time;
a request with another token is refused and its connection closed. Nothing received is
executed: requests name one of the operations ``hello``, ``reset``, ``step``, ``reseed``,
``expert_action``, ``snapshot``, ``close``, ``exit`` (live) or ``fork``, ``ping``,
``exit`` (frozen), whose arguments are strings, numbers and the task's fields.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import select
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

from train.envs.base import Environment, Task
from train.envs.sandbox_worker import reap_children  # stdlib only, import-safe

MAX_MESSAGE = 64 << 20
"""The largest message (bytes of JSON) either side accepts."""
_HEADER = struct.Struct(">I")


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit] + "..."


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=True).encode("ascii")


# ----- wire -----------------------------------------------------------------------------

def send(sock: socket.socket, obj: Any) -> None:
    data = canonical(obj)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes is over {MAX_MESSAGE}")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes is over {MAX_MESSAGE}")
    return json.loads(_recv_exact(sock, n))


def _listen(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(8)
    return sock


# ----- the processes of a group (supervisor, live worker, frozen copies) ----------------

def _exit_now(code: int = 0) -> NoReturn:
    """Leave a forked process without atexit handlers or finalizers (they belong to the
    process it was copied from)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _child(fn: Callable[[], None]) -> NoReturn:
    try:
        fn()
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
        _exit_now(1)
    _exit_now(0)


_CHILDREN: set[int] = set()
"""The copies this worker process forked and has not reaped yet (each process its own)."""


def _spawn_copy(fn: Callable[[], None], close: list[socket.socket]) -> int:
    """Fork: the child (closing ``close``) runs ``fn`` and exits; its pid. One fork, no
    wait: the parent reaps it later (``_reap_copies``), or the supervisor does once the
    parent is gone (it is the group's subreaper)."""
    pid = os.fork()
    if pid == 0:
        _CHILDREN.clear()
        for s in close:
            s.close()
        _child(fn)
    _CHILDREN.add(pid)
    return pid


def _reap_copies() -> None:
    """Reap the copies this process forked that have exited (by pid: an environment's own
    child processes are not touched)."""
    for pid in list(_CHILDREN):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _CHILDREN.discard(pid)


def _reply_error(conn: socket.socket, exc: BaseException) -> None:
    send(conn, {"ok": False, "type": type(exc).__name__, "error": _one_line(str(exc))})


def _authentic(req: Any, token: str) -> bool:
    return (isinstance(req, dict) and isinstance(req.get("token"), str)
            and hmac.compare_digest(req["token"].encode(), token.encode()))


def _wait_readable(fds: list[Any], lifeline: int, timeout: float | None = None) -> list[Any]:
    """``select`` on ``fds`` and the lifeline; exits the process when the caller died."""
    ready, _, _ = select.select([*fds, lifeline], [], [], timeout)
    if lifeline in ready:
        _exit_now(0)
    return ready


def _serve_live(listener: socket.socket, path: str, token: str, lifeline: int,
                spec: str, fallback: str, config: dict[str, Any], accept_timeout: float
                ) -> None:
    """A new live worker (forked by the supervisor): accept the caller's one connection
    (the first whose request carries ``token``), then serve it (``_serve_conn``)."""
    while True:
        if not _wait_readable([listener], lifeline, accept_timeout):
            return  # nobody came: the caller gave up
        conn, _ = listener.accept()
        try:
            req = recv(conn)
        except (EOFError, OSError, ValueError):
            conn.close()
            continue
        if _authentic(req, token):
            break
        with contextlib.suppress(OSError):
            _reply_error(conn, PermissionError("bad token"))
        conn.close()
    listener.close()
    with contextlib.suppress(OSError):
        os.unlink(path)
    _serve_conn(conn, req, token, lifeline, None, spec, fallback, config, accept_timeout)


def _serve_conn(conn: socket.socket, req: dict[str, Any], token: str, lifeline: int,
                env: Environment | None, spec: str, fallback: str, config: dict[str, Any],
                accept_timeout: float) -> None:
    """The live worker's loop: answer ``req`` and every later request on ``conn`` (building
    ``env`` on ``hello`` if there is none yet) until the caller closes the connection or
    says ``close``/``exit``."""
    from train.envs.registry import EnvSpecError, resolve_env

    conn.settimeout(None)  # waits between requests are select's, on the lifeline too
    while True:
        op = req.get("op")
        try:
            if op == "hello":
                if env is None:
                    try:
                        cls = resolve_env(spec)
                    except EnvSpecError:
                        cls = resolve_env(fallback)
                    env = cls(**config)
                value: Any = {"pid": os.getpid(), "has_reseed": callable(getattr(
                    env, "reseed", None))}
            elif env is None:
                raise RuntimeError("the worker has no environment yet (say hello first)")
            elif op == "reset":
                value = env.reset(Task(**req["task"]))
            elif op == "step":
                r = env.step(str(req["action"]))
                value = [r.observation, bool(r.done),
                         {str(k): float(v) for k, v in r.reward_parts.items()}]
            elif op == "reseed":
                env.reseed(int(req["key"]))  # type: ignore[attr-defined]
                value = None
            elif op == "expert_action":
                value = env.expert_action()
            elif op == "snapshot":
                value = _freeze(env, conn, str(req["path"]), str(req["frozen_token"]),
                                lifeline, spec, fallback, config, accept_timeout)
            elif op == "close":
                env.close()
                send(conn, {"ok": True, "value": None})
                return
            elif op == "exit":
                send(conn, {"ok": True, "value": None})
                return
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as exc:
            _reply_error(conn, exc)
        else:
            send(conn, {"ok": True, "value": value})
        try:
            _wait_readable([conn], lifeline)
            req = recv(conn)
        except (EOFError, OSError, ValueError):
            return  # the caller closed the connection: this worker is done
        if not _authentic(req, token):
            _reply_error(conn, PermissionError("bad token"))
            return


def _freeze(env: Environment, conn: socket.socket, path: str, token: str, lifeline: int,
            spec: str, fallback: str, config: dict[str, Any], accept_timeout: float) -> int:
    """Fork a frozen copy of this worker, waiting on ``path``; its pid."""
    _reap_copies()  # copies evicted since the last snapshot
    listener = _listen(path)
    try:
        return _spawn_copy(partial(_serve_frozen, listener, path, token, lifeline, env, spec,
                                   fallback, config, accept_timeout), [conn])
    finally:
        listener.close()


def _serve_frozen(listener: socket.socket, path: str, token: str, lifeline: int,
                  env: Environment, spec: str, fallback: str, config: dict[str, Any],
                  accept_timeout: float) -> None:
    """A frozen copy: ``fork`` forks a new live worker from this state, which takes over
    the request's connection and answers it as a ``hello``; ``exit`` ends the copy."""
    while True:
        ready = _wait_readable([listener], lifeline, 2.0)
        _reap_copies()  # live workers forked from this copy that have exited since
        if not ready:
            continue
        conn, _ = listener.accept()
        conn.settimeout(accept_timeout)
        try:
            req = recv(conn)
            if not _authentic(req, token):
                _reply_error(conn, PermissionError("bad token"))
            elif req.get("op") == "fork":
                live = str(req["live_token"])
                _spawn_copy(partial(_serve_conn, conn, {"op": "hello", "token": live}, live,
                                    lifeline, env, spec, fallback, config, accept_timeout),
                            [listener])
            elif req.get("op") == "ping":
                send(conn, {"ok": True, "value": os.getpid()})
            elif req.get("op") == "exit":
                with contextlib.suppress(OSError):
                    os.unlink(path)
                send(conn, {"ok": True, "value": None})
                return
            else:
                _reply_error(conn, ValueError(f"unknown request {req.get('op')!r}"))
        except (EOFError, OSError, ValueError, KeyError):
            pass
        finally:
            conn.close()


def _set_subreaper() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _supervise(ctl: socket.socket, lifeline: int) -> None:
    """The supervisor: reap the group, spawn live workers on request; when the caller goes
    away (its connection or the lifeline closes) or says ``close``, kill the whole group."""
    from train.envs.registry import EnvSpecError, resolve_env

    _set_subreaper()
    while True:
        fds: list[Any] = [ctl, lifeline]
        ready, _, _ = select.select(fds, [], [], 0.5)
        reap_children()
        if lifeline in ready:
            break
        if ctl not in ready:
            continue
        try:
            req = recv(ctl)
        except (EOFError, OSError, ValueError):
            break
        if not isinstance(req, dict) or req.get("op") != "spawn":
            break  # "close", or nonsense: either way the group ends
        try:
            spec, fallback = str(req["spec"]), str(req["fallback"])
            try:
                resolve_env(spec)  # imported once here, so that every worker forks it ready
            except EnvSpecError:
                resolve_env(fallback)
            path, token, config = str(req["path"]), str(req["token"]), dict(req["config"])
            timeout = float(req["timeout"])
            listener = _listen(path)
            try:
                pid = _spawn_copy(partial(_serve_live, listener, path, token, lifeline, spec,
                                          fallback, config, timeout), [ctl])
            finally:
                listener.close()
        except Exception as exc:
            _reply_error(ctl, exc)
        else:
            send(ctl, {"ok": True, "value": pid})
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[0] != "--supervisor":
        raise SystemExit("usage: python -m train.envs.fork_worker --supervisor CONTROL_FD "
                         "LIFELINE_FD (started by ForkEnv, not by hand)")
    ctl = socket.socket(fileno=int(argv[1]))
    _supervise(ctl, int(argv[2]))


__all__ = ["MAX_MESSAGE", "canonical", "main", "recv", "send"]

if __name__ == "__main__":
    main(sys.argv[1:])
