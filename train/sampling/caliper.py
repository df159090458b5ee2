"""``caliper``: budgeted local intervention (METHODS.md section 3, C1-C3; all [R]).

Phase 1: N_e = ceil(alpha * n_total) full rollouts (phase ``"explore"``).

Candidate positions come from failed full rollouts. In our node model a
position is a node boundary: the position of step node v is "resample v's step
from v's parent's snapshot". Its type is D (autonomous decision) when v is a
``decision`` node (the step after the prompt) and F (feedback-driven response)
when v is a ``feedback_response`` node (see ``train.sampling.base``) [R: our
policies generate whole steps, so a D position inside a step, just before its
``<tool_call>`` with the reasoning kept, is not available; each step is one
position]. Its bucket is g = type + relative-depth decile, decile =
min(9, floor(10 * (d - 1) / K)) for step d of a K-step rollout (``"F3"``).

Phase 2 spends the rest in chunks of k = min(K, remaining):

* (C1) V(p) = [1 - s_g^k - (1 - s_g)^k + kappa * u_g] / c(p), with s_g and u_g
  the posterior mean and standard deviation of Beta(1 + succ_g, 1 + fail_g)
  over past local resamples in bucket g (``CaliperState``, carried across
  tasks), and c(p) = tokens of the original suffix from v to its leaf +
  lambda_tool * its tool calls (the observed cost of y_0 estimates the
  expected cost of a resample) [R];
* (C2) V_full = [1 - p^k - (1 - p)^k] / mean cost of a full rollout, with p the
  success rate of the full rollouts so far [R: METHODS says phase 1; later
  full rollouts only sharpen it];
* a parent node is resampled from at most once (the D positions of several
  rollouts all have the root as parent, so only one of them is used):
  ``train.credit.caliper`` reads one local group per branching node, with one
  y_0 [R];
* if some position has V(p) > V_full, the best one (ties: shallowest, then
  earliest node) gets k local resamples (C3: restore the parent's
  snapshot, phase ``"local"``: siblings of v, each run to its end); their
  outcomes update bucket g; else k more full rollouts (``"explore"``), whose
  failures add candidate positions.

The trees are what ``train.credit.caliper`` reads: ``"explore"`` full
rollouts, ``"local"`` resamples below the same node as the original step y_0
(the ``"explore"`` sibling). y_0 carries ``meta["caliper_y0"] = True`` (and
every member ``meta["caliper_bucket"]``); ``caliper_extras(trees)`` turns the
marks into the estimator's ``extras["caliper_y0"]``. ``meta["caliper"]`` of the
tree records the phase-1 size, the extra full rollouts and every position used.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from rollout_store.tree import Tree
from train.sampling.base import Sampler, SamplerConfig, TreeBuilder
from train.sampling.engine import Request

EXPLORE_PHASE = "explore"
LOCAL_PHASE = "local"
Y0_META = "caliper_y0"
BUCKET_META = "caliper_bucket"


@dataclass(frozen=True)
class CaliperConfig(SamplerConfig):
    """CALIPER sampling hyperparameters (METHODS.md section 3; defaults there or [R])."""

    alpha: float = 0.5
    """Phase-1 share: N_e = ceil(alpha * n_total) full rollouts."""
    k: int = 4
    """K: resamples per position, and the chunk size of phase 2."""
    kappa: float = 1.0
    """kappa of C1: weight of the uncertainty bonus."""
    lambda_tool: float = 32.0
    """lambda_tool of C1: the cost of one tool call in generated tokens [R value]."""
    deciles: int = 10
    """Relative-depth bins of a bucket."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"caliper: alpha must lie in (0, 1], got {self.alpha}")
        if self.k < 1:
            raise ValueError(f"caliper: k must be >= 1, got {self.k}")
        if self.kappa < 0 or self.lambda_tool < 0:
            raise ValueError("caliper: kappa and lambda_tool must be >= 0")
        if self.deciles < 1:
            raise ValueError(f"caliper: deciles must be >= 1, got {self.deciles}")


@dataclass
class CaliperState:
    """Per-bucket success/failure counts of local resamples, kept across tasks (C1).

    A collector keeps one per worker (the ``CaliperSampler`` it holds). The
    counts are a prior for later tasks; ``to_dict``/``from_dict`` save them. Trees
    sampled together by the engine (one ``Engine.sample_trees`` call: a collect wave, a
    trainer iteration) each read the counts as of the call's start plus their own
    resamples; every tree's counts are added to the state as it goes.
    """

    counts: dict[str, list[int]] = field(default_factory=dict)  # bucket -> [succ, fail]

    def posterior(self, bucket: str) -> tuple[float, float]:
        """Mean and std of Beta(1 + succ, 1 + fail)."""
        succ, fail = self.counts.get(bucket, (0, 0))
        a, b = 1.0 + succ, 1.0 + fail
        return a / (a + b), math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1.0)))

    def update(self, bucket: str, successes: int, failures: int) -> None:
        row = self.counts.setdefault(bucket, [0, 0])
        row[0] += successes
        row[1] += failures

    def to_dict(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in sorted(self.counts.items())}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence[int]]) -> CaliperState:
        return cls({k: [int(v[0]), int(v[1])] for k, v in data.items()})


def mixed_probability(p: float, k: int) -> float:
    """P(k Bernoulli(p) draws are not all equal): 1 - p^k - (1 - p)^k."""
    return 1.0 - p ** k - (1.0 - p) ** k


