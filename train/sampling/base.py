"""The tree builder every sampler shares: one task and a budget ``n_total`` in, one ``Tree`` out.

Node model (docs/reference/store-schema.md):

* the root (kind ``"prompt"``) holds the prompt as ``observation_text`` and the
  snapshot of the environment right after ``reset``;
* every other node is ONE agent step (the policy's action, with its token ids,
  logprobs and entropies) plus the observation the environment answered, and
  the snapshot of the environment right after that step (``Tree.snapshots``);
* a node's ``kind`` is ``"feedback_response"`` when the step was generated
  right after tool feedback, i.e. its parent is a step whose observation holds
  a ``<tool_response>`` (an error response counts: it is feedback too), and
  ``"decision"`` otherwise (the first step after the prompt, or a step after an
  observation that is not tool feedback) [R];
* ``segments`` (computed in ``train.sampling.segments``) split the action tokens
  by the text they decode to: the
  ``<tool_call>...</tool_call>`` blocks are ``tool_call``, the
  ``<answer>...</answer>`` blocks ``answer``, and the rest is ``summary`` in a
  step that answers and ``text`` (reasoning) in any other step [R];
* ``observation_token_ids`` are the policy's ``encode(observation_text)`` when
  the policy has such a method (the raw observation, without the chat
  template's wrapping), else empty [R];
* a leaf is where the episode ended (the environment said ``done``: ``terminal``
  is True) or where the task's step limit ``Task.max_steps`` cut it
  (``terminal`` False, ``meta["truncated"]`` True); leaves carry
  ``reward = reward_parts["reward"]`` and the reward parts of their last step.

Rollouts and the budget. A *rollout* starts at a node v (the root for a full
trajectory, any non-leaf node for a suffix) and runs to a leaf; it creates one
new child chain, so a tree holds exactly one leaf per rollout. Each rollout
costs 1 against ``n_total`` under the phase that spent it (``Budget``);
``Budget.spend`` refuses to overspend, so no sampler can. A node's ``phase`` is
the phase of the rollout that created it.

Divergence drops the branch, never the tree. When restoring a snapshot does not
reach the recorded state (the environment raises ``train.envs.base.SnapshotDivergence``:
a replayed step or an agent program's model call came out otherwise, e.g. a random
tool), the rollout that needed it is dropped: it is never attached to the shared
prefix, and what it had added below its start (its chain, when a restore of its own
last node diverged) is pruned when the tree is finished, with every node left without
a leaf below it. The node it started from gets ``meta["diverged"]`` (the first
divergence's ``where``, e.g. ``{"call": 2, "field": "messages[2].content"}``, and
``"rollouts"``, how many were dropped there; the nearest kept ancestor when that node
was pruned), and the rest of the tree is sampled and committed as usual. The dropped
rollout stays *spent*: it is recorded as lost (``Budget.lost``, the tree's
``meta["diverged_rollouts"]`` by phase) rather than refunded, so the budget a sampler
sees, the reseed keys and row seeds every other rollout draws, and so the rest of the
tree, stay a function of seed, task, policy, sampler and where the environment
diverged (a refund would make the sampler respend, and its later draws depend on the
divergence twice). Such a tree holds one leaf per rollout that was not lost; one whose
rollouts were all lost has no leaf and fails by name with the first divergence.

Branching never replays: a rollout that starts at v restores the environment
from v's snapshot, calls the environment's optional ``reseed(key)`` hook (a
fresh outcome stream per rollout, so sibling rollouts of a stochastic world
differ; deterministic tools have no such hook and need none) and continues the
transcript of v's path, which the policy receives as a prefix and never
regenerates. Rollouts run in lockstep: each round asks for the next step of
every live rollout of the tree at once (one ``Decode`` of the rollout engine,
``train.sampling.engine``, which batches it with the rounds of every other tree in
flight); each row's random stream is keyed by (seed, node, draw), so a tree does
not depend on its batch; the environment is restored from the branch's last
snapshot before each step (skipped when it is already there). ``TreeBuilder.run``
and ``Sampler.grow`` are generators (programs of the engine): a sampler writes
``leaves = yield from builder.run(starts)``.

The continuation primitive (``Continuing``, ``load_starts``) is
``train.sampling.continuation``: this builder continues every rollout through it.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from rollout_store.tree import Node, Tree, extend_transcript
from train.envs.base import Environment, SnapshotDivergence, Task, parse_action
from train.envs.registry import spec_of
from train.policies.base import Continuation, Decoding, Policy, Rows, SampleConfig, Turn
from train.sampling.continuation import ContinuationError, Continuing, step_limit
from train.sampling.engine import Decode, Engine, EnvSource, Request, TreeJob, Work
from train.sampling.segments import action_segments, head_entropy, token_char_starts

if TYPE_CHECKING:
    pass

SamplerName = Literal["group", "random", "entropy", "bel", "caliper", "rooted"]
SAMPLER_NAMES: tuple[SamplerName, ...] = ("group", "random", "entropy", "bel", "caliper",
                                         "rooted")

_MASK63 = (1 << 63) - 1
_MASK62 = (1 << 62) - 1


def mix_seed(*parts: int | str) -> int:
    """A 63-bit seed from integers and strings (stable across processes and runs)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK63


