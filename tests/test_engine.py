"""The rollout engine (issue 22): many trees at once, and trees that do not depend on the batch.

The same tasks are collected with row budgets 1, 7 and 64 (one row per policy call, a
few, everything at once), with continuous batching and with whole calls, for every
sampler, with the trained tiny calc policy (the HF backend: left-padded batches of
different transcripts, rows joining a running batch, shared-prefix KV expansion) and
with the tabular workflow policy (the engine's one-call-per-branch fallback). The trees
must be the same: the same nodes, the same tokens, rewards, phases and snapshots, and
logprobs / entropies equal up to ``LOGPROB_TOL``.

The tiny policy runs in float64 here (``DTYPE``). Batched matmuls reduce in another order
than a lone row, and a prefix from the cache in another order than a full prefill; in
float32 that moved logprobs by up to ~1e-6 on one CPU and 1.1e-5 on an AVX-512 one, and a
sampled token flips whenever its uniform falls that close to a CDF boundary, so a float32
version of these tests holds on one machine and not on every machine of its kind. In
float64 the same reorderings move logprobs by ~1e-15: the tokens cannot part, and
``LOGPROB_TOL`` can be tight enough that any real difference in what a row attends to
(a wrong cache entry, a misplaced position or mask column: >= 1e-4) fails.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

from rollout_store.tree import Tree
from train.envs import Environment, Task, env_class, make_env
from train.envs.workflow import TabularPolicy, WorkflowModel
from train.policies import load_policy
from train.policies.base import Rows, SampleConfig, Turn, sample_rows, stream_uniforms
from train.policies.tiny import load_tiny_policy
from train.sampling import SAMPLERS, make_sampler
from train.sampling.engine import Decode, Engine, TreeJob, Work

DTYPE = torch.float64
LOGPROB_TOL = 1e-9
BUDGETS = (1, 7, 64)
CALC_TASKS = env_class("calc").generate_tasks(4, seed=11)
WF_TASKS = env_class("workflow").generate_tasks(4, seed=3)


@pytest.fixture(scope="module")
def calc_policy() -> Any:
    return load_tiny_policy("calc", dtype=DTYPE)


def collect_with(policy: Any, env: str, sampler: str, tasks: list[Task], n_total: int,
                 max_rows: int, continuous: bool = True, **params: Any
                 ) -> tuple[list[Tree], Engine]:
    samp = make_sampler(sampler, **params)
    engine = Engine(policy, max_rows=max_rows, continuous=continuous)
    jobs = [TreeJob(samp, lambda: make_env(env), task, n_total, seed=100 + i,
                    tree_id=f"t/{task.task_id}") for i, task in enumerate(tasks)]
    return engine.sample_trees(jobs), engine


def close(x: Any, y: Any) -> bool:
    """Equal, floats up to ``LOGPROB_TOL`` (BEL's gap and CALIPER's values are entropy
    and cost statistics)."""
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) < LOGPROB_TOL or x == y
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(close(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(close(u, v) for u, v in zip(x, y, strict=True))
    return bool(x == y)


def differences(a: Tree, b: Tree) -> tuple[list[str], float]:
    """What differs between two trees beyond float noise, and the largest logprob /
    entropy difference."""
    out: list[str] = []
    worst = 0.0
    if len(a.nodes) != len(b.nodes):
        return [f"{a.tree_id}: {len(a.nodes)} vs {len(b.nodes)} nodes"], float("inf")
    for x, y in zip(a.nodes, b.nodes, strict=True):
        for name in ("node_id", "parent_id", "kind", "action_text", "action_token_ids",
                     "observation_text", "reward", "terminal", "phase", "meta"):
            if getattr(x, name) != getattr(y, name):
                out.append(f"{a.tree_id} node {x.node_id}: {name}")
        for name in ("action_logprobs", "action_entropies"):
            u, v = np.asarray(getattr(x, name)), np.asarray(getattr(y, name))
            if u.shape != v.shape:
                out.append(f"{a.tree_id} node {x.node_id}: {name} length")
            elif u.size:
                worst = max(worst, float(np.abs(u - v).max()))
    if a.snapshots != b.snapshots or a.critical_node_id != b.critical_node_id:
        out.append(f"{a.tree_id}: snapshots or critical node")
    if a.rollouts_by_phase != b.rollouts_by_phase:
        out.append(f"{a.tree_id}: rollouts by phase")
    strip = ("env_steps", "restores", "policy_calls")
    if not close({k: v for k, v in (a.meta or {}).items() if k not in strip},
                 {k: v for k, v in (b.meta or {}).items() if k not in strip}):
        out.append(f"{a.tree_id}: meta")
    return out, worst


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_calc_trees_do_not_depend_on_the_row_budget(sampler: str, calc_policy: Any) -> None:
    """Row budgets 1, 7 and 64 with continuous batching (rows join the decoding batch
    between tokens, each policy call is one token of every live row), and with whole
    calls (each round answered by ``sample_rows`` calls), give the same trees."""
    runs = {(b, c): collect_with(calc_policy, "calc", sampler, CALC_TASKS, 8, b, c,
                                 max_new_tokens=32)
            for b in BUDGETS for c in (True, False)}
    base, _ = runs[BUDGETS[0], True]
    for c in (True, False):
        assert runs[1, c][1].stats.max_call_rows == 1  # budget 1: one row per call
        assert runs[64, c][1].stats.max_call_rows > 7  # budget 64: several trees at once
    assert runs[64, False][1].stats.policy_calls <= runs[7, False][1].stats.policy_calls \
        < runs[1, False][1].stats.policy_calls
    assert runs[64, True][1].stats.policy_calls < runs[1, True][1].stats.policy_calls
    for (budget, continuous), (trees, _) in runs.items():
        for a, b in zip(base, trees, strict=True):
            diff, worst = differences(a, b)
            assert diff == [], (budget, continuous, diff[:5])
            assert worst < LOGPROB_TOL, (budget, continuous, worst)
    assert all(len(t.leaves()) == 8 for t in base)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_workflow_trees_do_not_depend_on_the_row_budget(sampler: str) -> None:
    policy = load_policy("tabular", "workflow", policies=[
        TabularPolicy(WorkflowModel.from_config(t.config)) for t in WF_TASKS])
    runs = {b: collect_with(policy, "workflow", sampler, WF_TASKS, 12, b)[0] for b in BUDGETS}
    for budget in BUDGETS[1:]:
        for a, b in zip(runs[1], runs[budget], strict=True):
            diff, worst = differences(a, b)
            assert diff == [] and worst == 0.0, (budget, diff[:5])


def test_a_tree_in_a_wave_equals_the_tree_alone(calc_policy: Any) -> None:
    """``Sampler.sample_tree`` (a one-tree engine call) gives the tree a wave gives."""
    trees, _ = collect_with(calc_policy, "calc", "bel", CALC_TASKS[:3], 8, 64,
                            max_new_tokens=40)
    sampler = make_sampler("bel", max_new_tokens=40)
    for i, task in enumerate(CALC_TASKS[:3]):
        alone = sampler.sample_tree(make_env("calc"), calc_policy, task, 8, seed=100 + i,
                                    tree_id=f"t/{task.task_id}")
        diff, worst = differences(alone, trees[i])
        assert diff == [] and worst < LOGPROB_TOL


def test_rows_draw_from_their_own_stream(calc_policy: Any) -> None:
    """A request split into parts draws what the whole draws: branch k uses seed + k."""
    t: list[Turn] = [("prompt", make_env("calc").reset(CALC_TASKS[0]))]
    cfg = SampleConfig(max_new_tokens=20)
    whole = sample_rows(calc_policy, [Rows(t, 5, 77)], cfg)[0]
    parts = sample_rows(calc_policy, [Rows(t, 2, 77), Rows(t, 3, 79)], cfg)
    assert [c.token_ids for c in whole] == [c.token_ids for c in parts[0] + parts[1]]
    u = stream_uniforms(np.array([1, 2, 3], dtype=np.uint64), 0)
    assert u.shape == (3,) and ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == 3
    assert stream_uniforms(np.array([2], dtype=np.uint64), 0)[0] == u[1]


class SlowEnv(Environment):
    """calc with a sleeping step: tool time that the engine must overlap."""

    name = "calc"

    def __init__(self, delay: float, active: list[int], lock: threading.Lock) -> None:
        self.inner = make_env("calc")
        self.delay, self.active, self.lock = delay, active, lock

    def reset(self, task: Task) -> str:
        return self.inner.reset(task)

    def step(self, action_text: str) -> Any:
        with self.lock:
            self.active[0] += 1
            self.active[1] = max(self.active[1], self.active[0])
        time.sleep(self.delay)
        with self.lock:
            self.active[0] -= 1
        return self.inner.step(action_text)

    def snapshot(self) -> bytes:
        return self.inner.snapshot()

    def restore(self, state: bytes) -> None:
        self.inner.restore(state)

    def expert_action(self) -> str:
        return self.inner.expert_action()

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        raise NotImplementedError


def test_tools_of_different_trees_run_concurrently(calc_policy: Any) -> None:
    active, lock = [0, 0], threading.Lock()
    samp = make_sampler("group", max_new_tokens=24)
    jobs = [TreeJob(samp, lambda: SlowEnv(0.02, active, lock), task, 2, seed=i,
                    tree_id=f"s/{i}") for i, task in enumerate(CALC_TASKS)]
    trees = Engine(calc_policy, tool_threads=4).sample_trees(jobs)
    assert len(trees) == len(CALC_TASKS) and active[1] > 1  # steps overlapped


def test_programs_get_their_answers_in_their_own_order() -> None:
    """The core on plain programs: Work answers, Decode answers, exceptions raised."""
    from train.policies.tabular import UniformWorkflowPolicy

    env = make_env("workflow")
    prompt = env.reset(WF_TASKS[0])
    env.close()

    def program(i: int) -> Generator[Decode | Work, Any, Any]:
        value = yield Work(lambda: i * 10)
        assert value == i * 10
        turns: list[Turn] = [("prompt", prompt)]
        got = yield Decode([Rows(turns, 1 + i % 3, seed=i)],
                           SampleConfig(max_new_tokens=4))
        return len(got[0])

    engine = Engine(UniformWorkflowPolicy(), max_rows=2, max_programs=3)
    assert engine.run([partial(program, i) for i in range(7)]) == [1 + i % 3
                                                                        for i in range(7)]
    assert engine.stats.max_call_rows <= 2

    def failing() -> Generator[Decode | Work, Any, Any]:
        yield Work(lambda: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        Engine(UniformWorkflowPolicy()).run([lambda: program(0), failing])


def test_engine_closes_the_environments_it_made_even_on_failure(calc_policy: Any) -> None:
    closed: list[int] = []

    class Closing(SlowEnv):
        def close(self) -> None:
            closed.append(1)

    active, lock = [0, 0], threading.Lock()
    samp = make_sampler("group", max_new_tokens=24)
    jobs = [TreeJob(samp, lambda: Closing(0.0, active, lock), task, 2, seed=i, tree_id=f"c/{i}")
            for i, task in enumerate(CALC_TASKS)]
    Engine(calc_policy).sample_trees(jobs)
    assert len(closed) == len(CALC_TASKS)

    class Broken:
        policy_version, policy_ref = "broken", None

        def sample(self, transcripts: Any, config: Any) -> Any:
            raise RuntimeError("policy died")

    closed.clear()
    with pytest.raises(RuntimeError, match="policy died"):
        Engine(Broken()).sample_trees(jobs)  # type: ignore[arg-type]
    assert len(closed) == len(CALC_TASKS)


def test_prefix_cache_holds_refreshes_and_answers_exactly() -> None:
    """``PrefixCache.holds``: True only for a stored sequence (same tokens, not just the
    same hash key), and it makes the entry the most recently used, so a row whose keys
    the cache already has is not copied again and the entry survives eviction."""
    import torch

    from train.policies.hf import PrefixCache

    layer = [(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))]  # 64 bytes per entry
    cache = PrefixCache(max_bytes=128)
    cache.put([1, 2, 3, 4], layer)
    cache.put([5, 6, 7, 8], layer)
    assert cache.holds([1, 2, 3, 4]) and not cache.holds([1, 2, 3]) \
        and not cache.holds([1, 2, 3, 5])
    cache.put([9, 9, 9, 9], layer)  # evicts the least recently used: [5, 6, 7, 8]
    assert cache.holds([1, 2, 3, 4]) and not cache.holds([5, 6, 7, 8])
    assert cache.holds([9, 9, 9, 9]) and cache.bytes == 128


def test_the_prefix_cache_changes_no_token_and_saves_prefill() -> None:
    """The HF backend's cross-call prefix cache: the same trees as a full prefill every
    step (logprobs within LOGPROB_TOL), fewer prefix tokens computed, and emptied when
    the weights change."""
    from train.policies.base import Continuation

    seen: dict[str, list[int]] = {"off": [], "on": []}

    def trees(mib: float, tag: str) -> list[Tree]:
        policy = load_tiny_policy("calc", prefix_cache_mib=mib, dtype=DTYPE)
        original = policy.decoder

        def spy() -> Any:  # the engine's continuous decoder, its steps watched
            decoder = original()
            step = decoder.step

            def watched() -> list[tuple[Any, int, Continuation]]:
                got = step()
                seen[tag] += [c.prefill_tokens for _, _, c in got]
                return got

            decoder.step = watched  # type: ignore[method-assign]
            return decoder

        policy.decoder = spy  # type: ignore[method-assign]
        jobs = [TreeJob(make_sampler("bel", max_new_tokens=32), lambda: make_env("calc"),
                        task, 8, seed=i, tree_id=f"p/{i}") for i, task in enumerate(CALC_TASKS)]
        return Engine(policy).sample_trees(jobs)

    off, on = trees(0, "off"), trees(64, "on")
    for a, b in zip(off, on, strict=True):
        diff, worst = differences(a, b)
        assert diff == [] and worst < LOGPROB_TOL
    assert sum(seen["on"]) < 0.6 * sum(seen["off"])
    policy = load_tiny_policy("calc")
    t: list[Turn] = [("prompt", make_env("calc").reset(CALC_TASKS[0]))]
    n = len(policy.prompt_ids(t))
    policy.sample_rows([Rows(t, 2, 5)], SampleConfig(max_new_tokens=16))
    assert policy.prefix_cache is not None
    before = policy.prefix_cache.tokens
    assert before > 2 * n + 4
    with torch.no_grad():
        next(policy.model.parameters()).add_(0.0)  # an in-place update of the weights
    policy.sample_rows([Rows(t, 1, 6)], SampleConfig(max_new_tokens=4))
    assert policy.prefix_cache.tokens <= 2 * n + 4  # only what the second call stored


def test_rows_of_different_sample_configs_share_one_batch(calc_policy: Any) -> None:
    """Sampled and greedy episodes in one engine run (one decoding batch, each row with
    its own temperature / top_p) are the episodes each mode gives alone."""
    from train.sampling.evaluation import GREEDY_TOP_P, episode_program, run_episodes

    tasks = env_class("calc").generate_tasks(12, seed=5)
    configs = [SampleConfig(max_new_tokens=32), SampleConfig(max_new_tokens=32,
                                                             top_p=GREEDY_TOP_P)]
    engine = Engine(calc_policy)
    together = engine.run([partial(episode_program, lambda: make_env("calc"), task, i, 3, c)
                           for c in configs for i, task in enumerate(tasks)])
    assert engine.stats.max_call_rows > len(tasks)  # the modes did share steps
    for m, greedy in enumerate((False, True)):
        alone = run_episodes(calc_policy, "calc", tasks, seed=3, max_new_tokens=32,
                             greedy=greedy)
        assert [r for r, _ in together[m * len(tasks):(m + 1) * len(tasks)]] == alone.rewards
        assert [n for _, n in together[m * len(tasks):(m + 1) * len(tasks)]] == alone.steps
    assert together[:len(tasks)] != together[len(tasks):]  # the modes did differ


@pytest.mark.parametrize("max_rows, drop_from", [(7, 64), (3, 4), (16, 4)])
def test_rows_joining_a_running_batch_decode_as_alone(calc_policy: Any, max_rows: int,
                                                      drop_from: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``DecodeBatch.admit`` into a running batch (free positions reused, columns padded
    on the left, leading columns dropped, positions compacted): every row draws the
    tokens it draws decoded alone, logprobs within LOGPROB_TOL."""
    import random

    from train.policies import hf

    monkeypatch.setattr(hf.decode, "DROP_COLUMNS_FROM", drop_from)
    monkeypatch.setattr(calc_policy, "prefix_cache", None)
    env = make_env("calc")
    prompts = [calc_policy.prompt_ids([("prompt", env.reset(t))])
               for t in env_class("calc").generate_tasks(48, seed=0)]
    prompts = [p + p[:i % 25] * (i % 3) for i, p in enumerate(prompts)]  # mixed lengths
    ns = [1 + i % 3 for i in range(len(prompts))]
    config = SampleConfig(max_new_tokens=40)
    alone: dict[tuple[int, int], Any] = {}
    for i, prompt in enumerate(prompts):
        single = hf.DecodeBatch(calc_policy, config, [prompt], [ns[i]], [1000 + i], [i])
        while single.live:
            alone.update({(t, k): c for t, k, c in single.step()})
    batch = hf.DecodeBatch(calc_policy, config)
    together: dict[tuple[int, int], Any] = {}
    pending, rng, joined_running = list(range(len(prompts))), random.Random(1), 0
    while pending or batch.live:
        while pending and (not batch.live or (batch.live + ns[pending[0]] <= max_rows
                                              and rng.random() < 0.5)):
            i = pending.pop(0)
            joined_running += bool(batch.live)
            batch.admit([prompts[i]], [ns[i]], [1000 + i], [i])
        together.update({(t, k): c for t, k, c in batch.step()})
    assert joined_running >= len(prompts) // 4 and batch.merged  # rows did join mid-run
    assert together.keys() == alone.keys()
    for key, cont in alone.items():
        assert together[key].token_ids == cont.token_ids, key
        assert np.abs(np.subtract(together[key].logprobs, cont.logprobs)).max() < LOGPROB_TOL