@dataclass(frozen=True)
class _Position:
    node_id: int  # v: the original step (y_0)
    parent_id: int
    depth: int
    bucket: str
    cost: float


class CaliperSampler(Sampler):
    """Full exploration, then local resampling where it is worth the compute (C1-C3)."""

    name: ClassVar[str] = "caliper"
    config_class: ClassVar[type[SamplerConfig]] = CaliperConfig
    rank_refusal: ClassVar[str | None] = ("updates its bucket statistics tree by tree within "
                                          "an iteration, which ranks cannot share")

    def __init__(self, config: SamplerConfig | None = None,
                 state: CaliperState | None = None) -> None:
        super().__init__(config)
        self.state = state if state is not None else CaliperState()
        self._prior: CaliperState | None = None

    def begin_wave(self) -> None:
        """Trees sampled together read the counts as of now (plus their own), so a tree
        does not depend on which trees shared its wave or how far they got."""
        self._prior = CaliperState.from_dict(self.state.to_dict())

    def end_wave(self) -> None:
        self._prior = None

    def grow(self, builder: TreeBuilder) -> Generator[Request, Any, None]:
        c = self.config
        assert isinstance(c, CaliperConfig)
        budget = builder.budget
        n_e = min(budget.n_total, max(1, math.ceil(c.alpha * budget.n_total)))
        state = CaliperState.from_dict((self._prior or self.state).to_dict())  # this tree's
        full = list((yield from builder.run([(0, n_e, EXPLORE_PHASE)]))[0])
        used: set[int] = set()  # parents already resampled from: one group per node
        log: list[dict[str, Any]] = []
        n_extra = 0
        while budget.remaining:
            k = min(c.k, budget.remaining)
            p_hat = float(np.mean([builder.succeeded(leaf) for leaf in full]))
            full_cost = float(np.mean([self._cost(builder, leaf, 0) for leaf in full]))
            v_full = mixed_probability(p_hat, k) / max(full_cost, 1.0)
            best: tuple[float, _Position] | None = None
            for pos in self._positions(builder, full, used):
                s, u = state.posterior(pos.bucket)
                value = (mixed_probability(s, k) + c.kappa * u) / max(pos.cost, 1.0)
                if best is None or value > best[0]:  # strict: ties keep the earlier position
                    best = (value, pos)
            if best is not None and best[0] > v_full:
                value, pos = best
                used.add(pos.parent_id)
                leaves = (yield from builder.run([(pos.parent_id, k, LOCAL_PHASE)]))[0]
                succ = sum(builder.succeeded(leaf) for leaf in leaves)
                state.update(pos.bucket, succ, len(leaves) - succ)
                self.state.update(pos.bucket, succ, len(leaves) - succ)
                y0 = builder.node(pos.node_id)
                y0.meta = {**(y0.meta or {}), Y0_META: True, BUCKET_META: pos.bucket}
                for kid in builder.children(pos.parent_id):
                    node = builder.node(kid)
                    if node.phase == LOCAL_PHASE:
                        node.meta = {**(node.meta or {}), BUCKET_META: pos.bucket}
                log.append({"node": pos.node_id, "parent": pos.parent_id, "depth": pos.depth,
                            "bucket": pos.bucket, "k": k, "successes": succ, "value": value,
                            "v_full": v_full})
            else:
                full.extend((yield from builder.run([(0, k, EXPLORE_PHASE)]))[0])
                n_extra += k
        builder.meta["caliper"] = {"n_explore_initial": n_e, "n_explore_extra": n_extra,
                                   "positions": log}

    def _positions(self, builder: TreeBuilder, full: list[int], used: set[int]
                   ) -> list[_Position]:
        """Positions on failed full rollouts whose parent was not resampled from yet,
        shallowest first, then by node id."""
        c = self.config
        assert isinstance(c, CaliperConfig)
        out = []
        for leaf in full:
            if builder.succeeded(leaf):
                continue
            path = builder.path(leaf)
            for d, node in enumerate(path, start=1):
                if (node.parent_id or 0) in used:
                    continue
                kind = "D" if node.kind == "decision" else "F"
                decile = min(c.deciles - 1, (c.deciles * (d - 1)) // len(path))
                out.append(_Position(node.node_id, int(node.parent_id or 0), d,
                                     f"{kind}{decile}", self._cost(builder, leaf, d - 1)))
        out.sort(key=lambda p: (p.depth, p.node_id))
        return out

    def _cost(self, builder: TreeBuilder, leaf: int, skip: int) -> float:
        """Generated tokens + lambda_tool * tool calls of a rollout's steps after the first
        ``skip`` (the suffix a resample at step ``skip + 1`` would regenerate)."""
        c = self.config
        assert isinstance(c, CaliperConfig)
        steps = builder.path(leaf)[skip:]
        return float(sum((n.n_gen_tokens or 0) + c.lambda_tool * (n.tool_calls or 0)
                         for n in steps))


def caliper_extras(trees: Sequence[Tree]) -> dict[str, np.ndarray]:
    """``extras["caliper_y0"]`` (N,) bool for ``train.credit.base.from_trees(trees, extras)``:
    True on the nodes this sampler marked as y_0 (rows follow each tree's ``nodes``)."""
    marks = [bool((n.meta or {}).get(Y0_META, False)) for t in trees for n in t.nodes]
    return {Y0_META: np.array(marks, dtype=bool)}
