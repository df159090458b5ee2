"""The model-calling side of the loss step: token batches (``train.batches``) through
the model, to the per-token values ``train.loss`` takes.

* ``forward_logprobs``: log pi(target | prefix) of every loss token, (K,), and
  optionally the entropy (K,) of the next-token distribution there, in one autograd
  graph (a ``SplitTree``'s tokens in ``pieces`` order); the LM head runs at the K loss
  columns only;
* ``loss_pieces``: the same forwards as pieces with their own ``backward`` (a split
  tree's trunk once, each branch's activations freed after its backward);
* ``tree_layout_problem``: whether a model trains in the ``tree`` layout (a two-branch
  probe through the tree attention hook against two plain paths);
* ``has_dropout``: whether a model in training mode is random.

The tree layout runs through the model's own attention code with the ``rtrees_tree``
hook (``train.policies.tree_attention``); the paths layout with its padding mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from train.batches import Layout, MicroBatch, Row, SplitTree, Unit, collate
from train.policies.tree_attention import IMPLEMENTATION, KV, TreeAttention, register


def _forward(model: Any, mb: MicroBatch, with_entropy: bool, entropy_grad: bool,
             prefix: dict[int, KV] | None = None, capture: dict[int, KV] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    device = next(model.parameters()).device
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    if mb.tree_tout is None:
        hidden = base(input_ids=mb.input_ids.to(device),
                      position_ids=mb.position_ids.to(device),
                      attention_mask=mb.attention_mask.to(device),
                      use_cache=False).last_hidden_state  # (R, L, H)
    else:  # through the model's own attention hook: "rtrees_tree" (tree_attention)
        register()
        config = base.config
        saved = config._attn_implementation
        config._attn_implementation = IMPLEMENTATION
        tree = TreeAttention.of(
            mb.tree_tout, device,
            prefix_tin=None if prefix is None else mb.prefix_tin,
            prefix_tout=None if prefix is None else mb.prefix_tout,
            prefix=prefix, capture=capture)
        try:
            hidden = base(input_ids=mb.input_ids.to(device),
                          position_ids=mb.position_ids.to(device),
                          attention_mask=mb.attention_mask.to(device), use_cache=False,
                          tree_attention=tree).last_hidden_state  # (R, L, H)
        finally:
            config._attn_implementation = saved
    picked = hidden[mb.loss_row.to(device), mb.loss_col.to(device)]  # (K, H)
    head = model.get_output_embeddings()
    assert head is not None
    logits = head(picked)  # (K, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32+
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, mb.targets.to(device)[:, None]).squeeze(1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _probe_row(layout: Layout, branch: int) -> Row:
    """A row of the layout probe: prompt tokens (1, 2) then one branch token per path
    (3 or 4), each path predicting 5 after it. ``branch`` -1: the tree row of both."""
    if layout == "tree":
        ids, positions, token_node, tout = [1, 2, 3, 4], [0, 1, 2, 2], [0, 0, 1, 2], \
            [4, 4, 3, 4]
        cols, targets = [1, 1, 2, 3], [3, 4, 5, 5]
    else:
        ids, positions, token_node, tout = [1, 2, 3 + branch], [0, 1, 2], [0, 0, 1], []
        cols, targets = [1, 2], [3 + branch, 5]
    k = len(cols)
    return Row(tree=0, ids=ids, positions=positions, token_node=token_node, cols=cols,
               targets=targets, old_logp=[0.0] * k, advantage=[0.0] * k,
               clip_low=[0.2] * k, clip_high=[0.2] * k, traj_count=[1.0] * k,
               inv_len_sum=[1.0] * k, keys=[(0, 0, i) for i in range(k)], tout=tout,
               behav_logp=[0.0] * k, action_len=[1.0] * k, stored=[False] * k,
               staleness=[0.0] * k)


def tree_layout_problem(model: Any) -> str | None:
    """Why ``model`` cannot train in the tree layout, or None when it can: a two-branch
    probe (4 tokens) through the tree attention hook must run and give the logprobs the
    same tokens give as two plain paths (within 1e-4). A model whose attention code does
    not take the hook's mask (GPT-2's, in transformers 5) either raises or ignores it;
    the trainer then trains in the ``paths`` layout and says so."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            tree, _ = forward_logprobs(model, collate([_probe_row("tree", -1)], "tree"))
            paths = [forward_logprobs(model, collate([_probe_row("paths", b)], "paths"))[0]
                     for b in (0, 1)]
    except Exception as exc:  # the model's attention code refusing the hook's mask
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {text}"
    finally:
        model.train(was_training)
    want = torch.stack([paths[0][0], paths[1][0], paths[0][1], paths[1][1]])
    worst = float((tree.double() - want.double()).abs().max())
    if worst > 1e-4:
        return f"its tree-layout logprobs differ from the paths' by {worst:.2g}"
    return None


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether ``model`` in training mode is random: a ``Dropout`` module with p > 0, or a
    config ``*dropout*`` rate > 0 that its functional attention applies (HF attention
    passes ``attention_dropout`` to SDPA only while training). The trainer checks the
    sampling logprobs on its first training forward only when this is False."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
           for m in model.modules()):
        return True
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    rates: dict[str, Any] = to_dict() if callable(to_dict) else {}
    return any("dropout" in key and isinstance(value, int | float) and value > 0
               for key, value in rates.items())


