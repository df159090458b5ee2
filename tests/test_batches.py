"""train.batches: the tree layout equals the paths layout (per-token logprobs and the
gradient), recomputed logprobs equal the stored sampling logprobs, masks and weights."""

from __future__ import annotations

import copy
from collections import defaultdict

import numpy as np
import pytest
import torch

from rollout_store.tree import Tree
from train.batches import (
    NodeCredit,
    SplitTree,
    collate,
    dense_tree_mask,
    make_rows,
    micro_batches,
    node_credit,
    pack_rows,
)
from train.credit import ESTIMATORS
from train.credit.base import from_trees
from train.envs import make_env
from train.forward import forward_logprobs, has_dropout, loss_pieces
from train.loss import aggregate, denominator, token_loss, token_weights
from train.policies import load_policy
from train.policies.hf import HFPolicy
from train.policies.tree_attention import (
    BLOCK,
    TreeAttention,
    dense_allowed,
    tree_attention_forward,
)
from train.sampling import make_sampler
from train.sequences import BatchError, NodeSeq, TreeSeqs, build_sequences, tree_token_ratio


@pytest.fixture(scope="module")
def sampled() -> tuple[HFPolicy, list[Tree]]:
    policy = load_policy("tiny", "calc")
    assert isinstance(policy, HFPolicy)
    env = make_env("calc")
    tasks = type(env).generate_tasks(2, seed=11)
    sampler = make_sampler("random")
    trees = [sampler.sample_tree(env, policy, t, 6, seed=i) for i, t in enumerate(tasks)]
    return policy, trees


def _logprobs(policy: HFPolicy, trees: list[Tree], layout: str, max_tokens: int = 100_000,
              max_row_tokens: int | None = None
              ) -> dict[tuple[int, int, int], list[tuple[float, float]]]:
    arrays = from_trees(trees)
    credit = node_credit(arrays, ESTIMATORS["elpo"](arrays))
    seqs = [build_sequences(t, policy.prompt_ids) for t in trees]
    out: dict[tuple[int, int, int], list[tuple[float, float]]] = defaultdict(list)
    with torch.no_grad():
        rows = make_rows(seqs, credit, layout, max_row_tokens=max_row_tokens)  # type: ignore[arg-type]
        for mb in micro_batches(rows, layout, max_tokens):  # type: ignore[arg-type]
            lp, _ = forward_logprobs(policy.model, mb)
            for key, new, old in zip(mb.keys, lp.tolist(), mb.old_logp.tolist(), strict=True):
                out[key].append((new, old))
    return out


def test_recomputed_logprobs_equal_sampling_logprobs(sampled: tuple[HFPolicy, list[Tree]]
                                                     ) -> None:
    policy, trees = sampled
    for layout in ("paths", "tree"):
        out = _logprobs(policy, trees, layout)
        n_actions = sum(len(n.action_token_ids) for t in trees for n in t.nodes)
        assert len(out) == n_actions  # every agent token carries loss, nothing else does
        worst = max(abs(new - old) for vals in out.values() for new, old in vals)
        assert worst < 1e-4, (layout, worst)


def _break_a_chain(policy: HFPolicy, trees: list[Tree]) -> list[Tree]:
    """A copy where one inner node's action ids are a non-canonical tokenization of its
    text (characters instead of the single boilerplate token): its children's re-rendered
    context no longer extends it."""
    trees = copy.deepcopy(trees)
    tok = policy.tokenizer
    for tree in trees:
        kids = tree.children()
        for node in tree.nodes:
            if node.parent_id is not None and kids[node.node_id] and "<tool_call>" in \
                    node.action_text:
                ids = [int(i) for i in tok.convert_tokens_to_ids(list(node.action_text))]
                node.action_token_ids = ids
                node.action_logprobs = [-1.0] * len(ids)
                node.action_entropies = [0.0] * len(ids)
                node.segments = []
                return trees
    raise AssertionError("no inner tool-call node to break")


@pytest.mark.parametrize(("broken", "row_tokens"), [(False, None), (True, None),
                                                   (False, 48)])
