"""``rtrees export``: every root-to-leaf path as HF datasets Parquet, ATIF or ADP (issue 26)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cli._common import console, fail


class ExportFormat(StrEnum):
    hf = "hf"
    atif = "atif"
    adp = "adp"


def export_command(
    store: Annotated[Path, typer.Option("--store", help="Store directory (read only).")],
    fmt: Annotated[ExportFormat, typer.Option(
        "--format", help="hf: Parquet shards + dataset_info.json; atif: ATIF v1.4 "
                         "trajectories; adp: Agent Data Protocol JSONL.")],
    out: Annotated[Path, typer.Option("--out", help="Output directory (must not hold an "
                                                    "export yet, nor be or lie inside the "
                                                    "store).")],
    run: Annotated[str | None, typer.Option("--run", help="Only the trees of this run.")
                   ] = None,
    tree: Annotated[list[str] | None, typer.Option(
        "--tree", help="Only this tree (repeatable).")] = None,
) -> None:
    """Export every root-to-leaf path of the selected trees, with metadata.json (schema and
    store versions, git commit, per-column statistics). An --out that is the store or
    inside it (links and .. resolved) is refused in one line, nothing written."""
    from rollout_store import SchemaMismatchError, Store, StoreError
    from rollout_store.exporters import export_paths
    from rollout_store.textsafe import printable

    try:
        report = export_paths(Store(store), fmt.value, out, run_id=run, tree_ids=tree)
    except (StoreError, SchemaMismatchError, ValueError, OSError) as exc:
        fail(str(exc))
    console.print(printable(report.summary()), markup=False, highlight=False,
                  soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
