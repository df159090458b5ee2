"""The main job's report (``rtrees demo``), from the store and the result files alone.

``write_demo_report(out)`` reads ``OUT/demo.json`` (the job's settings, run ids and
phase timings, written by ``train.demo.run_demo_job``), ``OUT/ranking/results.json``
(the Mean@k ranking audit, ``analysis.ranking_report``) and the store named there (the
collected trees, their credits and references, the training run's ``metrics``), and
writes into ``OUT``:

* ``results.json``: ``ranking`` (per method: E10 pairwise accuracy and E11 Kendall
  tau-b macro with their bootstrap intervals, pooled and per sampler; the pairs of
  methods whose paired difference is exactly 0), ``collection`` (per sampler: trees,
  leaves, success, tool steps, audited prefixes), ``training`` (held-out success
  before and after, sampled and greedy, the learning curve, tool steps: new, spent by
  reuse, refresh-all, saved), ``bel_tree`` (the drawn tree), ``seconds``, ``files``;
* ``report.md``: the same as tables, with the plots;
* ``learning_curve.png``: held-out success (sampled, greedy) against the policy version
  (iterations done; version 0 = the starting weights, metric step -1) and the mean leaf
  reward of each iteration's fresh trees against the version that sampled them;
* ``bel_tree.png``: one collected BEL tree (``analysis.tree_plot.draw_tree``) with its
  leaf rewards, ELPO's node credit and BEL's critical step (``trees.critical_node_id``).

Nothing here steps an environment or runs a policy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analysis.report import fmt, fmt_ci, markdown_table, new_figure, save_figure, write_json

if TYPE_CHECKING:
    import duckdb

    from rollout_store.store import Store

DEMO_STATE = "demo.json"  # train.demo.DEMO_STATE (analysis does not import train)
CURVE_PNG = "learning_curve.png"
TREE_PNG = "bel_tree.png"
TREE_CREDIT = "elpo"  # the credit drawn on the BEL tree (ELPO is built on BEL's trees)

# What each audited method computes, and on which trees its score can differ from GRPO's
# (the module docstrings of train.credit.*; the report's "methods" section).
METHOD_NOTES: dict[str, str] = {
    "grpo": "G1: z-score of the leaf rewards of the tree; a node's score is the mean over "
            "the trajectories through it, so siblings are ordered by their mean leaf reward.",
    "tree_grpo": "G9-G11: intra z-score within the subtree of each root child plus inter "
                 "z-score over the prompt's trees; the intra term averages to 0 over a root "
                 "child's subtree, so at the root it orders like GRPO and can differ only at "
                 "deeper branching nodes (BEL probes, CALIPER resamples).",
    "elpo": "E3-E7: lambda * branch advantage (z-score of the E3 node value among siblings) "
            "+ (1 - lambda) * the mean trajectory advantage; both terms increase with the "
            "child's mean reward when the child's subtree is a chain, so on such siblings it "
            "orders exactly like GRPO.",
    "caliper": "C4-C9: GRPO over the full trajectories plus a leave-one-out local credit "
               "inside local groups (``local`` resamples beside the failed original step), "
               "which only CALIPER trees have: on group and BEL trees it is GRPO's score.",
    "trace": "T1-T7: TD credit from the starting policy's mean log-probability of the gold "
             "answer after each step (the frozen reference of T2, scored from the store) plus "
             "alpha_out times the z-scored outcome; a step that makes the gold answer more "
             "likely scores higher whatever its sampled rollouts returned, so it orders "
             "siblings by another signal than GRPO, and the audit shows what that signal is "
             "worth against the Monte-Carlo references.",
}


def _connect(store: str) -> duckdb.DuckDBPyConnection:
    from rollout_store import connect
    from rollout_store.store import open_store

    return connect(open_store(store))


def _store(store: str) -> Store:
    from rollout_store.store import open_store

    return open_store(store)


# ----- sections ---------------------------------------------------------------------------


def ranking_section(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The audit (``ranking/results.json``) per method, pooled and per sampler."""
    groups = doc.get("groups", {})
    methods: dict[str, Any] = {}
    for label, m in doc["methods"].items():
        by_sampler = {}
        for sampler, g in groups.items():
            gm = g["methods"].get(label)
            if gm is None:
                continue
            by_sampler[sampler] = {
                "pairwise_accuracy": gm["pairwise_accuracy"]["estimate"],
                "pairwise_accuracy_ci": gm["pairwise_accuracy"]["ci"],
                "kendall_tau_b": gm["kendall_tau_b"]["macro"]["estimate"],
                "kendall_tau_b_ci": gm["kendall_tau_b"]["macro"]["ci"],
                "n_prefixes": gm["n_prefixes"], "n_pairs": gm["n_pairs"]}
        methods[label] = {
            "method": m["method"], "params_hash": m["method_params_hash"],
            "pairwise_accuracy": m["pairwise_accuracy"],
            "pairwise_accuracy_ci": m["ci"]["pairwise_accuracy"],
            "kendall_tau_b": m["kendall_tau_b"]["macro"],
            "kendall_tau_b_ci": m["ci"]["kendall_tau_b"]["macro"],
            "kendall_tau_b_pooled": m["kendall_tau_b"]["pooled"],
            "n_prefixes": m["n_prefixes"], "n_pairs": m["n_pairs"],
            "by_sampler": by_sampler}
    identical = {"all": _identical(doc.get("paired_differences", {}))}
    for sampler, g in groups.items():
        identical[sampler] = _identical(g.get("paired_differences", {}))
    cov = doc["coverage"]
    return {"k": doc["k"], "store_version": doc["store_version"],
            "n_trees": cov["n_trees"], "n_prefixes": cov["n_prefixes_audited"],
            "n_children": cov["n_children"], "n_pairs": cov["n_pairs"],
            "n_prefixes_reference_tied": cov["n_prefixes_reference_tied"],
            "bootstrap": doc["bootstrap"], "samplers": sorted(groups),
            "methods": methods, "identical": identical}


