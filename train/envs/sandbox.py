"""Run model-written Python in a bubblewrap sandbox, one persistent worker per sandbox.

A ``Sandbox`` is one long-lived interpreter: ``bwrap`` starts the system Python
(``SandboxConfig.python``, default ``/usr/bin/python3``) running ``WORKER_SOURCE`` (the
source of ``sandbox_worker.py``, passed with ``-c``: the sandbox uid cannot read the
project checkout), which executes successive code cells in one namespace and answers
each over a private pipe. The worker is two processes: a supervisor that holds the
control pipe and the bookkeeping, and an executor it forks that holds the namespace and
runs the cells, so cell code cannot reach the bookkeeping or the control channel (see
``sandbox_worker``). The ``python`` environment (``train.envs.python_env``) builds its
tool on it; nothing here knows about episodes.

Isolation (``sandbox_argv`` builds the exact command line)::

    setpriv --reuid 65534 --regid 65534 --clear-groups --     # when the caller is root
    bwrap --ro-bind /usr /usr --symlink usr/bin /bin ...       # /bin /lib* /sbin as on the host
          --proc /proc --dev /dev --size 64MiB --tmpfs /dev/shm
          --size 64MiB --tmpfs /tmp --size 64MiB --tmpfs /sandbox
          --remount-ro /  --chdir /sandbox
          --unshare-all --unshare-user --disable-userns --uid 65534 --gid 65534
          --hostname sandbox --cap-drop ALL --die-with-parent --new-session
          --clearenv --setenv PATH ... --info-fd N --seccomp M
          -- /usr/bin/python3 -s -B -c WORKER_SOURCE CONFIG_JSON

* Read-only system directories, nothing else of the host: no ``/etc``, ``/home``,
  ``/root``, no project checkout. Writable: a private, size-capped tmpfs work
  directory ``/sandbox`` (also ``HOME``), ``/tmp`` and ``/dev/shm`` (capped like the
  others: it was an unbounded tmpfs); all vanish with the sandbox.
* All namespaces unshared (user, pid, net, ipc, uts, cgroup, mount): no network
  (a new network namespace holding only its own loopback, no route out, no DNS),
  and the sandbox sees only its own processes. No capabilities; nested user
  namespaces disabled (``--disable-userns``, used when bwrap has it: >= 0.8).
* An unprivileged uid on the host. ``RLIMIT_NPROC`` does not bind host root (the
  kernel exempts it, even inside a user namespace that maps root to another
  uid), so when the caller is root the sandbox is started as ``uid``/``gid``
  (65534, *nobody*) through ``setpriv``. The interpreter must therefore be one
  that uid can read: the system Python, not a venv or pyenv under ``/root``.
* The worker sets rlimits on itself before it reads any code: ``RLIMIT_AS``
  (``memory_bytes``), ``RLIMIT_FSIZE`` (``file_bytes``; ``SIGXFSZ`` ignored, so
  an oversized write fails with ``OSError`` instead of killing the worker),
  ``RLIMIT_NOFILE`` (``open_files``), ``RLIMIT_NPROC`` (``processes``, counted
  per user namespace, so per sandbox), ``RLIMIT_CORE`` 0 and ``RLIMIT_CPU``
  (soft limit reset before every cell to the CPU already used plus ``cpu_s``;
  hard limit ``cpu_total_s`` for the sandbox's life).
* Memory of the sandbox as a whole (``total_memory_bytes``), not only per process: the
  supervisor sums the proportional set size of every process of the sandbox, plus the
  memfd files they hold, every 10 ms while a cell runs; past the budget it kills them
  all and the run ends with status ``memory``. Why not a cgroup: this machine mounts
  cgroup v1 controllers (``/sys/fs/cgroup/memory``, writable by root only) beside an
  empty cgroup v2 hierarchy with no delegated memory controller, so a cgroup would
  hold only when the caller is root; the watchdog runs inside the sandbox as the
  sandbox uid and holds for root and unprivileged callers alike. Its price: an
  allocation faster than ~10 ms can overshoot briefly (each process stays under its
  ``RLIMIT_AS``), and a pipe's buffers are not counted.
* A seccomp filter (``bwrap --seccomp``, a BPF program built by ``seccomp_program``)
  refuses with EPERM the syscalls of ``BLOCKED_SYSCALLS`` (ptrace,
  process_vm_readv/writev, perf_event_open, io_uring_*, bpf, userfaultfd, keyctl and
  the key syscalls, mount and the new mount API, unshare/setns, module and kexec
  loading, reboot, swap, quotactl, acct, personality, syslog, fanotify_init, handle-based
  opens) and every syscall made through a foreign ABI (i386 or x32 on x86_64). Tables
  exist for x86_64 and aarch64; elsewhere no filter is loaded. It is a deny list, not
  an allow list: what it does not name, a cell may call. The supervisor also marks
  itself non-dumpable, so a cell cannot open its ``/proc/PID/mem``.
* A wall-clock limit (``timeout_s``) per cell, enforced here: past it the whole
  sandbox is killed. ``close`` kills the sandbox's pid-namespace init, which makes
  the kernel kill every process in the namespace, then reaps bwrap; nothing
  outlives a closed sandbox. ``--die-with-parent`` does the same if this process
  dies (note: if the *thread* that started the sandbox exits, Linux treats that
  as the parent dying too).
* After every cell the supervisor kills and counts processes the cell left running
  (every process of the namespace but init, the supervisor and the executor) and
  counts threads left running in the executor; the caller decides what that means
  (the env rolls the cell back).
* stdout and stderr of a cell (fds 1 and 2, so child processes are captured too)
  go to anonymous memory files; only the first ``output_bytes`` of each come
  back, with the full size.

Modules: ``SandboxConfig`` and the exact command line that isolates a sandbox (``sandbox_argv``,
``seccomp_program``, ``BLOCKED_SYSCALLS``) are ``train.envs.sandbox_isolation``; this module
checks that a real sandbox runs here (``sandbox_mode``) and runs cells in one (``Sandbox``).

Where bwrap is missing or cannot create namespaces, ``sandbox_mode`` raises
``SandboxUnavailable`` explaining why and how to install it, unless the config
says ``allow_unsafe=True``: then the worker runs as a plain subprocess (rlimits,
its own session, a temporary work directory, the uid drop when root) with no
filesystem, network or pid isolation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from train.envs.sandbox_isolation import (
    INSTALL_HINT,
    SandboxConfig,
    SandboxUnavailable,
    drop_to,
    find_executable,
    mounted_dirs,
    sandbox_argv,
    sandbox_env,
    seccomp_program,
)

_FRAME = struct.Struct(">I")


class CellRequest(NamedTuple):
    """One code cell to run: its source, the seed ``random`` gets before it, and whether
    its output should come back (replayed cells only report their status)."""

    code: str
    seed: str
    output: bool = True


class CellResult(NamedTuple):
    """What one cell did. ``error`` is the last line of its exception (``"ZeroDivisionError:
    division by zero"``) or None; ``strays``/``threads`` count processes (killed) and
    threads the cell left running. Output fields are empty when not requested."""

    error: str | None
    strays: int
    threads: int
    stdout: str = ""
    stderr: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0


RunStatus = Literal["ok", "timeout", "died", "protocol", "memory"]


class RunOutcome(NamedTuple):
    """The result of ``Sandbox.run``: ``results`` holds one entry per cell that finished.

    ``status`` is ``ok`` when every cell finished; otherwise the sandbox was killed
    during cell ``len(results)``: ``timeout`` (past ``timeout_s``, or startup past
    ``startup_timeout_s``), ``died`` (the worker exited: ``os._exit``, a signal, the
    CPU limit), ``memory`` (the sandbox's processes together passed
    ``total_memory_bytes``) or ``protocol`` (the worker's answer was unreadable). ``detail`` is for
    logs: bwrap's stderr and the exit status (not deterministic, keep it out of
    observations)."""

    status: RunStatus
    results: list[CellResult]
    detail: str = ""


_probe_lock = threading.Lock()
_probe_cache: dict[tuple[Any, ...], str | None] = {}


def _probe(config: SandboxConfig) -> str | None:
    """Why a bwrap sandbox cannot run here, or None when a real one ran a cell."""
    bwrap = find_executable(config.bwrap)
    if bwrap is None:
        return f"bubblewrap not found (bwrap={config.bwrap!r} is not an executable on PATH)"
    python = config.python
    if not os.path.isfile(python):
        return f"the sandbox interpreter {python!r} does not exist"
    real = os.path.realpath(python)
    if not any(real == d or real.startswith(d.rstrip("/") + "/")
               for d in map(os.path.realpath, mounted_dirs(config))):
        return (f"the sandbox interpreter {python!r} ({real}) is not under a directory "
                f"mounted in the sandbox ({', '.join(mounted_dirs(config))}); use the system "
                f"Python /usr/bin/python3 or add its prefix to ro_binds")
    quick = dataclasses.replace(config, allow_unsafe=False, timeout_s=30.0,
                                startup_timeout_s=30.0, cpu_s=30, cpu_total_s=30)
    with Sandbox(quick, unsafe=False) as sandbox:
        outcome = sandbox.run([CellRequest("print(6 * 7)", "0")])
    if outcome.status == "ok" and outcome.results[0].stdout == "42\n":
        return None
    detail = outcome.detail.strip() or f"status {outcome.status}"
    hint = ""
    if "namespace" in detail or "uid map" in detail or "Operation not permitted" in detail:
        hint = (" (user namespaces look disabled: check sysctl kernel.unprivileged_userns_clone=1,"
                " user.max_user_namespaces > 0 and, on Ubuntu >= 23.10, "
                "kernel.apparmor_restrict_unprivileged_userns=0)")
    return f"bwrap could not start a sandbox: {detail[-600:]}{hint}"


def sandbox_mode(config: SandboxConfig) -> Literal["bwrap", "unsafe"]:
    """``bwrap`` when a real sandbox works here (checked once per configuration, by
    running one), ``unsafe`` when it does not and ``config.allow_unsafe`` is set;
    otherwise ``SandboxUnavailable`` with the reason and how to fix it."""
    key = (config.bwrap, config.setpriv, config.python, config.uid, config.gid,
           config.ro_binds, config.tmpfs_bytes)
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _probe(config)
        problem = _probe_cache[key]
    if problem is None:
        return "bwrap"
    if not config.allow_unsafe:
        raise SandboxUnavailable(f"cannot sandbox model-written Python: {problem}. "
                                 f"{INSTALL_HINT}")
    warnings.warn(f"running model-written Python WITHOUT a sandbox ({problem}); "
                  f"allow_unsafe=True was given", RuntimeWarning, stacklevel=2)
    return "unsafe"


# ---------------------------------------------------------------------------
# One sandbox


class _Timeout(Exception):
    pass


class _Died(Exception):
    pass


class _Protocol(Exception):
    pass


class _Memory(Exception):
    pass


class _Handle:
    """The OS resources of one sandbox: ``terminate`` signals, ``reap`` waits and releases.

    With bwrap, killing the pid-namespace init (bwrap's child, whose pid bwrap wrote
    to ``info_r``) makes the kernel kill and reap every process of the namespace;
    bwrap then reaps init and exits, so nothing is left for anyone else to reap.
    Tearing a namespace down takes milliseconds, hence the split: a caller that
    discards a sandbox on a hot path signals it now and reaps it later.
    """

    def __init__(self, proc: subprocess.Popen[bytes], info_r: int, workdir: str | None,
                 unsafe: bool) -> None:
        self.proc, self.info_r, self.workdir, self.unsafe = proc, info_r, workdir, unsafe
        self.signalled = False
        self.reaped = False

    def terminate(self) -> None:
        if self.signalled:
            return
        self.signalled = True
        inner: int | None = None
        if not self.unsafe and self.info_r >= 0 and self.proc.poll() is None:
            ready, _, _ = select.select([self.info_r], [], [], 0.5)
            if ready:
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    inner = int(json.loads(os.read(self.info_r, 4096) or b"{}")["child-pid"])
        if inner is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(inner, signal.SIGKILL)
        else:
            self._kill_outer()

    def _kill_outer(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    def reap(self, block: bool = True) -> bool:
        """Release everything once bwrap has exited; False if it has not and ``block`` is
        False."""
        if self.reaped:
            return True
        self.terminate()
        if self.proc.poll() is None:
            if not block:
                return False
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._kill_outer()
                self.proc.wait()
        if self.unsafe:
            # the worker's process group; children that left it were killed by the worker
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if self.info_r >= 0:
            with contextlib.suppress(OSError):
                os.close(self.info_r)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.reaped = True
        return True


class Sandbox:
    """One sandboxed interpreter process, started at construction (asynchronously: the
    first ``run`` waits for it to come up).

        >>> with Sandbox(SandboxConfig()) as sb:                       # doctest: +SKIP
        ...     outcome = sb.run([CellRequest("x = 2", "0"), CellRequest("x + 3", "1")])
        >>> outcome.status, outcome.results[-1].stdout                 # doctest: +SKIP
        ('ok', '5\\n')

    Every failure kills the sandbox (``alive`` turns False); a dead sandbox answers
    ``run`` with status ``died``. ``unsafe`` runs without bwrap (see ``sandbox_mode``).
    """

    def __init__(self, config: SandboxConfig, *, unsafe: bool = False) -> None:
        self.config = config
        self.unsafe = unsafe
        self._ready = False
        self._dead = False
        workdir: str | None = None
        info_r, info_w = -1, -1
        drop = drop_to(config)
        use_setpriv = drop is not None and find_executable(config.setpriv) is not None
        kwargs: dict[str, Any] = {}
        if drop is not None and not use_setpriv:
            kwargs = {"user": drop[0], "group": drop[1], "extra_groups": []}
        if unsafe:
            workdir = tempfile.mkdtemp(prefix="rtrees-python-")
            if drop is not None:
                os.chown(workdir, drop[0], drop[1])
            argv, cwd, env = sandbox_argv(config, unsafe=True), workdir, sandbox_env(workdir)
        seccomp_r = -1
        if not unsafe:
            info_r, info_w = os.pipe()
            program = seccomp_program()
            if program is not None:  # a few hundred bytes: fits the pipe buffer
                seccomp_r, seccomp_w = os.pipe()
                os.write(seccomp_w, program)
                os.close(seccomp_w)
            argv = sandbox_argv(config, info_fd=info_w,
                                seccomp_fd=seccomp_r if seccomp_r >= 0 else None)
            cwd, env = "/", {"PATH": "/usr/bin:/bin"}
        passed = tuple(fd for fd in (info_w, seccomp_r) if fd >= 0)
        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=cwd, env=env, start_new_session=True, close_fds=True,
                pass_fds=passed, **kwargs)
        except BaseException:
            for fd in (info_r, *passed):
                if fd >= 0:
                    os.close(fd)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            raise
        for fd in passed:
            os.close(fd)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._w = self._proc.stdin.fileno()
        self._r = self._proc.stdout.fileno()
        os.set_blocking(self._w, False)
        os.set_blocking(self._r, False)
        self._handle = _Handle(self._proc, info_r, workdir, unsafe)
        self._finalizer = weakref.finalize(self, self._handle.reap)

    @property
    def pid(self) -> int:
        """Host pid of the outermost process (setpriv/bwrap, or the worker when unsafe)."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._dead and self._proc.poll() is None

    def wait_ready(self) -> bool:
        """Block until the worker is up (True) or the sandbox failed to start (False)."""
        if self._ready:
            return self.alive
        try:
            self._await_ready()
        except (_Timeout, _Died, _Protocol):
            self.close()
            return False
        return True

    def run(self, cells: Sequence[CellRequest]) -> RunOutcome:
        """Run ``cells`` in order in this interpreter; each gets ``timeout_s`` of wall clock
        from the end of the previous one (the first also waits for startup)."""
        results: list[CellResult] = []
        if not self.alive:
            self._dead = True
            return RunOutcome("died", results, "the sandbox is not running")
        try:
            if not self._ready:
                self._await_ready()
            payload = {"cells": [{"code": c.code, "seed": c.seed, "output": c.output}
                                 for c in cells]}
            self._send(json.dumps(payload, ensure_ascii=True).encode("ascii"),
                       time.monotonic() + self.config.timeout_s)
            for cell in cells:
                frame = self._recv(time.monotonic() + self.config.timeout_s)
                if "memory_exceeded" in frame:
                    raise _Memory(frame["memory_exceeded"])
                results.append(_cell_result(frame, cell.output))
        except _Memory as exc:
            return self._fail("memory", results, f"the sandbox used {exc.args[0]} bytes, "
                              f"more than total_memory_bytes={self.config.total_memory_bytes}")
        except _Timeout:
            return self._fail("timeout", results, "wall-clock limit")
        except _Died:
            return self._fail("died", results, "the worker exited")
        except _Protocol as exc:
            return self._fail("protocol", results, str(exc))
        return RunOutcome("ok", results)

    def close(self, wait: bool = True) -> None:
        """Kill the sandbox and everything in it (idempotent). With ``wait=False`` only
        send the signals; ``reap`` (or garbage collection) finishes the job."""
        self._dead = True
        if wait:
            self._finalizer()
        else:
            self._handle.terminate()

    def reap(self, block: bool = True) -> bool:
        """After ``close(wait=False)``: wait for the sandbox to be gone and release its
        resources; returns False if it is not gone yet and ``block`` is False."""
        self._dead = True
        return self._handle.reap(block)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------

    def _await_ready(self) -> None:
        frame = self._recv(time.monotonic() + self.config.startup_timeout_s)
        if frame.get("ready") is not True:
            raise _Protocol("the worker did not announce itself")
        self._ready = True

    def _fail(self, status: RunStatus, results: list[CellResult], why: str) -> RunOutcome:
        stderr = b""
        if self._proc.stderr is not None:
            with contextlib.suppress(OSError, ValueError):
                os.set_blocking(self._proc.stderr.fileno(), False)
                stderr = self._proc.stderr.read(65536) or b""
        code = self._proc.poll()
        self.close(wait=False)
        detail = f"{why}; exit status {code}; stderr: {stderr.decode('utf-8', 'replace')}"
        return RunOutcome(status, results, detail)

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(_FRAME.pack(len(data)) + data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            _, writable, _ = select.select([], [self._w], [], remaining)
            if not writable:
                raise _Timeout
            try:
                sent = os.write(self._w, view)
            except BlockingIOError:
                continue
            except (BrokenPipeError, OSError) as exc:
                raise _Died from exc
            view = view[sent:]

    def _read_exact(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout
            readable, _, _ = select.select([self._r], [], [], remaining)
            if not readable:
                raise _Timeout
            try:
                chunk = os.read(self._r, n - len(buf))
            except BlockingIOError:
                continue
            except OSError as exc:
                raise _Died from exc
            if not chunk:
                raise _Died
            buf += chunk
        return bytes(buf)

    def _recv(self, deadline: float) -> dict[str, Any]:
        (size,) = _FRAME.unpack(self._read_exact(_FRAME.size, deadline))
        # an answer holds two capped outputs, JSON-escaped (at most 12 bytes a character)
        if size > 24 * self.config.output_bytes + 65536:
            raise _Protocol(f"oversized answer ({size} bytes)")
        try:
            frame = json.loads(self._read_exact(size, deadline))
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Protocol(f"unreadable answer: {exc}") from None
        if not isinstance(frame, dict):
            raise _Protocol("unreadable answer: not an object")
        return frame


def _cell_result(frame: dict[str, Any], output: bool) -> CellResult:
    try:
        error = frame["error"]
        strays, threads = int(frame["strays"]), int(frame["threads"])
        if error is not None and not isinstance(error, str):
            raise TypeError("error")
        if not output:
            return CellResult(error, strays, threads)
        out, err = frame["stdout"], frame["stderr"]
        if not isinstance(out, str) or not isinstance(err, str):
            raise TypeError("output")
        return CellResult(error, strays, threads, out, err, int(frame["stdout_bytes"]),
                          int(frame["stderr_bytes"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise _Protocol(f"malformed answer: {exc}") from None
