"""The ``python`` environment and its sandbox: episodes, hostile actions, the sandbox's
limits (real bwrap, real processes), snapshot/restore determinism, tasks and answers.

Sandbox tests need bubblewrap (``apt-get install -y bubblewrap``) and are skipped
without it; the refusal path (no bwrap, no ``allow_unsafe``) runs everywhere.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import psutil
import pytest
from env_properties import HOSTILE_ACTIONS, check_never_raises, check_snapshot_determinism
from hypothesis import given, settings
from hypothesis import strategies as st

from train.envs import make_env
from train.envs.base import Task
from train.envs.python_env import PythonEnv, python_call
from train.envs.python_tasks import (
    BUILTIN_PROBLEMS,
    answers_match,
    load_task_file,
    parse_number,
)
from train.envs.sandbox import CellRequest, Sandbox
from train.envs.sandbox_isolation import (
    WORK_DIR,
    SandboxConfig,
    SandboxUnavailable,
    sandbox_argv,
)

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap) is not installed: "
                                 "apt-get install -y bubblewrap")
SANDBOX_UID = 65534
FAST: dict[str, Any] = {"timeout_s": 1.0, "cpu_s": 2}  # short limits keep the hostile tests quick

TASK = Task(task_id="hand-1", env="python", prompt="What is 2+3?", answer="5", max_steps=6,
            config={"solution": "print(2 + 3)"})
LONG = dataclasses.replace(TASK, max_steps=100)  # room for many calls


def _sandbox_processes(since: float) -> list[psutil.Process]:
    """Processes of the sandbox uid started since ``since`` (our sandboxes and anything
    they left behind)."""
    found = []
    for p in psutil.process_iter(["uids", "create_time"]):
        uids, created = p.info["uids"], p.info["create_time"]
        if uids is not None and uids.real == SANDBOX_UID and created >= since - 1:
            found.append(p)
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def started() -> Iterator[float]:
    """Checks after the test that nothing it started is still running: no child of
    this process, no process of the sandbox uid."""
    since = time.time()
    yield since
    gc.collect()
    assert _alive(psutil.Process().children(recursive=True)) == []
    if os.geteuid() == 0:
        assert _alive(_sandbox_processes(since)) == []


def _env(task: Task = LONG, **config: Any) -> PythonEnv:
    env = PythonEnv(**config)
    assert env.reset(task) == task.prompt
    return env


def _obs(env: PythonEnv, code: str) -> str:
    return env.step(python_call(code)).observation


def _obs_within(env: PythonEnv, code: str, seconds: float) -> str:
    """``_obs(env, code)``, asserting that the call came back within ``seconds``."""
    start = time.monotonic()
    obs = _obs(env, code)
    assert time.monotonic() - start < seconds
    return obs


# -- episodes by hand -----------------------------------------------------------------


@needs_bwrap
def test_episode_state_persists_and_answer_is_rewarded(started: float) -> None:
    with _env() as env:
        obs, done, parts = env.step(python_call("print(2+3)"))
        assert (obs, done) == ("<tool_response>5\n</tool_response>", False)
        assert parts == {"reward": 0.0, "tool_calls": 1.0, "tool_errors": 0.0, "truncated": 0.0}
        assert _obs(env, "x = 40") == "<tool_response></tool_response>"
        assert _obs(env, "def f(y):\n    return x + y") == "<tool_response></tool_response>"
        assert _obs(env, "f(2)") == "<tool_response>42\n</tool_response>"  # echoed expression
        assert _obs(env, "import math\nmath.comb(5, 2)") == "<tool_response>10\n</tool_response>"
        obs, done, parts = env.step("<answer>5.0</answer>")
        assert (obs, done) == ("", True)
        assert parts == {"reward": 1.0, "tool_calls": 5.0, "tool_errors": 0.0, "truncated": 0.0}
        obs, done, parts = env.step(python_call("print(1)"))
        assert (obs, done, parts["reward"]) == ("<tool_response>error: episode is over"
                                                "</tool_response>", True, 1.0)


@needs_bwrap
def test_output_format_and_errors(started: float) -> None:
    with _env(output_bytes=100) as env:
        assert _obs(env, "import sys\nprint('out')\nprint('err', file=sys.stderr)\n1/0") == \
            "<tool_response>out\nerr\nZeroDivisionError: division by zero</tool_response>"
        assert _obs(env, "print(undefined_name)") == \
            "<tool_response>NameError: name 'undefined_name' is not defined</tool_response>"
        assert _obs(env, "def (") == \
            "<tool_response>SyntaxError: invalid syntax (line 1)</tool_response>"
        big = _obs(env, "print('x' * 1_000_000)")
        assert big == "<tool_response>" + "x" * 100 + "\n[999901 more bytes of stdout cut]\n" \
            "</tool_response>"
        assert _obs(env, "raise SystemExit(3)") == "<tool_response>SystemExit: 3</tool_response>"
        # the interpreter survived all of it
        assert _obs(env, "print('still here')") == "<tool_response>still here\n</tool_response>"
        assert env.step(python_call("1/0")).reward_parts["tool_errors"] == 5.0


@needs_bwrap
def test_step_limit_ends_with_reward_0(started: float) -> None:
    with _env(dataclasses.replace(TASK, max_steps=2)) as env:
        assert env.step(python_call("print(5)")).done is False
        obs, done, parts = env.step(python_call("print(5)"))
        assert (obs, done) == ("<tool_response>5\n</tool_response>", True)
        assert parts["reward"] == 0.0 and parts["truncated"] == 1.0


@needs_bwrap
def test_expert_solves_every_builtin_task(started: float) -> None:
    tasks = PythonEnv.generate_tasks(len(BUILTIN_PROBLEMS), seed=0)
    assert sorted(t.task_id for t in tasks) == sorted(f"python-{p.problem_id}"
                                                     for p in BUILTIN_PROBLEMS)
    with PythonEnv() as env:
        for task in tasks:
            env.reset(task)
            first = env.expert_action()
            assert first == python_call(task.config["solution"])
            obs, done, _ = env.step(first)
            assert obs == f"<tool_response>{task.answer}\n</tool_response>", task.task_id
            assert env.expert_action() == f"<answer>{task.answer}</answer>"
            _, done, parts = env.step(env.expert_action())
            assert done and parts["reward"] == 1.0, task.task_id


# -- hostile actions ------------------------------------------------------------------

PYTHON_HOSTILE = [
    '<tool_call>{"name": "python", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "python", "arguments": {"code": 5}}</tool_call>',
    '<tool_call>{"name": "python", "arguments": {"code": ["print(1)"]}}</tool_call>',
    '<tool_call>{"name": "python", "arguments": {"code": "1", "timeout": 99}}</tool_call>',
    '<tool_call>{"name": "python", "arguments": {"code": null}}</tool_call>',
    python_call("x" * 70_000),  # over max_code_chars
    python_call("print('a\\x00b')\n"),
    python_call("\x00"),
    python_call("print('\ud800')"),
    python_call("raise ValueError('\ud800')"),
    python_call("import sys; sys.stdout = None; print(1)"),
    python_call("import sys; sys.stdout.close(); sys.stderr.close()"),
    python_call("import os; os.close(1); os.close(2)"),
    python_call("exit()"),
    python_call("import sys; sys.setrecursionlimit(10**6)\ndef f(n): return f(n + 1)\nf(0)"),
    python_call("input()"),
    python_call("print('\\xff' * 10, b'\\xff\\xfe'.decode('latin-1'))"),
    python_call("import os; os.write(1, b'\\xff\\xfe raw bytes')"),
    python_call("(" * 10_000 + ")" * 10_000),
    python_call("raise ValueError('v' * 1_000_000)"),
]


@needs_bwrap
def test_hostile_actions_never_raise(started: float) -> None:
    with PythonEnv(**FAST) as env:
        results = check_never_raises(env, TASK, HOSTILE_ACTIONS + PYTHON_HOSTILE)
        errors = [r.observation for r in results[:len(HOSTILE_ACTIONS)] if r.observation]
        assert all(o.startswith("<tool_response>error: ") for o in errors)
        by_action = dict(zip(PYTHON_HOSTILE, results[len(HOSTILE_ACTIONS):], strict=True))
        assert by_action[PYTHON_HOSTILE[1]].observation == \
            "<tool_response>error: argument 'code' must be of type string</tool_response>"
        assert "longer than 65536" in by_action[python_call("x" * 70_000)].observation
        # a lone surrogate cannot even be compiled; it comes back escaped, never raw
        assert by_action[python_call("print('\ud800')")].observation.startswith(
            "<tool_response>UnicodeEncodeError: 'utf-8' codec can't encode character '\\ud800'")
        assert by_action[python_call("raise ValueError('\ud800')")].observation.startswith(
            "<tool_response>UnicodeEncodeError")
        # unbounded recursion ends in RecursionError, MemoryError or the time limit
        assert "Error" in by_action[PYTHON_HOSTILE[14]].observation or \
            "error: the call exceeded" in by_action[PYTHON_HOSTILE[14]].observation
        assert by_action[python_call("input()")].observation == \
            "<tool_response>EOFError: EOF when reading a line</tool_response>"
        huge = by_action[PYTHON_HOSTILE[-1]].observation
        assert huge.endswith("...(cut)</tool_response>") and len(huge) < 5000
        env.reset(TASK)
        assert _obs(env, "print(2 + 3)") == "<tool_response>5\n</tool_response>"


@needs_bwrap
def test_unknown_tool_and_bad_json_are_errors(started: float) -> None:
    with _env() as env:
        assert env.step('<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>'
                        ).observation == ("<tool_response>error: unknown tool 'calc'; the only "
                                          "tool is 'python'</tool_response>")
        assert env.step("<tool_call>{bad</tool_call>").observation.startswith(
            "<tool_response>error: tool call is not valid JSON")


# -- the sandbox ----------------------------------------------------------------------


def _check_rolled_back(env: PythonEnv, since: float) -> None:
    """After a call that broke a limit: at most the live and spare sandboxes run (4
    processes each: bwrap, its pid-namespace init, the worker's supervisor and its
    executor), the state from before
    the call is there, and the call's partial effects are not."""
    env.wait_ready()  # reaps the killed sandbox (its teardown is asynchronous)
    if os.geteuid() == 0:
        procs = _alive(_sandbox_processes(since))
        assert len(procs) <= 8, [(p.pid, p.name()) for p in procs]
        assert {p.name() for p in procs} <= {"bwrap", "python3"}
    assert _obs(env, "print(kept)") == "<tool_response>1\n</tool_response>"
    assert _obs(env, "print('partial' in dir())") == "<tool_response>False\n</tool_response>"


