"""The ``workflow`` environment: exact values, snapshots, malformed actions, BEL ground truth."""

from __future__ import annotations

import math
import random

import pytest
from env_properties import HOSTILE_ACTIONS, check_never_raises, check_snapshot_determinism
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from train.envs import make_env
from train.envs.base import Task
from train.envs.workflow import (
    ACTION_TEXTS,
    ObsKey,
    StageSpec,
    State,
    TabularPolicy,
    WorkflowEnv,
    WorkflowModel,
    WorkflowSpec,
    lm_policy_values,
)

FAST, CAREFUL, REPAIR, SKIP = (ACTION_TEXTS[t] for t in ("fast", "careful", "repair", "skip"))
BAD = "<tool_call>{not json</tool_call>"


def tiny_spec(deterministic: bool = False) -> WorkflowSpec:
    """Two required stages, three steps: small enough to solve by hand (see test_hand_values)."""
    return WorkflowSpec(
        stages=(StageSpec("a", (), p_fast=0.8, p_careful=0.5, p_repair=0.5),
                StageSpec("b", (0,), p_fast=0.6, p_careful=0.4, p_repair=0.9,
                          fast_failure="crash")),
        horizon=3, rng_seed=7, deterministic=deterministic)


def tiny_task(deterministic: bool = False) -> Task:
    spec = tiny_spec(deterministic)
    return Task("tiny", "workflow", WorkflowModel(spec).prompt(), max_steps=3,
                config=spec.to_config())


def optional_spec() -> WorkflowSpec:
    """fetch -> (audit, optional) ; fetch -> deploy: skipping audit is safe, fetch is not."""
    return WorkflowSpec(
        stages=(StageSpec("fetch", (), 0.9, 0.6, 0.7),
                StageSpec("audit", (0,), 0.9, 0.6, 0.7),
                StageSpec("deploy", (0,), 0.9, 0.6, 0.7)),
        horizon=6, rng_seed=1)


TASKS = WorkflowEnv.generate_tasks(6, seed=11)


# ----- hand-computed values ---------------------------------------------------------------


def test_hand_values_uniform_policy() -> None:
    model = WorkflowModel(tiny_spec())
    values = TabularPolicy(model).values()  # all logits 0: uniform over the valid tools
    v = values.v
    # stage b with 1 step left: (fast 0.6 + careful 0.4 + skip 0) / 3
    assert v(State(1, 2)) == pytest.approx(1 / 3)
    # stage b, 2 steps left: fast 0.6; careful 0.4 + 0.6 * 1/3 = 0.6; skip 0
    assert values.q(State(1, 1), FAST) == pytest.approx(0.6)
    assert values.q(State(1, 1), CAREFUL) == pytest.approx(0.6)
    assert values.q(State(1, 1), SKIP) == 0.0
    assert v(State(1, 1)) == pytest.approx(0.4)
    # stage a with 1 step left, or broken with 2 left: too few steps
    assert v(State(0, 2)) == 0.0
    assert v(State(0, 1, broken=True)) == 0.0
    # stage a, 2 steps left: (0.8/3 + 0.5/3 + 0) / 3
    assert v(State(0, 1)) == pytest.approx(1.3 / 9)
    # the start: Q(fast) = 0.8 * 0.4, Q(careful) = 0.5 * 0.4 + 0.5 * 1.3/9
    assert values.q(State(0, 0), FAST) == pytest.approx(0.32)
    assert values.q(State(0, 0), CAREFUL) == pytest.approx(0.2 + 0.65 / 9)
    assert values.q_values(State(0, 0)) == pytest.approx(
        {FAST: 0.32, CAREFUL: 0.2 + 0.65 / 9, SKIP: 0.0})
    assert v(State(0, 0)) == pytest.approx(5.33 / 27)
    # a malformed action wastes a step: Q = V(stage a, 2 steps left)
    assert values.q(State(0, 0), BAD) == pytest.approx(1.3 / 9)
    # terminal states
    assert v(State(2, 2)) == 1.0
    assert v(State(2, 2, corrupt=True)) == 0.0
    assert v(State(1, 2, crashed=True)) == 0.0


