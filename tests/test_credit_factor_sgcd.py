"""FACTOR (F1-F5) and SGCD (Q2-Q4): hand values, the telescoping property on random trees,
the token-weight rules against a plain loop, the template summariser, and both estimators
on a real store through ``rtrees credit`` (scores under the tiny policy)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from credit_helpers import node, random_trees
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_store.tree import Node, Tree
from train.credit import ESTIMATORS
from train.credit.base import from_trees, node_lists_to_tokens
from train.credit.contrast import TemplateSummariser, contrast_pair, first_difference, reference
from train.credit.factor import (
    HINDSIGHT_LOGPROB,
    STUDENT_LOGPROB,
    FactorParams,
    allocation_weights,
    factor,
)
from train.credit.grpo import GrpoParams, grpo
from train.credit.sgcd import CONTRAST_LOGPROB, SgcdParams, sgcd

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _tree() -> Tree:
    # root -> 1 -> {2 (R=1), 3 (R=0)};  root -> 4 -> 5 (R=0)
    return Tree("a", [node(0, None, 0, 2), node(1, 0, 2, 1), node(2, 1, 3, 0, reward=1.0),
                      node(3, 1, 2, 0, reward=0.0), node(4, 0, 2, 1),
                      node(5, 4, 1, 0, reward=0.0)], task_id="x")


def test_factor_hand_values() -> None:
    batch = from_trees([_tree()])
    got = factor(batch, FactorParams(eta=0.0, std="none"))
    # z = R - mean = (2/3, -1/3, -1/3); kappa = 1; Vt(root) = 0
    v1 = (2 / 3 - 1 / 3 + 0.0) / (2 + 1)  # node 1: two trajectories below
    v4 = (-1 / 3 + 0.0) / (1 + 1)  # node 4: one trajectory, shrunk halfway to 0
    want = {0: 0.0, 1: v1, 2: 2 / 3 - v1, 3: -1 / 3 - v1, 4: v4, 5: -1 / 3 - v4}
    by_id = dict(zip(batch.node_ids.tolist(), got.node.tolist(), strict=True))
    assert by_id == pytest.approx(want, abs=1e-12)
    # prior_weight 0: pure Monte Carlo values; a chain's credit lands on its first action
    mc = factor(batch, FactorParams(eta=0.0, std="none", prior_weight=0.0))
    by_id = dict(zip(batch.node_ids.tolist(), mc.node.tolist(), strict=True))
    assert by_id[4] == pytest.approx(-1 / 3) and by_id[5] == pytest.approx(0.0)


@SETTINGS
@given(trees=random_trees(max_trees=4, max_nodes=15), kappa=st.sampled_from([0.0, 0.5, 2.0]),
       group=st.sampled_from(["tree", "task"]), std=st.sampled_from(["unbiased", "none"]))
def test_factor_td_credit_telescopes_to_the_grpo_advantage(
        trees: list[Tree], kappa: float, group: str, std: str) -> None:
    """F2: on every trajectory, the sum of its actions' A* is its G1 advantage."""
    batch = from_trees(trees)
    credit = factor(batch, FactorParams(eta=0.0, prior_weight=kappa, group=group,  # type: ignore[arg-type]
                                        std=std))  # type: ignore[arg-type]
    adv = grpo(batch, GrpoParams(group=group, std=std)).node  # type: ignore[arg-type]
    for leaf in np.flatnonzero(batch.is_leaf & np.isfinite(batch.reward) & (batch.depth > 0)):
        total, v = 0.0, int(leaf)
        while batch.parent[v] >= 0:
            total += credit.node[v]
            v = int(batch.parent[v])
        assert total == pytest.approx(adv[leaf], abs=1e-9)


def _loop_weights(lengths: list[int], gap: np.ndarray, a_star: np.ndarray, eta: float,
                  clip: float, tau: float) -> np.ndarray:
    """F4-F5 written out per action: rho = (1 - eta)/L + eta softmax(s / tau), w = L rho."""
    out, k = [], 0
    for v, n in enumerate(lengths):
        s = np.sign(a_star[v]) * np.clip(gap[k:k + n], -clip, clip) / tau
        soft = np.exp(s) / np.exp(s).sum()
        out += list(n * ((1 - eta) / n + eta * soft))
        k += n
    return np.array(out)


