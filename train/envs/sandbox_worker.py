"""The program that runs inside a python-tool sandbox (``train.envs.sandbox``).

It runs under the *system* Python (the unprivileged sandbox uid cannot read the project's
venv), started as ``python -s -B -c <this file's source> CONFIG_JSON``, so it imports
nothing of this project and only the standard library (it needs Python >= 3.9 for
``socket.send_fds``; annotations are strings, so newer syntax there is fine).

Two processes, so that cell code cannot reach the bookkeeping (issue 13 item 9):

* the **supervisor** (this program's main process) holds the control pipe to the host,
  the capture files and the bookkeeping: it kills and counts the processes a cell left
  behind, counts the executor's threads, and watches the memory of the whole sandbox;
* the **executor**, forked once at start, holds the persistent namespace and runs the
  cells. It never has the control pipe (closed right after the fork) and its
  ``sys.modules['__main__']`` is a fresh module whose globals are the cells' namespace.
  Each cell arrives on two fresh pipes passed over a Unix socket (``SCM_RIGHTS``): one
  carrying the cell, one for its answer. The supervisor reads exactly one answer from
  that cell's own pipe and then closes it, so whatever a cell writes anywhere cannot
  become another cell's answer, and a cell cannot shift later observations.

Memory (issue 13 item 7): every ``WATCH_S`` seconds while a cell runs, the supervisor sums
the proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``) of every process of the
sandbox plus the sizes of the memfd files they hold open; past ``total_memory_bytes``
it kills every process but itself and answers ``{"memory_exceeded": bytes}``, then exits.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import random
import resource
import signal
import socket
import struct
import sys
import time
import traceback
import types
import zlib
from typing import Any

FRAME = struct.Struct(">I")
WATCH_S = 0.01  # memory watchdog period while a cell runs
MAX_ANSWER = 1 << 20  # an executor answer is a few hundred bytes; more is a forgery
R = resource


class Config:
    """The worker's configuration (the JSON argument)."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.cpu_s = int(raw["cpu_s"])
        self.cpu_total_s = int(raw["cpu_total_s"])
        self.memory_bytes = int(raw["memory_bytes"])
        self.total_memory_bytes = int(raw.get("total_memory_bytes", raw["memory_bytes"]))
        self.file_bytes = int(raw["file_bytes"])
        self.open_files = int(raw["open_files"])
        self.processes = int(raw["processes"])
        self.output_bytes = int(raw["output_bytes"])
        self.pid_namespace = bool(raw["pid_namespace"])


# ---------------------------------------------------------------------------- shared


def _capture_file(name: str) -> int:
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)  # the executor dups it to fds 1 and 2
    except (AttributeError, OSError):
        import tempfile

        fd, path = tempfile.mkstemp()
        os.unlink(path)
        return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _frames(buf: bytes) -> list[bytes]:
    """The complete length-prefixed frames at the start of ``buf``."""
    out = []
    pos = 0
    while pos + FRAME.size <= len(buf):
        (size,) = FRAME.unpack_from(buf, pos)
        if pos + FRAME.size + size > len(buf):
            break
        out.append(buf[pos + FRAME.size:pos + FRAME.size + size])
        pos += FRAME.size + size
    return out


def _read_all(fd: int, limit: int) -> bytes:
    buf = b""
    while len(buf) <= limit:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    return buf


def _set_limits(cfg: Config) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for res, value in ((R.RLIMIT_CORE, 0), (R.RLIMIT_AS, cfg.memory_bytes),
                       (R.RLIMIT_FSIZE, cfg.file_bytes), (R.RLIMIT_NOFILE, cfg.open_files),
                       (R.RLIMIT_NPROC, cfg.processes)):
        R.setrlimit(res, (value, value))
    R.setrlimit(R.RLIMIT_CPU, (cfg.cpu_s, cfg.cpu_total_s))


# ---------------------------------------------------------------------------- executor


def _last_line(exc: BaseException, cap: int) -> str:
    try:
        if isinstance(exc, SyntaxError):
            line = f"{type(exc).__name__}: {exc.msg} (line {exc.lineno})"
        else:
            lines = traceback.format_exception_only(type(exc), exc)
            line = lines[-1].strip() if lines else type(exc).__name__
    except BaseException:
        line = type(exc).__name__
    return line if len(line) <= cap else line[:cap] + "...(cut)"


def run_executor(sock: socket.socket, cfg: Config, out_fd: int, err_fd: int) -> None:
    """The executor's loop: one cell per message on ``sock``; never returns."""
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = module  # the cells' own namespace, not this program
    namespace = module.__dict__
    pid = os.getpid()
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(sock, 1, 2)
        except OSError:
            os._exit(0)
        if len(fds) != 2:
            os._exit(0)  # the supervisor went away
        code_r, answer_w = fds
        try:
            cell = json.loads(_read_all(code_r, 1 << 26))
        finally:
            os.close(code_r)
        reap_children()
        for fd, target in ((out_fd, 1), (err_fd, 2)):
            os.dup2(fd, target)
        _start_cell(cfg, str(cell["seed"]))
        error = _exec(str(cell["code"]), namespace, pid, cfg.output_bytes)
        _end_cell()
        data = json.dumps({"error": error}).encode("ascii")
        try:
            _write_all(answer_w, FRAME.pack(len(data)) + data)
            os.close(answer_w)
        except OSError:
            pass  # the cell closed its answer pipe: the supervisor reports it
        reap_children()


