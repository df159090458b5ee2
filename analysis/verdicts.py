"""One-line verdicts on the seed papers' claims (``rtrees study``), from intervals alone.

A claim is a statement about a statistic x whose value we estimate with a bootstrap
interval [lo, hi] over tasks: "x > t" (``side="above"``) or "x < t" (``side="below"``),
e.g. "rho(|G|) - rho(KL) > 0" or "regret(DSC) - regret(Gap) < margin". The rule
(the same for every study; the report prints it beside each verdict):

* **reproduced**: the interval lies entirely on the claimed side of t
  (above: lo > t; below: hi < t);
* **not reproduced**: the interval lies entirely on the other side, t included
  (above: hi <= t; below: lo >= t): the data contradict the claim;
* **inconclusive**: the interval contains t, or it is undefined (too few tasks).

A claim about the paper's magnitude (e.g. its 0.839) is not judged by this rule: the
verdict concerns the claimed direction or bound, and the paper's number is printed
beside ours (with whether it lies inside our interval, ``paper_inside``), because our
environments and policies differ from the paper's and its magnitudes need not transfer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

Side = Literal["above", "below"]
VerdictName = Literal["reproduced", "not reproduced", "inconclusive"]
RULE = ("reproduced: the 95% interval lies on the claimed side of the threshold; not "
        "reproduced: it lies on the other side (threshold included); inconclusive: it "
        "contains the threshold or is undefined")


@dataclass(frozen=True)
class Verdict:
    """One claim, its verdict, our estimate with its interval, the paper's number."""

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

    def line(self) -> str:
        """``claim: verdict (ours 0.936 [0.872, 1.007] vs paper 0.839)``."""
        lo, hi = self.ci
        ours = f"{_f(self.estimate)} [{_f(lo)}, {_f(hi)}]"
        note = f"; {self.note}" if self.note else ""
        return (f"{self.claim}: {self.verdict} ({self.statistic} = {ours}, threshold "
                f"{self.side} {_f(self.threshold)}; paper: {self.paper}{note})")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ci"] = list(self.ci)
        doc["line"] = self.line()
        return doc


def _f(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:.4g}"


def judge(lo: float | None, hi: float | None, threshold: float, side: Side) -> VerdictName:
    """The rule of the module docstring on an interval [lo, hi]."""
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    if side == "above":
        if lo > threshold:
            return "reproduced"
        return "not reproduced" if hi <= threshold else "inconclusive"
    if side == "below":
        if hi < threshold:
            return "reproduced"
        return "not reproduced" if lo >= threshold else "inconclusive"
    raise ValueError(f"side must be 'above' or 'below', got {side!r}")


def verdict(claim: str, statistic: str, estimate: float, ci: Sequence[float | None],
            threshold: float, side: Side, paper: str, paper_value: float | None = None,
            note: str = "") -> Verdict:
    """A ``Verdict`` by ``judge``; ``paper_inside`` says whether ``paper_value`` lies in
    our interval (None without a paper value or an interval)."""
    lo = math.nan if ci[0] is None else float(ci[0])
    hi = math.nan if ci[1] is None else float(ci[1])
    inside = None
    if paper_value is not None and math.isfinite(lo) and math.isfinite(hi):
        inside = bool(lo <= paper_value <= hi)
    return Verdict(claim, judge(lo, hi, threshold, side), statistic, float(estimate),
                   (lo, hi), threshold, side, paper, paper_value, inside, note)


def verdict_lines(verdicts: Sequence[Mapping[str, Any]]) -> list[str]:
    """The markdown bullet list of a results file's ``verdicts``, then the rule."""
    lines = [f"- {v['line']}" for v in verdicts]
    return [*lines, "", f"Verdict rule: {RULE}."]


__all__ = ["RULE", "Side", "Verdict", "VerdictName", "judge", "verdict", "verdict_lines"]
