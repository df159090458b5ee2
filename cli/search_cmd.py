"""``rtrees search``: text by regex, token-id runs across node boundaries (issue 26)."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cli._common import console, fail, require


class SearchFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


def search_command(
    store: Annotated[Path, typer.Option("--store", help="Store directory (read only).")],
    regex: Annotated[str | None, typer.Option(
        "--regex", help="RE2 pattern over action and observation text: one hit per node "
                        "and field, with the character offset of the first match.")] = None,
    tokens: Annotated[str | None, typer.Option(
        "--tokens", help="Comma-separated token ids: every place they occur in a row along "
                         "a root-to-leaf path (crossing node boundaries): tree, start node, "
                         "offset in its tokens (action then observation), end node.")] = None,
    limit: Annotated[int, typer.Option(help="Hits printed at most (the total is counted).")
                     ] = 100,
    fmt: Annotated[SearchFormat, typer.Option("--format", help="Output format.")
                   ] = SearchFormat.table,
) -> None:
    """Search the stored trees: --regex over node text or --tokens for a token-id run."""
    import duckdb

    from rollout_store import SchemaMismatchError, Store, StoreError
    from rollout_store.search import search_regex, search_tokens

    require((regex is None) != (tokens is None), "give exactly one of --regex or --tokens")
    require(limit >= 1, f"--limit must be at least 1, got {limit}")
    ids: list[int] = []
    if tokens is not None:
        try:
            ids = [int(t) for t in tokens.split(",") if t.strip()]
        except ValueError:
            fail(f"--tokens {tokens!r}: expected comma-separated integer token ids")
        require(bool(ids), "--tokens: give at least one token id")
    try:
        s = Store(store)
        result = (search_regex(s, regex, limit) if regex is not None
                  else search_tokens(s, ids, limit))
    except duckdb.Error as exc:
        fail(f"--regex {regex!r}: {str(exc).splitlines()[0]}")
    except (StoreError, SchemaMismatchError, ValueError) as exc:
        fail(str(exc))
    if fmt is SearchFormat.json:
        print(json.dumps({"total": result.total, "hits": result.hits.to_pylist()}))
    elif fmt is SearchFormat.csv:
        import pyarrow.csv as pacsv

        pacsv.write_csv(result.hits, sys.stdout.buffer)
    else:
        from rich.table import Table

        table = Table(title=result.summary())
        for name in result.hits.column_names:
            table.add_column(name)
        for row in result.hits.to_pylist():
            table.add_row(*(str(v) for v in row.values()))
        console.print(table)


def register(app: typer.Typer) -> None:
    app.command("search")(search_command)
