"""The rollout engine every sampler shares: one task and a budget ``n_total`` in, one ``Tree`` out.

Node model (DESIGN.md section 3):

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
* ``segments`` split the action tokens by the text they decode to: the
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

Branching never replays: a rollout that starts at v restores the environment
from v's snapshot, calls the environment's optional ``reseed(key)`` hook (a
fresh outcome stream per rollout, so sibling rollouts of a stochastic world
differ; deterministic tools have no such hook and need none) and continues the
transcript of v's path, which the policy receives as a prefix and never
regenerates. Rollouts run in lockstep: each round asks the policy for the next
step of every live rollout at once (one ``sample`` call per distinct ``n``), so
a batched backend sees the whole frontier; the environment is restored from the
branch's last snapshot before each step (skipped when it is already there).
"""

from __future__ import annotations

import hashlib
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from rollout_store.schema import SegmentKind
from rollout_store.tree import Node, Segment, Tree
from train.envs.base import Environment, Task, parse_action
from train.policies.base import Continuation, Policy, SampleConfig, Turn

SamplerName = Literal["group", "random", "entropy", "bel", "caliper"]
SAMPLER_NAMES: tuple[SamplerName, ...] = ("group", "random", "entropy", "bel", "caliper")

_MASK63 = (1 << 63) - 1
_BLOCK_RE = re.compile(r"<tool_call>.*?</tool_call>|<answer>.*?</answer>", re.DOTALL)


