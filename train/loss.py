"""The policy loss in three separate steps (docs/METHODS.md G2-G8, E8-E9).

1. ``token_loss``: per-token clipped surrogate with per-token clip bounds, optional
   dual clip, optional KL penalty to a frozen reference policy and optional entropy
   bonus. Returns the per-token loss ``(B, L)`` to *minimise* and per-token diagnostics.
2. ``token_weights``: how much each loss token counts under an aggregation mode
   (``token-mean`` | ``seq-mean-token-mean`` | ``seq-mean-token-sum-norm``, G4;
   ``action-mean``, FACTOR's F6).
3. ``aggregate``: ``sum(weight * loss) / denominator`` with a denominator counted over
   the WHOLE mini-batch before it is cut into micro-batches, so gradient accumulation
   over any split gives the same update as one big batch.

Every aggregation is written as a per-token weight and a global denominator, which is
what lets the ``tree`` layout (train.batches: a shared prefix token is stored once but
belongs to several trajectories) give exactly the ``paths`` layout's loss:

=========================  ===============================  ==========================
mode                       weight of agent token t          denominator
=========================  ===============================  ==========================
token-mean                 c_t                              sum_t m_t c_t  (all tokens)
seq-mean-token-mean        s_t = sum_{i ni t} 1 / n_i       number of trajectories
seq-mean-token-sum-norm    c_t                              trajectories * norm_length
action-mean                c_t / L_t                        sum_t m_t c_t / L_t
=========================  ===============================  ==========================

``c_t`` is the number of trajectories through t's node (1 in the ``paths`` layout),
``n_i`` the number of agent tokens of trajectory i and ``L_t`` the number of tokens of
t's action (its node's agent tokens). ``action-mean`` (F6) averages each action's tokens,
sums over actions and divides by the number of (trajectory, action) pairs,
``sum_i T_i``: the denominator ``sum_t m_t c_t / L_t`` counts each action once per
trajectory through it. In the paths layout these are
exactly verl's ``agg_loss`` modes (token-mean = masked mean; seq-mean-token-mean = mean
over sequences of the per-sequence masked mean; seq-mean-token-sum-norm = mean over
sequences of the masked sum divided by a constant) and TRL's ``dapo`` / ``grpo`` /
``dr_grpo`` loss types; tests/test_loss.py writes those formulas out and compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                      "action-mean"]
AGGREGATIONS: tuple[Aggregation, ...] = ("token-mean", "seq-mean-token-mean",
                                         "seq-mean-token-sum-norm", "action-mean")
ISMode = Literal["truncate", "mask"]
IS_MODES: tuple[ISMode, ...] = ("truncate", "mask")
KLEstimator = Literal["k1", "k3"]
KL_ESTIMATORS: tuple[KLEstimator, ...] = ("k1", "k3")

LOG_RATIO_CLAMP = 20.0  # |log rho| <= 20 before exp (verl clamps the same way)
KL_CLAMP = 10.0  # k3 clamped to [-10, 10] (verl "low_var_kl")


@dataclass(frozen=True)
class TokenLoss:
    """Per-token outputs of ``token_loss``, each ``(B, L)``.

    ``loss`` is what to minimise (``-surrogate + kl_coef * kl - entropy_coef * entropy``);
    ``clipped_low`` / ``clipped_high`` mark tokens whose gradient the clip removed
    (A < 0 and rho < 1 - eps_lo; A > 0 and rho > 1 + eps_hi); ``dual_clipped`` marks
    A < 0 tokens bounded by ``-c * A``; ``ratio`` and ``kl`` are detached.
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    dual_clipped: torch.Tensor
    kl: torch.Tensor


def elc_clip_low(eps_low: float, eps_elc: float, critical_suffix: torch.Tensor) -> torch.Tensor:
    """(E8) per-token lower clip epsilon: ``eps_low + eps_elc`` where ``critical_suffix``
    (bool, any shape) is True, ``eps_low`` elsewhere."""
    return torch.where(critical_suffix, eps_low + eps_elc, eps_low).to(torch.float32)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator
               ) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate from sampled tokens (shapes kept).

    k1 = log pi_theta - log pi_ref; k3 = exp(log pi_ref - log pi_theta)
    - (log pi_ref - log pi_theta) - 1 (unbiased, non-negative), clamped to
    [-KL_CLAMP, KL_CLAMP].
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.exp(d) - d - 1.0).clamp(-KL_CLAMP, KL_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}; choose from {KL_ESTIMATORS}")