@needs_bwrap
def test_infinite_loop_is_stopped_and_rolled_back(started: float) -> None:
    with _env(**FAST) as env:
        _obs(env, "kept = 1")
        obs = _obs_within(env, "partial = 1\nwhile True:\n    pass", 1.0 + 2.0)
        assert obs.startswith("<tool_response>error: the call exceeded the 1 s time limit")
        assert "state from before this call" in obs
        _check_rolled_back(env, started)


@needs_bwrap
def test_cpu_limit_kills_a_spinning_cell(started: float) -> None:
    with _env(timeout_s=20.0, cpu_s=1) as env:
        _obs(env, "kept = 1")
        _obs(env, "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:"
                  "\n    pass")  # within the per-call budget: the limit is per call
        obs = _obs_within(env, "partial = 1\nwhile True:\n    pass", 5.0)
        assert obs.startswith("<tool_response>error: the interpreter exited during the call")
        _check_rolled_back(env, started)


@needs_bwrap
def test_huge_allocation_is_a_memory_error(started: float) -> None:
    with _env(**FAST) as env:
        _obs(env, "kept = 1")
        assert _obs(env, "partial = bytearray(4 * 1024**3)") == \
            "<tool_response>MemoryError</tool_response>"
        assert _obs(env, "big = [0] * (300 * 1024**2)") == \
            "<tool_response>MemoryError</tool_response>"
        _check_rolled_back(env, started)  # a MemoryError is an exception, not a rollback


