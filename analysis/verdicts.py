"""Verdicts on the seed papers' claims (``rtrees study``): four outcomes, paired, powered.

docs/METHODS.md section 8 (V1-V5) states the rule; this module is its one implementation.

A claim compares two things through a statistic x, oriented by ``side``: "x > t"
(``side="above"``, higher is better, e.g. "success(ELPO) - success(GRPO) > 0") or "x < t"
(``side="below"``, lower is better, e.g. "regret(DSC) - regret(Gap) < 0"). With the
interval [lo, hi] of x at the claim's level and a pre-registered equivalence margin
delta (V1):

* **superior**: the interval lies entirely on the better side of t
  (above: lo > t; below: hi < t);
* **inferior**: it lies entirely on the worse side (above: hi < t; below: lo > t);
* **equivalent**: it lies inside (t - delta, t + delta) (two one-sided tests, TOST, at
  the interval's level; never without a registered delta);
* **underpowered**: none of these: the data cannot tell, and the minimum detectable
  effect (``mde``, V3) printed beside says what size of effect the study could have seen.

Superior/inferior come first, so a difference that is both significant and smaller than
delta is reported as significant (the line prints its size).

**Multiplicity** (V4): a study with K claims judges each on an interval at level
``1 - alpha / K`` (Bonferroni, ``family_level``); with alpha = 0.10 two-sided, the chance
of any false superior (or any false inferior) verdict in the study is at most 5%, and each
equivalence verdict is a TOST at 5% / K.

**Paired differences** (V2, ``paired_difference``): arms that share training seeds,
held-out tasks and evaluation seeds are compared on the per-(seed, task) differences
``d[s, t] = y_A[s, t] - y_B[s, t]``; the evaluation noise enters once, inside d. The
variance of the mean difference comes from the two-way (seed x task) cluster-robust
estimator, the seeds' and the tasks' cluster variances minus the cells', floored at the
seeds' cluster variance (with few seeds the other terms can cancel it by chance), so both
the training runs and the task draw count as samples from their populations; its t
quantiles take min(S, T) - 1 degrees of freedom. Without per-task outcomes, seed-paired rates
``d[s] = rate_A[s] - rate_B[s]`` (one cluster level, S - 1 degrees of freedom).

**Power before running** (V5, ``Design``): the standard error a design of S seeds and T
tasks will have under stated variance components, the effect it can detect at 80% power,
and the seeds a target effect needs.

A paper's magnitude is printed beside ours (with whether it lies inside our interval,
``paper_inside``), not judged: our environments and policies differ from the papers'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from scipy import stats

Side = Literal["above", "below"]
VerdictName = Literal["superior", "inferior", "equivalent", "underpowered"]
VERDICTS: tuple[VerdictName, ...] = ("superior", "inferior", "equivalent", "underpowered")
FAMILY_ALPHA = 0.10
"""Two-sided error of a study's family of claims (V4): 5% per direction."""
POWER = 0.80
"""The power at which minimum detectable effects are stated (V3)."""
RULE = ("superior / inferior: the claim's interval lies entirely on the better / worse "
        "side of the threshold; equivalent: it lies inside threshold +- delta (TOST); "
        "underpowered: none of these (MDE: the effect detectable at 80% power); a study "
        "of K claims uses level 1 - 0.10/K per claim (Bonferroni)")


def family_level(k_claims: int, alpha: float = FAMILY_ALPHA) -> float:
    """V4: the two-sided level of each of a study's ``k_claims`` intervals."""
    if k_claims < 1:
        raise ValueError(f"k_claims must be >= 1, got {k_claims}")
    return 1.0 - alpha / k_claims


def _quantile(p: float, df: float | None) -> float:
    """The standard normal (df None or inf) or Student-t quantile at p."""
    if df is None or not math.isfinite(df):
        return float(stats.norm.ppf(p))
    return float(stats.t.ppf(p, df))


def mde(se: float, level: float, df: float | None = None, power: float = POWER) -> float:
    """V3: minimum detectable effect of a two-sided test at ``level``,
    ``(q_{1-(1-level)/2} + q_power) * se`` (t quantiles with ``df``, else normal)."""
    if not (math.isfinite(se) and se >= 0):
        return math.nan
    return (_quantile(1 - (1 - level) / 2, df) + _quantile(power, df)) * se


