"""The credit stage of the training loop: one object the trainer calls, like reuse's.

``make_credit(config)`` resolves the estimator and its params once (``train.credit``'s
registry, the code path of ``rtrees credit``) and checks, before anything is written,
what the trainer can give it, as its params type declares (``train.credit.base.Params``):

* ``trainer_refusal``: an input the trainer does not produce (dsc's stored ratios);
* ``node_scores`` of kind ``gold_answer`` (trace, T2): the trainer scores the gold answer
  at every node of the fresh trees under a frozen copy of the initial policy (the
  ``reference`` the trainer loads), so the params must not name another one, and stored
  trees (reuse) are refused: only the fresh trees are scored;
* ``token_scorer`` (factor, sgcd; F3, Q3): the trainer scores each fresh tree's tokens
  under the weights that sampled it, so the params must not name a teacher, and reuse is
  refused for the same reason;
* ``step_field`` (factor's F5 eta schedule): the trainer sets it to each iteration
  (``CreditStage.at_step``), so the params must not set it.

Per iteration, ``CreditStage.step`` scores what the method reads (DDP: each rank its own
trees, gathered), hands the score and credit rows to ``commit`` (the trainer's keyed,
queued writes) and returns the per-node token credit trained on. The credit trained on is
the credit committed: the rows carry the per-token clip bounds (ELC E8, CALIPER C8) and
``train.batches.rows_credit`` reads the token credit back from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from rollout_store.tree import Tree
from train import distributed as dp
from train.batches import NodeCredit, rows_credit
from train.config import ConfigError, TrainConfig
from train.credit import ESTIMATORS
from train.credit.base import Estimator, Params
from train.credit.scores import GOLD
from train.credit.store_io import CreditError, credit_trees, resolve_method
from train.policies.hf import HFPolicy
from train.scoring import score_trees

TokenCredit = dict[tuple[str, int], NodeCredit]
Commit = Callable[[str, pa.Table], None]
"""``commit(name, rows)``: queue this iteration's ``name`` rows (``scores``, ``credit``)."""


@dataclass(frozen=True)
class CreditStage:
    """The run's credit method, resolved once (module docstring)."""

    estimator: Estimator[Any]
    params: Params
    pairs: dict[str, str]
    """The run's ``credit_params`` as ``KEY=VALUE`` text (what ``rtrees credit`` takes)."""
    run_id: str
    policy_spec: str
    """The run's starting policy (``policy_ref`` of the reference's scores)."""
    reference: HFPolicy | None = None
    """The frozen initial policy, for a method that reads gold-answer scores (T2)."""

    @property
    def needs_reference(self) -> bool:
        """The method reads gold-answer scores of a frozen reference policy (T2)."""
        scores = self.params.node_scores
        return scores is not None and scores[1] == GOLD

    @property
    def stored_key(self) -> tuple[str, str] | None:
        """(method, params hash) under which ``credit(trees)`` (no scores) credits trees,
        when that credit is a function of each tree alone (not ``spans_trees``: a prompt
        group's credit depends on which trees are credited together), else None: the
        reuse stage reads stored trees' committed credit under this key instead of
        crediting them again (``train.reuse.stage``)."""
        return None if self.params.spans_trees() else (self.estimator.name,
                                                       self.params.params_hash())

    def with_reference(self, reference: HFPolicy | None) -> CreditStage:
        return replace(self, reference=reference)

    def at_step(self, it: int) -> CreditStage:
        """This stage with the params' ``step_field`` (factor's F5 schedule) set to
        iteration ``it``; unchanged for a method whose credit does not depend on it."""
        field = self.params.step_field
        if field is None:
            return self
        pairs = {**self.pairs, field: str(it)}
        return replace(self, pairs=pairs, params=resolve_method(self.estimator.name, pairs)[1])

    def credit(self, trees: Sequence[Tree], scores: pa.Table | None = None,
               ref_version: str | None = None) -> tuple[pa.Table, TokenCredit]:
        """Credit rows (committed) and per-node token credit (trained on) of ``trees``,
        through the registry (``credit_trees``, the code path of ``rtrees credit``).
        ``scores``: the ``policy_scores`` rows the method reads; ``ref_version``: the
        version of the reference that scored them (recorded in the params, so the params
        hash names the reference weights, as ``rtrees credit --param ref=``)."""
        pairs = dict(self.pairs)
        if ref_version is not None and self.params.node_scores is not None:
            pairs[self.params.node_scores[0]] = ref_version
        rows = credit_trees(trees, self.estimator.name, pairs, run_id=self.run_id,
                            scores=scores)
        return rows, rows_credit(rows)

    def step(self, trees: Sequence[Tree], mine: Sequence[Tree], current: HFPolicy,
             world: dp.World, commit: Commit, it: int = 0) -> TokenCredit:
        """Iteration ``it``'s credit: ``trees`` every rank's fresh trees, ``mine`` this
        rank's (DDP: each rank scores its own), ``current`` the weights that sampled them;
        ``commit`` queues the score and credit rows (rank 0 writes)."""
        stage = self.at_step(it)
        scores = ref_version = None
        if self.reference is not None and self.needs_reference:  # T2: gold answer
            ref_version = self.reference.policy_version
            scores = pa.concat_tables(dp.gather_list(world, [score_trees(
                mine, self.reference, GOLD, policy_ref=self.policy_spec,
                run_id=self.run_id)]))
            commit("scores", scores)
        kinds = stage.params.token_score_kinds()
        if kinds:  # F3, Q3: teacher and student scores under the sampling weights
            scores = pa.concat_tables(dp.gather_list(world, [score_trees(
                mine, current, kind, policy_ref=current.policy_ref, run_id=self.run_id,
                min_tokens=stage.params.min_scored_tokens)
                for kind in dict.fromkeys(kinds.values())]))
            commit("scores", scores)
        rows, credit = stage.credit(trees, scores, ref_version)
        commit("credit", rows)
        return credit


