"""train.envs.preamble: a long shared system prompt ahead of every task (issue 25)."""

from __future__ import annotations

import pytest

from train.envs import make_env
from train.envs.preamble import system_preamble
from train.policies import load_policy
from train.sampling import make_sampler
from train.sequences import build_sequences, tree_token_ratio


@pytest.mark.parametrize("name", ["calc", "workflow", "sgls"])
def test_preamble_goes_ahead_of_the_prompt_and_default_is_unchanged(name: str) -> None:
    plain = make_env(name)
    long = make_env(name, system_prompt_chars=1500)
    task = type(plain).generate_tasks(1, seed=5)[0]
    base = plain.reset(task)
    got = long.reset(task)
    assert got.endswith(base) and len(got) - len(base) >= 1500
    assert got.startswith(f"You are a careful agent working in the {name} environment.")
    assert make_env(name, system_prompt_chars=0).reset(task) == base
    if name == "calc":
        assert '"name": "calc"' in got  # the tool schema is rendered


def test_python_config_has_the_option() -> None:
    from train.envs.python_env import PythonEnv, PythonEnvConfig
    assert PythonEnvConfig().system_prompt_chars == 0
    text = system_preamble("python", [PythonEnv.tool], 800)
    assert len(text) >= 800 and '"name": "python"' in text
    with pytest.raises(ValueError, match="system_prompt_chars"):
        system_preamble("python", [], -1)


@pytest.mark.slow  # samples a BEL tree with a 1k-token prompt (~15 s)
def test_shared_preamble_makes_bel_trees_share_at_least_4x() -> None:
    policy = load_policy("tiny", "calc")
    env = make_env("calc", system_prompt_chars=1000)
    task = type(env).generate_tasks(1, seed=3)[0]
    trees = [make_sampler("bel").sample_tree(env, policy, task, 6, seed=0)]
    seqs = [build_sequences(t, policy.prompt_ids) for t in trees]  # type: ignore[attr-defined]
    assert tree_token_ratio(seqs) >= 4.0
