"""Token batches for the loss step, in two layouts (issue 11; METHODS.md G4, E6-E7 note).

The node sequences they are laid out from (what a node's tokens are, which it shares
with its parent: ``build_sequences``) are ``train.sequences``.

Layouts (``make_rows``):

* ``paths``: every root-to-leaf trajectory as one row ``S_leaf`` (one row per chain
  piece where a chain breaks), right-padded, causal attention: the verl/TRL baseline;
* ``tree``: one row per tree, each node's own tokens once, in a DFS order of the chain
  forest (preorder when no chain breaks), token i attending token j iff j <= i and j's
  node is i's node or a chain ancestor of it, and position ids = the token's index in
  its node's full sequence ``S_v`` (its depth), so a shared prefix is forwarded and
  back-propagated once. The relation is kept as intervals, never as an (L, L) mask:
  ``Row.tout[j]`` is the end column of j's node's chain subtree and i sees j iff
  ``j <= i < tout[j]`` (``train.policies.tree_attention``; ``dense_tree_mask`` is the
  test oracle). ``pack_rows`` packs several trees' rows into one row.

Loss tokens are the action tokens only (prompt, observation, template and padding
tokens never carry loss). Each carries its stored sampling logprob (``old_logp``),
advantage, clip bounds and the two aggregation weights of ``train.loss``:
``traj_count`` c_t and ``inv_len_sum`` s_t. In ``tree`` with ``node_weight=
"trajectories"`` a token's c_t is the number of trajectories through its node and s_t
the sum of 1/n_i over them (n_i = agent tokens of trajectory i), which makes the loss
and its gradient equal those of ``paths``; ``node_weight="once"`` trains each node
once (c_t = 1, s_t = the mean of 1/n_i over its trajectories: METHODS E7 note).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from train.credit.base import Credit, TreeArrays
from train.policies.tree_attention import block_mask
from train.sequences import BatchError, TreeSeqs, _piece_ends

Layout = Literal["paths", "tree"]
LAYOUTS: tuple[Layout, ...] = ("paths", "tree")
NodeWeight = Literal["trajectories", "once"]
NODE_WEIGHTS: tuple[NodeWeight, ...] = ("trajectories", "once")

ProxLogp = dict[tuple[str, int], np.ndarray]
"""(tree id, node id) -> log pi_prox of the node's action tokens (stored trees, G8)."""


@dataclass(frozen=True)
class NodeCredit:
    """Per-action-token advantage and optional clip epsilons of one node, each (len A_v,)."""

    advantage: np.ndarray
    clip_low: np.ndarray | None = None
    clip_high: np.ndarray | None = None


def node_credit(arrays: TreeArrays, credit: Credit) -> dict[tuple[str, int], NodeCredit]:
    """``Credit`` (token arrays in ``TreeArrays`` order) as per-node action-token arrays,
    keyed by (tree id, node id). Agent tokens are each node's first tokens there."""
    out: dict[tuple[str, int], NodeCredit] = {}
    a_len = np.bincount(arrays.token_node[arrays.agent_mask], minlength=arrays.n_nodes)
    for v in range(arrays.n_nodes):
        lo = int(arrays.token_offsets[v])
        hi = lo + int(a_len[v])
        key = (arrays.tree_ids[int(arrays.node_tree[v])], int(arrays.node_ids[v]))
        out[key] = NodeCredit(
            advantage=np.asarray(credit.token[lo:hi], np.float64),
            clip_low=None if credit.clip_low is None else np.asarray(credit.clip_low[lo:hi]),
            clip_high=None if credit.clip_high is None else np.asarray(credit.clip_high[lo:hi]))
    return out


