"""log pi_prox of stored action tokens (D3, G8): one no-grad forward pass of the current
(pre-update) weights over the stored trees' token layout, no environment step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from train.batches import NodeCredit, ProxLogp, make_rows, micro_batches
from train.forward import forward_logprobs
from train.sequences import TreeSeqs


def score_actions(model: Any, seqs: Sequence[TreeSeqs], layout: Any, micro_tokens: int,
                  pad_id: int, max_row_tokens: int | None = None) -> ProxLogp:
    """log pi_prox of every stored action token under ``model`` (the current, pre-update
    weights): one no-grad forward pass over the trees' token layout, no environment
    step. Returns {(tree id, node id): (len A_v,) float64}."""
    zero = {(ts.tree_id, n.node_id): NodeCredit(np.zeros(len(n.old_logp)))
            for ts in seqs for n in ts.nodes}
    rows = make_rows(seqs, zero, layout, max_row_tokens=max_row_tokens)
    out: dict[tuple[str, int], np.ndarray] = {
        k: np.zeros(len(v.advantage)) for k, v in zero.items()}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for mb in micro_batches(rows, layout, micro_tokens, pad_id=pad_id):
            if not mb.n_loss_tokens:
                continue
            logp = forward_logprobs(model, mb)[0].double().cpu().numpy()
            for (b, i, k), value in zip(mb.keys, logp, strict=True):
                ts = seqs[b]
                out[(ts.tree_id, ts.nodes[i].node_id)][k] = value
    model.train(was_training)
    return out


__all__ = ["score_actions"]
