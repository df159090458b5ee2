"""A small pristine training run (the tiny calc policy, ``STEPS`` iterations, every
checkpoint kept) that tests forge or damage and then restore in place: shared by the
checkpoint tests (``test_checkpoints.py``) and the state-binding tests
(``test_state_binding.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from train.config import load_config
from train.trainer import train

SMALL = {"tasks_per_step": 2, "n_total": 2, "heldout_tasks": 0, "max_new_tokens": 24,
         "minibatches": 2, "progress": False, "run_id": "r", "keep_last": 10}
STEPS = 2


class Run:
    """The pristine run, restorable in place (its config names its own paths)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cfg = load_config(None, {**SMALL, "steps": STEPS, "store": str(root / "store"),
                                      "out": str(root / "run")})
        self.pristine = root / "pristine"

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    def ckpt(self, step: int) -> Path:
        return self.out / "checkpoints" / f"step-{step:06d}"

    def restore(self) -> None:
        for name in ("run", "store"):
            shutil.rmtree(self.root / name, ignore_errors=True)
            shutil.copytree(self.pristine / name, self.root / name)


def trained(root: Path) -> Run:
    """Train the run in ``root`` once and keep a pristine copy of its directory and store."""
    r = Run(root)
    train(r.cfg)
    r.pristine.mkdir()
    for name in ("run", "store"):
        shutil.copytree(r.root / name, r.pristine / name)
    return r