def behaviour_weight(prox_logp: torch.Tensor, behav_logp: torch.Tensor, cap: float = 2.0,
                     mode: ISMode = "truncate") -> tuple[torch.Tensor, torch.Tensor]:
    """(G8) the decoupled behaviour weight w_t = pi_prox / mu per token, a constant.

    ``prox_logp`` (any shape) = log pi_prox (this iteration's pre-update weights),
    ``behav_logp`` (same shape) = log mu (the stored sampling logprobs); the log-ratio is
    clamped to +-20. ``truncate``: w = min(w, cap); ``mask``: w = 0 where w > cap.
    Returns (w, over) with ``over`` True where w exceeded the cap. On fresh tokens
    pi_prox = mu, so w = exp(0) = 1 exactly.
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown is_mode {mode!r}; choose from {IS_MODES}")
    if not cap >= 1.0:
        raise ValueError(f"the behaviour-weight cap must be >= 1, got {cap}")
    w = torch.exp((prox_logp - behav_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).detach()
    over = w > cap
    if mode == "truncate":
        return torch.clamp(w, max=cap), over
    return torch.where(over, torch.zeros_like(w), w), over


def token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
               clip_low: torch.Tensor | float, clip_high: torch.Tensor | float, *,
               dual_clip: float | None = 3.0, ref_logp: torch.Tensor | None = None,
               kl_coef: float = 0.0, kl_estimator: KLEstimator = "k3",
               entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
               weight: torch.Tensor | None = None) -> TokenLoss:
    """Per-token loss of the clipped surrogate (G2, G3 with per-token bounds E8-E9).

    All tensors ``(B, L)`` (or any common shape): ``logp`` = log pi_theta(o_t | .) with
    grad, ``old_logp`` = log pi_old (the weights that sampled, no grad), ``advantages``
    A_t, ``clip_low`` / ``clip_high`` the per-token epsilons (scalars broadcast).

    * (G2) rho_t = exp(logp - old_logp), the log-ratio clamped to +-20;
    * (G3 / E9) l_t = min(rho_t A_t, clip(rho_t, 1 - eps_lo_t, 1 + eps_hi_t) A_t);
    * dual clip (``dual_clip`` = c > 1, negative advantages only): l_t = max(l_t, c A_t),
      i.e. the loss -l_t is at most -c A_t (verl's ``clip_ratio_c``); None turns it off;
    * KL: ``+ kl_coef * kl_penalty(logp, ref_logp)`` when ``kl_coef > 0``;
    * entropy: ``- entropy_coef * entropy`` (``entropy`` the per-token policy entropy,
      with grad) when ``entropy_coef > 0``;
    * (G8) ``weight`` w_t (``behaviour_weight``, no grad): the clipped surrogate (dual
      clip included) is multiplied by w_t; ``old_logp`` is then log pi_prox, so rho_t is
      pi_theta / pi_prox. None: no factor (the on-policy loss, unchanged).

    Returns per-token values; masking and averaging are ``aggregate``'s job.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip c must be > 1 (or None), got {dual_clip}")
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    lo = 1.0 - torch.as_tensor(clip_low, dtype=ratio.dtype)
    hi = 1.0 + torch.as_tensor(clip_high, dtype=ratio.dtype)
    clipped_ratio = torch.minimum(torch.maximum(ratio, lo), hi)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    negative = advantages < 0
    dual = torch.zeros_like(negative)
    if dual_clip is not None:
        floor = dual_clip * advantages
        dual = negative & (surrogate < floor)
        surrogate = torch.where(negative, torch.maximum(surrogate, floor), surrogate)
    if weight is not None:
        surrogate = weight.detach() * surrogate
    loss = -surrogate
    kl = torch.zeros_like(logp)
    if kl_coef > 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (the frozen reference's logprobs)")
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        loss = loss + kl_coef * kl
    if entropy_coef > 0.0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        loss = loss - entropy_coef * entropy
    r = ratio.detach()
    return TokenLoss(loss=loss, ratio=r, clipped_low=negative & (r < lo),
                     clipped_high=(advantages > 0) & (r > hi), dual_clipped=dual,
                     kl=kl.detach())


def token_weights(mode: Aggregation, traj_count: torch.Tensor, inv_len_sum: torch.Tensor,
                  action_len: torch.Tensor | None = None) -> torch.Tensor:
    """(G4, F6) each token's weight in the aggregation ``mode`` (module docstring table).

    ``traj_count`` (B, L): c_t, trajectories counted through the token (0 off the loss
    mask); ``inv_len_sum`` (B, L): s_t = sum over those trajectories of 1 / n_i;
    ``action_len`` (B, L): L_t, the token count of t's action (``action-mean`` only).
    """
    if mode in ("token-mean", "seq-mean-token-sum-norm"):
        return traj_count
    if mode == "seq-mean-token-mean":
        return inv_len_sum
    if mode == "action-mean":
        if action_len is None:
            raise ValueError("aggregation 'action-mean' needs each token's action length")
        return traj_count / action_len.clamp(min=1.0)
    raise ValueError(f"unknown aggregation {mode!r}; choose from {AGGREGATIONS}")


def denominator(mode: Aggregation, n_tokens: float, n_seqs: float, norm_length: float,
                n_actions: float = 0.0) -> float:
    """(G4, F6) the global normaliser of ``mode``: ``n_tokens`` (sum of c_t over the whole
    mini-batch), ``n_seqs`` (its trajectories), ``n_seqs * norm_length`` or ``n_actions``
    (``sum_t c_t / L_t``: its (trajectory, action) pairs)."""
    if mode == "token-mean":
        value = n_tokens
    elif mode == "seq-mean-token-mean":
        value = n_seqs
    elif mode == "seq-mean-token-sum-norm":
        value = n_seqs * norm_length
    elif mode == "action-mean":
        value = n_actions
    else:
        raise ValueError(f"unknown aggregation {mode!r}; choose from {AGGREGATIONS}")
    return max(float(value), 1.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor,
              denom: float) -> torch.Tensor:
    """sum_t mask_t * weights_t * per_token_t / denom: a scalar (shapes (B, L)).

    ``denom`` comes from ``denominator`` over the whole mini-batch, so summing this
    over micro-batches equals the value on the undivided mini-batch.
    """
    w = weights * mask.to(weights.dtype)
    return (per_token * w).sum() / denom


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Plain mean of ``values`` where ``mask`` (for logging)."""
    m = mask.to(torch.float64)
    n = float(m.sum())
    return float((values.to(torch.float64) * m).sum()) / n if n else 0.0


__all__ = ["AGGREGATIONS", "IS_MODES", "KL_ESTIMATORS", "Aggregation", "ISMode", "KLEstimator",
           "TokenLoss", "aggregate", "behaviour_weight", "denominator", "elc_clip_low",
           "kl_penalty", "masked_mean", "token_loss", "token_weights"]
