"""``rtrees view``: the store in a local web page, or as a static HTML file (issue 26)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli._common import fail, require


def view_command(
    store: Annotated[Path, typer.Option("--store", help="Store directory (read only).")],
    port: Annotated[int, typer.Option(
        help="Port on 127.0.0.1 (0: a free one). The page is reachable from this machine "
             "only.")] = 0,
    export: Annotated[Path | None, typer.Option(
        "--export", help="Write the page for the selected trees as DIR/index.html (one "
                         "static file, opens offline) instead of serving it.")] = None,
    run: Annotated[str | None, typer.Option(
        "--run", help="With --export: the trees of this run (and its metrics).")] = None,
    where: Annotated[str | None, typer.Option(
        "--where", help="With --export: an SQL WHERE expression over trees (plus reward, "
                        "max_reward, leaves), as in the page's filter.")] = None,
    tree: Annotated[list[str] | None, typer.Option(
        "--tree", help="With --export: a tree id (repeatable).")] = None,
    max_trees: Annotated[int, typer.Option(
        "--max-trees", help="With --export: refuse more trees than this.")] = 500,
    labels: Annotated[bool, typer.Option(
        help="Let the page append labels (its only write); --no-labels serves it "
             "strictly read-only.")] = True,
) -> None:
    """Serve a read-only page over the store on 127.0.0.1: runs and trees (filter by an SQL
    WHERE over trees), one tree drawn with its node panel (text, coloured tokens, credit
    under every method, Mean@k, snapshot), two methods compared, a run's metrics plotted.
    Ctrl-C stops it. With --export, write the same page for one run or a set of trees as
    a static HTML file instead."""
    from rollout_store import SchemaMismatchError, Store, StoreError

    require(0 <= port <= 65_535, f"--port must be in 0..65535, got {port}")
    require(max_trees >= 1, f"--max-trees must be at least 1, got {max_trees}")
    if export is None:
        require(run is None and where is None and not tree,
                "--run, --where and --tree select trees for --export; the page filters "
                "them itself")
    try:
        s = Store(store)
    except (StoreError, SchemaMismatchError) as exc:
        fail(str(exc))
    if export is not None:
        from analysis.viewer.export import export_static

        try:
            report = export_static(s, export, run_id=run, where=where, tree_ids=tree,
                                   max_trees=max_trees)
        except (ValueError, OSError) as exc:  # FilterError is a ValueError
            fail(str(exc))
        print(report.summary(), flush=True)
        return
    from analysis.viewer import serve

    def ready(url: str) -> None:
        print(f"serving {s.path} on {url} ({'labels writable' if labels else 'read only'}; "
              "Ctrl-C stops)", flush=True)

    try:
        serve(s, port, on_ready=ready, labels=labels)
    except OSError as exc:  # the port is taken, or not ours to bind
        fail(f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        print("stopped", flush=True)


def register(app: typer.Typer) -> None:
    app.command("view")(view_command)
