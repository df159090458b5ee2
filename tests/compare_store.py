"""Stores for the comparison tests (issue 48) and docs/guides/compare.md's screenshots.

* ``build(path, run_b)``: ``tests/viewer_store.py``'s store plus a second training run
  ``run_b`` (``TRAIN_B``) with its own curves, and held-out evaluations of both runs
  (``HELDOUT``: successes of ``N_HELDOUT`` tasks per step and mode), so the metrics panel
  has two runs to overlay with intervals.
* ``wide_tree(tree_id, children, tokens)``: a prompt with ``children`` answers of
  ``tokens`` token ids each (the tiny calc tokenizer's, so the viewer decodes them), every
  child equal to the first but at one token (node ``k`` > 1 has id 3 at token ``k - 1``), leaves
  alternately rewarded 1 and 0.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import viewer_store

from rollout_store import Store
from rollout_store.schema import EVALUATIONS, METRICS
from rollout_store.tree import Node, Tree

TRAIN_A = viewer_store.TRAIN_RUN
TRAIN_B = "train-viewer-b"
N_HELDOUT = 20
# (run, metric step) -> successes of N_HELDOUT sampled tasks
HELDOUT = {(TRAIN_A, 0): 4, (TRAIN_A, 5): 9, (TRAIN_B, 0): 4, (TRAIN_B, 5): 15}


def evaluations(run: str, step: int, successes: int, now: datetime) -> pa.Table:
    """``N_HELDOUT`` sampled evaluation rows of ``run`` at metric step ``step``."""
    return pa.Table.from_pylist([
        {"run_id": run, "step": step - 1, "mode": "sampled", "task_index": i,
         "task_id": f"t{i}", "eval_seed": 7, "reward": float(i < successes),
         "success": i < successes, "steps": 2, "created_at": now}
        for i in range(N_HELDOUT)], schema=EVALUATIONS)


def build(path: Path, run_b: bool = True) -> Store:
    store = viewer_store.build(path)
    now = datetime.now(UTC)
    if run_b:
        rows = [{"run_id": TRAIN_B, "step": step, "name": name, "value": value,
                 "created_at": now}
                for step in range(6)
                for name, value in (("reward", 0.2 + 0.15 * step), ("loss", 0.8 / (step + 1)))]
        store.append_metrics(pa.Table.from_pylist(rows, schema=METRICS), key="cmp-metrics")
    parts = [evaluations(run, step, k, now) for (run, step), k in HELDOUT.items()
             if run_b or run == TRAIN_A]
    store.append_evaluations(pa.concat_tables(parts), key="cmp-evals")
    return store


def wide_tree(tree_id: str, children: int, tokens: int, text: str = "") -> Tree:
    """A branch point with ``children`` leaves of ``tokens`` tokens (module docstring);
    ``text`` is every node's action and observation text (an XSS payload, say)."""
    base = [(7 * i) % 500 + 10 for i in range(tokens)]
    nodes = [Node(0, None, "prompt", observation_text=text or "prompt")]
    for c in range(children):
        ids = list(base)
        if 0 < c < tokens:
            ids[c] = 3
        nodes.append(Node(c + 1, 0, "decision", action_text=text or f"answer {c}",
                          action_token_ids=ids, action_logprobs=[-0.1] * tokens,
                          action_entropies=[0.2] * tokens, observation_text=text,
                          terminal=True, reward=float(c % 2 == 0)))
    return Tree(tree_id, nodes, run_id="wide", task_id="wide-task", env="calc",
                sampler="group", policy_ref=str(viewer_store.CALC))
