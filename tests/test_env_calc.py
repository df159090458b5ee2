"""The ``calc`` environment: episodes, hostile actions, the safe evaluator, snapshots,
the task generator and the scripted experts."""

from __future__ import annotations

import builtins
import dataclasses
import json
import random
import sys
import time
from fractions import Fraction
from typing import Any

import pytest
from env_properties import (
    HOSTILE_ACTIONS,
    check_never_raises,
    check_snapshot_determinism,
    step_bytes,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from train.envs import make_env
from train.envs.base import Task
from train.envs.calc import (
    MAX_EXPR_CHARS,
    CalcEnv,
    CalcError,
    answer_text,
    call_text,
    evaluate,
    format_number,
    parse_number,
)

TASK = Task(task_id="hand-1", env="calc", prompt="Compute (17*23)+5.", answer="396",
            max_steps=4, config={"expr": "(17*23)+5", "difficulty": 2})


def _env(task: Task = TASK) -> CalcEnv:
    env = CalcEnv()
    assert env.reset(task) == task.prompt
    return env


# -- episodes by hand -----------------------------------------------------------


def test_expert_episode_gets_reward_1() -> None:
    env = _env()
    first = env.expert_action()
    assert first == '<tool_call>{"name": "calc", "arguments": {"expr": "(17*23)+5"}}</tool_call>'
    obs, done, parts = env.step(first)
    assert (obs, done) == ("<tool_response>396</tool_response>", False)
    assert parts == {"reward": 0.0, "tool_calls": 1.0, "tool_errors": 0.0, "truncated": 0.0}
    assert env.expert_action() == "<answer>396</answer>"
    obs, done, parts = env.step(env.expert_action())
    assert (obs, done) == ("", True)
    assert parts == {"reward": 1.0, "tool_calls": 1.0, "tool_errors": 0.0, "truncated": 0.0}


def test_registry_builds_calc() -> None:
    assert isinstance(make_env("calc"), CalcEnv)


def _expert_episode(env: CalcEnv) -> tuple[Any, int]:
    """The scripted expert played to the end: (the last step's result, steps taken)."""
    steps = 0
    while True:
        result = env.step(env.expert_action())
        steps += 1
        if result.done:
            return result, steps


def test_expert_solves_every_difficulty() -> None:
    env = CalcEnv()
    for task in CalcEnv.generate_tasks(60, seed=5, difficulties=(1, 2, 3, 4, 5, 6)):
        env.reset(task)
        result, steps = _expert_episode(env)
        assert result.reward_parts["reward"] == 1.0, task
        assert steps == 2


@pytest.mark.parametrize(("answer", "reward"), [
    ("396", 1.0), (" 396 ", 1.0), ("396.0", 1.0), ("792/2", 1.0), ("+396", 1.0),
    ("395", 0.0), ("-396", 0.0), ("396.5", 0.0), ("three hundred", 0.0), ("", 0.0),
    ("396 apples", 0.0), ("1/0", 0.0), ("9" * 500, 0.0),
])
def test_answers_compare_exactly(answer: str, reward: float) -> None:
    obs, done, parts = _env().step(answer_text(answer))
    assert (obs, done, parts["reward"]) == ("", True, reward)


def test_answer_without_tool_is_graded() -> None:
    _, done, parts = _env().step("I think <answer>396</answer>")
    assert done and parts["reward"] == 1.0 and parts["tool_calls"] == 0.0


def test_step_limit_ends_with_reward_0() -> None:
    env = _env()
    call = call_text("17*23")
    for i in range(1, 4):
        result = env.step(call)
        assert not result.done and result.observation == "<tool_response>391</tool_response>"
        assert result.reward_parts["tool_calls"] == i
    obs, done, parts = env.step(call)  # the 4th step is the last one
    assert (obs, done) == ("<tool_response>391</tool_response>", True)
    assert parts == {"reward": 0.0, "tool_calls": 4.0, "tool_errors": 0.0, "truncated": 1.0}


def test_answer_on_last_step_is_graded() -> None:
    env = _env()
    for _ in range(3):
        env.step("no tags")
    _, done, parts = env.step(answer_text("396"))
    assert done and parts["reward"] == 1.0 and parts["truncated"] == 0.0
    assert parts["tool_errors"] == 3.0


def test_steps_after_done_are_errors_and_change_nothing() -> None:
    env = _env()
    env.step(answer_text("1"))
    snap = env.snapshot()
    for action in [answer_text("396"), call_text("1+1"), "junk"]:
        obs, done, parts = env.step(action)
        assert obs == "<tool_response>error: episode is over</tool_response>"
        assert done and parts["reward"] == 0.0
    assert env.snapshot() == snap
    with pytest.raises(RuntimeError):
        env.expert_action()


def test_step_before_reset_is_a_caller_error() -> None:
    with pytest.raises(RuntimeError):
        CalcEnv().step("x")


# -- hostile actions ---------------------------------------------------------------

_CALL = '<tool_call>{{"name": "calc", "arguments": {args}}}</tool_call>'


@pytest.mark.parametrize(("action", "message"), [
    ("hello", "expected a tool_call block"),
    ("<tool_call>{bad</tool_call>", "not valid JSON"),
    ("<tool_call>" + "[" * 50_000 + "</tool_call>", "nested more than"),
    ('<tool_call>{"name": "rm", "arguments": {"expr": "1"}}</tool_call>', "unknown tool 'rm'"),
    ('<tool_call>{"name": "' + "x" * 1_000_000 + '"}</tool_call>', "unknown tool"),
    (_CALL.format(args="{}"), "missing required argument 'expr'"),
    (_CALL.format(args='{"expression": "1"}'), "missing required argument 'expr'"),
    (_CALL.format(args='{"expr": 17}'), "must be of type string"),
    (_CALL.format(args='{"expr": ["1+1"]}'), "must be of type string"),
    (_CALL.format(args='{"expr": null}'), "must be of type string"),
    (_CALL.format(args='{"expr": "1", "extra": 2}'), "unknown argument 'extra'"),
    (_CALL.format(args='"1+1"'), '"arguments" must be a JSON object'),
    (call_text("10**10**10"), "exponent out of range"),
    (call_text("2**65"), "exponent out of range"),
    (call_text("9**9**9"), "out of range"),
    (call_text("999999999999*999999999"), "result out of range"),
    (call_text("1" + "0" * 19), "result out of range"),
    (call_text("(1/7)**30"), "result out of range"),
    (call_text("1e999"), "number out of range"),
    (call_text("(" * 40 + "1" + ")" * 40), "parentheses nest deeper"),
    (call_text("(" * 500_000 + "1" + ")" * 500_000), "longer than"),
    (call_text("1+" * 500_000 + "1"), "longer than"),
    (call_text("-" * 900 + "1"), "more than 256 parts"),
    (call_text("+".join(["1"] * 300)), "more than 256 parts"),
    (call_text("1/0"), "division by zero"),
    (call_text("1//(2-2)"), "division by zero"),
    (call_text("5%0"), "division by zero"),
    (call_text("0**-1"), "division by zero"),
    (call_text("2**0.5"), "exponent must be an integer"),
    (call_text(""), "empty expression"),
    (call_text("1 +"), "invalid syntax"),
    (call_text("1\x00"), "invalid syntax"),
    (call_text("__import__('os').system('true')"), "function calls are not allowed"),
    (call_text("\ud800"), "invalid syntax"),
])
def test_hostile_action_gives_error_observation(action: str, message: str) -> None:
    env = _env()
    start = time.perf_counter()
    obs, done, parts = env.step(action)
    assert time.perf_counter() - start < 0.5
    assert obs.startswith("<tool_response>error: ") and message in obs, obs
    assert len(obs) < 400
    assert not done and parts["tool_errors"] == 1.0 and parts["reward"] == 0.0
    obs.encode("utf-8")
    assert _env().step(action).observation == obs  # deterministic


def test_generic_hostile_actions_never_raise() -> None:
    results = check_never_raises(CalcEnv(), TASK, HOSTILE_ACTIONS)
    assert all(r.observation.startswith("<tool_response>error: ") for r in results
               if r.observation)


# -- the safe evaluator ---------------------------------------------------------------


@pytest.mark.parametrize(("expr", "value"), [
    ("17*23", 391), ("(17*23)+5", 396), ("2+3*4", 14), ("(2+3)*4", 20), ("-5+2", -3),
    ("--5", 5), ("+5", 5), ("-(2*3)", -6), ("7/2", Fraction(7, 2)), ("12/4", 3),
    ("-7//2", -4), ("-7%3", 2), ("7%-3", -2), ("2**10", 1024), ("2**-2", Fraction(1, 4)),
    ("(-2)**3", -8), ("-2**2", -4), ("0**0", 1), ("0.1+0.2", Fraction(3, 10)),
    ("1.5*2", 3), (" 1 + 1 ", 2), ("1_000+1", 1001), ("0x10", 16), ("10**18", 10**18),
    ("2**59//2**55", 16),
])
def test_evaluator_values(expr: str, value: Fraction | int) -> None:
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", [
    "x", "abs(-1)", "__import__('os')", "__import__('os').system('echo hi')",
    "(1).real", "(1).__class__", "().__class__.__bases__[0].__subclasses__()",
    "lambda: 1", "(lambda x: x)(1)", "'1'", "'1'+'1'", "b'1'", "f'{1}'", "True", "None",
    "...", "1j", "[1]", "(1, 2)", "{1: 2}", "{1}", "1 if 1 else 0", "1 < 2", "1 and 2",
    "not 1", "~1", "1 << 2", "1 & 3", "1 | 2", "1 ^ 3", "[x for x in ()]", "(x := 1)",
    "1; 2", "import os", "a.b", "globals()", "1 @ 2", "1\n2",
])
def test_evaluator_refuses(expr: str) -> None:
    with pytest.raises(CalcError):
        evaluate(expr)