class BudgetError(RuntimeError):
    """A sampler tried to spend more rollouts than ``n_total`` allows."""


@dataclass
class Budget:
    """``n_total`` rollouts; ``by_phase`` counts what each phase spent so far, ``lost``
    the spent rollouts of each phase that were dropped without a leaf (a snapshot
    restore diverged: module docstring). Lost rollouts stay spent (``used`` counts
    them), so ``by_phase[p] - lost.get(p, 0)`` leaves of phase ``p`` are in the tree."""

    n_total: int
    by_phase: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_total < 1:
            raise ValueError(f"n_total must be >= 1, got {self.n_total}")

    @property
    def used(self) -> int:
        return sum(self.by_phase.values())

    @property
    def remaining(self) -> int:
        return self.n_total - self.used

    def spend(self, phase: str, n: int) -> None:
        if n < 1:
            raise BudgetError(f"a spend must be >= 1 rollout, got {n}")
        if n > self.remaining:
            raise BudgetError(f"phase {phase!r} asked for {n} rollouts, {self.remaining} of "
                              f"{self.n_total} left")
        self.by_phase[phase] = self.by_phase.get(phase, 0) + n

    def lose(self, phase: str, n: int = 1) -> None:
        """Record ``n`` rollouts of ``phase``, already spent, as dropped without a leaf."""
        if n < 1 or self.lost.get(phase, 0) + n > self.by_phase.get(phase, 0):
            raise BudgetError(f"phase {phase!r} cannot lose {n} rollouts: it spent "
                              f"{self.by_phase.get(phase, 0)}, lost {self.lost.get(phase, 0)}")
        self.lost[phase] = self.lost.get(phase, 0) + n


@dataclass(frozen=True)
class SamplerConfig(Decoding):
    """What every sampler shares: how the policy samples (``Decoding``: token cap,
    temperature, nucleus mass), and what counts as success."""

    success_threshold: float = 1.0
    """A leaf succeeds when its reward is >= this (binary rewards: "reaches reward 1"):
    the one success rule of a run (samplers, dynamic sampling, the trainer's success
    metric and its held-out evaluation)."""


# A start of rollouts: (node id to continue from, how many rollouts, phase).
Start = tuple[int, int, str]
OnStep = Callable[[Node], Sequence[Start]]


@dataclass
class _Branch:
    start: int  # index of the start that spawned it
    node: int  # the branch's last node
    phase: str
    rollout: Continuing  # the continuation (its env is the builder's one env)
    origin: int  # the node it started from


