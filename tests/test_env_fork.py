"""The ``fork`` snapshot strategy (``train.envs.fork``, issue 44 item 3).

The environments below are built in worker processes, which import them by spec from this
module (``test_env_fork:CounterEnv``: pytest puts ``tests/`` on ``sys.path`` and
``ForkEnv`` passes its ``sys.path`` on). ``CounterEnv`` has no native snapshot and holds
what no serialiser takes (a generator, a lock); with ``entropy=True`` its noise stream is
seeded from ``os.urandom``, so only a copy of the process (not a replay) reproduces it.
``SignalEnv`` installs a signal handler in its constructor, which only a main thread may.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest

from train.envs import Environment, StepResult, Task, fork_pool, fork_worker, make_env
from train.envs import fork as fork_mod
from train.envs.fork import ForkEnv, ForkError, make_fork_env, parse_fork
from train.envs.strategies import (
    SNAPSHOT_STRATEGIES,
    ReplayDivergenceError,
    ReplayEnv,
    with_snapshots,
)

pytestmark = pytest.mark.skipif(not fork_mod.SUPPORTED, reason="fork needs POSIX")


def _noise(seed: int) -> Iterator[int]:
    rng = random.Random(seed)
    while True:
        yield rng.randrange(1000)


class CounterEnv(Environment):
    """``add N`` adds N to a total; every step also draws from a noise stream; ``<answer>T``
    ends the episode, reward 1 when T is the total; ``sleep`` hangs (timeouts)."""

    name = "fork-counter"
    snapshot_strategy = "fork"

    def __init__(self, start: int = 0, entropy: bool = False) -> None:
        self.start, self.entropy = start, entropy
        self._lock = threading.Lock()  # neither JSON nor pickle takes these two
        self._noise: Iterator[int] = iter(())
        self._task: Task | None = None
        self._total = self._steps = 0

    def reset(self, task: Task) -> str:
        with self._lock:
            self._task, self._total, self._steps = task, self.start, 0
            seed = int.from_bytes(os.urandom(8)) if self.entropy else len(task.task_id)
            self._noise = _noise(seed)
            return task.prompt

    def step(self, action_text: str) -> StepResult:
        with self._lock:
            if self._task is None:
                raise RuntimeError("fork-counter: call reset() first")
            if "sleep" in action_text:
                time.sleep(60)
            self._steps += 1
            answer = re.search(r"<answer>(-?\d+)</answer>", action_text)
            if answer:
                reward = float(int(answer.group(1)) == self._total)
                return StepResult("", True, {"reward": reward, "steps": float(self._steps)})
            add = re.search(r"add (-?\d+)", action_text)
            self._total += int(add.group(1)) if add else 0
            done = self._steps >= self._task.max_steps
            return StepResult(f"<tool_response>total={self._total} noise={next(self._noise)}"
                              f"</tool_response>", done, {"reward": 0.0,
                                                          "steps": float(self._steps)})

    def reseed(self, key: int) -> None:
        self._noise = _noise(key)

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        return [Task(f"count-{seed}-{i}", "fork-counter", f"Add numbers, then answer the "
                     f"total ({i}).", max_steps=8) for i in range(n)]


class SignalEnv(Environment):
    """Installs a SIGUSR1 handler in its constructor (a main thread only); each step raises
    the signal and reports how many the handler saw and on which thread it runs."""

    name = "fork-signal"
    snapshot_strategy = "fork"

    def __init__(self) -> None:
        self.hits = 0
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.hits += 1

    def reset(self, task: Task) -> str:
        self.hits = 0
        return task.prompt

    def step(self, action_text: str) -> StepResult:
        signal.raise_signal(signal.SIGUSR1)
        main = threading.current_thread() is threading.main_thread()
        return StepResult(f"hits={self.hits} main={main}", False, {"reward": 0.0})

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        return [Task(f"sig-{i}", "fork-signal", "Raise signals.") for i in range(n)]


COUNTER = f"{CounterEnv.__module__}:CounterEnv"
SIGNAL = f"{SignalEnv.__module__}:SignalEnv"
TASK = CounterEnv.generate_tasks(1, seed=0)[0]


def actions(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"add {rng.randrange(-9, 10)}" for _ in range(n)]


def reference(acts: list[str], reseed_at: dict[int, int] | None = None) -> list[StepResult]:
    """The outcomes of ``acts`` on an in-process ``CounterEnv`` (no fork, no snapshot)."""
    env = CounterEnv()
    env.reset(TASK)
    out = []
    for i, a in enumerate(acts):
        if reseed_at and i in reseed_at:
            env.reseed(reseed_at[i])
        out.append(env.step(a))
    return out


@pytest.fixture
def counter() -> Iterator[ForkEnv]:
    env = make_fork_env(COUNTER)
    assert isinstance(env, ForkEnv)
    yield env
    env.close()


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_running(pids: list[int], timeout: float) -> list[int]:
    """The ``pids`` still running (not zombies) once all are gone or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_make_env_wraps_a_fork_class_in_a_worker() -> None:
    env = make_env(COUNTER)
    try:
        assert isinstance(env, ForkEnv) and env.spec == COUNTER
        assert env.worker_pid is not None and env.worker_pid != os.getpid()
        assert env.reset(TASK) == TASK.prompt
        assert env.step("add 3") == reference(["add 3"])[0]
    finally:
        env.close()


