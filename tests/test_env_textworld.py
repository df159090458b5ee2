"""The TextWorld adapter (``train.envs.adapters.textworld_env``, issue 44 item 5): a world
whose state cannot be serialised, branched by fork (replay as its fallback), against the
real textworld package (extra ``textworld``; every test skips without it). No mocks:
games made by TextWorld's own generator, compiled and played on its Z-machine.

Games are compiled once per module into a temporary cache (``RTREES_TEXTWORLD_GAMES``),
which the fork workers and the CLI's processes inherit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from train.envs import Task, make_env

TW = "train.envs.adapters.textworld_env"
SPEC = f"{TW}:TextWorldEnv"


@pytest.fixture(scope="module")
def games(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("tw-games")
    old = os.environ.get("RTREES_TEXTWORLD_GAMES")
    os.environ["RTREES_TEXTWORLD_GAMES"] = str(root)
    yield root
    if old is None:
        os.environ.pop("RTREES_TEXTWORLD_GAMES", None)
    else:
        os.environ["RTREES_TEXTWORLD_GAMES"] = old


@pytest.fixture(scope="module")
def tw(games: Path) -> ModuleType:
    pytest.importorskip("textworld")
    import train.envs.adapters.textworld_env as module

    return module


@pytest.fixture(scope="module")
def tasks(tw: ModuleType) -> list[Task]:
    return list(tw.TextWorldEnv.generate_tasks(2, 0))


def test_tasks_are_seeded_prefix_stable_and_carry_the_game_digest(
        tw: ModuleType, tasks: list[Task]) -> None:
    again = tw.TextWorldEnv.generate_tasks(1, 0)
    assert again[0] == tasks[0]  # a prefix, the same game
    other = tw.TextWorldEnv.generate_tasks(1, 1)
    assert other[0].config["game_sha256"] != tasks[0].config["game_sha256"]
    for task in tasks:
        assert task.max_steps == 4 * 2 + 4 and task.task_id.startswith("tw-0-")
        assert set(task.config) == {"game_seed", "rooms", "objects", "quest_length",
                                    "game_sha256"}
    with pytest.raises(ValueError, match="unknown textworld task option"):
        tw.TextWorldEnv.generate_tasks(1, 0, nb_rooms=3)
    with pytest.raises(ValueError, match=r"rooms 1\.\.20"):
        tw.TextWorldEnv.generate_tasks(1, 0, rooms=0)


def test_a_game_that_does_not_regenerate_is_refused(tw: ModuleType, tasks: list[Task],
                                                    tmp_path: Path) -> None:
    forged = dict(tasks[0].config, game_seed=tasks[0].config["game_seed"] + 1)
    task = Task("forged", "textworld", "p", None, 4, forged)
    os.environ["RTREES_TEXTWORLD_GAMES"], old = str(tmp_path), os.environ[
        "RTREES_TEXTWORLD_GAMES"]
    try:  # not in the cache: regenerated from its seed, and the digest differs
        with pytest.raises(ValueError, match="generates another game from seed"):
            tw.game_file(task)
    finally:
        os.environ["RTREES_TEXTWORLD_GAMES"] = old
    assert not any(p.suffix == ".z8" for p in tmp_path.rglob("*"))


def test_expert_wins_every_game_and_the_reward_is_set_at_the_end(
        tw: ModuleType, tasks: list[Task]) -> None:
    env = tw.TextWorldEnv()  # in this process: the raw class, no strategy
    try:
        for task in tasks:
            first = env.reset(task)
            assert first.startswith(task.prompt + "\n\n")
            assert "Commands you can try: " in first and "\x1b" not in first
            for _ in range(task.max_steps):
                result = env.step(env.expert_action())
                if result.done:
                    break
                assert result.reward_parts["reward"] == 0.0
                assert "Commands you can try: " in result.observation
            assert result.done and result.reward_parts["reward"] == 1.0
            assert result.reward_parts["score"] == result.reward_parts["max_score"] >= 1
            assert "You won; reward 1." in result.observation
            assert "RESTART" not in result.observation  # the interpreter's menu is cut
            with pytest.raises(RuntimeError, match="episode is over"):
                env.expert_action()
    finally:
        env.close()


@pytest.mark.parametrize("action", [
    "I will look around.",                                               # no block
    '<tool_call>{"name": "go", "arguments": {"command": "look"}}</tool_call>',
    '<tool_call>{"name": "act", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "act", "arguments": {"command": 3}}</tool_call>',
    '<tool_call>{"name": "act", "arguments": {"command": "   "}}</tool_call>',
    '<tool_call>{"name": "act", "arguments": {"command": "save"}}</tool_call>',
    '<tool_call>{"name": "act", "arguments": {"command": "RESTART now"}}</tool_call>',
    '<tool_call>{"name": "act", "arguments": {"command": "look\\u0000"}}</tool_call>',
    '<tool_call>{"name": "act", "arguments": {"command": "' + "x" * 101 + '"}}</tool_call>',
])
def test_malformed_and_meta_commands_are_errors_not_moves(
        tw: ModuleType, tasks: list[Task], action: str) -> None:
    env = tw.TextWorldEnv()
    try:
        env.reset(tasks[0])
        result = env.step(action)
        assert result.observation.startswith("<tool_response>error: ")
        assert not result.done and result.reward_parts["tool_errors"] == 1.0
        # the game did not move: the expert's plan is as long as at the start
        env2 = tw.TextWorldEnv()
        env2.reset(tasks[0])
        assert env.expert_action() == env2.expert_action()
        env2.close()
    finally:
        env.close()


def test_giving_up_and_running_out_of_steps_score_zero(tw: ModuleType,
                                                       tasks: list[Task]) -> None:
    env = tw.TextWorldEnv()
    try:
        env.reset(tasks[0])
        result = env.step("<answer>done</answer>")
        assert result.done and result.reward_parts["reward"] == 0.0
        env.reset(tasks[0])
        look = tw.act_text("look")
        steps = [env.step(look) for _ in range(tasks[0].max_steps)]
        assert [r.done for r in steps] == [False] * (len(steps) - 1) + [True]
        assert steps[-1].reward_parts["truncated"] == 1.0
        assert steps[-1].reward_parts["reward"] == 0.0
    finally:
        env.close()


def test_fork_snapshots_branch_and_fall_back_to_replay(tw: ModuleType,
                                                       tasks: list[Task]) -> None:
    """A snapshot mid-game restores to the same state through the frozen fork (same
    instance) and through replay (a fresh instance, as a later run would)."""
    from train.envs.fork import ForkEnv

    task = tasks[0]
    env = make_env(SPEC)
    fresh = make_env(SPEC)
    try:
        assert isinstance(env, ForkEnv) and isinstance(fresh, ForkEnv)
        env.reset(task)
        env.step(tw.act_text("look"))
        snap = env.snapshot()
        doc = json.loads(snap)
        assert doc["strategy"] == "fork" and doc["replay"]["strategy"] == "replay"
        ends = []
        for _ in range(2):  # the same state twice: the expert's line to the win
            env.restore(snap)
            path = []
            for _ in range(task.max_steps):
                result = env.step(env.expert_action())
                path.append(result)
                if result.done:
                    break
            ends.append(path)
        assert ends[0] == ends[1] and ends[0][-1].reward_parts["reward"] == 1.0
        assert env.stats.fork_restores >= 1
        fresh.restore(snap)  # not in this instance's pool: replayed
        assert fresh.stats.replay_restores == 1
        replayed = [fresh.step(fresh.expert_action()) for _ in ends[0]]
        assert replayed == ends[0]
        # a diverging branch: a detour, then the expert recovers (the plan is recomputed)
        env.restore(snap)
        detour = env.step(tw.act_text("inventory"))
        assert "Commands you can try" in detour.observation and not detour.done
    finally:
        env.close()
        fresh.close()


@pytest.mark.slow  # about 25 s: random episodes and prefixes through three strategies
def test_env_check_passes_with_fork_and_replay(tw: ModuleType) -> None:
    from train.envs.check import check_env

    report = check_env(SPEC, prefixes=3, tasks=2)
    status = {r.name: r.status for r in report.checks}
    assert report.passed, [r for r in report.checks if r.status == "FAIL"]
    assert status["fork"] == "ok" and status["replay"] == "ok"
    assert status["native"] == "skip" and status["expert"] == "ok"


def test_the_entry_point_names_the_adapter() -> None:
    """``--env textworld`` once the package is installed (pyproject.toml declares it)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    doc = tomllib.loads((root / "pyproject.toml").read_text())
    assert doc["project"]["entry-points"]["rollout_trees.envs"]["textworld"] == SPEC
    assert any(d.startswith("textworld") for d in
               doc["project"]["optional-dependencies"]["textworld"])


