"""The DSC refresh protocol (DSC-Gate section 5; METHODS.md section 5): spend new
trajectories from pi only where the prior cannot order the routes.

Used by the gate study (``train.studies.gates``) and available to the trainer.

* (``beta_prior``) a Beta posterior per route from a prior mean m and variance v
  of its success rate: pseudo-count n0 = min(N, 0.25 / max(v, 1e-12)), prior
  successes n0 * clip(m, 0, 1), plus Beta(0.5, 0.5);
* (``refresh_protocol``) rounds: the leader is the route with the highest posterior
  mean; a competitor c is unresolved while |m_L - m_c| <= kappa_e sqrt(v_L + v_c);
  each round allocates ``batch`` new trajectories over the leader and the
  unresolved competitors in proportion to v / max(gap, min_gap)^2 (largest
  remainder; the leader's weight uses its smallest gap) [R]; a trajectory's reward
  (in [0, 1]) updates its route's posterior; the protocol stops when every pair is
  resolved or ``cap_steps`` new tool steps are spent (a trajectory cut by the cap
  consumes budget but does not update the posterior);
* (``RefreshSampler``) the k-th new trajectory of a route is drawn once and cached,
  so several gates run on one instance see the same k-th trajectory (common random
  numbers);
* (``PolicyRefresh``) a draw for any ``Policy`` and environment with exact
  ``restore``: the continuation primitive of ``train.sampling.base`` from the
  context's snapshot, the route's action forced first (a stored action keeps its
  tokens and logprobs, ``Forced``), key ``mix_seed(seed, "refresh", *key_parts, k)``
  (key parts default to the route index), cost in env steps or tool calls, and
  optionally one ``StepRecord`` per step. Used by the trainer's refresh of stored
  trees (``train.reuse``) and its D7 calibration draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from rollout_store.tree import Segment
from train.envs.base import Environment, parse_action
from train.policies.base import Policy, Rows, SampleConfig, Turn, sample_rows
from train.sampling.base import Continuing, SamplerConfig, mix_seed
from train.sampling.segments import action_segments, token_char_starts


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
    prior = np.array([beta_prior(float(m), float(v), float(n))
                      for m, v, n in zip(prior_mean, prior_var, n_old, strict=True)])
    alpha, beta = prior[:, 0].copy(), prior[:, 1].copy()
    n_new = np.zeros(len(prior_mean), np.int64)
    steps = charged = 0  # the draws' cost in the budget unit; what the cap counts
    incomplete = 0
    candidates = np.array(sorted(routes), np.int64)
    while True:
        mean, var = _beta_moments(alpha, beta)
        leader = int(candidates[np.argmax(mean[candidates])])
        comps = candidates[candidates != leader]
        gaps = np.abs(mean[leader] - mean[comps])
        unresolved = comps[gaps <= kappa_e * np.sqrt(var[leader] + var[comps])]
        if unresolved.size == 0 or charged >= cap_steps:
            return RefreshResult(mean, var, n_new, steps, leader, unresolved.size == 0,
                                 incomplete)
        gap_u = np.maximum(np.abs(mean[leader] - mean[unresolved]), min_gap)
        members = np.concatenate([[leader], unresolved])
        weights = np.concatenate([[var[leader] / gap_u.min() ** 2],
                                  var[unresolved] / gap_u**2])
        for route, count in zip(members, _largest_remainder(weights, batch), strict=True):
            for _ in range(int(count)):
                traj = sample(int(route), int(n_new[route]))
                n_new[route] += 1
                if charged + max(1, traj.steps) > cap_steps:  # cut by the cap: spent,
                    steps = min(steps + traj.steps, cap_steps)  # its reward not counted
                    charged = cap_steps
                    incomplete += 1
                    break
                steps += traj.steps
                charged += max(1, traj.steps)
                alpha[route] += traj.reward
                beta[route] += 1.0 - traj.reward
            if charged >= cap_steps:
                break


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


@dataclass(frozen=True)
class Forced:
    """A route's first action as it was stored: its text and, for the step records, the
    tokens, logprobs (the behaviour policy's mu), entropies and segments it was sampled
    with. A plain ``str`` route action is ``Forced(text)``."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    entropies: tuple[float, ...] = ()
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class StepRecord:
    """One step of a draw (``PolicyRefresh(records=True)``): the action (tokens, logprobs,
    entropies, segments), what followed (observation, done, reward parts), the env
    snapshot after it, whether the step limit cut the rollout there, and whether the
    action was a tool call."""

    action_text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    entropies: tuple[float, ...]
    segments: tuple[Segment, ...]
    observation: str
    done: bool
    reward_parts: dict[str, float]
    snapshot: bytes
    truncated: bool
    tool_call: bool


@dataclass(frozen=True)
class Drawn:
    """A new trajectory drawn by ``PolicyRefresh``: its transcript, its cost in the
    budget unit (``steps``), reward, whether the step limit cut it, its route and (with
    ``records``) one ``StepRecord`` per step."""

    turns: tuple[Turn, ...]
    steps: int
    reward: float
    truncated: bool
    route: int = -1
    records: tuple[StepRecord, ...] = ()


Budget = Literal["env_steps", "tool_calls"]
"""What a draw's ``steps`` counts: every env step, or the steps whose action is a tool call."""


class PolicyRefresh:
    """``draw(route, k)`` for any ``Policy``: continue the context (``transcript``, env
    ``snapshot``) with ``actions[route]`` forced first, then the policy, under
    ``max_steps`` (the continuation primitive; None: no limit), the context being
    ``depth`` steps from the episode start. A cut trajectory has reward 0.

    Key of the k-th draw of a route: ``mix_seed(seed, "refresh", *key_parts[route], k)``
    (default key parts ``(route,)``), the policy's j-th call within it ``mix_seed(key,
    "call", j)`` (the stream seed of its one row, ``sample_rows``). ``budget`` chooses
    the unit of ``Drawn.steps``; ``records`` keeps one ``StepRecord`` per step (for
    committing the draws as trees).
    """

    def __init__(self, env: Environment, policy: Policy, transcript: Sequence[Turn],
                 snapshot: bytes, actions: Sequence[str | Forced], *, max_steps: int | None,
                 seed: int = 0, config: SamplerConfig | None = None,
                 key_parts: Sequence[tuple[Any, ...]] | None = None,
                 budget: Budget = "env_steps", records: bool = False, depth: int = 0) -> None:
        if budget not in ("env_steps", "tool_calls"):
            raise ValueError(f"budget must be 'env_steps' or 'tool_calls', got {budget!r}")
        if key_parts is not None and len(key_parts) != len(actions):
            raise ValueError(f"key_parts has {len(key_parts)} entries for {len(actions)} "
                             "routes")
        self.env, self.policy, self.snapshot = env, policy, snapshot
        self.transcript = tuple(transcript)
        self.actions = [a if isinstance(a, Forced) else Forced(a) for a in actions]
        self.max_steps, self.seed = max_steps, seed
        self.config = config or SamplerConfig()
        self.key_parts = [tuple(p) for p in key_parts] if key_parts is not None else [
            (r,) for r in range(len(self.actions))]
        self.budget, self.records, self.depth = budget, records, depth

    def __call__(self, route: int, k: int) -> Drawn:
        key = mix_seed(self.seed, "refresh", *self.key_parts[route], k)
        run = Continuing.begin(self.env, self.snapshot, key, self.transcript, self.depth,
                               self.max_steps)
        f = self.actions[route]
        action = (f.text, f.token_ids, f.logprobs, f.entropies, f.segments)
        calls = tools = 0
        steps: list[StepRecord] = []
        while True:
            text = action[0]
            result = run.step(text)
            tool = parse_action(text).kind == "tool_call"
            tools += tool
            if self.records:
                steps.append(StepRecord(text, *action[1:], observation=result.observation,
                                        done=result.done,
                                        reward_parts=dict(result.reward_parts),
                                        snapshot=self.env.snapshot(),
                                        truncated=run.truncated, tool_call=tool))
            if run.over:
                break
            calls += 1
            seed = mix_seed(key, "call", calls) & ((1 << 62) - 1)
            cont = sample_rows(self.policy, [Rows(tuple(run.turns), 1, seed)],
                               self._config(1, seed))[0][0]
            segs = (tuple(action_segments(cont.text, token_char_starts(self.policy, cont)))
                    if self.records else ())
            action = (cont.text, tuple(cont.token_ids), tuple(cont.logprobs),
                      tuple(cont.entropies), segs)
        reward = 0.0 if run.truncated else run.reward
        cost = run.steps if self.budget == "env_steps" else tools
        return Drawn(tuple(run.turns), cost, reward, run.truncated, route, tuple(steps))

    def _config(self, n: int, seed: int) -> SampleConfig:
        c = self.config
        return SampleConfig(n=n, max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                            top_p=c.top_p, seed=seed)


__all__ = ["Budget", "Drawn", "Forced", "PolicyRefresh", "RefreshResult", "RefreshSampler",
           "StepRecord", "Trajectory", "beta_prior", "refresh_protocol"]
