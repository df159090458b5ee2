"""The third-party adapters (issue 44 item 5) against the real packages: gymnasium's
toy-text games (``train.envs.adapters.gymnasium_env``) and reasoning-gym's task sets
(``train.envs.adapters.reasoning_gym_env``). Each test skips cleanly when its package is
missing. No mocks: real games, real data sets, real collection into a real store."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from train.envs import Environment, StepResult, Task, make_env
from train.envs.strategies import ReplayEnv
from train.envs.tools import check_tool_schemas
from train.policies.base import Continuation, SampleConfig, Transcript

GYM = "train.envs.adapters.gymnasium_env"
RG = "train.envs.adapters.reasoning_gym_env"
GAME_CLASSES = ("GymTextEnv", "ToyTextEnv", "FrozenLakeEnv", "TaxiEnv", "CliffWalkingEnv",
                "BlackjackEnv")
# a 4x4 map with one shortest path: DOWN DOWN RIGHT RIGHT DOWN RIGHT (gymnasium's 4x4)
MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]
MALFORMED = [
    "I will go left.",                                                  # no block
    "<tool_call>{not json</tool_call>",                                 # bad JSON
    '<tool_call>{"name": "fly", "arguments": {"action": "UP"}}</tool_call>',  # other tool
    '<tool_call>{"name": "act", "arguments": {}}</tool_call>',         # no argument
    '<tool_call>{"name": "act", "arguments": {"action": "JUMP"}}</tool_call>',  # no such
    '<tool_call>{"name": "act", "arguments": {"action": 3}}</tool_call>',  # wrong type
    '<tool_call>{"name": "act", "arguments": {"action": "UP", "x": 1}}</tool_call>',
    "<tool_call>" + "[" * 5000 + "</tool_call>",                        # deep JSON
    "<tool_call>\x00\x1b[31m</tool_call>",                              # control chars
]


@pytest.fixture(scope="module")
def gm() -> ModuleType:
    pytest.importorskip("gymnasium")
    import train.envs.adapters.gymnasium_env as module

    return module


@pytest.fixture(scope="module")
def rgm() -> ModuleType:
    pytest.importorskip("reasoning_gym")
    import train.envs.adapters.reasoning_gym_env as module

    return module


def lake_task(gm: ModuleType, slippery: bool = False, seed: int = 0, max_steps: int = 16,
              desc: list[str] | None = None) -> Task:
    return Task("lake", "gym-frozenlake", "Cross the lake.", None, max_steps,
                {"game": "FrozenLake", "gym_id": gm.installed_id("FrozenLake"),
                 "kwargs": {"desc": desc or MAP, "is_slippery": slippery}, "seed": seed})


def episode(env: Environment, task: Task, actions: Sequence[str]) -> list[StepResult]:
    env.reset(task)
    out = []
    for a in actions:
        out.append(env.step(a))
        if out[-1].done:
            break
    return out


def run_expert(env: Environment, task: Task) -> StepResult:
    env.reset(task)
    for _ in range(task.max_steps):
        result = env.step(env.expert_action())
        if result.done:
            return result
    raise AssertionError("the episode did not end within max_steps")


# ---------------------------------------------------------------------------
# gymnasium


def test_gym_tool_schemas_are_valid_and_list_the_game_actions(gm: ModuleType) -> None:
    enums = {}
    for name in GAME_CLASSES:
        cls = getattr(gm, name)
        schemas = check_tool_schemas(cls.tool_schemas(), name)
        assert [s["function"]["name"] for s in schemas] == ["act"]
        enums[name] = schemas[0]["function"]["parameters"]["properties"]["action"]["enum"]
        # make_env's instance (replay-wrapped or not) answers the same schemas
        assert make_env(f"{GYM}:{name}").tool_schemas() == schemas
    assert enums["FrozenLakeEnv"] == ["LEFT", "DOWN", "RIGHT", "UP"]
    assert enums["TaxiEnv"] == ["SOUTH", "NORTH", "EAST", "WEST", "PICKUP", "DROPOFF"]
    assert enums["CliffWalkingEnv"] == ["UP", "RIGHT", "DOWN", "LEFT"]
    assert enums["BlackjackEnv"] == ["STICK", "HIT"]
    assert set(enums["GymTextEnv"]) == {a for n in GAME_CLASSES[2:] for a in enums[n]}
    assert isinstance(make_env(f"{GYM}:GymTextEnv"), ReplayEnv)
    assert isinstance(make_env(f"{GYM}:FrozenLakeEnv"), gm.FrozenLakeEnv)  # native


def test_frozen_lake_board_moves_and_reward(gm: ModuleType) -> None:
    env = make_env(f"{GYM}:FrozenLakeEnv")
    task = lake_task(gm)
    first = env.reset(task)
    assert first.startswith("Cross the lake.\n\n")
    assert "\x1b" not in first and "SFFF\nFHFH\nFFFH\nHFFG\n" in first
    assert "row 0, column 0" in first and first.endswith("Legal actions: LEFT, DOWN, RIGHT, UP")
    act = gm.act_text
    r = env.step(act("RIGHT"))
    assert r.observation.startswith("<tool_response>  (Right)\nSFFF")
    assert "row 0, column 1" in r.observation and not r.done
    assert r.reward_parts == {"reward": 0.0, "tool_calls": 1.0, "tool_errors": 0.0,
                              "truncated": 0.0, "env_return": 0.0, "env_steps": 1.0}
    r = env.step(act("DOWN"))  # (1, 1) is a hole
    assert r.done and r.reward_parts["reward"] == 0.0 and "on H" in r.observation
    assert "Legal actions" not in r.observation and "The game is over" in r.observation
    again = env.step(act("DOWN"))
    assert again.done and "episode is over" in again.observation
    path = ["DOWN", "DOWN", "RIGHT", "RIGHT", "DOWN", "RIGHT"]
    results = episode(env, task, [act(a) for a in path])
    assert [x.done for x in results] == [False] * 5 + [True]
    assert results[-1].reward_parts["reward"] == 1.0
    assert results[-1].reward_parts["env_return"] == 1.0


def test_taxi_penalty_continues_and_delivery_scores_one(gm: ModuleType) -> None:
    env = make_env(f"{GYM}:TaxiEnv")
    task = gm.TaxiEnv.generate_tasks(1, 3)[0]
    assert task.config["gym_id"] == gm.installed_id("Taxi")
    obs = env.reset(task)
    assert "+---------+" in obs and "The passenger is at" in obs and "\x1b" not in obs
    r = env.step(gm.act_text("DROPOFF"))  # no passenger aboard: gym's -10, not the end
    assert not r.done and r.reward_parts["env_return"] == -10.0
    result = run_expert(env, task)
    assert result.reward_parts["reward"] == 1.0 and "The game is over" in result.observation


def test_answer_gives_up_and_max_steps_truncate(gm: ModuleType) -> None:
    env = make_env(f"{GYM}:FrozenLakeEnv")
    r = episode(env, lake_task(gm), ["<answer>done</answer>"])[-1]
    assert (r.observation, r.done, r.reward_parts["reward"]) == ("", True, 0.0)
    results = episode(env, lake_task(gm, max_steps=3), [gm.act_text("LEFT")] * 5)
    assert len(results) == 3 and results[-1].done
    assert results[-1].reward_parts["truncated"] == 1.0
    assert results[-1].reward_parts["reward"] == 0.0


@pytest.mark.parametrize("name", GAME_CLASSES)
def test_gym_malformed_actions_get_error_observations(gm: ModuleType, name: str) -> None:
    env = make_env(f"{GYM}:{name}")
    task = getattr(gm, name).generate_tasks(1, 5, max_steps=len(MALFORMED) + 1)[0]
    env.reset(task)
    for i, text in enumerate(MALFORMED, 1):
        r = env.step(text)
        assert r.observation.startswith("<tool_response>error: ") and not r.done, text
        assert r.reward_parts["tool_errors"] == i and r.reward_parts["env_steps"] == 0
        assert "\x1b" not in r.observation and "\x00" not in r.observation
    # an action of another game: refused against the task's own game
    other = "HIT" if task.config["game"] != "Blackjack" else "UP"
    r = env.step(gm.act_text(other))
    assert "must be one of" in r.observation and r.done  # the last step: truncated
    assert r.reward_parts["truncated"] == 1.0


def _random_action(rng: random.Random, actions: Sequence[str], gm: ModuleType) -> str:
    roll = rng.random()
    if roll < 0.08:
        return rng.choice(MALFORMED[:5])
    if roll < 0.1:
        return "<answer>stop</answer>"
    return gm.act_text(rng.choice(actions))


def _check_prefix_agreement(gm: ModuleType, specs: Sequence[str], tasks: Sequence[Task],
                            n_prefixes: int, seed: int) -> int:
    """For random prefixes (random actions, some malformed, some reseeds): every spec's
    live continuation, and its continuation after restoring the prefix's snapshot into a
    fresh instance, are byte-identical, across specs too. Returns the suffix steps
    compared."""
    rng = random.Random(seed)
    compared = 0
    for k in range(n_prefixes):
        task = tasks[k % len(tasks)]
        actions = gm.GAMES[task.config["game"]].actions
        prefix = [_random_action(rng, actions, gm) for _ in range(rng.randint(0, 6))]
        reseed_at = rng.randint(0, len(prefix)) if rng.random() < 0.5 else -1
        suffix = [_random_action(rng, actions, gm) for _ in range(6)]
        key = rng.randrange(2**40)
        outcomes: list[list[tuple[Any, ...]]] = []
        for spec in specs:
            live = make_env(spec)
            live.reset(task)
            for i, a in enumerate(prefix):
                if i == reseed_at:
                    live.reseed(key)  # type: ignore[attr-defined]
                if live.step(a).done:  # the suffix then checks "episode is over"
                    break
            snap = live.snapshot()
            for run in ("live", "restored", "restored-again"):
                env = live if run == "live" else make_env(spec)
                if run != "live":
                    env.restore(snap)
                    if isinstance(env, gm.ToyTextEnv):
                        assert env.snapshot() == snap  # restore is exact
                got = []
                for a in suffix:
                    r = env.step(a)
                    got.append((r.observation, r.done, sorted(r.reward_parts.items())))
                    if r.done:
                        break
                outcomes.append(got)
        if outcomes:
            assert all(o == outcomes[0] for o in outcomes), (task.task_id, prefix)
            compared += len(outcomes[0])
    return compared


def test_native_and_replay_restores_agree_on_random_prefixes(gm: ModuleType) -> None:
    lakes = [lake_task(gm, slippery=s, seed=i) for i, s in enumerate([False, True, True])]
    taxis = [*gm.TaxiEnv.generate_tasks(2, 1), *gm.TaxiEnv.generate_tasks(1, 2, rainy=True),
             *gm.TaxiEnv.generate_tasks(1, 3, fickle=True)]
    cliffs = gm.CliffWalkingEnv.generate_tasks(2, 4, slippery=[False, True])
    replay = f"{GYM}:GymTextEnv"
    assert _check_prefix_agreement(gm, [f"{GYM}:FrozenLakeEnv", f"{GYM}:ToyTextEnv",
                                        replay], lakes, 30, 0) > 40
    assert _check_prefix_agreement(gm, [f"{GYM}:TaxiEnv", replay], taxis, 8, 1) > 20
    assert _check_prefix_agreement(gm, [f"{GYM}:CliffWalkingEnv", replay], cliffs, 8, 2) > 20
    blackjack = gm.BlackjackEnv.generate_tasks(4, 3)  # replay only
    assert _check_prefix_agreement(gm, [f"{GYM}:BlackjackEnv", replay], blackjack, 8, 3) > 4


def test_gym_time_limit_survives_a_native_restore(gm: ModuleType) -> None:
    # FrozenLake-v1's TimeLimit is 100 moves; a task allowing more meets it mid-episode
    task = lake_task(gm, max_steps=150)
    bump = gm.act_text("LEFT")  # into the west wall: the agent stays on S
    env = make_env(f"{GYM}:FrozenLakeEnv")
    episode(env, task, [bump] * 98)
    snap = env.snapshot()
    live = [env.step(bump) for _ in range(2)]
    assert [r.done for r in live] == [False, True] and "time limit" in live[1].observation
    assert live[1].reward_parts["truncated"] == 1.0 and live[1].reward_parts["env_steps"] == 100
    fresh = make_env(f"{GYM}:FrozenLakeEnv")
    fresh.restore(snap)
    assert [fresh.step(bump) for _ in range(2)] == live


def test_reseed_draws_a_new_stream_from_the_key_alone(gm: ModuleType) -> None:
    task = lake_task(gm, slippery=True, seed=7, max_steps=40)
    moves = [gm.act_text(a) for a in ["RIGHT", "DOWN"] * 20]

    def run(spec: str, key: int) -> list[str]:
        env = make_env(spec)
        env.reset(task)
        env.reseed(key)  # type: ignore[attr-defined]
        out = []
        for a in moves:
            r = env.step(a)
            out.append(r.observation)
            if r.done:
                break
        return out

    native, replay = f"{GYM}:FrozenLakeEnv", f"{GYM}:GymTextEnv"
    runs = {key: run(native, key) for key in range(6)}
    assert len({tuple(v) for v in runs.values()}) > 1  # keys give different slides
    for key in (0, 3):
        assert run(native, key) == runs[key] == run(replay, key)


def test_gym_restore_rejects_what_is_not_a_snapshot(gm: ModuleType) -> None:
    env = make_env(f"{GYM}:FrozenLakeEnv")
    env.reset(lake_task(gm))
    good = json.loads(env.snapshot())
    bad_state = {**good, "game": {**good["game"], "s": 999}}
    bad_rng = {**good, "game": {**good["game"], "rng": {"bit_generator": "MT19937"}}}
    for blob in (b"", b"{}", b"\xff", json.dumps(bad_state).encode(),
                 json.dumps(bad_rng).encode(), json.dumps({**good, "steps": "x"}).encode()):
        with pytest.raises(ValueError, match="not a gym-frozenlake snapshot"):
            env.restore(blob)


def test_gym_experts_solve_deterministic_tasks(gm: ModuleType) -> None:
    cases = [(gm.FrozenLakeEnv, gm.FrozenLakeEnv.generate_tasks(6, 0, size=[4, 6])),
             (gm.TaxiEnv, gm.TaxiEnv.generate_tasks(6, 0)),
             (gm.CliffWalkingEnv, gm.CliffWalkingEnv.generate_tasks(1, 0))]
    for cls, tasks in cases:
        for spec in (f"{GYM}:{cls.__name__}", f"{GYM}:GymTextEnv"):
            env = make_env(spec)
            for task in tasks:
                assert run_expert(env, task).reward_parts["reward"] == 1.0, (spec, task)
    # slippery: the best-odds policy, well above chance on the fixed 4x4 map
    slippery = gm.FrozenLakeEnv.generate_tasks(30, 1, slippery=True, random_map=False)
    env = make_env(f"{GYM}:FrozenLakeEnv")
    wins = sum(run_expert(env, t).reward_parts["reward"] for t in slippery)
    assert wins >= 10  # the optimum of this map is about 0.74 within gym's limit


def test_blackjack_expert_plays_the_basic_strategy(gm: ModuleType) -> None:
    """Blackjack has no transition table: its expert is the textbook basic strategy (stand
    on soft 17 dealer, hit/stick only), checked cell by cell on known entries and on play."""
    basic = gm.blackjack_basic_strategy
    hit, stick = 1, 0
    for total, dealer, ace, want in [(11, 10, 0, hit), (12, 2, 0, hit), (12, 4, 0, stick),
                                     (12, 7, 0, hit), (13, 2, 0, stick), (16, 6, 0, stick),
                                     (16, 7, 0, hit), (16, 1, 0, hit), (17, 1, 0, stick),
                                     (17, 6, 1, hit), (18, 8, 1, stick), (18, 9, 1, hit),
                                     (18, 1, 1, stick), (18, 10, 1, hit), (19, 10, 1, stick),
                                     (21, 1, 0, stick)]:
        assert basic((total, dealer, ace)) == want, (total, dealer, ace)
    tasks = gm.BlackjackEnv.generate_tasks(400, 5)
    outcomes = [run_expert(make_env("gym-blackjack"), t).reward_parts["reward"]
                for t in tasks]
    wins = sum(r == 1.0 for r in outcomes) / len(tasks)
    # basic strategy wins about 43% of hands; always sticking about 38%, hitting to 17
    # about 41%: the bound tells a working expert from a broken one, not those apart
    assert 0.36 <= wins <= 0.52, wins
    assert all(r in (0.0, 0.5, 1.0) for r in outcomes)


def test_gym_tasks_are_seeded_prefix_stable_and_rebuild_from_config(gm: ModuleType) -> None:
    tasks = gm.GymTextEnv.generate_tasks(20, 9)
    assert tasks == gm.GymTextEnv.generate_tasks(20, 9)
    assert tasks[:5] == gm.GymTextEnv.generate_tasks(5, 9)
    assert tasks != gm.GymTextEnv.generate_tasks(20, 10)
    assert {t.config["game"] for t in tasks} == set(gm.GymTextEnv.PLAYS)
    for t in tasks:
        assert json.loads(json.dumps(t.config)) == t.config
        assert set(t.config) == {"game", "gym_id", "kwargs", "seed"}
    lake = gm.FrozenLakeEnv.generate_tasks(4, 0, size=8, slippery=True)
    assert all(len(t.config["kwargs"]["desc"]) == 8 and t.config["kwargs"]["is_slippery"]
               for t in lake)
    with pytest.raises(ValueError, match="unknown"):
        gm.FrozenLakeEnv.generate_tasks(1, 0, colour="blue")
    with pytest.raises(ValueError, match="plays"):
        gm.FrozenLakeEnv.generate_tasks(1, 0, games=["Taxi"])
    with pytest.raises(ValueError, match="plays"):
        make_env(f"{GYM}:FrozenLakeEnv").reset(gm.TaxiEnv.generate_tasks(1, 0)[0])
    with pytest.raises(ValueError, match="Taxi-v3"):
        gm.game_of("Taxi-v3")  # deprecated in gymnasium 1.x: refused with gym's reason


# ---------------------------------------------------------------------------
# reasoning-gym


def test_reasoning_gym_reset_calc_and_the_dataset_grader(rgm: ModuleType) -> None:
    import reasoning_gym

    check_tool_schemas(rgm.ReasoningGymEnv.tool_schemas(), "reasoning-gym")
    tasks = rgm.ReasoningGymEnv.generate_tasks(12, 0)
    assert {t.config["dataset"] for t in tasks} == set(rgm.DEFAULT_DATASETS)
    env = make_env(f"{RG}:ReasoningGymEnv")
    for task in tasks:
        c = task.config
        ds = reasoning_gym.create_dataset(c["dataset"], seed=c["seed"], size=c["size"])
        entry = ds[c["index"]]
        assert env.reset(task) == task.prompt and task.prompt.startswith(
            str(entry["question"]).strip())
        assert task.answer == entry["answer"]
        expr = entry["metadata"].get("expression")
        if expr is not None:  # our exact calculator agrees with the data set's answer
            r = env.step(f'<tool_call>{json.dumps({"name": "calc", "arguments": {"expr": expr}})}'
                         "</tool_call>")
            assert r.observation == f"<tool_response>{entry['answer']}</tool_response>"
        wrong = str(int(entry["answer"]) + 1)
        r = env.step(f"<answer>{wrong}</answer>")
        assert r.done and r.reward_parts["reward"] == ds.score_answer(wrong, entry) < 1
        env.reset(task)
        r = env.step(f"<answer>{entry['answer']}</answer>")
        assert r.reward_parts["reward"] == ds.score_answer(entry["answer"], entry) == 1.0
    # the grader's partial credit passes through: gold "-4" inside "x-4" scores 2/3
    chain = rgm.ReasoningGymEnv.generate_tasks(30, 1, datasets=["chain_sum"])
    task = next(t for t in chain if t.answer and len(t.answer) == 2)
    env.reset(task)
    assert env.step(f"<answer>x{task.answer}</answer>").reward_parts["reward"] == (
        pytest.approx(2 / 3))


def test_reasoning_gym_malformed_actions_and_truncation(rgm: ModuleType) -> None:
    env = make_env(f"{RG}:ReasoningGymEnv")
    task = rgm.ReasoningGymEnv.generate_tasks(1, 0, max_steps=len(MALFORMED) + 1)[0]
    env.reset(task)
    bad = [*MALFORMED, '<tool_call>{"name": "calc", "arguments": {"expr": "__import__(1)"}}'
           "</tool_call>"]
    results = [env.step(a) for a in bad]
    assert all(r.observation.startswith("<tool_response>error: ") for r in results)
    assert [r.done for r in results] == [False] * len(MALFORMED) + [True]
    assert results[-1].reward_parts == {"reward": 0.0, "tool_calls": 6.0,
                                        "tool_errors": float(len(bad)), "truncated": 1.0}
    env.reset(task)
    long = env.step("<answer>" + task.answer * 1000 + "</answer>")  # over MAX_ANSWER_CHARS
    assert long.done and long.reward_parts["reward"] == 0.0


def test_reasoning_gym_snapshots_restore_exactly(rgm: ModuleType) -> None:
    tasks = rgm.ReasoningGymEnv.generate_tasks(4, 2)
    rng = random.Random(0)
    steps = ['<tool_call>{"name": "calc", "arguments": {"expr": "12*7"}}</tool_call>',
             '<tool_call>{"name": "calc", "arguments": {"expr": "1/0"}}</tool_call>',
             "no action", "<answer>84</answer>"]
    spec = f"{RG}:ReasoningGymEnv"
    compared = 0
    for k in range(10):
        task = tasks[k % len(tasks)]
        live = make_env(spec)
        live.reset(task)
        prefix = [rng.choice(steps[:3]) for _ in range(rng.randint(0, 2))]
        for a in prefix:
            live.step(a)
        snap = live.snapshot()
        a = rng.choice([*steps, live.expert_action()])
        want = live.step(a)
        for _ in range(2):
            fresh = make_env(spec)
            fresh.restore(snap)
            assert fresh.snapshot() == snap
            assert fresh.step(a) == want
            compared += 1
    assert compared == 20
    with pytest.raises(ValueError, match="not a reasoning-gym snapshot"):
        make_env(spec).restore(b'{"format": "calc/1"}')


def test_reasoning_gym_expert_and_task_rebuild(rgm: ModuleType) -> None:
    tasks = rgm.ReasoningGymEnv.generate_tasks(10, 3)
    assert tasks[:4] == rgm.ReasoningGymEnv.generate_tasks(4, 3)
    # reasoning-gym seeds entry i with seed + i: our tasks of seeds 3 and 4 must not share
    other = {t.prompt for t in rgm.ReasoningGymEnv.generate_tasks(10, 4)}
    assert not other & {t.prompt for t in tasks}
    env = make_env(f"{RG}:ReasoningGymEnv")
    for task in tasks:
        assert run_expert(env, task).reward_parts["reward"] == 1.0
    with pytest.raises(ValueError, match="reasoning-gym data sets"):
        rgm.ReasoningGymEnv.generate_tasks(1, 0, datasets=["no_such_set"])


# ---------------------------------------------------------------------------
# end to end: BEL trees collected into a store, then credit


class RandomActPolicy:
    """A transcript-only policy that calls ``act`` with a uniformly drawn action of the
    game named in the last ``Legal actions`` line (one token per character)."""

    policy_version = "random-act"
    policy_ref = None

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        rng = np.random.default_rng(config.seed)
        out = []
        for tr in transcripts:
            legal = [line for t in tr for line in t[1].splitlines()
                     if line.startswith("Legal actions: ")][-1]
            names = legal.removeprefix("Legal actions: ").removesuffix(
                "</tool_response>").split(", ")
            conts = []
            for _ in range(config.n):
                name = names[int(rng.integers(len(names)))]
                text = ('<tool_call>{"name": "act", "arguments": {"action": "'
                        f'{name}"}}}}</tool_call>')
                lp = -float(np.log(len(names)))
                conts.append(Continuation(text, [ord(c) for c in text],
                                          [lp] + [0.0] * (len(text) - 1),
                                          [-lp] + [0.0] * (len(text) - 1)))
            out.append(conts)
        return out

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        raise NotImplementedError


def test_collect_bel_trees_and_credit(gm: ModuleType, tmp_path: Path) -> None:
    from rollout_store import Store, connect, read_trees
    from train.policies.tiny import random_tiny_policy
    from train.sampling.collect import collect
    from train.scoring import score_and_credit

    store = Store(tmp_path / "store", create=True)
    # the untrained tiny model: mostly malformed actions, the plumbing end to end
    native = f"{GYM}:FrozenLakeEnv"
    lakes = gm.FrozenLakeEnv.generate_tasks(2, 0, max_steps=3)
    report = collect(store, native, random_tiny_policy(seed=0), "bel", lakes, n_total=4,
                     seed=0, run_id="tiny", progress=False)
    assert report.trees == 2
    # random legal moves through the replay strategy: real branching on real boards
    replay = f"{GYM}:GymTextEnv"
    mixed = gm.GymTextEnv.generate_tasks(3, 1, games=["FrozenLake", "Taxi"], max_steps=6)
    report = collect(store, replay, RandomActPolicy(), "bel", mixed, n_total=6, seed=0,
                     run_id="random", progress=False)
    assert report.trees == 3
    trees = {t.task_id: t for t in read_trees(store)}
    assert len(trees) == 5
    for task in [*lakes, *mixed]:
        tree = trees[task.task_id]
        assert tree.env == (native if task in lakes else replay)
        assert tree.root().observation_text.startswith(task.prompt)
        tree.validate()
    rows = connect(store).sql("SELECT DISTINCT env FROM trees ORDER BY env").fetchall()
    assert rows == [(native,), (replay,)]
    # the stored snapshots restore through each spec: the replay ones name their strategy
    for task in mixed:
        tree = trees[task.task_id]
        snap = next(iter(tree.snapshots.values()))
        assert json.loads(snap)["strategy"] == "replay"
        make_env(replay).restore(snap)
    for task in lakes:
        snap = next(iter(trees[task.task_id].snapshots.values()))
        assert json.loads(snap)["format"] == gm.SNAPSHOT_FORMAT
        make_env(native).restore(snap)
    moves = [n for t in mixed for n in trees[t.task_id].nodes
             if n.action_text and "Legal actions" in (n.observation_text or "")]
    assert moves, "random legal moves should reach real boards"
    credit = score_and_credit(store, "tree_grpo", progress=False)
    assert credit.trees_done == 5 and credit.rows > 0
    n_credit = connect(store).sql("SELECT count(DISTINCT tree_id) FROM credits").fetchall()
    assert n_credit == [(5,)]
