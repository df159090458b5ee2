"""Power before running (docs/METHODS.md V3-V5): what each ``rtrees study`` can detect.

``study_power(name, config)`` takes a study's settings (the dict of its config dataclass)
and returns, without running anything, the minimum detectable effect (MDE, 80% power) of
its claims at those sizes, and with ``effect`` the size needed to detect that effect. It
is pure arithmetic on stated assumptions, printed with them:

* ``table1``: the paired seed x task design of V5 (``analysis.verdicts.Design``), S seeds
  and T held-out tasks, its claims judged at the Bonferroni level of V4;
* the task-resampled studies (``dsc-l1``, ``elpo-fig3``, ``dsc-table2``, ``elpo-fig1``,
  ``credit-exact``, ``third-party-audit``):
  a normal approximation over tasks, MDE = (z_0.975 + z_0.8) * sd / sqrt(n) at their 95%
  intervals, with the per-task sd of each claim's statistic taken from the last measured
  run of that study (benchmarks/README.md, the rows of the round of issues 9-16): the
  half-width of its 95% interval times sqrt(n) / 1.96 [R: a pilot estimate; a new env or
  policy changes it].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from analysis.verdicts import Design, family_level, mde

PILOT_SD: dict[str, tuple[str, float, str]] = {
    # study -> (statistic, per-task sd, where the sd comes from)
    "dsc-l1": ("Spearman gain of |G| over global KL", 0.087,
               "48 tasks: 0.867 [0.842, 0.891]"),
    "elpo-fig3": ("pairwise-accuracy difference of two constructions", 0.19,
                  "48 workflow tasks: -0.042 [-0.091, 0.016]"),
    "dsc-table2": ("regret difference DSC - Gap", 0.0056,
                   "120 tasks: +0.00074, one-sided bound 0.00158"),
    "credit-exact": ("paired difference of two methods' mean cosine to the exact advantage",
                     0.03, "32 tasks per horizon: tree_grpo - grpo at H = 6 -0.000 "
                     "[-0.011, 0.010] at 99.2%, the widest of its differences"),
    "elpo-fig1": ("paired recovery difference of two fixed steps", 0.12,
                  "48 workflow tasks at H 12/18/24, 4 trajectories each: first "
                  "irrecoverable - first error +0.038 [0.006, 0.072], the widest of its "
                  "exact differences"),
    "third-party-audit": ("pairwise-accuracy difference of two estimators on the same trees",
                          0.19, "elpo-fig3's pilot (the same statistic, 48 workflow tasks); "
                          "a new env or policy changes it"),
}
TASK_FIELD = {"dsc-l1": "n_tasks", "elpo-fig3": "n_tasks", "dsc-table2": "n_eval",
              "elpo-fig1": "n_tasks", "credit-exact": "n_tasks",
              "third-party-audit": "n_tasks"}
TASK_LEVEL = 0.95


@dataclass(frozen=True)
class PowerStatement:
    """What a study of the given sizes can detect, and (with ``effect``) what it needs."""

    study: str
    sizes: dict[str, int]
    level: float
    mde: float
    statistic: str
    assumptions: str
    effect: float | None = None
    needed: dict[str, int | None] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """The lines ``rtrees study`` prints before it starts (and ``--power`` alone)."""
        sizes = ", ".join(f"{k} {v}" for k, v in self.sizes.items())
        out = [f"power: {self.statistic}; with {sizes} the {self.level:.1%} interval "
               f"detects a difference of {self.mde:.3g} at 80% power (MDE)"
               if not math.isnan(self.mde) else
               f"power: {self.statistic}; with {sizes} there is no MDE: the interval over "
               "seeds needs at least 2 (processes sharing a study directory report their "
               "seeds together)"]
        if self.effect is not None:
            need = ", ".join(f"{k} {'none suffices' if v is None else v}"
                             for k, v in self.needed.items())
            out.append(f"power: to detect {self.effect:.3g}: {need}")
        out.append(f"power: assumptions: {self.assumptions}")
        return out


def study_power(name: str, config: Mapping[str, Any], effect: float | None = None
                ) -> PowerStatement:
    """The ``PowerStatement`` of study ``name`` at ``config``'s sizes (module docstring)."""
    if effect is not None and not (math.isfinite(effect) and effect > 0):
        raise ValueError(f"the effect must be a finite number > 0, got {effect!r}")
    if name == "table1":
        return _table1_power(config, effect)
    if name not in PILOT_SD:
        raise ValueError(f"no power statement for study {name!r}")
    statistic, sd, source = PILOT_SD[name]
    n = int(config[TASK_FIELD[name]])
    se = sd / math.sqrt(n)
    needed: dict[str, int | None] = {}
    if effect is not None:
        z = mde(1.0, TASK_LEVEL)  # (z_0.975 + z_0.8) per unit se
        needed[TASK_FIELD[name]] = math.ceil((z * sd / effect) ** 2)
    return PowerStatement(name, {TASK_FIELD[name]: n}, TASK_LEVEL, mde(se, TASK_LEVEL),
                          statistic, f"per-task sd {sd} of the statistic (pilot: {source}); "
                          "normal approximation over tasks", effect, needed)


def _table1_power(config: Mapping[str, Any], effect: float | None) -> PowerStatement:
    from analysis.table1 import CLAIMS

    names = set(config["configs"])
    k = max(sum(a in names and b in names for _, a, b, _ in CLAIMS), 1)
    level = family_level(k)
    design = Design()
    seeds, tasks = len(config["seeds"]), int(config["heldout_tasks"])
    detect = math.nan if seeds < 2 else design.detectable(seeds, tasks, level)
    needed: dict[str, int | None] = {}
    if effect is not None:
        needed["seeds"] = design.seeds_needed(effect, tasks, level)
        needed[f"seeds for equivalence within +-{effect:.3g}"] = design.seeds_needed(
            effect, tasks, level, kind="equivalence")
    return PowerStatement(
        "table1", {"seeds": seeds, "held-out tasks": tasks, "claims": k}, level, detect,
        "paired difference of final held-out success (V2)",
        f"V5 design sd_seed {design.sd_seed}, sd_task {design.sd_task}, p {design.p}, "
        f"rho {design.rho}; Bonferroni level over the study's {k} claims", effect, needed)


__all__ = ["PILOT_SD", "PowerStatement", "study_power"]
