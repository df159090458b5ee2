"""``rooted``: a few root actions, each continued many times (the data shape of a sibling
comparison at the root, docs/METHODS.md section 9: DSC's gate compares root actions by
their trajectories' returns, and a gap between two actions can only be resolved when each
has several).

Budget (``n_total`` = N, ``n_root`` = A):

1. A full trajectories from the root (phase ``"root"``): their first steps are the root
   actions a_1..a_A (distinct nodes even where the texts agree, as in ``group``);
2. the remaining N - A rollouts are split as evenly as integers allow over the root
   actions whose trajectory did not end at the first step (the first ones get one more),
   each a suffix rollout from that action's snapshot (phase ``"continue"``), so root
   action i carries 1 + k_i trajectories, k_i >= floor((N - A) / A). Where every first
   step ended the episode, the rest are drawn at the root like ``group``.

With N = 32 and A = 2 every root action has 16 trajectories (the reuse experiment's
stored trees, ``benchmarks/reuse.py``).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar

from train.sampling.base import Sampler, SamplerConfig, Start, TreeBuilder
from train.sampling.engine import Request

ROOT_PHASE = "root"
CONTINUE_PHASE = "continue"


@dataclass(frozen=True)
class RootedConfig(SamplerConfig):
    """Number of root actions of ``rooted``; see the module docstring."""

    n_root: int = 2
    """Root actions A (full trajectories drawn at the root); at most ``n_total``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_root < 1:
            raise ValueError(f"rooted: n_root must be >= 1, got {self.n_root}")


class RootedSampler(Sampler):
    """A root actions, the rest of the budget spent continuing them evenly."""

    name: ClassVar[str] = "rooted"
    config_class: ClassVar[type[SamplerConfig]] = RootedConfig

    def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
        c = self.config
        assert isinstance(c, RootedConfig)
        budget = builder.budget
        n_root = min(c.n_root, budget.n_total)
        yield from builder.run([(0, n_root, ROOT_PHASE)])
        rest = budget.remaining
        if not rest:
            return
        open_actions = [nid for nid in builder.children(0) if not builder.is_leaf(nid)]
        if not open_actions:
            yield from builder.run([(0, rest, ROOT_PHASE)])
            return
        share, extra = divmod(rest, len(open_actions))
        starts: list[Start] = [(nid, share + (i < extra), CONTINUE_PHASE)
                               for i, nid in enumerate(open_actions) if share + (i < extra)]
        yield from builder.run(starts)