def test_restore_then_step_is_byte_identical_for_random_prefixes(counter: ForkEnv) -> None:
    acts = actions(7, seed=1)
    reseed_at = {3: 77}
    want = reference(acts, reseed_at)
    counter.reset(TASK)
    snaps = [counter.snapshot()]
    for i, a in enumerate(acts):
        if i in reseed_at:
            counter.reseed(reseed_at[i])
        assert counter.step(a) == want[i]
        snaps.append(counter.snapshot())
    rng = random.Random(2)
    for _ in range(6):
        depth = rng.randrange(len(acts))
        counter.restore(snaps[depth])
        for i in range(depth, len(acts)):
            if i in reseed_at:
                counter.reseed(reseed_at[i])
            got = counter.step(acts[i])
            assert got.observation.encode() == want[i].observation.encode()
            assert got == want[i]
    assert counter.stats.fork_restores == 6 and counter.stats.replay_restores == 0
    assert counter.stats.replayed_steps == 0


def test_fork_copies_state_that_replay_cannot_reproduce() -> None:
    """With noise from os.urandom, only the frozen copy continues the episode exactly; a
    replay of the same log diverges and says so at the first step."""
    env = make_fork_env(COUNTER, entropy=True)
    try:
        env.reset(TASK)
        env.step("add 1")
        snap = env.snapshot()
        first = [env.step("add 2"), env.step("add 3")]
        for _ in range(3):
            env.restore(snap)
            assert [env.step("add 2"), env.step("add 3")] == first
        assert env.stats.fork_restores == 3
        fresh = make_fork_env(COUNTER, entropy=True)  # as in a later run: no frozen copy
        try:
            with pytest.raises(ReplayDivergenceError, match=r"fork-counter: replay diverged "
                                                            r"at step 1 of task 'count-0-0'"):
                fresh.restore(snap)
        finally:
            fresh.close()
    finally:
        env.close()


def test_fork_path_and_replay_fallback_agree() -> None:
    acts = actions(6, seed=3)
    want = reference(acts)
    env = ForkEnv(CounterEnv, COUNTER, pool_size=2)
    try:
        env.reset(TASK)
        snaps = [env.snapshot()]
        for a in acts:
            env.step(a)
            snaps.append(env.snapshot())
        assert env.stats.snapshots == 7 and env.stats.evictions == 5
        assert len(fork_pool.POOL.pids(env._owner)) == 2
        for depth in (5, 6, 2, 0, 4):  # 5 and 6 are still frozen, the rest were evicted
            env.restore(snaps[depth])
            assert [env.step(a) for a in acts[depth:]] == want[depth:]
        assert env.stats.fork_restores == 2 and env.stats.replay_restores == 3
        assert env.stats.replayed_steps == 2 + 0 + 4
    finally:
        env.close()
    later = make_fork_env(COUNTER)  # another instance: snapshots from an earlier run
    try:
        for depth in (3, 6):
            later.restore(snaps[depth])
            assert [later.step(a) for a in acts[depth:]] == want[depth:]
        assert later.stats.fork_restores == 0 and later.stats.replay_restores == 2
        later.restore(snaps[2])  # a plain replay snapshot restores too
        doc = json.loads(snaps[2])
        later.restore(json.dumps(doc["replay"]).encode())
        assert [later.step(a) for a in acts[2:]] == want[2:]
    finally:
        later.close()


def test_snapshot_is_canonical_json_holding_the_replay_record(counter: ForkEnv) -> None:
    counter.reset(TASK)
    counter.step("add 4")
    counter.reseed(9)
    snap = counter.snapshot()
    doc = json.loads(snap)
    assert snap == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert doc["strategy"] == "fork" and set(doc["handle"]) == {"id", "path", "token", "env"}
    replay = ReplayEnv(CounterEnv())
    replay.reset(TASK)
    replay.step("add 4")
    replay.reseed(9)
    assert doc["replay"] == json.loads(replay.snapshot())
    task, log, handle = parse_fork(snap)
    assert task == TASK and log == doc["replay"]["log"] and handle == doc["handle"]
    for bad in (b"nope", b'{"strategy":"native"}', b'{"strategy":"fork","handle":{}}'):
        with pytest.raises(ValueError, match="not a fork snapshot"):
            counter.restore(bad)


