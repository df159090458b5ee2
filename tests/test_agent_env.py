"""Agent programs as environments (``agent:module:function``, issue 49): programs that
drive the endpoint with the real ``openai`` client are stepped, snapshotted, restored by
replay (divergence named by call and field), collected into BEL trees, credited and
audited from the CLI; programs that raise, hang or return a non-number fail their own
tree by name while the others commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")

import agent_programs  # tests/ is on sys.path: specs name it

from rollout_store import Store, read_trees
from train.envs import make_env
from train.envs.agent.program import (
    AgentDivergenceError,
    AgentEnv,
    AgentProgramError,
    parse_agent_snapshot,
)
from train.envs.agent.wire import completion_message
from train.envs.base import Task
from train.policies.base import Policy

ROOT = Path(__file__).resolve().parents[1]
CALL_7 = '<tool_call>{"name": "calc", "arguments": {"expr": "3+4"}}</tool_call>'
TASK = Task("t-7", "agent:agent_programs:calc", "Compute 3+4.", "7", 4)


def _env_of(spec: str) -> AgentEnv:
    env = make_env(spec)
    assert isinstance(env, AgentEnv)
    return env


def _env(program: str) -> AgentEnv:
    return _env_of(f"agent:agent_programs:{program}")


def test_episode_steps_through_the_openai_client() -> None:
    env = _env("calc")
    try:
        assert env.reset(TASK) == "Compute 3+4."
        # the completion's tool call reached the program as structured tool_calls: it ran
        # the calculator on the arguments and sent the result back as a tool message
        first = env.step(CALL_7)
        assert first.observation == "<tool_response>7</tool_response>"
        assert not first.done
        # the call it answered, for its tree node (the viewer shows it), taken once
        call = env.step_meta()["call"]  # type: ignore[index]
        assert (call["index"], call["first"]) == (1, 0)
        assert call["messages"] == [{"role": "user", "content": "Compute 3+4."}]
        assert [(c["name"], json.loads(c["arguments"])) for c in call["tool_calls"]] == \
            [("calc", {"expr": "3+4"})]
        assert env.step_meta() is None
        last = env.step("<answer>7</answer>")
        assert last.done and last.reward_parts["reward"] == 1.0
        over = env.step("<answer>7</answer>")
        assert over.done and "episode is over" in over.observation
    finally:
        env.close()


def test_restore_replays_answers_and_parks_live_programs() -> None:
    env = _env("calc")
    try:
        env.reset(TASK)
        root = env.snapshot()
        env.step(CALL_7)
        after_call = env.snapshot()
        task, answers, calls = parse_agent_snapshot(after_call)
        assert (task, answers, len(calls)) == (TASK, [CALL_7], 2)
        # two branches from the node after the tool call: the first continues the live
        # program, which ends; the second re-runs and replays one answer
        runs = env.reruns
        assert env.step("<answer>8</answer>").reward_parts["reward"] == 0.0
        env.restore(after_call)
        assert (env.reruns, env.replayed_calls) == (runs + 1, 1)
        assert env.step("<answer>7</answer>").reward_parts["reward"] == 1.0
        # lockstep branches each keep a parked program: switching between them re-runs none
        env.restore(root)
        env.step('<tool_call>{"name": "calc", "arguments": {"expr": "2*5"}}</tool_call>')
        other = env.snapshot()
        env.restore(after_call)
        runs = env.reruns
        env.restore(other)
        env.restore(after_call)
        assert env.reruns == runs
    finally:
        env.close()
    fresh = _env("calc")  # another process's view: a fresh instance replays the record
    try:
        fresh.restore(after_call)
        assert fresh.step("<answer>7</answer>").reward_parts["reward"] == 1.0
    finally:
        fresh.close()


def test_non_deterministic_tool_is_a_named_divergence() -> None:
    env = _env("noisy")
    try:
        env.reset(TASK)
        env.step(CALL_7)
        state = env.snapshot()
    finally:
        env.close()
    again = _env("noisy")
    try:
        with pytest.raises(AgentDivergenceError) as caught:
            again.restore(state)
        assert (caught.value.call, caught.value.field) == (2, "messages[2].content")
        assert "replay diverged at call 2" in str(caught.value)
    finally:
        again.close()


@pytest.mark.parametrize(("program", "needle"), [
    ("rewriter", "rewrote its conversation at call 2"),
    ("silent", "returned before its first model call"),
])
def test_program_misuse_is_one_named_error(program: str, needle: str) -> None:
    env = _env(program)
    try:
        with pytest.raises(AgentProgramError, match=needle):
            env.reset(TASK)
            env.step("<answer>1</answer>")
    finally:
        env.close()


def _rtrees(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny_calc() -> Policy:
    from train.policies import load_policy

    return load_policy("tiny:calc", "agent:agent_programs:calc")


def test_collect_in_process_commits_good_trees_and_names_failures(
        tmp_path: Path, tiny_calc: Policy) -> None:
    """BEL trees of a program (the library path), and a program that raises, hangs or
    returns a non-number on some tasks: those trees fail by name, the others commit."""
    from train.sampling.collect import collect

    store = Store(tmp_path / "st", create=True)
    tasks = [Task(f"ok-{i}", "agent", str(t["prompt"]), str(t["answer"]), 4)
             for i, t in enumerate(agent_programs.TASKS[:2])]
    report = collect(store, "agent:agent_programs:calc", tiny_calc, "bel", tasks, 6, 0,
                     "bel", progress=False)
    assert (report.trees, report.failed) == (2, {})
    bad = [Task(mode, "agent", "Compute 3+4.", "7", 4, {"mode": mode})
           for mode in ("raise", "hang", "text")]
    report = collect(store, "agent:agent_programs:moody", tiny_calc, "group",
                     [*bad, tasks[0]], 2, 0, "moody", progress=False)
    assert report.trees == 1 and len(report.failed) == 3
    reasons = " ".join(report.failed.values())
    for needle in ("KeyError", "within 2 s", "not a finite number"):
        assert needle in reasons
    trees = read_trees(Store(tmp_path / "st"))
    assert sorted(t.task_id for t in trees) == ["ok-0", "ok-0", "ok-1"]
    bel = [t for t in trees if t.run_id == "bel"]
    assert all(sum(n.reward is not None for n in t.nodes) == 6 for t in bel)
    assert all(t.env == "agent:agent_programs:calc" for t in bel)


def test_collect_drops_divergent_branches_and_commits_the_tree(
        tmp_path: Path, tiny_calc: Policy) -> None:
    """BEL probes branch from inner nodes, which re-runs the program: a random tool result
    is a divergence at call 2. Each such rollout is dropped (spent, lost), its start node
    marked, the divergences counted, and every tree is still committed."""
    from train.sampling.collect import collect

    store = Store(tmp_path / "st", create=True)
    tasks = [Task(f"n-{i}", "agent", str(t["prompt"]), str(t["answer"]), 4)
             for i, t in enumerate(agent_programs.TASKS)]
    report = collect(store, "agent:agent_programs:noisy", tiny_calc, "bel", tasks, 8, 0,
                     "noisy", progress=False)
    assert (report.trees, report.failed) == (len(tasks), {})
    assert report.diverged > 0, "a branch below the root re-ran the program"
    assert f"{report.diverged} rollouts diverged on replay" in report.summary()
    trees = read_trees(Store(tmp_path / "st"))
    assert len(trees) == len(tasks)
    lost = 0
    for tree in trees:
        assert sum(tree.rollouts_by_phase.values()) == 8  # lost rollouts stay spent
        by_phase = (tree.meta or {}).get("diverged_rollouts", {})
        leaves = [n for n in tree.nodes if n.reward is not None]
        assert len(leaves) == 8 - sum(by_phase.values())
        marks = [n.meta["diverged"] for n in tree.nodes if n.meta and "diverged" in n.meta]
        assert sum(m["rollouts"] for m in marks) == sum(by_phase.values())
        for mark in marks:
            assert (mark["call"], mark["field"]) == (2, "messages[2].content")
        # nothing of a dropped branch is attached: a marked node's children are rollouts
        # that began elsewhere (its own live program), and no node is left without a leaf
        kids = tree.children()
        assert all(kids[n.node_id] or n.reward is not None for n in tree.nodes)
        lost += sum(by_phase.values())
        # every step node carries its model call: call k at depth k, its new messages
        # start where the previous call's ended, its tool calls parsed from the action
        depth = {0: 0}
        for n in tree.preorder():
            if n.parent_id is None:
                continue
            depth[n.node_id] = depth[n.parent_id] + 1
            call = (n.meta or {})["call"]
            assert call["index"] == depth[n.node_id] and call["messages"]
            assert call["messages"][-1]["role"] in ("user", "tool")
            sent = completion_message(n.action_text)[0].get("tool_calls", [])  # as sent
            assert [(c["name"], c["arguments"]) for c in call["tool_calls"]] == \
                [(c["function"]["name"], c["function"]["arguments"]) for c in sent]
    assert lost == report.diverged


@pytest.mark.slow
def test_collect_credit_audit_agent_trees(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in agent_programs.TASKS[:2]))
    store = tmp_path / "st"
    steps = [
        ["collect", "--store", str(store), "--agent", "agent_programs:calc", "--tasks",
         str(tasks), "--policy", "tiny:calc", "--sampler", "bel", "--n-total", "6",
         "--no-progress"],
        ["credit", "--store", str(store), "--method", "grpo"],
        ["credit", "--store", str(store), "--method", "elpo"],
        ["audit", "ranking", "--store", str(store), "--methods", "grpo,elpo", "--k", "2",
         "--bootstrap", "50", "--out", str(tmp_path / "audit")],
    ]
    for args in steps:
        done = _rtrees(args, tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
    trees = read_trees(Store(store))
    assert len(trees) == 2
    for tree in trees:
        assert tree.env == "agent:agent_programs:calc"
        assert tree.root().observation_text.startswith("Compute ")
        leaves = [n for n in tree.nodes if n.reward is not None]
        assert len(leaves) == 6
        calls = [n for n in tree.nodes if n.action_text and "<tool_call>" in n.action_text]
        assert calls and all(n.action_token_ids for n in calls)
    results = json.loads((tmp_path / "audit" / "results.json").read_text())
    assert results


@pytest.mark.slow
def test_failing_programs_fail_their_trees_by_name(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"prompt": "Compute 3+4.", "answer": "7", "task_id": "ok"},
            {"prompt": "Compute 3+4.", "task_id": "raises", "config": {"mode": "raise"}},
            {"prompt": "Compute 3+4.", "task_id": "hangs", "config": {"mode": "hang"}},
            {"prompt": "Compute 3+4.", "task_id": "text", "config": {"mode": "text"}}]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _rtrees(["collect", "--store", str(tmp_path / "st"), "--agent",
                    "agent_programs:moody", "--tasks", str(tasks), "--policy", "tiny:calc",
                    "--sampler", "group", "--n-total", "2", "--no-progress",
                    "--run-id", "moody"], tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "Traceback" not in out
    assert "3 of 4 trees failed" in out
    for needle in ("KeyError", "within 2 s", "not a finite number"):
        assert needle in " ".join(out.split()), out
    trees = read_trees(Store(tmp_path / "st"))
    assert [t.task_id for t in trees] == ["ok"]


def test_env_check_reports_the_first_divergent_call(tmp_path: Path) -> None:
    done = _rtrees(["env", "check", "--agent", "agent_programs:noisy", "--prefixes", "2",
                    "--tasks", "1"], tmp_path)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, out
    assert "FAIL native: prefix 0" in out
    assert "replay diverged at call 2" in out and "messages[2].content differs" in out
    assert "Traceback" not in out


def test_env_check_passes_a_deterministic_program() -> None:
    from train.envs.check import check_env

    report = check_env("agent:agent_programs:calc", prefixes=2, tasks=1)
    status = {c.name: c.status for c in report.checks}
    assert status["native"] == "ok" and status["tools"] == "ok" and report.passed


def test_an_unmodified_framework_is_stepped_and_replayed() -> None:
    """smolagents' ToolCallingAgent over its OpenAIServerModel: the completion's tool call
    runs the framework's own tool, its observation reaches the policy, a ``final_answer``
    call ends the run with the program's reward, and a fresh instance replays the
    framework's requests byte for byte (no divergence)."""
    pytest.importorskip("smolagents")
    env = _env_of("agent:agent_smol:run")
    again = _env_of("agent:agent_smol:run")
    try:
        prompt = env.reset(TASK)
        assert "Compute 3+4." in prompt and "calc" in prompt  # its system prompt and task
        step = env.step(CALL_7)
        assert step.observation.endswith("7") and not step.done
        state = env.snapshot()
        final = '<tool_call>{"name": "final_answer", "arguments": {"answer": "7"}}</tool_call>'
        assert env.step(final).reward_parts["reward"] == 1.0
        again.restore(state)  # a fresh run of the framework, checked call by call
        assert again.step(final).reward_parts["reward"] == 1.0
        wrong = '<tool_call>{"name": "final_answer", "arguments": {"answer": "8"}}</tool_call>'
        env.restore(state)
        assert env.step(wrong).reward_parts["reward"] == 0.0
    finally:
        env.close()
        again.close()