def test_evaluator_refusal_messages() -> None:
    cases = {"x": "names", "abs(1)": "function calls", "(1).real": "attribute access",
             "lambda: 1": "lambdas", "'a'": "strings", "1 < 2": "Compare is not allowed"}
    for expr, message in cases.items():
        with pytest.raises(CalcError, match=message):
            evaluate(expr)


def test_evaluator_never_calls_eval_or_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval or exec called")

    for name in ("eval", "exec"):  # ast.parse itself calls compile(..., PyCF_ONLY_AST)
        monkeypatch.setattr(builtins, name, forbidden)
    assert evaluate("(17*23)+5") == 396
    with pytest.raises(CalcError):
        evaluate("__import__('os')")


def test_evaluator_length_limit_is_exact() -> None:
    assert evaluate("1" + " " * (MAX_EXPR_CHARS - 1)) == 1
    with pytest.raises(CalcError, match="longer than"):
        evaluate("1" * (MAX_EXPR_CHARS + 1))


@pytest.mark.parametrize(("value", "text"), [
    (Fraction(391), "391"), (Fraction(-7), "-7"), (Fraction(0), "0"), (Fraction(7, 2), "3.5"),
    (Fraction(-1, 8), "-0.125"), (Fraction(1, 20), "0.05"), (Fraction(10, 3), "10/3"),
    (Fraction(-1, 6), "-1/6"),
])
def test_format_number_is_exact(value: Fraction, text: str) -> None:
    assert format_number(value) == text
    assert parse_number(text) == value


