"""``TrainConfig.task_params`` reaches the env's task generator for both splits (issue 23
item 3): workflow horizons set from the command line, a bad option a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import app
from train.coerce import CoerceError, literal_value
from train.config import TrainConfig
from train.trainer import TrainError, task_splits


def test_literal_value_rules() -> None:
    assert literal_value("18") == 18
    assert literal_value("12,18") == (12, 18)
    assert literal_value("0.5") == 0.5
    assert literal_value("True") is True
    assert literal_value("shop,flight") == ("shop", "flight")
    assert literal_value([6, 9]) == (6, 9)
    with pytest.raises(CoerceError, match="finite"):
        literal_value("nan", "x")
    # JSON objects and lists, for options that are themselves tables (reasoning-gym's
    # dataset_config); JSON is data, never code
    assert literal_value('{"products": {"max_terms": 2}}') == {"products": {"max_terms": 2}}
    assert literal_value("[1, 2]") == [1, 2]
    with pytest.raises(CoerceError, match="not valid JSON"):
        literal_value("{oops", "dataset_config")
    with pytest.raises(CoerceError, match="finite"):
        literal_value('{"a": NaN}', "dataset_config")
    with pytest.raises(CoerceError, match="finite"):
        literal_value('{"a": 1e999}', "dataset_config")


def test_workflow_horizons_reach_both_splits() -> None:
    config = TrainConfig(env="workflow", train_tasks=30, heldout_tasks=10,
                         task_params={"horizons": "12,18"})
    train, heldout = task_splits(config)
    assert {t.max_steps for t in train} == {12, 18}
    assert {t.max_steps for t in heldout} == {12, 18}
    one = TrainConfig(env="workflow", train_tasks=20, heldout_tasks=5,
                      task_params={"horizons": "24"})
    assert {t.max_steps for t in task_splits(one)[0]} == {24}
    default = TrainConfig(env="workflow", train_tasks=30, heldout_tasks=5)
    assert {t.max_steps for t in task_splits(default)[0]} == {6, 9, 12}


def test_calc_difficulties_reach_the_generator() -> None:
    config = TrainConfig(env="calc", train_tasks=40, heldout_tasks=10,
                         task_params={"difficulties": "3"})
    train, heldout = task_splits(config)
    assert {t.config["difficulty"] for t in train + heldout} == {3}


@pytest.mark.parametrize("params, word", [({"nope": "1"}, "nope"),
                                          ({"horizons": "1"}, "horizons"),
                                          ({"horizons": "a,b"}, "horizons")])
def test_bad_task_params_are_named(params: dict[str, str], word: str) -> None:
    with pytest.raises(TrainError, match=word):
        task_splits(TrainConfig(env="workflow", train_tasks=5, heldout_tasks=2,
                                task_params=params))


def test_cli_bad_task_param_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                     ) -> None:
    with pytest.raises(SystemExit) as info:
        app(["train", "--env", "workflow", "--store", str(tmp_path / "s"),
             "--out", str(tmp_path / "run"), "--task-param", "nope=3", "--steps", "1"])
    assert info.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "run" / "config.json").exists()


def test_collect_task_params_reach_the_generator(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``rtrees collect --task-param`` sets the generator's options (workflow horizon 6 trees
    are stored as such); a bad one or one beside a task file is one line, no store made."""
    from rollout_store import Store

    app_args = ["collect", "--env", "workflow", "--policy", "tabular", "--sampler", "group",
                "--tasks", "2", "--n-total", "2", "--no-progress"]
    with pytest.raises(SystemExit) as info:
        app([*app_args, "--store", str(tmp_path / "s"), "--task-param", "horizons=6"])
    assert info.value.code == 0
    trees = Store(tmp_path / "s").delta_table("trees").to_pyarrow_table()
    configs = [json.loads(c) for c in trees.column("env_config").to_pylist()]
    assert len(configs) == 2 and all(c["task"]["horizon"] == 6 for c in configs), configs
    for extra, word in ((["--task-param", "nope=1"], "nope"),
                        (["--task-param", "horizons={bad"], "not valid JSON"),
                        (["--tasks", str(tmp_path / "t.jsonl"), "--task-param", "horizons=6"],
                         "task file")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            app([*app_args, "--store", str(tmp_path / "bad"), *extra])
        assert info.value.code != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and word in err[0], err
        assert not (tmp_path / "bad").exists()