TEXTWORLD_BLOCK = re.compile(r"^```bash textworld\n(.*?)^```", re.S | re.M)


@pytest.mark.slow
def test_the_documented_textworld_commands_run(tw: ModuleType, tmp_path: Path) -> None:
    """The guide's ``bash textworld`` block (``rtrees env check``, ``collect``, ``credit``,
    ``audit ranking``, ``train`` on ``--env textworld``) runs as written, in one bash
    script with this interpreter's ``bin`` first on ``PATH``; then what it made is
    checked. Skips where the ``textworld`` entry point is not installed (the package was
    installed before this checkout declared it). The calc policy does not know the game,
    so its rewards are 0 and the audit has no pair to rank: this tests the plumbing."""
    from importlib.metadata import entry_points

    from rollout_store import Store, connect, read_trees

    if "textworld" not in {e.name for e in entry_points(group="rollout_trees.envs")}:
        pytest.skip("the textworld entry point is not installed (pip install -e .)")
    root = Path(__file__).resolve().parents[1]
    blocks = [b for doc in sorted((root / "docs").rglob("*.md"))
              for b in TEXTWORLD_BLOCK.findall(doc.read_text())]
    assert len(blocks) == 1
    script = tmp_path / "guide.sh"
    script.write_text("set -euo pipefail\n" + blocks[0])
    env = dict(os.environ, PATH=str(Path(sys.executable).parent) + os.pathsep
               + os.environ.get("PATH", ""), PYTHONPATH=str(root))
    run = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ok    fork:" in run.stdout and "ok    replay:" in run.stdout
    trees = read_trees(Store(tmp_path / "tw"))
    collected = [t for t in trees if not t.run_id.startswith("train-")]
    assert len(collected) == 2 and {t.env for t in trees} == {"textworld"}
    for tree in collected:  # fork snapshots, with their replay record, are stored
        snap = json.loads(next(iter(tree.snapshots.values())))
        assert snap["strategy"] == "fork" and isinstance(snap["replay"]["log"], list)
    n_credit = connect(Store(tmp_path / "tw")).sql(
        "SELECT count(DISTINCT tree_id) FROM credits").fetchall()[0][0]
    assert n_credit >= 2
    audit = json.loads((tmp_path / "tw-audit" / "results.json").read_text())
    assert audit["coverage"]["n_trees"] == 2
    assert "held-out success" in run.stdout
    assert (tmp_path / "tw-train" / "config.json").is_file()
