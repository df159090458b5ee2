"""``rtrees policy init --env SPEC`` on a user's environment, and tiny checkpoints for any
env (issue 44 item 6): the envs are ``tests/tiny_envs.py``, named as ``module:Class``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_envs import WordEnv  # importable from tests/: the specs name it as module:Class

from cli.main import app
from rollout_store import Store
from train.policies import PolicyUnavailableError, load_policy
from train.policies.tiny import COMMITTED_DIR, checkpoint_name, default_cache_dir
from train.policies.tiny_train import default_config, init_policy
from train.sampling.collect import collect
from train.sampling.evaluation import ALL_TASKS, success_report

WORD = "tiny_envs:WordEnv"
NO_EXPERT = "tiny_envs:NoExpertEnv"
# a few optimizer steps on a few episodes: enough to write a real checkpoint quickly
TINY_RUN: dict[str, Any] = {"max_steps": 3, "train_tasks": 12, "eval_every": 1000, "eval_tasks": 2,
            "test_tasks": 3, "max_new_tokens": 12, "batch_tokens": 512, "warmup_steps": 1,
            "threads": 1}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RTREES_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_checkpoint_names_are_safe_and_distinct() -> None:
    assert [checkpoint_name(e) for e in ("calc", "workflow", "sgls")] == [
        "calc", "workflow", "sgls"]  # the committed checkpoints' directories
    names = {checkpoint_name(s) for s in ("a.b:C", "a_b:C", "a.b_C", "my.env")}
    assert len(names) == 4
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                             "0123456789_-") for n in names)
    assert default_cache_dir(WORD, 3).name.endswith("-3")
    assert ":" not in str(default_cache_dir(WORD, 3).name)


def test_policy_init_trains_a_custom_env_that_then_samples_trees(
        cache: Path, tmp_path: Path) -> None:
    config = default_config(WORD)
    assert config.noise == "none" and config.minutes == 10.0  # the generic recipe
    lines: list[str] = []
    result = init_policy(WORD, seed=0, minutes=2, log=lines.append, evaluate=success_report,
                         **TINY_RUN)
    assert result is not None and result.steps == TINY_RUN["max_steps"]
    assert result.path == default_cache_dir(WORD, 0) and result.path.parent.parent == cache
    assert result.test.to_json()["group"] == "tasks"  # no task_group_key: one group
    assert set(result.test.per_group) == {ALL_TASKS}
    policy = load_policy("tiny", WORD)
    assert Path(str(policy.policy_ref)) == result.path
    tasks = WordEnv.generate_tasks(2, 7)
    store = Store(tmp_path / "store", create=True)
    report = collect(store, WORD, policy, "random", tasks, 4, 0, "custom",
                     sampler_params={"max_new_tokens": 12}, progress=False)
    assert report.trees == len(tasks) and report.rollouts >= 4
    # a second init finds the checkpoint instead of training again
    assert init_policy(WORD, seed=0, log=lines.append, evaluate=success_report) is None


def test_any_tiny_checkpoint_loads_for_any_env(cache: Path) -> None:
    """``--policy PATH`` to a tiny checkpoint (here the committed calc one) acts in a
    user's env, and ``checkpoint=`` does too."""
    path = COMMITTED_DIR / "calc"
    by_path = load_policy(str(path), WORD)
    by_kw = load_policy("tiny", WORD, checkpoint=path)
    assert by_path.policy_version == by_kw.policy_version


def test_tiny_policy_of_an_untrained_env_names_the_command(cache: Path) -> None:
    with pytest.raises(PolicyUnavailableError, match=f"rtrees policy init --env {WORD}"):
        load_policy("tiny", WORD)


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        app(args)
    code = info.value.code
    return (code if isinstance(code, int) else 1), capsys.readouterr().err


@pytest.mark.parametrize("spec,needles", [
    (NO_EXPERT, ("has no scripted expert", "NoExpertEnv.expert_action()")),
    ("tiny_envs:Missing", ("tiny_envs:Missing", "has no 'Missing'")),
])
def test_policy_init_refuses_in_one_line(spec: str, needles: tuple[str, ...], cache: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _cli(["policy", "init", "--env", spec], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert all(n in lines[0] for n in needles), err
    assert not cache.exists()  # nothing trained, nothing written
    with pytest.raises(ValueError, match=needles[0]):
        init_policy(spec, evaluate=success_report)
