"""``entropy``: ARPO/AEPO-style entropy-gated branching after tool feedback.

ARPO (Dong et al. 2025, arXiv:2507.19849) measures the entropy of the first k
tokens of the initial response, H_root, and after each tool call the entropy
of the first k tokens the model generates in response to the feedback, H_t; a
rise (Delta H = H_t - H_root above a threshold) means the feedback made the
model uncertain, and the rollout branches there. Our reading [R]:

1. ``n_initial`` full trajectories (phase ``"explore"``; default
   ``ceil(n_total / 2)``, ARPO's half global / half branch split);
2. while they run (lockstep), every new ``feedback_response`` node v (see
   ``train.sampling.base``) with ``head_entropy(v) - head_entropy(step 1 of
   v's trajectory) > threshold`` branches: ``min(branch_width, remaining)``
   more samples of the same step from v's parent's snapshot (siblings of v,
   phase ``"branch"``), each run to its end. Branches may branch again deeper
   down (a tree, as in ARPO), but a position (a parent node) branches at most
   once, so a branch's first step never re-triggers its own position [R: a
   simple stand-in for AEPO's consecutive-branch penalty]. Branching stops
   when the budget is spent; the first nodes to cross the threshold (lockstep
   round order) get it;
3. whatever is left afterwards goes to full trajectories (phase ``"fill"``),
   which do not branch.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rollout_store.tree import Node
from train.sampling.base import Sampler, SamplerConfig, Start, TreeBuilder, head_entropy
from train.sampling.engine import Request

EXPLORE_PHASE = "explore"
BRANCH_PHASE = "branch"
FILL_PHASE = "fill"


@dataclass(frozen=True)
class EntropyConfig(SamplerConfig):
    """Hyperparameters of ``entropy``; see the module docstring."""

    n_initial: int | None = None
    """Full trajectories that start the tree (None: ceil(n_total / 2))."""
    branch_width: int = 2
    """Z: extra samples of a step whose entropy rose (ARPO's branch factor) [R value]."""
    threshold: float = 0.0
    """Branch when H(first tokens after feedback) - H_root exceeds this (nats)."""
    entropy_tokens: int | None = 10
    """k: how many first tokens of a step the entropies average (None: all) [R value]."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_initial is not None and self.n_initial < 1:
            raise ValueError(f"entropy: n_initial must be >= 1 or None, got {self.n_initial}")
        if self.branch_width < 1:
            raise ValueError(f"entropy: branch_width must be >= 1, got {self.branch_width}")
        if self.entropy_tokens is not None and self.entropy_tokens < 1:
            raise ValueError("entropy: entropy_tokens must be >= 1 or None")


class EntropySampler(Sampler):
    """Branch after tool feedback where the response's first-token entropy rises."""

    name: ClassVar[str] = "entropy"
    config_class: ClassVar[type[SamplerConfig]] = EntropyConfig

    def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
        c = self.config
        assert isinstance(c, EntropyConfig)
        budget = builder.budget
        n0 = min(budget.n_total, c.n_initial or max(1, math.ceil(budget.n_total / 2)))
        branched: set[int] = set()  # parents already branched from
        triggers: list[dict[str, float]] = []

        def on_step(node: Node) -> Sequence[Start]:
            parent = node.parent_id
            if node.kind != "feedback_response" or parent is None or parent in branched \
                    or not budget.remaining:
                return []
            h_root = head_entropy(builder.path(node.node_id)[0], c.entropy_tokens)
            delta = head_entropy(node, c.entropy_tokens) - h_root
            if not delta > c.threshold:  # NaN (no tokens) never branches
                return []
            branched.add(parent)
            triggers.append({"node": node.node_id, "delta_h": delta})
            return [(parent, min(c.branch_width, budget.remaining), BRANCH_PHASE)]

        yield from builder.run([(0, n0, EXPLORE_PHASE)], on_step=on_step)
        if budget.remaining:
            yield from builder.run([(0, budget.remaining, FILL_PHASE)])
        builder.meta["entropy"] = {"branches": triggers}