@needs_bwrap
def test_fork_bomb_is_contained(started: float) -> None:
    with _env(**FAST) as env:
        _obs(env, "kept = 1")
        obs = _obs_within(env, "import os\nwhile True:\n    os.fork()", 1.0 + 2.0)
        # RLIMIT_NPROC stops it: either every fork failed and the children exited by
        # themselves (an exception), or some were still alive and got killed (rollback)
        assert obs == ("<tool_response>BlockingIOError: [Errno 11] Resource temporarily "
                       "unavailable</tool_response>") or \
            obs.startswith("<tool_response>error: the call left ")
        env.wait_ready()
        if os.geteuid() == 0:
            procs = _alive(_sandbox_processes(started))
            assert len(procs) <= 8, [(p.pid, p.name()) for p in procs]
        assert _obs(env, "print(kept)") == "<tool_response>1\n</tool_response>"


@needs_bwrap
def test_process_limit_binds(started: float) -> None:
    with _env(processes=8) as env:
        obs = _obs(env, "import os\nkids = []\ntry:\n    for _ in range(50):\n"
                        "        pid = os.fork()\n        if pid == 0:\n"
                        "            import time; time.sleep(5); os._exit(0)\n"
                        "        kids.append(pid)\nexcept OSError as e:\n"
                        "    print(len(kids), type(e).__name__)\n"
                        "for pid in kids:\n    os.kill(pid, 9); os.waitpid(pid, 0)")
        # bwrap's init and the worker's supervisor and executor count against the limit of 8
        assert obs == "<tool_response>5 BlockingIOError\n</tool_response>"