class TreeBuilder:
    """One tree under construction: nodes, snapshots, the budget, and the rollout engine.

    Samplers call ``run`` with the starts of the rollouts they want, read the
    nodes back (``node``, ``path``, ``children``, ``leaf_reward``) and finish
    with ``finish``. ``rng`` is the sampler's own random source (seeded per tree).
    ``env_steps`` / ``restores`` / ``policy_calls`` count the work done.

    ``phase_seeds`` seeds the ``run`` calls whose first start has one of its phases
    (their rollouts' reseed keys and their policy calls) with its seed instead of
    ``seed``: trees that share ``seed`` then share their other phases and differ in
    those (the localization study: one explore phase, independent probes).

    ``graft`` starts a builder from a stored tree (its root and copies of stored paths)
    instead of ``reset``, and ``run(forced=...)`` replays a stored action as a rollout's
    first step: the reuse refresh grows its trees this way (``train.sampling.refresh``),
    so they follow the same node and leaf rules as every sampled tree.
    """

    def __init__(self, env: Environment, policy: Policy, task: Task, n_total: int, *,
                 sampler: str, config: SamplerConfig, seed: int, tree_id: str,
                 run_id: str = "default", phase_seeds: Mapping[str, int] | None = None,
                 root: tuple[str, bytes] | None = None) -> None:
        self.env, self.policy, self.task, self.config = env, policy, task, config
        self.sampler, self.seed, self.tree_id, self.run_id = sampler, seed, tree_id, run_id
        self.phase_seeds = dict(phase_seeds or {})
        self._run_seed = seed
        self.budget = Budget(n_total)
        self.rng = np.random.default_rng(mix_seed(seed, "sampler"))
        self.critical_node_id: int | None = None
        self.meta: dict[str, Any] = {}
        self.env_steps = self.restores = self.policy_calls = 0
        self._nodes: dict[int, Node] = {}
        self._children: dict[int, list[int]] = {}
        self._depth: dict[int, int] = {}
        self._turns: dict[int, tuple[Turn, ...]] = {}
        self.snapshots: dict[str, bytes] = {}
        self._n_rollouts = 0
        self._draws: dict[int, int] = {}  # node -> rows drawn from it so far
        self._divergence: SnapshotDivergence | None = None  # the first one (module doc)
        if root is None:
            prompt = env.reset(task)
            state: bytes = env.snapshot()
            self._env_at: int | None = 0
        else:  # a stored root (``graft``): the environment is restored when a rollout begins
            prompt, state = root
            self._env_at = None
        node = Node(node_id=0, parent_id=None, kind="prompt", observation_text=prompt)
        self._add(node, state, depth=0, turns=(("prompt", prompt),))

    @classmethod
    def graft(cls, env: Environment, policy: Policy, tree: Tree, node_ids: Sequence[int], *,
              sampler: str, config: SamplerConfig, seed: int, tree_id: str,
              run_id: str = "default", n_total: int = 1 << 30, phase: str = "copy"
              ) -> tuple[TreeBuilder, dict[int, int]]:
        """A builder that starts from the stored ``tree``'s root (its prompt and snapshot,
        no ``reset``) with copies of the stored paths root -> v for each v of ``node_ids``
        (the union, in the order given); returns it and {stored node id: new node id}.

        A copy keeps the stored step (action, tokens, logprobs, observation, kind,
        segments) and its snapshot when the store holds one; it is of phase ``phase`` and
        of no rollout (``tool_calls`` 0, no reward, not terminal, ``meta["copy_of"]`` the
        stored id), so it costs nothing new. The task is rebuilt from the stored tree
        (``task_id``, ``env_config``'s task config, its step limit ``step_limit``)."""
        cfg = dict(tree.env_config or {})
        limit = cfg.get("max_steps")
        if not isinstance(limit, int) or limit < 1:
            limit = step_limit(json.dumps(cfg))
        stored_root = tree.root()
        if stored_root.snapshot_id is None or stored_root.snapshot_id not in tree.snapshots:
            raise ContinuationError(f"tree {tree.tree_id!r}: the root has no snapshot")
        task = Task(task_id=tree.task_id or tree.tree_id, env=tree.env or spec_of(env),
                    prompt=stored_root.observation_text or "", max_steps=limit,
                    config=dict(cfg.get("task") or {}))
        builder = cls(env, policy, task, n_total, sampler=sampler, config=config, seed=seed,
                      tree_id=tree_id, run_id=run_id,
                      root=(stored_root.observation_text or "",
                            tree.snapshots[stored_root.snapshot_id]))
        copied = {stored_root.node_id: 0}
        builder.copy_paths(tree, node_ids, copied, phase)
        return builder, copied

    def copy_paths(self, tree: Tree, node_ids: Sequence[int], copied: dict[int, int],
                   phase: str = "copy") -> None:
        """Copy the stored paths root -> v of ``node_ids`` that ``copied`` ({stored node
        id: new node id}, updated) does not hold yet (``graft``; a refresh copies a site's
        path only when it draws there, so no copied step is left without a rollout)."""
        for v in node_ids:
            for stored in tree.path_to(v)[1:]:
                if stored.node_id not in copied:
                    copied[stored.node_id] = self._copy(
                        stored, copied[stored.parent_id or 0], tree, phase)

    def _copy(self, stored: Node, parent: int, tree: Tree, phase: str) -> int:
        """Add a copy of a stored step under ``parent`` (``graft``); returns its id."""
        nid = len(self._nodes)
        node = replace(stored, node_id=nid, parent_id=parent, tool_calls=0, phase=phase,
                       reward=None, reward_parts={}, terminal=False,
                       meta={**(stored.meta or {}), "copy_of": stored.node_id})
        state = tree.snapshots.get(stored.snapshot_id or "")
        self._add(node, state, self._depth[parent] + 1,
                  extend_transcript(self._turns[parent], stored))
        return nid

    # ----- reading the tree ---------------------------------------------------------------

    def node(self, node_id: int) -> Node:
        return self._nodes[node_id]

    @property
    def nodes(self) -> list[Node]:
        return list(self._nodes.values())

    def children(self, node_id: int) -> list[int]:
        return self._children[node_id]

    def depth(self, node_id: int) -> int:
        return self._depth[node_id]

    def is_leaf(self, node_id: int) -> bool:
        """Whether the node ends a rollout (leaves are exactly the nodes with a reward)."""
        return self._nodes[node_id].reward is not None

    def path(self, node_id: int) -> list[Node]:
        """The step nodes from the root's child down to ``node_id`` (the root excluded)."""
        out = []
        nid: int | None = node_id
        while nid is not None and nid != 0:
            node = self._nodes[nid]
            out.append(node)
            nid = node.parent_id
        return out[::-1]

    def transcript(self, node_id: int) -> tuple[Turn, ...]:
        """The episode up to and including ``node_id``'s observation, as typed turns."""
        return self._turns[node_id]

    def leaf_reward(self, node_id: int) -> float:
        reward = self._nodes[node_id].reward
        if reward is None:
            raise ValueError(f"node {node_id} is not a leaf")
        return reward

    def succeeded(self, leaf_id: int) -> bool:
        return self.leaf_reward(leaf_id) >= self.config.success_threshold

    def snapshot_of(self, node_id: int) -> bytes:
        sid = self._nodes[node_id].snapshot_id
        if sid is None:
            raise ContinuationError(f"tree {self.tree_id!r} node {node_id}: no snapshot to "
                                    "continue from")
        return self.snapshots[sid]

    # ----- growing the tree -----------------------------------------------------------------

    def run(self, starts: Sequence[Start], on_step: OnStep | None = None,
            forced: Sequence[Continuation | None] | None = None
            ) -> Generator[Request, Any, list[list[int]]]:
        """Run ``n`` rollouts from each ``(node_id, n, phase)`` start to their leaves (a
        program step of ``train.sampling.engine``: ``leaves = yield from builder.run(...)``).

        The budget is charged up front (``BudgetError`` when it does not allow it).
        Each lockstep round yields one ``Decode`` (new starts sample n branches, live
        ones 1; row seeds keyed by (seed, node, draw)) and one ``Work`` that takes the
        round's steps in the environment. ``on_step(node)`` is called for every new
        step node and may return more starts, charged at once (so the next call sees
        the budget left) and run from the next lockstep round on (entropy branching).
        Returns the leaf ids of each start, in ``starts`` order, then the extra starts
        in the order they were returned; a rollout dropped because a restore diverged
        (module docstring) has no leaf, so a start can return fewer than its n.

        ``forced[i]`` (when given and not None) is the first step of start i, taken as
        it is instead of sampled (its tokens and logprobs kept: a stored action replayed,
        the refresh of ``train.sampling.refresh``); such a start has n = 1 and draws no
        row in its first round.
        """
        pending: list[tuple[int, int, str, int, Continuation | None]] = []
        leaves: list[list[int]] = []
        if starts:
            self._run_seed = self.phase_seeds.get(starts[0][2], self.seed)
        if forced is not None and len(forced) != len(starts):
            raise ValueError(f"forced has {len(forced)} entries for {len(starts)} starts")

        def add(new: Sequence[Start], first: Sequence[Continuation | None] | None = None
                ) -> None:
            for i, (node_id, n, phase) in enumerate(new):
                if node_id not in self._nodes or self.is_leaf(node_id):
                    raise ValueError(f"cannot start rollouts at node {node_id}: "
                                     "not an inner node of this tree")
                cont = first[i] if first is not None else None
                if cont is not None and n != 1:
                    raise ValueError(f"a forced start has n = 1, got {n}")
                self.budget.spend(phase, n)
                pending.append((node_id, n, phase, len(leaves), cont))
                leaves.append([])

        add(starts, forced)
        active: list[_Branch] = []
        while pending or active:
            owners: list[_Branch | tuple[int, str, int]] = [
                *((node_id, phase, idx) for node_id, _, phase, idx, _ in pending), *active]
            given: list[list[Continuation] | None] = [
                None if cont is None else [cont] for *_, cont in pending]
            given += [None] * len(active)
            rows = [Rows(self._turns[node_id], n, self._row_seed(node_id, n))
                    for node_id, n, _, _, cont in pending if cont is None]
            rows += [Rows(self._turns[br.node], 1, self._row_seed(br.node, 1)) for br in active]
            pending = []
            sampled: list[list[Continuation]] = []
            if rows:
                self.policy_calls += len({r.n for r in rows})  # the calls of a lone tree
                sampled = yield Decode(rows, self._sample_config)
            it = iter(sampled)
            conts = [g if g is not None else next(it) for g in given]

            def apply(owners: list[_Branch | tuple[int, str, int]] = owners,
                      conts: list[list[Continuation]] = conts) -> list[_Branch]:
                live: list[_Branch] = []
                for owner, cont_list in zip(owners, conts, strict=True):
                    for cont in cont_list:
                        try:
                            br = owner if isinstance(owner, _Branch) else self._begin(*owner)
                            child = self._step(br, cont)
                        except SnapshotDivergence as exc:  # the env is not deterministic
                            if isinstance(owner, _Branch):
                                self._drop(owner.origin, owner.phase, exc)
                            else:
                                self._drop(owner[0], owner[1], exc)
                            continue
                        if child.reward is not None:
                            leaves[br.start].append(child.node_id)
                        else:
                            br.node = child.node_id
                            live.append(br)
                        if on_step is not None:
                            add(on_step(child))  # charged now: later hooks see the budget left
                return live

            steps = sum(len(c) for c in conts)  # env steps of this work, one after another
            active = yield Work(apply, lag=self.env.tool_lag * steps)
        return leaves

    def finish(self) -> Tree:
        """The finished tree (validated by the store when committed; ``Tree.validate``):
        the chains of dropped rollouts pruned (module docstring), and the first
        ``SnapshotDivergence`` raised when no rollout reached a leaf."""
        self._prune()
        if not self._children[0]:
            assert self._divergence is not None  # a spent budget gives the root a child
            raise self._divergence
        if self.budget.lost:
            self.meta["diverged_rollouts"] = dict(self.budget.lost)
        policy_ref = getattr(self.policy, "policy_ref", None)
        return Tree(
            tree_id=self.tree_id, nodes=self.nodes, run_id=self.run_id,
            task_id=self.task.task_id, env=spec_of(self.env), sampler=self.sampler,
            env_config={"task": self.task.config, "max_steps": self.task.max_steps},
            policy_version=str(self.policy.policy_version),
            policy_ref=None if policy_ref is None else str(policy_ref),
            budget=self.budget.n_total, rollouts_by_phase=dict(self.budget.by_phase),
            seed=self.seed, critical_node_id=self.critical_node_id,
            meta={"config": asdict(self.config), "env_steps": self.env_steps,
                  "restores": self.restores, "policy_calls": self.policy_calls, **self.meta},
            snapshots=dict(self.snapshots),
        )

    # ----- internals ----------------------------------------------------------------------

    def _begin(self, node_id: int, phase: str, start: int) -> _Branch:
        """A new rollout from ``node_id``: restore its snapshot, reseed (the primitive)."""
        key = mix_seed(self._run_seed, "rollout", self._n_rollouts)
        self._n_rollouts += 1
        rollout = Continuing.begin(self.env, self.snapshot_of(node_id), key,
                                   self._turns[node_id], self._depth[node_id],
                                   self.task.max_steps)
        self.restores += 1
        self._env_at = node_id
        return _Branch(start, node_id, phase, rollout, node_id)

    def _drop(self, origin: int, phase: str, exc: SnapshotDivergence) -> None:
        """Drop a rollout of ``phase`` from ``origin`` whose restore diverged: it stays
        spent (``Budget.lose``) and ``origin`` is marked (module docstring)."""
        self.budget.lose(phase)
        self._env_at = None  # the environment is at no node: the next step restores
        if self._divergence is None:
            self._divergence = exc
        self._mark(self._nodes[origin], {**exc.where, "rollouts": 1})

    @staticmethod
    def _mark(node: Node, diverged: dict[str, Any]) -> None:
        """Add ``diverged`` to the node's ``meta["diverged"]`` (the first ``where`` kept,
        ``rollouts`` summed)."""
        meta = dict(node.meta or {})
        old = meta.get("diverged")
        meta["diverged"] = ({**old, "rollouts": old["rollouts"] + diverged["rollouts"]}
                            if old else diverged)
        node.meta = meta

    def _prune(self) -> None:
        """Remove every step node without a leaf below it (what dropped rollouts left:
        each one's chain ends in a node with neither a child nor a reward); a pruned
        node's ``diverged`` mark moves to its nearest kept ancestor. Node ids of the
        kept nodes do not change."""
        dangling = [nid for nid, kids in self._children.items()
                    if nid != 0 and not kids and self._nodes[nid].reward is None]
        while dangling:
            nid = dangling.pop()
            node = self._nodes.pop(nid)
            parent = node.parent_id
            assert parent is not None
            del self._children[nid], self._depth[nid], self._turns[nid]
            if node.snapshot_id is not None:
                self.snapshots.pop(node.snapshot_id, None)
            self._children[parent].remove(nid)
            if node.meta and "diverged" in node.meta:
                self._mark(self._nodes[parent], node.meta["diverged"])
            if parent != 0 and not self._children[parent] and \
                    self._nodes[parent].reward is None:
                dangling.append(parent)

    @property
    def _sample_config(self) -> SampleConfig:
        c = self.config
        return SampleConfig(n=1, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                            top_p=c.top_p)

    def _row_seed(self, node_id: int, n: int) -> int:
        """The stream seed of the next ``n`` draws from ``node_id``: keyed by (run seed,
        node, draw index), so it depends on the tree alone (branch k: seed + k)."""
        draw = self._draws.get(node_id, 0)
        self._draws[node_id] = draw + n
        return mix_seed(self._run_seed, "row", node_id, draw) & _MASK62

    def _encode(self, text: str) -> list[int]:
        """The observation's token ids when the policy can encode text (``encode``), else []."""
        encode = getattr(self.policy, "encode", None)
        return [int(i) for i in encode(text)] if callable(encode) and text else []

    def _add(self, node: Node, state: bytes | None, depth: int, turns: tuple[Turn, ...]
             ) -> None:
        sid = f"{self.tree_id}/{node.node_id}"
        node.snapshot_id = sid if state is not None else None
        if state is not None:
            self.snapshots[sid] = state
        self._nodes[node.node_id] = node
        self._children[node.node_id] = []
        self._depth[node.node_id] = depth
        self._turns[node.node_id] = turns
        if node.parent_id is not None:
            self._children[node.parent_id].append(node.node_id)

    def _step(self, br: _Branch, cont: Continuation) -> Node:
        parent = self._nodes[br.node]
        if self._env_at != parent.node_id:  # another branch stepped the shared env
            self.env.restore(self.snapshot_of(parent.node_id))
            self.restores += 1
        rollout = br.rollout
        result = rollout.step(cont.text)
        self.env_steps += 1
        depth, truncated, leaf = rollout.depth, rollout.truncated, rollout.over
        feedback = parent.parent_id is not None and "<tool_response>" in parent.observation_text
        node = Node(
            node_id=len(self._nodes), parent_id=parent.node_id,
            kind="feedback_response" if feedback else "decision",
            action_text=cont.text, action_token_ids=list(cont.token_ids),
            action_logprobs=list(cont.logprobs), action_entropies=list(cont.entropies),
            observation_text=result.observation,
            observation_token_ids=self._encode(result.observation),
            segments=action_segments(cont.text, token_char_starts(self.policy, cont)),
            terminal=result.done,
            reward=float(result.reward_parts["reward"]) if leaf else None,
            reward_parts=dict(result.reward_parts) if leaf else {},
            n_gen_tokens=len(cont.token_ids),
            tool_calls=int(parse_action(cont.text).kind == "tool_call"),
            phase=br.phase, meta={"truncated": True} if truncated else None,
        )
        step_meta = getattr(self.env, "step_meta", None)  # optional (``Environment``)
        extra = step_meta() if callable(step_meta) else None
        if extra:
            node.meta = {**(node.meta or {}), **extra}
        self._add(node, self.env.snapshot(), depth, tuple(rollout.turns))
        self._env_at = node.node_id
        return node