def test_an_empty_batch_prefills_short_and_long_suffixes_apart(
        calc_policy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts whose uncomputed suffixes differ widely (a cached transcript plus an
    observation beside a fresh root prompt) are prefilled in separate forwards even into
    an empty batch, so no row computes at the longest suffix's width; each row still draws
    what it draws alone."""
    from train.policies import hf

    assert calc_policy.prefix_cache is not None  # an empty one: earlier tests filled it
    monkeypatch.setattr(calc_policy, "prefix_cache",
                        hf.PrefixCache(calc_policy.prefix_cache.max_bytes))
    env = make_env("calc")
    first, fresh = env_class("calc").generate_tasks(2, seed=11)
    config = SampleConfig(max_new_tokens=24)
    root = calc_policy.prompt_ids([("prompt", env.reset(first))])
    step = calc_policy.sample_rows([Rows([("prompt", env.reset(first))], 1, 50)], config)
    grown = root + step[0][0].token_ids[:-1] + root[:6]  # cached, then 6 new tokens
    long = calc_policy.prompt_ids([("prompt", env.reset(fresh))]) * 3  # nothing cached
    widths: list[int] = []
    forward = calc_policy.model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        widths.append(int(kwargs["input_ids"].shape[1]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(calc_policy.model, "forward", spy)
    batch = hf.DecodeBatch(calc_policy, config)
    batch.admit([grown, long], [2, 1], [7, 8])
    assert sorted(widths) == [6, len(long)], (widths, len(long))
    got: dict[tuple[int, int], Any] = {}
    while batch.live:
        got.update({(t, k): c for t, k, c in batch.step()})
    monkeypatch.setattr(calc_policy.model, "forward", forward)
    for t, (prompt, n, seed) in enumerate([(grown, 2, 7), (long, 1, 8)]):
        single = hf.DecodeBatch(calc_policy, config)
        single.admit([prompt], [n], [seed])
        while single.live:
            for _, k, cont in single.step():
                assert cont.token_ids == got[(t, k)].token_ids
                assert np.abs(np.subtract(cont.logprobs, got[(t, k)].logprobs)).max() \
                    < LOGPROB_TOL