# -- snapshots ---------------------------------------------------------------------


def _small_expr() -> st.SearchStrategy[str]:
    leaf = st.integers(0, 40).map(str)
    return st.recursive(leaf, lambda inner: st.tuples(
        inner, st.sampled_from(["+", "-", "*", "/", "//", "%", "**"]), inner,
    ).map(lambda t: f"({t[0]}{t[1]}{t[2]})"), max_leaves=4)


_ACTIONS = st.one_of(
    _small_expr().map(call_text),
    st.just("expert"),  # replaced by the expert's action in the state it meets
    st.integers(-50, 1000).map(lambda v: answer_text(str(v))),
    st.text(max_size=30),
    st.sampled_from([
        "<tool_call>{oops</tool_call>", '<tool_call>{"name": "calc"}</tool_call>',
        '<tool_call>{"name": "sh", "arguments": {"cmd": "ls"}}</tool_call>',
        call_text("10**10**10"), call_text("1/0"), call_text("x"), "<answer></answer>",
    ]),
)


def _resolve(task: Task, actions: list[str]) -> list[str]:
    """Replace "expert" markers by the expert's action along the actual trajectory."""
    env = _env(task)
    out = []
    for action in actions:
        if action == "expert":
            action = answer_text("0") if env.snapshot().find(b'"done":true') >= 0 \
                else env.expert_action()
        out.append(action)
        env.step(action)
    return out