def test_a_handle_with_a_wrong_token_replays_and_a_frozen_copy_refuses_it(
        counter: ForkEnv) -> None:
    counter.reset(TASK)
    counter.step("add 5")
    doc = json.loads(counter.snapshot())
    assert os.stat(os.path.dirname(os.path.dirname(doc["handle"]["path"]))).st_mode & 0o777 \
        == 0o700
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(doc["handle"]["path"])
        fork_worker.send(s, {"op": "fork", "token": "0" * 32, "path": "/tmp/x.sock",
                             "live_token": "x"})
        reply = fork_worker.recv(s)
    assert reply == {"ok": False, "type": "PermissionError", "error": "bad token"}
    doc["handle"]["token"] = "f" * 32
    counter.step("add 1")
    counter.restore(json.dumps(doc).encode())
    assert counter.stats.fork_restores == 0 and counter.stats.replay_restores == 1
    assert counter.step("add 2") == reference(["add 5", "add 2"])[1]


def test_signal_handler_env_works_from_a_non_main_thread() -> None:
    task = SignalEnv.generate_tasks(1, seed=0)[0]
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match="main thread"):
            pool.submit(SignalEnv).result()  # in this process it cannot be built off-main

        def episode() -> tuple[list[str], list[str]]:
            env = make_fork_env(SIGNAL)
            try:
                env.reset(task)
                first = [env.step("x").observation for _ in range(2)]
                snap = env.snapshot()
                env.step("x")
                env.restore(snap)
                return first, [env.step("x").observation for _ in range(2)]
            finally:
                env.close()

        first, again = pool.submit(episode).result()
        first2, again2 = pool.submit(episode).result()  # another thread of the pool
    assert first == first2 == ["hits=1 main=True", "hits=2 main=True"]
    assert again == again2 == ["hits=3 main=True", "hits=4 main=True"]


def test_a_worker_killed_mid_episode_is_replaced_and_replayed(counter: ForkEnv) -> None:
    acts = actions(5, seed=4)
    want = reference(acts)
    counter.reset(TASK)
    for a in acts[:3]:
        counter.step(a)
    old = counter.worker_pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    assert [counter.step(a) for a in acts[3:]] == want[3:]
    assert counter.stats.recoveries == 1 and counter.worker_pid not in (None, old)
    assert counter.stats.replayed_steps == 3


def test_a_killed_worker_whose_state_cannot_be_replayed_fails_by_name() -> None:
    env = make_fork_env(COUNTER, entropy=True)
    try:
        env.reset(TASK)
        env.step("add 1")
        assert env.worker_pid is not None
        os.kill(env.worker_pid, signal.SIGKILL)
        with pytest.raises(ForkError, match=r"^fork-counter: its fork worker died and the "
                                            r"last state \(task 'count-0-0'.*could not be "
                                            r"replayed.*ReplayDivergenceError"):
            env.step("add 2")
        assert env.reset(TASK) == TASK.prompt  # the env is usable again after a reset
    finally:
        env.close()


def test_a_hung_worker_times_out_in_one_line_and_is_replaced() -> None:
    env = ForkEnv(CounterEnv, COUNTER, timeout=1.0)
    try:
        env.reset(TASK)
        env.step("add 2")
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"^fork-counter: its fork worker did not "
                                               r"answer 'step' within 1 s and was killed"):
            env.step("sleep")
        assert time.monotonic() - start < 10
        assert env.step("add 3") == reference(["add 2", "add 3"])[1]
    finally:
        env.close()


def test_close_leaves_no_process(counter: ForkEnv) -> None:
    counter.reset(TASK)
    snaps = []
    for a in actions(4, seed=5):
        counter.step(a)
        snaps.append(counter.snapshot())
    counter.restore(snaps[1])
    pids = counter.pids()
    assert len(pids) == 2 + 4  # supervisor, live worker, four frozen copies
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    assert set(pids) <= children
    counter.close()
    assert still_running(pids, timeout=10) == []
    assert not set(pids) & {p.pid for p in psutil.Process().children(recursive=True)
                            if p.status() != psutil.STATUS_ZOMBIE}
    with pytest.raises(RuntimeError, match="fork-counter: this fork env is closed"):
        counter.restore(snaps[0])


def test_no_process_outlives_the_caller() -> None:
    script = (
        "import json, os, sys\n"
        f"sys.path[:0] = {sys.path!r}\n"
        "from train.envs.fork import make_fork_env\n"
        "from test_env_fork import COUNTER, TASK\n"
        "env = make_fork_env(COUNTER)\n"
        "env.reset(TASK)\n"
        "env.snapshot()\n"
        "print(json.dumps(env.pids()), flush=True)\n"
        "os._exit(0)\n")  # no close(), no atexit: only the lifeline ends the group
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True)
    pids = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(pids) == 3
    assert still_running(pids, timeout=20) == []


