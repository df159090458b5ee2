"""What a bubblewrap sandbox is and may use (``SandboxConfig``) and the exact command line
that isolates it: ``sandbox_argv`` (bwrap, ``setpriv`` when the caller is root, the
environment ``sandbox_env``) and the seccomp filter ``seccomp_program``. The rules they
enforce, and why, are ``train.envs.sandbox``'s docstring ("Isolation"); ``Sandbox`` there
starts and runs what this module describes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

WORK_DIR = "/sandbox"
"""The work directory (and ``HOME``) inside the sandbox: a private, size-capped tmpfs."""

INSTALL_HINT = ("Install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`; "
                "Fedora: `dnf install bubblewrap`; Arch: `pacman -S bubblewrap`), or pass "
                "allow_unsafe=True to run model-written code WITHOUT isolation (only on a "
                "throwaway machine).")

_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot start a sandbox, and unsafe execution was not allowed."""


@dataclass(frozen=True)
class SandboxConfig:
    """Where the sandbox's tools are and what one sandbox may use."""

    bwrap: str = "bwrap"
    """The bubblewrap executable: a name looked up on PATH, or a path."""
    setpriv: str = "setpriv"
    """util-linux ``setpriv``, used to drop to ``uid``/``gid`` when the caller is root
    (without it, ``subprocess`` drops privileges itself, a slower fork)."""
    python: str = "/usr/bin/python3"
    """The interpreter inside the sandbox; it must live under a mounted system
    directory (``/usr``, ``/bin``, ...) or ``ro_binds``, and ``uid`` must be able to read it."""
    timeout_s: float = 5.0
    """Wall-clock limit of one cell; past it the whole sandbox is killed."""
    startup_timeout_s: float = 10.0
    """Wall-clock limit for a new sandbox to come up (a loaded machine is slow)."""
    cpu_s: int = 6
    """CPU seconds one cell may use (soft ``RLIMIT_CPU``, reset before every cell). Above
    ``timeout_s`` so that the wall clock, which gives the clearer error, normally fires first."""
    cpu_total_s: int = 3600
    """CPU seconds the worker may use over its whole life (hard ``RLIMIT_CPU``)."""
    memory_bytes: int = 1 << 30
    """``RLIMIT_AS`` of every process in the sandbox; a larger allocation raises MemoryError."""
    total_memory_bytes: int = 1 << 30
    """Memory of the whole sandbox: the proportional set size of all its processes plus the
    memfd files they hold, watched by the worker's supervisor; past it every process of the
    sandbox is killed and the run ends with status ``memory``."""
    file_bytes: int = 16 << 20
    """``RLIMIT_FSIZE``: the largest file (and captured stdout/stderr) a cell can write."""
    tmpfs_bytes: int = 64 << 20
    """Size of each of the three tmpfs mounts (``/sandbox``, ``/tmp`` and ``/dev/shm``)."""
    open_files: int = 64
    """``RLIMIT_NOFILE`` of every process in the sandbox."""
    processes: int = 16
    """``RLIMIT_NPROC``: processes and threads of the sandbox uid, counting bwrap's init
    and the worker."""
    output_bytes: int = 4096
    """How much of a cell's stdout, and of its stderr, comes back (the rest is counted)."""
    uid: int | None = 65534
    """Host uid (and uid inside) the sandbox runs as when the caller is root; None keeps root
    (then RLIMIT_NPROC does not bind). Non-root callers always run as themselves."""
    gid: int = 65534
    """Host gid that goes with ``uid``."""
    ro_binds: tuple[str, ...] = ()
    """Extra host paths mounted read-only at the same place (e.g. a venv readable by ``uid``)."""
    allow_unsafe: bool = False
    """Run without bwrap when it is unavailable (no filesystem, network or pid isolation)."""

    def __post_init__(self) -> None:
        positive = ("timeout_s", "startup_timeout_s", "cpu_s", "cpu_total_s", "memory_bytes",
                    "total_memory_bytes", "file_bytes", "tmpfs_bytes", "open_files", "processes",
                    "output_bytes")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxConfig.{name} must be positive, got "
                                 f"{getattr(self, name)!r}")
        if self.cpu_total_s < self.cpu_s:
            raise ValueError("SandboxConfig.cpu_total_s must be at least cpu_s (the hard CPU "
                             "limit bounds every cell's soft limit)")
        if self.processes < 4:
            raise ValueError("SandboxConfig.processes must be at least 4: bwrap's init and the "
                             "worker's supervisor and executor count against RLIMIT_NPROC")
        if self.open_files < 16:
            raise ValueError("SandboxConfig.open_files must be at least 16: the worker keeps "
                             "its pipes and capture files open")
        if not os.path.isabs(self.python):
            raise ValueError(f"SandboxConfig.python must be an absolute path, got {self.python!r}")


