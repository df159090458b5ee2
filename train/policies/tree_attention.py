"""Tree attention without a dense mask (issue 25; the ``tree`` layout of ``train.batches``).

The ancestor relation of a packed row as intervals. Nodes are laid out in a DFS order of
the chain forest (a node, then its chain descendants), so the chain subtree of a node is
one contiguous span of columns. Every token k carries ``tout[k]``, the exclusive end
column of its node's chain subtree, and query q attends key k iff::

    k <= q  and  q < tout[k]                                        (1)

(k's node is q's node or a chain ancestor of it: its start is <= q, and q lies inside its
subtree; ``k <= q`` is the causal order inside a node). Padding columns get
``tout[k] = k + 1`` (they see only themselves, so no row is fully masked). Rows packed with
several trees are just consecutive spans: (1) never crosses a tree's span.

Two consumers of (1):

* ``block_mask``: a FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention``)
  built from the intervals in O((L/B)^2) per row (B = 128): a (q-block, kv-block) pair is
  *empty* when ``k0 > q1 - 1`` or ``max tout <= q0``, *full* when ``k1 - 1 <= q0`` and
  ``min tout >= q1``, partial otherwise; ``mask_mod`` is (1).
* ``tree_attention_forward``: the attention that training runs on CPU, registered as the
  transformers attention implementation ``"rtrees_tree"``. FlexAttention has no CPU
  backward in torch 2.13 (``NotImplementedError: FlexAttention does not support backward
  on CPU``) and eager flex materialises the full (L, L) score matrix. Compiled flex does
  run forward on CPU here (L = 1,024, 4 heads: first call 80 s of inductor compilation,
  then 0.07 s against 6.7 s eager), usable for no-grad logprobs but not for training; so
  training uses a block-sparse SDPA: for each block of 128 queries, exactly the keys that
  (1) lets some query of the block see are gathered (``k < q1`` and ``tout[k] > q0``) and
  ``scaled_dot_product_attention`` runs on that (128, n_sel) block with (1) as its boolean
  mask. Memory and work are O(sum over blocks of 128 * n_sel), linear in the row length
  for trees of bounded depth, never L^2.

Split trees (``train.batches.SplitTree``). A tree too long for one row is forwarded as a
*trunk* row once, then as *branch* rows whose queries also attend the trunk's keys and
values (the trunk forward records them per layer, ``TreeAttention.capture``). Trunk column
j is visible to query q of a branch row iff::

    prefix_tin[j] <= q < prefix_tout[j]                              (2)

(the branch row's columns that lie under j's node; branch subtrees are laid out in the
order of their attachment points, so that span is contiguous). A branch block's keys are
the trunk keys (2) admits, then the row's own keys (1), so each query attends exactly
the keys it attends in the one-row layout.

Keys and values with fewer heads than the queries (GQA) are repeated per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

IMPLEMENTATION = "rtrees_tree"
BLOCK = 128


def mask_mod_of(tout: torch.Tensor) -> Any:
    """FlexAttention ``mask_mod`` of (1) for ``tout`` (R, L)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> torch.Tensor:
        return (k <= q) & (q < tout[b, k])

    return mask_mod