def test_hand_values_optimal_and_expert() -> None:
    model = WorkflowModel(tiny_spec())
    opt = model.optimal_values()
    assert opt.v(State(1, 2)) == pytest.approx(0.6)
    assert opt.v(State(1, 1)) == pytest.approx(0.76)  # careful: 0.4 + 0.6 * 0.6
    assert opt.v(State(0, 1)) == pytest.approx(0.48)  # fast: 0.8 * 0.6
    assert opt.q(State(0, 0), FAST) == pytest.approx(0.608)
    assert opt.q(State(0, 0), CAREFUL) == pytest.approx(0.62)
    assert opt.v(State(0, 0)) == pytest.approx(0.62)
    env = WorkflowEnv()
    env.reset(tiny_task())
    assert env.expert_action() == CAREFUL
    assert opt.best_action(State(1, 1)) == CAREFUL
    assert opt.best_action(State(1, 2)) == FAST


def test_tabular_policy_parameters() -> None:
    model = WorkflowModel(tiny_spec())
    policy = TabularPolicy(model)
    s = State(0, 0)
    assert policy.probs(s) == pytest.approx([1 / 3] * 3)
    assert policy.entropy(s) == pytest.approx(math.log(3))
    policy.update(s, "fast", math.log(2.0))  # fast now has weight 2 of 4
    assert policy.prob(s, FAST) == pytest.approx(0.5)
    assert policy.log_prob(s, "careful") == pytest.approx(math.log(0.25))
    policy.set_logits(State(0, 1, broken=True), {"repair": 1.0})
    assert policy.logits(State(0, 1, broken=True)) == [1.0, 0.0]
    # the policy sees the observable state only
    assert policy.probs(State(0, 0, corrupt=True)) == policy.probs(s)
    with pytest.raises(ValueError):
        policy.update(s, "repair", 1.0)  # not valid on a working stage
    with pytest.raises(ValueError):
        policy.set_logits(s, [1.0, 2.0])
    # values() is a frozen snapshot: later updates do not leak in
    values = policy.values()
    before = values.v(s)
    policy.update(s, SKIP, 10.0)
    assert values.v(s) == before
    assert policy.values().v(s) < before
    draws = [policy.sample(s, random.Random(i)) for i in range(200)]
    assert set(draws) <= set(model.valid_actions(s))


# ----- LM-style callable --------------------------------------------------------------------


def random_policy(model: WorkflowModel, seed: int) -> TabularPolicy:
    rng = random.Random(seed)
    policy = TabularPolicy(model)
    for key in model.keys_by_text().values():
        policy.set_logits(key, [rng.gauss(0.0, 1.5) for _ in model.valid_tools(key)])
    return policy


@pytest.mark.parametrize("task", TASKS[:3], ids=lambda t: t.task_id)
def test_lm_callable_equals_tabular(task: Task) -> None:
    model = WorkflowModel.from_config(task.config)
    policy = random_policy(model, seed=3)
    # an "LM" that only reads the text: a table from state text to probabilities
    table = {text: policy.probs(key) for text, key in model.keys_by_text().items()}
    calls: list[str] = []

    def lm(state_text: str, actions: list[str]) -> list[float]:
        calls.append(state_text)
        assert actions == model.valid_actions(model.keys_by_text()[state_text])
        return table[state_text]

    exact = policy.values()
    via_lm = lm_policy_values(model, lm)
    via_method = lm_policy_values(model, policy.action_probs, residual="strict")
    for s in model.reachable_states(include_wasted=True):
        assert via_lm.v(s) == pytest.approx(exact.v(s), abs=1e-12)
        assert via_method.v(s) == pytest.approx(exact.v(s), abs=1e-12)
        for action in model.valid_actions(s):
            assert via_lm.q(s, action) == pytest.approx(exact.q(s, action), abs=1e-12)
    assert len(calls) == len(set(calls))  # one call per observable state


