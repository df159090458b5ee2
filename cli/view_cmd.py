"""``rtrees view``: the store in a local web page, or as a static HTML file (issue 26).

The page is its owner's alone (issue 50): the server prints its URL with a random access
token to stdout, and answers nothing without it (``analysis/viewer/server.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli._common import fail, require


def view_command(
    store: Annotated[list[Path], typer.Option(
        "--store", help="Store directory (read only); repeat to open several stores at once "
                        "(the page switches between them and compares across them).")],
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
    force: Annotated[bool, typer.Option(
        "--force", help="With --export: overwrite an existing DIR/index.html.")] = False,
    labels: Annotated[bool, typer.Option(
        help="Let the page append labels (its only write); --no-labels serves it "
             "strictly read-only.")] = True,
) -> None:
    """Serve a read-only page over the store on 127.0.0.1: runs and trees (filter by an SQL
    WHERE over trees), one tree drawn with its node panel (text, coloured tokens, credit
    under every method, Mean@k, snapshot), two methods compared, a run's metrics plotted.
    Only the printed URL opens it: it holds a random access token (keep it to yourself;
    other accounts of this machine get 403). From another machine, forward the port
    (ssh -L PORT:127.0.0.1:PORT host) and open the printed URL. Labels are written as
    the user the server runs as. Ctrl-C stops it. With --export, write the same page for
    one run or a set of trees as a static HTML file instead (no server, no token; an
    existing DIR/index.html is kept unless --force)."""
    from rollout_store import SchemaMismatchError, Store, StoreError

    require(0 <= port <= 65_535, f"--port must be in 0..65535, got {port}")
    require(max_trees >= 1, f"--max-trees must be at least 1, got {max_trees}")
    require(len(set(store)) == len(store), "a --store is given twice")
    require(export is None or len(store) == 1,
            "--export writes one store's trees: give one --store (rtrees compare --export "
            "writes a comparison across stores)")
    if export is None:
        require(run is None and where is None and not tree,
                "--run, --where and --tree select trees for --export; the page filters "
                "them itself")
        require(not force, "--force overwrites the file of --export; there is none here")
    opened: dict[str, Store] = {}
    for path in store:
        try:
            opened[str(path)] = Store(path)
        except (StoreError, SchemaMismatchError) as exc:
            fail(str(exc))
    s = next(iter(opened.values()))
    if export is not None:
        from analysis.viewer.export import export_static

        try:
            report = export_static(s, export, run_id=run, where=where, tree_ids=tree,
                                   max_trees=max_trees, force=force)
        except (ValueError, OSError) as exc:  # FilterError is a ValueError
            fail(str(exc))
        print(report.summary(), flush=True)
        return
    from analysis.viewer import serve

    def ready(url: str) -> None:  # url holds the access token: stdout, the owner's only
        print(f"serving {', '.join(opened)} on {url} "
              f"({'labels writable' if labels else 'read only'}; "
              "open this URL, it holds the access token; Ctrl-C stops)", flush=True)

    try:
        serve(opened, port, on_ready=ready, labels=labels)
    except OSError as exc:  # the port is taken, or not ours to bind
        fail(f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        print("stopped", flush=True)


def register(app: typer.Typer) -> None:
    app.command("view")(view_command)