# ---------------------------------------------------------------------------
# The worker: ``sandbox_worker.py``, a real module (ruff- and mypy-checked) whose source
# the system Python runs with ``-c`` (the sandbox uid cannot read the project checkout).

WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_worker.py")
with open(WORKER_PATH, encoding="utf-8") as _worker_file:
    WORKER_SOURCE = _worker_file.read()


# ---------------------------------------------------------------------------
# The seccomp filter (bwrap --seccomp FD): syscalls a cell has no use for, refused with EPERM.

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
BLOCKED_SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
        "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "kexec_load": 246, "kexec_file_load": 320,
        "init_module": 175, "finit_module": 313, "delete_module": 176, "mount": 165,
        "umount2": 166, "pivot_root": 155, "swapon": 167, "swapoff": 168, "reboot": 169,
        "setns": 308, "unshare": 272, "acct": 163, "quotactl": 179,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "personality": 135,
        "syslog": 103, "fanotify_init": 300, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442,
    },
    "aarch64": {
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218,
        "bpf": 280, "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "kexec_load": 104, "kexec_file_load": 294,
        "init_module": 105, "finit_module": 273, "delete_module": 106, "mount": 40,
        "umount2": 39, "pivot_root": 41, "swapon": 224, "swapoff": 225, "reboot": 142,
        "setns": 268, "unshare": 97, "acct": 89, "quotactl": 60,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "personality": 92,
        "syslog": 116, "fanotify_init": 262, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442,
    },
}


def seccomp_program(machine: str | None = None) -> bytes | None:
    """A classic-BPF seccomp filter (``struct sock_filter[]``) for ``bwrap --seccomp``.

    Refuses with EPERM: every syscall of ``BLOCKED_SYSCALLS`` for this architecture, every
    syscall made through another ABI (i386 ``int 0x80`` or x32 on x86_64, whose numbers
    differ), and allows the rest. None on an architecture without a table (no filter)."""
    machine = machine or os.uname().machine
    if machine not in _AUDIT_ARCH:
        return None
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO|EPERM
    numbers = sorted(set(BLOCKED_SYSCALLS[machine].values()))
    checks: list[tuple[int, int]] = []  # (opcode, k): jump to deny when true
    if machine == "x86_64":
        checks.append((jge, 0x40000000))  # the x32 ABI
    checks += [(jeq, n) for n in numbers]
    program: list[tuple[int, int, int, int]] = [
        (ld_abs, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, _AUDIT_ARCH[machine]),
        (ret, 0, 0, deny),
        (ld_abs, 0, 0, 0),  # seccomp_data.nr
    ]
    deny_at = len(program) + len(checks) + 1
    for op, k in checks:
        program.append((op, deny_at - (len(program) + 1), 0, k))
    program += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *insn) for insn in program)


def find_executable(program: str) -> str | None:
    if os.sep in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program)


