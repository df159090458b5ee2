"""D7 calibration of the gate's kappas for ``dsc`` (docs/METHODS.md section 9, "D7
calibration"): the root comparison's pairs of calibration-split trees against targets from
new trajectories under mu (the tree's own checkpoint) and pi (the current weights);
``dsc_gate.calibrate_radii`` gives the residual variances (dev trees) and kappas (calib
trees). The record lives in ``OUT/reuse_params.json`` (``train.reuse.runfiles``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from rollout_store.reader import read_trees
from rollout_store.tree import Tree
from train.batches import ProxLogp
from train.credit.base import TreeArrays, from_trees
from train.credit.dsc import RATIO, STATE
from train.credit.dsc_gate import DSCGateParams, calibrate_radii, dsc_gate
from train.envs.base import Environment
from train.policies.base import Policy
from train.reuse.params import CALIB_FRAC, ReuseParams
from train.reuse.refresh import engine_for
from train.reuse.resolve import dsc_extras
from train.reuse.runfiles import read_record, write_params
from train.reuse.select import Selection, split_hash, tree_problem
from train.sampling.base import SamplerConfig, TreeBuilder, mix_seed
from train.sampling.engine import EnvSource, Request
from train.sampling.refresh import forced_draws, open_env
from train.scoring import score_trees


def _ratio_scores(trees: Sequence[Tree], policy: Policy) -> ProxLogp:
    """{(tree id, node id): (1,) sum log pi} of every depth >= 2 action under ``policy``
    (``score_trees``, kind ``action``: the action text re-scored by the policy)."""
    table = score_trees(trees, policy, "action")
    return {(t, n): np.array([v]) for t, n, v in zip(
        table.column("tree_id").to_pylist(), table.column("node_id").to_pylist(),
        table.column("value").to_pylist(), strict=True)}


def _route_means(trees: Sequence[Tree], env: EnvSource, policy: Policy, *, k: int,
                 seeds: Sequence[int], max_new_tokens: int, temperature: float
                 ) -> list[tuple[np.ndarray, int]]:
    """Per tree, the (A,) mean return of ``k`` new trajectories per root child under
    ``policy`` (the root's stored child actions forced first, ``forced_draws``) and the
    tool steps they spent: every tree one program (rows keyed by its seed), all in one
    ``Engine.run``."""
    config = SamplerConfig(max_new_tokens=max_new_tokens, temperature=temperature)

    def program(tree: Tree, seed: int) -> Generator[Request, Any, tuple[np.ndarray, int]]:
        owned = not isinstance(env, Environment)
        environment = yield from open_env(env)
        try:
            root = tree.root().node_id
            children = tree.children()[root]
            builder, copied = TreeBuilder.graft(environment, policy, tree, [root],
                                                sampler="calibrate", config=config,
                                                seed=seed, tree_id=f"{tree.tree_id}/calibrate")
            got = yield from forced_draws(builder, [(copied[root], tree.node(c))
                                                    for c in children for _ in range(k)])
            rewards = np.array([d.reward for d in got]).reshape(len(children), k)
            return rewards.mean(axis=1), sum(d.steps for d in got)
        finally:
            if owned:
                environment.close()

    return engine_for(policy, env).run(
        [partial(program, t, s) for t, s in zip(trees, seeds, strict=True)])


def calibrate_gate(trees: Sequence[Tree], params: ReuseParams, env: EnvSource,
                   policy: Policy, *, seed: int, max_new_tokens: int, temperature: float,
                   load_mu: Callable[[Tree], Policy]) -> tuple[ReuseParams, dict[str, Any]]:
    """D7 on calibration-split ``trees`` (module docstring): the root comparison's pairs
    (kappas 1, zero residuals; ratios pi/mu from ``policy``'s scores) against c_mu, c_pi
    of ``params.calib_draws`` new trajectories per root action under ``load_mu(tree)``
    and ``policy``; trees alternate calib / dev in the given order. Returns the params
    with the calibrated kappas and residual variances (a kappa without calib pairs keeps
    its start value; one from too few calib trees to certify the level is at least its
    start value) and the record written to the run."""
    split: dict[str, str] = {}
    usable: list[Tree] = []
    problems: Counter[str] = Counter()
    mus: list[Policy] = []
    for tree in trees:
        if len(tree.children()[tree.root().node_id]) < 2:
            problems["one_root_action"] += 1
            continue
        try:
            mus.append(load_mu(tree))
        except (OSError, ValueError, RuntimeError):  # a pruned or foreign checkpoint
            problems["no_mu_checkpoint"] += 1
            continue
        split[tree.tree_id] = "calib" if len(usable) % 2 == 0 else "dev"
        usable.append(tree)
    record: dict[str, Any] = {"split": f"sha256(tree_id)/2^64 < {CALIB_FRAC}",
                              "trees": split, "skipped": dict(problems), "tool_steps": 0}
    if not usable:
        record["status"] = "no usable calibration tree: start kappas kept"
        return params, record
    prox = _ratio_scores(usable, policy)
    extras = [dsc_extras(t, prox) for t in usable]
    arrays: TreeArrays = from_trees(list(usable), {
        k: np.concatenate([e[k] for e in extras]) for k in (RATIO, STATE)})
    pairs = dsc_gate(arrays, DSCGateParams(kappa_R=1.0, kappa_delta=1.0, kappa_T=1.0))
    steps = 0
    at_row: list[np.ndarray] = [np.zeros(arrays.n_nodes), np.zeros(arrays.n_nodes)]
    row_of = {(arrays.tree_ids[int(arrays.node_tree[r])], int(arrays.node_ids[r])): r
              for r in range(arrays.n_nodes)}
    keys = [mix_seed(seed, "calibrate", t.tree_id) for t in usable]
    draw = partial(_route_means, env=env, k=params.calib_draws, max_new_tokens=max_new_tokens,
                   temperature=temperature)
    by_mu: dict[int, list[int]] = {}  # trees of one mu checkpoint: one wavefront
    for b, mu in enumerate(mus):
        by_mu.setdefault(id(mu), []).append(b)
    under_mu: dict[int, tuple[np.ndarray, int]] = {}
    for idx in by_mu.values():
        under_mu.update(zip(idx, draw([usable[b] for b in idx], policy=mus[idx[0]],
                                      seeds=[mix_seed(keys[b], 0) for b in idx]), strict=True))
    under_pi = draw(usable, policy=policy, seeds=[mix_seed(key, 1) for key in keys])
    for which, got in enumerate(([under_mu[b] for b in range(len(usable))], under_pi)):
        for tree, (means, spent) in zip(usable, got, strict=True):
            steps += spent
            children = tree.children()[tree.root().node_id]
            for c, m in zip(children, means, strict=True):
                at_row[which][row_of[(tree.tree_id, c)]] = m
    c_mu = at_row[0][pairs.leader] - at_row[0][pairs.competitor]
    c_pi = at_row[1][pairs.leader] - at_row[1][pairs.competitor]
    calib = calibrate_radii([(pairs, c_mu, c_pi)],
                            [split[arrays.tree_ids[b]] for b in range(arrays.n_trees)],
                            params.calib_level)
    new: dict[str, float] = {}
    start = params.kappas()
    for x in ("R", "delta", "T"):
        kappa = calib[x]["kappa"]
        if calib[x]["kappa_fallback_to_max"]:
            # too few calib trees to certify the level: the calibration may only widen
            kappa = max(kappa, start[f"kappa_{x}"])
            calib[x]["kappa_floored_at_start"] = True
        if math.isfinite(kappa):
            new[f"kappa_{x}"] = float(kappa)
        new[f"residual_var_{x}"] = float(calib[x]["residual_var"])
    record.update({"status": "calibrated", "tool_steps": steps, "n_pairs": len(c_mu),
                   "level": params.calib_level, "draws_per_action": params.calib_draws,
                   "radii": calib})
    return params.with_kappas(new), record


def gate_params(sel: Selection, params: ReuseParams, env: EnvSource, policy: Policy, *,
                out: Path | None, iteration: int, seed: int, max_new_tokens: int,
                temperature: float) -> tuple[ReuseParams, int, dict[str, Any] | None]:
    """The gate's params for ``iteration`` of a ``dsc`` run: the calibration recorded in
    ``out/reuse_params.json`` by an earlier iteration, or a calibration now (when
    ``params.calibrate`` and ``calib_trees`` calibration-split trees are eligible), or
    the start kappas. Returns (params, new tool steps the calibration spent now, its
    record when it ran now). A resumed iteration that had calibrated calibrates again
    (the same draws), so its counts match an uninterrupted run."""
    if not params.calibrate or out is None:
        return params, 0, None
    done = read_record(out).get("calibration") or {}
    if isinstance(done, dict) and done.get("status") == "calibrated" and \
            int(done.get("iteration", iteration)) < iteration:
        return params.with_kappas(done["kappas"]), 0, None
    if len(sel.calib) < params.calib_trees or sel.store is None:
        return params, 0, None
    order = sorted(sel.calib, key=lambda t: (t[1], split_hash(t[0])))[:params.calib_trees]
    trees = [t for t in read_trees(sel.store, [i for i, _ in order])
             if tree_problem(t, True) is None]
    by_id = {t.tree_id: t for t in trees}
    trees = [by_id[i] for i, _ in order if i in by_id]
    from train.policies import load_policy_ref

    cache: dict[str, Policy] = {}

    def load_mu(tree: Tree) -> Policy:
        ref = str(tree.policy_ref)
        if ref not in cache:
            cache[ref] = load_policy_ref(ref, tree.env, tree.policy_version)
        return cache[ref]

    new, record = calibrate_gate(trees, params, env, policy, seed=seed,
                                 max_new_tokens=max_new_tokens, temperature=temperature,
                                 load_mu=load_mu)
    record.update({"iteration": iteration, "kappas": new.kappas(),
                   "start_kappas": params.kappas()})
    if record.get("status") == "calibrated":
        write_params(out, new, record)
    return new, int(record["tool_steps"]), record


__all__ = ["calibrate_gate", "gate_params"]
