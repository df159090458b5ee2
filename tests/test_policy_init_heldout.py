"""``rtrees policy init`` and ``rtrees train`` keep their held-out tasks out of training by
task (``task_identity``), not by prompt:
every gymnasium lake of one size shares one prompt (the map is in the config and the first
observation), so filtering by prompt dropped every training task: the documented
``rtrees policy init --env gym-frozenlake`` failed, and ``rtrees train`` on it would stop
with "the training split is empty"."""

from __future__ import annotations

import dataclasses

import pytest

from train.envs.base import task_identity as task_key
from train.policies.tiny_train import EVAL_SEED_OFFSET, TEST_SEED_OFFSET, make_tasks


def test_lakes_sharing_a_prompt_stay_in_training_and_held_out_ones_do_not() -> None:
    pytest.importorskip("gymnasium")
    train = make_tasks("gym-frozenlake", 200, 0)
    held = [*make_tasks("gym-frozenlake", 50, EVAL_SEED_OFFSET),
            *make_tasks("gym-frozenlake", 50, TEST_SEED_OFFSET)]
    assert len({t.prompt for t in [*train, *held]}) == 1  # why a prompt filter failed
    excluded = {task_key(t) for t in held}
    kept = [t for t in train if task_key(t) not in excluded]
    assert len(kept) >= 190  # only a map drawn twice (a few 4x4 maps repeat) is dropped
    # a held-out task that reappears in training (another id, same prompt and config) goes
    again = dataclasses.replace(held[0], task_id="copy")
    assert task_key(again) in excluded


def test_the_trainer_split_keeps_lakes_that_share_a_prompt() -> None:
    pytest.importorskip("gymnasium")
    from train.config import TrainConfig
    from train.trainer import task_splits

    config = TrainConfig(env="gym-frozenlake", train_tasks=100, heldout_tasks=20)
    train, heldout = task_splits(config)
    assert len(heldout) == 20 and len(train) >= 95
    assert not {task_key(t) for t in train} & {task_key(t) for t in heldout}
