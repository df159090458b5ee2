"""Golden trajectories of the trainer: the tiny calc policy, a fixed seed, a few
iterations; per-step losses and rewards must match ``tests/golden/trainer_calc.json``, and
for each stored-tree reuse rule (``--reuse all | transport | dsc | refresh``, METHODS.md
section 9) the per-step loss, pair decisions, new tool steps and a digest of the refreshed
trees must match ``tests/golden/trainer_reuse_<rule>.json``.

Regenerate only on purpose: ``make golden`` (runs this file as a script with ``--write``).
A change of the recorded numbers means the training step changed; say why in the commit.

**The goldens hold on any x86-64 CPU** (docs/REPRODUCIBILITY.md). Another CPU, or another
kernel on the same one (``ATEN_CPU_CAPABILITY=default|avx2``, ``MKL_ENABLE_INSTRUCTIONS``),
reduces sums in another order. In float32 that moves logits by ~1e-7 and, compounded over
a few updates, the loss by up to ~1e-4 relative; and since a token is drawn by inverting
the CDF at a fixed u, a 1e-7 move flips a sampled token whenever u falls that close to a
boundary, after which the trajectories, and every number, part. Widening tolerances cannot
fix that, so these runs train the policy in float64 (``dtype = "float64"``: sampling,
scoring and the loss included), where the same moves are ~1e-16 and a flip needs u within
~1e-13 of a boundary (about 1e-9 per run of ~10^4 draws). What is discrete (rewards, tool
steps, pair decisions, the refreshed trees' tokens and shape) is compared exactly; floats
within ``FLOAT_REL``; CI runs this file a second time under another CPU capability
(``.ci/run``).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from rollout_store.reader import read_trees
from train.config import load_config
from train.trainer import read_metrics, train

GOLDEN = Path(__file__).parent / "golden" / "trainer_calc.json"
SETTINGS = {"env": "calc", "policy": "tiny", "dtype": "float64", "sampler": "bel",
            "credit": "elpo", "steps": 10, "tasks_per_step": 2, "n_total": 4,
            "heldout_tasks": 0, "max_new_tokens": 40,
            "minibatches": 2, "seed": 7, "progress": False, "run_id": "golden",
            "sampler_params": {"b_max": 1, "x_max": 1}}
REUSE_RULES = ("all", "transport", "dsc", "refresh")
REUSE_SETTINGS = {"env": "calc", "policy": "tiny", "dtype": "float64", "sampler": "group",
                  "credit": "grpo", "steps": 4, "tasks_per_step": 2, "n_total": 3,
                  "heldout_tasks": 0,
                  "max_new_tokens": 24, "minibatches": 2, "seed": 7, "progress": False,
                  "run_id": "golden", "reuse_per_step": 2, "max_staleness": 2,
                  "reuse_params": "calib_trees=2,calib_level=0.5,calib_draws=1,refresh_cap=6,"
                                 "min_trajectories=1"}
REUSE_METRICS = ("loss", "reward", "grad_norm", "new_tool_steps", "reuse_trees",
                 "reuse_new_tool_steps", "reuse_pairs_reuse", "reuse_pairs_transport",
                 "reuse_pairs_refresh", "is_weight_mean")
FLOAT_REL = 1e-6
"""Tolerance of the float metrics. In float64, another CPU capability on one machine
(``ATEN_CPU_CAPABILITY=default`` with ``MKL_ENABLE_INSTRUCTIONS=SSE4_2`` against AVX2)
moved the losses by at most 2.3e-9 relative and every grad norm by 2e-16 (the stored
logprobs are float32: a rare last-bit flip there is the 2.3e-9); float32 runs of the same
goldens moved by 1e-6 here and 1e-4 on an AVX-512 CPU. A change of random streams or of
the method moves them by far more; rewards, tool-step counts, pair decisions and the
refreshed trees' digests are compared exactly."""


def reuse_golden(rule: str) -> Path:
    return GOLDEN.with_name(f"trainer_reuse_{rule}.json")


def run_golden(tmp: Path) -> dict[str, list[float]]:
    cfg = load_config(None, {**SETTINGS, "store": str(tmp / "store"), "out": str(tmp / "run")})
    train(cfg)
    metrics = read_metrics(cfg.store, "golden")
    return {name: [v for _, v in metrics[name]] for name in ("loss", "reward", "grad_norm")}


