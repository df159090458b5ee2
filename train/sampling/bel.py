"""``bel``: ELPO's Binary-search Error Localization (METHODS.md section 2.1, E1, E2).

For one task with budget N_total (defaults N_total=16, B_max=3, X_min=1,
X_max=3, beta=5):

1. N0 full trajectories (phase ``"explore"``); N0 = ``n_initial`` or, by
   default, N_total - B_max * X_max (= 7; at least 1) [R: the reserve for probes].
2. The failed ones (leaf reward < ``success_threshold``) form the buffer B.
   If B is empty, the rest of the budget goes to full trajectories (``"fill"``).
3. (E1) tau* = argmax_{tau in B} Gap(tau), Gap = H_tool(tau) - H_root(tau), ties (up
   to ``GAP_TIE``) to the first trajectory sampled. H_root is the mean token entropy of tau's first
   step; H_tool the mean, over the steps generated right after tool feedback
   (``feedback_response`` nodes), of each step's mean token entropy [R: steps
   weigh equally]. ``entropy_tokens`` limits both to each step's first tokens.
   A trajectory without such steps has Gap 0 [R].
4. Binary search over tau*'s K steps: L=1, R=K; while L < R, probes < B_max and
   budget is left: anchor m = floor((L+R)/2); restore the snapshot taken after
   step m (the history and the tool state) and sample X suffixes from it
   (phase ``"probe"``; they hang below tau*'s step-m node, beside its original
   step m+1), X = min(X_m, remaining), with (E2)
   X_m = round(X_min + (X_max - X_min) * sigmoid(beta * (H_tool,m - H_root))),
   H_tool,m the mean entropy of tau*'s step m+1 (the response to step m's
   feedback) [R: round half up, then the cap]. If any suffix reaches
   ``success_threshold``, step m's state is recoverable: L = m+1; else R = m.
5. t_crit = L; the tree's ``critical_node_id`` is tau*'s step-L node.
6. Leftover budget: full trajectories (phase ``"fill"``) [R].

The search keeps "the state after step L-1 was shown recoverable, the state
after step R is irrecoverable under the sampled budget" and needs at most
ceil(log2 K) probes to reach L = R (``b_max=None`` removes the cap). With
enough suffixes per probe and deterministic tools it returns the exact first
irrecoverable step (the ``workflow`` environment's ``first_irrecoverable_step``).
``meta["bel"]`` records tau*, K, the anchors probed with their X and outcome,
the final L and R, and whether the search converged (L = R).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from rollout_store.tree import Node
from train.sampling.base import Sampler, SamplerConfig, TreeBuilder, head_entropy
from train.sampling.engine import Request

EXPLORE_PHASE = "explore"
PROBE_PHASE = "probe"
FILL_PHASE = "fill"


@dataclass(frozen=True)
class BelConfig(SamplerConfig):
    """BEL hyperparameters (METHODS.md section 2.1; defaults [N])."""

    b_max: int | None = 3
    """B_max: anchor probes per search (read as a probe cap [R]); None: search until L = R."""
    x_min: int = 1
    """X_min of E2: fewest suffixes per probe."""
    x_max: int = 3
    """X_max of E2: most suffixes per probe."""
    beta: float = 5.0
    """beta of E2: how sharply the suffix count follows the entropy gap."""
    n_initial: int | None = None
    """N0: full trajectories before the search (None: n_total - b_max * x_max, at least 1;
    with ``b_max=None``, ceil(n_total / 2))."""
    entropy_tokens: int | None = None
    """Average entropies over each step's first this many tokens (None: the whole step)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.b_max is not None and self.b_max < 1:
            raise ValueError(f"bel: b_max must be >= 1 or None, got {self.b_max}")
        if not 1 <= self.x_min <= self.x_max:
            raise ValueError(f"bel: need 1 <= x_min <= x_max, got {self.x_min}, {self.x_max}")
        if self.n_initial is not None and self.n_initial < 1:
            raise ValueError(f"bel: n_initial must be >= 1 or None, got {self.n_initial}")
        if self.entropy_tokens is not None and self.entropy_tokens < 1:
            raise ValueError("bel: entropy_tokens must be >= 1 or None")

    def initial_rollouts(self, n_total: int) -> int:
        """N0 for a budget of ``n_total`` (step 1 of the module docstring)."""
        if self.n_initial is not None:
            return min(self.n_initial, n_total)
        if self.b_max is None:
            return max(1, math.ceil(n_total / 2))
        return min(n_total, max(1, n_total - self.b_max * self.x_max))

    def suffix_count(self, h_tool: float, h_root: float) -> int:
        """X_m of E2 before the budget cap (NaN entropies count as no gap)."""
        gap = h_tool - h_root if math.isfinite(h_tool - h_root) else 0.0
        sig = 0.5 * (1.0 + math.tanh(0.5 * self.beta * gap))  # sigmoid, overflow-free
        return math.floor(self.x_min + (self.x_max - self.x_min) * sig + 0.5)


