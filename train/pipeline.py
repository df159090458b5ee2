"""The main job behind ``make demo`` / ``rtrees pipeline``: init, collect, credit, audit.

On embedded defaults (the tiny policy, calc, a local store, DuckDB):

1. **policy**: the tiny policy for the environment, trained by ``rtrees policy
   init`` unless a checkpoint exists (the committed one, or the cache);
2. **collect**: one tree per task with each sampler (``group``, ``bel``), committed
   to the store (``train.sampling.collect``; idempotent per run id and seed);
3. **credit**: each method (``grpo``, ``elpo``) for every stored tree lacking it;
4. **audit**: the Mean@k ranking audit; the reference job samples k rollouts from
   every branching child without a reference, then ``analysis.ranking`` reports.

Every step reuses what the store already holds, so a rerun only redoes the
reporting. Returns the audit's results (``results.json`` content).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


@dataclass(frozen=True)
class PipelineConfig:
    """Settings of the main job (defaults: the embedded demo, ~15 min on 2 cores cold)."""

    store: Path = Path("store-demo")
    """Store directory (created if missing)."""
    out: Path = Path("out/demo")
    """Where the ranking report goes (report.md, results.json, plots)."""
    env: str = "calc"
    """Environment (the tiny policy exists for calc and workflow)."""
    policy: str = "tiny"
    """Policy spec (``train.policies.load_policy``)."""
    seed: int = 0
    """Seed of tasks, sampling, references and the bootstrap."""
    tasks: int = 12
    """Tasks collected with each sampler."""
    n_total: int = 16
    """Rollout budget per tree."""
    samplers: tuple[str, ...] = ("group", "bel")
    """Samplers to collect with (one run id each)."""
    methods: tuple[str, ...] = ("grpo", "elpo")
    """Credit methods computed and audited."""
    k: int = 32
    """Rollouts behind each Mean@k reference."""
    init_minutes: float = 10.0
    """Time budget of ``policy init`` when no checkpoint exists."""
    max_new_tokens: int = 64
    """Token cap of one agent step while collecting and referencing."""

    def __post_init__(self) -> None:
        if self.tasks < 1 or self.n_total < 1 or self.k < 1:
            raise ValueError("tasks, n_total and k must be >= 1")
        if not self.samplers or not self.methods:
            raise ValueError("name at least one sampler and one method")


def run_pipeline(config: PipelineConfig, console: Console | None = None) -> dict[str, Any]:
    """Run the four steps of the module docstring; print a summary table and the report path."""
    from analysis.ranking import RankingConfig, ranking_audit, write_ranking_report
    from rollout_store import Store
    from train.credit.store_io import compute_credits
    from train.envs import env_class
    from train.policies import load_policy
    from train.sampling.collect import collect
    from train.sampling.references import ReferenceConfig, collect_references

    console = console or Console()
    start = time.perf_counter()
    if config.policy == "tiny":
        from train.policies.tiny import find_checkpoint
        from train.policies.tiny_train import init_policy

        if find_checkpoint(config.env, config.seed) is None:
            console.print(f"[bold]1/4 policy[/]: no tiny {config.env} checkpoint yet; "
                          f"training one (up to {config.init_minutes:g} min)")
            init_policy(config.env, seed=config.seed, minutes=config.init_minutes,
                        log=console.print)
    policy = load_policy(config.policy, config.env)
    console.print(f"[bold]1/4 policy[/]: {config.policy} {policy.policy_version} "
                  f"({policy.policy_ref})")

    store = Store(config.store, create=True)
    tasks = env_class(config.env).generate_tasks(config.tasks, config.seed)
    for sampler in config.samplers:
        run_id = f"demo-{config.env}-{sampler}-{config.policy}-n{config.n_total}"
        report = collect(store, config.env, policy, sampler, tasks, config.n_total,
                         config.seed, run_id,
                         sampler_params={"max_new_tokens": config.max_new_tokens})
        console.print(f"[bold]2/4 collect[/] {sampler}: {escape(report.summary())}")
    for method in config.methods:
        credit = compute_credits(store, method)
        console.print(f"[bold]3/4 credit[/]: {escape(credit.summary())}")
    refs = collect_references(
        store, ReferenceConfig(k=config.k, seed=config.seed,
                               max_new_tokens=config.max_new_tokens), policy=policy)
    console.print(f"[bold]4/4 audit[/]: references {escape(refs.summary())}")
    result = ranking_audit(store, RankingConfig(methods=tuple(config.methods), k=config.k,
                                                seed=config.seed))
    write_ranking_report(result, config.out)
    doc: dict[str, Any] = result.to_json()
    table = Table(title=f"Mean@{config.k} ranking audit ({config.env}, {config.policy})")
    for col in ("method", "pairwise acc.", "Kendall tau-b (macro)", "prefixes", "pairs"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, m in doc["methods"].items():
        table.add_row(name, _fmt(m["pairwise_accuracy"], m["ci"]["pairwise_accuracy"]),
                      _fmt(m["kendall_tau_b"]["macro"], m["ci"]["kendall_tau_b"]["macro"]),
                      str(m["n_prefixes"]), str(m["n_pairs"]))
    console.print(table)
    console.print(f"report: {config.out / 'report.md'}  "
                  f"({time.perf_counter() - start:.0f} s)")
    return doc


def _fmt(value: float | None, ci: list[float] | None) -> str:
    if value is None:
        return "-"
    if not ci or ci[0] is None:
        return f"{value:.3f}"
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
