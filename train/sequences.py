"""Token sequences of a tree's nodes (issue 11; METHODS.md G4): what each node's tokens
are, which of them it shares with its parent, and its trajectory weights; the token
batches of the loss step (``train.batches``) are laid out from them.

What a node's tokens are. A step node v was sampled by the policy continuing the
transcript of v's parent: the policy rendered it to the context ids
``C_v = policy.prompt_ids(transcript through parent)`` (template and role tokens
included) and generated the action ids ``A_v`` (``Node.action_token_ids``, the
sampled ids, never a retokenization). Its full sequence is ``S_v = C_v + A_v``; the
root's is ``S_root = C`` of its children (the rendered prompt). ``build_sequences``
computes these for every node.

Sharing. v *extends* its parent p when ``S_p`` is a prefix of ``C_v`` (the template
re-rendered the earlier turns to the same ids); then v owns the tokens
``S_v[len(S_p):]`` (the observation's rendering, role tokens, then its action) and
attends to its ancestors' tokens. When a re-rendering differs (a retokenized action,
a template that drops earlier reasoning: verl #3960), v starts a new chain and owns
all of ``S_v``: the sequence is always exactly what the policy conditioned on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollout_store.tree import Tree
from train.policies.base import Turn

PromptIds = Callable[[Sequence[Turn]], list[int]]


class BatchError(ValueError):
    """Trees that cannot be turned into token batches (a policy without ``prompt_ids``,
    stored action tokens that disagree with their logprobs, ...)."""


@dataclass(frozen=True)
class NodeSeq:
    """One node's sequence facts (positions index ``S_v``)."""

    node_id: int
    full: tuple[int, ...]  # S_v = C_v + A_v
    own_start: int  # v owns S_v[own_start:]
    action_start: int  # len(C_v): A_v = S_v[action_start:]
    chain_parent: int  # index (in TreeSeqs.nodes) of the node v extends, -1 when none
    parent: int  # index of the tree parent, -1 at the root
    old_logp: tuple[float, ...]  # stored sampling logprobs of A_v
    n_leaves: int  # trajectories through v
    inv_len_sum: float  # sum over those trajectories of 1 / n_i


@dataclass(frozen=True)
class TreeSeqs:
    """A tree's nodes in preorder with their sequences (``build_sequences``)."""

    tree_id: str
    nodes: tuple[NodeSeq, ...]
    leaves: tuple[int, ...]  # indices of the leaves

    def chain(self, i: int) -> list[int]:
        """Indices from the top of i's chain down to i."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.nodes[i].chain_parent
        return out[::-1]

    def paths_tokens(self) -> int:
        """Tokens of the ``paths`` layout (every trajectory's rows)."""
        return sum(len(self.nodes[end].full) for leaf in self.leaves
                   for end in _piece_ends(self, leaf))

    def tree_tokens(self) -> int:
        """Tokens of the ``tree`` layout (each node's own tokens once)."""
        return sum(len(n.full) - n.own_start for n in self.nodes)

    def breaks(self) -> int:
        """Step nodes that could not extend their parent (re-rendering differed)."""
        return sum(1 for n in self.nodes if n.parent >= 0 and n.chain_parent < 0)


def build_sequences(tree: Tree, prompt_ids: PromptIds) -> TreeSeqs:
    """Sequences, sharing and trajectory weights of every node (module docstring)."""
    order = list(tree.preorder())
    index = {n.node_id: i for i, n in enumerate(order)}
    turns = tree.transcripts()
    kids: dict[int, list[int]] = {i: [] for i in range(len(order))}
    for i, n in enumerate(order):
        if n.parent_id is not None:
            kids[index[n.parent_id]].append(i)
    # trajectory lengths n_i (agent tokens on the root-to-leaf path) and leaf sets
    path_tokens = [0] * len(order)
    for i, n in enumerate(order):
        p = -1 if n.parent_id is None else index[n.parent_id]
        path_tokens[i] = len(n.action_token_ids) + (path_tokens[p] if p >= 0 else 0)
    leaves = [i for i in range(len(order)) if not kids[i] and order[i].parent_id is not None]
    n_leaves = [0] * len(order)
    inv_sum = [0.0] * len(order)
    for leaf in leaves:
        inv = 1.0 / max(path_tokens[leaf], 1)
        j: int | None = leaf
        while j is not None:
            n_leaves[j] += 1
            inv_sum[j] += inv
            pid = order[j].parent_id
            j = None if pid is None else index[pid]
    context_cache: dict[int, list[int]] = {}
    seqs: list[NodeSeq] = []
    for i, n in enumerate(order):
        if n.parent_id is None:
            first_kid = kids[i][0] if kids[i] else None
            full = prompt_ids(turns[n.node_id]) if first_kid is not None else []
            context_cache[i] = full
            seqs.append(NodeSeq(n.node_id, tuple(full), 0, len(full), -1, -1, (),
                                n_leaves[i], inv_sum[i]))
            continue
        p = index[n.parent_id]
        ctx = context_cache[p] if order[p].parent_id is None else prompt_ids(turns[n.parent_id])
        if len(n.action_logprobs) != len(n.action_token_ids):
            raise BatchError(f"tree {tree.tree_id!r} node {n.node_id}: "
                             f"{len(n.action_token_ids)} action tokens but "
                             f"{len(n.action_logprobs)} logprobs")
        parent_full = seqs[p].full
        extends = len(parent_full) <= len(ctx) and tuple(ctx[:len(parent_full)]) == parent_full
        seqs.append(NodeSeq(n.node_id, (*ctx, *n.action_token_ids),
                            len(parent_full) if extends else 0, len(ctx), p if extends else -1,
                            p, tuple(n.action_logprobs), n_leaves[i], inv_sum[i]))
    return TreeSeqs(tree.tree_id, tuple(seqs), tuple(leaves))


def _piece_ends(ts: TreeSeqs, leaf: int) -> list[int]:
    """The last node of each chain piece on the path to ``leaf`` (leaf first)."""
    ends = []
    i = leaf
    while i >= 0:
        ends.append(i)
        top = ts.chain(i)[0]
        i = ts.nodes[top].parent
    return ends


def tree_token_ratio(seqs: Sequence[TreeSeqs]) -> float:
    """paths tokens / tree tokens of a batch (>= 1; the FLOP bound of the tree layout)."""
    tree = sum(t.tree_tokens() for t in seqs)
    return sum(t.paths_tokens() for t in seqs) / max(tree, 1)


__all__ = ["BatchError", "NodeSeq", "PromptIds", "TreeSeqs", "build_sequences",
           "tree_token_ratio"]