@needs_bwrap
def test_background_processes_and_threads_are_killed(started: float) -> None:
    with _env(**FAST) as env:
        _obs(env, "kept = 1")
        obs = _obs(env, "import subprocess\npartial = 1\nsubprocess.Popen(['sleep', '100'])")
        assert obs.startswith("<tool_response>error: the call left 1 background process(es) "
                              "running; they were stopped")
        _check_rolled_back(env, started)
        daemon = ("import os, time\npartial = 1\nif os.fork() == 0:\n    os.setsid()\n"
                  "    if os.fork() == 0:\n        time.sleep(100)\n    os._exit(0)\n"
                  "os.wait()")
        assert "background process" in _obs(env, daemon)
        _check_rolled_back(env, started)
        obs = _obs(env, "import threading, time\npartial = 1\n"
                        "threading.Thread(target=time.sleep, args=(100,), daemon=True).start()")
        assert "left 1 background thread(s) running" in obs
        _check_rolled_back(env, started)
        assert _obs(env, "import subprocess\nsubprocess.run(['true']).returncode") == \
            "<tool_response>0\n</tool_response>"  # a child that is waited for is fine


@needs_bwrap
def test_os_exit_is_rolled_back(started: float) -> None:
    with _env(**FAST) as env:
        _obs(env, "kept = 1")
        assert _obs(env, "import os\npartial = 1\nos._exit(0)").startswith(
            "<tool_response>error: the interpreter exited during the call")
        _check_rolled_back(env, started)


@needs_bwrap
def test_filesystem_is_private_and_read_only(started: float, tmp_path: Path) -> None:
    with _env(**FAST) as env:
        system = [d for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
                  if os.path.lexists(f"/{d}")]
        top = sorted(["dev", "proc", WORK_DIR.strip("/"), "tmp", "usr", *system])
        assert _obs(env, "import os\nsorted(os.listdir('/'))") == \
            f"<tool_response>{top}\n</tool_response>"
        assert _obs(env, "import os\nos.getcwd(), os.environ['HOME']") == \
            f"<tool_response>('{WORK_DIR}', '{WORK_DIR}')\n</tool_response>"
        for path in ("/usr/evil", "/evil", "/usr/lib/evil"):
            assert _obs(env, f"open({path!r}, 'w')") == \
                f"<tool_response>OSError: [Errno 30] Read-only file system: {path!r}" \
                "</tool_response>"
            assert not os.path.exists(path)
        outside = tmp_path / "escape.txt"
        for path in ("/root/evil", "/etc/passwd", str(outside)):
            assert "FileNotFoundError" in _obs(env, f"open({path!r}, 'w')")
        assert not outside.exists()
        for path in ("/root", "/home", "/work", "/etc", str(Path.cwd())):
            assert "FileNotFoundError: [Errno 2] No such file or directory" in \
                _obs(env, f"import os\nos.listdir({path!r})")
        # the work directory is writable and keeps files across calls
        assert _obs(env, "open('notes.txt', 'w').write('hello')") == \
            "<tool_response>5\n</tool_response>"
        assert _obs(env, "open('/sandbox/notes.txt').read()") == \
            "<tool_response>'hello'\n</tool_response>"
        # file size and tmpfs size are capped
        assert "File too large" in _obs(env, "open('big', 'wb').write(b'x' * (20 << 20))")
        assert "No space left on device" in _obs(
            env, "for i in range(10):\n    open(f'f{i}', 'wb').write(b'x' * (15 << 20))")


