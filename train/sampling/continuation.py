"""The continuation primitive: how an episode goes on from a stored or live node.

Every piece of code that continues an episode from a node (``TreeBuilder``, the Mean@k
reference job ``train.sampling.references``, the DSC refresh ``train.sampling.refresh``
and the studies of ``train.studies``) does it through ``Continuing``:
``Continuing.begin`` restores the node's snapshot and calls the environment's
``reseed(key)`` hook (one key per rollout, from ``train.sampling.base.mix_seed``, the
one seeding scheme), ``step`` takes one action and extends the transcript, and the step
limit is the one rule of ``Continuing.at_limit``: a rollout is cut (truncated) when it
is not done and its depth (the node's depth plus the steps taken) reached ``max_steps``.
``load_starts`` reads the ``NodeStart`` of stored nodes (``step_limit``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_store.snapshots import decompress
from train.envs.base import Environment, StepResult
from train.policies.base import Turn

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

DEFAULT_MAX_STEPS = 32
"""The step limit of a stored tree that records none (``step_limit``)."""


class ContinuationError(RuntimeError):
    """A node cannot be continued (no snapshot, a corrupt one)."""


def reseed_env(env: Environment, key: int | None) -> None:
    """Call the environment's optional ``reseed(key)`` hook (a fresh outcome stream); a
    deterministic environment has no such hook and needs none."""
    reseed = getattr(env, "reseed", None)
    if key is not None and callable(reseed):
        reseed(key)


@dataclass
class Continuing:
    """One rollout continued from a node (module docstring, "The continuation primitive").

    ``turns`` is the transcript so far (the node's path, then every step taken),
    ``depth`` the steps from the root (the node's depth plus the steps taken),
    ``max_steps`` the episode's step limit (None: no limit), ``steps`` the steps
    taken by this rollout, ``last`` the last ``StepResult``.
    """

    env: Environment
    turns: list[Turn]
    depth: int
    max_steps: int | None
    steps: int = 0
    last: StepResult | None = None

    @classmethod
    def begin(cls, env: Environment, state: bytes | None, key: int | None,
              turns: Sequence[Turn] = (), depth: int = 0,
              max_steps: int | None = None) -> Continuing:
        """Restore ``state`` (a node's snapshot; None: continue where ``env`` is) and
        reseed with ``key``: the start of every rollout from a node."""
        if state is not None:
            env.restore(state)
        reseed_env(env, key)
        return cls(env, list(turns), depth, max_steps)

    @property
    def done(self) -> bool:
        """The environment ended the episode on the last step."""
        return self.last is not None and self.last.done

    @property
    def at_limit(self) -> bool:
        """The depth reached the step limit (no further step is allowed)."""
        return self.max_steps is not None and self.depth >= self.max_steps

    @property
    def truncated(self) -> bool:
        """Cut by the step limit: not done, and at the limit."""
        return not self.done and self.at_limit

    @property
    def over(self) -> bool:
        """Done or truncated: the rollout ended (a leaf)."""
        return self.done or self.at_limit

    @property
    def reward(self) -> float:
        """The last step's ``reward_parts["reward"]`` (0 before any step)."""
        return float(self.last.reward_parts["reward"]) if self.last is not None else 0.0

    def step(self, action: str) -> StepResult:
        """Take ``action``; extend the transcript by the action and its observation."""
        result = self.env.step(action)
        self.depth += 1
        self.steps += 1
        self.turns += [("action", action), ("observation", result.observation)]
        self.last = result
        return result


@dataclass(frozen=True)
class NodeStart:
    """A stored node to continue from: its transcript, environment snapshot (None for a
    leaf), depth, the tree's step limit, and its reward when it is a leaf."""

    tree_id: str
    node_id: int
    transcript: tuple[Turn, ...]
    state: bytes | None
    depth: int
    max_steps: int
    leaf_reward: float | None

    @property
    def steps_left(self) -> int:
        return self.max_steps - self.depth

    def begin(self, env: Environment, key: int | None) -> Continuing:
        """``Continuing.begin`` from this node."""
        if self.state is None:
            raise ContinuationError(f"tree {self.tree_id!r} node {self.node_id}: a leaf has "
                                    "no snapshot to continue from")
        return Continuing.begin(env, self.state, key, self.transcript, self.depth,
                                self.max_steps)


def step_limit(env_config: str | None, override: int | None = None) -> int:
    """The step limit of a stored tree: ``override``, else ``env_config.max_steps`` (what
    ``TreeBuilder`` records: ``Task.max_steps``), else the task config's ``horizon``,
    else ``DEFAULT_MAX_STEPS``."""
    if override is not None:
        return override
    try:
        cfg = json.loads(env_config) if env_config else {}
    except json.JSONDecodeError:
        cfg = {}
    if isinstance(cfg, dict):
        for value in (cfg.get("max_steps"), (cfg.get("task") or {}).get("horizon")
                      if isinstance(cfg.get("task"), dict) else None, cfg.get("horizon")):
            if isinstance(value, int) and value > 0:
                return value
    return DEFAULT_MAX_STEPS


def load_starts(con: duckdb.DuckDBPyConnection, nodes: pa.Table,
                max_steps: int | None = None) -> list[NodeStart]:
    """The ``NodeStart`` of each stored node of ``nodes`` (columns tree_id, node_id,
    env_config), in the order given. A node's path is found with the nested-set
    columns: its ancestors ``a`` have ``a.preorder <= c.preorder < a.preorder +
    a.subtree_size``. Snapshots are decompressed and sha256-checked."""
    con.register("_start_batch", nodes.select(["tree_id", "node_id", "env_config"]))
    info = con.sql("""
        SELECT b.tree_id, b.node_id, b.env_config, c.depth, c.reward, s.state, s.state_hash,
               c.snapshot_id
        FROM _start_batch b JOIN nodes c USING (tree_id, node_id)
        LEFT JOIN snapshots s ON s.tree_id = c.tree_id AND s.snapshot_id = c.snapshot_id
        """).fetchall()
    paths = con.sql("""
        SELECT b.tree_id, b.node_id, a.parent_id IS NULL AS is_root, a.action_text,
               a.observation_text
        FROM _start_batch b JOIN nodes c USING (tree_id, node_id)
        JOIN nodes a ON a.tree_id = c.tree_id AND a.preorder <= c.preorder
                    AND c.preorder < a.preorder + a.subtree_size
        ORDER BY b.tree_id, b.node_id, a.depth""").fetchall()
    turns: dict[tuple[str, int], list[Turn]] = {}
    for tree_id, node_id, is_root, action, observation in paths:
        out = turns.setdefault((tree_id, node_id), [])
        if is_root:
            out.append(("prompt", observation or ""))
        else:
            out += [("action", action or ""), ("observation", observation or "")]
    by_key = {(r[0], r[1]): r for r in info}
    starts = []
    for tree_id, node_id in zip(nodes.column("tree_id").to_pylist(),
                                nodes.column("node_id").to_pylist(), strict=True):
        _, _, env_config, depth, reward, blob, state_hash, sid = by_key[(tree_id, node_id)]
        state = None
        if reward is None:
            if blob is None:
                raise ContinuationError(f"tree {tree_id!r} node {node_id}: no environment "
                                        f"snapshot (snapshot_id {sid!r}) to continue from")
            try:
                state = decompress(blob, state_hash)
            except ValueError as exc:
                raise ContinuationError(f"tree {tree_id!r} node {node_id}: {exc}") from exc
        starts.append(NodeStart(tree_id, int(node_id), tuple(turns[(tree_id, node_id)]), state,
                                int(depth), step_limit(env_config, max_steps), reward))
    return starts


__all__ = ["DEFAULT_MAX_STEPS", "ContinuationError", "Continuing", "NodeStart", "load_starts",
           "reseed_env", "step_limit"]
