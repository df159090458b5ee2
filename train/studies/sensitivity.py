"""Exact branch sensitivity, credit drift and policy KL on ``workflow`` tasks (DSC-Gate D1-D2).

METHODS.md section 5. For an old (behaviour) tabular policy mu and a new one pi
on one ``WorkflowModel``, every quantity here is an exact finite sum over the
task's states (no sampling):

* (D1) B(s, h) = sum_u [pi(u|s,h) - mu(u|s,h)] * Q_mu(s, h, u): the first-order
  change of V at s when the policy changes at s only. A workflow ``State``
  carries its step count t, so h = horizon - t is part of the state.
* (D2) G(a, b) = sum_{s,h} [d_{mu,a}(s,h) - d_{mu,b}(s,h)] * B(s,h), where
  d_{mu,x} is the occupancy (expected visits) of the states after taking x in
  the decision state and following mu. Each state holds its step count, so a
  state is visited at most once and d is a visit probability.
  G is computed by one backward pass instead of one forward occupancy pass per
  action: W_B(s) = B(s) + sum_u mu(u|s) sum_o P(o|s,u) W_B(s_o) (0 at terminal
  states), and sum_{s'} d_{mu,x}(s') B(s') = Q^B(s, x) = sum_o P(o|s,x) W_B(s_o).
* Credit of action a over b in state s (the quantity whose drift DSC-Gate
  studies): c(a, b) = Q(s, a) - Q(s, b); drift Delta c = c_pi - c_mu. The
  performance-difference lemma gives Delta c = sum_s [d_{pi,a} - d_{pi,b}] B(s)
  exactly, so G (occupancies of mu, not pi) is its first-order term.
* KL [R] (METHODS names "global KL" and "pairwise KL" without defining them):
  per state KL_s = KL(mu(.|s) || pi(.|s)) over the valid actions. The global KL
  of an update is E_{tau ~ mu}[sum_t KL_{S_t}] from the task's initial state,
  which by the chain rule equals the KL divergence KL(P_mu || P_pi) between
  the two policies' trajectory distributions (the transition terms cancel).
  The pairwise KL of (a, b) in s is the same sum over the states after a plus
  the states after b: K(a) + K(b), K(x) = sum_{s'} d_{mu,x}(s') KL_{s'}.

Transport estimates G: E_mu[sum_t z_t R | root action x] = sum_{s'} d_{mu,x}(s') B(s')
(METHODS D3-D4, E_mu[z_t Q_mu(S_t, A_t) | S_t] = B(S_t)), so the DSC correction
delta = c_T - c_R (D5) is an unbiased Monte Carlo estimate of G(a, b); the
tests check exactly that through the real environment.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import combinations

from train.envs.workflow_model import ObsKey, PolicyValues, State, WorkflowModel
from train.envs.workflow_policy import TabularPolicy


def state_kl(mu: TabularPolicy, pi: TabularPolicy, state: State | ObsKey) -> float:
    """KL(mu(.|s) || pi(.|s)) over the valid actions of a non-terminal state (nats)."""
    p, q = mu.probs(state), pi.probs(state)
    return sum(pm * math.log(pm / qm) for pm, qm in zip(p, q, strict=True) if pm > 0.0)


class MarkovSum:
    """W(s) = r(s) + sum_u mu(u|s) sum_o P(o|s,u) W(s_o), W = 0 at terminal states.

    The expected sum of a per-state quantity ``r`` over the non-terminal states
    a trajectory of ``policy`` visits from s (s included); ``q(s, x)`` is the
    same sum over the states after action x in s (s excluded). Memoized.
    """

    def __init__(self, model: WorkflowModel, policy: TabularPolicy,
                 r: Callable[[State], float]) -> None:
        self.model = model
        self.policy = policy
        self.r = r
        self._w: dict[State, float] = {}

    def v(self, s: State) -> float:
        found = self._w.get(s)
        if found is None:
            if self.model.is_terminal(s):
                found = 0.0
            else:
                tools = self.model.valid_tools(s)
                probs = self.policy.probs(s)
                found = self.r(s) + sum(p * self.q(s, tool)
                                        for p, tool in zip(probs, tools, strict=True) if p)
            self._w[s] = found
        return found

    def q(self, s: State, action: str) -> float:
        return sum(tr.probability * self.v(tr.state)
                   for tr in self.model.transitions(s, action))


class UpdateAnalysis:
    """Exact credit drift, branch sensitivity (D1-D2) and KL of one update mu -> pi.

    ``mu`` and ``pi`` must be policies of the same ``model``; they are frozen
    copies, so later updates to the arguments do not leak in.
    """

    def __init__(self, model: WorkflowModel, mu: TabularPolicy, pi: TabularPolicy) -> None:
        if mu.model is not model or pi.model is not model:
            raise ValueError("mu and pi must be tabular policies of this model")
        self.model = model
        self.mu = mu.copy()
        self.pi = pi.copy()
        self.values_mu: PolicyValues = self.mu.values()
        self.values_pi: PolicyValues = self.pi.values()
        self._shift = MarkovSum(model, self.mu, self.advantage_shift)
        self._kl = MarkovSum(model, self.mu, lambda s: state_kl(self.mu, self.pi, s))

    # ----- D1 / D2 ----------------------------------------------------------------------

    def advantage_shift(self, s: State) -> float:
        """(D1) B(s, h) = sum_u [pi(u|s) - mu(u|s)] Q_mu(s, u)."""
        q = self.values_mu
        return sum((p_pi - p_mu) * q.q(s, tool) for p_pi, p_mu, tool in zip(
            self.pi.probs(s), self.mu.probs(s), self.model.valid_tools(s), strict=True))

    def shift_after(self, s: State, action: str) -> float:
        """sum_{s'} d_{mu,action}(s') B(s'): the first-order change of Q(s, action)."""
        return self._shift.q(s, action)

    def branch_sensitivity(self, s: State, a: str, b: str) -> float:
        """(D2) G(a, b) in decision state ``s`` (exact)."""
        return self._shift.q(s, a) - self._shift.q(s, b)

    # ----- credit -----------------------------------------------------------------------

    def credit_old(self, s: State, a: str, b: str) -> float:
        """c_mu(a, b) = Q_mu(s, a) - Q_mu(s, b)."""
        return self.values_mu.q(s, a) - self.values_mu.q(s, b)

    def credit_new(self, s: State, a: str, b: str) -> float:
        """c_pi(a, b) = Q_pi(s, a) - Q_pi(s, b)."""
        return self.values_pi.q(s, a) - self.values_pi.q(s, b)

    # ----- KL [R] -----------------------------------------------------------------------

    def global_kl(self, s: State | None = None) -> float:
        """KL(P_mu || P_pi) of the trajectory distributions from ``s`` (default: the
        initial state) = E_mu[sum_t KL(mu(.|S_t) || pi(.|S_t))] (module docstring)."""
        return self._kl.v(self.model.initial_state() if s is None else s)

    def kl_after(self, s: State, action: str) -> float:
        """K(x) = sum_{s'} d_{mu,x}(s') KL_{s'}: the KL of the trajectories after x in s."""
        return self._kl.q(s, action)

    def pairwise_kl(self, s: State, a: str, b: str) -> float:
        """K(a) + K(b) in decision state ``s`` [R]."""
        return self._kl.q(s, a) + self._kl.q(s, b)



def occupancy(model: WorkflowModel, policy: TabularPolicy, start: State | None = None,
              action: str | None = None) -> dict[State, float]:
    """d(s): the probability that a trajectory of ``policy`` from ``start`` (default: the
    initial state; with ``action``, after taking it there, ``start`` then excluded)
    visits s, for every state it can visit, terminal states included.

    One forward pass by step count: every transition uses exactly one step.
    """
    start = model.initial_state() if start is None else start
    if action is None:
        level: dict[State, float] = {start: 1.0}
    else:
        level = {}
        for tr in model.transitions(start, action):
            level[tr.state] = level.get(tr.state, 0.0) + tr.probability
    out: dict[State, float] = {}
    while level:
        nxt: dict[State, float] = {}
        for s, d in level.items():
            out[s] = out.get(s, 0.0) + d
            if model.is_terminal(s):
                continue
            for p, tool in zip(policy.probs(s), model.valid_tools(s), strict=True):
                if p:
                    for tr in model.transitions(s, tool):
                        nxt[tr.state] = nxt.get(tr.state, 0.0) + d * p * tr.probability
        level = nxt
    return out


def decision_states(model: WorkflowModel, start: State | None = None) -> list[State]:
    """Non-terminal states reachable from ``start`` (default: the initial state) that are
    still recoverable (success possible under some policy), sorted. In a dead state every
    action has Q = 0 under every policy, so its credits are identically 0 and say nothing
    about drift."""
    return [s for s in model.reachable_states(None if start is None else [start])
            if not model.is_terminal(s) and model.recoverable(s)]


def action_pairs(model: WorkflowModel, s: State) -> list[tuple[str, str]]:
    """Every unordered pair (a, b) of valid actions of ``s``, in ``TOOLS`` order."""
    return list(combinations(model.valid_actions(s), 2))


__all__ = ["MarkovSum", "UpdateAnalysis", "action_pairs", "decision_states", "occupancy",
           "state_kl"]
