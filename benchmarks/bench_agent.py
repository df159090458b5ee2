"""Agent programs cost little over native environments (issue 49): trees/min of a
calculator agent *program* (``run(task, base_url, api_key)`` over the official ``openai``
client, collected as ``agent:bench_agent:run``) over the same world as a native
environment (``mirror_env``: the same completion parser, tool, rendering and reward), both
collected by
the engine with the same policy, sampler and seeds; and episodes/min of ``--sessions``
concurrent program sessions against ``rtrees serve`` (``train.serve.serve``: every
session's rows in one continuously batched decoder) over the engine stepping the native
environment for the same tasks (``group``, one rollout per task).

Both sides alternate ``--repeat`` times; ratios are of minima (medians beside). Also
printed, from ``train.envs.agent.program.STATS``: calls answered live and their mean
latency (answer to the program's next call: its tool, HTTP and JSON), calls replayed
from the record (the answer is the recorded text: 0 tokens decoded) and their latency,
and program runs started. The two collections' actions are compared: the agent path
gives the policy the same text as the native env, so with the same seeds its trees are
the same (``identical trees``).

Targets: agent trees/min >= 0.7x native; serve sessions >= 0.7x the engine.
Measured 2026-12-06 (2 shared cores, load ~8; tiny calc policy; 32 tasks x n_total 8
bel; 3 repeats): identical trees 32 of 32; agent program 0.43x native (median 0.37x,
FAIL) with ``tool_lag`` 8 (0.34x at lag 0); 457 live calls at ~8-10 ms each (the openai
client's own share ~2.3-2.6 ms against a null endpoint), 121 replayed calls (0 tokens
decoded) at ~11-13 ms, 348 program runs for 256 rollouts. On this CPU the tiny policy
decodes a call in ~1-2 ms, so a program's per-call Python (client, HTTP, JSON, thread
hand-offs) dominates; with a model whose call costs tens of ms it would not. 32 serve
sessions: 0.89x the engine (median 0.82x, PASS), median per-call latency 356 ms under
32 concurrent clients, 97 decode steps for 180 rows.

    .venv/bin/python benchmarks/bench_agent.py --tasks 32 --n-total 8 --sessions 32
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import json
import operator
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression exactly: integers, + - * /, parentheses."""
    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return Fraction(_OPS[type(node.op)](value(node.left), value(node.right)))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        raise ValueError("only integers and + - * /")
    try:
        return str(value(ast.parse(expr, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {type(exc).__name__}"


def reward(answer: str, task: Any) -> float:
    return float(answer.strip() == task.answer)


_HTTP: list[Any] = []


def run(task: Any, base_url: str, api_key: str) -> float:
    """The agent program: the calc loop over the openai client (one connection pool per
    process: building one costs ~0.1 s here, more than a whole episode)."""
    from openai import DefaultHttpxClient, OpenAI

    if not _HTTP:
        _HTTP.append(DefaultHttpxClient())
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=_HTTP[0])
    messages: list[Any] = [{"role": "user", "content": task.prompt}]
    for _ in range(task.max_steps):
        message = client.chat.completions.create(model="policy", messages=messages,
                                                 tools=TOOLS, max_tokens=128
                                                 ).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            text = message.content or ""
            if "<answer>" not in text or "</answer>" not in text:
                return 0.0
            return reward(text.split("<answer>")[1].split("</answer>")[0], task)
        for call in message.tool_calls:
            try:
                expr = str(json.loads(getattr(call, "function").arguments).get("expr", ""))  # noqa: B009
            except (ValueError, AttributeError):
                expr = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(expr)})
    return 0.0


def mirror_env(tasks: list[Any]) -> type:
    """The native twin of ``run``: the same completion parser (``wire.completion_message``),
    tool, rendering and reward, stepped by the engine directly (replay snapshots)."""
    from train.envs import Environment, StepResult, Task
    from train.envs.agent.wire import completion_message
    from train.envs.base import tool_response

    class Mirror(Environment):
        name = "bench-calc"
        snapshot_strategy = "replay"

        def reset(self, task: Task) -> str:
            self.task = task
            return task.prompt

        def step(self, action_text: str) -> StepResult:
            message, _ = completion_message(action_text)
            calls = message.get("tool_calls") or []
            if not calls:
                text = message.get("content") or ""
                if "<answer>" not in text or "</answer>" not in text:
                    return StepResult("", True, {"reward": 0.0})
                got = reward(text.split("<answer>")[1].split("</answer>")[0], self.task)
                return StepResult("", True, {"reward": got})
            out = []
            for call in calls:
                try:
                    expr = str(json.loads(call["function"]["arguments"]).get("expr", ""))
                except (ValueError, AttributeError):
                    expr = ""
                out.append(tool_response(calc(expr)))
            return StepResult("\n".join(out), False, {"reward": 0.0})

        @classmethod
        def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
            return tasks[:n]

    return Mirror