def forward_logprobs(model: Any, unit: Unit, with_entropy: bool = False,
                     entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(target | prefix) of every loss token, (K,), and optionally the entropy (K,)
    of the next-token distribution there (differentiable only with ``entropy_grad``).
    The LM head runs at the K loss columns only. A ``SplitTree``'s tokens come in
    ``pieces`` order, in one autograd graph (``loss_pieces`` is the pass that frees each
    branch's activations after its backward)."""
    if not isinstance(unit, SplitTree):
        return _forward(model, unit, with_entropy, entropy_grad)
    capture: dict[int, KV] = {}
    t_logp, t_ent = _forward(model, unit.trunk, with_entropy, entropy_grad, capture=capture)
    parts = [_forward(model, mb, with_entropy, entropy_grad, prefix=capture)
             for mb in unit.branches] + [(t_logp, t_ent)]
    ent = [e for _, e in parts if e is not None]
    return (torch.cat([lp for lp, _ in parts]),
            torch.cat(ent) if with_entropy else None)


@dataclass
class Piece:
    """One forward of ``loss_pieces``: the micro-batch whose loss tokens it scored, their
    logprobs (K,), entropies (K,) and reference logprobs (K,) when asked for, and the
    ``backward`` to call on the loss built from them (exactly once)."""

    mb: MicroBatch
    logp: torch.Tensor
    entropy: torch.Tensor | None
    ref: torch.Tensor | None
    backward: Callable[[torch.Tensor], None]


def loss_pieces(model: Any, unit: Unit, with_entropy: bool = False,
                entropy_grad: bool = False, ref_model: Any = None) -> Iterator[Piece]:
    """The loss step's forwards of ``unit``. A micro-batch is one piece. A ``SplitTree``
    forwards its trunk once, keeping its graph and each layer's keys and values K_l, V_l;
    each branch micro-batch then attends detached copies K'_l, V'_l (leaves), and its
    ``backward`` frees the branch's activations, accumulating dL/dK'_l and dL/dV'_l;
    the trunk's piece comes last and its ``backward`` runs once through the trunk with
    its own loss and ``sum over branches of dL/dK'_l`` into K_l (and V_l): the gradient
    of the one-row layout, with peak activations of the trunk plus one branch. A trunk
    without loss tokens yields no piece; its backward runs when the branches are done."""
    def plain(loss: torch.Tensor) -> None:
        loss.backward()

    def ref_of(mb: MicroBatch, prefix: dict[int, KV] | None = None,
               capture: dict[int, KV] | None = None) -> torch.Tensor | None:
        if ref_model is None:
            return None
        with torch.no_grad():
            return _forward(ref_model, mb, False, False, prefix=prefix, capture=capture)[0]

    if not isinstance(unit, SplitTree):
        logp, ent = _forward(model, unit, with_entropy, entropy_grad)
        yield Piece(unit, logp, ent, ref_of(unit), plain)
        return
    grad = torch.is_grad_enabled()
    capture: dict[int, KV] = {}
    ref_capture: dict[int, KV] = {}
    t_logp, t_ent = _forward(model, unit.trunk, with_entropy, entropy_grad, capture=capture)
    t_ref = ref_of(unit.trunk, capture=ref_capture)
    leaves = {layer: (k.detach().requires_grad_(grad), v.detach().requires_grad_(grad))
              for layer, (k, v) in capture.items()}
    for mb in unit.branches:
        logp, ent = _forward(model, mb, with_entropy, entropy_grad, prefix=leaves)
        yield Piece(mb, logp, ent, ref_of(mb, prefix=ref_capture) if ref_model is not None
                    else None, plain)

    def finish(loss: torch.Tensor | None) -> None:
        outs: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if loss is not None and loss.requires_grad:
            outs.append(loss)
            grads.append(None)
        for layer, pair in capture.items():
            for cap, leaf in zip(pair, leaves[layer], strict=True):
                if leaf.grad is not None and cap.requires_grad:
                    outs.append(cap)
                    grads.append(leaf.grad)
        if outs:
            torch.autograd.backward(outs, grads)

    if unit.trunk.n_loss_tokens:
        yield Piece(unit.trunk, t_logp, t_ent, t_ref, finish)
    elif grad:
        finish(None)


__all__ = ["Piece", "forward_logprobs", "has_dropout", "loss_pieces", "tree_layout_problem"]
