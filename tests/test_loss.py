"""train.loss: hand values of every clip region, ELC, dual clip, masks, aggregations,
micro-batch invariance, and the verl / TRL formulas written out on fixed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from train.loss import (
    aggregate,
    behaviour_weight,
    denominator,
    elc_clip_low,
    kl_penalty,
    token_loss,
    token_weights,
)


def _lp(ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp with grad, old_logp) whose ratio is ``ratio``."""
    old = torch.tensor([-1.0])
    logp = (old + math.log(ratio)).clone().requires_grad_(True)
    return logp, old


@pytest.mark.parametrize(("ratio", "adv", "eps_lo", "eps_hi", "loss", "grad", "lo", "hi"), [
    (1.5, 1.0, 0.2, 0.28, -1.28, 0.0, False, True),     # A > 0 above 1 + eps_hi: clipped
    (1.1, 1.0, 0.2, 0.28, -1.1, -1.1, False, False),    # A > 0 inside: d(-rho A)/dlogp
    (0.5, 1.0, 0.2, 0.28, -0.5, -0.5, False, False),    # A > 0 below: min keeps rho A
    (0.5, -1.0, 0.2, 0.28, 0.8, 0.0, True, False),      # A < 0 below 1 - eps_lo: clipped
    (0.9, -1.0, 0.2, 0.28, 0.9, 0.9, False, False),     # A < 0 inside
    (1.5, -2.0, 0.2, 0.28, 3.0, 3.0, False, False),     # A < 0 above: min keeps rho A
    (0.6, -1.0, 0.315, 0.28, 0.685, 0.0, True, False),  # ELC bound 1 - 0.315 = 0.685
    (0.7, -1.0, 0.315, 0.28, 0.7, 0.7, False, False),   # inside the wider ELC bound
])
def test_clip_regions_hand_values(ratio: float, adv: float, eps_lo: float, eps_hi: float,
                                  loss: float, grad: float, lo: bool, hi: bool) -> None:
    logp, old = _lp(ratio)
    out = token_loss(logp, old, torch.tensor([adv]), eps_lo, eps_hi, dual_clip=None)
    assert out.loss.item() == pytest.approx(loss, abs=1e-6)
    out.loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad.item() == pytest.approx(grad, abs=1e-6)
    assert bool(out.clipped_low.item()) is lo
    assert bool(out.clipped_high.item()) is hi


def test_dual_clip_bounds_negative_advantages_only() -> None:
    logp, old = _lp(4.0)
    out = token_loss(logp, old, torch.tensor([-1.0]), 0.2, 0.2, dual_clip=3.0)
    assert out.loss.item() == pytest.approx(3.0)  # -rho A = 4 capped at -c A = 3
    assert bool(out.dual_clipped.item())
    out.loss.backward()
    assert logp.grad is not None and logp.grad.item() == 0.0
    # below the cap it changes nothing
    logp, old = _lp(2.0)
    out = token_loss(logp, old, torch.tensor([-1.0]), 0.2, 0.2, dual_clip=3.0)
    assert out.loss.item() == pytest.approx(2.0) and not bool(out.dual_clipped.item())
    # positive advantages are never dual-clipped
    logp, old = _lp(4.0)
    out = token_loss(logp, old, torch.tensor([1.0]), 0.2, 0.2, dual_clip=3.0)
    assert out.loss.item() == pytest.approx(-1.2) and not bool(out.dual_clipped.item())
    with pytest.raises(ValueError, match="dual_clip"):
        token_loss(logp, old, torch.tensor([1.0]), 0.2, 0.2, dual_clip=0.5)


def test_elc_clip_low_per_token() -> None:
    suffix = torch.tensor([[False, True, True]])
    assert elc_clip_low(0.2, 0.115, suffix)[0].tolist() == pytest.approx([0.2, 0.315, 0.315])


