# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · A tour of a rollout store
#
# A *rollout tree* is one task instance at one policy version: the prompt at the root,
# one node per agent step (the action and the tool feedback it got), branching where a
# sampler continued several times from one snapshotted state, and a reward at each leaf.
#
# This notebook
#
# 1. collects a few small trees of the `calc` environment with the tiny policy and two
#    samplers (`group`: independent rollouts; `bel`: ELPO's binary-search error
#    localization) into a fresh store,
# 2. queries the store with DuckDB: the `trees` and `nodes` tables and the derived
#    `paths` and `siblings` views,
# 3. computes `grpo` and `elpo` credit and reads it back from the `credits` table,
# 4. draws one BEL tree with its rewards, credits and critical step.
#
# Everything is written to a temporary directory. Set `RTREES_NOTEBOOK_SMALL=1` for the
# quick settings the tests use.

# %% tags=["parameters"]
import os
import tempfile
from pathlib import Path

SMALL = os.environ.get("RTREES_NOTEBOOK_SMALL") == "1"
ENV = "calc"
N_TASKS = 2 if SMALL else 16  # tasks per sampler (one tree each)
N_TOTAL = 16  # rollout budget per tree (BEL keeps 9 for its probes)
MAX_NEW_TOKENS = 48 if SMALL else 64  # token cap of one agent step
SEED = 0
WORK = Path(tempfile.mkdtemp(prefix="rtrees-nb01-"))
print(f"small={SMALL}  work dir: {WORK}")

# %%
import warnings

from IPython.display import Image

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets


def show(fig, name):
    """Save a matplotlib figure as WORK/name and display the PNG."""
    fig.savefig(WORK / name, dpi=110, bbox_inches="tight")
    return Image(filename=WORK / name)

# %% [markdown]
# ## 1. Collect trees into a new store
#
# `Store(path, create=True)` makes the Delta Lake tables; `collect` samples one tree per
# task and commits them (idempotently: a rerun with the same run id and seed adds
# nothing). `load_policy("tiny", "calc")` loads the committed tiny checkpoint.

# %%
from rollout_store import Store, connect, read_trees
from train.envs import env_class
from train.policies import load_policy
from train.sampling.collect import collect

store = Store(WORK / "store", create=True)
policy = load_policy("tiny", ENV)
tasks = env_class(ENV).generate_tasks(N_TASKS, SEED)
print("policy", policy.policy_version, "| first task:", tasks[0].prompt[:80])
for sampler in ("group", "bel"):
    report = collect(store, ENV, policy, sampler, tasks, N_TOTAL, SEED, f"tour-{sampler}",
                     progress=False, sampler_params={"max_new_tokens": MAX_NEW_TOKENS})
    print(report.summary())

# %% [markdown]
# ## 2. DuckDB over the store
#
# `connect(store)` returns a DuckDB connection with one view per table (`trees`,
# `nodes`, `snapshots`, `credits`, `mc_references`, `metrics`, `policy_scores`) and two
# derived views: `paths` (one row per root-to-leaf trajectory) and `siblings` (one row
# per child of a branching node, with the leaves and successes below it). `.pl()` turns
# a result into a polars DataFrame. (`rtrees sql "..." --store DIR` runs the same
# queries from a shell, read-only.)

# %%
con = connect(store)
con.sql("""
    SELECT t.sampler, count(DISTINCT t.tree_id) AS trees, count(*) AS nodes,
           count(*) FILTER (WHERE n.reward IS NOT NULL) AS leaves,
           max(n.depth) AS max_depth,
           count(DISTINCT t.tree_id) FILTER (WHERE t.critical_node_id IS NOT NULL)
               AS trees_with_critical_step
    FROM trees t JOIN nodes n USING (tree_id)
    GROUP BY t.sampler ORDER BY t.sampler""").pl()

# %% [markdown]
# `paths`: the trajectories. Success rate and mean length per sampler (BEL's probe
# suffixes are trajectories too).

