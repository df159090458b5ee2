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
# # 02 · The Mean@k ranking audit, and how to add a credit method
#
# At every branching node of a tree (a *prefix*), each child has a credit score s(c)
# from a method and a reference q(c): the success rate of k fresh rollouts continued
# from that child (Mean@k). The audit asks how well each method orders the children the
# way the reference does: pairwise accuracy (METHODS E10) and Kendall tau-b (E11), with
# tree-bootstrap intervals. This notebook
#
# 1. collects `group` and `bel` trees of `calc` with the tiny policy and credits them
#    with `grpo` and `elpo`,
# 2. runs the audit (`train.jobs.ranking_job`: samples the missing references, audits,
#    writes `report.md`, `results.json` and plots),
# 3. defines a new credit method as a pure estimator, registers it, computes it and
#    audits it beside `grpo`.
#
# Set `RTREES_NOTEBOOK_SMALL=1` for the quick settings the tests use (too small for
# meaningful intervals).

# %% tags=["parameters"]
import os
import tempfile
from pathlib import Path

SMALL = os.environ.get("RTREES_NOTEBOOK_SMALL") == "1"
ENV = "calc"
N_TASKS = 2 if SMALL else 12  # tasks per sampler
N_TOTAL = 8 if SMALL else 16  # rollout budget per tree
K = 2 if SMALL else 32  # rollouts behind each reference (Mean@K)
N_BOOT = 50 if SMALL else 2000  # tree-bootstrap resamples
MAX_NEW_TOKENS = 48 if SMALL else 64
SEED = 0
WORK = Path(tempfile.mkdtemp(prefix="rtrees-nb02-"))
print(f"small={SMALL}  work dir: {WORK}")

# %%
import warnings

from IPython.display import Image

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets


# %% [markdown]
# ## 1. Trees and credit

# %%
import polars as pl

from rollout_store import Store, connect
from train.credit.store_io import compute_credits
from train.envs import env_class
from train.policies import load_policy
from train.sampling.collect import collect

store = Store(WORK / "store", create=True)
policy = load_policy("tiny", ENV)
tasks = env_class(ENV).generate_tasks(N_TASKS, SEED)
for sampler in ("group", "bel"):
    print(collect(store, ENV, policy, sampler, tasks, N_TOTAL, SEED, f"audit-{sampler}",
                  progress=False, sampler_params={"max_new_tokens": MAX_NEW_TOKENS}).summary())
for method in ("grpo", "elpo"):
    print(compute_credits(store, method, progress=False).summary())

# %% [markdown]
# ## 2. The audit
#
# `ranking_job` first samples K rollouts from every child of a branching node that has
# no reference yet (`train.sampling.references`, into the `mc_references` table), then
# audits from the store alone (`analysis.ranking.ranking_audit`) and writes the report.
# `own_version=True`: the references are sampled by the policy version that made each
# tree (here the tiny checkpoint itself).

# %%
from train.jobs import RankingJobConfig, fmt_ci, ranking_job

job = ranking_job(store, WORK / "ranking", RankingJobConfig(
    ("grpo", "elpo"), k=K, policy=policy, own_version=True, n_boot=N_BOOT, seed=SEED,
    max_new_tokens=MAX_NEW_TOKENS), progress=False)
print(job.references.summary())
doc = job.result.to_json()


def method_table(doc):
    """One row per method: E10 / E11 with their bootstrap intervals."""
    return pl.DataFrame([
        {"method": name,
         "pairwise_accuracy": fmt_ci(m["pairwise_accuracy"], m["ci"]["pairwise_accuracy"]),
         "kendall_tau_b_macro": fmt_ci(m["kendall_tau_b"]["macro"],
                                       m["ci"]["kendall_tau_b"]["macro"]),
         "prefixes": m["n_prefixes"], "pairs": m["n_pairs"]}
        for name, m in doc["methods"].items()])


print("coverage:", doc["coverage"])
method_table(doc)

# %% [markdown]
# The report's plots: E10 / E11 per method with their intervals, and every audited
# child's score against its reference.

# %%
print([p.name for p in job.files])
Image(filename=WORK / "ranking" / "ranking.png")

# %%
Image(filename=WORK / "ranking" / "score_vs_reference.png")

# %% [markdown]
# The data behind it is plain SQL: each child's reference (`mc_references`) beside its
# credit (`credits`).

# %%
con = connect(store)
con.sql("""
    SELECT s.tree_id, s.parent_id, s.child_id, r.successes, r.k,
           round(r.successes / r.k, 3) AS q,
           round(max(c.value) FILTER (WHERE c.method = 'grpo'), 3) AS grpo,
           round(max(c.value) FILTER (WHERE c.method = 'elpo'), 3) AS elpo
    FROM siblings s
    JOIN mc_references r ON r.tree_id = s.tree_id AND r.node_id = s.child_id
    JOIN credits c ON c.tree_id = s.tree_id AND c.node_id = s.child_id
    GROUP BY ALL ORDER BY s.tree_id, s.parent_id, s.child_id LIMIT 10""").pl()