def test_kl_estimators_hand_values() -> None:
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    d = ref - logp
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx((d.exp() - d - 1).tolist())
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() == 10.0  # clamped
    out = token_loss(logp, logp.detach(), torch.zeros(2), 0.2, 0.2, ref_logp=ref,
                     kl_coef=0.5, kl_estimator="k1")
    assert out.loss.tolist() == pytest.approx([0.25, -0.5])
    with pytest.raises(ValueError, match="ref_logp"):
        token_loss(logp, logp, torch.zeros(2), 0.2, 0.2, kl_coef=0.1)


def test_entropy_bonus_lowers_loss() -> None:
    logp = torch.tensor([-1.0])
    out = token_loss(logp, logp, torch.zeros(1), 0.2, 0.2, entropy=torch.tensor([2.0]),
                     entropy_coef=0.01)
    assert out.loss.item() == pytest.approx(-0.02)


# ----------------------------------------------------------------------------- aggregation

def _batch(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    B, L = 5, 7
    old = -torch.rand(B, L, generator=g) * 2
    logp = old + 0.3 * torch.randn(B, L, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, L).clone()
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[:, 0] = True
    return logp, old, adv, mask


def _paths_weights(mode: str, mask: torch.Tensor) -> torch.Tensor:
    """Paths layout: c_t = 1 and s_t = 1 / n_i on every token of sequence i."""
    n = mask.sum(-1, keepdim=True).clamp(min=1).to(torch.float32)
    return token_weights(mode, torch.ones(mask.shape), (1.0 / n).expand(mask.shape))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_aggregations_hand_values(mode: str) -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    expected = {"token-mean": (1 + 2 + 3 + 4) / 4,
                "seq-mean-token-mean": ((1 + 2 + 3) / 3 + 4 / 1) / 2,
                "seq-mean-token-sum-norm": ((1 + 2 + 3) / 10 + 4 / 10) / 2}[mode]
    d = denominator(mode, float(mask.sum()), 2, 10)  # type: ignore[arg-type]
    got = aggregate(loss, mask, _paths_weights(mode, mask), d)
    assert got.item() == pytest.approx(expected)


def test_masked_tokens_get_no_gradient() -> None:
    logp, old, adv, mask = _batch()
    logp = logp.clone().requires_grad_(True)
    out = token_loss(logp, old, adv, 0.2, 0.28)
    d = denominator("token-mean", float(mask.sum()), 5, 1)
    aggregate(out.loss, mask, _paths_weights("token-mean", mask), d).backward()
    assert logp.grad is not None
    assert (logp.grad[~mask] == 0).all()
    assert (logp.grad[mask & ~out.clipped_low & ~out.clipped_high] != 0).any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_micro_batch_invariance(mode: str) -> None:
    """Accumulating gradients over micro-batches of 2 + 3 rows equals one batch of 5."""
    logp0, old, adv, mask = _batch(1)
    d = denominator(mode, float(mask.sum()), mask.shape[0], 16)  # type: ignore[arg-type]
    w = _paths_weights(mode, mask)

    def grad(splits: list[slice]) -> torch.Tensor:
        logp = logp0.clone().requires_grad_(True)
        for s in splits:
            out = token_loss(logp[s], old[s], adv[s], 0.2, 0.28)
            aggregate(out.loss, mask[s], w[s], d).backward()
        assert logp.grad is not None
        return logp.grad

    torch.testing.assert_close(grad([slice(0, 5)]), grad([slice(0, 2), slice(2, 5)]),
                               rtol=0, atol=1e-7)


# ------------------------------------------------------ verl and TRL, formulas written out

def _verl_vanilla_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                              advantages: torch.Tensor, response_mask: torch.Tensor,
                              cliprange_low: float, cliprange_high: float,
                              clip_ratio_c: float, loss_agg_mode: str,
                              loss_scale_factor: float) -> torch.Tensor:
    """verl core_algos.compute_policy_loss (vanilla) + agg_loss, as their docs write it."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    m = response_mask.float()
    if loss_agg_mode == "token-mean":
        return (pg_losses * m).sum() / m.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        return ((pg_losses * m).sum(-1) / m.sum(-1)).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return ((pg_losses * m).sum(-1) / loss_scale_factor).mean()
    raise AssertionError(loss_agg_mode)


def _trl_grpo_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor,
                   advantages: torch.Tensor, completion_mask: torch.Tensor,
                   epsilon_low: float, epsilon_high: float, loss_type: str,
                   max_completion_length: int, beta: float = 0.0,
                   ref_per_token_logps: torch.Tensor | None = None) -> torch.Tensor:
    """TRL GRPOTrainer._compute_loss as its docs write it (advantages (B,) per sequence)."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if beta != 0.0:
        assert ref_per_token_logps is not None
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps)
                        - (ref_per_token_logps - per_token_logps) - 1)
        per_token_loss = per_token_loss + beta * per_token_kl
    m = completion_mask.float()
    if loss_type == "grpo":
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):  # dapo: over the global batch's active tokens
        return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * m).sum() / (per_token_loss.size(0) * max_completion_length)
    raise AssertionError(loss_type)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_grpo_surrogate_equals_verl(mode: str) -> None:
    logp0, old, adv, mask = _batch(2)
    g = torch.Generator().manual_seed(4)
    logp0 = logp0 + 0.8 * torch.randn(logp0.shape, generator=g)
    adv = torch.randn(adv.shape, generator=g)  # per-token signs: every clip region occurs
    ours_lp, verl_lp = logp0.clone().requires_grad_(True), logp0.clone().requires_grad_(True)
    out = token_loss(ours_lp, old, adv, 0.2, 0.28, dual_clip=3.0)
    assert out.dual_clipped.any() and out.clipped_low.any() and out.clipped_high.any()
    d = denominator(mode, float(mask.sum()), mask.shape[0], 7)  # type: ignore[arg-type]
    ours = aggregate(out.loss, mask, _paths_weights(mode, mask), d)
    ref = _verl_vanilla_policy_loss(verl_lp, old, adv, mask, 0.2, 0.28, 3.0, mode, 7)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours_lp.grad, verl_lp.grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("loss_type", "mode"), [("dapo", "token-mean"),
                                                 ("grpo", "seq-mean-token-mean"),
                                                 ("dr_grpo", "seq-mean-token-sum-norm")])