def test_lm_callable_residual_modes() -> None:
    model = WorkflowModel(tiny_spec())

    def lm(state_text: str, actions: list[str]) -> list[float]:
        return [0.5] + [0.0] * (len(actions) - 1)  # half the mass on invalid text

    # stage b, 1 step left: 0.5 * fast (0.6) + 0.5 * wasted (out of steps, 0)
    assert lm_policy_values(model, lm, "wasted").v(State(1, 2)) == pytest.approx(0.3)
    assert lm_policy_values(model, lm, "renormalize").v(State(1, 2)) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        lm_policy_values(model, lm, "strict").v(State(1, 2))
    with pytest.raises(ValueError):
        lm_policy_values(model, lambda text, actions: [-1.0, 2.0, 0.0]).v(State(0, 0))


# ----- recoverability and the first irrecoverable step --------------------------------------


def test_recoverable_states() -> None:
    model = WorkflowModel(tiny_spec())
    assert model.recoverable(State(0, 0))
    assert model.recoverable(State(0, 1))
    assert not model.recoverable(State(0, 2))  # one step left, two stages to go
    assert not model.recoverable(State(0, 1, broken=True))  # repair + 2 stages > 2 steps
    assert not model.recoverable(State(1, 1, corrupt=True))
    assert model.recoverable(State(2, 3))  # success
    opt = model.optimal_values()
    for s in model.reachable_states(include_wasted=True):
        assert model.recoverable(s) == (opt.v(s) > 0.0)


@pytest.mark.parametrize(("actions", "outcomes", "expected"), [
    ([FAST], [False], 1),  # broken with 2 steps left: dead
    ([CAREFUL, CAREFUL], [False, False], 2),  # out of time after the second failure
    ([SKIP, FAST], [None, True], 1),  # silent corruption, noticed only at the end
    ([CAREFUL, CAREFUL], [True, True], None),  # success
    ([BAD, CAREFUL, CAREFUL], [None, True, False], 3),
    ([CAREFUL, FAST], [True, False], 2),  # crash
    ([], [], None),
])
def test_first_irrecoverable_step_hand_built(actions: list[str], outcomes: list[bool | None],
                                             expected: int | None) -> None:
    model = WorkflowModel(tiny_spec())
    states = model.replay(actions, outcomes)
    assert model.first_irrecoverable_step(states) == expected
    if expected is not None:  # monotone: every later state is dead too
        assert not any(model.recoverable(s) for s in states[expected:])


def test_first_irrecoverable_step_optional_stage() -> None:
    model = WorkflowModel(optional_spec())
    assert model.required == frozenset({0, 2})
    safe = model.replay([CAREFUL, SKIP, CAREFUL], [True, None, True])
    assert model.is_success(safe[-1])
    assert model.first_irrecoverable_step(safe) is None
    # skipping the required first stage kills the run at step 1, though the episode goes on
    dead = model.replay([SKIP, FAST, CAREFUL], [None, True, True])
    assert model.first_irrecoverable_step(dead) == 1
    assert model.is_terminal(dead[-1]) and model.reward(dead[-1]) == 0.0


@pytest.mark.parametrize(("actions", "expected", "reward"), [
    ([CAREFUL, CAREFUL, CAREFUL], 3, 0.0),  # b's careful (0.4 < 0.5) fails every time
    ([CAREFUL, CAREFUL, FAST], None, 1.0),  # ... but fast (0.6) still saves it at step 3
    ([SKIP, FAST], 1, 0.0),  # silent corruption, then the final check fails
    ([FAST, SKIP], 2, 0.0),
])
def test_first_irrecoverable_step_deterministic_env(actions: list[str], expected: int | None,
                                                    reward: float) -> None:
    """Deterministic mode: outcomes follow from the actions, and the env agrees with replay."""
    task = tiny_task(deterministic=True)
    model = WorkflowModel.from_config(task.config)
    env = WorkflowEnv()
    env.reset(task)
    results = [env.step(a) for a in actions]
    states = model.replay(actions)  # no outcomes needed
    assert env.state == states[-1]
    assert model.first_irrecoverable_step(states) == expected
    assert results[-1].done and results[-1].reward_parts["reward"] == reward


