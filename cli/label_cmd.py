"""``rtrees label``: put labels on a tree or a node (issue 26)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli._common import ParamError, console, fail, split_params


def label_command(
    store: Annotated[Path, typer.Option("--store", help="Store directory.")],
    tree: Annotated[str, typer.Option("--tree", help="The labelled tree's id.")],
    node: Annotated[int | None, typer.Option(
        "--node", help="A node of the tree (default: the whole tree).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Label KEY=VALUE (repeatable); the last write of a key wins.")] = None,
    clear: Annotated[list[str] | None, typer.Option(
        "--clear", help="Clear the label KEY (repeatable; the history keeps it).")] = None,
    author: Annotated[str | None, typer.Option(
        help="Author recorded (default: $RTREES_AUTHOR or the login name).")] = None,
) -> None:
    """Label a tree or one of its nodes (append-only: `rtrees sql` reads the history in
    labels and the current labels in labels_latest; the viewer shows them). A key is 1 to
    100 characters, a value at most 10,000, an author 1 to 100; none may hold control,
    line-separator or bidi characters (newline, NUL, ESC, U+202E...): refused in one line,
    nothing written."""
    from rollout_store import SchemaMismatchError, Store, StoreError
    from rollout_store.labels import write_labels
    from rollout_store.schema import MAX_NODE_ID
    from rollout_store.textsafe import printable

    if node is not None and not 0 <= node <= MAX_NODE_ID:
        fail(f"--node {node}: a node id is an integer in 0..{MAX_NODE_ID}")
    try:
        values: dict[str, str | None] = dict(split_params(set_, "--set"))
    except ParamError as exc:
        fail(str(exc))
    for key in clear or []:
        if key.strip() in values:
            fail(f"--clear {key!r}: also given to --set")
        values[key] = None
    if not values:
        fail("give at least one --set KEY=VALUE or --clear KEY")
    try:
        report = write_labels(Store(store), tree, node, values, author)
    except (StoreError, SchemaMismatchError, ValueError) as exc:
        fail(str(exc))
    target = f"tree {printable(tree)}" + ("" if node is None else f" node {node}")
    console.print(f"{target}: {report.rows.get('labels', 0)} label rows written", markup=False)


def register(app: typer.Typer) -> None:
    app.command("label")(label_command)