def reap_children() -> None:
    """Reap every child of this process that has exited, without waiting (the cell's
    children the supervisor killed; ``train.envs.fork``'s workers and copies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _start_cell(cfg: Config, seed: str) -> None:
    used = R.getrusage(R.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime) + 1 + cfg.cpu_s
    # an earlier cell may have lowered its own hard limit: it keeps what it asked for
    with contextlib.suppress(ValueError, OSError):
        R.setrlimit(R.RLIMIT_CPU, (soft, R.getrlimit(R.RLIMIT_CPU)[1]))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", write_through=True)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        with contextlib.suppress(Exception):
            np.random.seed(zlib.crc32(seed.encode()))


def _exec(code: str, namespace: dict[str, Any], pid: int, cap: int) -> str | None:
    """Run one cell; a last bare expression is echoed (repr), as in a notebook."""
    error = None
    try:
        tree = ast.parse(code, filename="<cell>", mode="exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
        exec(compile(tree, "<cell>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except BaseException as exc:
        if os.getpid() != pid:
            os._exit(1)  # a child forked by the cell never returns into the loop
        error = _last_line(exc, cap)
    if os.getpid() != pid:
        os._exit(0)
    return error


def _end_cell() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except BaseException:
            pass
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.setitimer(signal.ITIMER_VIRTUAL, 0)
    signal.setitimer(signal.ITIMER_PROF, 0)


# ---------------------------------------------------------------------------- supervisor


class MemoryExceeded(Exception):
    """The sandbox's processes together used more than ``total_memory_bytes``."""


class ExecutorGone(Exception):
    """The executor exited (``os._exit``, a signal, the CPU limit)."""