def mix_seed(*parts: int | str) -> int:
    """A 63-bit seed from integers and strings (stable across processes and runs)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK63


class BudgetError(RuntimeError):
    """A sampler tried to spend more rollouts than ``n_total`` allows."""


@dataclass
class Budget:
    """``n_total`` rollouts; ``by_phase`` counts what each phase spent so far."""

    n_total: int
    by_phase: dict[str, int] = field(default_factory=dict)

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


@dataclass(frozen=True)
class SamplerConfig:
    """What every sampler shares: how the policy samples, and what counts as success."""

    max_new_tokens: int = 128
    """Token cap of one agent step (``SampleConfig.max_new_tokens``)."""
    temperature: float = 1.0
    """Sampling temperature (``SampleConfig.temperature``)."""
    top_p: float = 1.0
    """Nucleus mass (``SampleConfig.top_p``)."""
    success_threshold: float = 1.0
    """A leaf succeeds when its reward is >= this (binary rewards: "reaches reward 1")."""

    def __post_init__(self) -> None:
        SampleConfig(n=1, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                     top_p=self.top_p)  # the same checks, the same messages


# A start of rollouts: (node id to continue from, how many rollouts, phase).
Start = tuple[int, int, str]
OnStep = Callable[[Node], Sequence[Start]]


@dataclass
class _Branch:
    start: int  # index of the start that spawned it
    node: int  # the branch's last node
    phase: str
    reseed_key: int | None  # set until the branch's first step is taken


def head_entropy(node: Node, n_tokens: int | None = None) -> float:
    """Mean entropy of the first ``n_tokens`` action tokens of ``node`` (all when None);
    NaN for a node without tokens."""
    ent = node.action_entropies if n_tokens is None else node.action_entropies[:n_tokens]
    return float(np.mean(ent)) if len(ent) else math.nan


def token_char_starts(policy: Policy, cont: Continuation) -> list[int]:
    """Character offset in ``cont.text`` where each token starts.

    In order of preference: the policy's ``token_texts()`` (each token id decoded
    alone, as ``HFPolicy`` offers) summed up; its ``decode(token_ids) -> str``
    applied to growing prefixes; one token per character when the counts match
    (a character tokenizer); else tokens spread evenly over the text [R: an
    approximation that moves segment borders by a token or so]. Offsets are
    clamped to the text (a trailing EOS token decodes to nothing in ``text``).
    """
    ids, text = cont.token_ids, cont.text
    n = len(ids)
    if not n:
        return []
    token_texts = getattr(policy, "token_texts", None)
    if callable(token_texts):
        table = token_texts()
        if all(0 <= i < len(table) for i in ids):
            lengths = np.cumsum([0] + [len(table[i]) for i in ids[:-1]])
            return [min(int(x), len(text)) for x in lengths]
    decode = getattr(policy, "decode", None)
    if callable(decode):
        try:
            return [min(len(str(decode(ids[:i]))), len(text)) for i in range(n)]
        except Exception:  # a decode that cannot do prefixes: fall back
            pass
    if n == len(text):
        return list(range(n))
    return [(i * len(text)) // n for i in range(n)]


def action_segments(text: str, char_starts: Sequence[int]) -> list[Segment]:
    """Token spans of an action: ``tool_call`` / ``answer`` blocks, the rest ``summary``
    (in a step that answers) or ``text`` (elsewhere). Every token is in one segment."""
    n = len(char_starts)
    if n == 0:
        return []
    blocks = [(m.start(), m.end(), "tool_call" if m.group().startswith("<tool_call>")
               else "answer") for m in _BLOCK_RE.finditer(text)]
    rest: SegmentKind = "summary" if any(k == "answer" for *_, k in blocks) else "text"
    labels: list[SegmentKind] = []
    b = 0
    for c in char_starts:
        while b < len(blocks) and blocks[b][1] <= c:
            b += 1
        inside = b < len(blocks) and blocks[b][0] <= c < blocks[b][1]
        labels.append(blocks[b][2] if inside else rest)  # type: ignore[arg-type]
    segments: list[Segment] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or labels[i] != labels[start]:
            segments.append(Segment(labels[start], start, i))
            start = i
    return segments


class TreeBuilder:
    """One tree under construction: nodes, snapshots, the budget, and the rollout engine.

    Samplers call ``run`` with the starts of the rollouts they want, read the
    nodes back (``node``, ``path``, ``children``, ``leaf_reward``) and finish
    with ``finish``. ``rng`` is the sampler's own random source (seeded per tree).
    ``env_steps`` / ``restores`` / ``policy_calls`` count the work done.
    """

    def __init__(self, env: Environment, policy: Policy, task: Task, n_total: int, *,
                 sampler: str, config: SamplerConfig, seed: int, tree_id: str,
                 run_id: str = "default") -> None:
        self.env, self.policy, self.task, self.config = env, policy, task, config
        self.sampler, self.seed, self.tree_id, self.run_id = sampler, seed, tree_id, run_id
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
        prompt = env.reset(task)
        self._env_at: int | None = 0
        root = Node(node_id=0, parent_id=None, kind="prompt", observation_text=prompt)
        self._add(root, env.snapshot(), depth=0, turns=(("prompt", prompt),))

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
        assert sid is not None
        return self.snapshots[sid]

    # ----- growing the tree -----------------------------------------------------------------

    def run(self, starts: Sequence[Start], on_step: OnStep | None = None) -> list[list[int]]:
        """Run ``n`` rollouts from each ``(node_id, n, phase)`` start to their leaves.

        The budget is charged up front (``BudgetError`` when it does not allow it).
        ``on_step(node)`` is called for every new step node and may return more
        starts, charged at once (so the next call sees the budget left) and run
        from the next lockstep round on (entropy branching). Returns the leaf
        ids of each start, in ``starts`` order, then the extra starts in the
        order they were returned.
        """
        pending: list[tuple[int, int, str, int]] = []
        leaves: list[list[int]] = []

        def add(new: Sequence[Start]) -> None:
            for node_id, n, phase in new:
                if node_id not in self._nodes or self.is_leaf(node_id):
                    raise ValueError(f"cannot start rollouts at node {node_id}: "
                                     "not an inner node of this tree")
                self.budget.spend(phase, n)
                pending.append((node_id, n, phase, len(leaves)))
                leaves.append([])

        add(starts)
        active: list[_Branch] = []
        while pending or active:
            # one policy call per distinct n: new starts sample n branches, live ones 1
            requests: list[tuple[int, _Branch | tuple[int, str, int]]] = []
            for node_id, n, phase, idx in pending:
                requests.append((n, (node_id, phase, idx)))
            for br in active:
                requests.append((1, br))
            pending = []
            conts: list[list[Continuation]] = [[] for _ in requests]
            for n in sorted({n for n, _ in requests}):
                rows = [i for i, (m, _) in enumerate(requests) if m == n]
                transcripts = [self._turns[self._owner_node(requests[i][1])] for i in rows]
                out = self.policy.sample(transcripts, self._sample_config(n))
                if len(out) != len(rows) or any(len(o) != n for o in out):
                    raise RuntimeError(f"policy returned {[len(o) for o in out]} continuations "
                                       f"for {len(rows)} transcripts with n={n}")
                for i, o in zip(rows, out, strict=True):
                    conts[i] = o
            active = []
            for (_, owner), cont_list in zip(requests, conts, strict=True):
                for cont in cont_list:
                    if isinstance(owner, _Branch):
                        br = owner
                    else:
                        node_id, phase, idx = owner
                        br = _Branch(idx, node_id, phase, mix_seed(self.seed, "rollout",
                                                                   self._n_rollouts))
                        self._n_rollouts += 1
                    child = self._step(br, cont)
                    if child.reward is not None:
                        leaves[br.start].append(child.node_id)
                    else:
                        active.append(_Branch(br.start, child.node_id, br.phase, None))
                    if on_step is not None:
                        add(on_step(child))  # charged now: later hooks see the budget left
        return leaves

    def finish(self) -> Tree:
        """The finished tree (validated by the store when committed; ``Tree.validate``)."""
        policy_ref = getattr(self.policy, "policy_ref", None)
        return Tree(
            tree_id=self.tree_id, nodes=self.nodes, run_id=self.run_id,
            task_id=self.task.task_id, env=self.env.name, sampler=self.sampler,
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

    @staticmethod
    def _owner_node(owner: _Branch | tuple[int, str, int]) -> int:
        return owner.node if isinstance(owner, _Branch) else owner[0]

    def _sample_config(self, n: int) -> SampleConfig:
        self.policy_calls += 1
        c = self.config
        return SampleConfig(n=n, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                            top_p=c.top_p, seed=mix_seed(self.seed, "call", self.policy_calls))

    def _encode(self, text: str) -> list[int]:
        """The observation's token ids when the policy can encode text (``encode``), else []."""
        encode = getattr(self.policy, "encode", None)
        return [int(i) for i in encode(text)] if callable(encode) and text else []

    def _add(self, node: Node, state: bytes, depth: int, turns: tuple[Turn, ...]) -> None:
        sid = f"{self.tree_id}/{node.node_id}"
        node.snapshot_id = sid
        self.snapshots[sid] = state
        self._nodes[node.node_id] = node
        self._children[node.node_id] = []
        self._depth[node.node_id] = depth
        self._turns[node.node_id] = turns
        if node.parent_id is not None:
            self._children[node.parent_id].append(node.node_id)

    def _step(self, br: _Branch, cont: Continuation) -> Node:
        parent = self._nodes[br.node]
        if self._env_at != parent.node_id or br.reseed_key is not None:
            self.env.restore(self.snapshot_of(parent.node_id))
            self.restores += 1
        reseed = getattr(self.env, "reseed", None)
        if br.reseed_key is not None and callable(reseed):
            reseed(br.reseed_key)
        result = self.env.step(cont.text)
        self.env_steps += 1
        depth = self._depth[parent.node_id] + 1
        truncated = not result.done and depth >= self.task.max_steps
        leaf = result.done or truncated
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
        turns = (*self._turns[parent.node_id], ("action", cont.text),
                 ("observation", result.observation))
        self._add(node, self.env.snapshot(), depth, turns)
        self._env_at = node.node_id
        return node