# %%
con.sql("""
    SELECT t.sampler, count(*) AS trajectories, avg(p.reward) AS success_rate,
           avg(p.depth) AS mean_depth
    FROM paths p JOIN trees t USING (tree_id)
    GROUP BY t.sampler ORDER BY t.sampler""").pl()

# %% [markdown]
# `siblings`: every child of a branching node. A `group` tree branches only at the root;
# a `bel` tree also branches where the binary search probed a step's snapshot.

# %%
con.sql("""
    SELECT t.sampler, s.tree_id, s.parent_id, n.depth AS parent_depth,
           count(*) AS children, sum(s.n_leaves)::BIGINT AS leaves,
           sum(s.n_success)::BIGINT AS successes
    FROM siblings s JOIN trees t USING (tree_id)
    JOIN nodes n ON n.tree_id = s.tree_id AND n.node_id = s.parent_id
    GROUP BY ALL ORDER BY t.sampler, s.tree_id, parent_depth LIMIT 12""").pl()

# %% [markdown]
# One trajectory, step by step (actions and tool feedback are stored as text and as
# token ids with their sampling log-probabilities).

# %%
first_leaf = con.sql("""
    SELECT tree_id, leaf_id FROM paths ORDER BY tree_id, leaf_id LIMIT 1""").fetchall()[0]
(tree0,) = read_trees(store, [first_leaf[0]])
for step in tree0.path_to(first_leaf[1]):
    print(f"[{step.node_id} {step.kind}] action={step.action_text[:70]!r}")
    print(f"      obs={step.observation_text[:70]!r} reward={step.reward}")

# %% [markdown]
# ## 3. Credit, computed and read back
#
# `compute_credits(store, method)` runs a registered estimator over every stored tree
# that lacks its credit and commits one row per node to `credits` (keyed by method and
# a hash of its parameters; a rerun changes nothing).

# %%
from train.credit.store_io import compute_credits

for method in ("grpo", "elpo"):
    print(compute_credits(store, method, progress=False).summary())
con = connect(store)  # a new connection sees the new commits
con.sql("""
    SELECT method, method_params_hash, count(DISTINCT tree_id) AS trees, count(*) AS rows,
           avg(value) AS mean_credit, min(value) AS min_credit, max(value) AS max_credit
    FROM credits GROUP BY ALL ORDER BY method""").pl()

# %% [markdown]
# ## 4. One BEL tree: rewards, credit and the critical step
#
# BEL stores its localized first irrecoverable step as `trees.critical_node_id` and the
# search itself (the failed trajectory tau*, its length K, the probes and their outcomes)
# in `trees.meta["bel"]`. We take a BEL tree whose search ran (some explore rollout
# failed), read its ELPO credit per node, and draw it with `analysis.tree_plot.draw_tree`.

# %%
from analysis.tree_plot import draw_tree

rows = con.sql("""
    SELECT tree_id, critical_node_id FROM trees WHERE sampler = 'bel'
    ORDER BY critical_node_id IS NULL, tree_id LIMIT 1""").fetchall()
bel_tree_id, critical = rows[0]
(bel_tree,) = read_trees(store, [bel_tree_id])
print("tree", bel_tree_id, "critical_node_id", critical)
print("bel search:", (bel_tree.meta or {}).get("bel"))
elpo_credit = dict(con.execute(
    "SELECT node_id, value FROM credits WHERE method = 'elpo' AND tree_id = $t",
    {"t": bel_tree_id}).fetchall())
fig = draw_tree(bel_tree, credits=elpo_credit, critical=critical,
                title=f"{bel_tree_id}: ELPO credit, critical step {critical}")
show(fig, "bel_tree_elpo.png")

# %% [markdown]
# The same tree under GRPO (G1): a node's credit is the mean z-scored reward of the
# trajectories through it; the critical step plays no part in it.

# %%
grpo_credit = dict(con.execute(
    "SELECT node_id, value FROM credits WHERE method = 'grpo' AND tree_id = $t",
    {"t": bel_tree_id}).fetchall())
show(draw_tree(bel_tree, credits=grpo_credit, critical=critical, title="GRPO credit"),
     "bel_tree_grpo.png")