TASK_POOL = CalcEnv.generate_tasks(8, seed=11, difficulties=(1, 2, 3))


@settings(max_examples=80, deadline=None)
@given(task_index=st.integers(0, len(TASK_POOL) - 1), max_steps=st.integers(1, 8),
       prefix=st.lists(_ACTIONS, max_size=6), suffix=st.lists(_ACTIONS, max_size=6))
def test_snapshot_restore_is_byte_identical(task_index: int, max_steps: int,
                                            prefix: list[str], suffix: list[str]) -> None:
    task = dataclasses.replace(TASK_POOL[task_index], max_steps=max_steps)
    actions = _resolve(task, prefix + suffix)
    check_snapshot_determinism(CalcEnv, task, actions[:len(prefix)], actions[len(prefix):])


def test_snapshot_is_compact_canonical_json() -> None:
    env = _env()
    env.step(call_text("17*23"))
    snap = env.snapshot()
    data = json.loads(snap)
    assert snap == json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    assert len(snap) < 600
    assert data["steps"] == 1 and data["done"] is False
    assert data["last_observation"] == "<tool_response>391</tool_response>"
    assert data["task"]["task_id"] == "hand-1"


def test_restore_replaces_state_without_replay() -> None:
    env = _env()
    env.step(call_text("(17*23)+5"))
    snap = env.snapshot()
    other = CalcEnv()
    other.reset(CalcEnv.generate_tasks(1, seed=99)[0])
    other.step("junk")
    other.restore(snap)
    assert other.snapshot() == snap
    assert other.expert_action() == env.expert_action() == "<answer>396</answer>"
    assert step_bytes(other.step("<answer>396</answer>")) == step_bytes(
        env.step("<answer>396</answer>"))


@pytest.mark.parametrize("state", [
    b"", b"garbage", b"[]", b'{"format": "calc/2"}', b'{"format": "calc/1"}', b"\xff\xfe",
    b'{"format": "calc/1", "task": {"task_id": "t", "env": "calc", "prompt": "p"}, '
    b'"expected": "1", "steps": "one"}',
])
def test_restore_rejects_bad_snapshots(state: bytes) -> None:
    with pytest.raises(ValueError, match="not a calc snapshot"):
        CalcEnv().restore(state)


# -- task generator ------------------------------------------------------------------


def test_generator_is_deterministic() -> None:
    a = CalcEnv.generate_tasks(50, seed=3)
    assert a == CalcEnv.generate_tasks(50, seed=3)
    assert a[:10] == CalcEnv.generate_tasks(10, seed=3)
    assert a != CalcEnv.generate_tasks(50, seed=4)
    assert len({t.task_id for t in a}) == 50