def make_credit(config: TrainConfig) -> CreditStage:
    """The credit stage of ``config``, or a ``ConfigError`` naming what the trainer cannot
    give the method (module docstring); loads nothing."""
    if config.credit not in ESTIMATORS:
        raise ConfigError(f"unknown credit {config.credit!r}; choose from {sorted(ESTIMATORS)}")
    pairs = {k: str(v) for k, v in config.credit_params.items()}
    try:
        estimator, params = resolve_method(config.credit, pairs)
    except CreditError as exc:
        raise ConfigError(str(exc)) from exc
    name, kind = config.credit, type(params)
    if kind.trainer_refusal is not None:
        raise ConfigError(f"credit {name!r} {kind.trainer_refusal}")
    if kind.node_scores is not None and kind.node_scores[1] == GOLD:
        if kind.node_scores[0] in config.credit_params:
            raise ConfigError(f"credit_params: {name} in the trainer scores with the frozen "
                              f"initial policy (T2); drop {kind.node_scores[0]}=")
        if config.reuses_stored:
            raise ConfigError(f"credit {name!r} with reuse: the trainer scores only the fresh "
                              "trees under the frozen reference (T2); use reuse none")
    if kind.step_field is not None and kind.step_field in config.credit_params:
        raise ConfigError(f"credit_params: the trainer sets {name}'s {kind.step_field} to "
                          f"each iteration; drop {kind.step_field}=")
    if kind.token_scorer is not None:
        if kind.token_scorer in config.credit_params:
            raise ConfigError(f"credit_params: {name} in the trainer scores each tree with "
                              f"the weights that sampled it (F3, Q3); drop {kind.token_scorer}=")
        if config.reuses_stored:
            raise ConfigError(f"credit {name!r} with reuse: the trainer scores only the "
                              "fresh trees (F3, Q3); use reuse none")
    return CreditStage(estimator, params, pairs, config.resolved_run_id, config.policy)


def credit_for(trees: Sequence[Tree], config: TrainConfig, scores: pa.Table | None = None,
               ref_version: str | None = None) -> tuple[pa.Table, TokenCredit]:
    """``make_credit(config).credit(trees, scores, ref_version)``: the trainer's credit of
    ``trees`` outside a run (benchmarks, tests)."""
    return make_credit(config).credit(trees, scores, ref_version)


def stored_credit_key(config: TrainConfig) -> tuple[str, str] | None:
    """``make_credit(config).stored_key``."""
    return make_credit(config).stored_key


__all__ = ["Commit", "CreditStage", "TokenCredit", "credit_for", "make_credit",
           "stored_credit_key"]