def test_deterministic_recoverability_counts_certain_failures() -> None:
    model = WorkflowModel(tiny_spec(), deterministic=True)
    assert model.tool_probability(State(1, 2), "careful") == 0.0
    assert model.tool_probability(State(1, 2), "fast") == 1.0
    # with only careful, b would be stuck; fast saves it, so the state is recoverable
    assert model.optimal_values().v(State(1, 2)) == 1.0


# ----- paths, snapshots and text ---------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.task_id)
def test_path_states_from_texts_and_snapshots(task: Task) -> None:
    env = WorkflowEnv()
    env.reset(task)
    rng = random.Random(5)
    model = env.model
    policy = random_policy(model, seed=1)
    values = policy.values()
    actions, observations = [], []
    while not env.done:
        action = policy.sample(env.state, rng) if rng.random() < 0.9 else BAD
        result = env.step(action)
        actions.append(action)
        observations.append(result.observation)
        states = model.path_states(actions, observations)
        assert states[-1] == env.state == WorkflowEnv.snapshot_state(env.snapshot())
        assert values.path_value(actions, observations) == values.v(env.state)
        assert result.done == model.is_terminal(env.state)
        assert result.reward_parts["reward"] == (model.reward(env.state) if result.done else 0.0)
        if not result.done:
            assert result.observation.endswith(model.state_text(env.state) + "</tool_response>")
    assert len(actions) <= task.max_steps


def test_tree_values_from_node_columns() -> None:
    """Exact success probability of every node of a branched tree, from the node texts."""
    env = WorkflowEnv()
    prompt = env.reset(TASKS[1])
    model = env.model
    values = random_policy(model, seed=2).values()
    node_ids, actions, observations = [0], [""], [prompt]
    parents: list[int | None] = [None]
    truth, snaps = {0: env.state}, {0: env.snapshot()}
    rng = random.Random(0)
    for nid in range(1, 60):
        parent = rng.choice([n for n in node_ids if not model.is_terminal(truth[n])])
        env.restore(snaps[parent])
        env.reseed(nid)
        action = rng.choice([FAST, CAREFUL, REPAIR, SKIP, BAD])
        result = env.step(action)
        node_ids.append(nid)
        parents.append(parent)
        actions.append(action)
        observations.append(result.observation)
        truth[nid], snaps[nid] = env.state, env.snapshot()
    order = list(range(len(node_ids)))[::-1]  # any node order
    got = values.tree_values([node_ids[i] for i in order], [parents[i] for i in order],
                             [actions[i] for i in order], [observations[i] for i in order])
    assert got == {nid: values.v(s) for nid, s in truth.items()}
    with pytest.raises(ValueError):
        model.tree_states([1], [5], [FAST], [""])


def test_state_text_identifies_observable_state() -> None:
    model = WorkflowModel.from_config(TASKS[2].config)
    texts = model.keys_by_text()
    assert len(texts) == model.n_stages * model.horizon * 2
    for text, key in texts.items():
        assert model.key_from_text("history...\n" + text) == key
    assert model.key_from_text("nothing here") is None
    assert model.state_text(ObsKey(1, 2, True)) == model.state_text(State(1, 2, True, True))


