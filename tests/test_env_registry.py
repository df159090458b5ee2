"""Environments from outside the package (issue 44): the one resolver of env specs
(built-in, ``register_env``, entry points, ``module:Class``), tool schemas from the
environment, ``function_tool_env``, replay snapshots and their divergence check, and a
tree whose environment fails left out of a collection while the others commit."""

from __future__ import annotations

import json
import random
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from rollout_store import Store, read_trees
from train.envs import (
    Environment,
    EnvSpecError,
    StepResult,
    Task,
    env_class,
    env_names,
    make_env,
    register_env,
    spec_of,
    unregister_env,
)
from train.envs.calc import CalcEnv
from train.envs.strategies import ReplayDivergenceError, ReplayEnv, with_snapshots
from train.envs.tools import (
    ToolSchemaError,
    check_tool_schemas,
    function_tool_env,
    read_task_file,
    tool,
)
from train.policies import env_tools


def upper(text: str) -> str:
    """Upper-case a string."""
    return text.upper()


def repeat(text: str, times: int = 2) -> str:
    """Repeat a string."""
    return text * times


def exact(answer: str, task: Task) -> float:
    return float(answer == task.answer)


TASKS = [{"prompt": f"Upper-case {w}.", "answer": w.upper()} for w in ("ab", "cd", "ef")]
StrTools = function_tool_env("strtools-test", tools=[upper, repeat], tasks=TASKS, reward=exact)


class Clocked(Environment):
    """Not deterministic under replay: the observation counts every step ever taken by
    any instance (a global counter, like a clock)."""

    name = "clocked"
    snapshot_strategy = "replay"
    ticks = 0

    def reset(self, task: Task) -> str:
        return task.prompt

    def step(self, action_text: str) -> StepResult:
        Clocked.ticks += 1
        return StepResult(f"<tool_response>{Clocked.ticks}</tool_response>", False,
                          {"reward": 0.0})

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        return [Task(f"c{i}", "clocked", "tick") for i in range(n)]


def call(name: str, **arguments: Any) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


# ----- the resolver -----------------------------------------------------------------------


def test_builtin_names_and_paths_resolve_to_the_same_class() -> None:
    assert env_class("calc") is CalcEnv
    assert env_class("train.envs.calc:CalcEnv") is CalcEnv
    assert {"calc", "python", "workflow", "sgls"} <= set(env_names())
    env = make_env("train.envs.calc:CalcEnv")
    assert isinstance(env, CalcEnv) and spec_of(env) == "train.envs.calc:CalcEnv"
    assert spec_of(make_env("calc")) == "calc"


