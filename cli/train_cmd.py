"""``rtrees train``: on-policy training on rollout trees (issue 11; ``train.trainer``).

``rtrees train --config FILE`` or ``rtrees train --env calc --policy tiny --sampler bel
--credit elpo --steps N --store DIR --out DIR [--resume] [--reuse none|all|transport|dsc|
refresh|m2po|prox-interp|gap-gate --reuse-from SQL --reuse-per-step N --max-staleness V --is-cap C
--is-mode M]
[--nproc N] [--shard none|fsdp]``; ``--nproc N`` runs N data-parallel ranks
(``train.launch.launch``; the same run as ``torchrun --nproc-per-node N -m cli.main train
...``); ``--shard fsdp`` shards the parameters, gradients and optimizer state over them
(FSDP2, ``train.fsdp``; ``TrainConfig.shard``).
Every option is optional and passed on only when given: the defaults live in
``train.config.TrainConfig`` alone (``--set FIELD=VALUE`` reaches any field;
``rtrees train --fields`` lists them with their documentation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from cli._common import console, fail, parse_params


def train_command(
    config: Annotated[Path | None, typer.Option("--config", help="TOML file of TrainConfig "
                                                "fields.")] = None,
    env: Annotated[str | None, typer.Option(help="Environment (TrainConfig.env).")] = None,
    policy: Annotated[str | None, typer.Option(help="tiny or hf:PATH.")] = None,
    sampler: Annotated[str | None, typer.Option(help="group, random, entropy, bel, caliper, rooted."
                                                )] = None,
    credit: Annotated[str | None, typer.Option(help="Credit estimator, e.g. grpo, elpo.")] = None,
    steps: Annotated[int | None, typer.Option(help="Training iterations.")] = None,
    store: Annotated[Path | None, typer.Option(help="Store directory (created if missing).")
                     ] = None,
    out: Annotated[Path | None, typer.Option(help="Run directory (config, checkpoints).")
                   ] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id in the store (default: train- and "
                                               "the run directory's name).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Any TrainConfig field as FIELD=VALUE (repeatable).")] = None,
    sampler_param: Annotated[list[str] | None, typer.Option(
        "--sampler-param", help="Sampler option KEY=VALUE (repeatable).")] = None,
    credit_param: Annotated[list[str] | None, typer.Option(
        "--credit-param", help="Estimator parameter KEY=VALUE (repeatable).")] = None,
    task_param: Annotated[list[str] | None, typer.Option(
        "--task-param", help="Task generator option KEY=VALUE for both splits, e.g. "
        "horizons=18 (TrainConfig.task_params; repeatable).")] = None,
    reuse: Annotated[str | None, typer.Option(help="Stored-tree reuse: none, all, transport, "
                                              "dsc, refresh, m2po, prox-interp, gap-gate "
                                              "(TrainConfig.reuse).")] = None,
    reuse_from: Annotated[str | None, typer.Option(help="SQL filter over trees choosing the "
                                                   "stored trees (TrainConfig.reuse_from).")
                          ] = None,
    reuse_per_step: Annotated[int | None, typer.Option(help="Stored trees per iteration.")
                              ] = None,
    max_staleness: Annotated[int | None, typer.Option(help="Skip stored trees more than this "
                                                      "many policy versions old.")] = None,
    is_cap: Annotated[float | None, typer.Option(help="Cap of the behaviour weight "
                                                 "pi_prox/mu (G8).")] = None,
    is_mode: Annotated[str | None, typer.Option(help="truncate or mask above the cap.")
                       ] = None,
    reuse_param: Annotated[list[str] | None, typer.Option(
        "--reuse-param", help="Gate/refresh/rule knob KEY=VALUE (TrainConfig.reuse_params).")
                           ] = None,
    nproc: Annotated[int | None, typer.Option(help="Data-parallel ranks on this machine "
                                              "(train.distributed; gloo on CPU).")] = None,
    shard: Annotated[str | None, typer.Option(help="none or fsdp: FSDP2 parameter sharding "
                                              "over the ranks (TrainConfig.shard).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from "
                                         "its newest checkpoint.")] = False,
    tensorboard: Annotated[bool, typer.Option("--tensorboard", help="Also write TensorBoard "
                                              "event files.")] = False,
    fields: Annotated[bool, typer.Option("--fields", help="List TrainConfig's fields and "
                                         "exit.")] = False,
) -> None:
    """Train a policy on-policy on rollout trees (sample, commit, credit, PPO, publish)."""
    from train.config import ConfigError, apply_overrides, field_docs, load_config, read_config
    from train.distributed import DistributedError
    from train.launch import launch
    from train.trainer import TrainError

    if fields:
        for name, doc in field_docs().items():
            console.print(f"{name}: {doc}", highlight=False, markup=False)
        return
    given: dict[str, Any] = dict(parse_params(set_, "--set"))
    for name, value in (("env", env), ("policy", policy), ("sampler", sampler),
                        ("credit", credit), ("steps", steps), ("store", store), ("out", out),
                        ("run_id", run_id),
                        ("reuse", reuse), ("reuse_from", reuse_from),
                        ("reuse_per_step", reuse_per_step), ("max_staleness", max_staleness),
                        ("is_cap", is_cap), ("is_mode", is_mode), ("shard", shard)):
        if value is not None:
            given[name] = str(value) if isinstance(value, Path) else value
    if tensorboard:
        given["tensorboard"] = True
    if sampler_param:
        given["sampler_params"] = parse_params(sampler_param, "--sampler-param")
    if credit_param:
        given["credit_params"] = parse_params(credit_param, "--credit-param")
    if task_param:
        given["task_params"] = parse_params(task_param, "--task-param")
    if reuse_param:
        given["reuse_params"] = parse_params(reuse_param, "--reuse-param")
    try:
        if resume and config is None and out is not None:  # the run's own config
            cfg = apply_overrides(read_config(out), given)
        else:
            cfg = load_config(config, given)
        report = launch(cfg, resume=resume, **({} if nproc is None else {"nproc": nproc}))
    except (ConfigError, TrainError, DistributedError) as exc:
        fail(f"{type(exc).__name__}: {exc}", code=2)
    if report.rank == 0:  # under torchrun every rank runs this command
        console.print(report.summary(), highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    """Add the ``train`` command to the ``rtrees`` app."""
    app.command("train")(train_command)