def test_tree_layout_equals_paths_logprobs(sampled: tuple[HFPolicy, list[Tree]],
                                           broken: bool, row_tokens: int | None) -> None:
    policy, trees = sampled
    if broken:
        trees = _break_a_chain(policy, trees)
        assert sum(build_sequences(t, policy.prompt_ids).breaks() for t in trees) >= 1
    tree = _logprobs(policy, trees, "tree", max_row_tokens=row_tokens)
    paths = _logprobs(policy, trees, "paths", max_tokens=300)  # several micro-batches
    assert tree.keys() == paths.keys()
    assert all(len(v) == 1 for v in tree.values())
    assert any(len(v) > 1 for v in paths.values())  # shared prefixes repeat in paths
    worst = max(abs(tree[k][0][0] - p[0]) for k, vals in paths.items() for p in vals)
    assert worst < 1e-5


@pytest.mark.parametrize(("mode", "row_tokens"), [("token-mean", None),
                                                 ("seq-mean-token-mean", 48),
                                                 ("seq-mean-token-sum-norm", None),
                                                 ("action-mean", 48)])
def test_tree_layout_equals_paths_gradient(sampled: tuple[HFPolicy, list[Tree]],
                                           mode: str, row_tokens: int | None) -> None:
    policy, trees = sampled
    # node-level credit (one value per node, whichever trajectory): random, both signs
    rng = np.random.default_rng(0)
    credit = {(t.tree_id, n.node_id): NodeCredit(np.full(len(n.action_token_ids),
                                                         rng.normal()))
              for t in trees for n in t.nodes}
    seqs = [build_sequences(t, policy.prompt_ids) for t in trees]
    model = copy.deepcopy(policy.model).train()
    n_seqs = sum(len(s.leaves) for s in seqs)
    grads = {}
    for layout in ("paths", "tree"):
        rows = make_rows(seqs, credit, layout, max_row_tokens=row_tokens)
        mbs = micro_batches(rows, layout, 400)
        n_tokens = sum(float(mb.traj_count.sum()) for mb in mbs)
        n_actions = sum(float((mb.traj_count / mb.action_len).sum()) for mb in mbs
                        if mb.action_len is not None)
        d = denominator(mode, n_tokens, n_seqs, 64, n_actions)  # type: ignore[arg-type]
        model.zero_grad()
        for piece in (p for unit in mbs for p in loss_pieces(model, unit)):  # the trainer's
            mb, lp = piece.mb, piece.logp
            # a ratio away from 1 so the clip matters: old logprobs shifted per token key
            key = torch.tensor([1000 * b + 37 * i + k for b, i, k in mb.keys])
            old = mb.old_logp + 0.3 * torch.sin(key * 1.7)
            out = token_loss(lp, old, mb.advantage, mb.clip_low, mb.clip_high)
            w = token_weights(mode, mb.traj_count, mb.inv_len_sum,  # type: ignore[arg-type]
                              mb.action_len)
            piece.backward(aggregate(out.loss, torch.ones_like(w, dtype=torch.bool), w, d))
        if row_tokens is not None and layout == "tree":
            assert any(isinstance(u, SplitTree) for u in mbs)  # the split is exercised
        grads[layout] = torch.cat([p.grad.flatten() for p in model.parameters()
                                   if p.grad is not None])
    assert grads["tree"].abs().max() > 1e-4
    torch.testing.assert_close(grads["tree"], grads["paths"], rtol=0, atol=1e-5)