def drop_to(config: SandboxConfig) -> tuple[int, int] | None:
    """The (uid, gid) to switch to: only when running as root and a uid is configured."""
    if os.geteuid() != 0 or config.uid is None:
        return None
    return config.uid, config.gid


_help_cache: dict[str, str] = {}


def _bwrap_help(bwrap: str) -> str:
    if bwrap not in _help_cache:
        try:
            done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10,
                                  check=False)
            _help_cache[bwrap] = done.stdout + done.stderr
        except (OSError, subprocess.SubprocessError):
            _help_cache[bwrap] = ""
    return _help_cache[bwrap]


def mounted_dirs(config: SandboxConfig) -> list[str]:
    dirs = ["/usr", *(f"/{d}" for d in _SYSTEM_DIRS if os.path.lexists(f"/{d}"))]
    return dirs + list(config.ro_binds)


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment of the worker (nothing is inherited from the caller).

    ``PYTHONHASHSEED=0`` makes set and dict-of-str iteration orders repeat from one
    sandbox to the next (needed for byte-identical replays); one BLAS/OpenMP thread
    keeps ``RLIMIT_NPROC`` for processes.
    """
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": "/tmp",
            "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


def _worker_config(config: SandboxConfig, pid_namespace: bool) -> str:
    keys = ("cpu_s", "cpu_total_s", "memory_bytes", "total_memory_bytes", "file_bytes",
            "open_files", "processes", "output_bytes")
    cfg: dict[str, Any] = {k: v for k, v in asdict(config).items() if k in keys}
    cfg["pid_namespace"] = pid_namespace
    return json.dumps(cfg, sort_keys=True)


def sandbox_argv(config: SandboxConfig, *, unsafe: bool = False,
                 info_fd: int | None = None, seccomp_fd: int | None = None) -> list[str]:
    """The exact command line of one sandbox (see the module docstring).

    ``unsafe`` gives the no-bwrap fallback: the worker started directly (still behind
    ``setpriv`` when the caller is root). ``info_fd`` is passed to ``bwrap --info-fd``,
    ``seccomp_fd`` (a pipe holding ``seccomp_program()``) to ``bwrap --seccomp``.
    """
    python = [config.python, "-s", "-B", "-c", WORKER_SOURCE,
              _worker_config(config, pid_namespace=not unsafe)]
    prefix: list[str] = []
    drop = drop_to(config)
    setpriv = find_executable(config.setpriv)
    if drop is not None and setpriv is not None:
        prefix = [setpriv, f"--reuid={drop[0]}", f"--regid={drop[1]}", "--clear-groups", "--"]
    if unsafe:
        return prefix + python
    bwrap = find_executable(config.bwrap) or config.bwrap
    features = _bwrap_help(bwrap)
    args = [bwrap, "--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_DIRS:
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in config.ro_binds:
        args += ["--ro-bind", path, path]
    size = ["--size", str(config.tmpfs_bytes)] if "--size" in features else []
    args += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/dev/shm",
             *size, "--tmpfs", "/tmp", *size, "--tmpfs", WORK_DIR,
             "--remount-ro", "/", "--chdir", WORK_DIR,
             "--unshare-all", "--unshare-user"]
    if "--disable-userns" in features:
        args += ["--disable-userns"]
    inner_uid = config.uid if config.uid is not None else os.geteuid()
    inner_gid = config.gid if config.uid is not None else os.getegid()
    args += ["--uid", str(inner_uid), "--gid", str(inner_gid), "--hostname", "sandbox",
             "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--clearenv"]
    for key, value in sandbox_env(WORK_DIR).items():
        args += ["--setenv", key, value]
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return prefix + args + ["--", *python]


__all__ = ["BLOCKED_SYSCALLS", "INSTALL_HINT", "WORKER_PATH", "WORKER_SOURCE", "WORK_DIR",
           "SandboxConfig", "SandboxUnavailable", "drop_to", "find_executable", "mounted_dirs",
           "sandbox_argv", "sandbox_env", "seccomp_program"]
