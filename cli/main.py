"""``rtrees``: the command line. Each command parses its options and calls one library function.

Errors are one line on stderr with a non-zero exit (``cli._common``): bad option values,
the library's named errors, and, as a last resort, any other exception (its type, its
message and a hint to set ``RTREES_DEBUG=1`` for the traceback).
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from cli._common import RtreesApp, console, err, fail, parse_params, require
from cli.audit_cmd import audit_app
from cli.collect_cmd import register as register_collect
from cli.env_cmd import env_app
from cli.policy_cmd import policy_app

app = RtreesApp(help="Collect, archive, audit and train on rollout trees.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
store_app = typer.Typer(help="Inspect and maintain a store.", no_args_is_help=True)
app.add_typer(store_app, name="store")
app.add_typer(env_app, name="env")
app.add_typer(policy_app, name="policy")
app.add_typer(audit_app, name="audit")
register_collect(app)
from cli.train_cmd import register as register_train  # noqa: E402  (issue 11)

register_train(app)
from cli.study_cmd import register as register_study  # noqa: E402  (issue 14)

register_study(app)
from cli.view_cmd import register as register_view  # noqa: E402  (issue 26)

register_view(app)
from cli.search_cmd import register as register_search  # noqa: E402  (issue 26)

register_search(app)
from cli.label_cmd import register as register_label  # noqa: E402  (issue 26)

register_label(app)
from cli.export_cmd import register as register_export  # noqa: E402  (issue 26)

register_export(app)
from cli.compare_cmd import register as register_compare  # noqa: E402  (issue 48)

register_compare(app)
from cli.serve_cmd import register as register_serve  # noqa: E402  (issue 49)

register_serve(app)

if TYPE_CHECKING:
    import pyarrow as pa

    from rollout_store import Store

StoreOpt = Annotated[Path, typer.Option("--store", help="Store directory.")]


def _open(path: Path, create: bool = False) -> Store:
    from rollout_store import SchemaMismatchError, Store, StoreError

    try:
        return Store(path, create=create)
    except (StoreError, SchemaMismatchError) as exc:
        fail(str(exc))


@store_app.command("info")
def store_info(store: StoreOpt,
               as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False
               ) -> None:
    """Tables, table versions, row counts, bytes and schema version, and the rows each
    recorded attempt of a run wrote (a resumed `rtrees train`) with how many a later attempt
    superseded."""
    from rollout_store.maintenance import info
    from rollout_store.store import CorruptFileError

    try:
        data = info(_open(store))
    except CorruptFileError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(data, indent=2))
        return
    table = Table(title=f"{data['store']}  (schema v{data['schema_version']}, "
                        f"{data['commits']} committed appends)")
    for col in ("table", "version", "rows", "uncommitted rows", "files", "bytes", "schema"):
        table.add_column(col, justify="left" if col == "table" else "right")
    for name, t in data["tables"].items():
        table.add_row(name, str(t["version"]), f"{t['rows']:,}", f"{t['uncommitted_rows']:,}",
                      str(t["files"]), f"{t['bytes']:,}", f"v{t['schema_version']}")
    console.print(table)
    if data["attempts"]:  # runs that recorded attempts (a resumed `rtrees train`)
        runs = Table(title="attempts: rows written (superseded by a later attempt)")
        for col in ("run", "attempt", "from iteration", "started", "trees", "credits",
                    "metrics"):
            runs.add_column(col, justify="left" if col in ("run", "started") else "right")
        for a in data["attempts"]:
            start = "" if a["start_iteration"] is None else str(a["start_iteration"])
            runs.add_row(a["run_id"], str(a["attempt"]), start, a["started_at"] or "",
                         *(f"{a[t]['rows']:,} ({a[t]['superseded']:,})"
                           for t in ("trees", "credits", "metrics")))
        console.print(runs)


@store_app.command("validate")
def store_validate(store: StoreOpt) -> None:
    """Read every committed byte: file sizes, page checksums, and every tree rule."""
    from rollout_store import SchemaMismatchError, Store, StoreError
    from rollout_store.maintenance import verify

    try:
        report = verify(Store(store))
    except (StoreError, SchemaMismatchError) as exc:
        err.print(f"[red]problem:[/] {exc}", highlight=False)
        raise typer.Exit(1) from None
    for problem in report.problems:
        err.print(f"[red]problem:[/] {problem}", highlight=False)
    if not report.ok:
        raise typer.Exit(1)
    console.print(f"ok: {report.files_checked} files and {report.trees_checked} trees checked")


@store_app.command("compact")
def store_compact(
    store: StoreOpt,
    vacuum: Annotated[bool, typer.Option(help="Also delete unreferenced files.")] = True,
    retention_hours: Annotated[int, typer.Option(
        help="Vacuum keeps unreferenced files younger than this (min 1): appends in "
             "flight and readers pinned to older versions need them.")] = 168,
    target_size: Annotated[int | None, typer.Option(help="Target file size in bytes.")] = None,
) -> None:
    """Merge small files (safe while collectors append), then vacuum old unreferenced files."""
    from rollout_store.maintenance import compact
    from rollout_store.maintenance import vacuum as run_vacuum

    require(target_size is None or target_size > 0,
            f"--target-size must be a positive number of bytes, got {target_size}")
    require(not vacuum or retention_hours >= 1,
            f"--retention-hours must be at least 1, got {retention_hours}")
    s = _open(store)
    for name, m in compact(s, target_size).items():
        console.print(f"{name}: {m['numFilesRemoved']} files -> {m['numFilesAdded']}")
    if vacuum:
        try:
            removed = run_vacuum(s, retention_hours)
        except ValueError as exc:
            fail(str(exc))
        console.print(f"vacuum: removed {len(removed)} unreferenced files "
                      f"older than {retention_hours} h")


class SqlFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


@app.command("sql")
def sql(
    query: Annotated[str, typer.Argument(help="SQL over the views trees, nodes, snapshots, "
                                              "credits, mc_references, metrics, paths, siblings.")],
    store: Annotated[Path | None, typer.Option("--store", help="Store directory.")] = None,
    stores: Annotated[str | None, typer.Option(
        "--stores", help="Comma-separated store directories: every view is the union of "
                         "theirs, with a first column `store` (the directory as given).")
    ] = None,
    fmt: Annotated[SqlFormat, typer.Option("--format", help="Output format.")] = SqlFormat.table,
    version: Annotated[int | None, typer.Option(
        help="Time travel: read the store as of this trees-table version.")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Check every file's page checksums first (DuckDB does not).")] = False,
    timeout: Annotated[float, typer.Option(
        help="Wall-clock limit of the query in seconds; past it the query is stopped "
             "(error: query exceeded N s).")] = 60.0,
    memory: Annotated[str, typer.Option(
        help="DuckDB memory limit of the query (e.g. 512MB, 2GB).")] = "2GB",
    temp_disk: Annotated[str, typer.Option(
        help="Let a query larger than --memory spill up to this much (e.g. 4GB) into a "
             "private temporary directory, removed afterwards; 0: never spill (nothing "
             "is written to disk).")] = "0",
    rss_growth: Annotated[str, typer.Option(
        help="How much this process's memory may grow while the query runs (e.g. 1GB): "
             "--memory bounds DuckDB's buffers, not the strings a query builds; past it "
             "the query is stopped (error: query exceeded the process memory "
             "limit).")] = "4GB",
) -> None:
    """Run read-only SQL (SELECT, EXPLAIN) over the store's DuckDB views: it reads the
    store's committed files and nothing else, within --timeout, --memory, --temp-disk and
    --rss-growth. Stored text is printed with control characters escaped (\\n, \\x1b,
    \\x00; ``rollout_store.textsafe.printable``) in every format: JSON through its own
    escapes, CSV and the table as printable text (exact values: --format json). With
    --stores A,B,... the query runs over all of them at once (their latest versions),
    e.g. which sampler gave the best success across runs kept in separate stores."""
    import tempfile

    import duckdb
    from rich.text import Text

    from rollout_store import StoreError, connect
    from rollout_store.reader import run_query
    from rollout_store.sqlguard import QueryLimits
    from rollout_store.textsafe import printable, printable_json, printable_table

    require(timeout > 0, f"--timeout must be a positive number of seconds, got {timeout}")
    require((store is None) != (stores is None), "give --store or --stores (not both)")
    names = [] if stores is None else [n.strip() for n in stores.split(",")]
    require(stores is None or (all(names) and len(set(names)) == len(names) >= 1),
            f"--stores is a comma-separated list of distinct store directories, got {stores!r}")
    require(stores is None or (version is None and not verify),
            "--version and --verify read one store; use --store")
    spill = temp_disk.strip() not in ("", "0", "0B", "0b")
    try:
        with tempfile.TemporaryDirectory(prefix="rtrees-sql-") as tmp:
            limits = QueryLimits(timeout_s=timeout, memory=memory,
                                 temp_directory=tmp if spill else None, temp_disk=temp_disk,
                                 rss_growth=rss_growth)
            if store is not None:
                con = connect(_open(store), version, verify_checksums=verify,
                              restricted=True, limits=limits)
            else:
                from rollout_store.reader import connect_stores

                con = connect_stores({n: _open(Path(n)) for n in names}, restricted=True,
                                     limits=limits)
            try:
                data = run_query(con, query, limits)
            finally:
                con.close()  # before the temporary directory goes
    except (duckdb.Error, StoreError, ValueError) as exc:
        fail(printable(str(exc), newlines=True))  # DuckDB quotes stored values in errors
    if fmt is SqlFormat.json:
        print(printable_json(data.to_pylist()))
    elif fmt is SqlFormat.csv:
        import pyarrow.csv as pacsv

        pacsv.write_csv(printable_table(csv_ready(data)), sys.stdout.buffer)
    else:
        shown = printable_table(data)
        table = Table()
        for name in shown.column_names:
            table.add_column(Text(name))
        for row in shown.to_pylist():  # Text: a stored "[red]" is text, not rich markup
            table.add_row(*(Text("NULL" if v is None else str(v)) for v in row.values()))
        console.print(table)


def csv_ready(data: pa.Table) -> pa.Table:
    """``data`` with every nested column (lists, structs, maps) as a JSON text column:
    CSV has no nested values (issue 10: ``token_values`` crashed the writer)."""
    import pyarrow as pa

    columns = []
    for field, column in zip(data.schema, data.columns, strict=True):
        if pa.types.is_nested(field.type):
            column = pa.array([None if v is None else json.dumps(v, default=str)
                               for v in column.to_pylist()], pa.string())
        columns.append(column)
    return pa.table(columns, names=data.column_names)


class ImportFormat(StrEnum):
    verl_jsonl = "verl-jsonl"
    trl_parquet = "trl-parquet"
    atif = "atif"


@app.command("import")
def import_dumps(
    paths: Annotated[list[Path], typer.Argument(help="Dump files to ingest.")],
    store: StoreOpt,
    fmt: Annotated[ImportFormat, typer.Option("--format", help="Source format.")],
    reward_columns: Annotated[str | None, typer.Option(
        help="TRL: comma-separated reward columns (default: every numeric column that is "
             "not step or advantage).")] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id for the imported trees.")] = None,
    max_mib: Annotated[float, typer.Option(
        "--max-mib", help="Largest file read, in MiB (a bigger one is refused).")] = 256.0,
) -> None:
    """Ingest verl rollout_data_dir JSONL or TRL completions Parquet as one-level trees, or
    ATIF trajectories (files or folders, e.g. `rtrees export --format atif`) as one tree
    each: the prompt, then one node per agent step. Only regular files of at most
    --max-mib are read; a malformed field is one error line naming it, nothing stored."""
    import math

    from rollout_store.import_atif import import_atif_files
    from rollout_store.import_checks import DumpImportError
    from rollout_store.importers import import_files

    if not (max_mib > 0 and math.isfinite(max_mib)):
        fail(f"--max-mib must be a positive number, got {max_mib}")
    max_bytes = int(max_mib * 2**20)
    s = _open(store, create=True)
    if fmt is ImportFormat.atif:
        try:
            done = import_atif_files(s, [str(p) for p in paths], run_id, max_bytes=max_bytes)
        except (DumpImportError, OSError) as exc:
            fail(str(exc))
        console.print(f"atif: {done.rows.get('trees', 0)} trees imported"
                      + (" (already stored)" if done.already_committed else ""), markup=False)
        return
    try:
        reports = import_files(s, [str(p) for p in paths], fmt.value, run_id=run_id,
                               reward_columns=None if reward_columns is None
                               else [c.strip() for c in reward_columns.split(",") if c.strip()],
                               max_bytes=max_bytes)
    except DumpImportError as exc:
        fail(str(exc))
    for r in reports:
        console.print(r.summary(), markup=False)


@app.command("credit")
def credit(
    store: StoreOpt,
    method: Annotated[str, typer.Option(help="Estimator name (grpo, tree_grpo, elpo, caliper, "
                                              "slca, trace, dsc).")],
    param: Annotated[list[str] | None, typer.Option(
        "--param", help="Hyperparameter KEY=VALUE (repeatable).")] = None,
    run_id: Annotated[str | None, typer.Option(help="Run id recorded with the credit.")] = None,
) -> None:
    """Compute credit for every stored tree that lacks it (keyed by method and params hash)."""
    from train.credit.store_io import CreditError
    from train.scoring import score_and_credit

    pairs = parse_params(param)
    try:
        report = score_and_credit(_open(store), method, pairs, run_id=run_id)
    except CreditError as exc:
        fail(str(exc))
    console.print(report.summary(), markup=False)


@app.command("demo")
def demo(
    store: Annotated[Path | None, typer.Option(help="Store directory.")] = None,
    out: Annotated[Path | None, typer.Option(help="Report directory.")] = None,
    env: Annotated[str | None, typer.Option(help="Environment (calc or workflow).")] = None,
    tasks: Annotated[int | None, typer.Option(help="Tasks collected per sampler.")] = None,
    n_total: Annotated[int | None, typer.Option(help="Rollout budget per tree.")] = None,
    k: Annotated[int | None, typer.Option(help="Rollouts per Mean@k reference.")] = None,
    steps: Annotated[int | None, typer.Option(help="Training iterations.")] = None,
    tasks_per_step: Annotated[int | None, typer.Option(
        help="Fresh trees per training iteration.")] = None,
    reuse_per_step: Annotated[int | None, typer.Option(
        help="Stored trees reused per training iteration.")] = None,
    heldout_tasks: Annotated[int | None, typer.Option(help="Held-out tasks.")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed.")] = None,
) -> None:
    """The main job: tiny policy, collect (group, bel, caliper), credit (grpo, tree_grpo,
    elpo, caliper, trace), Mean@32 ranking audit, a short training run reusing the stored trees
    (--reuse transport) with held-out success before and after; report in OUT. A rerun reuses
    everything that exists."""
    from train.demo import DemoConfig, run_demo_job
    from train.jobs import JobError

    given: dict[str, Any] = {
        "store": store, "out": out, "env": env, "tasks": tasks, "n_total": n_total, "k": k,
        "train_steps": steps, "tasks_per_step": tasks_per_step,
        "reuse_per_step": reuse_per_step, "heldout_tasks": heldout_tasks, "seed": seed}
    try:
        config = DemoConfig(**{name: v for name, v in given.items() if v is not None})
    except ValueError as exc:
        fail(str(exc))
    try:
        run_demo_job(config, console=console)
    except JobError as exc:
        fail(str(exc))


@store_app.command("demo")
def store_demo(
    store: StoreOpt = Path("out/store-synthetic"),
    trees: Annotated[int, typer.Option(help="Synthetic BEL-shaped trees to write.")] = 2000,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """The store tour: write synthetic BEL-shaped trees, compact, query, validate (no
    policy needed)."""
    from rollout_store.demo import run_demo

    try:
        run_demo(store, n_trees=trees, seed=seed, console=console)
    except ValueError as exc:
        fail(str(exc))


def main() -> None:  # pragma: no cover - console-script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
