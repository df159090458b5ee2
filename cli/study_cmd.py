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
                                                 "elpo-fig1, credit-exact, table1 (see "
                                                 "train.jobs.STUDIES).")],
        out: Annotated[Path | None, typer.Option(
            "--out", help="Directory for the study's data, results.json, report.md, plots "
                          "(required unless --power).")] = None,
        param: Annotated[list[str] | None, typer.Option(
            "--param", help="KEY=VALUE setting of the study's config (repeatable).")] = None,
        small: Annotated[bool, typer.Option(
            help="Run the small settings of the study's test.")] = False,
        power: Annotated[bool, typer.Option(
            "--power", help="Print the effect the settings can detect (80% power) and, with "
                            "--effect, the sizes that effect needs; run nothing.")] = False,
        effect: Annotated[float | None, typer.Option(
            "--effect", help="With --power: the effect to size the study for.")] = None,
    ) -> None:
        """Re-run a seed paper's claim: data, report.md, results.json, plots, verdicts.

        Before it starts, it prints the effect its settings can detect at 80% power."""
        from rollout_store import SchemaMismatchError, StoreError
        from train.jobs import STUDIES, JobError, run_study, study_power

        if name not in STUDIES:
            fail(f"unknown study {name!r}; choose from {sorted(STUDIES)}")
        if effect is not None and not power:
            fail("--effect sizes a study: pass it with --power")
        params = parse_params(param)
        if power:
            try:
                lines = study_power(name, params, small=small, effect=effect)
            except ValueError as exc:
                fail(str(exc))
            for line in lines:
                console.print(line, highlight=False, markup=False, soft_wrap=True)
            return
        if out is None:
            fail("--out is required (or pass --power to size the study without running it)")
        try:
            res = run_study(name, out, params, small=small,
                            log=lambda line: console.print(line, highlight=False,
                                                           markup=False, soft_wrap=True))
        except (JobError, StoreError, SchemaMismatchError, ValueError, OSError) as exc:
            fail(str(exc))
        console.print(f"[bold]{STUDIES[name].title}[/]")
        for v in res.get("verdicts", []):
            console.print(f"  {v['line']}", highlight=False, markup=False, soft_wrap=True)
        console.print(f"report: {out / 'report.md'}")


__all__ = ["register"]
