"""Clip metrics on the tokens whose lower bound ELC widens (issue 23 item 4): the share of
such tokens, how many were clipped at the wider bound, and how many the run's own
``clip_low`` would have clipped (ELC's effect on the gradient). With ``eps_elc = 0`` no
token is widened."""

from __future__ import annotations

from pathlib import Path

from train.config import load_config
from train.trainer import read_metrics, train

RECIPE = {"tasks_per_step": 4, "n_total": 8, "heldout_tasks": 0, "max_new_tokens": 40,
          "epochs": 3, "minibatches": 4, "lr": 3e-3, "steps": 2, "progress": False,
          "run_id": "r", "sampler": "bel", "credit": "elpo"}


def _metrics(tmp: Path, name: str, **kw: object) -> dict[str, list[float]]:
    cfg = load_config(None, {**RECIPE, "store": str(tmp / f"s-{name}"),
                             "out": str(tmp / f"r-{name}"), **kw})
    train(cfg)
    got = read_metrics(cfg.store, cfg.resolved_run_id)
    return {k: [v for _, v in got[k]] for k in ("wide_low_frac", "wide_low_clip_frac",
                                                "wide_low_released_frac", "clip_frac_low")}


def test_elc_tokens_are_counted_and_vanish_without_elc(tmp_path: Path) -> None:
    elc = _metrics(tmp_path, "elc")
    print("ELC recipe metrics:", elc)
    assert all(f > 0 for f in elc["wide_low_frac"]), elc
    for clip, released in zip(elc["wide_low_clip_frac"], elc["wide_low_released_frac"],
                              strict=True):
        assert 0.0 <= clip <= 1.0 and 0.0 <= released <= 1.0 and clip + released <= 1.0
    plain = _metrics(tmp_path, "plain", credit_params={"eps_elc": "0"})
    assert plain["wide_low_frac"] == [0.0, 0.0]
    assert plain["wide_low_clip_frac"] == [0.0, 0.0]