def _identical(diffs: Mapping[str, Any]) -> list[list[str]]:
    """Method pairs whose paired differences (accuracy and tau-b macro) are exactly 0 on
    every bootstrap resample: they order every audited sibling set the same way."""
    out = []
    for name, d in diffs.items():
        acc, tau = d["pairwise_accuracy"], d["kendall_tau_b"]["macro"]
        values = [acc["estimate"], *acc["ci"], tau["estimate"], *tau["ci"]]
        if all(v is not None and v == 0.0 for v in values):
            out.append([d["a"], d["b"]] if "a" in d else name.split("-", 1))
    return out


def _classes(pairs: Sequence[Sequence[str]], order: Sequence[str]) -> list[list[str]]:
    """The equivalence classes (two or more methods) that ``pairs`` of equal methods form,
    each in ``order``."""
    root = {m: m for m in order}

    def find(m: str) -> str:
        while root.setdefault(m, m) != m:
            m = root[m]
        return m

    for a, b in pairs:
        root[find(a)] = find(b)
    classes: dict[str, list[str]] = {}
    for m in order:
        classes.setdefault(find(m), []).append(m)
    return [c for c in classes.values() if len(c) > 1]


def collection_section(con: duckdb.DuckDBPyConnection, runs: Mapping[str, str], k: int
                       ) -> dict[str, Any]:
    """Per sampler: trees, nodes, leaves, leaf success, tool steps, branching nodes and
    referenced children (``mc_references`` at ``k``)."""
    out = {}
    for sampler, run_id in runs.items():
        [(trees, nodes, leaves, success, tools)] = con.execute("""
            SELECT count(DISTINCT t.tree_id), count(*),
                   count(*) FILTER (WHERE n.reward IS NOT NULL),
                   avg((n.reward >= 1.0)::DOUBLE) FILTER (WHERE n.reward IS NOT NULL),
                   coalesce(sum(n.tool_calls), 0)
            FROM trees t JOIN nodes n USING (tree_id) WHERE t.run_id = $r""",
                                                              {"r": run_id}).fetchall()
        [(branching,)] = con.execute("""
            SELECT count(*) FROM (SELECT n.tree_id, n.parent_id FROM nodes n
                                  JOIN trees t USING (tree_id)
                                  WHERE t.run_id = $r AND n.parent_id IS NOT NULL
                                  GROUP BY ALL HAVING count(*) >= 2)""",
                                     {"r": run_id}).fetchall()
        [(refs,)] = con.execute("""
            SELECT count(DISTINCT (r.tree_id, r.node_id)) FROM mc_references r
            JOIN trees t USING (tree_id) WHERE t.run_id = $r AND r.k = $k""",
                                {"r": run_id, "k": int(k)}).fetchall()
        out[sampler] = {"run_id": run_id, "trees": int(trees), "nodes": int(nodes),
                        "leaves": int(leaves), "leaf_success": success,
                        "tool_steps": int(tools), "branching_nodes": int(branching),
                        "referenced_children": int(refs)}
    return out