def test_grpo_surrogate_equals_trl(loss_type: str, mode: str) -> None:
    logp, old, adv, mask = _batch(4)
    ref_lp = old + 0.1
    seq_adv = adv[:, 0]
    out = token_loss(logp, old, adv, 0.2, 0.28, dual_clip=None, ref_logp=ref_lp,
                     kl_coef=0.04, kl_estimator="k3")
    d = denominator(mode, float(mask.sum()), mask.shape[0], 7)  # type: ignore[arg-type]
    ours = aggregate(out.loss, mask, _paths_weights(mode, mask), d)
    ref = _trl_grpo_loss(logp, old, seq_adv, mask, 0.2, 0.28, loss_type, 7, beta=0.04,
                         ref_per_token_logps=ref_lp)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_behaviour_weight_is_one_on_fresh_tokens_and_loss_is_on_policy() -> None:
    """G8: on fresh tokens pi_prox = mu, so w = 1 exactly and the loss (values and
    gradient) equals the on-policy G3 loss bit for bit."""
    torch.manual_seed(0)
    old = torch.randn(2, 5)
    adv = torch.randn(2, 5)
    w, over = behaviour_weight(old, old, cap=2.0)
    assert torch.equal(w, torch.ones_like(w)) and not over.any()
    grads = []
    for weight in (None, w):
        logp = (old + 0.3 * torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
                ).requires_grad_(True)
        out = token_loss(logp, old, adv, 0.2, 0.28, weight=weight)
        out.loss.sum().backward()
        assert logp.grad is not None
        grads.append((out.loss.detach(), logp.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_behaviour_weight_truncate_and_mask_hand_values() -> None:
    """w = pi_prox / mu; truncate: min(w, cap); mask: 0 above the cap; the surrogate is
    scaled by w (r = pi_theta / pi_prox clipped as usual)."""
    mu = torch.log(torch.tensor([0.5, 0.5, 0.5]))
    prox = torch.log(torch.tensor([0.25, 0.75, 0.5 * 3.0 - 1e-9]))
    w, over = behaviour_weight(prox, mu, cap=2.0, mode="truncate")
    assert torch.allclose(w, torch.tensor([0.5, 1.5, 2.0])) and over.tolist() == [
        False, False, True]
    w_mask, _ = behaviour_weight(prox, mu, cap=2.0, mode="mask")
    assert torch.allclose(w_mask, torch.tensor([0.5, 1.5, 0.0]))
    logp, old = _lp(1.1)
    base = token_loss(logp, old, torch.tensor([1.0]), 0.2, 0.28).loss
    scaled = token_loss(logp, old, torch.tensor([1.0]), 0.2, 0.28,
                        weight=torch.tensor([1.5])).loss
    assert float(scaled.detach()) == pytest.approx(1.5 * float(base.detach()))
    with pytest.raises(ValueError, match="is_mode"):
        behaviour_weight(prox, mu, mode="clip")  # type: ignore[arg-type]


# ------------------------------------------------------ FACTOR's action-mean (F6)

def test_action_mean_hand_value() -> None:
    # two trajectories in the paths layout; actions (token spans): traj 0 = [1, 2 | 3],
    # traj 1 = [4 | 5, 6]; F6: sum over actions of the action's token mean / sum_i T_i
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    action_len = torch.tensor([[2.0, 2.0, 1.0], [1.0, 2.0, 2.0]])
    mask = torch.ones_like(loss, dtype=torch.bool)
    w = token_weights("action-mean", torch.ones(loss.shape), torch.ones(loss.shape), action_len)
    n_actions = float((torch.ones(loss.shape) / action_len).sum())
    assert n_actions == pytest.approx(4.0)
    d = denominator("action-mean", 6.0, 2, 1, n_actions)
    expected = ((1 + 2) / 2 + 3 + 4 + (5 + 6) / 2) / 4
    assert aggregate(loss, mask, w, d).item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="action length"):
        token_weights("action-mean", torch.ones(3), torch.ones(3))


def test_action_mean_surrogate_at_ratio_one_is_the_td_credit() -> None:
    """F6: at the behaviour policy (rho = 1), before clipping, each action's inner
    action-mean surrogate (1/L) sum_j C_j equals its TD credit A*, whatever the split."""
    import numpy as np

    from train.credit.factor import allocation_weights

    rng = np.random.default_rng(3)
    lengths = [1, 4, 7, 2]
    a_star = np.array([0.8, -1.3, 0.05, -0.2])
    node_of = np.repeat(np.arange(len(lengths)), lengths)
    w = allocation_weights(node_of, rng.normal(size=node_of.size) * 2, np.sign(a_star),
                           len(lengths), 0.7, 3.0, 1.0)
    c = torch.tensor(w * a_star[node_of], dtype=torch.float64)
    logp = torch.full((node_of.size,), -1.3, dtype=torch.float64, requires_grad=True)
    out = token_loss(logp, logp.detach(), c, 0.2, 0.28, dual_clip=None)
    assert not out.clipped_low.any() and not out.clipped_high.any()
    weights = token_weights("action-mean", torch.ones(node_of.size, dtype=torch.float64),
                            torch.ones(node_of.size, dtype=torch.float64),
                            torch.tensor(np.array(lengths)[node_of], dtype=torch.float64))
    per_action = np.bincount(node_of, weights=(-out.loss * weights).detach().numpy())
    np.testing.assert_allclose(per_action, a_star, rtol=0, atol=1e-12)
    # and the aggregated loss is minus their sum over the number of actions
    d = denominator("action-mean", float(node_of.size), 1, 1, float(len(lengths)))
    total = aggregate(out.loss, torch.ones(node_of.size, dtype=torch.bool), weights, d)
    assert total.item() == pytest.approx(-a_star.sum() / len(lengths), abs=1e-12)
