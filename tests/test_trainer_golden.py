"""Golden trajectory of the trainer: the tiny calc policy, a fixed seed,
10 iterations; per-step losses and rewards must match ``tests/golden/trainer_calc.json``.

Regenerate only on purpose: ``make golden`` (runs this file as a script with ``--write``).
A change of the recorded numbers means the training step changed; say why in the commit.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from train.config import load_config
from train.trainer import read_metrics, train

GOLDEN = Path(__file__).parent / "golden" / "trainer_calc.json"
SETTINGS = {"env": "calc", "policy": "tiny", "sampler": "bel", "credit": "elpo", "steps": 10,
            "tasks_per_step": 2, "n_total": 4, "heldout_tasks": 0, "max_new_tokens": 40,
            "minibatches": 2, "seed": 7, "progress": False, "run_id": "golden",
            "sampler_params": {"b_max": 1, "x_max": 1}}


def run_golden(tmp: Path) -> dict[str, list[float]]:
    cfg = load_config(None, {**SETTINGS, "store": str(tmp / "store"), "out": str(tmp / "run")})
    train(cfg)
    metrics = read_metrics(cfg.store, "golden")
    return {name: [v for _, v in metrics[name]] for name in ("loss", "reward", "grad_norm")}


def test_golden_trajectory(tmp_path: Path) -> None:
    expected = json.loads(GOLDEN.read_text())
    got = run_golden(tmp_path)
    assert expected["settings"] == SETTINGS
    assert got["reward"] == expected["reward"]
    for name in ("loss", "grad_norm"):
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python tests/test_trainer_golden.py --write  (or: make golden)")
    with tempfile.TemporaryDirectory() as tmp:
        result = run_golden(Path(tmp))
    GOLDEN.write_text(json.dumps({"settings": SETTINGS, **result}, indent=2) + "\n")
    print(f"wrote {GOLDEN}")
