"""``rtrees study NAME --out DIR``: re-run one of the seed papers' claims (issue 14).

``NAME`` is a study of ``train.jobs.STUDIES`` (``dsc-l1``, ``elpo-fig3``, ...). The command
parses its options, calls ``train.jobs.run_study`` (data generation in ``train.studies``,
report in ``analysis``) and prints one verdict line per claim. ``--param KEY=VALUE``
overrides one setting of the study's config dataclass (tuples as ``a,b,c``); ``--small``
runs the small settings of its test. ``rtrees audit report --study DIR`` rebuilds the
report from the data files alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli._common import console, fail, parse_params


def register(app: typer.Typer) -> None:
    """Add ``rtrees study`` to ``app``."""

    @app.command("study")
    def study(
        name: Annotated[str, typer.Argument(help="The study: dsc-l1, elpo-fig3, dsc-table2, "
                                                 "elpo-fig1, table1 (see train.jobs.STUDIES).")],
        out: Annotated[Path, typer.Option("--out", help="Directory for the study's data, "
                                                        "results.json, report.md, plots.")],
        param: Annotated[list[str] | None, typer.Option(
            "--param", help="KEY=VALUE setting of the study's config (repeatable).")] = None,
        small: Annotated[bool, typer.Option(
            help="Run the small settings of the study's test.")] = False,
    ) -> None:
        """Re-run a seed paper's claim: data, report.md, results.json, plots, verdicts."""
        from rollout_store import SchemaMismatchError, StoreError
        from train.jobs import STUDIES, JobError, run_study

        if name not in STUDIES:
            fail(f"unknown study {name!r}; choose from {sorted(STUDIES)}")
        params = parse_params(param)
        try:
            res = run_study(name, out, params, small=small)
        except (JobError, StoreError, SchemaMismatchError, ValueError, OSError) as exc:
            fail(str(exc))
        console.print(f"[bold]{STUDIES[name].title}[/]")
        for v in res.get("verdicts", []):
            console.print(f"  {v['line']}", highlight=False, markup=False, soft_wrap=True)
        console.print(f"report: {out / 'report.md'}")


__all__ = ["register"]