# %% [markdown]
# ## 3. Adding a credit method
#
# An estimator is a pure function `(TreeArrays, Params) -> Credit` registered by name
# with a frozen params dataclass (`train.credit.base`). `TreeArrays` holds many trees as
# flat arrays with nodes in preorder: `parent` (N,), `is_leaf` (N,), `reward` (N,, NaN
# off leaves), `token_offsets` (N+1,), `agent_mask` (T,), ...; `Credit` holds per-node
# credit (N,) and per-token advantages (T,).
#
# The example, *subtree advantage*: V(v) = the mean leaf reward in v's subtree, and
# A(v) = V(v) - V(parent(v)), with A(root) = 0. Subtree sums come from
# `base.subtree_sum` (vectorised by depth level), tokens from `base.node_to_tokens`.

# %%
from dataclasses import dataclass

import numpy as np

from train.credit import ESTIMATORS, Credit, Params, TreeArrays, register
from train.credit.base import node_to_tokens, subtree_sum


@dataclass(frozen=True)
class SubtreeAdvantageParams(Params):
    """Hyperparameters of ``subtree_advantage``: none but the empty-subtree value."""

    empty: float = 0.0
    """V of a subtree without a rewarded leaf."""


def subtree_advantage(batch: TreeArrays, params: SubtreeAdvantageParams) -> Credit:
    """A(v) = V(v) - V(parent(v)), V(v) = mean leaf reward under v; node (N,), token (T,)."""
    leaf_reward = np.where(batch.is_leaf, np.nan_to_num(batch.reward), 0.0)  # (N,)
    rewarded = (batch.is_leaf & ~np.isnan(batch.reward)).astype(np.float64)  # (N,)
    total, count = subtree_sum(batch, leaf_reward), subtree_sum(batch, rewarded)
    value = np.where(count > 0, total / np.maximum(count, 1.0), params.empty)  # V (N,)
    node = np.where(batch.parent >= 0, value - value[np.maximum(batch.parent, 0)], 0.0)
    return Credit(node=node, token=node_to_tokens(batch, node))


if "subtree_advantage" not in ESTIMATORS:  # a re-run of this cell keeps the first one
    register("subtree_advantage", SubtreeAdvantageParams)(subtree_advantage)

# %% [markdown]
# A check by hand on one stored tree, before trusting it: a root child's credit is its
# subtree's success rate minus the whole tree's.

# %%
from rollout_store import read_trees
from train.credit.base import from_trees

(tree,) = read_trees(store, [con.sql("SELECT min(tree_id) FROM trees").fetchall()[0][0]])
batch = from_trees([tree])
credit = ESTIMATORS["subtree_advantage"](batch)
leaves = {n.node_id: n.reward for n in tree.leaves()}
child = tree.children()[tree.root().node_id][0]
below = [leaves[n.node_id] for n in tree.leaves() if child in
         [p.node_id for p in tree.path_to(n.node_id)]]
by_hand = np.mean(below) - np.mean(list(leaves.values()))
row = int(np.flatnonzero(batch.node_ids == child)[0])
print(f"node {child}: estimator {credit.node[row]:.4f}, by hand {by_hand:.4f}")
assert abs(credit.node[row] - by_hand) < 1e-12

# %% [markdown]
# Commit it like any other method, then audit it beside `grpo` (the references are
# already stored, so `collect=False` audits what is there).

# %%
print(compute_credits(store, "subtree_advantage", progress=False).summary())
job2 = ranking_job(store, WORK / "ranking-new", RankingJobConfig(
    ("grpo", "subtree_advantage"), k=K, n_boot=N_BOOT, seed=SEED, collect=False),
    progress=False)
doc2 = job2.result.to_json()
method_table(doc2)

# %% [markdown]
# The paired difference uses the same bootstrap resamples for both methods, so its
# interval is that of the difference itself.

# %%
pl.DataFrame([
    {"difference": name,
     "pairwise_accuracy": fmt_ci(d["pairwise_accuracy"]["estimate"],
                                 d["pairwise_accuracy"]["ci"]),
     "kendall_tau_b_macro": fmt_ci(d["kendall_tau_b"]["macro"]["estimate"],
                                   d["kendall_tau_b"]["macro"]["ci"])}
    for name, d in doc2["paired_differences"].items()])

# %%
Image(filename=WORK / "ranking-new" / "ranking.png")
