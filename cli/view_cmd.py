"""``rtrees view``: the store in a local web page (issue 26)."""

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
) -> None:
    """Serve a read-only page over the store on 127.0.0.1: runs and trees (filter by an SQL
    WHERE over trees), one tree drawn with its node panel (text, coloured tokens, credit
    under every method, Mean@k, snapshot), two methods compared, a run's metrics plotted.
    Ctrl-C stops it."""
    from rollout_store import SchemaMismatchError, Store, StoreError

    require(0 <= port <= 65_535, f"--port must be in 0..65535, got {port}")
    try:
        s = Store(store)
    except (StoreError, SchemaMismatchError) as exc:
        fail(str(exc))
    from analysis.viewer import serve

    def ready(url: str) -> None:
        print(f"serving {s.path} on {url} (read only; Ctrl-C stops)", flush=True)

    try:
        serve(s, port, on_ready=ready)
    except OSError as exc:  # the port is taken, or not ours to bind
        fail(f"cannot serve on 127.0.0.1:{port}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        print("stopped", flush=True)


def register(app: typer.Typer) -> None:
    app.command("view")(view_command)
