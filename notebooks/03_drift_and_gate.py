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
# # 03 · Credit drift and the DSC gate, with exact ground truth
#
# Stored credit was computed under an old policy mu. After an update mu -> pi, is it
# still right? On the `workflow` environment with tabular policies every Q value is
# exact, so both questions of the DSC-Gate paper can be answered without sampling noise
# in the ground truth:
#
# 1. **Drift** (`rtrees study dsc-l1`, METHODS D1-D2, D6): for every pair of actions at
#    every reachable decision state, the credit c = Q(a) - Q(b) before and after updates
#    of matched global KL. Claim L1: the branch sensitivity |G(a, b)| explains |drift|
#    better than the KL of the update.
# 2. **The gate** (`rtrees study dsc-table2`, D7-D10): given old trajectories per root
#    action, a gate decides per pair to reuse the old credit, transport it to pi, or
#    refresh it with new tool steps. Table 2: DSC's regret against the Gap gate's, and
#    the new tool steps each spends.
#
# Each study writes its data files, `report.md`, `results.json` and plots to its output
# directory, with one verdict per claim. Set `RTREES_NOTEBOOK_SMALL=1` for the quick
# settings the tests use (the studies' own small settings; too small for conclusions).

# %% tags=["parameters"]
import os
import tempfile
from pathlib import Path

SMALL = os.environ.get("RTREES_NOTEBOOK_SMALL") == "1"
# Overrides of each study's settings (field names of train.studies.drift.DriftConfig and
# train.studies.gates.GateStudyConfig); empty: the study's defaults (or its small ones).
DRIFT_PARAMS: dict = {}
GATE_PARAMS: dict = {} if SMALL else {"n_eval": 40, "n_boot": 2000}
WORK = Path(tempfile.mkdtemp(prefix="rtrees-nb03-"))
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
# ## 1. Credit drift (L1)

# %%
import duckdb
import polars as pl
from matplotlib.figure import Figure

from train.jobs import run_study, study_config

print(study_config("dsc-l1", DRIFT_PARAMS, small=SMALL))
drift = run_study("dsc-l1", WORK / "drift", DRIFT_PARAMS, small=SMALL)
for v in drift["verdicts"]:
    print("-", v["line"])

# %% [markdown]
# Per update: size (global KL), mean and largest |drift|, and how often a relevant
# credit (|c_mu| > tau) changed sign.

# %%
pl.DataFrame(drift["summary"]["by_update"]).select(
    "kind", "kl_target", "global_kl", "n_pairs", "mean_abs_drift", "max_abs_drift",
    "n_relevant", "reversals", "reversal_rate")

# %% [markdown]
# The per-pair table is an ordinary Parquet file; DuckDB reads it directly. Here |drift|
# against |G| and against the update's KL, one point per (pair, update).

# %%
pairs = duckdb.sql(f"""
    SELECT kind, kl_target, global_kl, abs(drift) AS abs_drift, abs(g) AS abs_g
    FROM read_parquet('{WORK / "drift" / drift["pairs_path"]}')""").pl()
fig = Figure(figsize=(9, 3.5), layout="constrained")
axes = fig.subplots(1, 2, sharey=True)
for kind in sorted(pairs["kind"].unique()):
    part = pairs.filter(pl.col("kind") == kind)
    axes[0].scatter(part["abs_g"], part["abs_drift"], s=6, alpha=0.5, label=kind)
    axes[1].scatter(part["global_kl"], part["abs_drift"], s=6, alpha=0.5, label=kind)
axes[0].set_xlabel("branch sensitivity |G(a, b)| (D2)")
axes[1].set_xlabel("global KL of the update")
axes[0].set_ylabel("|credit drift|")
axes[0].legend(fontsize=8)
fig.suptitle("|credit drift| against |G| and against the update's KL")
show(fig, "drift_scatter.png")

# %% [markdown]
# The report's own plots:

# %%
print(drift["plots"])
Image(filename=WORK / "drift" / "drift_vs_g.png")

# %% [markdown]
# ## 2. The DSC gate (Table 2)
#
# Per evaluation task and update, every gate picks a root action; its regret
# max_a Q_pi(a) - Q_pi(pick) is exact, and its cost is the new tool steps it sampled.
# `oracle` (argmax of the exact Q_pi) has regret 0 by construction: a check.

# %%
print(study_config("dsc-table2", GATE_PARAMS, small=SMALL))
gate = run_study("dsc-table2", WORK / "gate", GATE_PARAMS, small=SMALL)
for v in gate["verdicts"]:
    print("-", v["line"])
print(gate["finding"]["statement"])

# %%
table = pl.DataFrame([{"gate": name, **{k: v for k, v in row.items() if k != "regret_ci95"},
                       "regret_ci_low": row["regret_ci95"][0],
                       "regret_ci_high": row["regret_ci95"][1]}
                      for name, row in gate["table"].items()])
table.sort("new_steps")

# %%
fig = Figure(figsize=(5, 3.5), layout="constrained")
ax = fig.add_subplot()
for row in table.iter_rows(named=True):
    ax.errorbar(row["new_steps"], row["regret"],
                yerr=[[row["regret"] - row["regret_ci_low"]],
                      [row["regret_ci_high"] - row["regret"]]], fmt="o", capsize=3)
    ax.annotate(row["gate"], (row["new_steps"], row["regret"]), xytext=(4, 4),
                textcoords="offset points", fontsize=8)
ax.set_xlabel("new tool steps per instance")
ax.set_ylabel("regret (exact)")
ax.set_title("gates after an update: regret vs cost")
show(fig, "gate_regret_vs_steps.png")

# %% [markdown]
# What the DSC gate decided, pair by pair: reuse, transport or refresh, by update kind.
# The decisions are data in `pairs.parquet`.

# %%
duckdb.sql(f"""
    SELECT kind, decision, count(*) AS pairs
    FROM read_parquet('{WORK / "gate" / gate["pairs_path"]}')
    GROUP BY ALL ORDER BY kind, decision""").pl()

# %%
print(gate["plots"])
Image(filename=WORK / "gate" / "regret_vs_steps.png")
