"""``rtrees search``: text by regex, token-id runs across node boundaries (issue 26)."""

from __future__ import annotations

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
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds a --regex search may run (then it is stopped with an "
                          "error).")] = 30.0,
    no_index: Annotated[bool, typer.Option(
        "--no-index", help="--tokens: read the nodes table, neither reading nor writing "
                           "the store's .search-index (a store you may not write is never "
                           "written anyway).")] = False,
) -> None:
    """Search the stored trees: --regex over node text (a pattern of at most 1,000
    characters, stopped after --timeout seconds) or --tokens for a token-id run (at most
    1,000 ids). Stored text is printed with control characters escaped (\\n, \\x1b)."""
    import duckdb

    from rollout_store import SchemaMismatchError, Store, StoreError
    from rollout_store.search import MAX_PATTERN, search_regex, search_tokens
    from rollout_store.textsafe import printable_json, printable_table

    require((regex is None) != (tokens is None), "give exactly one of --regex or --tokens")
    require(limit >= 1, f"--limit must be at least 1, got {limit}")
    require(timeout > 0, f"--timeout must be > 0 seconds, got {timeout}")
    if regex is not None:
        require(len(regex) <= MAX_PATTERN, f"--regex: a pattern of {len(regex):,} "
                                            f"characters; at most {MAX_PATTERN:,}")
    ids: list[int] = []
    if tokens is not None:
        try:
            ids = [int(t) for t in tokens.split(",") if t.strip()]
        except ValueError:
            fail(f"--tokens {_short(tokens)}: expected comma-separated integer token ids")
        require(bool(ids), "--tokens: give at least one token id")
    try:
        s = Store(store)
        result = (search_regex(s, regex, limit, timeout_s=timeout) if regex is not None
                  else search_tokens(s, ids, limit, cache=not no_index))
    except duckdb.Error as exc:
        fail(f"--regex {_short(regex or '')}: {str(exc).splitlines()[0]}")
    except (StoreError, SchemaMismatchError, ValueError) as exc:
        fail(str(exc))
    hits = printable_table(result.hits)  # stored text: control characters escaped
    if fmt is SearchFormat.json:
        print(printable_json({"total": result.total, "hits": result.hits.to_pylist()}))
    elif fmt is SearchFormat.csv:
        import pyarrow.csv as pacsv

        pacsv.write_csv(hits, sys.stdout.buffer)
    else:
        from rich.table import Table
        from rich.text import Text

        table = Table(title=result.summary())
        for name in hits.column_names:
            table.add_column(name)
        for row in hits.to_pylist():  # Text: stored text is never read as rich markup
            table.add_row(*(Text(str(v)) for v in row.values()))
        console.print(table)


def _short(text: str, keep: int = 80) -> str:
    """``repr(text)`` cut to ``keep`` characters: an error names the option's value
    without printing a 1,000-character pattern back (``repr`` escapes control characters)."""
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text):,} characters)"


def register(app: typer.Typer) -> None:
    app.command("search")(search_command)
