"""Log trees from your own training loop: plain Python objects in, stored trees out.

``TreeLogger`` turns what any trainer has at hand into ``Tree`` records and commits
them, together with the trainer's own advantages, to a store::

    with TreeLogger("my-store", run_id="run-1") as log:
        log.group("2+2=", ["4", "5"], rewards=[1.0, 0.0], advantages=[0.7, -0.7],
                  policy_version="step-0")
    log.report.trees  # 1

Two shapes of input:

* ``group(prompt, completions, rewards, advantages=...)``: a GRPO group, i.e. G
  completions of one prompt, becomes a one-level tree: the root is a ``prompt`` node
  (the prompt in ``observation_text``, its token ids in ``observation_token_ids``), and
  completion i is the terminal ``decision`` leaf with node id i + 1 (its text, token ids,
  logprobs and reward). A completion is a string, or a ``Step`` when token ids and
  logprobs are known.
* ``tree(prompt, steps)``: any tree of agent turns. ``steps[i]`` is node i + 1; its
  ``parent`` is the index of an earlier step, ``None`` for the prompt (the root, node 0),
  or ``PREVIOUS`` (the default) for the step just before it, so a list of turns with
  default parents is one trajectory. Steps that no later step names as parent are the
  leaves: rewards are given exactly there (``validate.py``: ``reward_on_non_leaf`` /
  ``missing_leaf_reward``), and those steps are marked terminal.

A step's ``advantage`` (or ``group``'s ``advantages``) is the trainer's own per-node
value; it is stored as a ``credits`` row with method ``source_advantage``, as
``rtrees import`` does for the dumps of verl and TRL, so ``rtrees audit ranking
--methods source_advantage,grpo`` compares the trainer's advantages with the project's
estimators on the same trees.

Commits. Trees are buffered and committed by ``flush()`` (and on leaving the ``with``
block without an exception): one ``append_trees`` commit, then one ``append_credits``
commit when advantages were given. The commit keys are digests of the tree ids, and a
default tree id is a digest of the run, the policy version and the tree's content, so
re-running a logging step after a crash stores each tree once. A tree is validated when
it is logged: a bad input raises ``TreeValidationError`` or ``ValueError`` naming the
step, and nothing of that tree is buffered. An exception inside the ``with`` block
leaves the unflushed trees out (what earlier flushes committed stays).

This module imports nothing above ``rollout_store`` (tests/test_layering.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final

import numpy as np
import pyarrow as pa

from rollout_store.importers import SOURCE_ADVANTAGE_METHOD, task_id_for
from rollout_store.schema import CREDITS
from rollout_store.store import CommitReport, Store
from rollout_store.tree import Node, Tree

PREVIOUS: Final[int] = -1
"""``Step.parent`` default: the step just before this one (the prompt for the first)."""


@dataclass(frozen=True)
class Step:
    """One agent turn: the action the policy generated and what came back.

    ``token_ids``, ``logprobs`` (log pi of each sampled token) and ``entropies`` (of each
    step's distribution) are the action's, one per token, when known; ``observation`` /
    ``observation_token_ids`` the tool or user feedback that followed. ``reward`` is set
    on leaves only; ``reward_parts`` are its named components. ``advantage`` is the
    trainer's own credit for this node. ``parent``: an earlier step's index, ``None`` for
    the prompt, ``PREVIOUS`` for the step before.
    """

    action: str = ""
    token_ids: Sequence[int] = ()
    logprobs: Sequence[float] = ()
    entropies: Sequence[float] = ()
    observation: str = ""
    observation_token_ids: Sequence[int] = ()
    reward: float | None = None
    reward_parts: Mapping[str, float] = field(default_factory=dict)
    advantage: float | None = None
    parent: int | None = PREVIOUS
    meta: Mapping[str, Any] | None = None


@dataclass
class LogReport:
    """What a logger committed so far: trees, nodes, advantage rows, commits, and the
    trees whose commit was already in the store (a retried flush)."""

    trees: int = 0
    nodes: int = 0
    credits: int = 0
    commits: int = 0
    already_stored: int = 0
    tree_ids: list[str] = field(default_factory=list)


class TreeLogger:
    """Buffer trees built from plain Python objects and commit them to a store.

    ``store``: a ``Store`` or a path (created when missing). ``run_id``, ``env`` and
    ``sampler`` fill the trees' columns of the same names (``env`` is a label here:
    nothing is replayed). See the module docstring for the node layout and commits.
    """

    def __init__(self, store: Store | str | os.PathLike[str], run_id: str = "default", *,
                 env: str = "external", sampler: str = "external") -> None:
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        self.store = store if isinstance(store, Store) else Store(store, create=True)
        self.run_id, self.env, self.sampler = run_id, env, sampler
        self.report = LogReport()
        self._trees: list[Tree] = []
        self._advantages: list[tuple[str, int, float, str | None]] = []
        self._ids: set[str] = set()

    # ----- building ----------------------------------------------------------------------

    def tree(self, prompt: str, steps: Sequence[Step], *,
             prompt_token_ids: Sequence[int] = (), policy_version: str | None = None,
             task_id: str | None = None, tree_id: str | None = None,
             meta: Mapping[str, Any] | None = None) -> Tree:
        """Buffer the tree of ``steps`` below ``prompt`` (module docstring); return it."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
        if not steps:
            raise ValueError("a tree needs at least one step")
        parents = [_parent_of(i, s) for i, s in enumerate(steps)]
        has_child = set(parents)
        nodes = [Node(node_id=0, parent_id=None, kind="prompt", observation_text=prompt,
                      observation_token_ids=_ints(prompt_token_ids, "prompt_token_ids"))]
        for i, (s, parent) in enumerate(zip(steps, parents, strict=True)):
            if not isinstance(s, Step):
                raise ValueError(f"step {i} must be a Step, got {type(s).__name__}")
            leaf = i + 1 not in has_child
            if leaf and s.reward is None:
                raise ValueError(f"step {i} is a leaf (no step names it as parent) but has no "
                                 "reward")
            if not leaf and s.reward is not None:
                raise ValueError(f"step {i} has a reward but is not a leaf (step "
                                 f"{parents.index(i + 1)} names it as parent)")
            nodes.append(Node(
                node_id=i + 1, parent_id=parent, kind="decision", action_text=s.action,
                action_token_ids=_ints(s.token_ids, f"step {i} token_ids"),
                action_logprobs=_floats(s.logprobs, f"step {i} logprobs"),
                action_entropies=_floats(s.entropies, f"step {i} entropies"),
                observation_text=s.observation,
                observation_token_ids=_ints(s.observation_token_ids,
                                            f"step {i} observation_token_ids"),
                terminal=leaf, reward=None if s.reward is None else float(s.reward),
                reward_parts={str(k): float(v) for k, v in s.reward_parts.items()},
                meta=None if s.meta is None else dict(s.meta)))
        advantages = [(i + 1, _finite(s.advantage, f"step {i} advantage"))
                      for i, s in enumerate(steps) if s.advantage is not None]
        tid = tree_id if tree_id is not None else self._default_id(prompt, nodes,
                                                                    policy_version)
        if tid in self._ids:
            raise ValueError(f"tree id {tid!r} was already logged by this logger")
        t = Tree(tree_id=tid, nodes=nodes, run_id=self.run_id,
                 task_id=task_id if task_id is not None else task_id_for(prompt),
                 env=self.env, sampler=self.sampler, policy_version=policy_version,
                 budget=len(nodes) - 1 - len(has_child - {0}),
                 meta=None if meta is None else dict(meta))
        t.validate()  # TreeValidationError naming the node, before anything is buffered
        self._ids.add(tid)
        self._trees.append(t)
        self._advantages += [(tid, nid, a, policy_version) for nid, a in advantages]
        return t

    def group(self, prompt: str, completions: Sequence[str | Step],
              rewards: Sequence[float] | None = None, *,
              advantages: Sequence[float] | None = None, prompt_token_ids: Sequence[int] = (),
              policy_version: str | None = None, task_id: str | None = None,
              tree_id: str | None = None, meta: Mapping[str, Any] | None = None) -> Tree:
        """Buffer one GRPO group as a one-level tree: completion i is leaf i + 1.

        ``rewards`` / ``advantages``, when given, hold one value per completion and
        override the ``Step``'s own; a string completion is ``Step(action=text)``.
        """
        n = len(completions)
        if n == 0:
            raise ValueError("a group needs at least one completion")
        for name, values in (("rewards", rewards), ("advantages", advantages)):
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} values for {n} completions")
        steps = []
        for i, c in enumerate(completions):
            s = Step(action=c) if isinstance(c, str) else c
            if not isinstance(s, Step):
                raise ValueError(f"completion {i} must be a str or a Step, got "
                                 f"{type(c).__name__}")
            steps.append(Step(
                action=s.action, token_ids=s.token_ids, logprobs=s.logprobs,
                entropies=s.entropies, observation=s.observation,
                observation_token_ids=s.observation_token_ids,
                reward=s.reward if rewards is None else rewards[i],
                reward_parts=s.reward_parts,
                advantage=s.advantage if advantages is None else advantages[i],
                parent=None, meta=s.meta))
        return self.tree(prompt, steps, prompt_token_ids=prompt_token_ids,
                         policy_version=policy_version, task_id=task_id, tree_id=tree_id,
                         meta=meta)

    # ----- committing --------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Trees buffered and not yet committed."""
        return len(self._trees)

    def flush(self) -> CommitReport | None:
        """Commit the buffered trees (one commit) and their advantages (one more); return
        the trees' ``CommitReport`` (None when nothing was buffered)."""
        if not self._trees:
            return None
        trees, advantages = self._trees, self._advantages
        ids = sorted(t.tree_id for t in trees)
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:32]
        report = self.store.append_trees(trees, key=f"log:{self.run_id}:{digest}")
        self.report.commits += 1
        if report.already_committed:
            self.report.already_stored += len(trees)
        if advantages:
            self.store.append_credits(self._credit_rows(advantages),
                                      key=f"log-advantage:{self.run_id}:{digest}")
            self.report.commits += 1
            self.report.credits += len(advantages)
        self.report.trees += len(trees)
        self.report.nodes += sum(len(t.nodes) for t in trees)
        self.report.tree_ids += [t.tree_id for t in trees]
        self._trees, self._advantages = [], []
        return report

    def __enter__(self) -> TreeLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.flush()
        else:  # a failing loop: keep what earlier flushes committed, store nothing half-made
            self._trees, self._advantages = [], []

    def _credit_rows(self, advantages: Sequence[tuple[str, int, float, str | None]]
                     ) -> pa.Table:
        params = json.dumps({"source": "TreeLogger"}, sort_keys=True)
        params_hash = hashlib.sha256(params.encode()).hexdigest()[:16]
        created = datetime.now(UTC)
        return pa.Table.from_pylist([{
            "run_id": self.run_id, "method": SOURCE_ADVANTAGE_METHOD,
            "method_params_hash": params_hash, "method_params": params, "tree_id": tid,
            "node_id": nid, "value": value, "token_values": None, "policy_version": version,
            "created_at": created} for tid, nid, value, version in advantages],
            schema=CREDITS)

    def _default_id(self, prompt: str, nodes: Sequence[Node], version: str | None) -> str:
        """A digest of the run, the version and the tree's content (retries store once);
        a second identical tree of this logger gets a counter appended."""
        content = json.dumps([self.run_id, version, prompt, [
            [n.parent_id, n.action_text, n.action_token_ids, n.observation_text, n.reward]
            for n in nodes]], ensure_ascii=False)
        base = f"{self.run_id}-{hashlib.sha256(content.encode()).hexdigest()[:24]}"
        tid, i = base, 1
        while tid in self._ids:
            i += 1
            tid = f"{base}-{i}"
        return tid


def _parent_of(i: int, s: Step) -> int:
    """Node id of step ``i``'s parent (node 0 is the prompt)."""
    parent = getattr(s, "parent", PREVIOUS)
    if parent is None:
        return 0
    if parent == PREVIOUS:
        return i  # step i - 1 is node i; the first step hangs off the prompt (node 0)
    if isinstance(parent, bool) or not isinstance(parent, int) or not 0 <= parent < i:
        raise ValueError(f"step {i} parent must be an earlier step's index (0..{i - 1}), "
                         f"None (the prompt) or PREVIOUS, got {parent!r}")
    return parent + 1


def _ints(values: Sequence[int], name: str) -> list[int]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise ValueError(f"{name} must hold ints, got {type(v).__name__}")
        out.append(int(v))
    return out


def _floats(values: Sequence[float], name: str) -> list[float]:
    return [_finite(v, name) for v in values]


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ValueError(f"{name} must be numbers, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


__all__ = ["PREVIOUS", "LogReport", "Step", "TreeLogger"]