GAP_TIE = 1e-5
"""Gaps within this many nats of the largest tie (E1 takes the first): trajectories with
the same tokens have the same gap up to the float reductions of the batch they were
decoded in (the rollout engine bounds logprob and entropy differences by 1e-5), and an
exact comparison would let the batch break their tie."""


def first_maximum(gaps: Sequence[float]) -> int:
    """The index of the first gap within ``GAP_TIE`` of the largest (NaN never wins)."""
    finite = [g for g in gaps if not math.isnan(g)]
    if not finite:
        return 0
    top = max(finite)
    return next(i for i, g in enumerate(gaps) if g >= top - GAP_TIE)


def entropy_gap(steps: Sequence[Node], entropy_tokens: int | None = None) -> float:
    """E1: Gap(tau) = H_tool(tau) - H_root(tau) over a trajectory's step nodes (root first
    step first); 0 when no step follows tool feedback or entropies are missing."""
    if not steps:
        return 0.0
    h_root = head_entropy(steps[0], entropy_tokens)
    tool = [head_entropy(s, entropy_tokens) for s in steps if s.kind == "feedback_response"]
    tool = [h for h in tool if math.isfinite(h)]
    if not tool or not math.isfinite(h_root):
        return 0.0
    return float(np.mean(tool)) - h_root


class BelSampler(Sampler):
    """Binary-search error localization on one failed trajectory per tree."""

    name: ClassVar[str] = "bel"
    config_class: ClassVar[type[SamplerConfig]] = BelConfig

    def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
        c = self.config
        assert isinstance(c, BelConfig)
        budget = builder.budget
        leaves = (yield from builder.run(
            [(0, c.initial_rollouts(budget.n_total), EXPLORE_PHASE)]))[0]
        failed = [leaf for leaf in leaves if not builder.succeeded(leaf)]
        info: dict[str, Any] = {"n_failed": len(failed)}
        builder.meta["bel"] = info
        if failed:
            gaps = [entropy_gap(builder.path(leaf), c.entropy_tokens) for leaf in failed]
            best = first_maximum(gaps)
            path = builder.path(failed[best])
            k = len(path)
            h_root = head_entropy(path[0], c.entropy_tokens)
            lo, hi = 1, k
            probes: list[dict[str, Any]] = []
            while lo < hi and (c.b_max is None or len(probes) < c.b_max) and budget.remaining:
                m = (lo + hi) // 2
                x_m = c.suffix_count(head_entropy(path[m], c.entropy_tokens), h_root)
                x = min(x_m, budget.remaining)
                suffixes = (yield from builder.run([(path[m - 1].node_id, x, PROBE_PHASE)]))[0]
                recovered = any(builder.succeeded(leaf) for leaf in suffixes)
                probes.append({"anchor_step": m, "anchor_node": path[m - 1].node_id,
                               "x": x, "recovered": recovered})
                if recovered:
                    lo = m + 1
                else:
                    hi = m
            builder.critical_node_id = path[lo - 1].node_id
            info.update({"trajectory_leaf": failed[best], "gap": gaps[best], "k": k,
                         "t_crit": lo, "lo": lo, "hi": hi, "probes": probes,
                         "converged": lo == hi})
        if budget.remaining:
            yield from builder.run([(0, budget.remaining, FILL_PHASE)])
