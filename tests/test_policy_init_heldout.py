"""``rtrees policy init`` keeps its held-out tasks out of training by task, not by prompt:
every gymnasium lake of one size shares one prompt (the map is in the config and the first
observation), so filtering by prompt dropped all 40,000 training tasks and the documented
``rtrees policy init --env gym-frozenlake`` failed."""

from __future__ import annotations

import dataclasses

import pytest

from train.policies.tiny_train import EVAL_SEED_OFFSET, TEST_SEED_OFFSET, make_tasks, task_key


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