class Supervisor:
    """The control loop: requests from the host, cells to the executor, answers back."""

    def __init__(self, cfg: Config, ctl_in: int, ctl_out: int, sock: socket.socket,
                 executor: int, out_fd: int, err_fd: int) -> None:
        self.cfg, self.ctl_in, self.ctl_out, self.sock = cfg, ctl_in, ctl_out, sock
        self.executor, self.out_fd, self.err_fd = executor, out_fd, err_fd
        self.pid = os.getpid()
        self.pgrp = os.getpgrp()
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.early_strays = 0

    # -- host channel
    def read_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = os.read(self.ctl_in, n - len(buf))
            if not chunk:
                self.shutdown(0)  # the host went away
            buf += chunk
        return buf

    def send(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode("ascii")
        _write_all(self.ctl_out, FRAME.pack(len(data)) + data)

    def shutdown(self, code: int) -> None:
        for pid in self.others(include_executor=True):
            _kill(pid)
        os._exit(code)

    # -- processes
    def others(self, include_executor: bool = False) -> list[int]:
        """Live processes of this sandbox but init, the supervisor (and the executor)."""
        skip = {1, self.pid} if include_executor else {1, self.pid, self.executor}
        return [pid for pid in self.sandbox_pids() if pid not in skip]

    def sandbox_pids(self) -> list[int]:
        """Every live process of this sandbox (with a pid namespace: all that /proc shows;
        without one: the worker's process group)."""
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] in "ZX":
                continue
            if not self.cfg.pid_namespace and int(fields[2]) != self.pgrp:
                continue  # without a pid namespace only the worker's process group is ours
            found.append(int(name))
        return found

    def executor_alive(self) -> bool:
        try:
            pid, _ = os.waitpid(self.executor, os.WNOHANG)
        except ChildProcessError:
            return False
        return pid == 0

    def settle(self, check: Any, grace_s: float = 0.05) -> Any:
        deadline = time.monotonic() + grace_s
        while True:
            self.reap_strays()
            left = check()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.002)

    def reap_strays(self) -> None:
        """Reap exited children of the supervisor (strays re-parent to init, not here)."""
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0 or pid == self.executor:
                    return
        except ChildProcessError:
            return

    def kill_strays(self) -> int:
        left = self.settle(self.others)
        if not left:
            return 0
        for _ in range(1000):
            for pid in self.others():
                _kill(pid)
            self.reap_strays()
            if not self.others():
                break
            time.sleep(0.001)
        return len(left)

    def executor_threads(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.executor}/task")) - 1
        except OSError:
            return 0

    def memory_used(self) -> int:
        """Pss of every process of the sandbox plus the memfd files they hold open."""
        total = 0
        seen = set()
        for pid in self.sandbox_pids():
            name = str(pid)
            total += self._pss(name)
            try:
                fds = os.listdir(f"/proc/{name}/fd")
            except OSError:
                continue
            for fd in fds:
                path = f"/proc/{name}/fd/{fd}"
                try:
                    if not os.readlink(path).startswith("/memfd:"):
                        continue
                    st = os.stat(path)
                except OSError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_size
        return total

    def _pss(self, pid: str) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * self.page
        except (OSError, ValueError, IndexError):
            return 0

    # -- one cell
    def run_cell(self, cell: dict[str, Any]) -> dict[str, Any]:
        self.early_strays = 0
        code_r, code_w = os.pipe()
        answer_r, answer_w = os.pipe()
        try:
            socket.send_fds(self.sock, [b"c"], [code_r, answer_w])
        except OSError:
            raise ExecutorGone from None
        finally:
            os.close(code_r)
            os.close(answer_w)
        for fd in (self.out_fd, self.err_fd):
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)  # the executor's fds 1 and 2 share this offset
        try:
            _write_all(code_w, json.dumps({"code": cell["code"], "seed": cell["seed"]}
                                          ).encode("ascii"))
        except OSError:
            pass  # the executor died: noticed below
        finally:
            os.close(code_w)
        try:
            answer = self.await_answer(answer_r)
        finally:
            os.close(answer_r)
        error = answer.get("error") if isinstance(answer, dict) else None
        if error is not None and not isinstance(error, str):
            error = "the cell forged its answer"
        if answer is None:
            error = "the cell closed its answer channel"
        result: dict[str, Any] = {"error": error,
                                  "strays": self.early_strays + self.kill_strays(),
                                  "threads": self.settle(self.executor_threads)}
        if cell["output"]:
            cap = self.cfg.output_bytes
            for key, fd in (("stdout", self.out_fd), ("stderr", self.err_fd)):
                size = os.fstat(fd).st_size
                result[key] = os.pread(fd, min(size, cap), 0).decode("utf-8", "replace")
                result[key + "_bytes"] = size
        return result

    def await_answer(self, fd: int) -> dict[str, Any] | None:
        """The executor's answer on this cell's own pipe: the last complete frame before
        the pipe's end (the executor closes its end once the cell is over, so a frame the
        cell wrote there itself is superseded by the real one), watching memory meanwhile.

        Children of the cell inherit the pipe and would hold its end open: once a frame
        is in and the end is 50 ms late, they are killed (and counted as strays)."""
        import select

        buf = b""
        first_frame_at: float | None = None
        while True:
            ready, _, _ = select.select([fd], [], [], WATCH_S)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > MAX_ANSWER:
                    return None
                if first_frame_at is None and _frames(buf):
                    first_frame_at = time.monotonic()
                continue
            used = self.memory_used()
            if used > self.cfg.total_memory_bytes:
                raise MemoryExceeded(used)
            if first_frame_at is not None and time.monotonic() - first_frame_at > 0.05:
                self.early_strays += self.kill_strays()
                first_frame_at = time.monotonic()
            if not self.executor_alive():
                break
        frames = _frames(buf)
        if not frames:
            deadline = time.monotonic() + 0.5  # EOF: the executor is exiting (its fds
            while time.monotonic() < deadline:  # close before it is reapable) or the cell
                if not self.executor_alive():  # closed the pipe
                    raise ExecutorGone
                time.sleep(0.002)
            return None
        if not self.executor_alive():
            raise ExecutorGone
        try:
            obj = json.loads(frames[-1])
        except (ValueError, UnicodeDecodeError):
            return None
        return obj if isinstance(obj, dict) else None

    def loop(self) -> None:
        self.send({"ready": True})
        while True:
            size = FRAME.unpack(self.read_exact(FRAME.size))[0]
            request = json.loads(self.read_exact(size))
            for cell in request["cells"]:
                try:
                    result = self.run_cell(cell)
                except MemoryExceeded as exc:
                    for pid in self.others(include_executor=True):
                        _kill(pid)
                    self.send({"memory_exceeded": int(exc.args[0])})
                    os._exit(3)
                except ExecutorGone:
                    self.shutdown(2)  # the host sees the worker exit: status "died"
                self.send(result)


def _not_dumpable() -> None:
    """``PR_SET_DUMPABLE`` 0: a cell (same uid, no capabilities) cannot open the
    supervisor's ``/proc/PID/mem`` to rewrite its bookkeeping."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        pass


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    cfg = Config(json.loads(argv[1]))
    ctl_in = os.dup(0)  # dup() gives non-inheritable fds: no child ever sees them
    ctl_out = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out_fd, err_fd = _capture_file("stdout"), _capture_file("stderr")
    _set_limits(cfg)
    sup_sock, exe_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    executor = os.fork()
    if executor == 0:
        for fd in (ctl_in, ctl_out):
            os.close(fd)
        sup_sock.close()
        run_executor(exe_sock, cfg, out_fd, err_fd)
        os._exit(0)
    exe_sock.close()
    _not_dumpable()
    # The executor's CPU is what a cell may spend; the supervisor's own polling must not
    # run into the per-cell soft limit.
    R.setrlimit(R.RLIMIT_CPU, (cfg.cpu_total_s, cfg.cpu_total_s))
    Supervisor(cfg, ctl_in, ctl_out, sup_sock, executor, out_fd, err_fd).loop()


if __name__ == "__main__":
    main(sys.argv)
