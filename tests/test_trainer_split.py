"""The trainer with ``tree_row_tokens`` (issue 25): trees larger than the row budget are
split into a trunk and branch rows (``train.batches.SplitTree``), which forwards no token
twice and gives the same update as one row per tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.config import load_config
from train.trainer import read_metrics, train

RECIPE = {"tasks_per_step": 2, "n_total": 6, "heldout_tasks": 0, "max_new_tokens": 40,
          "steps": 1, "progress": False, "run_id": "r", "sampler": "bel", "credit": "elpo",
          "epochs": 2, "minibatches": 2, "lr": 3e-3}


def _run(tmp: Path, row_tokens: int) -> dict[str, float]:
    cfg = load_config(None, {**RECIPE, "store": str(tmp / f"s{row_tokens}"),
                             "out": str(tmp / f"r{row_tokens}"),
                             "tree_row_tokens": row_tokens})
    train(cfg)
    return {k: v[-1][1] for k, v in read_metrics(cfg.store, cfg.resolved_run_id).items()}


def test_split_trees_train_like_whole_trees(tmp_path: Path) -> None:
    whole, split = _run(tmp_path, 0), _run(tmp_path, 48)
    assert whole["split_trees"] == 0 and split["split_trees"] >= 2  # every tree split
    assert whole["tree_token_ratio"] == split["tree_token_ratio"] > 1.0  # same trees
    assert split["forward_tokens"] == whole["forward_tokens"]  # no token twice
    assert split["loss_tokens"] == whole["loss_tokens"]
    for name in ("loss", "grad_norm", "kl", "clip_frac_low"):
        assert split[name] == pytest.approx(whole[name], rel=1e-4, abs=1e-6), name