class Sampler(ABC):
    """Turns one task and a rollout budget into one tree (see the module docstring).

    Subclasses set ``name`` and ``config_class`` and implement ``grow``, which
    must spend the whole budget through ``TreeBuilder.run``.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[SamplerConfig]] = SamplerConfig
    rank_refusal: ClassVar[str | None] = None
    """Why data-parallel ranks cannot share this sampler within an iteration (completing
    ``sampler NAME ...``); None: they can (each samples its own trees)."""

    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = config if config is not None else self.config_class()
        if not isinstance(self.config, self.config_class):
            raise TypeError(f"{self.name} needs a {self.config_class.__name__}, "
                            f"got {type(self.config).__name__}")

    @abstractmethod
    def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
        """Spend ``builder.budget`` on rollouts (``yield from builder.run(...)``) and set
        ``critical_node_id`` / ``meta``: a program of ``train.sampling.engine``."""

    def begin_wave(self) -> None:  # noqa: B027 - optional hook
        """Called before the engine runs a set of this sampler's trees together."""

    def end_wave(self) -> None:  # noqa: B027 - optional hook
        """Called after it (``caliper`` adds the wave's bucket counts here)."""

    def sample_tree(self, env: Environment, policy: Policy, task: Task, n_total: int, *,
                    seed: int, tree_id: str | None = None, run_id: str = "default",
                    phase_seeds: Mapping[str, int] | None = None) -> Tree:
        """One tree of ``task`` with exactly ``n_total`` rollouts (``phase_seeds``: see
        ``TreeBuilder``): a one-tree ``Engine.sample_trees`` call."""
        job = TreeJob(self, env, task, n_total, seed, tree_id or f"{run_id}/{task.task_id}",
                      run_id, phase_seeds)
        return Engine(policy).sample_trees([job])[0]

    def tree_program(self, job: TreeJob, policy: Policy) -> Generator[Request, Any, Tree]:
        """The engine's program of one tree of this sampler: build its ``TreeBuilder``
        (environment reset in the pool), run ``grow``, check the budget was spent,
        finish."""
        owned = not isinstance(job.env, Environment)
        source: EnvSource = job.env
        env: Environment = yield Work(source if owned else lambda: source)  # type: ignore[arg-type]
        try:
            def build() -> TreeBuilder:
                return TreeBuilder(env, policy, job.task, job.n_total, sampler=self.name,
                                   config=self.config, seed=job.seed, tree_id=job.tree_id,
                                   run_id=job.run_id, phase_seeds=job.phase_seeds)

            builder: TreeBuilder = yield Work(build)
            yield from self.grow(builder)
            if builder.budget.remaining:
                raise BudgetError(f"{self.name} left {builder.budget.remaining} of "
                                  f"{job.n_total} rollouts unspent")
            return builder.finish()
        finally:
            if owned:
                env.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


__all__ = ["SAMPLER_NAMES", "Budget", "BudgetError", "OnStep", "Sampler", "SamplerConfig",
           "SamplerName", "Start", "TreeBuilder", "action_segments", "head_entropy", "mix_seed",
           "token_char_starts"]