@dataclass(frozen=True)
class Verdict:
    """One claim: its verdict, our estimate with its interval, delta, MDE, the paper's
    number."""

    claim: str
    verdict: VerdictName
    statistic: str
    estimate: float
    ci: tuple[float, float]
    threshold: float
    side: Side
    paper: str
    paper_value: float | None = None
    paper_inside: bool | None = None
    note: str = ""
    delta: float | None = None
    level: float = 0.95
    mde: float | None = None

    def line(self) -> str:
        """``claim: superior (x = 0.03 [0.01, 0.05] (90% CI), threshold above 0, delta
        0.02, MDE 0.018; paper: ...)``."""
        lo, hi = self.ci
        ours = f"{_f(self.estimate)} [{_f(lo)}, {_f(hi)}] ({self.level:.1%} CI)"
        extra = f", delta {_f(self.delta)}" if self.delta is not None else ", no delta"
        if self.mde is not None:
            extra += f", MDE {_f(self.mde)}"
        note = f"; {self.note}" if self.note else ""
        return (f"{self.claim}: {self.verdict} ({self.statistic} = {ours}, threshold "
                f"{self.side} {_f(self.threshold)}{extra}; paper: {self.paper}{note})")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ci"] = list(self.ci)
        doc["line"] = self.line()
        return doc


def _f(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.4g}"


def judge(lo: float | None, hi: float | None, threshold: float, side: Side,
          delta: float | None = None) -> VerdictName:
    """V1 on an interval [lo, hi]; an undefined interval is ``underpowered``."""
    if side not in ("above", "below"):
        raise ValueError(f"side must be 'above' or 'below', got {side!r}")
    if delta is not None and not (math.isfinite(delta) and delta > 0):
        raise ValueError(f"delta must be a finite number > 0, got {delta!r}")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "underpowered"
    if lo > threshold:
        return "superior" if side == "above" else "inferior"
    if hi < threshold:
        return "inferior" if side == "above" else "superior"
    if delta is not None and threshold - delta < lo and hi < threshold + delta:
        return "equivalent"
    return "underpowered"


def verdict(claim: str, statistic: str, estimate: float, ci: Sequence[float | None],
            threshold: float, side: Side, paper: str, paper_value: float | None = None,
            note: str = "", *, delta: float | None = None, level: float = 0.95,
            se: float | None = None, df: float | None = None) -> Verdict:
    """A ``Verdict`` by ``judge`` on ``ci`` (at ``level``). The MDE uses ``se`` and ``df``
    when given, else the normal-theory se of the interval, ``(hi - lo) / (2 z)``.
    ``paper_inside`` says whether ``paper_value`` lies in our interval."""
    lo = math.nan if ci[0] is None else float(ci[0])
    hi = math.nan if ci[1] is None else float(ci[1])
    inside = None
    if paper_value is not None and math.isfinite(lo) and math.isfinite(hi):
        inside = bool(lo <= paper_value <= hi)
    if se is None and math.isfinite(lo) and math.isfinite(hi):
        se = (hi - lo) / (2 * _quantile(1 - (1 - level) / 2, None))
        df = None
    m = mde(se, level, df) if se is not None else None
    return Verdict(claim, judge(lo, hi, threshold, side, delta), statistic, float(estimate),
                   (lo, hi), threshold, side, paper, paper_value, inside, note, delta, level,
                   None if m is None or not math.isfinite(m) else m)


def verdict_lines(verdicts: Sequence[Mapping[str, Any]]) -> list[str]:
    """The markdown bullet list of a results file's ``verdicts``, then the rule."""
    lines = [f"- {v['line']}" for v in verdicts]
    return [*lines, "", f"Verdict rule: {RULE}."]


def verdict_counts(verdicts: Sequence[Mapping[str, Any]]) -> str:
    """``superior 1, inferior 0, equivalent 2, underpowered 2``."""
    return ", ".join(f"{v} {sum(x['verdict'] == v for x in verdicts)}" for v in VERDICTS)


@dataclass(frozen=True)
class Difference:
    """V2: a paired mean difference with its standard error and interval."""

    estimate: float
    se: float
    df: float
    ci: tuple[float, float]
    level: float
    n_seeds: int
    n_tasks: int
    """0 when the difference was paired by seed only (rates, no per-task outcomes)."""

    @property
    def mde(self) -> float:
        return mde(self.se, self.level, self.df)


