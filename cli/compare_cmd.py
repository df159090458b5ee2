"""``rtrees diff`` and ``rtrees compare``: siblings at their branch point, trajectories by
step (issue 48). Both read through the viewer's locked, pinned connection
(``analysis.viewer.data``) and print what ``analysis.compare`` returns: text for a
terminal (differing tokens highlighted, stored text with control characters escaped) or
``--json``; ``compare --export DIR`` writes the comparison as one static HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from cli._common import console, fail, require

DIFF_STYLE = "bold black on yellow"  # a differing token run, in the terminal


def _open(stores: list[Path]) -> Any:
    """``ViewerStores`` of the given store directories (named as given); one line when
    one is not a store."""
    from analysis.viewer.data import ViewerStores
    from rollout_store import SchemaMismatchError, Store, StoreError

    opened: dict[str, Any] = {}
    for path in stores:
        try:
            opened[str(path)] = Store(path)
        except (StoreError, SchemaMismatchError) as exc:
            fail(str(exc))
    try:
        return ViewerStores(opened)
    except (StoreError, ValueError) as exc:
        fail(str(exc))


def _action(segments: list[dict[str, Any]]) -> Text:
    from rollout_store.textsafe import printable

    out = Text()
    for seg in segments:  # Text: a stored "[red]" stays text, never rich markup
        out.append(printable(seg["text"], newlines=True), DIFF_STYLE if seg["diff"] else "")
    return out


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _print_steps(steps: list[dict[str, Any]], parts: tuple[int | None, int | None]) -> None:
    from rollout_store.textsafe import printable

    for i, s in enumerate(steps):
        marks = [m for m, at in (("actions part", parts[0]), ("outcomes part", parts[1]))
                 if at == i]
        head = Text(f"  step {i} (node {s['node']}, depth {s['depth']}, {s['tokens']} tokens"
                    + (f", reward {_num(s['reward'])}" if s["reward"] is not None else "")
                    + (", credit " + " ".join(f"{m}={_num(v)}" for m, v in s["credit"].items())
                       if s["credit"] else "") + ")" + (" <- " + ", ".join(marks) if marks
                                                         else ""), style="dim")
        console.print(head)
        line = Text("    action: ")
        line.append_text(_action(s["action"]))
        console.print(line, soft_wrap=True)
        if s["observation"]:
            console.print(Text("    observation: " + printable(s["observation"],
                                                                newlines=True)),
                          soft_wrap=True)


def diff_command(
    store: Annotated[Path, typer.Option("--store", help="Store directory (read only).")],
    tree: Annotated[str, typer.Option("--tree", help="Tree id.")],
    node: Annotated[int, typer.Option("--node", help="A branching node of the tree.")],
    ref: Annotated[int | None, typer.Option(
        "--ref", help="The child the others are diffed against (default: the first).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """A branching node's children side by side, aligned at the branch point: each
    child's continuation (the child, then its first child at each step, down to a leaf)
    with its subtree's leaves and mean reward, Mean@k references, credit under every
    stored method, the tokens where its actions differ from the reference child's
    (highlighted), and the first step where the actions and the outcomes part."""
    require(node >= 0, f"--node must be a node id (>= 0), got {node}")
    stores = _open([store])
    try:
        res = stores.first.sibling_diff(tree, node, ref)
    except KeyError as exc:
        fail(str(exc.args[0]) if exc.args else "not found")
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        from rollout_store.textsafe import printable_json

        print(printable_json(res))
        return
    from rollout_store.textsafe import printable

    console.print(Text(f"tree {printable(res['tree_id'])} (run {printable(res['run_id'] or '-')}, "
                       f"task {printable(res['task_id'] or '-')}): node {res['node']} at depth "
                       f"{res['depth']} has {len(res['columns'])} children; reference child "
                       f"{res['reference']}; first action difference at step "
                       f"{res['first_action_difference']}, first outcome difference at step "
                       f"{res['first_outcome_difference']}"), soft_wrap=True)
    last = res["prefix"][-1]
    console.print(Text("shared prefix ends with: " + printable(last["action"] or
                                                               last["observation"])[:200]),
                  soft_wrap=True)
    for col in res["columns"]:
        mc = "; ".join(f"Mean@{r['k']}={_num(r['mean'])}" for r in col["mc"]) or "none"
        credit = " ".join(f"{m}={_num(v)}" for m, v in col["credit"].items()) or "none"
        console.print(Text(f"child {col['child']}: {col['leaves']} leaves, {col['successes']} "
                           f"successes, mean reward {_num(col['reward'])}; Mean@k {mc}; "
                           f"credit {credit}; actions part at step {col['action_parts_at']}, "
                           f"outcomes at step {col['outcome_parts_at']}", style="bold"),
                      soft_wrap=True)
        _print_steps(col["steps"], (col["action_parts_at"], col["outcome_parts_at"]))


def parse_path(spec: str, names: list[str]) -> tuple[str | None, str, int | None]:
    """``[STORE@]TREE[:LEAF]`` -> (store, tree, leaf): STORE one of ``names`` (the
    ``--store`` values as given), LEAF an integer; no LEAF: the tree's best leaf."""
    store: str | None = None
    head, sep, tail = spec.partition("@")
    if sep and head in names:
        store, spec = head, tail
    tree, sep, leaf = spec.rpartition(":")
    if sep and leaf.isdigit() and tree:
        return store, tree, int(leaf)
    return store, spec, None