def test_global_pool_cap_bounds_frozen_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fork_pool.POOL_ENV, "3")
    a, b = make_fork_env(COUNTER), make_fork_env(COUNTER)
    try:
        for env in (a, b):
            env.reset(TASK)
        for i in range(3):
            for env in (a, b):
                env.step(f"add {i}")
                env.snapshot()
        held = fork_pool.POOL.pids(a._owner) + fork_pool.POOL.pids(b._owner)
        assert len(held) == 3
        assert a.stats.evictions + b.stats.evictions == 3
    finally:
        a.close()
        b.close()
    monkeypatch.setenv(fork_pool.POOL_ENV, "0")
    env = make_fork_env(COUNTER)
    try:
        env.reset(TASK)
        env.step("add 1")
        snap = env.snapshot()
        env.step("add 1")
        env.restore(snap)
        assert env.stats.snapshots == 0 and env.stats.replay_restores == 1
        assert env.step("add 5") == reference(["add 1", "add 5"])[1]
    finally:
        env.close()


def test_a_sampler_collects_the_same_tree_through_fork_as_through_replay() -> None:
    from train.policies.base import Continuation, SampleConfig
    from train.sampling import make_sampler
    from train.sampling.engine import Engine, TreeJob

    class AddPolicy:
        """Adds a seeded random number, answers the total after a few steps."""

        policy_version = "add-test"
        policy_ref = None

        def sample(self, transcripts: Any, config: SampleConfig) -> list[list[Continuation]]:
            out = []
            for tr in transcripts:
                rng = random.Random(config.seed)
                totals = re.findall(r"total=(-?\d+)", tr[-1][1])
                if totals and rng.random() < 0.3:
                    text = f"<answer>{totals[-1]}</answer>"
                else:
                    text = f"add {rng.randrange(-5, 6)}"
                out.append([Continuation(text, [ord(c) for c in text],
                                         [-0.5] * len(text), [0.5] * len(text))
                            for _ in range(config.n)])
            return out

        def score(self, transcripts: Any, actions: Any) -> Any:
            raise NotImplementedError

    tasks = CounterEnv.generate_tasks(2, seed=7)

    def collect(factory: Any) -> list[Any]:
        jobs = [TreeJob(make_sampler("random"), factory, t, 6, seed=10 + i,
                        tree_id=f"f/{t.task_id}") for i, t in enumerate(tasks)]
        return Engine(AddPolicy(), max_rows=4, continuous=False).sample_trees(jobs)

    by_fork = collect(lambda: make_env(COUNTER))
    by_replay = collect(lambda: with_snapshots(CounterEnv(), "replay"))
    for f, r in zip(by_fork, by_replay, strict=True):
        assert len(f.nodes) == len(r.nodes) >= 1 + 6
        assert [(n.action_text, n.observation_text, n.reward) for n in f.nodes] == \
            [(n.action_text, n.observation_text, n.reward) for n in r.nodes]
        assert {json.loads(s)["strategy"] for s in f.snapshots.values()} == {"fork"}
        fork_logs = [json.loads(s)["replay"] for s in f.snapshots.values()]
        assert fork_logs == [json.loads(s) for s in r.snapshots.values()]


def test_without_fork_the_strategy_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    saved, module_vars = SNAPSHOT_STRATEGIES.pop("fork"), dict(vars(fork_mod))
    try:
        monkeypatch.delattr(os, "fork")
        module = importlib.reload(fork_mod)
        assert not module.SUPPORTED and "fork" not in SNAPSHOT_STRATEGIES
        with pytest.raises(ValueError, match="unknown snapshot strategy 'fork'; choose from "
                                             "native, replay"):
            with_snapshots(CounterEnv())
    finally:
        monkeypatch.undo()
        vars(fork_mod).update(module_vars)  # the classes, pool and lifeline other tests use
        SNAPSHOT_STRATEGIES["fork"] = saved
    assert fork_mod.SUPPORTED and "fork" in SNAPSHOT_STRATEGIES


def test_make_env_builds_a_fork_class_only_in_its_worker() -> None:
    with ThreadPoolExecutor(1) as pool:
        def episode() -> tuple[str, str]:
            sig, counter = make_env(SIGNAL), make_env(COUNTER, start=5)
            try:
                sig.reset(SignalEnv.generate_tasks(1, seed=0)[0])
                counter.reset(TASK)
                return sig.step("x").observation, counter.step("add 1").observation
            finally:
                sig.close()
                counter.close()

        hits, total = pool.submit(episode).result()
    assert hits == "hits=1 main=True"
    assert total.startswith("<tool_response>total=6 ")
