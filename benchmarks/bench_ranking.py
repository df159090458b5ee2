"""Ranking audit: the E10-E11 statistics vs a per-group scipy loop and a bare DuckDB query.

Data: ``--groups`` branching groups (prefixes) of 2 to 8 children, 5 groups per
tree (group j+1 hangs below the first child of group j), k = 32: each child
has a success probability p ~ Beta(1.5, 1.5), a reference successes ~
Binomial(k, p) and a score p + N(0, 0.25²) rounded to 2 decimals (so scores tie
sometimes, as credits do). The per-child rows (tree_id, parent_id, node_id,
score, successes, k) are written to one Parquet file (zstd). Every timed side
starts from that file and computes the same point estimates: pairwise accuracy
(E10), macro and pooled Kendall τ_b (E11), the number of prefixes and of pairs.

* ours: ``RankingData.from_table(pq.read_table(file))`` then
  ``ranking_statistics(..., n_boot=0)`` (numpy pairs within each prefix,
  ``bincount`` per prefix; ``analysis/ranking_data.py``, ``analysis/stats.py``);
* (a) the baseline a researcher would write: the same arrays, then a Python loop
  over groups calling ``scipy.stats.kendalltau`` (variant b) per group and a loop
  over its pairs for E10 and the pooled counts;
* (b) a bare vectorised DuckDB query over the file: a self-join within each
  group (``a.node_id < b.node_id``), per-group sums, then the totals.

Also timed: the whole audit path over a real store holding the same trees
(``analysis.ranking.ranking_audit`` of the store's directory, as ``rtrees audit
ranking`` runs it: the store opened, the projected reads of ``trees``, ``nodes``,
``credits`` and ``mc_references`` at one pinned version + the statistics, no
bootstrap), and, informative, the 2,000-resample tree bootstrap on its own.

Targets: ours at least 150x faster than (a), at most 1.5x (b) (issue 5); the store
path at most 1.5x (b) (issue 26); every number equal within 1e-9.

    .venv/bin/python benchmarks/bench_ranking.py [--groups 50000] [--repeat 7]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.stats
from _common import Timings, print_table, print_timings, timed, verdict

from analysis.ranking import (
    RankingConfig,
    RankingData,
    ranking_audit,
    ranking_statistics,
)
from rollout_store import Store
from rollout_store.schema import CREDITS, MC_REFERENCES, NODE_INPUT, SNAPSHOT_INPUT, TREE_INPUT
from rollout_store.tree import TreeBatch

K = 32
GROUPS_PER_TREE = 5
TARGET_VS_LOOP = 150.0
TARGET_VS_SQL = 1.5
TOLERANCE = 1e-9
NAMES = ("pairwise_accuracy", "tau_b_macro", "tau_b_pooled", "n_prefixes", "n_pairs")


# ----- data --------------------------------------------------------------------------------


def make_data(n_groups: int, seed: int) -> tuple[pa.Table, pa.Table]:
    """(per-child rows, every node of the trees): tree_id, parent_id, node_id, ..."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 9, n_groups)
    n_trees = -(-n_groups // GROUPS_PER_TREE)
    tree_of_group = np.arange(n_groups) // GROUPS_PER_TREE
    # Node ids within a tree: root 0, then each group's children in order.
    first_in_tree = np.r_[0, np.cumsum(np.bincount(tree_of_group, sizes))[:-1]]
    group_start = np.cumsum(sizes) - sizes
    offset_in_tree = group_start - first_in_tree[tree_of_group]  # children before the group
    first_child = 1 + offset_in_tree  # node id of the group's first child
    is_first_group = np.r_[True, tree_of_group[1:] != tree_of_group[:-1]]
    parent = np.where(is_first_group, 0, np.r_[0, first_child[:-1]])
    child_group = np.repeat(np.arange(n_groups), sizes)
    node = first_child[child_group] + (np.arange(len(child_group)) - group_start[child_group])
    names = np.array([f"tree-{t:06d}" for t in range(n_trees)], dtype=object)
    p = rng.beta(1.5, 1.5, len(node))
    children = pa.table({
        "tree_id": pa.array(names[tree_of_group[child_group]], pa.string()),
        "parent_id": pa.array(parent[child_group]),
        "node_id": pa.array(node),
        "score": pa.array(np.round(p + rng.normal(0, 0.25, len(p)), 2)),
        "successes": pa.array(rng.binomial(K, p).astype(np.int32)),
        "k": pa.array(np.full(len(p), K, np.int32)),
    })
    # The trees: the roots plus every child; a child is a leaf unless a group hangs below it.
    inner = set(zip(tree_of_group[~is_first_group].tolist(),
                    parent[~is_first_group].tolist(), strict=True))
    tree_idx = tree_of_group[child_group]
    leaf = np.array([(t, n) not in inner for t, n in zip(tree_idx.tolist(), node.tolist(),
                                                          strict=True)])
    all_tree = np.r_[np.arange(n_trees), tree_idx]
    nodes = pa.table({"tree_idx": all_tree, "node_id": np.r_[np.zeros(n_trees, np.int64), node],
                      "parent_id": np.r_[np.full(n_trees, -1), parent[child_group]],
                      "leaf": np.r_[np.zeros(n_trees, bool), leaf],
                      "score": np.r_[np.zeros(n_trees), children.column("score").to_numpy()]})
    return children, nodes.append_column("tree_id", pa.array(names[all_tree], pa.string()))


def build_store(path: Path, children: pa.Table, nodes: pa.Table) -> Store:
    """A real store holding the same trees, one credit per node, one reference per child."""
    n = nodes.num_rows
    is_root = nodes.column("parent_id").to_numpy() < 0
    leaf = nodes.column("leaf").to_numpy()
    rng = np.random.default_rng(0)
    reward = np.where(leaf, rng.integers(0, 2, n).astype(float), np.nan)
    now = datetime.now(UTC)
    empty_i32 = pa.array([[]] * n, pa.list_(pa.int32()))
    empty_f32 = pa.array([[]] * n, pa.list_(pa.float32()))
    node_rows = pa.table({
        "tree_id": nodes.column("tree_id"), "node_id": nodes.column("node_id"),
        "parent_id": pa.array(nodes.column("parent_id").to_numpy(), mask=is_root),
        "kind": pa.array(np.where(is_root, "prompt", "decision")),
        "phase": pa.nulls(n, pa.string()), "action_text": pa.array([""] * n),
        "action_token_ids": empty_i32, "action_logprobs": empty_f32,
        "action_entropies": empty_f32, "observation_text": pa.array([""] * n),
        "observation_token_ids": empty_i32,
        "segments": pa.array([[]] * n, NODE_INPUT.field("segments").type),
        "terminal": pa.array(leaf), "reward": pa.array(reward, mask=~leaf),
        "reward_parts": pa.nulls(n, NODE_INPUT.field("reward_parts").type),
        "snapshot_id": pa.nulls(n, pa.string()), "n_gen_tokens": pa.nulls(n, pa.int32()),
        "tool_calls": pa.nulls(n, pa.int32()), "meta": pa.nulls(n, pa.string()),
    }, schema=NODE_INPUT)
    tree_ids = nodes.column("tree_id").filter(pa.array(is_root))
    t = len(tree_ids)
    trees = pa.table({
        "tree_id": tree_ids, "run_id": pa.array(["bench"] * t), "task_id": tree_ids,
        "env": pa.array(["synthetic"] * t), "env_config": pa.nulls(t, pa.string()),
        "sampler": pa.array(["random"] * t), "policy_version": pa.array(["v0"] * t),
        "policy_ref": pa.nulls(t, pa.string()), "budget": pa.nulls(t, pa.int32()),
        "rollouts_by_phase": pa.nulls(t, TREE_INPUT.field("rollouts_by_phase").type),
        "seed": pa.nulls(t, pa.int64()), "critical_node_id": pa.nulls(t, pa.int64()),
        "created_at": pa.array([now] * t, TREE_INPUT.field("created_at").type),
        "meta": pa.nulls(t, pa.string()),
    }, schema=TREE_INPUT)
    store = Store(path, create=True)
    store.append_trees(TreeBatch(trees, node_rows, SNAPSHOT_INPUT.empty_table()), key="bench")
    store.append_credits(pa.table({
        "run_id": pa.array(["bench"] * n), "method": pa.array(["m"] * n),
        "method_params_hash": pa.array(["h"] * n), "method_params": pa.nulls(n, pa.string()),
        "tree_id": nodes.column("tree_id"), "node_id": nodes.column("node_id"),
        "value": nodes.column("score"), "token_values": pa.nulls(n, pa.list_(pa.float32())),
        "policy_version": pa.array(["v0"] * n),
        "created_at": pa.array([now] * n, CREDITS.field("created_at").type),
        "clip_low": pa.nulls(n, CREDITS.field("clip_low").type),
        "clip_high": pa.nulls(n, CREDITS.field("clip_high").type)}, schema=CREDITS),
        key="bench-credit")
    c = children.num_rows
    store.append_mc_references(pa.table({
        "run_id": pa.array(["bench"] * c), "tree_id": children.column("tree_id"),
        "node_id": children.column("node_id"), "k": children.column("k"),
        "successes": children.column("successes"), "policy_version": pa.array(["v0"] * c),
        "created_at": pa.array([now] * c, MC_REFERENCES.field("created_at").type)},
        schema=MC_REFERENCES), key="bench-ref")
    return store


# ----- the three sides ---------------------------------------------------------------------


def ours(path: Path) -> tuple[float, ...]:
    table = pq.read_table(path).rename_columns(
        ["tree_id", "parent_id", "node_id", "s0", "successes", "k"])
    d = RankingData.from_table(table, ["m"])
    return _numbers(ranking_statistics(d.tree, d.group, d.q, d.scores, d.labels, n_boot=0))


def _numbers(stats: object) -> tuple[float, ...]:
    m = stats.methods[0]  # type: ignore[attr-defined]
    return (m.pairwise_accuracy.value, m.tau_b_macro.value, m.tau_b_pooled.value,
            float(m.n_prefixes), float(m.n_pairs))


def scipy_loop(path: Path) -> tuple[float, ...]:
    """What a researcher would write: sort, then one Python iteration per group."""
    t = pq.read_table(path)
    tree = t.column("tree_id").to_numpy(zero_copy_only=False)
    parent = t.column("parent_id").to_numpy()
    s = t.column("score").to_numpy()
    q = t.column("successes").to_numpy() / t.column("k").to_numpy()
    order = np.lexsort((parent, tree))
    tree, parent, s, q = tree[order], parent[order], s[order], q[order]
    new = np.r_[True, (tree[1:] != tree[:-1]) | (parent[1:] != parent[:-1])]
    bounds = np.r_[np.flatnonzero(new), len(q)]
    taus = []
    hits = n_pairs = conc = untied_s = untied_q = 0.0
    for lo, hi in itertools.pairwise(bounds):
        sg, qg = s[lo:hi], q[lo:hi]
        if np.all(qg == qg[0]):
            continue  # E11: every reference ties
        tau = scipy.stats.kendalltau(sg, qg, variant="b").statistic
        taus.append(0.0 if np.isnan(tau) else tau)
        for i, j in itertools.combinations(range(hi - lo), 2):
            ds = np.sign(sg[i] - sg[j])
            dq = np.sign(qg[i] - qg[j])
            conc += ds * dq
            untied_s += ds != 0
            untied_q += dq != 0
            if dq:
                n_pairs += 1
                hits += 1.0 if ds == dq else 0.5 if ds == 0 else 0.0
    return (hits / n_pairs, float(np.mean(taus)), conc / np.sqrt(untied_s * untied_q),
            float(len(taus)), n_pairs)


def bare_sql(path: Path) -> str:
    f = "read_parquet('" + str(path).replace("'", "''") + "')"
    return f"""
        WITH c AS (SELECT tree_id, parent_id, node_id, score AS s,
                          successes::DOUBLE / k AS q FROM {f}),
        g AS (
            SELECT a.tree_id, a.parent_id,
                   sum(sign(a.s - b.s) * sign(a.q - b.q))::DOUBLE AS conc,
                   count(*) FILTER (WHERE a.s <> b.s)::DOUBLE AS untied_s,
                   count(*) FILTER (WHERE a.q <> b.q)::DOUBLE AS untied_q
            FROM c a JOIN c b ON a.tree_id = b.tree_id AND a.parent_id = b.parent_id
                             AND a.node_id < b.node_id
            GROUP BY a.tree_id, a.parent_id
            HAVING count(*) FILTER (WHERE a.q <> b.q) > 0)
        SELECT 0.5 + 0.5 * sum(conc) / sum(untied_q),
               avg(CASE WHEN untied_s > 0 THEN conc / sqrt(untied_s * untied_q) ELSE 0 END),
               sum(conc) / sqrt(sum(untied_s) * sum(untied_q)),
               count(*)::DOUBLE, sum(untied_q)
        FROM g"""


def store_path(store: Path) -> tuple[float, ...]:
    """What ``rtrees audit ranking --store DIR --methods m --n-boot 0`` computes: the store
    opened from its path, the audited tables pinned and read, the statistics."""
    result = ranking_audit(store, RankingConfig(("m",), k=K, n_boot=0))
    return _numbers(result.stats)


# ----- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=50_000, help="branching groups")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs of the fast sides")
    parser.add_argument("--loop-repeat", type=int, default=1,
                        help="timed runs of the scipy loop (about 20 s each at 50k groups)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-ranking-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        children, nodes = make_data(args.groups, args.seed)
        path = root / "children.parquet"
        pq.write_table(children, path, compression="zstd")
        store_dir = root / "store"
        build_store(store_dir, children, nodes)
        print(f"{args.groups:,} groups of 2-8 children ({children.num_rows:,} children, "
              f"{nodes.num_rows:,} nodes in {nodes.num_rows - children.num_rows:,} trees), "
              f"k = {K}; file and store written in {time.perf_counter() - start:.1f} s "
              "(not timed)")
        con = duckdb.connect()
        sql = bare_sql(path)

        def duck() -> tuple[float, ...]:
            return tuple(float(x) for x in con.sql(sql).fetchall()[0])

        results = {"ours": ours(path), "(a) scipy loop": scipy_loop(path),
                   "(b) bare DuckDB": duck(), "store path": store_path(store_dir)}
        print_table(["side", *NAMES], [[k, *(f"{x:.12g}" for x in v)]
                                       for k, v in results.items()])
        base = np.array(results["ours"])
        diff = max(float(np.max(np.abs(np.array(v) - base))) for v in results.values())
        same = diff <= TOLERANCE
        print(f"max |difference| across sides: {diff:.3g} (tolerance {TOLERANCE:g})\n")

        ours_t = Timings("ours: read file + RankingData + statistics")
        duck_t = Timings("(b) bare DuckDB query over the file")
        loop_t = Timings("(a) per-group scipy.stats.kendalltau loop")
        store_t = Timings("store path: ranking_audit(DIR), n_boot 0")
        for i in range(args.repeat):  # interleaved, so load spikes hit every side
            ours_t.seconds.append(timed(lambda: ours(path)))
            duck_t.seconds.append(timed(duck))
            store_t.seconds.append(timed(lambda: store_path(store_dir)))
            if i < args.loop_repeat:
                loop_t.seconds.append(timed(lambda: scipy_loop(path)))
        d = RankingData.from_table(pq.read_table(path).rename_columns(
            ["tree_id", "parent_id", "node_id", "s0", "successes", "k"]), ["m"])
        boot_t = Timings("tree bootstrap alone, 2,000 resamples (info)", [timed(
            lambda: ranking_statistics(d.tree, d.group, d.q, d.scores, ["m"], n_boot=2000))
            for _ in range(3)])
        threads = con.sql("SELECT current_setting('threads')").fetchall()[0][0]
        print(f"DuckDB {duckdb.__version__}, threads {threads}\n")
        print_timings([duck_t, ours_t, loop_t, store_t, boot_t], duck_t)
        con.close()

    vs_loop = loop_t.min / ours_t.min
    vs_sql = ours_t.min / duck_t.min
    print(f"\nours vs (a): {vs_loop:.0f}x faster (min; median {loop_t.median / ours_t.median:.0f}x)"
          f"; ours / (b): {vs_sql:.2f} (min; median {ours_t.median / duck_t.median:.2f}); "
          f"store path / (b): {store_t.min / duck_t.min:.2f}")
    verdict(f"ranking statistics over {args.groups:,} groups, scipy loop / ours (min)",
            vs_loop, vs_loop >= TARGET_VS_LOOP and same,
            f">= {TARGET_VS_LOOP:g}x, equal within {TOLERANCE:g}")
    verdict(f"ranking statistics over {args.groups:,} groups, ours / bare DuckDB (min)",
            vs_sql, vs_sql <= TARGET_VS_SQL and same,
            f"<= {TARGET_VS_SQL:g}x, equal within {TOLERANCE:g}")
    vs_store = store_t.min / duck_t.min
    verdict(f"ranking audit over a store, {args.groups:,} groups, store path / bare DuckDB "
            "(min)", vs_store, vs_store <= TARGET_VS_SQL and same,
            f"<= {TARGET_VS_SQL:g}x (issue 26), equal within {TOLERANCE:g}")


if __name__ == "__main__":
    main()
