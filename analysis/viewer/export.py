"""``rtrees view --export DIR``: the viewer's page as one static HTML file, for a report.

``export_static`` answers, ahead of time, every question the page can ask about the
selected trees (one run, a checked ``WHERE`` over ``trees``, or tree ids): the run and
tree lists, each tree, each pair of its credit methods compared, and the metrics of the
runs listed. The answers are embedded in ``DIR/index.html`` with the script and
stylesheet inlined, so the file opens from disk, offline, with nothing else beside it.
The SQL filter box is disabled there (no store to run it on).

``export_compare`` writes the N-way compare of issue 48 the same way: the trajectories'
columns (``/api/paths``), the trees they come from (each browsable as above), and a hint
(``/api/view``) that opens the page on the comparison.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import permutations
from pathlib import Path
from typing import Any

from analysis.viewer.data import ViewerData, ViewerStores
from analysis.viewer.server import page_html
from rollout_store.store import Store

MAX_TREES = 500  # default cap: every tree's answers are embedded in one HTML file


def static_key(path: str, **params: str | None) -> str:
    """The lookup key of one answer (``staticKey`` in ``viewer.js``): the route, then
    ``name=value`` for each non-empty parameter in name order, joined by ``|``."""
    return "|".join([path, *(f"{k}={v}" for k, v in sorted(params.items()) if v)])


@dataclass(frozen=True)
class ExportReport:
    """What ``export_static`` wrote."""

    path: Path
    trees: int
    runs: int
    bytes: int

    def summary(self) -> str:
        return (f"wrote {self.path}: {self.trees} trees, {self.runs} runs, "
                f"{self.bytes:,} bytes (open it in a browser; no server needed)")


def export_static(store: Store | str | Path, out: str | Path, *, run_id: str | None = None,
                  where: str | None = None, tree_ids: list[str] | None = None,
                  max_trees: int = MAX_TREES, force: bool = False) -> ExportReport:
    """Write ``out/index.html`` for the trees of ``run_id`` and/or matching ``where`` (both
    optional; checked like the page's filter) or exactly ``tree_ids``. ``ValueError``
    when nothing or more than ``max_trees`` trees are selected, or a tree id is unknown;
    ``FileExistsError`` when ``out/index.html`` exists (checked first, and again by the
    exclusive create) and ``force`` does not allow overwriting it."""
    target = Path(out) / "index.html"
    exists = FileExistsError(f"{target} exists: pass --force to overwrite it")
    if not force and (target.exists() or target.is_symlink()):
        raise exists
    data = ViewerData(store)
    if tree_ids:
        listed = data.trees(None, None, limit=10**9)["trees"]
        by_id = {t["tree_id"]: t for t in listed}
        unknown = [t for t in tree_ids if t not in by_id]
        if unknown:
            raise ValueError(f"no tree {unknown[0]!r} in {data.store.path}")
        rows = [by_id[t] for t in dict.fromkeys(tree_ids)]
        if run_id:
            rows = [r for r in rows if r["run_id"] == run_id]
    else:
        found = data.trees(where, run_id, limit=max_trees)
        if found["truncated"]:
            raise ValueError(f"more than --max-trees {max_trees} trees selected (every tree "
                             "is embedded in the page): narrow --run or --where")
        rows = found["trees"]
    if not rows:
        raise ValueError("no tree selected (check --run, --where, --tree)")
    if len(rows) > max_trees:
        raise ValueError(f"{len(rows)} trees selected, more than --max-trees {max_trees} "
                         "(every tree is embedded in the page)")
    answers = tree_answers(data, rows, {run_id} if run_id else set())
    runs = answers[static_key("/api/runs")]
    size = _write(target, answers, force, exists)
    return ExportReport(target, len(rows), len(runs), size)


def _write(target: Path, answers: dict[str, Any], force: bool, exists: FileExistsError
           ) -> int:
    """Write the page with ``answers`` embedded; its size in bytes."""
    # NaN stays NaN: the answers are a JavaScript literal, not JSON; no server, no token
    html = page_html("", json.dumps(answers, default=str), inline=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # "x" refuses a file that appeared since the check above (unless --force)
    try:
        with target.open("w" if force else "x", encoding="utf-8") as f:
            f.write(html)
    except FileExistsError:
        raise exists from None
    return len(html.encode())


def tree_answers(data: ViewerData, rows: list[dict[str, Any]], run_ids: set[str],
                 store: str | None = None) -> dict[str, Any]:
    """The answers the page can ask about tree rows ``rows`` of ``data`` (and the runs
    ``run_ids`` beside theirs): summary, runs, tree lists, trees, credit compares, metrics;
    keyed with ``store`` (a name of ``/api/stores``; None: the default store)."""
    answers: dict[str, Any] = {static_key("/api/summary", store=store): data.summary()}
    run_ids = run_ids | {r["run_id"] for r in rows}
    runs = [dict(r, trees=sum(t["run_id"] == r["run_id"] for t in rows))
            for r in data.runs() if r["run_id"] in run_ids]
    answers[static_key("/api/runs", store=store)] = runs
    answers[static_key("/api/trees", store=store)] = {"trees": rows, "truncated": False}
    for r in runs:
        answers[static_key("/api/trees", run=r["run_id"], store=store)] = {
            "trees": [t for t in rows if t["run_id"] == r["run_id"]], "truncated": False}
        if r["metrics"]:
            answers[static_key("/api/metrics", run=r["run_id"], store=store)] = \
                data.metrics(r["run_id"])
    for t in rows:
        tid = t["tree_id"]
        tree = data.tree(tid)
        answers[static_key("/api/tree", id=tid, store=store)] = tree
        for a, b in permutations(tree["methods"], 2):
            answers[static_key("/api/compare", tree=tid, a=a, b=b, store=store)] = \
                data.compare(tid, a, b, tree)
    return answers


def export_compare(stores: ViewerStores | ViewerData | Store | str | Path,
                   specs: list[tuple[str | None, str, int | None]], out: str | Path, *,
                   force: bool = False) -> ExportReport:
    """Write ``out/index.html``: the trajectories ``specs`` (``(store, tree_id, leaf)``,
    as ``ViewerStores.compare`` takes them) in columns by step, and their trees, as one
    static page that opens on the comparison. ``KeyError`` for an unknown store, tree or
    node, ``ValueError`` for bad ``specs``; ``FileExistsError`` as ``export_static``."""
    target = Path(out) / "index.html"
    exists = FileExistsError(f"{target} exists: pass --force to overwrite it")
    if not force and (target.exists() or target.is_symlink()):
        raise exists
    stores = ViewerStores.of(stores)
    # the page's key: JSON.stringify's text (no spaces, non-ASCII as is)
    key = json.dumps([list(s) for s in specs], separators=(",", ":"), ensure_ascii=False)
    compared = stores.compare(specs)
    answers: dict[str, Any] = {}
    names = list(stores.by_name)
    for name in names:
        wanted = {tree_id for store, tree_id, _ in specs if (store or names[0]) == name}
        if not wanted and name != names[0]:
            continue
        data = stores.by_name[name]
        listed = {t["tree_id"]: t for t in data.trees(None, None, limit=10**9)["trees"]}
        rows = [listed[t] for t in sorted(wanted) if t in listed]
        answers.update(tree_answers(data, rows, set(), None if name == names[0] else name))
    answers[static_key("/api/stores")] = stores.summary()
    answers[static_key("/api/paths", paths=key)] = compared
    answers[static_key("/api/view")] = {"paths": key}
    size = _write(target, answers, force, exists)
    return ExportReport(target, len({(s, t) for s, t, _ in specs}), 0, size)
