"""``rtrees collect``: sample rollout trees into a store (issue 6)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from cli._common import console, fail, parse_params, require


def default_run_id(env: str, sampler: str, policy: str, n_total: int) -> str:
    """The run id when none is given: the same options give the same id, so a rerun
    resumes (skips the trees already stored) instead of starting over."""
    def slug(text: str, default: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or default

    return f"{slug(env, 'env')}-{sampler}-{slug(policy, 'policy')}-n{n_total}"


def collect_command(
    store: Annotated[Path, typer.Option("--store", help="Store directory (created if missing).")],
    env: Annotated[str, typer.Option(
        help="Environment: calc, python, workflow, sgls, a name an installed package "
             "registers (entry points 'rollout_trees.envs'), or module:Class.")],
    policy: Annotated[str, typer.Option(help="Policy spec for train.policies.load_policy "
                                             "(tiny, hf:PATH, vllm:PATH, tabular).")],
    sampler: Annotated[str, typer.Option(help="group, random, entropy, bel or caliper.")],
    tasks: Annotated[int, typer.Option("--tasks", help="Number of generated tasks.")] = 64,
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
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    ray: Annotated[str | None, typer.Option(
        "--ray", help="Collect on Ray (the ray extra): auto (a running cluster, else a new "
                      "local one), local, or a cluster ADDRESS; --workers actors.")] = None,
) -> None:
    """Sample one rollout tree per task with a sampler and a policy, commit them to a store."""
    from rollout_store import SchemaMismatchError, Store, StoreError
    from train.envs import env_class
    from train.policies import PolicyUnavailableError
    from train.sampling.collect import collect

    params = parse_params(param)
    for option, value in (("--tasks", tasks), ("--n-total", n_total), ("--workers", workers),
                          ("--commit-trees", commit_trees)):
        require(value >= 1, f"{option} must be at least 1, got {value}")
    try:
        env_cls = env_class(env)
    except ValueError as exc:  # EnvSpecError: unknown name, module that does not import
        fail(f"--env: {exc}")
    try:
        generated = env_cls.generate_tasks(tasks, seed)
        s = Store(store, create=True)
        report = collect(s, env, policy, sampler, generated, n_total, seed,
                         run_id or default_run_id(env, sampler, policy, n_total),
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
