"""Step statistics of one training iteration: what the metrics rows report.

``StepStats`` accumulates over the iteration's PPO epochs: ``add`` once per loss piece
(a micro-batch, or one branch of a split tree), ``step`` once per optimizer step,
``reduce`` once across data-parallel ranks, and ``metrics`` gives the rows. With K the
loss tokens of every rank (``loss_tokens``) and S the optimizer steps of this rank:

* ``loss`` = (1/S) sum over steps of the step's loss (the sum of its pieces' aggregated
  losses, each already normalised by the mini-batch's global denominator);
* ``clip_frac_low`` / ``clip_frac_high`` / ``dual_clip_frac``: tokens whose ratio the
  lower / upper / dual clip bound held (``train.loss.TokenLoss``), over K;
* ``wide_low_frac``: tokens whose lower bound ``mb.clip_low`` is wider than the run's
  ``clip_low`` (ELC E8, CALIPER C8), over K; ``wide_low_clip_frac``: of those, the ones
  clipped at their own bound; ``wide_low_released_frac``: the ones the run's bound would
  have clipped (ratio < 1 - clip_low with a negative advantage) and theirs did not;
* ``kl`` / ``entropy``: token means over K (``kl`` summed per piece as its mean times its
  token count); ``grad_norm``: mean of the pre-clip gradient norms over S;
* ``tokens_per_s``: real tokens through the model (``forward_tokens``, every rank) per
  second of the train phase; ``logprob_diff_max`` (with the logprob check): the largest
  |logp - old_logp| of the first forward of each mini-batch before any update.

``iteration_metrics`` gives the rows about the iteration's trees (reward, success, the
tree layout's savings, tool steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rollout_store.tree import Tree
from train import distributed as dp
from train.batches import MicroBatch, Unit
from train.forward import forward_logprobs
from train.loss import TokenLoss, masked_mean
from train.sequences import TreeSeqs, tree_token_ratio

_SUMS = ("loss", "clip_low", "clip_high", "dual", "kl", "entropy", "tokens", "wide",
         "wide_clip", "wide_released")


@dataclass
class StepStats:
    """Sums of one iteration's training statistics (see the module docstring)."""

    clip_low: float
    """The run's lower clip epsilon: a token's bound wider than this is 'wide'."""
    check_logprobs: bool = False
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_SUMS, 0.0))
    grad_norms: list[float] = field(default_factory=list)
    logprob_diffs: list[float] = field(default_factory=list)
    n_loss_tokens: int = 0
    forward_tokens: int = 0
    logprob_diff_max: float = 0.0
    _step_loss: float = 0.0

    @property
    def stepped(self) -> bool:
        """An optimizer step was taken (the logprobs no longer are the sampler's)."""
        return bool(self.grad_norms)

    def add(self, mb: MicroBatch, out: TokenLoss, loss: torch.Tensor,
            entropy: torch.Tensor) -> None:
        """One loss piece: ``mb`` its micro-batch, ``out`` its per-token loss terms (L,),
        ``loss`` its aggregated scalar loss, ``entropy`` its per-token entropy (L,)."""
        self._step_loss += float(loss.detach())
        k = mb.n_loss_tokens
        self.n_loss_tokens += k
        self.forward_tokens += mb.n_tokens
        s = self.sums
        s["clip_low"] += float(out.clipped_low.sum())
        s["clip_high"] += float(out.clipped_high.sum())
        s["dual"] += float(out.dual_clipped.sum())
        wide = mb.clip_low > self.clip_low + 1e-9
        if bool(wide.any()):
            below_base = (out.ratio < 1.0 - self.clip_low) & (mb.advantage < 0)
            s["wide"] += float(wide.sum())
            s["wide_clip"] += float((out.clipped_low & wide).sum())
            s["wide_released"] += float((below_base & wide & ~out.clipped_low).sum())
        s["kl"] += masked_mean(out.kl, torch.ones_like(out.kl, dtype=torch.bool)) * k
        s["entropy"] += float(entropy.detach().sum())

    def step(self, grad_norm: float) -> None:
        """One optimizer step, with its pre-clip gradient norm (every rank's)."""
        self.grad_norms.append(grad_norm)
        self.sums["loss"] += self._step_loss
        self._step_loss = 0.0

    def reduce(self, world: dp.World) -> None:
        """Sum the counts over data-parallel ranks (the largest logprob difference: max);
        every rank calls it, in the same place of the loop."""
        if self.check_logprobs:
            self.logprob_diff_max = dp.all_max(world, [max(self.logprob_diffs,
                                                           default=0.0)])[0]
        self.sums = dp.reduce_sums(world, self.sums)
        self.n_loss_tokens, self.forward_tokens = (int(v) for v in dp.all_sum(
            world, [self.n_loss_tokens, self.forward_tokens]))

    def metrics(self, seconds_train: float) -> dict[str, float]:
        """The training rows of the iteration's metrics (after ``reduce``)."""
        s, k = self.sums, max(self.n_loss_tokens, 1)
        rows = {"logprob_diff_max": self.logprob_diff_max} if self.check_logprobs else {}
        return rows | {
            "loss": s["loss"] / max(len(self.grad_norms), 1),
            "clip_frac_low": s["clip_low"] / k,
            "clip_frac_high": s["clip_high"] / k,
            "dual_clip_frac": s["dual"] / k,
            "wide_low_frac": s["wide"] / k,
            "wide_low_clip_frac": s["wide_clip"] / max(s["wide"], 1.0),
            "wide_low_released_frac": s["wide_released"] / max(s["wide"], 1.0),
            "kl": s["kl"] / k,
            "entropy": s["entropy"] / k,
            "grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else 0.0,
            "tokens_per_s": self.forward_tokens / max(seconds_train, 1e-9),
            "loss_tokens": float(self.n_loss_tokens),
            "forward_tokens": float(self.forward_tokens),  # real tokens through the model
        }