@given(seed=st.integers(0, 10_000), eta=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       tau=st.sampled_from([0.5, 1.0]))
@settings(max_examples=30, deadline=None)
def test_allocation_weights_mean_one_no_sign_flip_and_equal_when_teacher_is_student(
        seed: int, eta: float, tau: float) -> None:
    rng = np.random.default_rng(seed)
    lengths = list(rng.integers(1, 6, size=5))
    a_star = rng.normal(size=5) * (rng.random(5) > 0.2)
    node_of = np.repeat(np.arange(5), lengths)
    gap = rng.normal(size=node_of.size) * 4
    w = allocation_weights(node_of, gap, np.sign(a_star), 5, eta, 3.0, tau)
    np.testing.assert_allclose(w, _loop_weights(lengths, gap, a_star, eta, 3.0, tau),
                               atol=1e-12)
    mean = np.bincount(node_of, weights=w) / np.bincount(node_of)
    np.testing.assert_allclose(mean, 1.0, atol=1e-12)  # F5: mean weight 1
    assert np.all(w > 0)  # no token's sign differs from its action's
    same = allocation_weights(node_of, np.zeros(node_of.size), np.sign(a_star), 5, eta, 3.0, tau)
    np.testing.assert_allclose(same, 1.0, atol=1e-12)  # teacher = student: equal weights


def _with_scores(tree: Tree, teacher: dict[int, list[float]], student: dict[int, list[float]],
                 key: str) -> tuple[object, object]:
    batch = from_trees([tree])
    lists = {}
    for name, src in ((key, teacher), (STUDENT_LOGPROB, student)):
        arr = np.empty(batch.n_nodes, dtype=object)
        for row, nid in enumerate(batch.node_ids):
            arr[row] = src.get(int(nid))
        lists[name] = node_lists_to_tokens(batch, arr)
    return batch, dataclasses.replace(batch, extras=lists)


def test_factor_tokens_follow_the_gap_and_mismatched_lengths_are_uniform() -> None:
    tree = _tree()
    student = {1: [-1.0, -1.0], 2: [-1.0, -1.0, -1.0], 3: [-2.0, -2.0], 4: [-1.0, -1.0],
               5: [-1.0]}
    teacher = {1: [-0.2, -1.5], 2: [-1.0, 0.0, -1.0], 3: [-2.0, -2.0, -2.0],  # 3: wrong length
               4: [-1.0, -1.0], 5: [0.0]}
    _, batch = _with_scores(tree, teacher, student, HINDSIGHT_LOGPROB)
    got = factor(batch, FactorParams())  # type: ignore[arg-type]
    tok = {int(batch.node_ids[v]): got.token[batch.token_offsets[v]:batch.token_offsets[v + 1]]  # type: ignore[attr-defined]
           [batch.agent_mask[batch.token_offsets[v]:batch.token_offsets[v + 1]]]  # type: ignore[attr-defined]
           for v in range(batch.n_nodes)}  # type: ignore[attr-defined]
    node_value = dict(zip(batch.node_ids.tolist(), got.node.tolist(), strict=True))  # type: ignore[attr-defined]
    assert node_value[1] > 0 and tok[1][0] > tok[1][1]  # A* > 0: the token the teacher likes
    assert node_value[2] > 0 and tok[2][1] > tok[2][0] == pytest.approx(tok[2][2])
    np.testing.assert_allclose(tok[3], node_value[3])  # length mismatch: uniform
    np.testing.assert_allclose(tok[4], node_value[4])  # teacher = student: uniform
    with pytest.raises(KeyError):
        factor(from_trees([tree]), FactorParams())


def test_sgcd_weights_are_bounded_and_signed_by_the_advantage() -> None:
    tree = _tree()
    student = {1: [-1.0, -1.0], 2: [-1.0, -1.0, -1.0], 3: [-1.0, -1.0], 4: [-1.0, -1.0],
               5: [-1.0]}
    teacher = {1: [0.0, -1.0], 2: [-5.0, -0.5, -1.0], 3: [0.0, -3.0], 4: [-1.0, -1.0],
               5: [-0.8]}
    plain, batch = _with_scores(tree, teacher, student, CONTRAST_LOGPROB)
    got = sgcd(batch, SgcdParams(c=0.5))  # type: ignore[arg-type]
    base = grpo(plain, GrpoParams()).node  # type: ignore[arg-type]
    np.testing.assert_allclose(got.node, base)  # node values are GRPO's
    b = batch
    w = {}
    for v in range(b.n_nodes):  # type: ignore[attr-defined]
        lo, hi = b.token_offsets[v], b.token_offsets[v + 1]  # type: ignore[attr-defined]
        tok = got.token[lo:hi][b.agent_mask[lo:hi]]  # type: ignore[attr-defined]
        if tok.size and base[v] != 0:
            w[int(b.node_ids[v])] = tok / base[v]  # type: ignore[attr-defined]
    # node 2 succeeded (A > 0): d = (-4, +0.5, 0) -> w = (0.5, 1.5, 1)
    np.testing.assert_allclose(w[2], [0.5, 1.5, 1.0])
    # node 3 failed (A < 0): d = (+1, -2) -> w = clip(1 - d) = (0.5, 1.5)
    np.testing.assert_allclose(w[3], [0.5, 1.5])
    np.testing.assert_allclose(w[4], [1.0, 1.0])
    assert all(np.all((x >= 0.5) & (x <= 1.5)) for x in w.values())
    with pytest.raises(ValueError, match="c must be in"):
        SgcdParams(c=1.0)
    with pytest.raises(ValueError, match="summariser"):
        SgcdParams(summariser="gpt")
    assert SgcdParams(kappa=0.0).params_hash() != SgcdParams().params_hash()
    np.testing.assert_allclose(sgcd(plain, SgcdParams(kappa=0.0)).token,  # type: ignore[arg-type]
                               grpo(plain, GrpoParams()).token)  # type: ignore[arg-type]