def test_tree_token_ratio_and_weights(sampled: tuple[HFPolicy, list[Tree]]) -> None:
    policy, trees = sampled
    seqs = [build_sequences(t, policy.prompt_ids) for t in trees]
    ratio = tree_token_ratio(seqs)
    assert ratio > 1.0
    arrays = from_trees(trees)
    credit = node_credit(arrays, ESTIMATORS["grpo"](arrays))
    tree_rows = make_rows(seqs, credit, "tree")
    paths_rows = make_rows(seqs, credit, "paths")
    assert sum(len(r.ids) for r in paths_rows) / sum(len(r.ids) for r in tree_rows) == \
        pytest.approx(ratio)
    # trajectory-count weights: sum of c_t over tree tokens = paths loss tokens
    assert sum(sum(r.traj_count) for r in tree_rows) == sum(len(r.cols) for r in paths_rows)
    # s_t sums to the number of trajectories in both layouts
    n_traj = sum(len(s.leaves) for s in seqs)
    assert sum(sum(r.inv_len_sum) for r in tree_rows) == pytest.approx(n_traj)
    assert sum(sum(r.inv_len_sum) for r in paths_rows) == pytest.approx(n_traj)
    split = make_rows(seqs, credit, "tree", max_row_tokens=48)
    assert len(split) > len(trees)  # cut into rows of whole leaf paths
    assert sum(sum(r.traj_count) for r in split) == sum(sum(r.traj_count) for r in tree_rows)
    once = make_rows(seqs, credit, "tree", node_weight="once")
    assert set(np.concatenate([r.traj_count for r in once]).tolist()) == {1.0}
    with pytest.raises(BatchError, match="tree layout"):
        make_rows(seqs, credit, "paths", node_weight="once")
    with pytest.raises(BatchError, match="unknown layout"):
        make_rows(seqs, credit, "flat")  # type: ignore[arg-type]


# --- issue 25: intervals instead of a dense mask -------------------------------------------

def _random_seqs(rng: np.random.Generator, n_nodes: int, tree_id: str) -> TreeSeqs:
    """A random tree's sequences: random parents (preorder), random own lengths, some
    chain breaks (a node that does not extend its parent owns its whole sequence)."""
    nodes: list[NodeSeq] = []
    for i in range(n_nodes):
        parent = -1 if i == 0 else int(rng.integers(0, i))
        # preorder needs a parent that is the previous node or one of its ancestors
        if i > 0:
            anc = [i - 1]
            while nodes[anc[-1]].parent >= 0:
                anc.append(nodes[anc[-1]].parent)
            parent = anc[int(rng.integers(0, len(anc)))]
        breaks = parent >= 0 and rng.random() < 0.2
        base = () if parent < 0 else nodes[parent].full
        own = tuple(int(x) for x in rng.integers(3, 50, int(rng.integers(1, 9))))
        full = own if breaks else (*base, *own)
        own_start = 0 if breaks else len(base)
        nodes.append(NodeSeq(i, full, own_start, own_start, -1 if breaks or parent < 0
                             else parent, parent, (), 1, 1.0))
    kids = {n.parent for n in nodes}
    return TreeSeqs(tree_id, tuple(nodes), tuple(i for i in range(1, n_nodes) if i not in kids))