def read_run_metrics(con: duckdb.DuckDBPyConnection, run_id: str
                     ) -> dict[str, list[tuple[int, float]]]:
    """``{name: [(step, value), ...]}`` of one run from the store's training metrics (the
    trainer writes one row per metric and iteration; step -1 = before training;
    ``rollout_store.attempts.training_metrics``: the latest write per step, no bookkeeping
    rows)."""
    from rollout_store.attempts import training_metrics

    return training_metrics(con, run_id)


def training_section(metrics: Mapping[str, Sequence[tuple[int, float]]], run_id: str,
                     train_config: Mapping[str, Any]) -> dict[str, Any]:
    """Held-out success before/after (sampled, greedy) and per version, the fresh-tree
    reward per iteration, and the tool steps, all from the run's metrics.

    Versions: held-out metrics at step s are of the weights after s + 1 iterations
    (step -1: the starting weights, version 0); the fresh trees of iteration it were
    sampled by version it. Tool steps (sums over iterations): ``new`` =
    ``new_tool_steps`` (fresh trees plus what reuse spent), ``reuse_new`` =
    ``reuse_new_tool_steps``, ``refresh_all`` = ``reuse_refresh_all_tool_steps`` (what
    refreshing every reused tree would have cost), ``calibration`` =
    ``reuse_calibration_tool_steps`` (the D7 calibration draws, part of reuse_new),
    ``saved`` = refresh_all - reuse_new.
    """
    def total(name: str) -> float:
        return float(sum(v for _, v in metrics.get(name, [])))

    heldout = {}
    for kind in ("sampled", "greedy"):
        curve = [(step + 1, v) for step, v in metrics.get(f"heldout_{kind}", [])]
        heldout[kind] = {"before": curve[0][1] if curve and curve[0][0] == 0 else None,
                         "after": curve[-1][1] if curve and curve[-1][0] > 0 else None,
                         "after_version": curve[-1][0] if curve else None,
                         "curve": curve}
    iterations = len(metrics.get("loss", []))
    reuse_new = total("reuse_new_tool_steps")
    refresh_all = total("reuse_refresh_all_tool_steps")
    new = total("new_tool_steps")
    reuse_keys = sorted(k for k in metrics if k.startswith(("reuse_pairs_", "reuse_skip_")))
    return {
        "run_id": run_id, "iterations": iterations, "steps": train_config.get("steps"),
        "reuse": train_config.get("reuse"), "reuse_from": train_config.get("reuse_from"),
        "heldout_tasks": train_config.get("heldout_tasks"), "heldout": heldout,
        "reward_curve": [(step, v) for step, v in metrics.get("reward", [])],
        "tool_steps": {"new": new, "fresh": new - reuse_new, "reuse_new": reuse_new,
                       "calibration": total("reuse_calibration_tool_steps"),
                       "refresh_all": refresh_all, "saved": refresh_all - reuse_new},
        "reuse_trees": total("reuse_trees"),
        "reuse_decisions": {k: total(k) for k in reuse_keys},
        "seconds": {k.removeprefix("seconds_"): total(k) for k in metrics
                    if k.startswith("seconds_")},
    }