def test_snapshot_is_compact_canonical_json() -> None:
    env = WorkflowEnv()
    env.reset(TASKS[2])
    env.step(FAST)
    snap = env.snapshot()
    assert snap.startswith(b"{") and b" " not in snap and len(snap) < 400
    other = WorkflowEnv()
    other.restore(snap)
    assert other.snapshot() == snap
    assert other.state == env.state
    with pytest.raises(ValueError):
        other.restore(b'{"v": 99}')


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(task_index=st.integers(0, len(TASKS) - 1),
       prefix=st.lists(st.sampled_from([FAST, CAREFUL, REPAIR, SKIP, BAD]), max_size=8),
       suffix=st.lists(st.sampled_from([FAST, CAREFUL, REPAIR, SKIP, BAD, "<answer>1</answer>"]),
                       max_size=10),
       deterministic=st.booleans())
def test_snapshot_restore_determinism(task_index: int, prefix: list[str], suffix: list[str],
                                      deterministic: bool) -> None:
    check_snapshot_determinism(lambda: WorkflowEnv(deterministic=deterministic),
                               TASKS[task_index], prefix, suffix)


def test_reseed_gives_an_independent_stream() -> None:
    env = WorkflowEnv()
    env.reset(TASKS[0])
    snap = env.snapshot()
    runs = set()
    for k in range(20):
        env.restore(snap)
        env.reseed(k)
        runs.add(tuple(env.step(CAREFUL).observation for _ in range(3)))
    assert len(runs) > 1


def test_malformed_actions_never_raise() -> None:
    env = make_env("workflow")
    hostile = [*HOSTILE_ACTIONS, REPAIR, '<tool_call>{"name": "fast", "arguments": {"x": 1}}'
               "</tool_call>", "<answer>done</answer>", FAST + CAREFUL]
    results = check_never_raises(env, tiny_task(), hostile)
    for action, result in zip(hostile, results, strict=True):
        if action not in (FAST + CAREFUL,):
            assert result.observation.startswith("<tool_response>error: ")
            assert result.reward_parts == {"reward": 0.0, "malformed": 1.0}
    # the same bad action twice from one state gives the same observation
    env.reset(tiny_task())
    snap = env.snapshot()
    first = env.step(BAD)
    env.restore(snap)
    assert env.step(BAD) == first


def test_malformed_actions_use_up_the_horizon() -> None:
    env = WorkflowEnv()
    env.reset(tiny_task())
    results = [env.step("nonsense") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].observation.endswith("Out of steps. Reward 0.</tool_response>")
    after = env.step(FAST)
    assert after.done and after.reward_parts["reward"] == 0.0
    assert WorkflowEnv().step(FAST).done  # before reset: an error, not an exception


# ----- task generator and expert ------------------------------------------------------------


def test_generate_tasks_is_seeded_and_mixed() -> None:
    tasks = WorkflowEnv.generate_tasks(30, seed=4)
    assert tasks == WorkflowEnv.generate_tasks(30, seed=4)
    assert tasks != WorkflowEnv.generate_tasks(30, seed=5)
    assert [t.max_steps for t in tasks[:6]] == [6, 9, 12, 6, 9, 12]
    for task in tasks:
        spec = WorkflowSpec.from_config(task.config)
        assert spec.to_config() == task.config
        h = task.max_steps
        assert math.ceil(h / 3) + 1 <= len(spec.stages) <= h // 2 + 1
        model = WorkflowModel(spec)
        assert model.recoverable(model.initial_state())
        assert WorkflowEnv().reset(task) == task.prompt
    assert {t.max_steps for t in WorkflowEnv.generate_tasks(4, 0, horizons=(8,))} == {8}
    with pytest.raises(TypeError):
        WorkflowEnv.generate_tasks(1, 0, colour="red")