@pytest.mark.parametrize("seed", range(6))
def test_interval_mask_equals_dense_oracle(seed: int) -> None:
    rng = np.random.default_rng(seed)
    seqs = [_random_seqs(rng, int(rng.integers(2, 25)), f"t{k}") for k in range(4)]
    rows = make_rows(seqs, {}, "tree", max_row_tokens=None if seed % 2 else 200)
    packed = pack_rows(rows, 150)
    assert len(packed) < len(rows)  # some rows hold several trees
    for batch in (rows, packed):
        batch = [r for r in batch if not r.prefix_tin]  # (2) is checked in the next test
        mb = collate(batch, "tree")
        assert mb.tree_tout is not None
        oracle = dense_tree_mask(batch)[:, 0] == 0  # (R, L, L) allowed
        assert torch.equal(dense_allowed(mb.tree_tout), oracle)
        # the BlockMask's blocks cover every allowed pair; its mask_mod is the relation
        dense_blocks = mb.attention_mask.to_dense().bool()  # (R, 1, nQ, nK)
        nq = dense_blocks.shape[2]
        covered = dense_blocks[:, 0].repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
        width = oracle.shape[1]
        assert not (oracle & ~covered[:, :width, :width]).any()
        assert nq == -(-width // BLOCK)


@pytest.mark.parametrize("seed", range(6))
def test_split_tree_rows_cover_the_tree_once(seed: int) -> None:
    """A split tree (``max_row_tokens``): every node's own tokens in exactly one row, the
    row's own relation (1) equal to the dense oracle, and a branch query seeing trunk
    column j by (2) iff j's node is a chain ancestor of the query's node."""
    rng = np.random.default_rng(100 + seed)
    ts = _random_seqs(rng, 40, "t")
    rows = make_rows([ts], {}, "tree", max_row_tokens=40 + 10 * seed)
    trunk = [r for r in rows if r.trunk]
    branches = [r for r in rows if r.prefix_tin]
    assert len(trunk) == 1 and branches and len(rows) == 1 + len(branches)
    seen = sorted((n, p) for r in rows for n, p in zip(r.token_node, r.positions, strict=True))
    assert seen == sorted((i, p) for i, n in enumerate(ts.nodes)
                          for p in range(n.own_start, len(n.full)))
    anc = trunk[0].ancestors
    assert anc is not None
    for row in rows:
        mb = collate([row], "tree")
        assert mb.tree_tout is not None
        assert torch.equal(dense_allowed(mb.tree_tout), dense_tree_mask([row])[:, 0] == 0)
    tn = np.asarray(trunk[0].token_node)
    for row in branches:
        q = np.arange(len(row.ids))[:, None]
        by_spans = (np.asarray(row.prefix_tin)[None, :] <= q) & (
            q < np.asarray(row.prefix_tout)[None, :])
        assert np.array_equal(by_spans, anc[np.asarray(row.token_node)][:, tn])


def test_split_tree_pieces(sampled: tuple[HFPolicy, list[Tree]]) -> None:
    """``loss_pieces`` on a split tree: one forward per branch micro-batch, each smaller
    than the one-row layout, every loss token once, the trunk's piece last; the pieces'
    gradient equals the one-row gradient (within 1e-5; memory is measured by
    ``benchmarks/bench_train_layout.py --split-tokens``)."""
    policy, trees = sampled
    rng = np.random.default_rng(5)
    credit = {(t.tree_id, n.node_id): NodeCredit(rng.normal(size=len(n.action_token_ids)))
              for t in trees for n in t.nodes}
    seqs = [build_sequences(t, policy.prompt_ids) for t in trees[:1]]
    model = copy.deepcopy(policy.model).train()
    grads, keys = {}, {}
    for row_tokens in (None, 48):
        units = micro_batches(make_rows(seqs, credit, "tree", max_row_tokens=row_tokens),
                              "tree", 1)  # one row per micro-batch
        model.zero_grad()
        order, got = [], []
        for unit in units:
            for piece in loss_pieces(model, unit):
                order.append(piece.mb is getattr(unit, "trunk", None))
                got += piece.mb.keys
                piece.backward((piece.logp * piece.mb.advantage).sum())
        grads[row_tokens] = torch.cat([p.grad.flatten() for p in model.parameters()
                                       if p.grad is not None])
        keys[row_tokens] = sorted(got)
        if row_tokens is not None:
            (unit,) = units
            assert isinstance(unit, SplitTree) and len(unit.branches) >= 2
            assert order == [False] * len(unit.branches) + [True]  # the trunk's piece last
            assert max(b.n_tokens for b in unit.branches) < seqs[0].tree_tokens()
            assert unit.n_tokens == seqs[0].tree_tokens()  # no token forwarded twice
    assert keys[None] == keys[48] and len(set(keys[48])) == len(keys[48])
    assert grads[None].abs().max() > 1e-4
    torch.testing.assert_close(grads[48], grads[None], rtol=0, atol=1e-5)


def test_block_sparse_attention_equals_dense_and_flex() -> None:
    from torch.nn.attention.flex_attention import flex_attention
    rng = np.random.default_rng(3)
    seqs = [_random_seqs(rng, 40, f"t{k}") for k in range(3)]
    rows = pack_rows(make_rows(seqs, {}, "tree"), 400)
    mb = collate(rows, "tree")
    assert mb.tree_tout is not None
    n, length = mb.tree_tout.shape
    assert length > 2 * BLOCK  # several query blocks
    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, 4, length, 8, generator=g, requires_grad=True)
    k = torch.randn(n, 2, length, 8, generator=g, requires_grad=True)  # GQA: 2 kv heads
    v = torch.randn(n, 2, length, 8, generator=g, requires_grad=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
        attn_mask=dense_tree_mask(rows))
    got, _ = tree_attention_forward(torch.nn.Module(), q, k, v, mb.attention_mask,
                                    tree_attention=TreeAttention.of(mb.tree_tout))
    torch.testing.assert_close(got.transpose(1, 2), ref, rtol=0, atol=1e-5)
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    with torch.no_grad():  # FlexAttention with the BlockMask (eager; no CPU backward)
        flex = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=mb.attention_mask,
                              enable_gqa=True)
    assert isinstance(flex, torch.Tensor)
    torch.testing.assert_close(flex, ref.detach(), rtol=0, atol=1e-5)


