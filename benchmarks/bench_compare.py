"""Comparisons (issue 48): a wide sibling diff in the browser, and SQL across stores.

1. **Sibling diff in headless Chromium.** One tree: a prompt with ``--children`` leaves of
   ``--tokens`` token ids each (the tiny calc tokenizer's, so the viewer decodes them;
   every child equals the first but at one token). ``rtrees view`` serves it; Selenium
   opens the page and times, in the page (``performance.now``), ``loadSiblings``: the
   ``/api/siblings`` request (the server reads the tree, decodes, diffs every child
   against the first) plus building the grid, one forced layout and the next animation
   frame. Building the grid's DOM alone (no request, no layout) is shown beside it, and,
   as the same-run reference, opening the same tree in the existing tree view. Target: the
   diff renders in under 1 s (absolute; the ratio printed is to 1 s).
2. **Across stores.** ``--stores`` stores of about ``--nodes`` BEL-shaped nodes each (one
   run each), and one store holding the same batches (one append per part, so both sides
   read the same number of files). Each query runs over ``connect_stores`` (the union views
   of ``rtrees sql --stores``, restricted) and over ``connect`` of the one store
   (restricted), alternately, ``--repeat`` times, after checking both give the same rows:
   success per run (``trees`` joined with ``paths``, on ``store`` too over the union) and
   the ``siblings`` aggregate of ``bench_store_query.py``. Target: at most 1.5x the one-store query.

    .venv/bin/python benchmarks/bench_compare.py [--children 64 --tokens 2000]
        [--stores 10 --nodes 100000] [--repeat 5] [--skip-browser] [--skip-stores]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from _common import Timings, print_table, print_timings, timed, verdict

if TYPE_CHECKING:
    from rollout_store.tree import Tree

ROOT = Path(__file__).resolve().parents[1]
CALC = ROOT / "train" / "policies" / "checkpoints" / "calc"
NODES_PER_TREE = 47.2  # mean size of a 16-rollout, depth-6 BEL-shaped tree (bench_store_query)
# {name: SQL with {same_store}: "" over one store, the store join condition over the union}
QUERIES = {
    "success per run": "SELECT t.run_id, count(*) AS leaves, avg(p.reward) AS success "
                       "FROM trees t JOIN paths p ON p.tree_id = t.tree_id{same_store} "
                       "GROUP BY t.run_id ORDER BY t.run_id",
    "siblings aggregate": "SELECT count(*), sum(n_leaves), sum(n_success) FROM siblings",
}
RENDER_TARGET_S = 1.0
STORE_TARGET = 1.5

_TIME_DIFF = """
const done = arguments[arguments.length - 1];
const t0 = performance.now();
RTREES.loadSiblings(null).then(() => {
  document.getElementById("siblings-grid").offsetHeight;  // force layout
  requestAnimationFrame(() => done([performance.now() - t0,
                                    Number(document.body.dataset.siblingsMs)]));
}).catch((e) => done(["error", String(e)]));
"""
_TIME_TREE = """
const done = arguments[arguments.length - 1];
const t0 = performance.now();
RTREES.openTree("wide").then(() => {
  RTREES.selectNode(0);
  document.getElementById("tree-drawing").offsetHeight;
  requestAnimationFrame(() => done(performance.now() - t0));
}).catch((e) => done(String(e)));
"""


def wide_tree(children: int, tokens: int) -> Tree:
    """A prompt with ``children`` leaves of ``tokens`` calc-tokenizer ids, each equal to
    the first but at one token (as ``tests/compare_store.wide_tree``)."""
    from rollout_store.tree import Node, Tree

    base = [(7 * i) % 500 + 10 for i in range(tokens)]
    nodes = [Node(0, None, "prompt", observation_text="prompt")]
    for c in range(children):
        ids = list(base)
        if 0 < c < tokens:
            ids[c] = 3
        nodes.append(Node(c + 1, 0, "decision", action_text=f"answer {c}",
                          action_token_ids=ids, action_logprobs=[-0.1] * tokens,
                          action_entropies=[0.2] * tokens, terminal=True,
                          reward=float(c % 2 == 0)))
    return Tree("wide", nodes, run_id="wide", task_id="wide-task", env="calc",
                sampler="group", policy_ref=str(CALC))


def bench_browser(args: argparse.Namespace, tmp: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_viewer_browser import browser, make_driver

    from analysis.viewer.data import ViewerData
    from analysis.viewer.server import start
    from rollout_store import Store

    found = browser()
    if isinstance(found, str):
        print(f"sibling diff: skipped ({found})")
        return
    store = Store(tmp / "wide", create=True)
    store.append_trees([wide_tree(args.children, args.tokens)])
    data = ViewerData(store)
    server_side = Timings("server: sibling_diff (read, decode, diff)")
    for _ in range(args.repeat):
        server_side.seconds.append(timed(lambda: data.sibling_diff("wide", 0)))
    server, thread = start(store)
    driver = make_driver(found)
    total, render, tree = (Timings("page: /api/siblings + grid + layout"),
                           Timings("page: grid DOM only (no request)"),
                           Timings("reference: open the tree (tree view)"))
    try:
        driver.set_script_timeout(120)
        driver.get(server.login_url)
        deadline = time.monotonic() + 60
        while not driver.execute_script("return document.body.dataset.ready") \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        for _ in range(args.repeat):
            tree.seconds.append(driver.execute_async_script(_TIME_TREE) / 1000)
        for _ in range(args.repeat):
            got = driver.execute_async_script(_TIME_DIFF)
            if got[0] == "error":
                raise RuntimeError(got[1])
            total.seconds.append(got[0] / 1000)
            render.seconds.append(got[1] / 1000)
        cells = driver.execute_script(
            "return document.querySelectorAll('#siblings-grid .cell.step').length")
        marked = driver.execute_script(
            "return document.querySelectorAll('#siblings-grid .dseg').length")
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()
        thread.join(5)
    print(f"\nsibling diff: {args.children} children x {args.tokens} tokens; the page drew "
          f"{cells} step cells with {marked} differing runs highlighted")
    print_timings([total, render, server_side, tree], total)
    verdict(f"sibling diff of {args.children} x {args.tokens} tokens rendered in the page "
            f"(/api/siblings + grid; ratio to {RENDER_TARGET_S:g} s)",
            total.min / RENDER_TARGET_S, total.min < RENDER_TARGET_S, "< 1.00")


def bench_stores(args: argparse.Namespace, tmp: Path) -> None:
    from rollout_store import Store, connect
    from rollout_store.reader import connect_stores, run_query
    from rollout_store.synthetic import bel_shaped_batch

    n_trees = max(1, round(args.nodes / NODES_PER_TREE))
    one = Store(tmp / "all", create=True)
    parts: dict[str, Path] = {}
    nodes = 0
    t0 = time.perf_counter()
    for i in range(args.stores):
        batch = bel_shaped_batch(n_trees, seed=i, tree_prefix=f"s{i}-", run_id=f"run-{i}")
        nodes += batch.nodes.num_rows
        part = Store(tmp / f"part-{i}", create=True)
        part.append_trees(batch, key=f"part-{i}")
        one.append_trees(batch, key=f"part-{i}")
        parts[f"part-{i}"] = part.path  # type: ignore[assignment]
    print(f"\nacross stores: {args.stores} stores of {n_trees:,} trees "
          f"({nodes / args.stores:,.0f} nodes) each vs one store of {nodes:,} nodes "
          f"(written in {time.perf_counter() - t0:.1f} s)")
    connect_one = Timings("connect: one store")
    connect_many = Timings(f"connect: {args.stores} stores (union views)")
    con_one = con_many = None
    for _ in range(3):
        start = time.perf_counter()
        con_one = connect(one, restricted=True)
        connect_one.seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        con_many = connect_stores(parts, restricted=True)
        connect_many.seconds.append(time.perf_counter() - start)
    assert con_one is not None and con_many is not None
    print_timings([connect_one, connect_many], connect_one)
    worst = 0.0
    rows = []
    for name, template in QUERIES.items():
        sql = template.format(same_store="")
        sql_many = template.format(same_store=" AND p.store = t.store")
        a = run_query(con_one, sql).to_pylist()
        b = run_query(con_many, sql_many).to_pylist()
        if a != b:
            raise SystemExit(f"{name}: the union views disagree with the one store")
        single, many = Timings(f"{name}: one store"), Timings(f"{name}: {args.stores} stores")
        for _ in range(args.repeat):
            single.seconds.append(timed(partial(run_query, con_one, sql)))
            many.seconds.append(timed(partial(run_query, con_many, sql_many)))
        print(f"\n{name} (same rows on both sides):")
        print_timings([single, many], single)
        ratio = many.min / single.min
        rows.append([name, f"{single.min:.3f}", f"{many.min:.3f}", f"{ratio:.2f}"])
        worst = max(worst, ratio)
    print()
    print_table(["query", "one store min s", "union min s", "ratio"], rows)
    verdict(f"query over {args.stores} stores vs one store holding them all (worst query)",
            worst, worst <= STORE_TARGET, f"<= {STORE_TARGET}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--children", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--stores", type=int, default=10)
    p.add_argument("--nodes", type=int, default=100_000, help="nodes per store")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--skip-browser", action="store_true")
    p.add_argument("--skip-stores", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        if not args.skip_browser:
            bench_browser(args, Path(tmp))
        if not args.skip_stores:
            bench_stores(args, Path(tmp))


if __name__ == "__main__":
    main()