def rows_credit(rows: pa.Table) -> dict[tuple[str, int], NodeCredit]:
    """``credits`` rows (``schema.CREDITS``) as per-node action-token credit, keyed by
    (tree id, node id): ``token_values`` the advantages, ``clip_low`` / ``clip_high`` the
    per-token epsilons where a row records them (an empty or null list: none, the run's
    epsilons apply). The trainer trains on what it commits, fresh or read back."""
    out: dict[tuple[str, int], NodeCredit] = {}
    cols = [rows.column(c).to_pylist() for c in
            ("tree_id", "node_id", "token_values", "clip_low", "clip_high")]
    for tid, nid, vals, low, high in zip(*cols, strict=True):
        adv = np.asarray(vals or [], np.float64)
        out[(tid, int(nid))] = NodeCredit(
            adv, np.asarray(low, np.float64) if low and len(low) == adv.size else None,
            np.asarray(high, np.float64) if high and len(high) == adv.size else None)
    return out


@dataclass
class Row:
    """One sequence of a layout with its loss tokens (``cols`` predict ``targets``)."""

    tree: int  # index of the tree in the batch
    ids: list[int]
    positions: list[int]
    token_node: list[int]  # node index of each token (for the tree mask)
    cols: list[int]  # column whose output predicts each loss token
    targets: list[int]
    old_logp: list[float]
    advantage: list[float]
    clip_low: list[float]
    clip_high: list[float]
    traj_count: list[float]
    inv_len_sum: list[float]
    keys: list[tuple[int, int, int]]  # (tree, node index, k-th action token)
    ancestors: np.ndarray | None = None  # (n_nodes, n_nodes) bool, tree layout only
    tout: list[int] = field(default_factory=list)  # tree layout: j visible to i iff j<=i<tout[j]
    behav_logp: list[float] = field(default_factory=list)  # log mu (G8); = old_logp if fresh
    action_len: list[float] = field(default_factory=list)  # L_t: tokens of t's action (F6)
    stored: list[bool] = field(default_factory=list)  # the node is in ``prox`` (G8)
    staleness: list[float] = field(default_factory=list)  # versions behind (stored, P1)
    # split trees (``SplitTree``): the group, whether this is its trunk, and per trunk
    # column j the span [prefix_tin[j], prefix_tout[j]) of this branch row's columns that
    # see j (relation (2) of ``train.policies.tree_attention``)
    split: int = -1
    trunk: bool = False
    prefix_tin: list[int] = field(default_factory=list)
    prefix_tout: list[int] = field(default_factory=list)


def make_rows(seqs: Sequence[TreeSeqs], credit: dict[tuple[str, int], NodeCredit],
              layout: Layout, node_weight: NodeWeight = "trajectories",
              clip_low: float = 0.2, clip_high: float = 0.2,
              max_row_tokens: int | None = None, prox: ProxLogp | None = None,
              staleness: Mapping[str, int] | None = None) -> list[Row]:
    """Rows of ``layout`` for every tree (tree order kept; ``paths``: trajectories in leaf
    order). ``clip_low`` / ``clip_high`` apply where the credit sets no bounds.
    ``max_row_tokens`` (tree layout) splits a larger tree into a trunk row and branch
    rows that attend the trunk's keys (``SplitTree``): no token is forwarded twice.
    ``prox`` (stored trees, G8): a node found there trains against ``old_logp`` = its
    log pi_prox, with ``behav_logp`` = the stored log mu, and its tokens are ``stored``;
    elsewhere both are log mu. ``staleness``: tree id -> versions behind (default 0)."""
    if layout not in LAYOUTS:
        raise BatchError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    if node_weight not in NODE_WEIGHTS:
        raise BatchError(f"unknown node_weight {node_weight!r}; choose from {NODE_WEIGHTS}")
    if layout == "paths" and node_weight != "trajectories":
        raise BatchError("node_weight 'once' needs the tree layout (paths repeats prefixes)")
    rows: list[Row] = []
    for b, ts in enumerate(seqs):
        if layout == "tree":
            rows.extend(_tree_rows(b, ts, credit, node_weight, clip_low, clip_high,
                                   max_row_tokens, prox, split=b))
        else:
            for leaf in ts.leaves:
                inv = 1.0 / max(sum(len(ts.nodes[i].old_logp) for i in _path(ts, leaf)), 1)
                for end in _piece_ends(ts, leaf):
                    rows.append(_path_row(b, ts, end, inv, credit, clip_low, clip_high, prox))
    for row in rows:
        s = float((staleness or {}).get(seqs[row.tree].tree_id, 0))
        row.staleness = [s] * len(row.cols)
    return rows