def test_generated_tasks_are_well_formed() -> None:
    tasks = CalcEnv.generate_tasks(300, seed=1, difficulties=(1, 2, 3, 4, 5, 6))
    for task in tasks:
        expr = task.config["expr"]
        assert task.prompt == f"Compute {expr}."
        assert task.env == "calc" and task.max_steps == 4
        assert sum(expr.count(op) for op in "+-*/") == task.config["difficulty"]
        assert evaluate(expr) == int(task.answer or "x")  # integer answers, exact divisions
        assert abs(int(task.answer or "x")) <= 10_000
    assert {t.config["difficulty"] for t in tasks} == {1, 2, 3, 4, 5, 6}
    assert any("/" in t.config["expr"] for t in tasks)


def test_default_mix_is_one_or_two_operations() -> None:
    tasks = CalcEnv.generate_tasks(200, seed=0)
    counts = [t.config["difficulty"] for t in tasks]
    assert set(counts) == {1, 2}
    assert 60 < counts.count(1) < 140  # uniform over the two


@pytest.mark.parametrize("mix", [
    {"difficulties": (0,)}, {"difficulties": (7,)}, {"difficulties": ()},
    {"difficulties": ("1",)}, {"max_operand": 0}, {"max_steps": 0}, {"level": 1},
])
def test_generator_rejects_bad_options(mix: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CalcEnv.generate_tasks(1, seed=0, **mix)


# -- experts ----------------------------------------------------------------------


def test_expert_answers_when_one_step_is_left() -> None:
    env = _env(dataclasses.replace(TASK, max_steps=1))
    assert env.expert_action() == "<answer>396</answer>"


def test_expert_recovers_after_a_wrong_call() -> None:
    env = _env()
    env.step(call_text("(17*22)+5"))
    assert env.expert_action() == call_text("(17*23)+5")


def test_noisy_expert() -> None:
    env = CalcEnv()
    tasks = CalcEnv.generate_tasks(40, seed=2)

    def rollout(task: Task, rng: random.Random, p_error: float) -> list[str]:
        env.reset(task)
        trace = []
        while True:
            action = env.noisy_expert_action(rng, p_error)
            trace.append(action)
            if env.step(action).done:
                return trace

    clean = [rollout(t, random.Random(0), 0.0) for t in tasks]
    assert all(len(trace) == 2 for trace in clean)
    rng_a, rng_b = random.Random(7), random.Random(7)
    noisy_a = [rollout(t, rng_a, 0.4) for t in tasks]
    noisy_b = [rollout(t, rng_b, 0.4) for t in tasks]
    assert noisy_a == noisy_b
    assert noisy_a != clean
    all_wrong = [rollout(t, random.Random(i), 1.0)[0] for i, t in enumerate(tasks)]
    expert_first = [call_text(t.config["expr"]) for t in tasks]
    assert all(a != e for a, e in zip(all_wrong, expert_first, strict=True))
    kinds = {"answer" if a.startswith("<answer>") else
             "malformed" if '"}}' not in a else "call" for a in all_wrong}
    assert kinds == {"answer", "malformed", "call"}


def test_expressions_parse_in_many_threads_at_once() -> None:
    """The rollout engine runs calc tool calls in a thread pool. CPython 3.11's AST
    constructor keeps its recursion depth in per-interpreter state, so parses in two
    threads, interleaved by a garbage collection that runs a finalizer, raised a spurious
    ``SystemError`` (it ended a 60-iteration training run); evaluation serialises the parse.
    Without the lock this failed in about 2 of 3 rounds here."""
    import gc
    import threading

    from train.envs.calc import evaluate

    class Finalized:
        def __del__(self) -> None:
            sum(range(50))

    def churn() -> None:
        for _ in range(100_000):
            a = Finalized()
            b: list[object] = [a]
            b.append(b)
            del a, b

    errors: list[str] = []

    def work() -> None:
        for i in range(2_000):
            try:
                assert evaluate(f"(({i} + 3) * 7 - 2) / (5 + {i % 7})") == \
                    Fraction((i + 3) * 7 - 2, 5 + i % 7)
            except Exception as exc:  # every kind is a failure of this test
                errors.append(repr(exc))

    interval, thresholds = sys.getswitchinterval(), gc.get_threshold()
    try:
        sys.setswitchinterval(1e-6)
        gc.set_threshold(10, 1, 1)
        for _ in range(3):
            threads = [threading.Thread(target=work) for _ in range(6)]
            threads += [threading.Thread(target=churn) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)
        gc.set_threshold(*thresholds)
    assert errors == []


# ----- the one-operation variant (issue 23: errors irrecoverable mid-trajectory) ---------


def test_one_op_plan_computes_the_expression_one_operation_a_call() -> None:
    from train.envs.calc import count_operations, one_op_plan

    assert one_op_plan("(3+4)*5") == ["3+4", "7*5"]
    assert one_op_plan("(2-7)*(10/4)") == ["2-7", "10/4", "(-5)*2.5"]
    assert one_op_plan("7") == []
    for task in CalcEnv.generate_tasks(40, seed=2, one_op=True):
        plan = one_op_plan(task.config["expr"])
        assert len(plan) == task.config["difficulty"]
        assert all(count_operations(call) == 1 for call in plan)
        assert evaluate(plan[-1]) == Fraction(task.answer)


def test_one_op_tasks_have_no_step_slack_and_say_so() -> None:
    tasks = CalcEnv.generate_tasks(50, seed=4, one_op=True)
    assert {t.config["difficulty"] for t in tasks} == {4, 5, 6}
    for t in tasks:
        assert t.max_steps == t.config["difficulty"] + 1 and t.config["one_op"] is True
        assert t.prompt.endswith(", one operation per calc call.")
    fixed = CalcEnv.generate_tasks(5, seed=4, one_op=True, difficulties=(2,), max_steps=6)
    assert {(t.config["difficulty"], t.max_steps) for t in fixed} == {(2, 6)}
    # the default tasks are unchanged by the option's existence
    assert CalcEnv.generate_tasks(5, seed=4) == CalcEnv.generate_tasks(5, seed=4, one_op=False)
    with pytest.raises(ValueError, match="one_op must be true or false"):
        CalcEnv.generate_tasks(1, seed=0, one_op="yes")


def test_one_op_expert_solves_in_exactly_the_step_limit() -> None:
    env = CalcEnv()
    for task in CalcEnv.generate_tasks(30, seed=6, one_op=True):
        env.reset(task)
        result, steps = _expert_episode(env)
        assert result.reward_parts["reward"] == 1.0, task
        assert steps == task.max_steps and result.reward_parts["tool_errors"] == 0.0


def test_one_op_refuses_a_longer_call_and_the_lost_step_loses_the_episode() -> None:
    env = CalcEnv()
    task = CalcEnv.generate_tasks(1, seed=8, one_op=True)[0]
    env.reset(task)
    first = env.step(call_text(task.config["expr"]))  # the whole expression at once
    n = task.config["difficulty"]
    assert first.observation == ("<tool_response>error: one operation per call "
                                 f"(this has {n})</tool_response>")
    assert first.reward_parts["tool_errors"] == 1.0 and not first.done
    state = env.snapshot()
    result, _ = _expert_episode(env)  # the expert goes on, but one step short
    assert result.reward_parts["reward"] == 0.0
    other = CalcEnv()
    other.restore(state)  # the variant's snapshots restore like any calc state
    assert other.snapshot() == state
    # a one-operation call and a malformed one are judged as in plain calc
    env.reset(task)
    assert env.step(call_text("2+3")).observation == "<tool_response>5</tool_response>"
    assert env.step(call_text("2+")).observation.startswith("<tool_response>error: ")