def pick_bel_tree(con: duckdb.DuckDBPyConnection, run_id: str) -> str | None:
    """The BEL tree to draw: one with a critical step, preferring more probes (the search
    did something), then fewer nodes (readable), then the tree id."""
    rows = con.execute("""
        SELECT tree_id, n_nodes, meta FROM trees
        WHERE run_id = $r AND critical_node_id IS NOT NULL""", {"r": run_id}).fetchall()
    best: tuple[int, int, str] | None = None
    for tree_id, n_nodes, meta in rows:
        probes = len(((json.loads(meta) if meta else {}).get("bel") or {}).get("probes", []))
        key = (-probes, int(n_nodes), str(tree_id))
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


def node_credits(con: duckdb.DuckDBPyConnection, tree_id: str, method: str,
                 params_hash: str | None) -> dict[int, float]:
    """node id -> the latest ``credits.value`` of ``method`` (at ``params_hash``)."""
    rows = con.execute("""
        SELECT node_id, arg_max(value, created_at) FROM credits
        WHERE tree_id = $t AND method = $m AND ($h IS NULL OR method_params_hash = $h)
        GROUP BY node_id""", {"t": tree_id, "m": method, "h": params_hash}).fetchall()
    return {int(n): float(v) for n, v in rows}


def draw_bel_tree(store: str, con: duckdb.DuckDBPyConnection, run_id: str,
                  params_hash: str | None, path: Path) -> dict[str, Any] | None:
    """Draw the picked BEL tree with ELPO's credit and the critical step into ``path``."""
    from analysis.tree_plot import draw_tree
    from rollout_store.reader import read_trees

    tree_id = pick_bel_tree(con, run_id)
    if tree_id is None:
        return None
    [tree] = read_trees(_store(store), [tree_id], snapshots=False)
    credits = node_credits(con, tree_id, TREE_CREDIT, params_hash)
    critical = tree.critical_node_id
    fig = draw_tree(tree, credits, critical=critical,
                    title=f"BEL tree {tree_id}: leaf rewards, {TREE_CREDIT} credit per node, "
                          f"critical step (node {critical})")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    bel = (tree.meta or {}).get("bel", {})
    return {"tree_id": tree_id, "critical_node_id": critical, "credit": TREE_CREDIT,
            "n_nodes": len(tree.nodes), "t_crit": bel.get("t_crit"),
            "probes": bel.get("probes", []), "file": path.name}