def test_mark_optional_shows_exactly_the_optional_stages() -> None:
    """``mark_optional`` adds ``; optional`` to the optional stages' needs (prompt list
    and state lines) and nothing else: same stages, probabilities and outcomes; the flag
    survives config, snapshot and restore; unmarked tasks keep their old config."""
    plain = WorkflowEnv.generate_tasks(12, seed=3, horizons=(18,))
    marked = WorkflowEnv.generate_tasks(12, seed=3, horizons=(18,), mark_optional=True)
    assert all("mark_optional" not in t.config for t in plain)
    assert any(len(WorkflowSpec.from_config(t.config).required()) < len(t.config["stages"])
               for t in marked)
    for p, m in zip(plain, marked, strict=True):
        assert {**p.config, "mark_optional": True} == m.config
        model = WorkflowModel.from_config(m.config)
        assert model.spec.to_config() == m.config
        for i, stage in enumerate(model.spec.stages):
            line = f"{i + 1}. {stage.name} (needs: "
            row = next(r for r in m.prompt.splitlines() if r.strip().startswith(line))
            assert row.endswith("; optional)") == (i not in model.required), row
            key = ObsKey(i, 1, False)
            text = model.state_text(key)
            assert ("; optional)" in text) == (i not in model.required)
            assert model.key_from_text(text) == key
        env, other = WorkflowEnv(), WorkflowEnv()
        assert env.reset(m) == m.prompt
        outcomes = [env.step(CAREFUL).observation for _ in range(3)]
        other.reset(p)
        assert [o.replace("; optional", "") for o in outcomes] == \
            [other.step(CAREFUL).observation for _ in range(3)]
        snap = env.snapshot()
        restored = WorkflowEnv()
        restored.restore(snap)
        assert restored.model.spec.mark_optional and restored.snapshot() == snap
    with pytest.raises(ValueError, match="mark_optional"):
        WorkflowEnv.generate_tasks(1, 0, mark_optional="yes")  # type: ignore[arg-type]


def test_expert_solves_deterministic_tasks() -> None:
    for task in WorkflowEnv.generate_tasks(24, seed=2, deterministic=True):
        env = WorkflowEnv()
        env.reset(task)
        assert env.model.optimal_values().v(env.state) == 1.0
        result = None
        while not env.done:
            result = env.step(env.expert_action())
        assert result is not None and result.reward_parts["reward"] == 1.0


# ----- exact values against Monte Carlo through the real env ---------------------------------


def monte_carlo(env: WorkflowEnv, snap: bytes, policy: TabularPolicy, n: int, seed: int,
                first_action: str | None = None) -> float:
    """Mean reward of ``n`` episodes from ``snap`` through ``env.step`` (fresh outcome
    stream per episode via ``reseed``)."""
    rng = random.Random(seed)
    wins = 0.0
    for i in range(n):
        env.restore(snap)
        env.reseed(seed * 1_000_003 + i)
        action = first_action
        result = None
        while not env.done:
            result = env.step(action if action is not None else policy.sample(env.state, rng))
            action = None
        assert result is not None
        wins += result.reward_parts["reward"]
    return wins / n


def check_against_monte_carlo(n: int, z: float) -> None:
    env = WorkflowEnv()
    for index, task in enumerate(TASKS[:3]):
        env.reset(task)
        model = env.model
        policy = random_policy(model, seed=index)
        values = policy.values()
        starts = [env.snapshot()]
        rng = random.Random(index)
        for _ in range(2):  # a couple of later states along a sampled path
            if env.done:
                break
            env.step(policy.sample(env.state, rng))
            if not env.done:
                starts.append(env.snapshot())
        for k, snap in enumerate(starts):
            s = WorkflowEnv.snapshot_state(snap)
            checks: list[tuple[float, str | None]] = [(values.v(s), None)]
            if k == 0:
                checks.append((values.q(s, CAREFUL), CAREFUL))
            for exact, first in checks:
                estimate = monte_carlo(env, snap, policy, n, seed=100 * index + k,
                                       first_action=first)
                bound = z * math.sqrt(exact * (1.0 - exact) / n) + 1e-9
                assert abs(estimate - exact) <= bound, (task.task_id, s, first, estimate, exact)


def test_exact_values_match_monte_carlo_fast() -> None:
    check_against_monte_carlo(n=600, z=5.0)


@pytest.mark.slow
def test_exact_values_match_monte_carlo_slow() -> None:
    check_against_monte_carlo(n=20_000, z=4.0)