def test_template_summariser_names_the_first_differing_step() -> None:
    def step(nid: int, parent: int | None, text: str, reward: float | None = None) -> Node:
        n = node(nid, parent, 1, 1, reward=reward)
        return dataclasses.replace(n, action_text=text, observation_text=f"obs{nid}")

    tree = Tree("c", [step(0, None, ""), step(1, 0, "calc(2+3)"), step(2, 1, "answer 5", 1.0),
                      step(3, 1, "answer 6", 0.0), step(4, 0, "calc(2*3)"),
                      step(5, 4, "answer 6", 0.0)], task_id="x")
    success, failed = contrast_pair(tree)  # type: ignore[misc]
    assert [n.node_id for n in success] == [0, 1, 2]
    assert [n.node_id for n in failed] == [0, 1, 3]  # the closest failure, not node 5's
    assert first_difference(success, failed) == (2, "answer 5", "answer 6")
    ref = reference(tree, TemplateSummariser())
    assert ref == ("Hint from a solved attempt: at step 2, do answer 5 "
                   "(a failed attempt did answer 6).")
    no_success = dataclasses.replace(tree, nodes=[dataclasses.replace(
        n, reward=0.0 if n.reward is not None else None) for n in tree.nodes])
    assert reference(no_success, TemplateSummariser()) is None


def test_both_are_registered_with_frozen_params() -> None:
    for name, params in (("factor", FactorParams), ("sgcd", SgcdParams)):
        est = ESTIMATORS[name]
        assert est.params_type is params
        p = est.parse_params({"teacher": "abc"})
        assert p.teacher == "abc"
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.teacher = "x"
        assert p.params_hash() != est.params_type().params_hash()
    with pytest.raises(ValueError, match="eta"):
        FactorParams(eta=1.5)


def test_hf_summariser_prompts_a_local_chat_model_deterministically() -> None:
    """Q2 ``hf:PATH``: any local chat model (here the tiny calc checkpoint, which has a chat
    template) is prompted with both siblings; greedy decoding gives the same reference."""
    from train.credit.contrast import HFSummariser, make_summariser
    from train.policies.tiny import committed_checkpoint

    path = committed_checkpoint("calc", 0)
    if path is None:
        pytest.skip("no committed tiny calc checkpoint")

    def step(nid: int, parent: int | None, text: str, reward: float | None = None) -> Node:
        return dataclasses.replace(node(nid, parent, 1, 1, reward=reward), action_text=text,
                                   observation_text=f"obs{nid}")

    tree = Tree("h", [step(0, None, ""), step(1, 0, "<answer>5</answer>", 1.0),
                      step(2, 0, "<answer>6</answer>", 0.0)], task_id="x")
    summariser = make_summariser(f"hf:{path}")
    assert isinstance(summariser, HFSummariser)
    summariser.max_new_tokens = 8
    first = reference(tree, summariser)
    assert first is not None and first.startswith("Hint from a solved attempt:")
    assert reference(tree, summariser) == first
    with pytest.raises(ValueError, match="unknown summariser"):
        make_summariser("openai:gpt")


