"""``rtrees env check`` / ``check_env`` (issue 44 item 4): the built-in worlds pass; each
deliberate defect in ``env_check_envs`` is reported on its own line, by name."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
from typing import Any

import env_check_envs  # noqa: F401  # importable from tests/: specs name it as module:Class
import pytest
from typer.testing import CliRunner

from cli.main import app
from train.envs.base import StepResult, check_arguments
from train.envs.check import CheckReport, CheckResult, check_env
from train.envs.check_steps import diverging_field, percentile, random_arguments
from train.sampling import SAMPLERS

PREFIXES = 3  # enough to exercise every path; the CLI's default is 20


def _by_name(report: CheckReport) -> dict[str, CheckResult]:
    return {c.name: c for c in report.checks}


def _invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["env", "check", *args])
    return result.exit_code, result.stdout, result.stderr


# ----- the built-in worlds pass ------------------------------------------------------------


def test_calc_passes_every_check() -> None:
    report = check_env("calc", prefixes=PREFIXES, samplers=list(SAMPLERS))
    checks = _by_name(report)
    assert report.passed
    assert report.env_class == "train.envs.calc:CalcEnv"
    assert checks["tasks"].line() == "ok    tasks: 3 deterministic"
    for name in ("build", "tools", "expert", "episodes", "native", "replay", "thread"):
        assert checks[name].status == "ok", checks[name].line()
    assert checks["reseed"].status == "skip"  # calc has no reseed()
    assert checks["native"].message.startswith(f"{PREFIXES} prefixes byte-identical")
    assert checks["native"].metrics["restore_p99_ms"] >= checks["native"].metrics[
        "restore_p50_ms"] >= 0
    assert "3 expert (mean reward 1.00" in checks["episodes"].message  # the expert solves calc
    assert report.supports == [f"{', '.join(SAMPLERS)} samplers", "references", "audit",
                               "refresh", "policy init (expert)", "hf: policies get its tools"]
    assert report.lacks == []


def test_workflow_passes_and_reseed_is_checked_per_strategy() -> None:
    report = check_env("workflow", prefixes=PREFIXES, seed=1)
    checks = _by_name(report)
    assert report.passed, "\n".join(report.lines())
    assert checks["reseed"].status == "ok"
    assert "(native, replay" in checks["reseed"].message  # and fork, where registered
    assert checks["tools"].message == "4 valid (fast, careful, repair, skip)"


def test_cli_prints_one_line_per_check_then_supports() -> None:
    code, out, err = _invoke("calc", "--prefixes", str(PREFIXES))
    assert code == 0, err
    lines = out.splitlines()
    names = [re.match(r"(ok|FAIL|warn|skip) +(\w+): ", line) for line in lines[:-1]]
    assert all(names), lines
    assert [m.group(2) for m in names if m] == [
        "build", "tasks", "tools", "expert", "episodes", "native", "replay", "fork", "reseed",
        "thread"]
    assert re.fullmatch(r"ok    replay: 3 prefixes byte-identical; snapshot p50 \S+ ms p99 \S+ "
                        r"ms, restore p50 \S+ ms p99 \S+ ms \(step \S+ ms\)", lines[6])
    assert lines[-1].startswith("supports: group, random, entropy, bel, caliper, rooted "
                                "samplers; references; audit; refresh; policy init (expert)")


def test_cli_json_report() -> None:
    code, out, _ = _invoke("workflow", "--prefixes", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["passed"] is True and doc["spec"] == "workflow"
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["native"]["status"] == "ok"
    assert set(checks["replay"]["metrics"]) == {"snapshot_p50_ms", "snapshot_p99_ms",
                                                "restore_p50_ms", "restore_p99_ms", "step_ms"}
    assert "references" in doc["supports"]


def test_on_result_sees_each_check_as_it_finishes() -> None:
    seen: list[CheckResult] = []
    report = check_env("calc", prefixes=1, tasks=1, on_result=seen.append)
    assert seen == report.checks


def test_function_tool_env_passes_through_replay() -> None:
    report = check_env("env_check_envs:StrTools", prefixes=PREFIXES)
    checks = _by_name(report)
    assert report.passed, "\n".join(report.lines())
    assert report.snapshot_strategy == "replay"
    assert checks["native"].status == "skip"
    assert "does not implement snapshot()/restore()" in checks["native"].message
    assert checks["replay"].status == "ok"
    assert checks["tools"].message == "2 valid (upper, repeat)"
    assert report.supports[:2] == ["all samplers", "references"]  # replay outlives the process
    assert report.lacks == ["policy init (no expert_action)"]


def test_fork_is_checked_when_registered_else_skipped_with_the_reason() -> None:
    fork = _by_name(check_env("calc", prefixes=1, tasks=1))["fork"]
    if importlib.util.find_spec("train.envs.fork") is None:
        assert fork.status == "skip"
        assert "train.envs.fork does not import" in fork.message
    else:
        assert fork.status in ("ok", "warn", "skip") and fork.message


# ----- defects, each reported by name -------------------------------------------------------


def test_nondeterministic_env_names_the_first_diverging_step() -> None:
    report = check_env("env_check_envs:NoisyEnv", prefixes=8)
    checks = _by_name(report)
    assert not report.passed
    native = checks["native"]
    assert native.status == "FAIL"  # its own strategy: required
    found = re.fullmatch(r"prefix \d+ \(task '[^']+', snapshot after step (\d+)\) diverged "
                         r"at step (\d+) after restore \(observation\)", native.message)
    assert found, native.message
    depth, step = int(found.group(1)), int(found.group(2))
    assert step == max(depth + 1, 4)  # NoisyEnv's observations turn noisy at step 4
    assert checks["replay"].status == "warn"  # another strategy: optional
    assert "ReplayDivergenceError" in checks["replay"].message
    code, out, _ = _invoke("env_check_envs:NoisyEnv", "--prefixes", "8")
    assert code == 1
    assert f"FAIL  native: {native.message}" in out.splitlines()


def test_step_that_raises_is_reported_by_name() -> None:
    report = check_env("env_check_envs:RaisingEnv", prefixes=PREFIXES)
    episodes = _by_name(report)["episodes"]
    assert episodes.status == "FAIL"
    assert re.search(r"random episode of task '[^']+': step\('.*'\) raised KeyError: "
                     "'no tool_call block'", episodes.message), episodes.message
    assert _by_name(report)["thread"].status == "skip"  # not a threading problem
    code, out, err = _invoke("env_check_envs:RaisingEnv", "--prefixes", "1")
    assert code == 1 and "Traceback" not in out + err


def test_snapshot_that_is_not_bytes_is_reported() -> None:
    report = check_env("env_check_envs:StrSnapshotEnv", prefixes=PREFIXES)
    checks = _by_name(report)
    assert checks["native"].status == "FAIL"
    assert checks["native"].message.endswith("snapshot() returned str, not bytes")
    assert checks["replay"].status == "ok"
    assert not report.passed


def test_invalid_tool_schema_is_reported() -> None:
    report = check_env("env_check_envs:BadSchemaEnv", prefixes=1)
    tools = _by_name(report)["tools"]
    assert tools.status == "FAIL"
    assert "parameters are not valid JSON Schema at properties/n/type" in tools.message
    assert "tools for hf: policies (tool_schemas() failed the check)" in report.lacks


def test_env_that_needs_the_main_thread_is_told_to_fork() -> None:
    thread = _by_name(check_env("env_check_envs:MainThreadEnv", prefixes=1))["thread"]
    assert thread.status == "FAIL"
    assert "RuntimeError: signal only works in main thread" in thread.message
    assert "snapshot_strategy = 'fork'" in thread.message


def test_constructor_that_raises_is_one_failed_check() -> None:
    report = check_env("env_check_envs:BrokenInitEnv")
    assert [c.line() for c in report.checks] == [
        "FAIL  build: make_env('env_check_envs:BrokenInitEnv') raised OSError: cannot reach "
        "the sandbox"]
    assert report.supports == []
    assert "samplers (every sampler restores snapshots: no strategy passed)" in report.lacks
    code, out, err = _invoke("env_check_envs:BrokenInitEnv")
    assert code == 1 and "Traceback" not in out + err


@pytest.mark.parametrize(("spec", "problem"), [
    ("nosuch.module:X", "module 'nosuch.module' does not import"),
    ("os:path", "is not an Environment subclass"),
    ("calc:Nope", "does not import"),
    ("nope", "unknown environment 'nope'"),
])
def test_bad_spec_is_one_line_exit_2(spec: str, problem: str) -> None:
    code, out, err = _invoke(spec)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("error: ") and problem in err


# ----- the pieces ---------------------------------------------------------------------------


def test_random_arguments_fit_their_schema() -> None:
    schema: dict[str, Any] = {
        "type": "object", "additionalProperties": False, "required": ["n", "mode"],
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3},
                       "mode": {"type": "string", "enum": ["up", "down"]},
                       "x": {"type": "number"}, "flag": {"type": "boolean"},
                       "tags": {"type": "array", "items": {"type": "string"}},
                       "opts": {"type": "object", "properties": {"k": {"type": "integer"}}}}}
    rng = random.Random(0)
    seen_optional = set()
    for _ in range(200):
        args = random_arguments(schema, rng)
        assert check_arguments(args, schema) is None, args
        assert 0 <= args["n"] <= 3
        seen_optional |= set(args) - {"n", "mode"}
    assert seen_optional == {"x", "flag", "tags", "opts"}


def test_diverging_field_names_the_first_difference() -> None:
    base = StepResult("obs", False, {"reward": 0.0})
    assert diverging_field(base, StepResult("obs", False, {"reward": 0.0})) is None
    assert diverging_field(base, StepResult("obs2", True, {"reward": 1.0})) == "observation"
    assert diverging_field(base, StepResult("obs", True, {"reward": 1.0})) == "done"
    assert diverging_field(base, StepResult("obs", False, {"reward": -0.0})) == "reward_parts"
    nan = StepResult("obs", False, {"reward": math.nan})
    assert diverging_field(nan, StepResult("obs", False, {"reward": math.nan})) is None


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.5) == 0.0
