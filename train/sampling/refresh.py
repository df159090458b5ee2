"""The DSC refresh protocol (DSC-Gate section 5; METHODS.md section 5): spend new
trajectories from pi only where the prior cannot order the routes.

Used by the gate study (``train.studies.gates``) and by the trainer's refresh of stored
trees (``train.reuse``), there as a program of the rollout engine.

* (``beta_prior``) a Beta posterior per route from a prior mean m and variance v
  of its success rate: pseudo-count n0 = min(N, 0.25 / max(v, 1e-12)), prior
  successes n0 * clip(m, 0, 1), plus Beta(0.5, 0.5);
* (``ProtocolRun``, ``refresh_protocol``) rounds: the leader is the route with the
  highest posterior mean; a competitor c is unresolved while |m_L - m_c| <= kappa_e
  sqrt(v_L + v_c); each round allocates ``batch`` new trajectories over the leader and
  the unresolved competitors in proportion to v / max(gap, min_gap)^2 (largest
  remainder; the leader's weight uses its smallest gap) [R]; a trajectory's reward
  (in [0, 1]) updates its route's posterior; the protocol stops when every pair is
  resolved or ``cap_steps`` new tool steps are spent (a trajectory cut by the cap
  consumes budget but does not update the posterior);
* (``RefreshSampler``) the k-th new trajectory of a route is drawn once and cached,
  so several gates run on one instance see the same k-th trajectory (common random
  numbers);
* (``refresh_program``) the protocol on the refreshed comparisons (``Site``) of one
  stored tree, as a program of ``train.sampling.engine``: the refreshed tree is a
  ``TreeBuilder`` grafted onto the stored paths (``TreeBuilder.graft``), every draw a
  rollout from the copied node with the route's stored action forced first (its tokens
  and logprobs, the behaviour policy's mu, kept: ``forced_step``), so the tree's nodes,
  rewards (a truncated leaf's too) and row streams are ``TreeBuilder``'s. The sites of
  a tree run in lockstep rounds: each round's draws of every unresolved site are one
  ``TreeBuilder.run`` (decoded with every other tree's rows in the engine's batch), then
  observed site by site in preorder under the tree's one step cap (``StepCap``). Draws
  of the last round after the cap cut are kept in the tree and in its cost, not in
  the posterior. A round draws at most what the cap has room for at the tree's charge
  per draw so far (before any, the stored tree's tool steps per leaf; at least one
  draw), so a round does not overrun the cap by more than its last draws' excess cost;
  the draws left out are allocated again next round. ``forced_draws`` is the same draw
  for the D7 calibration.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from rollout_store.tree import Node, Tree
from train.envs.base import Environment
from train.policies.base import Continuation, Policy
from train.sampling.base import SamplerConfig, TreeBuilder
from train.sampling.engine import EnvSource, Request, Work


class Trajectory(Protocol):
    """What the protocol reads of a new trajectory: tool steps spent, final reward."""

    @property
    def steps(self) -> int: ...

    @property
    def reward(self) -> float: ...


T = TypeVar("T", bound=Trajectory)


@dataclass
class RefreshResult:
    """Posterior means / variances (A,), new trajectories per route, steps spent."""

    mean: np.ndarray
    var: np.ndarray
    n_new: np.ndarray
    steps: int
    leader: int
    resolved: bool
    incomplete: int = 0


def beta_prior(mean: float, var: float, n: float) -> tuple[float, float]:
    """Section 5: n0 = min(N, 0.25 / max(v, 1e-12)), prior successes n0 * clip(m, 0, 1),
    plus Beta(0.5, 0.5) smoothing. Returns (alpha, beta)."""
    n0 = min(n, 0.25 / max(var, 1e-12))
    m = min(1.0, max(0.0, mean))
    return 0.5 + n0 * m, 0.5 + n0 * (1.0 - m)


def _beta_moments(alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    total = alpha + beta
    return alpha / total, alpha * beta / (total**2 * (total + 1.0))


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    share = weights / weights.sum() * total
    out = np.floor(share).astype(np.int64)
    rest = total - int(out.sum())
    if rest > 0:
        out[np.argsort(-(share - out), kind="stable")[:rest]] += 1
    return out


@dataclass
class StepCap:
    """The new-step budget that protocol runs share (one stored tree's sites): ``cap``
    steps; ``charged`` what the observed draws were charged (each at least 1)."""

    cap: int
    charged: int = 0

    @property
    def spent(self) -> bool:
        return self.charged >= self.cap


class ProtocolRun:
    """The refresh protocol of section 5 as a state machine (``refresh_protocol`` drives
    it draw by draw, ``refresh_program`` a round at a time): ``allocate`` gives the next
    round's (route, count) groups, ``take`` observes the route's next trajectory. The
    arguments are ``refresh_protocol``'s; ``cap`` may be shared by several runs."""

    def __init__(self, prior_mean: np.ndarray, prior_var: np.ndarray, n_old: np.ndarray,
                 routes: Sequence[int], *, cap: StepCap, kappa_e: float = 2.0,
                 batch: int = 4, min_gap: float = 0.02) -> None:
        prior = np.array([beta_prior(float(m), float(v), float(n))
                          for m, v, n in zip(prior_mean, prior_var, n_old, strict=True)])
        self.alpha, self.beta = prior[:, 0].copy(), prior[:, 1].copy()
        self.n_new = np.zeros(len(prior_mean), np.int64)
        self.steps = self.incomplete = 0  # the draws' cost in the budget unit
        self.candidates = np.array(sorted(routes), np.int64)
        self.cap, self.kappa_e, self.batch, self.min_gap = cap, kappa_e, batch, min_gap

    def _state(self) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        mean, var = _beta_moments(self.alpha, self.beta)
        leader = int(self.candidates[np.argmax(mean[self.candidates])])
        comps = self.candidates[self.candidates != leader]
        gaps = np.abs(mean[leader] - mean[comps])
        unresolved = comps[gaps <= self.kappa_e * np.sqrt(var[leader] + var[comps])]
        return mean, var, leader, unresolved

    def allocate(self) -> list[tuple[int, int]]:
        """The next round's (route, count) in order; [] when every pair is resolved or
        the cap is spent (the protocol has ended)."""
        mean, var, leader, unresolved = self._state()
        if unresolved.size == 0 or self.cap.spent:
            return []
        gap_u = np.maximum(np.abs(mean[leader] - mean[unresolved]), self.min_gap)
        members = np.concatenate([[leader], unresolved])
        weights = np.concatenate([[var[leader] / gap_u.min() ** 2],
                                  var[unresolved] / gap_u**2])
        return [(int(r), int(c)) for r, c in zip(
            members, _largest_remainder(weights, self.batch), strict=True) if c > 0]

    def take(self, route: int, traj: Trajectory) -> bool:
        """Observe ``route``'s next trajectory (its k-th, k = ``n_new[route]`` before the
        call); False when the cap cut it (spent, its reward not counted; the round ends)."""
        self.n_new[route] += 1
        cap = self.cap
        if cap.charged + max(1, traj.steps) > cap.cap:
            self.steps = min(self.steps + traj.steps, cap.cap)
            cap.charged = cap.cap
            self.incomplete += 1
            return False
        self.steps += traj.steps
        cap.charged += max(1, traj.steps)
        self.alpha[route] += traj.reward
        self.beta[route] += 1.0 - traj.reward
        return True

    def play(self, groups: Sequence[tuple[int, int]],
             sample: Callable[[int, int], Trajectory]) -> None:
        """Observe one round: ``sample(route, k)`` for each draw of ``groups`` in order,
        until the cap cuts one or is spent after a route's draws."""
        for route, count in groups:
            for _ in range(count):
                if not self.take(route, sample(route, int(self.n_new[route]))):
                    return
            if self.cap.spent:
                return

    def result(self) -> RefreshResult:
        mean, var, leader, unresolved = self._state()
        return RefreshResult(mean, var, self.n_new.copy(), self.steps, leader,
                             unresolved.size == 0, self.incomplete)


def refresh_protocol(prior_mean: np.ndarray, prior_var: np.ndarray, n_old: np.ndarray,
                     routes: Sequence[int], sample: Callable[[int, int], Trajectory], *,
                     kappa_e: float = 2.0, cap_steps: int = 1536, batch: int = 4,
                     min_gap: float = 0.02) -> RefreshResult:
    """The Beta-posterior refresh of section 5 over ``routes`` (indices into the (A,) prior
    arrays; other routes keep their priors and take no part).

    ``sample(route, k)`` returns the k-th new trajectory of ``route`` (complete, from pi).
    Rounds: find the leader (highest posterior mean among ``routes``), the unresolved
    competitors (|m_L - m_c| <= kappa_e sqrt(v_L + v_c)); stop when none is left or the
    cap is spent; else allocate ``batch`` trajectories over the leader and the
    unresolved competitors in proportion to v / max(gap, min_gap)^2.

    Every draw is charged at least one step against ``cap_steps``, so the cap bounds the
    number of draws as well: in a unit where a draw may cost nothing (``tool_calls``: a
    route that answers at once) two routes with equal deterministic rewards never
    resolve (their gap stays 0 while the posterior variances shrink), and without the
    charge the loop drew forever. ``steps`` reports what the draws really cost.
    """
    run = ProtocolRun(prior_mean, prior_var, n_old, routes, cap=StepCap(cap_steps),
                      kappa_e=kappa_e, batch=batch, min_gap=min_gap)
    while groups := run.allocate():
        run.play(groups, sample)
    return run.result()


class RefreshSampler(Generic[T]):
    """The k-th new trajectory of each route, drawn once by ``draw(route, k)`` and cached
    (common random numbers across the gates of one instance)."""

    def __init__(self, draw: Callable[[int, int], T]) -> None:
        self.draw = draw
        self.cache: dict[tuple[int, int], T] = {}

    def __call__(self, route: int, k: int) -> T:
        found = self.cache.get((route, k))
        if found is None:
            found = self.cache[(route, k)] = self.draw(route, k)
        return found

    def by_route(self, names: Sequence[str]) -> dict[str, list[T]]:
        """The drawn trajectories per route name (``names[route]``), in k order."""
        out: dict[str, list[T]] = {}
        for (route, _), traj in sorted(self.cache.items(), key=lambda kv: kv[0]):
            out.setdefault(names[route], []).append(traj)
        return out


# ----- the protocol on stored trees, through the engine ------------------------------------

def forced_step(node: Node) -> Continuation:
    """A stored node's action as a step to force (``TreeBuilder.run(forced=...)``): its
    text, tokens, logprobs (mu) and entropies."""
    return Continuation(node.action_text or "", list(node.action_token_ids),
                        list(node.action_logprobs), list(node.action_entropies))


@dataclass(frozen=True)
class Draw:
    """One new trajectory of a refresh: its route, the ids of its first (forced) node and
    its leaf in the builder, the leaf's reward as ``TreeBuilder`` stored it, and its
    tool steps (the tool calls of its nodes, the forced one included)."""

    route: int
    first: int
    leaf: int
    reward: float
    steps: int


def forced_draws(builder: TreeBuilder, starts: Sequence[tuple[int, Node]]
                 ) -> Generator[Request, Any, list[Draw]]:
    """One rollout from each (builder node id, stored child) with the child's stored action
    forced first, all in one ``TreeBuilder.run`` (phase ``refresh``); ``Draw.route`` is
    the index in ``starts``."""
    leaves = yield from builder.run([(nid, 1, "refresh") for nid, _ in starts],
                                    forced=[forced_step(c) for _, c in starts])
    out = []
    for r, ((nid, _), (leaf,)) in enumerate(zip(starts, leaves, strict=True)):
        cur, steps = builder.node(leaf), 0
        while True:
            steps += int(cur.tool_calls or 0)
            if cur.parent_id == nid:
                break
            assert cur.parent_id is not None
            cur = builder.node(cur.parent_id)
        out.append(Draw(r, cur.node_id, leaf, builder.leaf_reward(leaf), steps))
    return out


@dataclass(frozen=True)
class Site:
    """One refreshed comparison of a stored tree: the stored node, its routes (the stored
    child ids refreshed) and each route's prior (mean, variance, n)."""

    node: int
    children: tuple[int, ...]
    prior: tuple[tuple[float, float, float], ...]


@dataclass
class RefreshOutcome:
    """What ``refresh_program`` returns: the protocol's result per site, every draw per
    site (route = index into ``Site.children``), the grafted builder, and the map from
    stored node ids to the builder's copies."""

    results: list[RefreshResult]
    draws: list[list[Draw]]
    builder: TreeBuilder
    copied: dict[int, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """New tool steps of every draw (the cost of the refresh)."""
        return sum(d.steps for ds in self.draws for d in ds)


def _prefix(rounds: Sequence[tuple[int, Sequence[tuple[int, int]]]],
            owners: Sequence[tuple[int, int]]) -> list[tuple[int, list[tuple[int, int]]]]:
    """The rounds' (site, (route, count) groups) cut to the draws ``owners`` kept (a
    prefix of them in order)."""
    left = len(owners)
    out: list[tuple[int, list[tuple[int, int]]]] = []
    for i, groups in rounds:
        kept = []
        for route, count in groups:
            if left <= 0:
                break
            kept.append((route, min(count, left)))
            left -= kept[-1][1]
        if kept:
            out.append((i, kept))
    return out


def _next_draw(queues: dict[tuple[int, int], deque[Draw]], site: int, route: int, _k: int
               ) -> Draw:
    return queues[(site, route)].popleft()


def open_env(source: EnvSource) -> Generator[Request, Any, Environment]:
    """The program's environment: a factory is called in the engine's pool."""
    if isinstance(source, Environment):
        return source
    env: Environment = yield Work(source)
    return env


def refresh_program(tree: Tree, sites: Sequence[Site], env: EnvSource, policy: Policy, *,
                    config: SamplerConfig, seed: int, tree_id: str, run_id: str, cap: int,
                    kappa_e: float = 2.0, batch: int = 4, min_gap: float = 0.02
                    ) -> Generator[Request, Any, RefreshOutcome]:
    """The refresh protocol on ``sites`` of the stored ``tree`` (module docstring), a
    program of ``train.sampling.engine``: a builder grafted onto the sites' stored paths
    (tree ``tree_id``, sampler ``refresh``, rows keyed by ``seed``), lockstep rounds over
    the sites, at most ``cap`` new tool steps charged for the tree. ``env``: an
    environment or a factory (made in the pool, closed at the end)."""
    owned = not isinstance(env, Environment)
    environment = yield from open_env(env)
    try:
        builder, copied = TreeBuilder.graft(  # paths copied when a site first draws
            environment, policy, tree, [], sampler="refresh",
            config=config, seed=seed, tree_id=tree_id, run_id=run_id, phase="refresh")
        shared = StepCap(cap)
        runs = [ProtocolRun(np.array([p[0] for p in s.prior]), np.array([p[1] for p in s.prior]),
                            np.array([p[2] for p in s.prior], np.float64),
                            range(len(s.children)), cap=shared, kappa_e=kappa_e,
                            batch=batch, min_gap=min_gap) for s in sites]
        draws: list[list[Draw]] = [[] for _ in sites]
        leaves = max(1, len(tree.leaves()))
        per_draw = max(1.0, sum(int(n.tool_calls or 0) for n in tree.nodes) / leaves)
        while rounds := [(i, g) for i, g in ((i, r.allocate()) for i, r in enumerate(runs))
                         if g]:
            taken = sum(int(r.n_new.sum()) for r in runs)
            if taken:  # the charge per draw so far (each draw charged at least 1)
                per_draw = max(1.0, shared.charged / taken)
            room = max(1, int((shared.cap - shared.charged) / per_draw))
            owners = [(i, route) for i, groups in rounds for route, count in groups
                      for _ in range(count)][:room]
            rounds = _prefix(rounds, owners)
            builder.copy_paths(tree, [sites[i].node for i, _ in owners], copied, "refresh")
            got = yield from forced_draws(builder, [
                (copied[sites[i].node], tree.node(sites[i].children[route]))
                for i, route in owners])
            queues: dict[tuple[int, int], deque[Draw]] = {}
            for (i, route), d in zip(owners, got, strict=True):
                d = Draw(route, d.first, d.leaf, d.reward, d.steps)
                draws[i].append(d)
                queues.setdefault((i, route), deque()).append(d)
            for i, groups in rounds:  # observed in preorder under the tree's one cap
                if shared.spent:
                    break
                runs[i].play(groups, partial(_next_draw, queues, i))
        return RefreshOutcome([r.result() for r in runs], draws, builder, copied)
    finally:
        if owned:
            environment.close()


__all__ = ["Draw", "ProtocolRun", "RefreshOutcome", "RefreshResult", "RefreshSampler", "Site",
           "StepCap", "Trajectory", "beta_prior", "forced_draws", "forced_step", "open_env",
           "refresh_program", "refresh_protocol"]