@pytest.mark.parametrize(("spec", "message"), [
    ("nosuch", "unknown environment 'nosuch'; choose from"),
    ("nosuch_mod_xyz:Env", "module 'nosuch_mod_xyz' does not import (ModuleNotFoundError"),
    ("train.envs.calc:Nope", "has no 'Nope'"),
    ("os:path", "is not an Environment subclass"),
    ("json:JSONDecoder", "is not an Environment subclass"),
    ("a b:C", "a name or 'module:Class'"),
    ("os:system; rm -rf /", "a name or 'module:Class'"),
    ("", "a name or 'module:Class'"),
])
def test_a_bad_spec_is_one_line(spec: str, message: str) -> None:
    with pytest.raises(EnvSpecError) as info:
        env_class(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_register_env_by_class_and_by_path() -> None:
    try:
        register_env("strtools-t", StrTools)
        assert env_class("strtools-t") is StrTools
        assert "strtools-t" in env_names()
        with pytest.raises(EnvSpecError, match="already registered"):
            register_env("strtools-t", "train.envs.calc:CalcEnv")
        register_env("strtools-t", "train.envs.calc:CalcEnv", replace=True)
        assert env_class("strtools-t") is CalcEnv
        with pytest.raises(EnvSpecError, match="built in"):
            register_env("calc", StrTools)
        with pytest.raises(EnvSpecError, match="not an Environment subclass"):
            register_env("bad-t", dict)  # type: ignore[arg-type]
        with pytest.raises(EnvSpecError, match="letters, digits"):
            register_env("no:colons", StrTools)
    finally:
        unregister_env("strtools-t")
    with pytest.raises(EnvSpecError, match="unknown environment"):
        env_class("strtools-t")


def test_an_entry_point_of_an_installed_package_resolves(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A dist-info on sys.path with a ``rollout_trees.envs`` entry point: the layout pip
    installs (the end-to-end test installs a real package with pip)."""
    pkg = tmp_path / "ep_env_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from train.envs.calc import CalcEnv as Mine\n")
    info = tmp_path / "ep_env_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-env-pkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rollout_trees.envs]\nmine = ep_env_pkg:Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from train.envs import registry

    registry._entry_points.cache_clear()
    registry.resolve_env.cache_clear()
    try:
        assert env_class("mine") is CalcEnv and "mine" in env_names()
    finally:
        monkeypatch.undo()
        registry._entry_points.cache_clear()
        registry.resolve_env.cache_clear()
    assert "mine" not in env_names()


# ----- tools ------------------------------------------------------------------------------


def test_tools_come_from_the_environment() -> None:
    calc = env_tools("calc")
    assert calc is not None and calc[0]["function"]["name"] == "calc"
    assert [t["function"]["name"] for t in env_tools("workflow") or []] == [
        "fast", "careful", "repair", "skip"]
    register_env("strtools-t2", StrTools)
    try:
        schemas = env_tools("strtools-t2")
    finally:
        unregister_env("strtools-t2")
    assert schemas is not None
    by_name = {s["function"]["name"]: s["function"] for s in schemas}
    assert by_name["upper"]["description"] == "Upper-case a string."
    assert by_name["repeat"]["parameters"] == {
        "type": "object", "properties": {"text": {"type": "string"},
                                         "times": {"type": "integer"}},
        "required": ["text"], "additionalProperties": False}


@pytest.mark.parametrize(("schemas", "message"), [
    ({"type": "function"}, "must return a list"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "object",
                                                                     "properties": 3}}}],
     "not valid JSON Schema at properties"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}],
     "must be a JSON Schema object"),
    ([{"type": "function", "function": {"name": ""}}], "non-empty string name"),
    ([{"type": "function", "function": {"name": "x"}}] * 2, "appears twice"),
    ([{"name": "x"}], 'expected {"type": "function"'),
])
def test_a_bad_tool_schema_is_one_line(schemas: Any, message: str) -> None:
    with pytest.raises(ToolSchemaError) as info:
        check_tool_schemas(schemas, "myenv")
    assert message in str(info.value) and str(info.value).startswith("myenv")


def test_a_tool_without_a_json_type_is_refused() -> None:
    def f(x: object) -> str:
        return ""

    with pytest.raises(ToolSchemaError, match="parameter 'x' needs an annotation"):
        tool(f)


# ----- function_tool_env and replay -------------------------------------------------------


def test_function_tool_env_steps_and_rewards() -> None:
    env = make_env_of(StrTools)
    tasks = StrTools.generate_tasks(5, seed=1)
    assert StrTools.generate_tasks(5, seed=1) == tasks and len({t.task_id for t in tasks}) == 5
    task = tasks[0]
    assert env.reset(task) == task.prompt
    r = env.step(call("upper", text="xy"))
    assert r.observation == "<tool_response>XY</tool_response>" and not r.done
    assert "unknown tool" in env.step(call("nope")).observation
    assert "missing required argument 'text'" in env.step(call("repeat")).observation
    assert "expected a tool_call" in env.step("hello").observation
    r = env.step(f"<answer>{task.answer}</answer>")
    assert r.done and r.reward_parts["reward"] == 1.0


def make_env_of(cls: type[Environment]) -> Environment:
    return with_snapshots(cls())


def test_replay_restores_byte_identical_states_for_random_prefixes() -> None:
    rng = random.Random(0)
    actions = [call("upper", text="ab"), call("repeat", text="z", times=3), "junk",
               call("repeat", text="q")]
    task = StrTools.generate_tasks(1, seed=0)[0]
    for _ in range(20):
        env = make_env_of(StrTools)
        assert isinstance(env, ReplayEnv)
        env.reset(task)
        prefix = [rng.choice(actions) for _ in range(rng.randint(0, 5))]
        for a in prefix:
            env.step(a)
        state = env.snapshot()
        assert json.loads(state)["strategy"] == "replay"
        suffix = [rng.choice(actions) for _ in range(3)]
        first = [env.step(a) for a in suffix]
        other = make_env_of(StrTools)  # another instance, as a later job would
        other.restore(state)
        assert [other.step(a) for a in suffix] == first
        env.restore(state)  # back to an ancestor of the live state: reset and replay
        assert [env.step(a) for a in suffix] == first
        assert isinstance(env, ReplayEnv) and env.stats.restores == 1
        assert env.stats.replayed_steps == len(prefix)  # reset, then the prefix again


def test_replay_steps_forward_from_a_live_prefix() -> None:
    env = make_env_of(StrTools)
    assert isinstance(env, ReplayEnv)
    task = StrTools.generate_tasks(1, seed=0)[0]
    env.reset(task)
    env.step(call("upper", text="a"))
    early = env.snapshot()
    env.step(call("upper", text="b"))
    late = env.snapshot()
    env.restore(early)
    env.restore(late)  # the live episode is a prefix of ``late``: one step, no reset
    assert env.stats.forward == 1 and env.stats.replayed_steps == 2


def test_replay_divergence_is_named() -> None:
    env = with_snapshots(Clocked())
    task = Clocked.generate_tasks(1, 0)[0]
    env.reset(task)
    env.step("a")
    env.step("b")
    state = env.snapshot()
    with pytest.raises(ReplayDivergenceError, match="diverged at step 1 of task 'c0'"):
        with_snapshots(Clocked()).restore(state)


@pytest.mark.parametrize("state", [b"", b"{}", b'{"strategy": "replay"}', b"\xff",
                                   b'{"strategy": "replay", "task": {}, "log": []}'])
def test_a_bad_replay_snapshot_is_refused(state: bytes) -> None:
    with pytest.raises(ValueError, match="not a replay snapshot"):
        make_env_of(StrTools).restore(state)


def test_a_task_file_with_a_bad_line_names_it(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "a", "answer": "A"}\n\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match=r"tasks\.jsonl line 3: prompt must be"):
        read_task_file(path, "e")
    path.write_text('{"prompt": "a", "extra": 1}\n')
    with pytest.raises(ValueError, match="line 1: unknown field 'extra'"):
        read_task_file(path, "e")
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "task_id": "x"}\n')
    assert [t.task_id for t in read_task_file(path, "e")] == ["tasks-1", "x"]


def test_a_reward_that_is_not_a_number_fails_the_step() -> None:
    Bad = function_tool_env("bad-reward", tools=[upper], tasks=TASKS,
                            reward=lambda a, t: "yes")  # type: ignore[arg-type,return-value]
    env = Bad()
    env.reset(Bad.generate_tasks(1, 0)[0])
    with pytest.raises(TypeError, match="reward\\(\\) returned 'yes', not a finite number"):
        env.step("<answer>x</answer>")


# ----- a failing tree does not stop the others -------------------------------------------


class FlakyCalc(CalcEnv):
    """Raises on the first step of one task: a bug in a user's environment."""

    def step(self, action_text: str) -> StepResult:
        if self._require().task.task_id == FlakyCalc.bad_task:
            raise RuntimeError("the tool server went away")
        return super().step(action_text)

    bad_task = ""


def test_a_tree_whose_env_raises_is_not_committed_and_the_others_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from train.policies import load_policy
    from train.sampling.chunks import tree_id_for
    from train.sampling.collect import collect

    tasks = CalcEnv.generate_tasks(4, seed=5)
    FlakyCalc.bad_task = tasks[1].task_id
    register_env("flaky-calc", FlakyCalc)
    try:
        store = Store(tmp_path / "s", create=True)
        policy = load_policy("tiny", "calc")
        report = collect(store, "flaky-calc", policy, "group", tasks, 2, 0, "r",
                         commit_trees=4, progress=False)
    finally:
        unregister_env("flaky-calc")
    assert list(report.failed) == [tree_id_for("r", 0, tasks[1].task_id)]
    assert "RuntimeError: the tool server went away" in next(iter(report.failed.values()))
    stored = read_trees(store)
    assert sorted(t.task_id for t in stored) == sorted(t.task_id for i, t in enumerate(tasks)
                                                       if i != 1)
    assert {t.env for t in stored} == {"test_env_registry:FlakyCalc"}  # importable: by path
    assert "1 trees FAILED" in report.summary()


def test_module_paths_in_a_subprocess(tmp_path: Path) -> None:
    """A ``module:Class`` spec resolves in a fresh process (as a spawned worker would)."""
    import subprocess

    (tmp_path / "sub_env_mod.py").write_text(textwrap.dedent("""
        from train.envs.calc import CalcEnv

        class SubEnv(CalcEnv):
            pass
    """))
    code = ("from train.envs import make_env, spec_of; e = make_env('sub_env_mod:SubEnv'); "
            "print(type(e).__name__, spec_of(e))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin"},
                         timeout=120)
    assert out.stdout.strip() == "SubEnv sub_env_mod:SubEnv", out.stderr