@needs_bwrap
def test_identity_network_and_namespaces(started: float) -> None:
    with _env(**FAST) as env:
        assert _obs(env, "import os\nos.getuid(), os.getgid(), os.getpid()") == \
            f"<tool_response>({SANDBOX_UID}, {SANDBOX_UID}, 3)\n</tool_response>"
        assert "Network is unreachable" in _obs(
            env, "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)")
        assert "Network is unreachable" in _obs(
            env, "import socket\nsocket.create_connection(('2606:4700:4700::1111', 80), timeout=1)")
        assert "gaierror" in _obs(env, "import socket\nsocket.getaddrinfo('example.com', 80)")
        # only the sandbox's own loopback exists: nothing of the host listens there
        assert "ConnectionRefusedError" in _obs(
            env, "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
        assert _obs(env, "open('/proc/self/status').read().split('CapEff:')[1].split()[0]") == \
            "<tool_response>'0000000000000000'\n</tool_response>"
        # no nested user namespace to regain capabilities in (bwrap --disable-userns)
        assert _obs(env, "import ctypes\nctypes.CDLL(None, use_errno=True).unshare(0x10000000)"
                    ) == "<tool_response>-1\n</tool_response>"
        if os.geteuid() == 0:  # on the host, the worker is not root either
            workers = [p for p in _alive(_sandbox_processes(started)) if p.name() == "python3"]
            assert workers and all(p.uids().real == SANDBOX_UID for p in workers)


def test_refuses_to_run_without_bwrap(started: float) -> None:
    with pytest.raises(SandboxUnavailable) as info:
        PythonEnv(bwrap="/nonexistent/bwrap")
    message = str(info.value)
    assert "bubblewrap not found" in message and "/nonexistent/bwrap" in message
    assert "apt-get install -y bubblewrap" in message and "allow_unsafe=True" in message
    with pytest.raises(SandboxUnavailable):
        make_env("python", bwrap="/nonexistent/bwrap")


@needs_bwrap
def test_refuses_an_interpreter_outside_the_sandbox(started: float) -> None:
    if os.path.realpath(sys.executable).startswith("/usr/"):
        pytest.skip("this test's interpreter is a system one")
    with pytest.raises(SandboxUnavailable, match="not under a directory mounted"):
        PythonEnv(python=sys.executable)
    with pytest.raises(SandboxUnavailable, match="does not exist"):
        PythonEnv(python="/nonexistent/python3")


def test_unsafe_mode_runs_when_allowed(started: float) -> None:
    with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
        env = PythonEnv(bwrap="/nonexistent/bwrap", allow_unsafe=True, timeout_s=2.0)
    with env:
        assert env.unsafe
        env.reset(TASK)
        assert _obs(env, "x = 2") == "<tool_response></tool_response>"
        assert _obs(env, "print(x + 3)") == "<tool_response>5\n</tool_response>"
        assert "background process" in _obs(env, "import subprocess\n"
                                                  "subprocess.Popen(['sleep', '100'])")
        if os.geteuid() == 0:
            assert _obs(env, "import os\nos.getuid()") == \
                f"<tool_response>{SANDBOX_UID}\n</tool_response>"


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unknown PythonEnv option"):
        PythonEnv(timeout=3)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        SandboxConfig(timeout_s=0)


def test_sandbox_argv_isolates() -> None:
    argv = sandbox_argv(SandboxConfig(bwrap="/usr/bin/bwrap"), info_fd=7)
    start = argv.index("/usr/bin/bwrap")
    end = argv.index("--", start)
    joined = " ".join(argv[start:end])
    for flag in ("--unshare-all", "--unshare-user", "--cap-drop ALL", "--die-with-parent",
                 "--new-session", "--clearenv", "--ro-bind /usr /usr", "--remount-ro /",
                 f"--uid {SANDBOX_UID}", f"--gid {SANDBOX_UID}", "--info-fd 7",
                 f"--tmpfs {WORK_DIR}", f"--chdir {WORK_DIR}", "--proc /proc"):
        assert flag in joined, flag
    assert "/root" not in joined and "/home" not in joined and "/etc" not in joined
    assert argv[end + 1:end + 5] == ["/usr/bin/python3", "-s", "-B", "-c"]
    if os.geteuid() == 0 and shutil.which("setpriv"):
        assert argv[1:4] == [f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                             "--clear-groups"]


@needs_bwrap
def test_sandbox_close_and_garbage_collection_leave_nothing(started: float) -> None:
    sandbox = Sandbox(SandboxConfig())
    outcome = sandbox.run([CellRequest("x = 2", "0", output=False), CellRequest("x + 3", "1")])
    assert outcome.status == "ok" and outcome.results[1].stdout == "5\n"
    sandbox.close()
    assert not sandbox.alive and sandbox.run([CellRequest("1", "0")]).status == "died"
    for _ in range(3):
        Sandbox(SandboxConfig()).wait_ready()  # dropped at once: the finalizer kills it
    env = _env()
    env.step(python_call("print(1)"))
    del env  # an env that is never closed does not leak its sandboxes either


# -- snapshot and restore -------------------------------------------------------------

_ACTIONS = st.sampled_from([
    python_call("x = 1"),
    python_call("x = x + 1 if 'x' in dir() else 10\nx"),
    python_call("print(x)"),
    python_call("import random\nprint(random.random())"),
    python_call("print([random.randint(0, 99) for _ in range(3)])"),
    python_call("with open('log.txt', 'a') as f:\n    f.write('a')\nprint(open('log.txt').read())"),
    python_call("print(''.join({str(i) for i in range(30)}))"),  # hash order: PYTHONHASHSEED
    python_call("def g(n):\n    return n * 3\ng(7)"),
    python_call("g(x)"),
    python_call("1/0"),
    python_call("import os\nos._exit(1)"),  # rolled back
    python_call("import subprocess\nsubprocess.Popen(['sleep', '30'])"),  # rolled back
    "<tool_call>{bad json</tool_call>",
    '<tool_call>{"name": "calc", "arguments": {}}</tool_call>',
    "<answer>5</answer>",
    "<answer>6</answer>",
])


@needs_bwrap
@settings(max_examples=10, deadline=None)
@given(max_steps=st.integers(1, 10), prewarm=st.booleans(),
       prefix=st.lists(_ACTIONS, max_size=6), suffix=st.lists(_ACTIONS, max_size=5))
def test_snapshot_restore_is_byte_identical(max_steps: int, prewarm: bool, prefix: list[str],
                                            suffix: list[str]) -> None:
    task = dataclasses.replace(TASK, max_steps=max_steps)
    check_snapshot_determinism(lambda: PythonEnv(prewarm=prewarm, **FAST), task, prefix, suffix)


@needs_bwrap
def test_restore_needs_no_replay_by_the_caller(started: float) -> None:
    with _env() as env, PythonEnv() as other:
        env.step(python_call("import random\nxs = [random.random() for _ in range(3)]"))
        env.step(python_call("open('f.txt', 'w').write('abc')"))
        snap = env.snapshot()
        data = json.loads(snap)
        assert data["cells"] == ["import random\nxs = [random.random() for _ in range(3)]",
                                 "open('f.txt', 'w').write('abc')"]
        assert snap == json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        expected = _obs(env, "print(xs, open('f.txt').read())")
        other.restore(snap)
        other.sync()
        assert _obs(other, "print(xs, open('f.txt').read())") == expected
        # the same env, after moving on: back to the snapshot's state
        _obs(env, "xs = None")
        env.restore(snap)
        assert _obs(env, "print(xs, open('f.txt').read())") == expected
        with pytest.raises(ValueError, match="not a python snapshot"):
            other.restore(b'{"format": "calc/1"}')
        with pytest.raises(ValueError, match="not a python snapshot"):
            other.restore(snap.replace(b'"cells":[', b'"cells":[1,'))


@needs_bwrap
def test_cells_are_seeded_per_call(started: float) -> None:
    with _env() as a, _env(seed=1) as b:
        code = "import random\nprint(random.random())"
        first, second = _obs(a, code), _obs(a, code)
        assert first != second  # call 0 and call 1 get different seeds
        a.reset(TASK)
        assert _obs(a, code) == first  # the same call index in a new episode repeats
        assert _obs(b, code) != first  # another seed


# -- tasks and answers ----------------------------------------------------------------


def test_generate_tasks_is_seeded_and_covers_the_pool() -> None:
    a = PythonEnv.generate_tasks(45, seed=3)
    assert a == PythonEnv.generate_tasks(45, seed=3)
    assert a[:10] == PythonEnv.generate_tasks(10, seed=3)
    assert a != PythonEnv.generate_tasks(45, seed=4)
    assert len({t.task_id for t in a[:20]}) == 20  # every problem once before repeats
    assert all(t.env == "python" and t.max_steps == 6 and "<answer>" in t.prompt for t in a)
    assert PythonEnv.generate_tasks(3, seed=0, max_steps=2)[0].max_steps == 2
    with pytest.raises(ValueError, match="unknown python task option"):
        PythonEnv.generate_tasks(3, seed=0, difficulty=2)


def test_task_files(tmp_path: Path) -> None:
    rows = [{"prompt": "What is 6*7?", "answer": 42},
            {"prompt": "Half of 9?", "answer": "4.5", "task_id": "half", "max_steps": 3,
             "solution": "print(9 / 2)"}]
    jsonl = tmp_path / "tasks.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    tasks = load_task_file(jsonl)
    assert [t.answer for t in tasks] == ["42", "4.5"]
    assert tasks[0].task_id.startswith("python-") and tasks[1].task_id == "half"
    assert tasks[1].max_steps == 3 and tasks[1].config == {"solution": "print(9 / 2)"}
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "tasks.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": r["prompt"], "answer": str(r["answer"])}
                                         for r in rows]), parquet)
    assert [t.prompt for t in load_task_file(parquet)] == ["What is 6*7?", "Half of 9?"]
    drawn = PythonEnv.generate_tasks(4, seed=0, task_file=jsonl)
    assert sorted(t.prompt for t in drawn[:2]) == ["Half of 9?", "What is 6*7?"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\n{"prompt": "", "answer": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'prompt'"):
        load_task_file(bad)
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="'answer'"):
        load_task_file(bad)
    with pytest.raises(ValueError, match="unsupported task file"):
        load_task_file(tmp_path / "tasks.csv")


@pytest.mark.parametrize(("text", "value"), [
    ("42", 42), (" 42 ", 42), ("42.0", 42), ("42.", 42), ("+42", 42), ("-3.5", Fraction(-7, 2)),
    ("84/2", 42), ("1,000", 1000), ("$42", 42), ("\\boxed{42}", 42), ("4.2e1", 42),
    ("abc", None), ("1/0", None), ("1e999999", None), ("4 2", None), ("1,00", None),
    ("9" * 101, None),
])
def test_parse_number(text: str, value: Fraction | int | None) -> None:
    assert parse_number(text) == value


def test_answers_match() -> None:
    assert answers_match("311", "311") and answers_match("311.00", "311")
    assert not answers_match("312", "311") and not answers_match("", "311")
    assert answers_match("  Paris ", "paris") and not answers_match("Paris", "311")
    assert not answers_match("311", None)
