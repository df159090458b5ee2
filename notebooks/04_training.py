# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Training the tiny policy from fresh and stored trees
#
# `train.trainer.train(TrainConfig(...))` is the whole training loop (`rtrees train`):
# each iteration draws training tasks, builds one tree per task with the sampler under
# the current weights, commits the trees to the store, credits them, runs PPO epochs on
# the clipped surrogate, publishes the next checkpoint and, every `eval_every`
# iterations, measures held-out success. Every number goes to the store's `metrics`
# table.
#
# With `reuse="transport"` each iteration also draws stored trees of earlier policy
# versions and moves their credit to the current weights by anchored transport (one
# forward pass, no environment step; METHODS section 9). The gated rules (`reuse="dsc"`:
# reuse, transport or refresh each pair) need at least 8 trajectories on each side of a
# compared pair, which `group` trees do not have, so they would refuse these stored
# trees; `rooted` trees have them. This notebook trains the tiny
# `calc` policy twice from the same start, once on fresh trees only and once with
# reuse, then reads both runs' metrics and plots the learning curves.
#
# Set `RTREES_NOTEBOOK_SMALL=1` for the quick settings the tests use (a smoke run: far
# too short to learn anything).

# %% tags=["parameters"]
import os
import tempfile
from pathlib import Path

SMALL = os.environ.get("RTREES_NOTEBOOK_SMALL") == "1"
STEPS = 2 if SMALL else 30  # training iterations per run
TASKS_PER_STEP = 2 if SMALL else 16  # fresh trees per iteration
N_TOTAL = 2 if SMALL else 8  # rollouts per tree
HELDOUT_TASKS = 4 if SMALL else 100  # fixed held-out split
EVAL_EVERY = 1 if SMALL else 5
REUSE_PER_STEP = 2 if SMALL else 8  # stored trees per iteration (reuse run)
MAX_NEW_TOKENS = 40 if SMALL else 48
SEED = 0
WORK = Path(tempfile.mkdtemp(prefix="rtrees-nb04-"))
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
# ## 1. Two runs into one store
#
# Both runs share the store (the run id keeps them apart) and start from the committed
# tiny checkpoint. `TrainConfig` is one flat dataclass: every field is documented in
# `train/config.py` (`rtrees train --fields` lists them).

# %%
from train.config import TrainConfig
from train.trainer import read_metrics, train

STORE = WORK / "store"
common = dict(store=str(STORE), env="calc", policy="tiny", sampler="group", credit="grpo",
              steps=STEPS, tasks_per_step=TASKS_PER_STEP, n_total=N_TOTAL,
              heldout_tasks=HELDOUT_TASKS, eval_every=EVAL_EVERY,
              max_new_tokens=MAX_NEW_TOKENS, seed=SEED, progress=False)
fresh = TrainConfig(**common, out=str(WORK / "run-fresh"), run_id="fresh")
print(train(fresh).summary())

# %%
reuse = TrainConfig(**common, out=str(WORK / "run-reuse"), run_id="reuse",
                    reuse="transport", reuse_per_step=REUSE_PER_STEP, max_staleness=4)
print(train(reuse).summary())

# %% [markdown]
# ## 2. The metrics table
#
# `read_metrics(store, run_id)` returns `{name: [(step, value), ...]}`; the same rows are
# the relation `TRAINING_METRICS` over `rollout_store.connect`: the `metrics_latest` view
# (one row per run, step and name, the last attempt's) without the bookkeeping rows (the
# run token at step -2, attempts at -3). Held-out success at step -1 is the starting
# policy's.

# %%
import polars as pl

from rollout_store import connect
from rollout_store.attempts import TRAINING_METRICS  # metrics_latest, no bookkeeping rows

con = connect(STORE)
con.sql(f"""
    SELECT run_id, count(DISTINCT step) FILTER (WHERE step >= 0) AS iterations,
           count(DISTINCT name) AS metrics,
           max(value) FILTER (WHERE name = 'heldout_sampled' AND step = -1) AS heldout_start,
           arg_max(value, step) FILTER (WHERE name = 'heldout_sampled') AS heldout_end,
           sum(value) FILTER (WHERE name = 'new_tool_steps') AS new_tool_steps
    FROM {TRAINING_METRICS} GROUP BY run_id ORDER BY run_id""").pl()

# %%
metrics = {run: read_metrics(STORE, run) for run in ("fresh", "reuse")}
per_step = pl.DataFrame([
    {"run": run, "step": step, "name": name, "value": value}
    for run, m in metrics.items() for name, rows in m.items() for step, value in rows])
per_step.filter(pl.col("name").is_in(["loss", "reward", "heldout_sampled", "kl",
                                      "new_tool_steps"])).pivot(
    on="name", index=["run", "step"], values="value").sort("run", "step")

# %% [markdown]
# What the reuse run did with its stored trees, per iteration: trees drawn, the rule's
# decisions per pair, and trees skipped by reason.

# %%
reuse_names = sorted(n for n in metrics["reuse"] if n.startswith("reuse_"))
per_step.filter((pl.col("run") == "reuse") & pl.col("name").is_in(reuse_names)).pivot(
    on="name", index="step", values="value").sort("step")

# %% [markdown]
# ## 3. Learning curves

# %%
from matplotlib.figure import Figure

fig = Figure(figsize=(11, 3.3), layout="constrained")
axes = fig.subplots(1, 3)
for run, m in metrics.items():
    for ax, name in zip(axes, ("heldout_sampled", "reward", "loss"), strict=True):
        steps, values = zip(*m[name], strict=True) if m.get(name) else ((), ())
        ax.plot(steps, values, marker="o", label=run)
        ax.set_title(name)
        ax.set_xlabel("iteration (held-out: -1 = start)")
axes[0].set_ylabel("held-out sampled success")
axes[0].legend()
fig.suptitle("tiny calc policy: fresh trees only vs fresh + stored (reuse=transport)")
show(fig, "learning_curve.png")

# %% [markdown]
# The trees themselves are in the store like any collected ones: one per task and
# iteration, with its `policy_version` and the `policy_ref` of the checkpoint that
# sampled it (a refreshing rule's new trees would carry their lineage in `trees.meta`).

# %%
con = connect(STORE)
con.sql("""
    SELECT run_id, sampler, count(*) AS trees, count(DISTINCT policy_version) AS versions
    FROM trees GROUP BY ALL ORDER BY run_id, sampler""").pl()