class Sampler(ABC):
    """Turns one task and a rollout budget into one tree (see the module docstring).

    Subclasses set ``name`` and ``config_class`` and implement ``grow``, which
    must spend the whole budget through ``TreeBuilder.run``.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[SamplerConfig]] = SamplerConfig

    def __init__(self, config: SamplerConfig | None = None) -> None:
        self.config = config if config is not None else self.config_class()
        if not isinstance(self.config, self.config_class):
            raise TypeError(f"{self.name} needs a {self.config_class.__name__}, "
                            f"got {type(self.config).__name__}")

    @abstractmethod
    def grow(self, builder: TreeBuilder) -> None:
        """Spend ``builder.budget`` on rollouts (and set ``critical_node_id`` / ``meta``)."""

    def sample_tree(self, env: Environment, policy: Policy, task: Task, n_total: int, *,
                    seed: int, tree_id: str | None = None, run_id: str = "default") -> Tree:
        """One tree of ``task`` with exactly ``n_total`` rollouts."""
        builder = TreeBuilder(env, policy, task, n_total, sampler=self.name, config=self.config,
                              seed=seed, tree_id=tree_id or f"{run_id}/{task.task_id}",
                              run_id=run_id)
        self.grow(builder)
        if builder.budget.remaining:
            raise BudgetError(f"{self.name} left {builder.budget.remaining} of {n_total} "
                              "rollouts unspent")
        return builder.finish()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
