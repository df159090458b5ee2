"""The knobs of stored-tree reuse (``TrainConfig.reuse_params``, ``--reuse-param``) and the
names of the reuse rules: the one module of ``train.reuse`` that ``train.config`` imports
(no torch, store, environments or policies here). The method is docs/METHODS.md section 9.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from train.credit.dsc_gate import DSCGateParams

ReuseMode = Literal["none", "all", "transport", "dsc", "refresh", "m2po", "prox-interp",
                    "gap-gate"]
REUSE_MODES: tuple[ReuseMode, ...] = ("none", "all", "transport", "dsc", "refresh", "m2po",
                                      "prox-interp", "gap-gate")
"""``TrainConfig.reuse``: ``none`` or a rule of ``train.reuse.resolve.RULES``."""
CALIB_FRAC: float = 0.25
"""Fraction of stored tree ids (by hash) held apart as the D7 calibration split."""
GATE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(DSCGateParams))
"""The gate's keys (kappas and residual variances), given flat as ``--reuse-param`` keys."""
_KAPPAS = ("kappa_R", "kappa_delta", "kappa_T")


def calib_needed(level: float) -> int:
    """The fewest calibration trees n whose split-conformal order statistic certifies
    ``level``: ceil((n + 1) level) <= n, i.e. n >= level / (1 - level) (19 at 0.95)."""
    return max(1, math.ceil(level / (1.0 - level) - 1e-9))


class ReuseError(ValueError):
    """Reuse cannot start: a bad ``reuse_from`` filter or bad ``reuse_params``."""


@dataclass(frozen=True)
class ReuseParams:
    """Gate (D7), calibration, refresh-protocol and rule knobs (``TrainConfig.reuse_params``).

    The gate's kappas and residual variances are ``gate`` (a ``DSCGateParams``); on the
    command line and in ``reuse_params.json`` they are flat keys (``kappa_R=3``)."""

    gate: DSCGateParams = field(default_factory=DSCGateParams)
    """D7 radii: kappa_X (start values; calibrated when ``calibrate``) and residual
    variances (set by the calibration's dev trees)."""
    calibrate: bool = True
    """``dsc``: calibrate the kappas (D7) on the calibration split; off when any kappa is
    given (unless ``calibrate`` is given too)."""
    calib_trees: int = 38
    """Calibration-split trees the calibration waits for and uses; they alternate calib /
    dev, so D7 at ``calib_level`` needs at least ``2 * calib_needed(calib_level) - 1``
    (37 at 0.95: 19 calib trees) and a calibrating rule refuses fewer."""
    calib_draws: int = 4
    """New trajectories per root action and policy (mu, pi) for the calibration targets."""
    calib_level: float = 0.95
    """D7 conformal level of the kappas."""
    min_trajectories: int = 8
    """Gated rules (``dsc``, ``gap-gate``): a stored tree none of whose gated pairs holds
    this many trajectories on both sides is refused (skip reason ``thin``; an iteration
    whose every stored tree is thin stops the run with a ``ReuseError``); 1 turns the
    refusal off. Default ``FEASIBLE_TRAJECTORIES`` (docs/METHODS.md section 9)."""
    kappa_e: float = 2.0
    """Refresh protocol: a pair is resolved when |m_L - m_c| > kappa_e sqrt(v_L + v_c)."""
    refresh_batch: int = 4
    """Refresh protocol: new trajectories per round."""
    refresh_cap: int = 0
    """Refresh protocol: cap on the new tool steps spent on one stored tree; 0 (default):
    the tree's own tool steps, so refreshing a tree never costs more than collecting it
    again (the refresh-all baseline of the metrics)."""
    m2po_threshold: float = 0.04
    """``m2po`` (M1): the batch mean of (log pi_prox - log mu)^2 over the stored tokens
    kept must be at most this."""
    stored_passes: int = 1
    """Update-to-data (U1): optimizer passes over the stored trees per fresh iteration (the
    fresh trees are trained on once per epoch as before; the stored trees' part batches
    this many times)."""

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> ReuseParams:
        """Flat keys (the gate's and the others) coerced by the field types
        (``train.coerce``); a one-line ``ValueError`` naming a bad key or value."""
        from train.coerce import coerce_fields

        own = {f.name for f in fields(cls) if f.name != "gate"}
        for key in values:
            if key not in own and key not in GATE_FIELDS:
                raise ValueError(f"unknown key {key!r}; keys: "
                                 f"{', '.join((*GATE_FIELDS, *sorted(own)))}")
        gate_in = {k: v for k, v in values.items() if k in GATE_FIELDS}
        rest = {k: v for k, v in values.items() if k in own}
        gate_kw: dict[str, Any] = coerce_fields(DSCGateParams, gate_in)
        out: dict[str, Any] = coerce_fields(cls, rest)
        if "calibrate" not in out and any(k in gate_kw for k in _KAPPAS):
            out["calibrate"] = False  # the kappas given are the ones to use
        if "kappa_e" in out and not out["kappa_e"] >= 0:
            raise ValueError("kappas and residual variances must be >= 0")
        p = cls(gate=DSCGateParams(**gate_kw), **out)
        if p.refresh_cap < 0:
            raise ValueError("refresh_cap must be >= 0 (0: the stored tree's own tool steps)")
        if min(p.refresh_batch, p.calib_trees, p.calib_draws, p.min_trajectories) < 1:
            raise ValueError("refresh_batch, calib_trees, calib_draws and min_trajectories "
                             "must be >= 1")
        if not 0.0 < p.calib_level < 1.0:
            raise ValueError(f"calib_level must be in (0, 1), got {p.calib_level}")
        if not p.m2po_threshold >= 0:
            raise ValueError(f"m2po_threshold must be >= 0, got {p.m2po_threshold}")
        if p.stored_passes < 1:
            raise ValueError(f"stored_passes must be >= 1, got {p.stored_passes}")
        return p

    def calibration_problem(self) -> str | None:
        """Why this calibration cannot certify its level (too few calib trees: the split
        trees alternate calib / dev, so ``calib_trees`` give ``ceil(calib_trees / 2)``),
        or None (also when ``calibrate`` is off)."""
        if not self.calibrate:
            return None
        need = calib_needed(self.calib_level)
        if (self.calib_trees + 1) // 2 >= need:
            return None
        return (f"D7 calibration at calib_level={self.calib_level:g} needs {need} calib "
                f"trees (calib_trees >= {2 * need - 1}; the split alternates calib / dev), "
                f"calib_trees={self.calib_trees} gives {(self.calib_trees + 1) // 2}: raise "
                f"calib_trees, lower calib_level, or give the kappas (calibration off)")

    def with_kappas(self, values: Mapping[str, float]) -> ReuseParams:
        """A copy with the kappas / residual variances in ``values`` (keys of ``kappas``)."""
        unknown = set(values) - set(GATE_FIELDS)
        if unknown:
            raise ValueError(f"not a kappa or residual variance: {sorted(unknown)}")
        return replace(self, gate=replace(self.gate, **{k: float(v) for k, v in values.items()}))

    def kappas(self) -> dict[str, float]:
        """The gate's fields (those of ``DSCGateParams``): kappas and residual variances."""
        return {name: float(getattr(self.gate, name)) for name in GATE_FIELDS}

    def flat(self) -> dict[str, Any]:
        """Every knob as one flat mapping (the keys ``parse`` takes)."""
        out: dict[str, Any] = self.kappas()
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "gate"})
        return out


__all__ = ["CALIB_FRAC", "GATE_FIELDS", "REUSE_MODES", "ReuseError", "ReuseMode", "ReuseParams",
           "calib_needed"]