def _qwen2_model(vocab: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).float()


def test_hf_qwen2_tree_equals_paths(sampled: tuple[HFPolicy, list[Tree]]) -> None:
    """A transformers Qwen2 (random weights, GQA) through its attention hook: the tree
    layout's logprobs and gradients equal those of paths within 1e-5."""
    policy, trees = sampled
    model = _qwen2_model(len(policy.tokenizer)).train()
    rng = np.random.default_rng(1)
    credit = {(t.tree_id, n.node_id): NodeCredit(np.full(len(n.action_token_ids),
                                                         rng.normal()))
              for t in trees for n in t.nodes}
    seqs = [build_sequences(t, policy.prompt_ids) for t in trees]
    logps, grads = {}, {}
    for layout, variant in (("paths", ""), ("tree", ""), ("tree", "+packed"),
                            ("tree", "+split")):
        rows = make_rows(seqs, credit, layout,  # type: ignore[arg-type]
                         max_row_tokens=48 if variant == "+split" else None)
        if variant == "+packed":
            rows = pack_rows(rows, 10_000)
            assert len(rows) == 1 < len(trees)
        model.zero_grad()
        got: dict[tuple[int, int, int], float] = {}
        units = micro_batches(rows, layout, 400)  # type: ignore[arg-type]
        assert any(isinstance(u, SplitTree) for u in units) == (variant == "+split")
        for piece in (p for unit in units for p in loss_pieces(model, unit)):
            mb, lp = piece.mb, piece.logp
            got.update(zip(mb.keys, lp.tolist(), strict=True))
            out = token_loss(lp, mb.old_logp, mb.advantage, mb.clip_low, mb.clip_high)
            w = token_weights("token-mean", mb.traj_count, mb.inv_len_sum)
            piece.backward(aggregate(out.loss, torch.ones_like(w, dtype=torch.bool), w, 100.0))
        name = f"{layout}{variant}"
        logps[name] = got
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()
                                 if p.grad is not None])
    assert model.config._attn_implementation == "sdpa"  # type: ignore[union-attr]  # restored
    for name in ("tree", "tree+packed", "tree+split"):
        assert logps[name].keys() == logps["paths"].keys()
        worst = max(abs(logps[name][k] - v) for k, v in logps["paths"].items())
        assert worst < 1e-5, (name, worst)
        assert grads[name].abs().max() > 1e-4
        torch.testing.assert_close(grads[name], grads["paths"], rtol=0, atol=1e-5)


def test_has_dropout_tells_when_the_training_forward_is_random() -> None:
    """The trainer checks the sampling logprobs on its first training forward only for a
    model whose training mode draws nothing (``has_dropout`` False); else it keeps a
    separate no-grad forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}
    assert not has_dropout(LlamaForCausalLM(LlamaConfig(**small)))
    assert has_dropout(LlamaForCausalLM(LlamaConfig(**small, attention_dropout=0.1)))
    assert has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2)))
    assert not has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