@SETTINGS
@given(trees=random_trees(max_trees=3, max_nodes=15), kappa=st.sampled_from([0.0, 1.0, 3.0]))
def test_factor_values_equal_a_plain_loop(trees: list[Tree], kappa: float) -> None:
    """F1-F2 node by node in Python (rows are in preorder: a parent before its children)."""
    batch = from_trees(trees)
    params = FactorParams(eta=0.0, prior_weight=kappa)
    z = grpo(batch, GrpoParams()).node  # G1 at trajectory leaves
    leaf = batch.is_leaf & np.isfinite(batch.reward)
    n = np.zeros(batch.n_nodes)
    s = np.zeros(batch.n_nodes)
    for v in np.flatnonzero(leaf):
        u = int(v)
        while u >= 0:
            n[u] += 1
            s[u] += z[v]
            u = int(batch.parent[u])
    value = np.zeros(batch.n_nodes)
    want = np.zeros(batch.n_nodes)
    for v in range(batch.n_nodes):
        p = int(batch.parent[v])
        if p < 0:
            continue
        if batch.is_leaf[v]:
            value[v] = 0.0
        elif n[v] > 0:
            value[v] = (s[v] + kappa * value[p]) / (n[v] + kappa)
        else:
            value[v] = value[p]
        want[v] = value[v] - value[p] + (z[v] if leaf[v] else 0.0) if n[v] > 0 else np.nan
    got = factor(batch, params).node
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_eta_schedule_anneals_linearly_and_reaches_uniform_weights() -> None:
    """issue 47: F5's eta follows the paper's ``eta max(1 - k / 50, 0)`` at the recorded
    step; at and after ``eta_steps`` the credit is the eta-0 credit and reads no scores."""
    assert FactorParams().eta_now == pytest.approx(0.7)
    assert FactorParams(step=25).eta_now == pytest.approx(0.35)
    assert FactorParams(step=10, eta_steps=20, eta=0.5).eta_now == pytest.approx(0.25)
    assert FactorParams(step=50).eta_now == 0.0 and FactorParams(step=80).token_score_kinds() == {}
    assert FactorParams(step=80, eta_schedule="constant").eta_now == pytest.approx(0.7)
    tree = _tree()
    student = {1: [-1.0, -1.0], 2: [-1.0, -1.0, -1.0], 3: [-2.0, -2.0], 4: [-1.0, -1.0],
               5: [-1.0]}
    teacher = {1: [-0.2, -1.5], 2: [-1.0, 0.0, -1.0], 3: [-2.0, -2.5], 4: [-1.0, -3.0],
               5: [0.0]}
    _, batch = _with_scores(tree, teacher, student, HINDSIGHT_LOGPROB)
    late = factor(batch, FactorParams(step=50))  # type: ignore[arg-type]
    off = factor(batch, FactorParams(eta=0.0))  # type: ignore[arg-type]
    np.testing.assert_allclose(late.token, off.token)
    mid = factor(batch, FactorParams(step=25))  # type: ignore[arg-type]
    half = factor(batch, FactorParams(eta=0.35, eta_schedule="constant"))  # type: ignore[arg-type]
    np.testing.assert_allclose(mid.token, half.token)
    assert not np.allclose(mid.token, off.token)
    for bad in ({"eta_schedule": "cosine"}, {"context": "inline"}, {"eta_steps": 0},
                {"step": -1}):
        with pytest.raises(ValueError):
            FactorParams(**bad)  # type: ignore[arg-type]


def test_teacher_contexts_put_the_feedback_where_each_option_says() -> None:
    """issue 47: ``turn`` gives the teacher the feedback as one more observation turn (the
    policy renders it as it renders every tool response); ``template`` keeps the issue-24
    suffix on the last turn. Both score the same nodes, each under its own kind."""
    from train.credit.base import HINDSIGHT, HINDSIGHT_KINDS, HINDSIGHT_TURN
    from train.scoring import FEEDBACK, teacher_contexts

    tree = Tree("t", [
        Node(0, None, kind="prompt", observation_text="Compute 3+4."),
        Node(1, 0, action_text="<tool_call>3+4</tool_call>",
             observation_text="<tool_response>7</tool_response>"),
        Node(2, 1, action_text="<answer>7</answer>", terminal=True, reward=1.0)], task_id="x")
    turns = tree.transcripts()
    new = dict((n.node_id, ctx) for n, ctx in teacher_contexts(tree, HINDSIGHT_TURN, turns))
    old = dict((n.node_id, ctx) for n, ctx in teacher_contexts(tree, HINDSIGHT, turns))
    assert set(new) == set(old) == {1}  # the answer tail has no feedback
    assert new[1] == [("prompt", "Compute 3+4."),
                      ("observation", "<tool_response>7</tool_response>")]
    assert old[1] == [("prompt", "Compute 3+4." + FEEDBACK + "<tool_response>7</tool_response>")]
    assert HINDSIGHT_KINDS == {"turn": HINDSIGHT_TURN, "template": HINDSIGHT}
    assert FactorParams().token_score_kinds()[HINDSIGHT_LOGPROB] == HINDSIGHT_TURN
    assert FactorParams(context="template").token_score_kinds()[HINDSIGHT_LOGPROB] == HINDSIGHT