def compare_command(
    store: Annotated[list[Path], typer.Option(
        "--store", help="Store directory (read only); repeat to compare across stores.")],
    path: Annotated[list[str], typer.Option(
        "--path", help="A trajectory: [STORE@]TREE[:LEAF] (STORE as given to --store, "
                       "default the first; no LEAF: the tree's best leaf). Two or more.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    export: Annotated[Path | None, typer.Option(
        "--export", help="Write the comparison as DIR/index.html (one static file).")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="With --export: overwrite an existing DIR/index.html.")] = False,
) -> None:
    """Trajectories (the same task in other runs, policy versions, samplers or stores)
    in columns aligned by step (step i is depth i; the prompt is step 0), each diffed
    against the first: the tokens where its actions differ, and the first step where its
    actions and its outcomes part from the first's."""
    from analysis.viewer.server import MAX_PATHS

    require(2 <= len(path) <= MAX_PATHS, f"give 2 to {MAX_PATHS} --path, got {len(path)}")
    require(export is not None or not force, "--force overwrites the file of --export")
    stores = _open(store)
    specs = [parse_path(p, [str(s) for s in store]) for p in path]
    try:
        if export is not None:
            from analysis.viewer.export import export_compare

            report = export_compare(stores, specs, export, force=force)
            print(f"wrote {report.path}: {len(specs)} trajectories from {report.trees} trees, "
                  f"{report.bytes:,} bytes (open it in a browser; no server needed)")
            return
        res = stores.compare(specs)
    except KeyError as exc:
        fail(str(exc.args[0]) if exc.args else "not found")
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if as_json:
        from rollout_store.textsafe import printable_json

        print(printable_json(res))
        return
    from rollout_store.textsafe import printable

    for col in res["columns"]:
        console.print(Text(f"{printable(col['label'])}: run {printable(col['run_id'] or '-')}, "
                           f"sampler {printable(col['sampler'] or '-')}, policy "
                           f"{printable(col['policy_version'] or '-')}, reward "
                           f"{_num(col['reward'])}; actions part at step "
                           f"{col['action_parts_at']}, outcomes at step "
                           f"{col['outcome_parts_at']}", style="bold"), soft_wrap=True)
        _print_steps(col["steps"], (col["action_parts_at"], col["outcome_parts_at"]))


def register(app: typer.Typer) -> None:
    app.command("diff")(diff_command)
    app.command("compare")(compare_command)


__all__ = ["compare_command", "diff_command", "parse_path", "register"]
