"""Property checks every environment must pass, reusable by each environment's tests.

    from env_properties import check_snapshot_determinism, check_never_raises

    @given(st.lists(actions), st.lists(actions))
    def test_snapshot(prefix, suffix):
        check_snapshot_determinism(MyEnv, task, prefix, suffix)

Only the ``Environment`` interface of ``train.envs.base`` is used, so the checks hold
for any tool world. Observations and reward parts are compared as bytes (UTF-8 text,
canonical JSON), which is how the store keeps them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from train.envs.base import Environment, StepResult, Task


def step_bytes(result: StepResult) -> bytes:
    """One step's outcome as canonical bytes: observation, done and reward parts.

    ``surrogatepass`` so that a stray lone surrogate shows up as a difference (or as
    an explicit failure in ``check_never_raises``) instead of an encoding error here.
    """
    parts = json.dumps(result.reward_parts, sort_keys=True, separators=(",", ":"))
    return b"\x00".join([result.observation.encode("utf-8", "surrogatepass"),
                         b"1" if result.done else b"0", parts.encode()])


def run_actions(env: Environment, actions: Sequence[str]) -> list[bytes]:
    """Step through ``actions`` (after done too: the env must answer those as well)."""
    return [step_bytes(env.step(a)) for a in actions]


def check_snapshot_determinism(env_factory: Callable[[], Environment], task: Task,
                               prefix_actions: Sequence[str],
                               suffix_actions: Sequence[str]) -> list[bytes]:
    """Restore-then-step is byte-identical to stepping on.

    Runs ``prefix_actions`` from ``reset(task)``, snapshots, then runs
    ``suffix_actions`` on (a) the same instance, (b) a fresh instance restored from
    the snapshot with no reset, and (c) the first instance restored back to the
    snapshot after the suffix (restore overwrites a used episode). All three must
    give identical observations, done flags and reward parts, and each restored
    instance must snapshot to the same bytes before the suffix and agree with (a)
    after every step. Returns (a)'s step bytes for further checks.
    """
    first = env_factory()
    fresh = env_factory()
    try:
        first.reset(task)
        run_actions(first, prefix_actions)
        snap = first.snapshot()
        assert isinstance(snap, bytes), f"snapshot() returned {type(snap).__name__}"

        fresh.restore(snap)
        assert fresh.snapshot() == snap, "snapshot of a restored env differs from the original"

        expected, snaps = [], []
        for action in suffix_actions:
            expected.append(step_bytes(first.step(action)))
            snaps.append(first.snapshot())

        for i, action in enumerate(suffix_actions):
            got = step_bytes(fresh.step(action))
            assert got == expected[i], (f"suffix step {i} differs after restore:\n"
                                        f"  stepped on: {expected[i]!r}\n  restored:   {got!r}")
            assert fresh.snapshot() == snaps[i], f"state after suffix step {i} differs"

        first.restore(snap)
        assert first.snapshot() == snap, "restore into a used env did not restore its state"
        again = run_actions(first, suffix_actions)
        assert again == expected, "re-running the suffix after restoring a used env differs"
        return expected
    finally:
        first.close()
        fresh.close()


def check_never_raises(env: Environment, task: Task, actions: Sequence[str]) -> list[StepResult]:
    """Every action gets a ``StepResult`` with a string observation that encodes as UTF-8
    and float reward parts holding ``"reward"``; none raises. Episodes that end are
    reset so that each action is tried in a live episode."""
    env.reset(task)
    results = []
    for action in actions:
        result = env.step(action)
        assert isinstance(result.observation, str)
        result.observation.encode("utf-8")  # no lone surrogates reach a tokenizer
        assert isinstance(result.done, bool)
        assert "reward" in result.reward_parts
        assert all(isinstance(v, float) for v in result.reward_parts.values())
        results.append(result)
        if result.done:
            env.reset(task)
    return results


HOSTILE_ACTIONS: list[str] = [
    "",
    "just text, no tags",
    "<tool_call>{not json</tool_call>",
    "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": 5}</tool_call>',
    '<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "x", "arguments": "not an object"}</tool_call>',
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
    '<tool_call>{"name": "x", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>",
    "<tool_call>" * 100_000,  # unclosed opens: quadratic for a naive regex
    "<tool_call>" + "x" * 1_000_000 + "</tool_call>",
    '<tool_call>{"name": "' + "n" * 100_000 + '", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "x\\ud800", "arguments": {}}</tool_call>',
    "<answer>",
    "\x00\x01\x02",
]
"""Malformed and hostile action texts that any environment must answer without raising
(environment-specific ones belong in that environment's tests)."""