def client_floor_ms(calls: int = 50) -> float:
    """Mean ms of one ``chat.completions.create`` of the openai client (shared connection
    pool) against a loopback endpoint that answers a fixed completion at once."""
    from openai import DefaultHttpxClient, OpenAI

    from train.envs.agent.http import LoopbackServer
    from train.envs.agent.wire import ChatRequest, Choice, response_body

    class Null:
        models = None

        def complete(self, request: ChatRequest) -> dict[str, Any]:
            return response_body(request, [Choice("<answer>7</answer>")], 0, "null")

    server = LoopbackServer(lambda path, key: Null())
    try:
        client = OpenAI(base_url=server.url("/v1"), api_key="k", max_retries=0,
                        http_client=DefaultHttpxClient())
        messages: list[Any] = [{"role": "user", "content": "Compute 3+4."}]
        client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        start = time.perf_counter()
        for _ in range(calls):
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        return (time.perf_counter() - start) / calls * 1000
    finally:
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--n-total", type=int, default=8)
    ap.add_argument("--sampler", default="bel")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--lag", type=int, default=None,
                    help="AgentEnv.tool_lag: decode steps an agent step may overlap "
                         "(default: the class's)")
    args = ap.parse_args()
    for name in ("tasks", "n_total", "sessions", "repeat"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name.replace('_', '-')} must be at least 1")

    from _common import Timings, print_timings, verdict

    from train.envs import Task, register_env, unregister_env
    from train.envs.agent.program import STATS, AgentEnv
    from train.envs.calc import CalcEnv
    from train.policies import load_policy
    from train.sampling import make_sampler
    from train.sampling.chunks import sample_trees
    from train.serve import serve

    if args.lag is not None:
        AgentEnv.tool_lag = max(0, args.lag)
    print(f"AgentEnv.tool_lag {AgentEnv.tool_lag}")
    calc_tasks = CalcEnv.generate_tasks(args.tasks, seed=1)
    tasks = [Task(t.task_id, "bench", t.prompt, t.answer, t.max_steps) for t in calc_tasks]
    register_env("bench-calc", mirror_env(tasks))
    policy = load_policy("tiny", "calc")
    sampler = make_sampler(args.sampler)
    sides = {"native env": Timings("native env"), "agent program": Timings("agent program")}
    specs = {"native env": "bench-calc", "agent program": "agent:bench_agent:run"}
    trees: dict[str, list[Any]] = {}
    try:
        for _ in range(args.repeat):
            for label, t in sides.items():
                STATS.reset()
                start = time.perf_counter()
                trees[label] = sample_trees(specs[label], policy, sampler, tasks,
                                            args.n_total, 0, "bench")
                t.seconds.append(time.perf_counter() - start)
                print(f"{label}: {t.seconds[-1]:.1f} s, "
                      f"{60 * len(trees[label]) / t.seconds[-1]:.1f} trees/min", flush=True)
        live = STATS.live_seconds / max(STATS.live_calls, 1) * 1000
        replay = STATS.replay_seconds / max(STATS.replayed_calls, 1) * 1000
        print(f"agent calls (last run): {STATS.live_calls} answered live, mean {live:.2f} ms "
              f"to the next call; {STATS.replayed_calls} replayed from the record (0 tokens "
              f"decoded), mean {replay:.2f} ms each; {STATS.runs} program runs for "
              f"{args.tasks} trees")
        floor = client_floor_ms()
        print(f"the openai client's own cost per call against a null endpoint (a fixed "
              f"answer, no model): {floor:.2f} ms (part of every live call above)")
        same = [[n.action_text for n in a.nodes] == [n.action_text for n in b.nodes]
                for a, b in zip(trees["native env"], trees["agent program"], strict=True)]
        print(f"identical trees (same actions, same seeds): {sum(same)} of {len(same)}")
        base, agent = sides.values()
        print_timings([base, agent], base)
        ratio = base.min / agent.min
        verdict(f"agent-program trees/min over native ({args.sampler}, {args.tasks} tasks x "
                f"n_total {args.n_total}; median {base.median / agent.median:.2f}x)", ratio,
                ratio >= 0.7, ">= 0.7x")

        # --- sessions through rtrees serve vs the engine stepping the native env
        one = make_sampler("group")
        engine_t, serve_t = Timings("engine, native env"), Timings("serve sessions")
        with tempfile.TemporaryDirectory() as tmp:
            handle = serve(policy, model="policy", record=Path(tmp) / "calls.jsonl")
            try:
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    sample_trees("bench-calc", policy, one, tasks, 1, 0, "bench-1")
                    engine_t.seconds.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    with cf.ThreadPoolExecutor(args.sessions) as pool:
                        rewards = list(pool.map(lambda t: run(t, handle.url, handle.key),
                                                tasks))
                    serve_t.seconds.append(time.perf_counter() - start)
                    print(f"engine: {engine_t.seconds[-1]:.1f} s; {args.sessions} serve "
                          f"sessions: {serve_t.seconds[-1]:.1f} s (mean reward "
                          f"{sum(rewards) / len(rewards):.2f}; {handle.calls} calls so far)",
                          flush=True)
                assert handle.batcher is not None
                lines = (Path(tmp) / "calls.jsonl").read_text().splitlines()
                secs = sorted(json.loads(line)["seconds"] for line in lines)
                print(f"serve per-call latency: median {secs[len(secs) // 2] * 1000:.1f} ms, "
                      f"p90 {secs[int(len(secs) * 0.9)] * 1000:.1f} ms over {len(secs)} calls; "
                      f"{handle.batcher.decode_steps} decode steps for "
                      f"{handle.batcher.rows_decoded} rows")
            finally:
                handle.close()
        print_timings([engine_t, serve_t], engine_t)
        ratio = engine_t.min / serve_t.min
        verdict(f"episodes/min of {args.sessions} serve sessions over the engine (median "
                f"{engine_t.median / serve_t.median:.2f}x)", ratio, ratio >= 0.7, ">= 0.7x")
    finally:
        unregister_env("bench-calc")


if __name__ == "__main__":
    main()
