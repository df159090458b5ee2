"""``rtrees train``'s field options are made from ``TrainConfig`` (issue 46): each one
sets its field, typed as the field is, and nothing is set that was not given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from cli.main import app
from cli.reference import root_command, walk
from cli.train_cmd import FIELD_OPTIONS, _given, _option_name
from train.config import TrainConfig, apply_overrides


def _train_command() -> Any:
    """The click command of ``rtrees train`` (typer vendors click: no isinstance checks)."""
    return dict(walk(root_command()))[("rtrees", "train")]


def test_every_field_option_exists_with_the_field_type() -> None:
    import dataclasses

    command = _train_command()
    opts = {p.opts[0]: p for p in command.params if p.param_type_name == "option"}
    kinds = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for name in FIELD_OPTIONS:
        is_dict = str(kinds[name]).startswith("dict")
        option = opts[_option_name(name, is_dict)]
        assert option.help, name
        if is_dict:
            assert option.multiple, name
        elif kinds[name] == "bool":
            assert option.is_flag, name
        elif kinds[name] in ("int", "float"):  # parsed as the field's type
            value = _parse([option.opts[0], "2"])[name]
            assert type(value).__name__ == kinds[name], name
    # the options of the run (not fields) are still there, each once
    flags = [p.opts[0] for p in command.params if p.param_type_name == "option"]
    for flag in ("--config", "--set", "--agent", "--nproc", "--resume", "--fields"):
        assert flags.count(flag) == 1


def _parse(args: list[str]) -> dict[str, Any]:
    """The fields ``rtrees train ARGS`` would set, without training."""
    command = _train_command()
    ctx = command.make_context("train", args)
    options = {k: v for k, v in ctx.params.items()
               if k not in ("config", "nproc", "resume", "fields")}
    return _given(options)


def test_given_options_set_their_fields_and_nothing_else(tmp_path: Path) -> None:
    got = _parse(["--steps", "3", "--store", str(tmp_path / "s"), "--reuse", "all",
                  "--is-cap", "1.5", "--is-mode", "mask", "--reuse-per-step", "2",
                  "--sampler-param", "b_max=2", "--reuse-param", "calib_trees=2",
                  "--tensorboard", "--set", "lr=1e-3"])
    assert got == {"lr": "1e-3", "steps": 3, "store": str(tmp_path / "s"), "reuse": "all",
                   "is_cap": 1.5, "is_mode": "mask", "reuse_per_step": 2,
                   "sampler_params": {"b_max": "2"}, "reuse_params": {"calib_trees": "2"},
                   "tensorboard": True}
    cfg = apply_overrides(TrainConfig(), got)
    assert (cfg.steps, cfg.is_mode, cfg.sampler_params, cfg.tensorboard) == \
        (3, "mask", {"b_max": "2"}, True)
    assert _parse([]) == {}  # every default stays TrainConfig's


def test_agent_is_an_alias_of_an_agent_env() -> None:
    """``--agent module:function`` parses to the config ``--env agent:module:function``
    gives (as in ``rtrees collect``); with ``--env`` too it is a one-line error."""
    alias = _parse(["--agent", "myagent:run", "--steps", "2"])
    assert alias == _parse(["--env", "agent:myagent:run", "--steps", "2"]) == \
        {"env": "agent:myagent:run", "steps": 2}
    assert apply_overrides(TrainConfig(), alias) == \
        apply_overrides(TrainConfig(), {"env": "agent:myagent:run", "steps": 2})
    for other in (["--env", "calc"], ["--set", "env=calc"]):
        result = CliRunner().invoke(app, ["train", "--agent", "myagent:run", *other])
        assert result.exit_code != 0 and "give one of --env and --agent" in result.output
        assert "Traceback" not in result.output


def test_a_bad_typed_option_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", "--steps", "many", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--steps" in result.output
    assert not (tmp_path / "o").exists()


def test_the_options_are_read_from_the_config_source_without_torch() -> None:
    """``config_fields`` reads ``TrainConfig`` from its source: the same fields as the
    dataclass, and ``rtrees`` still starts without importing torch."""
    import dataclasses
    import subprocess
    import sys

    from cli.train_cmd import config_fields

    assert list(config_fields()) == [f.name for f in dataclasses.fields(TrainConfig)]
    code = "import sys, cli.main; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