def iteration_metrics(trees: Sequence[Tree], seqs: Sequence[TreeSeqs],
                      success_threshold: float, extra_tool_steps: float = 0.0
                      ) -> dict[str, float]:
    """Rows about the iteration's fresh ``trees`` and the sequences trained on (``seqs``:
    fresh and stored): mean leaf reward, the share of leaves with reward >=
    ``success_threshold``, the tree layout's token ratio and chain breaks, env steps, and
    new tool steps (the trees' plus ``extra_tool_steps``: refreshed routes, resampled
    trees)."""
    leaves = [n for t in trees for n in t.nodes if n.reward is not None]
    return {
        "reward": float(np.mean([n.reward for n in leaves])) if leaves else 0.0,
        "success": float(np.mean([(n.reward or 0.0) >= success_threshold for n in leaves]))
        if leaves else 0.0,
        "tree_token_ratio": tree_token_ratio(list(seqs)),
        "chain_breaks": float(sum(s.breaks() for s in seqs)),
        "env_steps": float(sum((t.meta or {}).get("env_steps", 0) for t in trees)),
        "new_tool_steps": float(sum(n.tool_calls or 0 for t in trees for n in t.nodes))
        + extra_tool_steps,
    }


def logprob_diffs(model: torch.nn.Module, units: Sequence[Unit]) -> list[float]:
    """The logprob check by a separate no-grad forward (a model with active dropout):
    max |logp - old_logp| of each unit with loss tokens, before any update."""
    with torch.no_grad():
        return [float((forward_logprobs(model, mb)[0] - mb.old_logp).abs().max())
                for mb in units if mb.n_loss_tokens]


def write_scalars(writer: Any, metrics: dict[str, float], it: int) -> None:
    """The iteration's metrics into a TensorBoard ``SummaryWriter`` at step ``it``."""
    for name, value in metrics.items():
        writer.add_scalar(name, value, it)
    writer.flush()


def progress_line(run_id: str, it: int, steps: int, metrics: dict[str, float]) -> str:
    """One line of progress after iteration ``it`` (0-based) of ``steps``."""
    extra = "".join(f" {k.split('_')[1]} {metrics[k]:.3f}" for k in
                    ("heldout_sampled", "heldout_greedy") if k in metrics)
    return (f"[{run_id}] it {it + 1}/{steps} loss {metrics['loss']:+.4f} "
            f"reward {metrics['reward']:.3f} clip {metrics['clip_frac_low']:.3f}/"
            f"{metrics['clip_frac_high']:.3f} ratio {metrics['tree_token_ratio']:.2f} "
            f"{metrics['tokens_per_s']:.0f} tok/s{extra}")


__all__ = ["StepStats", "iteration_metrics", "logprob_diffs", "progress_line", "write_scalars"]
