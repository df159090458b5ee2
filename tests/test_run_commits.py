"""``train.run.Commits``: the trainer's keyed writes of one iteration, and the retry of an
attempt whose replayed trees differ from what an earlier attempt committed (issue 46)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_store.attempts import as_retry
from rollout_store.reader import connect
from rollout_store.store import CommitKeyConflictError, Store
from rollout_store.synthetic import bel_shaped_batch
from rollout_store.tree import Tree
from train.run import Commits
from train.writer import Writes


def _trees(seed: int, prefix: str) -> list[Tree]:
    return bel_shaped_batch(2, seed=seed, rollouts=2, tree_prefix=prefix).to_trees()


def test_keys_replays_and_the_retry_of_other_trees(tmp_path: Path) -> None:
    store = Store(tmp_path / "s", create=True)
    first, other = _trees(1, "a"), _trees(2, "b")
    with_writes = Writes(False)
    c1 = Commits(store, with_writes, "r", attempt=1, is_main=True)
    assert c1.trees(3, first) is False and c1.key("credit") == "r:credit:3"
    assert c1.trees(3, first) is False  # an exact replay: the store skips it
    c2 = Commits(store, with_writes, "r", attempt=2, is_main=True)
    assert c2.trees(3, other) is True  # another device's replay: other trees, same key
    c2.retry = True
    assert c2.key("trees") == "r:trees:3@a2"
    c2("trees", as_retry(other, 2))
    ids = {r[0] for r in connect(store).execute("SELECT tree_id FROM trees").fetchall()}
    assert ids == {t.tree_id for t in first} | {f"{t.tree_id}@a2" for t in other}
    with pytest.raises(CommitKeyConflictError):  # a first attempt never retries
        Commits(store, with_writes, "r", attempt=1, is_main=True).trees(3, other)
    assert Commits(store, with_writes, "r", attempt=2, is_main=False).trees(3, other) is False
