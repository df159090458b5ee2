"""Divergence drops the branch, never the tree (issue 49): when restoring a snapshot does
not reach the recorded state (``train.envs.base.SnapshotDivergence``), the tree builder
drops that rollout (spent, recorded as lost), prunes what it had added, marks the node it
started from, and commits the rest of the tree. Here with the generic ``replay`` strategy
over a world one of whose tools answers how often it was reset (not a function of the
task): a replay through that tool diverges."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_store import Store, read_trees
from train.envs.base import SnapshotDivergence, StepResult, Task
from train.envs.strategies import ReplayDivergenceError, ReplayEnv
from train.envs.workflow import WorkflowEnv
from train.policies.tabular import UniformWorkflowPolicy
from train.sampling import Budget, BudgetError, make_sampler

TASK = WorkflowEnv.generate_tasks(1, seed=3)[0]


class ResetCountingWorkflow(WorkflowEnv):
    """``workflow`` whose ``skip`` tool answers with how many times the world was reset
    (a reward part): a replay through a ``skip`` never gives the recorded outcome, one
    through other tools does."""

    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    def reset(self, task: Task) -> str:
        self.resets += 1
        return super().reset(task)

    def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        if '"skip"' not in action_text:
            return result
        return result._replace(reward_parts={**result.reward_parts, "run": float(self.resets)})


def _tree(sampler: str, n_total: int, seed: int = 0):  # type: ignore[no-untyped-def]
    inner = ResetCountingWorkflow()
    inner.spec = "workflow"  # what make_env sets (the store records it)
    env = ReplayEnv(inner)
    return make_sampler(sampler).sample_tree(env, UniformWorkflowPolicy(), TASK, n_total,
                                             seed=seed, tree_id=f"t{seed}")


def test_divergence_errors_share_one_base() -> None:
    from train.envs.agent.program import AgentDivergenceError

    assert issubclass(ReplayDivergenceError, SnapshotDivergence)
    assert issubclass(AgentDivergenceError, SnapshotDivergence)
    err = AgentDivergenceError("x", 2, "messages[2].content")
    assert err.where == {"call": 2, "field": "messages[2].content"}


def test_lost_rollouts_stay_spent() -> None:
    budget = Budget(4)
    budget.spend("explore", 3)
    budget.lose("explore", 2)
    assert (budget.used, budget.remaining, budget.lost) == (3, 1, {"explore": 2})
    with pytest.raises(BudgetError, match="cannot lose"):
        budget.lose("explore", 2)
    with pytest.raises(BudgetError, match="cannot lose"):
        budget.lose("probe")


def test_divergent_rollouts_are_dropped_and_pruned(tmp_path: Path) -> None:
    """Lockstep group rollouts share one replayed env: every branch whose own last node
    must be replayed diverges there; its chain is pruned, the root is marked, the rest is
    committed and reads back."""
    tree = _tree("group", 8, seed=1)
    lost = (tree.meta or {})["diverged_rollouts"]
    assert sum(tree.rollouts_by_phase.values()) == 8 and 0 < sum(lost.values()) < 8
    leaves = [n for n in tree.nodes if n.reward is not None]
    assert len(leaves) == 8 - sum(lost.values())
    kids = tree.children()
    assert all(kids[n.node_id] or n.reward is not None for n in tree.nodes)  # no dangling
    mark = tree.root().meta["diverged"]  # type: ignore[index]
    assert mark["rollouts"] == sum(lost.values()) and mark["step"] >= 1
    assert set(tree.snapshots) == {n.snapshot_id for n in tree.nodes if n.snapshot_id}
    store = Store(tmp_path / "st", create=True)
    store.append_trees([tree])
    back = read_trees(Store(tmp_path / "st"))[0]
    assert back.root().meta == tree.root().meta
    assert sorted(n.node_id for n in back.nodes) == sorted(n.node_id for n in tree.nodes)


def test_a_tree_with_divergences_is_a_function_of_its_seed() -> None:
    a, b = _tree("bel", 8, seed=1), _tree("bel", 8, seed=1)
    assert [(n.node_id, n.parent_id, n.action_text, n.reward, n.meta) for n in a.nodes] == \
        [(n.node_id, n.parent_id, n.action_text, n.reward, n.meta) for n in b.nodes]
    assert a.meta == b.meta


class NeverRestores(WorkflowEnv):
    """Every restore diverges (as a program that reads the clock in its first request)."""

    def restore(self, state: bytes) -> None:
        raise SnapshotDivergence("restore diverged at call 1: messages[0].content differs",
                                 call=1, field="messages[0].content")


def test_a_tree_whose_every_rollout_diverged_fails_by_name() -> None:
    with pytest.raises(SnapshotDivergence, match="diverged at call 1"):
        make_sampler("group").sample_tree(NeverRestores(), UniformWorkflowPolicy(), TASK, 3,
                                          seed=0)
