"""``rtrees collect``: sample rollout trees into a store (issue 6)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from cli._common import console, fail, parse_params, parse_task_params, require


def default_run_id(env: str, sampler: str, policy: str, n_total: int) -> str:
    """The run id when none is given: the same options give the same id, so a rerun
    resumes (skips the trees already stored) instead of starting over."""
    def slug(text: str, default: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or default

    return f"{slug(env, 'env')}-{sampler}-{slug(policy, 'policy')}-n{n_total}"


def tasks_value(text: str | int) -> int | str:
    """``--tasks``: a count (an integer) or a task file path (anything else)."""
    if isinstance(text, int):
        return text
    return int(text) if re.fullmatch(r"[+-]?\d{1,9}", text.strip()) else text


def collect_command(
    store: Annotated[Path, typer.Option("--store", help="Store directory (created if missing).")],
    policy: Annotated[str, typer.Option(help="Policy spec for train.policies.load_policy "
                                             "(tiny, hf:PATH, vllm:PATH, tabular).")],
    sampler: Annotated[str, typer.Option(help="group, random, entropy, bel or caliper.")],
    env: Annotated[str | None, typer.Option(
        help="Environment: calc, python, workflow, sgls, a name an installed package "
             "registers (entry points 'rollout_trees.envs'), module:Class, or "
             "agent:module:function.")] = None,
    agent: Annotated[str | None, typer.Option(
        help="An agent program module:function (run(task, base_url, api_key) -> reward): "
             "the same as --env agent:module:function.")] = None,
    tasks: Annotated[str, typer.Option(
        "--tasks", parser=tasks_value,
        help="Number of generated tasks, or a JSONL task file.")] = "64",
    n_total: Annotated[int, typer.Option("--n-total", help="Rollouts per tree.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of the tasks and of the sampling.")] = 0,
    run_id: Annotated[str | None, typer.Option(
        help="Run id (default: ENV-SAMPLER-POLICY-nN_TOTAL). A rerun with the same run id "
             "and seed skips the trees already stored.")] = None,
    workers: Annotated[int, typer.Option(
        help="Worker processes, or Ray actors with --ray (each loads the policy).")] = 1,
    commit_trees: Annotated[int, typer.Option(help="Trees per commit.")] = 16,
    param: Annotated[list[str] | None, typer.Option(
        "--param", help="Sampler option KEY=VALUE (repeatable), e.g. b_max=4.")] = None,
    task_param: Annotated[list[str] | None, typer.Option(
        "--task-param", help="KEY=VALUE option of the env's task generator (repeatable), "
                             "e.g. workflow horizons=18; a table or list as JSON. Not with "
                             "a task file, whose tasks carry their own configs.")] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    ray: Annotated[str | None, typer.Option(
        "--ray", help="Collect on Ray (the ray extra): auto (a running cluster, else a new "
                      "local one), local, or a cluster ADDRESS; --workers actors.")] = None,
) -> None:
    """Sample one rollout tree per task with a sampler and a policy, commit them to a store."""
    from rollout_store import SchemaMismatchError, Store, StoreError
    from train.envs import env_class
    from train.envs.tools import read_task_file
    from train.policies import PolicyUnavailableError
    from train.sampling.collect import collect

    params = parse_params(param)
    task_params = parse_task_params(task_param)
    require((env is None) != (agent is None), "give exactly one of --env and --agent")
    spec: str = env if env is not None else f"agent:{agent}"
    counted = isinstance(tasks, int)
    n_tasks = tasks if isinstance(tasks, int) else 1
    for option, value in (("--tasks", n_tasks), ("--n-total", n_total), ("--workers", workers),
                          ("--commit-trees", commit_trees)):
        require(value >= 1, f"{option} must be at least 1, got {value}")
    try:
        env_cls = env_class(spec)
    except ValueError as exc:  # EnvSpecError: unknown name, module that does not import
        fail(f"--{'env' if agent is None else 'agent'}: {exc}")
    require(counted or not task_params,
            "--task-param sets how tasks are generated: it cannot apply to a task file")
    if not counted:
        try:
            from_file = read_task_file(str(tasks), spec)
        except ValueError as exc:
            fail(f"--tasks: a count or a JSONL task file: {exc}")
    try:
        generated = (env_cls.generate_tasks(n_tasks, seed, **task_params) if counted
                     else from_file)
        s = Store(store, create=True)
        report = collect(s, spec, policy, sampler, generated, n_total, seed,
                         run_id or default_run_id(spec, sampler, policy, n_total),
                         workers=workers, commit_trees=commit_trees, progress=progress,
                         sampler_params=params, ray=ray)
    except (ValueError, RuntimeError, StoreError, SchemaMismatchError, OSError,
            PolicyUnavailableError) as exc:
        fail(str(exc))
    console.print(report.summary(), highlight=False, markup=False)
    if report.failed:
        tree_id, why = next(iter(sorted(report.failed.items())))
        fail(f"{len(report.failed)} of {len(generated)} trees failed and were not committed "
             f"(a rerun retries them); first: {tree_id}: {why}")


def register(app: typer.Typer) -> None:
    """Add the ``collect`` command to the ``rtrees`` app."""
    app.command("collect")(collect_command)
