"""``group``: GRPO's sampling (METHODS.md section 1): ``n_total`` full trajectories from the root.

Budget: one start of ``n_total`` rollouts at the root, phase ``"group"``; all
of them share the prompt's prefix computation and run in lockstep.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, ClassVar

from train.sampling.base import Sampler, SamplerConfig, TreeBuilder
from train.sampling.engine import Request

GROUP_PHASE = "group"


class GroupSampler(Sampler):
    """GRPO: a flat tree of ``n_total`` independent trajectories."""

    name: ClassVar[str] = "group"
    config_class: ClassVar[type[SamplerConfig]] = SamplerConfig

    def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
        yield from builder.run([(0, builder.budget.n_total, GROUP_PHASE)])