def paired_difference(a: np.ndarray, b: np.ndarray, level: float) -> Difference:
    """V2: mean of ``a - b`` with a paired interval at ``level``.

    ``a``, ``b``: (S, T) outcomes of two arms on the same S seeds and T held-out tasks
    (row s of both arms: training seed s; column t: task t with its evaluation seed), or
    (S,) per-seed rates. With d = a - b, D = mean(d) and, for (S, T),

        V = sum_s (dbar_s - D)^2 / (S (S-1)) + sum_t (dbar_t - D)^2 / (T (T-1))
            - sum_st (d_st - D)^2 / (S T (S T - 1)),

    the two-way cluster-robust variance (seed clusters plus task clusters minus cells),
    floored at its seed term (the task term where that is 0), with
    min(S, T) - 1 degrees of freedom; for (S,), V = var(d) / S with S - 1.
    """
    da = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    if da.ndim not in (1, 2) or da.shape[0] < 2 or (da.ndim == 2 and da.shape[1] < 2):
        raise ValueError(f"paired_difference needs >= 2 seeds (and tasks), got {da.shape}")
    if not np.isfinite(da).all():
        raise ValueError("paired_difference: outcomes must be finite")
    d = float(da.mean())
    n_seeds = da.shape[0]
    if da.ndim == 1:
        var = float(da.var(ddof=1)) / n_seeds
        n_tasks, dof = 0, n_seeds - 1
    else:
        n_tasks = da.shape[1]
        v_seed = float(((da.mean(axis=1) - d) ** 2).sum()) / (n_seeds * (n_seeds - 1))
        v_task = float(((da.mean(axis=0) - d) ** 2).sum()) / (n_tasks * (n_tasks - 1))
        cells = da.size
        v_cell = float(((da - d) ** 2).sum()) / (cells * (cells - 1))
        # Never below the seed-cluster variance: seeds are the replication unit, and with
        # few seeds the task and cell terms can cancel it by chance (Table 1 on workflow,
        # 5 seeds: 1.4e-5 + 9.7e-5 - 11.1e-5 = 3.4e-7, an interval 6x too narrow).
        var = max(v_seed + v_task - v_cell, v_seed)
        if var <= 0:  # every seed's mean difference equal: the task variance is left
            var = v_task
        dof = min(n_seeds, n_tasks) - 1
    se = math.sqrt(var)
    q = _quantile(1 - (1 - level) / 2, dof)
    return Difference(d, se, float(dof), (d - q * se, d + q * se), level, n_seeds, n_tasks)


@dataclass(frozen=True)
class Design:
    """V5: variance components of a paired two-arm comparison of success rates.

    The per-(seed, task) difference is modelled as d_st = effect + a_s + b_t + e_st:
    ``sd_seed`` the sd of a_s (how much the arms' difference moves between training
    seeds), ``sd_task`` the sd of b_t (arm x task interaction), and the evaluation noise
    Var(e) = 2 p (1 - p) (1 - rho) of two Bernoulli(p) outcomes with correlation rho.
    Defaults [R]: the Table 1 miniature's pooled seed sd of a final rate was 0.023 with
    100 tasks, of which Bernoulli noise is about 0.015 at p = 0.9, leaving about 0.018
    per arm and 0.025 for the difference of two independently trained arms; p = 0.5 is
    the worst case for the evaluation noise; rho and sd_task are guesses that a pilot
    study replaces (``rtrees study ... --power`` prints the assumptions it used).
    """

    sd_seed: float = 0.025
    sd_task: float = 0.05
    p: float = 0.5
    rho: float = 0.3

    def se(self, n_seeds: int, n_tasks: int) -> float:
        """Var(D) = sd_seed^2 / S + sd_task^2 / T + 2 p (1 - p) (1 - rho) / (S T)."""
        noise = 2 * self.p * (1 - self.p) * (1 - self.rho)
        return math.sqrt(self.sd_seed ** 2 / n_seeds + self.sd_task ** 2 / n_tasks
                         + noise / (n_seeds * n_tasks))

    def detectable(self, n_seeds: int, n_tasks: int, level: float,
                   kind: Literal["difference", "equivalence"] = "difference") -> float:
        """The smallest true effect called superior with probability ``POWER``
        (``difference``), or the smallest delta for which a true 0 is called equivalent
        with that probability (``equivalence``: q_{1-(1-level)/2} + z_{(1+POWER)/2})."""
        se = self.se(n_seeds, n_tasks)
        dof = min(n_seeds, n_tasks) - 1
        if kind == "difference":
            return mde(se, level, dof)
        return (_quantile(1 - (1 - level) / 2, dof) + _quantile((1 + POWER) / 2, None)) * se

    def seeds_needed(self, effect: float, n_tasks: int, level: float,
                     kind: Literal["difference", "equivalence"] = "difference",
                     max_seeds: int = 10_000) -> int | None:
        """The fewest seeds (>= 2) whose ``detectable`` is at most ``effect``; None when
        even ``max_seeds`` do not suffice (the task term sd_task^2 / T alone is too big)."""
        if not (math.isfinite(effect) and effect > 0):
            raise ValueError(f"effect must be a finite number > 0, got {effect!r}")
        for n in range(2, max_seeds + 1):
            if self.detectable(n, n_tasks, level, kind) <= effect:
                return n
        return None


__all__ = ["FAMILY_ALPHA", "POWER", "RULE", "VERDICTS", "Design", "Difference", "Side",
           "Verdict", "VerdictName", "family_level", "judge", "mde", "paired_difference",
           "verdict", "verdict_counts", "verdict_lines"]
