"""Estimates of Q_pi(s0, a) per route from the old interventional trajectories (the gate
study's priors; ``train.studies.gates``, METHODS.md section 5, D3-D5).

Per route of one instance: the reuse mean (old returns), the transported mean
(D4-D5, the real ``train.credit.dsc.transport_returns``), a self-normalized WIS
and a sequential doubly robust (DR) estimate, each with the variance of its mean.
Choices [R]: see ``train.studies.gates`` (WIS: W = product of pi/mu over the
downstream steps, delta-method variance floored at 1/(4N^2); DR: D_{K+1} = R,
D_t = v_pi(S_t) + rho_t (D_{t+1} - q(S_t, A_t)), q cross-fitted on the other fold).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from train.credit.base import path_sum
from train.credit.dsc import RATIO, STATE, Transported, transport_returns
from train.envs.workflow_model import ObsKey
from train.envs.workflow_policy import TabularPolicy
from train.studies.workflow_study import RouteData


@dataclass
class Trajectories:
    """The old trajectories of the batch, L = leaves: tree (L,), route index (L,),
    fold (L,), reward (L,), and each one's downstream rows (depth >= 3), root first."""

    tree: np.ndarray
    route: np.ndarray
    fold: np.ndarray
    reward: np.ndarray
    leaf: np.ndarray
    steps: list[np.ndarray]


def old_trajectories(data: RouteData) -> Trajectories:
    """Every old trajectory of the batch (folds as in ``train.credit.dsc``)."""
    b = data.batch
    ones = replace(b, extras={RATIO: np.ones(b.n_nodes), STATE: data.state_ids()})
    tr = transport_returns(ones)
    route = data.route_index[tr.action]
    steps = []
    for leaf in tr.leaf:
        rows = []
        v = int(leaf)
        while b.depth[v] >= 3:
            rows.append(v)
            v = int(b.parent[v])
        steps.append(np.array(rows[::-1], np.int64))
    return Trajectories(tr.tree, route, tr.fold, tr.reward, tr.leaf, steps)


class _DRModel:
    """Cross-fitted q(s, u) tables of one tree and fold (the DR prior, [R])."""

    def __init__(self) -> None:
        self.q: dict[tuple[ObsKey, str], list[float]] = {}
        self.b: dict[ObsKey, list[float]] = {}
        self.total = [0.0, 0.0]

    def add(self, keys: Sequence[ObsKey], actions: Sequence[str], reward: float) -> None:
        self.total[0] += reward
        self.total[1] += 1.0
        for key, action in zip(keys, actions, strict=True):
            for acc in (self.q.setdefault((key, action), [0.0, 0.0]),
                        self.b.setdefault(key, [0.0, 0.0])):
                acc[0] += reward
                acc[1] += 1.0

    def q_hat(self, key: ObsKey, action: str) -> float:
        for acc in (self.q.get((key, action)), self.b.get(key), self.total):
            if acc is not None and acc[1] > 0:
                return acc[0] / acc[1]
        return 0.0


def _dr_returns(data: RouteData, trajs: Trajectories, in_tree: np.ndarray, ratio: np.ndarray,
                dr_models: Sequence[_DRModel], pi: TabularPolicy, t: int) -> np.ndarray:
    """Sequential DR return of each trajectory of tree ``t`` ([R], module docstring):
    D_{K+1} = R, D_t = v_pi(S_t) + rho_t (D_{t+1} - q(S_t, A_t)), models of the other fold."""
    model = data.models[t]
    v_cache: dict[tuple[int, ObsKey], float] = {}
    out = np.empty(in_tree.size)
    for j, i in enumerate(in_tree):
        other = 1 - int(trajs.fold[i])
        q_model = dr_models[other]
        d = float(trajs.reward[i])
        for r in trajs.steps[i][::-1]:
            key = data.key[r]
            assert key is not None
            v = v_cache.get((other, key))
            if v is None:
                v = sum(p * q_model.q_hat(key, a)
                        for p, a in zip(pi.probs(key), model.valid_actions(key), strict=True))
                v_cache[(other, key)] = v
            d = v + float(ratio[r]) * (d - q_model.q_hat(key, data.action[r]))
        out[j] = d
    return out


def _floored_var(values: np.ndarray) -> float:
    n = values.size
    var = float(np.var(values, ddof=1)) if n > 1 else 0.0
    return max(var / n, 1.0 / (4.0 * n * n))


@dataclass
class RouteEstimates:
    """Per route (A,) of one instance: the exact Q_mu / Q_pi and every estimator's
    mean and variance of the mean (``reuse``, ``transport``, ``wis``, ``dr``)."""

    actions: list[str]
    n: np.ndarray
    q_mu: np.ndarray
    q_pi: np.ndarray
    mean: dict[str, np.ndarray]
    var: dict[str, np.ndarray]


def route_estimates(data: RouteData, trajs: Trajectories, tr: Transported,
                    ratio: np.ndarray, trees: Sequence[int], pi: Sequence[TabularPolicy],
                    q_mu: Sequence[np.ndarray], q_pi: Sequence[np.ndarray]
                    ) -> dict[int, RouteEstimates]:
    """Reuse, transported (D4-D5), WIS and DR means per route for the given trees."""
    b = data.batch
    log_ratio = np.where(b.depth >= 3, np.log(np.where(b.depth >= 3, ratio, 1.0)), 0.0)
    weight = np.exp(path_sum(b, log_ratio)[trajs.leaf])  # (L,) product of ratios
    out = {}
    for t in trees:
        actions = data.route_actions[t]
        in_tree = np.flatnonzero(trajs.tree == t)
        # cross-fitted DR models per fold
        dr_models = [_DRModel(), _DRModel()]
        for i in in_tree:
            rows = trajs.steps[i]
            keys = [data.key[r] for r in rows]
            dr_models[int(trajs.fold[i])].add(
                keys, [data.action[r] for r in rows], float(trajs.reward[i]))
        dr = _dr_returns(data, trajs, in_tree, ratio, dr_models, pi[t], t)
        n_routes = len(actions)
        est_mean = {k: np.zeros(n_routes) for k in ("reuse", "transport", "wis", "dr")}
        est_var = {k: np.zeros(n_routes) for k in est_mean}
        n = np.zeros(n_routes)
        route_of = trajs.route[in_tree]
        pos = np.searchsorted(tr.leaf, trajs.leaf[in_tree])
        for r in range(n_routes):
            sel = route_of == r
            reward = trajs.reward[in_tree][sel]
            n[r] = reward.size
            transported = tr.transported[pos[sel]]
            w = weight[in_tree][sel]
            for name, values in (("reuse", reward), ("transport", transported),
                                 ("dr", dr[sel])):
                est_mean[name][r] = float(values.mean())
                est_var[name][r] = _floored_var(values)
            if w.sum() > 0:
                m = float((w * reward).sum() / w.sum())
                v = float((w**2 * (reward - m) ** 2).sum() / w.sum() ** 2)
            else:
                m, v = est_mean["reuse"][r], est_var["reuse"][r]
            est_mean["wis"][r] = m
            est_var["wis"][r] = max(v, 1.0 / (4.0 * n[r] ** 2))
        out[t] = RouteEstimates(actions=list(actions), n=n, q_mu=q_mu[t], q_pi=q_pi[t],
                                mean=est_mean, var=est_var)
    return out


__all__ = ["RouteEstimates", "Trajectories", "old_trajectories", "route_estimates"]