def plot_learning_curve(training: Mapping[str, Any], path: Path) -> str:
    fig, ax = new_figure(6.5, 4.0)
    for kind, style in (("sampled", "o-"), ("greedy", "s--")):
        curve = training["heldout"][kind]["curve"]
        if curve:
            ax.plot([v for v, _ in curve], [y for _, y in curve], style,
                    label=f"held-out success ({kind})")
    reward = training["reward_curve"]
    if reward:
        ax.plot([s for s, _ in reward], [y for _, y in reward], "^:", alpha=0.8,
                label="fresh-tree mean reward (sampling version)")
    ax.set_xlabel("policy version (training iterations done)")
    ax.set_ylabel("success / reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"training run {training['run_id']} (reuse {training['reuse']})", fontsize=9)
    return save_figure(fig, path)


# ----- the report -------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def render(results: Mapping[str, Any]) -> str:
    """``report.md`` from ``results`` (the ``results.json`` document)."""
    s = results["settings"]
    r = results["ranking"]
    tr = results["training"]
    order = [m for m in s["methods"] if m in r["methods"]] + sorted(
        set(r["methods"]) - set(s["methods"]))
    samplers = [x for x in s["samplers"] if x in r["samplers"]]
    methods = [(name, r["methods"][name]) for name in order]
    lines = [
        "# The main job: collect, credit, audit, train (`rtrees demo`)", "",
        f"Store `{results['store']}`, environment `{s['env']}`, policy `{s['policy']}` "
        f"(starting weights `{results['start_policy']}`), seed {s['seed']}.", "",
        "## Ranking audit (Mean@{k})".format(k=r["k"]), "",
        f"Every child of a branching node of the collected trees got a reference q(c): the "
        f"success rate of {r['k']} fresh rollouts from c's stored state. A method's score "
        f"of c is its stored node credit. {r['n_prefixes']} prefixes (branching nodes) in "
        f"{r['n_trees']} trees, {r['n_children']} children, {r['n_pairs']} untied pairs; "
        f"{r['n_prefixes_reference_tied']} prefixes skipped (every reference tied). "
        f"Intervals: {r['bootstrap']['n_boot']} bootstrap resamples of trees, "
        f"{round(100 * r['bootstrap']['level'])}%.", "",
        markdown_table(
            ["method", "pairwise accuracy (E10)", "Kendall tau-b macro (E11)",
             "tau-b pooled", "prefixes", "pairs"],
            [[name, fmt_ci(m["pairwise_accuracy"], m["pairwise_accuracy_ci"]),
              fmt_ci(m["kendall_tau_b"], m["kendall_tau_b_ci"]),
              fmt(m["kendall_tau_b_pooled"]), m["n_prefixes"], m["n_pairs"]]
             for name, m in methods]), "",
        "Per sampler (tree construction), Kendall tau-b macro [95% CI] (prefixes):", "",
        markdown_table(
            ["method", *samplers],
            [[name, *(fmt_ci(m["by_sampler"][x]["kendall_tau_b"],
                             m["by_sampler"][x]["kendall_tau_b_ci"])
                      + f" ({m['by_sampler'][x]['n_prefixes']})"
                      if x in m["by_sampler"] else "n/a" for x in samplers)]
             for name, m in methods]), "",
        "**grpo and elpo rank siblings identically by construction** wherever each "
        "child's subtree is a chain: both scores are increasing functions of the child's "
        "mean leaf reward (GRPO's mean z-scored return through the child; ELPO's branch "
        "advantage and mean trajectory advantage of the same child), so their pairwise "
        "accuracy and tau-b coincide and their paired difference is 0.", "",
        "Methods whose paired difference is exactly 0 (the same order on every audited "
        "sibling set), by trees audited: " + "; ".join(
            f"{where}: " + (", ".join(" = ".join(c) for c in _classes(pairs, order))
                            or "all differ")
            for where, pairs in r["identical"].items()) + ".", "",
        "What each method is computed on (every collected tree gets every method):", "",
        *[f"- `{name}`: {METHOD_NOTES.get(m['method'], '')}" for name, m in methods], "",
        f"Full audit (plots, paired differences): [ranking/report.md]"
        f"({results['ranking_report']}).", "",
        "## Collection", "",
        markdown_table(
            ["sampler", "run id", "trees", "nodes", "leaves", "leaf success", "tool steps",
             "branching nodes", "children with a reference"],
            [[x, f"`{c['run_id']}`", c["trees"], c["nodes"], c["leaves"],
              _pct(c["leaf_success"]), c["tool_steps"], c["branching_nodes"],
              c["referenced_children"]] for x, c in results["collection"].items()]), "",
        "## Training", "",
        f"`train.trainer.train`: {tr['iterations']} iterations (of {tr['steps']}) of "
        f"{s['tasks_per_step']} fresh `{s['train_sampler']}` trees (n_total "
        f"{s['train_n_total']}, credit `{s['train_credit']}`) plus up to "
        f"{s['reuse_per_step']} stored trees per iteration reused with `--reuse "
        f"{tr['reuse']}` (`reuse_from`: `{tr['reuse_from']}`). Held-out: "
        f"{tr['heldout_tasks']} tasks, one rollout each.", "",
        markdown_table(
            ["held-out success", "before (version 0)",
             f"after (version {tr['heldout']['sampled']['after_version']})"],
            [[kind, _pct(tr["heldout"][kind]["before"]), _pct(tr["heldout"][kind]["after"])]
             for kind in ("sampled", "greedy")]), "",
        markdown_table(
            ["tool steps", "count"],
            [["new (fresh trees + reuse refreshes)", f"{tr['tool_steps']['new']:,.0f}"],
             ["  of which fresh trees", f"{tr['tool_steps']['fresh']:,.0f}"],
             ["  of which spent by reuse", f"{tr['tool_steps']['reuse_new']:,.0f}"],
             ["    of which calibration draws (D7)",
              f"{tr['tool_steps'].get('calibration', 0.0):,.0f}"],
             ["refresh-all cost of the reused trees",
              f"{tr['tool_steps']['refresh_all']:,.0f}"],
             ["saved by reuse (refresh-all - spent)", f"{tr['tool_steps']['saved']:,.0f}"],
             ["stored trees reused (sum over iterations)", f"{tr['reuse_trees']:,.0f}"],
             *[[k.removeprefix("reuse_").replace("_", " "), f"{v:,.0f}"]
               for k, v in tr["reuse_decisions"].items() if v]]), "",
        f"![learning curve]({CURVE_PNG})", "",
    ]
    bel = results.get("bel_tree")
    lines += ["## One BEL tree", ""]
    if bel is None:
        lines += ["No collected BEL tree has a critical step.", ""]
    else:
        lines += [
            f"Tree `{bel['tree_id']}` ({bel['n_nodes']} nodes): leaf rewards under the "
            f"leaves, `{bel['credit']}` node credit as colour and label, and BEL's critical "
            f"step (node {bel['critical_node_id']}, t_crit = {bel['t_crit']}; "
            f"`trees.critical_node_id`) ringed. The binary search probed "
            + (", ".join(f"step {p.get('anchor_step')} ({p.get('x')} suffixes, "
                         f"{'recovered' if p.get('recovered') else 'not recovered'})"
                         for p in bel["probes"]) or "nothing") + ".", "",
            f"![BEL tree]({TREE_PNG})", ""]
    lines += ["## Settings and why", "", *results["choices"], "",
              "## Time", "",
              "This invocation, wall / CPU seconds per phase (CPU: all threads of the "
              "process; on a shared machine wall time is inflated): " + ", ".join(
                  f"{name} {wall:.0f} / {cpu:.0f}" for name, wall, cpu in results["phases"])
              + f" (total {sum(p[1] for p in results['phases']):.0f} s wall, "
              f"{sum(p[2] for p in results['phases']):.0f} s CPU); phases that found "
              "their outputs: " + (", ".join(k for k, v in results["reused"].items() if v)
                                   or "none") + ".", ""]
    return "\n".join(lines)


def choices(settings: Mapping[str, Any], collection: Mapping[str, Any]) -> list[str]:
    """The settings the job ran with and why the defaults are what they are (report
    text; the defaults are ``train.demo.DemoConfig``'s)."""
    children = sum(c["referenced_children"] for c in collection.values())
    staleness = settings["max_staleness"] or settings["train_steps"]
    return [
        f"- `tasks` = {settings['tasks']} per sampler, `n_total` = {settings['n_total']}: "
        f"the reference job costs k rollouts per child of a branching "
        f"node ({children} children here; leaf children cost nothing) and is most of the "
        "run's time, so the task count sets the time; 16 is BEL's default budget (N0 = 7 "
        "full rollouts before the search), kept so the trees have the papers' shape.",
        f"- `k` = {settings['k']} (default 32, the seed papers' Mean@32).",
        f"- training: `train_steps` = {settings['train_steps']}, `tasks_per_step` = "
        f"{settings['tasks_per_step']}, `train_n_total` = {settings['train_n_total']} "
        "(the trainer's calc recipe; held-out success moved within 2 iterations when "
        f"measured), `reuse` = {settings['reuse']}, `reuse_per_step` = "
        f"{settings['reuse_per_step']} (default transport: the collected trees hold about "
        "one trajectory per compared action, too few for the dsc and gap-gate rules, which "
        "refuse them, docs/METHODS.md section 9 \"Feasible pairs\"; transport moves their "
        "stored returns to the current weights without a new tool step).",
        f"- `max_staleness` = {staleness}: the collected trees are version 0 of the run, so "
        "they stay eligible for reuse for all of it.",
        f"- `heldout_tasks` = {settings['heldout_tasks']}, `eval_every` = "
        f"{settings['eval_every']}: one batched rollout per task (sampled and greedy), "
        "about a second each on 2 cores at 200 tasks.",
        f"- `max_new_tokens` = {settings['max_new_tokens']}: calc steps are a few tokens "
        "(single-token tool boilerplate); the trainer's default.",
    ]


def write_demo_report(out: Path) -> tuple[dict[str, Any], list[Path]]:
    """Build ``results.json``, ``report.md`` and the PNGs in ``out`` (module docstring);
    returns the results and the files written (the ranking report's included)."""
    out = Path(out)
    state_path = out / DEMO_STATE
    if not state_path.is_file():
        raise FileNotFoundError(f"{out} has no {DEMO_STATE}: run `rtrees demo --out {out}`")
    state = json.loads(state_path.read_text())
    ranking_dir = Path(state["ranking_dir"])
    ranking_doc = json.loads((ranking_dir / "results.json").read_text())
    con = _connect(state["store"])
    ranking = ranking_section(ranking_doc)
    collection = collection_section(con, state["collect_runs"], ranking["k"])
    training = training_section(read_run_metrics(con, state["train_run"]), state["train_run"],
                                state["train_config"])
    files = [out / "report.md", out / "results.json", out / plot_learning_curve(
        training, out / CURVE_PNG)]
    bel_run = state["collect_runs"].get("bel")
    elpo = ranking["methods"].get(TREE_CREDIT)
    bel = None if bel_run is None else draw_bel_tree(
        state["store"], con, bel_run, elpo["params_hash"] if elpo else None, out / TREE_PNG)
    if bel is not None:
        files.append(out / TREE_PNG)
    ranking_files = [*sorted(ranking_dir.glob("*.png")), ranking_dir / "report.md"]
    results = {
        "settings": state["settings"], "store": state["store"],
        "start_policy": state["start_policy"],
        "ranking_report": (ranking_dir / "report.md").relative_to(out.resolve()).as_posix()
        if ranking_dir.is_relative_to(out.resolve()) else str(ranking_dir / "report.md"),
        "ranking": ranking, "collection": collection, "training": training,
        "bel_tree": bel, "choices": choices(state["settings"], collection),
        "phases": state["phases"], "reused": state["reused"],
        "files": [str(f) for f in [*files, *ranking_files]],
    }
    (out / "report.md").write_text(render(results))
    write_json(out / "results.json", results)
    return results, [*files, *ranking_files]


__all__ = ["METHOD_NOTES", "choices", "collection_section", "draw_bel_tree",
           "node_credits", "pick_bel_tree", "plot_learning_curve", "ranking_section",
           "read_run_metrics", "render", "training_section", "write_demo_report"]
