"""``rtrees policy ...``: train the embedded tiny policy and inspect policies (issue 6).

``rtrees policy init --env SPEC [--seed 0] [--out DIR] [--minutes M] [--force]``
trains the tiny policy by SFT on the environment's noisy expert traces
(``train.policies.tiny_train.init_policy``; any env spec whose class has a scripted expert,
``expert_action``), prints the sampled success on held-out tasks per group (the env's
``task_group_key``: difficulty on calc, horizon on workflow, task kind on sgls) and overall,
and caches the checkpoint; a later ``init`` (without ``--force``) or
``load_policy("tiny", SPEC)`` reuses it.

``rtrees policy info [--env calc] [--policy tiny|hf:PATH|vllm:PATH|tabular] [--json]``
loads a policy and prints its version, checkpoint and size (and, for a tiny
checkpoint, how it was trained).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from cli._common import fail, parse_task_params, require

policy_app = typer.Typer(help="Train the embedded tiny policy; inspect policies.",
                         no_args_is_help=True)
console = Console(highlight=False, soft_wrap=True)

TARGET_BAND = (0.2, 0.8)  # a policy that always or never succeeds gives no learning signal


@policy_app.command("init")
def init(
    env: Annotated[str, typer.Option(
        help="Environment spec with a scripted expert: calc, workflow, sgls, an installed "
             "name or module:Class.")],
    seed: Annotated[int, typer.Option(help="Seed of the model, data and batch order.")] = 0,
    out: Annotated[Path | None, typer.Option(
        help="Checkpoint directory (default: ~/.cache/rollout-trees/policies/ENV-SEED, "
             "ENV made safe for a path).")
    ] = None,
    minutes: Annotated[float | None, typer.Option(
        help="Wall-clock budget for training; it stops earlier once held-out success is "
             "in band (default: the env's, train.policies.tiny_train.default_minutes).")
    ] = None,
    force: Annotated[bool, typer.Option(help="Retrain even if a checkpoint exists.")] = False,
    task_param: Annotated[list[str] | None, typer.Option(
        help="KEY=VALUE option of the env's task generator for every split, e.g. calc "
             "one_op=true (repeatable; needs --out).")] = None,
) -> None:
    """Train the tiny policy by SFT on noisy expert traces; print held-out success."""
    from train.policies import PolicyUnavailableError
    from train.policies.tiny import default_cache_dir, find_checkpoint, read_meta
    from train.policies.tiny_train import init_policy, require_expert
    from train.sampling.evaluation import success_report

    try:
        require_expert(env)
    except ValueError as exc:  # EnvSpecError included: one line naming what is missing
        fail(str(exc), 2)
    require(minutes is None or minutes > 0, f"--minutes must be positive, got {minutes}")
    extra: dict[str, Any] = {}
    if task_param:
        extra["task_params"] = parse_task_params(task_param, 2)
    try:
        result = init_policy(env, seed=seed, out=out, minutes=minutes, force=force,
                             log=console.print, evaluate=success_report, **extra)
    except (ValueError, PolicyUnavailableError) as exc:
        fail(str(exc), 2)
    if result is None:  # reused: show what was measured when it was trained
        path = out if out is not None else (find_checkpoint(env, seed)
                                            or default_cache_dir(env, seed))
        meta = read_meta(path) or {}
        test = meta.get("test")
        if test:
            console.print(f"held-out sampled success recorded at training "
                          f"({meta.get('steps')} steps, {meta.get('train_seconds')} s):")
            for group, row in test["per_group"].items():
                console.print(f"  {test['group']} {group}: {row['rate']:6.1%}  "
                              f"({row['successes']}/{row['tasks']})")
            _print_overall(float(test["overall"]))
        return
    console.print(f"checkpoint: {result.path}  ({result.parameters:,} parameters, "
                  f"{result.steps} steps, {result.train_seconds:.0f} s, "
                  f"stopped: {result.stop_reason})")
    console.print(f"held-out sampled success ({sum(n for _, n in result.test.per_group.values())}"
                  " tasks, temperature 1):")
    for line in result.test.lines()[:-1]:
        console.print(line)
    _print_overall(result.test.overall)


def _print_overall(rate: float) -> None:
    low, high = TARGET_BAND
    verdict = "in" if low <= rate <= high else "OUTSIDE"
    console.print(f"  overall: {rate:6.1%}  ({verdict} the {low:.0%}-{high:.0%} target band)")


@policy_app.command("info")
def info(
    env: Annotated[str, typer.Option(help="Environment the policy acts in.")] = "calc",
    policy: Annotated[str, typer.Option(
        help="Policy spec: tiny, hf:PATH, vllm:PATH or tabular.")] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed of the tiny checkpoint.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Load a policy; print its version, checkpoint, size and training record."""
    from train.policies import PolicyUnavailableError, describe_policy

    kw: dict[str, Any] = {"seed": seed} if policy == "tiny" else {}
    try:
        data = describe_policy(policy, env, **kw)
    except (ValueError, FileNotFoundError, PolicyUnavailableError) as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    for key, value in data.items():
        if isinstance(value, dict):
            console.print(f"{key}:")
            for sub, item in value.items():
                console.print(f"  {sub}: {json.dumps(item, default=str)}")
        else:
            console.print(f"{key}: {value}")