def _path(ts: TreeSeqs, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = ts.nodes[i].parent
    return out[::-1]


def _empty_row(b: int) -> Row:
    return Row(b, [], [], [], [], [], [], [], [], [], [], [], [])


def _add_actions(row: Row, b: int, ts: TreeSeqs, i: int, col_of: Callable[[int], int],
                 credit: dict[tuple[str, int], NodeCredit], count: float, inv: float,
                 clip_low: float, clip_high: float, prox: ProxLogp | None = None) -> None:
    node = ts.nodes[i]
    n_act = len(node.old_logp)
    if n_act == 0:
        return
    nc = credit.get((ts.tree_id, node.node_id))
    if nc is None:
        raise BatchError(f"tree {ts.tree_id!r} node {node.node_id} has no credit")
    if nc.advantage.shape != (n_act,):
        raise BatchError(f"tree {ts.tree_id!r} node {node.node_id}: credit for "
                         f"{nc.advantage.shape[0]} tokens, the node has {n_act}")
    old = node.old_logp
    stored = prox is not None and (ts.tree_id, node.node_id) in prox
    if prox is not None and stored:
        old = tuple(float(x) for x in prox[(ts.tree_id, node.node_id)])
        if len(old) != n_act:
            raise BatchError(f"tree {ts.tree_id!r} node {node.node_id}: {len(old)} pi_prox "
                             f"logprobs for {n_act} action tokens")
    for k in range(n_act):
        q = node.action_start + k
        row.cols.append(col_of(q - 1))
        row.targets.append(node.full[q])
        row.old_logp.append(old[k])
        row.behav_logp.append(node.old_logp[k])
        row.advantage.append(float(nc.advantage[k]))
        row.clip_low.append(clip_low if nc.clip_low is None else float(nc.clip_low[k]))
        row.clip_high.append(clip_high if nc.clip_high is None else float(nc.clip_high[k]))
        row.traj_count.append(count)
        row.inv_len_sum.append(inv)
        row.action_len.append(float(n_act))
        row.stored.append(stored)
        row.keys.append((b, i, k))


def _path_row(b: int, ts: TreeSeqs, end: int, inv: float,
              credit: dict[tuple[str, int], NodeCredit], clip_low: float,
              clip_high: float, prox: ProxLogp | None = None) -> Row:
    full = ts.nodes[end].full
    row = _empty_row(b)
    row.ids = list(full)
    row.positions = list(range(len(full)))
    row.token_node = [end] * len(full)
    for i in ts.chain(end):
        _add_actions(row, b, ts, i, lambda q: q, credit, 1.0, inv, clip_low, clip_high, prox)
    return row


def _tree_rows(b: int, ts: TreeSeqs, credit: dict[tuple[str, int], NodeCredit],
               node_weight: NodeWeight, clip_low: float, clip_high: float,
               max_row_tokens: int | None, prox: ProxLogp | None = None,
               split: int = -1) -> list[Row]:
    """The tree as one row, or, past ``max_row_tokens``, split (``SplitTree``): the
    *trunk* is every node whose subtree holds more than ``max_row_tokens`` tree tokens
    (with the root; closed towards the root), each remaining subtree hangs off a trunk
    node and fits a row; subtrees are grouped greedily, in the order of their
    attachment points, into *branch* rows of at most ``max_row_tokens`` tokens. Every
    token is forwarded once (the trunk once for all its branches) and every loss token
    counts once, in the row whose column predicts it: the first action token of a
    branch node that directly extends a trunk node is predicted from the trunk's last
    column there, so it belongs to the trunk row."""
    everything = set(range(len(ts.nodes)))
    if max_row_tokens is None or ts.tree_tokens() <= max_row_tokens:
        row, _ = _tree_row(b, ts, everything, credit, node_weight, clip_low, clip_high, prox)
        return [row]
    size = [len(n.full) - n.own_start for n in ts.nodes]
    count = [1] * len(ts.nodes)  # nodes in each subtree: nodes[i:i + count[i]] (preorder)
    for i in range(len(ts.nodes) - 1, 0, -1):  # preorder: a child after its parent
        if ts.nodes[i].parent >= 0:
            size[ts.nodes[i].parent] += size[i]
            count[ts.nodes[i].parent] += count[i]
    trunk_nodes = {0} | {i for i in everything if size[i] > max_row_tokens}
    trunk, place = _tree_row(b, ts, trunk_nodes, credit, node_weight, clip_low, clip_high,
                             prox)
    trunk.split, trunk.trunk = split, True

    def attach(i: int) -> int:  # DFS index of the trunk node i's chain extends, or -1
        cp = ts.nodes[i].chain_parent
        return place.dfs[cp] if cp in trunk_nodes else -1

    tops = sorted((i for i in everything - trunk_nodes if ts.nodes[i].parent in trunk_nodes),
                  key=lambda i: (attach(i), i))
    members: list[set[int]] = []
    used = 0  # tree tokens of the row being filled
    for top in tops:
        sub = set(range(top, top + count[top]))
        if members and used + size[top] <= max_row_tokens:
            members[-1] |= sub
            used += size[top]
        else:
            members.append(sub)
            used = size[top]
    rows = [trunk]
    for group in members:
        row, bplace = _tree_row(b, ts, group, credit, node_weight, clip_low, clip_high,
                                prox, top_key=lambda i: (attach(i), i), spill=(trunk, place))
        row.split = split
        # (2): trunk column j (node u) is seen by this row's branch tops whose chain
        # attaches inside u's chain subtree, a contiguous run of tops
        span: dict[int, tuple[int, int]] = {}
        for u in trunk_nodes:
            lo, hi = place.dfs[u], place.dfs_end[u]
            seen = [t for t in bplace.tops if lo <= attach(t) < hi]
            if seen:
                span[u] = (bplace.start[seen[0]], bplace.end[seen[-1]])
        for u in trunk.token_node:
            a, z = span.get(u, (0, 0))
            row.prefix_tin.append(a)
            row.prefix_tout.append(z)
        rows.append(row)
    return rows


@dataclass
class _Placement:
    """Where ``_tree_row`` put each node: DFS index (and end of its chain subtree in DFS
    indices), first column and end column of its chain subtree, the chain tops in order,
    and the packed column of position q of ``S_i`` (``col``)."""

    dfs: dict[int, int]
    dfs_end: dict[int, int]
    start: dict[int, int]
    end: dict[int, int]
    tops: list[int]
    col: Callable[[int, int], int | None]


def _tree_row(b: int, ts: TreeSeqs, members: set[int],
              credit: dict[tuple[str, int], NodeCredit], node_weight: NodeWeight,
              clip_low: float, clip_high: float, prox: ProxLogp | None = None,
              top_key: Callable[[int], Any] | None = None,
              spill: tuple[Row, _Placement] | None = None) -> tuple[Row, _Placement]:
    """``members`` as one row in a DFS order of their chain forest (chain tops in
    ``top_key`` order, preorder by default), with every member's action tokens; a
    loss token predicted from a column outside the row (a split tree's trunk) goes to
    ``spill``'s row at its column there."""
    row = _empty_row(b)
    packed_start: dict[int, int] = {}
    chain_kids: dict[int, list[int]] = {i: [] for i in members}
    tops: list[int] = []
    for i in sorted(members):  # preorder
        cp = ts.nodes[i].chain_parent
        (chain_kids[cp] if cp in members else tops).append(i)
    if top_key is not None:
        tops.sort(key=top_key)
    subtree_end: dict[int, int] = {}
    dfs: dict[int, int] = {}
    dfs_end: dict[int, int] = {}
    order: list[int] = []

    def place(i: int) -> None:  # DFS of the chain forest: a chain subtree is contiguous
        node = ts.nodes[i]
        dfs[i] = len(order)
        order.append(i)
        packed_start[i] = len(row.ids)
        own = node.full[node.own_start:]
        row.ids.extend(own)
        row.positions.extend(range(node.own_start, len(node.full)))
        row.token_node.extend([i] * len(own))
        for kid in chain_kids[i]:
            place(kid)
        subtree_end[i] = len(row.ids)
        dfs_end[i] = len(order)

    for top in tops:
        place(top)
    for i in order:
        n_own = len(ts.nodes[i].full) - ts.nodes[i].own_start
        row.tout.extend([subtree_end[i]] * n_own)

    def col(i: int, q: int) -> int | None:  # packed column of position q of S_i
        j = i
        while q < ts.nodes[j].own_start:
            j = ts.nodes[j].chain_parent
            if j not in members:
                return None
        return packed_start[j] + q - ts.nodes[j].own_start

    placement = _Placement(dfs, dfs_end, packed_start, subtree_end, tops, col)
    for i in sorted(members):
        node = ts.nodes[i]
        if node_weight == "trajectories":
            count, inv = float(node.n_leaves), node.inv_len_sum
        else:
            count, inv = 1.0, node.inv_len_sum / max(node.n_leaves, 1)
        if spill is None:  # members closed towards the root: every column is here
            def inside(q: int, i: int = i) -> int:
                c = col(i, q)
                assert c is not None
                return c
            _add_actions(row, b, ts, i, inside, credit, count, inv, clip_low, clip_high,
                         prox)
            continue
        # a split tree's branch row: tokens whose predicting column is in the trunk
        # (the first action token of a node extending a trunk node) go to the trunk row
        mine = _empty_row(b)
        _add_actions(mine, b, ts, i, lambda q: q, credit, count, inv, clip_low, clip_high,
                     prox)
        trunk_row, trunk_place = spill
        for t in range(len(mine.cols)):
            here = col(i, mine.cols[t])
            if here is not None:
                _move_token(mine, t, row, here)
                continue
            cp = node.chain_parent  # only a chain top's first token reaches the trunk
            there = trunk_place.col(cp, mine.cols[t]) if cp in trunk_place.dfs else None
            if there is None:
                raise BatchError(f"tree {ts.tree_id!r} node {node.node_id}: a loss token's "
                                 "context is in neither its row nor the trunk")
            _move_token(mine, t, trunk_row, there)
    anc = np.zeros((len(ts.nodes), len(ts.nodes)), bool)
    for i, node in enumerate(ts.nodes):
        if node.chain_parent >= 0:
            anc[i] = anc[node.chain_parent]
        anc[i, i] = True
    row.ancestors = anc
    return row, placement


_TOKEN_FIELDS = ("targets", "old_logp", "advantage", "clip_low", "clip_high", "traj_count",
                 "inv_len_sum", "keys", "behav_logp", "action_len", "stored")


def _move_token(src: Row, t: int, dst: Row, col: int) -> None:
    """Loss token ``t`` of ``src`` appended to ``dst`` at column ``col``."""
    dst.cols.append(col)
    for name in _TOKEN_FIELDS:
        getattr(dst, name).append(getattr(src, name)[t])


@dataclass
class MicroBatch:
    """Rows collated for one forward pass. ``(R, L)`` token tensors; ``(K,)`` loss tokens."""

    input_ids: torch.Tensor  # (R, L) long, right padded
    position_ids: torch.Tensor  # (R, L) long
    attention_mask: Any  # (R, L) long padding mask (paths) or a FlexAttention BlockMask (tree)
    loss_row: torch.Tensor  # (K,) long
    loss_col: torch.Tensor  # (K,) long
    targets: torch.Tensor  # (K,) long
    old_logp: torch.Tensor  # (K,) float32: log pi_old (fresh) or log pi_prox (stored, G8)
    behav_logp: torch.Tensor  # (K,) float32: log mu, the stored sampling logprobs
    advantage: torch.Tensor  # (K,)
    clip_low: torch.Tensor  # (K,)
    clip_high: torch.Tensor  # (K,)
    traj_count: torch.Tensor  # (K,)
    inv_len_sum: torch.Tensor  # (K,)
    keys: list[tuple[int, int, int]]
    n_tokens: int  # real (non-padding) tokens forwarded
    action_len: torch.Tensor | None = None  # (K,) L_t: tokens of the token's action (F6)
    stored: torch.Tensor | None = None  # (K,) bool: a stored tree's token (G8)
    staleness: torch.Tensor | None = None  # (K,) float32: its versions behind (P1)
    tree_tout: torch.Tensor | None = None  # (R, L) long, tree layout: the intervals of (1)
    prefix_tin: torch.Tensor | None = None  # (R, P) long: branch rows of a SplitTree, (2)
    prefix_tout: torch.Tensor | None = None  # (R, P) long

    @property
    def n_loss_tokens(self) -> int:
        return int(self.targets.numel())


@dataclass
class SplitTree:
    """One tree too long for a row (``make_rows``' ``max_row_tokens``): its ``trunk``
    (one row, (1, P)) forwarded once, and ``branches``, micro-batches of branch rows
    whose queries also attend the trunk's keys and values (relation (2) of
    ``train.policies.tree_attention``). ``pieces`` is the order in which
    ``loss_pieces`` and ``forward_logprobs`` return their loss tokens (the trunk last:
    its backward pass carries its branches' gradients into its keys and values)."""

    trunk: MicroBatch
    branches: list[MicroBatch]

    @property
    def pieces(self) -> list[MicroBatch]:
        return [*self.branches, self.trunk]

    def cat(self, name: str) -> torch.Tensor:
        """A (K,) loss-token field of every piece, in ``pieces`` order."""
        return torch.cat([getattr(p, name) for p in self.pieces])

    @property
    def n_loss_tokens(self) -> int:
        return sum(p.n_loss_tokens for p in self.pieces)

    @property
    def n_tokens(self) -> int:
        return sum(p.n_tokens for p in self.pieces)

    @property
    def keys(self) -> list[tuple[int, int, int]]:
        return [k for p in self.pieces for k in p.keys]

    # the (K,) loss-token fields of MicroBatch, over every piece
    old_logp = property(lambda self: self.cat("old_logp"))
    behav_logp = property(lambda self: self.cat("behav_logp"))
    targets = property(lambda self: self.cat("targets"))
    advantage = property(lambda self: self.cat("advantage"))
    clip_low = property(lambda self: self.cat("clip_low"))
    clip_high = property(lambda self: self.cat("clip_high"))
    traj_count = property(lambda self: self.cat("traj_count"))
    inv_len_sum = property(lambda self: self.cat("inv_len_sum"))
    action_len = property(lambda self: self.cat("action_len"))
    stored = property(lambda self: self.cat("stored"))
    staleness = property(lambda self: self.cat("staleness"))


Unit = MicroBatch | SplitTree
"""What ``micro_batches`` returns: a micro-batch, or a split tree's pieces."""


def collate(rows: Sequence[Row], layout: Layout, pad_id: int = 0,
            dtype: torch.dtype = torch.float32) -> MicroBatch:
    """Pad ``rows`` to one ``MicroBatch`` (tree layout: the intervals ``tree_tout`` and
    their FlexAttention ``BlockMask``, module docstring; no (L, L) tensor is built)."""
    width = max(len(r.ids) for r in rows)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    pad = torch.zeros((n, width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row.ids)] = torch.tensor(row.ids, dtype=torch.long)
        pos[r, :len(row.ids)] = torch.tensor(row.positions, dtype=torch.long)
        pad[r, :len(row.ids)] = 1
    tout: torch.Tensor | None = None
    mask: Any = pad
    pre_in = pre_out = None
    if layout == "tree":
        tout = torch.arange(1, width + 1).repeat(n, 1)  # padding sees itself only
        for r, row in enumerate(rows):
            if len(row.tout) != len(row.ids):
                raise BatchError(f"tree-layout row {r} has no intervals (tout)")
            tout[r, :len(row.tout)] = torch.tensor(row.tout, dtype=torch.long)
        mask = block_mask(tout)
        if rows[0].prefix_tin:  # branch rows of one split tree: one trunk, one P
            if len({len(r.prefix_tin) for r in rows}) != 1 or any(not r.prefix_tin
                                                                   for r in rows):
                raise BatchError("branch rows of different trunks in one micro-batch")
            pre_in = torch.tensor([r.prefix_tin for r in rows], dtype=torch.long)
            pre_out = torch.tensor([r.prefix_tout for r in rows], dtype=torch.long)
    cat = np.concatenate

    def f(name: str) -> torch.Tensor:
        return torch.tensor(cat([np.asarray(getattr(r, name), np.float64) for r in rows]),
                            dtype=torch.float32)

    return MicroBatch(
        input_ids=ids, position_ids=pos, attention_mask=mask,
        loss_row=torch.tensor(cat([[r] * len(row.cols) for r, row in enumerate(rows)]),
                              dtype=torch.long),
        loss_col=torch.tensor(cat([row.cols for row in rows]), dtype=torch.long),
        targets=torch.tensor(cat([row.targets for row in rows]), dtype=torch.long),
        old_logp=f("old_logp"), behav_logp=f("behav_logp"), advantage=f("advantage"),
        clip_low=f("clip_low"), clip_high=f("clip_high"), traj_count=f("traj_count"),
        inv_len_sum=f("inv_len_sum"),
        keys=[k for row in rows for k in row.keys], n_tokens=int(pad.sum()),
        action_len=f("action_len"),
        stored=torch.tensor(cat([np.asarray(row.stored, bool) for row in rows]), dtype=torch.bool),
        staleness=f("staleness"), tree_tout=tout, prefix_tin=pre_in, prefix_tout=pre_out)


def dense_tree_mask(rows: Sequence[Row], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tree layout's additive (R, 1, L, L) mask from the node ancestor matrices (the
    pre-issue-25 construction): the test oracle of the intervals, never used to train."""
    width = max(len(r.ids) for r in rows)
    allowed = np.zeros((len(rows), width, width), bool)
    for r, row in enumerate(rows):
        assert row.ancestors is not None
        tn = np.asarray(row.token_node)
        m = row.ancestors[tn][:, tn] & np.tril(np.ones((len(tn), len(tn)), bool))
        allowed[r, :len(tn), :len(tn)] = m
        allowed[r, len(tn):, :] = np.eye(width, dtype=bool)[len(tn):]  # padding: itself
    mask = torch.zeros((len(rows), 1, width, width), dtype=dtype)
    mask.masked_fill_(~torch.from_numpy(allowed)[:, None], torch.finfo(dtype).min)
    return mask


def pack_rows(rows: Sequence[Row], max_tokens: int) -> list[Row]:
    """Tree-layout rows concatenated greedily (in order) into rows of at most
    ``max_tokens`` tokens (a longer row stays alone): each part keeps its own intervals,
    shifted, so no token attends across parts. ``Row.tree`` of a packed row is its first
    part's; ``keys`` keep each token's own tree; ``ancestors`` becomes block diagonal."""
    out: list[Row] = []
    for row in rows:
        if len(row.tout) != len(row.ids):
            raise BatchError("pack_rows needs tree-layout rows")
        last = out[-1] if out else None
        if row.split >= 0 and (row.trunk or row.prefix_tin):  # a split tree stays apart
            out.append(copy.deepcopy(row))
            continue
        if (last is None or len(last.ids) + len(row.ids) > max_tokens
                or (last.split >= 0 and (last.trunk or last.prefix_tin))):
            out.append(copy.deepcopy(row))
            continue
        shift, n_nodes = len(last.ids), 0 if last.ancestors is None else len(last.ancestors)
        last.ids += row.ids
        last.positions += row.positions
        last.token_node += [t + n_nodes for t in row.token_node]
        last.tout += [t + shift for t in row.tout]
        last.cols += [c + shift for c in row.cols]
        for name in ("targets", "old_logp", "advantage", "clip_low", "clip_high",
                     "traj_count", "inv_len_sum", "keys", "behav_logp", "action_len",
                     "stored", "staleness"):
            getattr(last, name).extend(getattr(row, name))
        if last.ancestors is not None and row.ancestors is not None:
            a, b = last.ancestors, row.ancestors
            anc = np.zeros((len(a) + len(b),) * 2, bool)
            anc[:len(a), :len(a)], anc[len(a):, len(a):] = a, b
            last.ancestors = anc
    return out


def micro_batches(rows: Sequence[Row], layout: Layout, max_tokens: int, pad_id: int = 0,
                  dtype: torch.dtype = torch.float32, max_padding: float = 0.25
                  ) -> list[Unit]:
    """Rows sorted by length (stable), cut so that rows * longest row <= ``max_tokens``
    and padding stays under ``max_padding`` of a micro-batch (at least one row each),
    collated; a split tree's rows (``make_rows``' ``max_row_tokens``) become one
    ``SplitTree`` whose branch rows are cut the same way. The order of rows does not
    change the loss: ``aggregate``'s denominators are global."""
    whole = [r for r in rows if not (r.trunk or r.prefix_tin)]
    out: list[Unit] = list(_cut(whole, layout, max_tokens, pad_id, dtype, max_padding))
    for row in rows:
        if row.trunk:
            branches = [r for r in rows if r.prefix_tin and r.split == row.split
                        and r.tree == row.tree]
            out.append(SplitTree(collate([row], layout, pad_id, dtype),
                                 _cut(branches, layout, max_tokens, pad_id, dtype,
                                      max_padding)))
    return out


def _cut(rows: Sequence[Row], layout: Layout, max_tokens: int, pad_id: int,
         dtype: torch.dtype, max_padding: float) -> list[MicroBatch]:
    out: list[MicroBatch] = []
    chunk: list[Row] = []
    width = real = 0
    for row in sorted(rows, key=lambda r: len(r.ids)):
        w = max(width, len(row.ids))
        padded = w * (len(chunk) + 1)
        if chunk and (padded > max_tokens or padded - real - len(row.ids) >
                      max_padding * padded):
            out.append(collate(chunk, layout, pad_id, dtype))
            chunk, w, real = [], len(row.ids), 0
        chunk.append(row)
        width = w
        real += len(row.ids)
    if chunk:
        out.append(collate(chunk, layout, pad_id, dtype))
    return out


__all__ = ["LAYOUTS", "NODE_WEIGHTS", "Layout", "MicroBatch", "NodeCredit", "NodeWeight",
           "ProxLogp", "Row", "SplitTree", "Unit", "collate", "dense_tree_mask", "make_rows",
           "micro_batches", "node_credit", "pack_rows"]