def tree_digest(tree: Any, versions: dict[str, str]) -> str:
    """sha256 of what a refreshed tree holds: its shape, actions, observations, rewards and
    lineage (not its snapshots' bytes, which the env's pickling may vary). Policy versions
    are hashes of the weights' bytes, so they enter as ``versions`` maps them (to the
    iteration that published them): a float reduction in another order changes the hash
    but not the lineage this checks."""
    meta = {k: versions.get(v, v) if isinstance(v, str) else v for k, v in tree.meta.items()}
    body = [tree.tree_id, versions.get(tree.policy_version, tree.policy_version),
            json.dumps(meta, sort_keys=True)]
    for n in tree.nodes:  # no floats: their last bits are the CPU's (``logprob_sum``)
        body.append(json.dumps([n.node_id, n.parent_id, n.kind, n.action_token_ids,
                                n.observation_text, n.reward, n.tool_calls, n.meta],
                               sort_keys=True, default=str))
    return hashlib.sha256("\n".join(body).encode()).hexdigest()


def logprob_sum(tree: Any) -> float:
    """The sum of a tree's sampled-token logprobs (compared within ``FLOAT_REL``)."""
    return float(sum(sum(n.action_logprobs) for n in tree.nodes))


def iteration_versions(trees: list[Any]) -> dict[str, str]:
    """Each fresh tree's policy version -> ``it<k>``, k the iteration in its tree id
    (``<run>/it<k>/<index>``)."""
    return {t.policy_version: t.tree_id.split("/")[1] for t in trees
            if t.sampler != "refresh"}


def run_reuse_golden(tmp: Path, rule: str) -> dict[str, Any]:
    cfg = load_config(None, {**REUSE_SETTINGS, "reuse": rule, "store": str(tmp / "store"),
                             "out": str(tmp / "run")})
    train(cfg)
    metrics = read_metrics(cfg.store, "golden")
    got: dict[str, Any] = {name: [v for _, v in metrics.get(name, [])]
                           for name in REUSE_METRICS}
    trees = read_trees(cfg.store)
    versions = iteration_versions(trees)
    refreshed = [t for t in trees if t.sampler == "refresh"]
    got["refreshed_trees"] = {t.tree_id: tree_digest(t, versions) for t in refreshed}
    got["refreshed_logprob_sums"] = {t.tree_id: logprob_sum(t) for t in refreshed}
    return got


def test_golden_trajectory(tmp_path: Path) -> None:
    expected = json.loads(GOLDEN.read_text())
    got = run_golden(tmp_path)
    assert expected["settings"] == SETTINGS
    assert got["reward"] == expected["reward"]
    for name in ("loss", "grad_norm"):
        assert got[name] == pytest.approx(expected[name], rel=FLOAT_REL, abs=1e-6), name


@pytest.mark.parametrize("rule", REUSE_RULES)
def test_reuse_golden(tmp_path: Path, rule: str) -> None:
    expected = json.loads(reuse_golden(rule).read_text())
    got = run_reuse_golden(tmp_path, rule)
    assert expected["settings"] == {**REUSE_SETTINGS, "reuse": rule}
    for name in ("reward", "new_tool_steps", "reuse_trees", "reuse_new_tool_steps",
                 "reuse_pairs_reuse", "reuse_pairs_transport", "reuse_pairs_refresh"):
        assert got[name] == expected[name], name
    for name in ("loss", "grad_norm", "is_weight_mean"):
        assert got[name] == pytest.approx(expected[name], rel=FLOAT_REL, abs=1e-6), name
    assert got["refreshed_trees"] == expected["refreshed_trees"]
    assert got["refreshed_logprob_sums"] == pytest.approx(expected["refreshed_logprob_sums"],
                                                          rel=FLOAT_REL, abs=1e-6)


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python tests/test_trainer_golden.py --write [--only RULE]  "
                 "(or: make golden)")
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    with tempfile.TemporaryDirectory() as tmp:
        if only is None or only == "none":
            result = run_golden(Path(tmp) / "none")
            GOLDEN.write_text(json.dumps({"settings": SETTINGS, **result}, indent=2) + "\n")
            print(f"wrote {GOLDEN}")
        for rule in REUSE_RULES:
            if only is not None and only != rule:
                continue
            got = run_reuse_golden(Path(tmp) / rule, rule)
            path = reuse_golden(rule)
            path.write_text(json.dumps({"settings": {**REUSE_SETTINGS, "reuse": rule}, **got},
                                       indent=2) + "\n")
            print(f"wrote {path}")
