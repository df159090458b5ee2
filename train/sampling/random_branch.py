"""``random``: Tree-GRPO-style random branching (Ji et al. 2025, arXiv:2509.21240; the
"ELPO w/o BEL" arm of METHODS.md section 2.4: branch prefixes chosen uniformly at random).

Budget [R: Tree-GRPO's M trees x L rounds x N expansions, folded into one budget]:

1. ``n_initial`` full trajectories from the root (phase ``"explore"``; default
   ``ceil(n_total / 4)``, at least 1, at most ``n_total``);
2. then rounds until the budget is spent: each round draws
   ``min(expand_per_round, remaining)`` nodes uniformly, with replacement, from
   the tree's inner step nodes (nodes with a child, the root excluded; the root
   only when there is no other), and runs one suffix rollout (phase
   ``"expand"``) from each drawn node's snapshot. A node drawn twice in a round
   gets both rollouts as one start (they share its prefix). Nodes made by
   earlier expansions can be drawn in later rounds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

from train.sampling.base import Sampler, SamplerConfig, Start, TreeBuilder
from train.sampling.engine import Request

EXPLORE_PHASE = "explore"
EXPAND_PHASE = "expand"


@dataclass(frozen=True)
class RandomBranchConfig(SamplerConfig):
    """Budget split of ``random``; see the module docstring."""

    n_initial: int | None = None
    """Full trajectories before any expansion (None: ceil(n_total / 4))."""
    expand_per_round: int | None = None
    """Expansions drawn per round (None: the number of initial trajectories)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_initial", "expand_per_round"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"random: {name} must be >= 1 or None, got {value}")


class RandomBranchSampler(Sampler):
    """Full trajectories, then suffix rollouts from uniformly drawn inner nodes."""

    name: ClassVar[str] = "random"
    config_class: ClassVar[type[SamplerConfig]] = RandomBranchConfig

    def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
        c = self.config
        assert isinstance(c, RandomBranchConfig)
        budget = builder.budget
        n0 = min(budget.n_total, c.n_initial or max(1, math.ceil(budget.n_total / 4)))
        yield from builder.run([(0, n0, EXPLORE_PHASE)])
        per_round = c.expand_per_round or n0
        while budget.remaining:
            inner = [n.node_id for n in builder.nodes
                     if n.node_id != 0 and builder.children(n.node_id)]
            pool = inner or [0]
            draws = builder.rng.integers(0, len(pool), size=min(per_round, budget.remaining))
            counts = Counter(pool[int(i)] for i in draws)
            starts: list[Start] = [(nid, k, EXPAND_PHASE) for nid, k in sorted(counts.items())]
            yield from builder.run(starts)