def block_mask(tout: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """The ``BlockMask`` of (1) for ``tout`` (R, L) long, without any (L, L) tensor."""
    n_rows, length = tout.shape
    nb = -(-length // block)
    padded = torch.arange(nb * block).expand(n_rows, -1).clone() + 1  # pad: tout = k + 1
    padded[:, :length] = tout
    blocks = padded.view(n_rows, nb, block)
    kmax, kmin = blocks.max(-1).values, blocks.min(-1).values  # (R, nb)
    start = torch.arange(nb) * block
    last = torch.clamp(start + block, max=length) - 1  # last real column of each block
    # (R, q-block, kv-block)
    nonempty = (start[None, None, :] <= last[None, :, None]) & (kmax[:, None, :] >
                                                               start[None, :, None])
    full = (last[None, None, :] <= start[None, :, None]) & (kmin[:, None, :] >
                                                           last[None, :, None])
    partial = nonempty & ~full

    def indices(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True)
        return sel.sum(-1).to(torch.int32)[:, None], order.to(torch.int32)[:, None]

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod_of(tout), seq_lengths=(length, length))


def dense_allowed(tout: torch.Tensor) -> torch.Tensor:
    """(R, L, L) bool of (1): the reference for tests; never used in training."""
    length = tout.shape[1]
    col = torch.arange(length)
    return (col[None, None, :] <= col[None, :, None]) & (col[None, :, None] <
                                                          tout[:, None, :])


@dataclass(frozen=True)
class _Block:
    row: int
    q0: int
    q1: int
    keys: torch.Tensor  # (n_sel,) long, columns of the row
    allowed: torch.Tensor  # (q1 - q0, n_pre + n_sel) bool: prefix keys first
    pre: torch.Tensor | None = None  # (n_pre,) long, prefix columns (split trees)


def plan(tout: torch.Tensor, block: int = BLOCK, prefix_tin: torch.Tensor | None = None,
         prefix_tout: torch.Tensor | None = None) -> list[_Block]:
    """Per block of ``block`` queries, the keys (1) can reach and the block's mask;
    with a prefix (2), the prefix keys some query of the block sees come first."""
    n_rows, length = tout.shape
    col = torch.arange(length)
    out = []
    for r in range(n_rows):
        t = tout[r]
        for q0 in range(0, length, block):
            q1 = min(q0 + block, length)
            keys = torch.nonzero((col < q1) & (t > q0)).squeeze(1)
            q = col[q0:q1, None]
            allowed = (keys[None, :] <= q) & (q < t[keys][None, :])
            pre = None
            if prefix_tin is not None and prefix_tout is not None:
                lo, hi = prefix_tin[r], prefix_tout[r]
                pre = torch.nonzero((lo < q1) & (hi > q0) & (lo < hi)).squeeze(1)
                allowed = torch.cat([(lo[pre][None, :] <= q) & (q < hi[pre][None, :]),
                                     allowed], dim=1)
            out.append(_Block(r, q0, q1, keys, allowed, pre))
    return out


KV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values, each (1, H_kv, P, D), after the rotary embedding."""


@dataclass
class TreeAttention:
    """What ``tree_attention_forward`` needs of a micro-batch: ``tout`` and its plan
    (computed once per forward, shared by every layer). A split tree's branch rows also
    carry ``prefix``, the trunk's keys and values per layer index, visible to query q of
    row r iff ``prefix_tin[r, j] <= q < prefix_tout[r, j]`` (2); a trunk forward that
    fills ``capture`` records each layer's keys and values for its branches."""

    tout: torch.Tensor  # (R, L) long
    blocks: list[_Block]
    prefix: dict[int, KV] | None = None
    capture: dict[int, KV] | None = None

    @classmethod
    def of(cls, tout: torch.Tensor, device: torch.device | str = "cpu",
           prefix_tin: torch.Tensor | None = None, prefix_tout: torch.Tensor | None = None,
           prefix: dict[int, KV] | None = None, capture: dict[int, KV] | None = None
           ) -> TreeAttention:
        blocks = [_Block(b.row, b.q0, b.q1, b.keys.to(device), b.allowed.to(device),
                         None if b.pre is None else b.pre.to(device))
                  for b in plan(tout, prefix_tin=prefix_tin, prefix_tout=prefix_tout)]
        if (prefix is None) != (prefix_tin is None):
            raise ValueError("a prefix needs its intervals (prefix_tin, prefix_tout) and back")
        return cls(tout.to(device), blocks, prefix, capture)


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                           scaling: float | None = None, **kwargs: Any
                           ) -> tuple[torch.Tensor, None]:
    """Attention implementation ``"rtrees_tree"``: query (R, H, L, D), key/value
    (R, H_kv, L, D) -> (R, L, H, D). With ``tree_attention=TreeAttention`` in the
    kwargs it runs the block-sparse SDPA of (1) (and (2) over a split tree's trunk
    keys); otherwise it is transformers' SDPA."""
    tree: TreeAttention | None = kwargs.pop("tree_attention", None)
    if tree is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    layer = int(getattr(module, "layer_idx", -1))
    if tree.capture is not None:
        tree.capture[layer] = (key, value)
    pre_kv = None if tree.prefix is None else tree.prefix[layer]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        if pre_kv is not None:
            pre_kv = (pre_kv[0].repeat_interleave(groups, dim=1),
                      pre_kv[1].repeat_interleave(groups, dim=1))
    rows: list[list[torch.Tensor]] = [[] for _ in range(query.shape[0])]
    for blk in tree.blocks:
        q = query[blk.row:blk.row + 1, :, blk.q0:blk.q1]  # (1, H, nq, D)
        k = key[blk.row:blk.row + 1, :, blk.keys]  # (1, H, n_sel, D)
        v = value[blk.row:blk.row + 1, :, blk.keys]
        if pre_kv is not None and blk.pre is not None:  # (2): the trunk's keys first
            k = torch.cat([pre_kv[0][:, :, blk.pre], k], dim=2)
            v = torch.cat([pre_kv[1][:, :, blk.pre], v], dim=2)
        rows[blk.row].append(F.scaled_dot_product_attention(
            q, k, v, attn_mask=blk.allowed, dropout_p=dropout if module.training else 0.0,
            scale=scaling))
    out = torch.cat([torch.cat(r, dim=2) for r in rows], dim=0)  # (R, H, L, D)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"rtrees_tree"`` with transformers (idempotent): attention through
    ``tree_attention_forward``, 2D padding masks prepared as for SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    AttentionInterface.register(IMPLEMENTATION, tree_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


__all__ = ["BLOCK", "IMPLEMENTATION", "KV", "TreeAttention", "block_mask", "dense_allowed",
           "mask_mod_of", "plan", "register", "tree_attention_forward"]
