"""trace and dsc on stored trees (issue 10 item 6): policy scores computed once, stored,
reused, on a real store collected with the real tiny policy (no mocks)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest

from rollout_store import Store, connect, read_trees
from rollout_store.synthetic import bel_shaped_batch
from train.credit.base import TreeArrays, from_trees
from train.credit.dsc import RATIO, STATE, DSCParams
from train.credit.scores import ACTION, GOLD, is_answer_tail, score_extras, stored_scores
from train.credit.store_io import CreditError, compute_credits, credit_trees
from train.credit.trace import REF_LOGPROB, TraceParams, trace
from train.policies import load_policy
from train.policies.tiny import committed_checkpoint
from train.scoring import gold_answer, score_and_credit, score_trees


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    if committed_checkpoint("calc", 0) is None:
        pytest.skip("no committed tiny calc checkpoint")
    from train.envs import env_class
    from train.sampling.collect import collect

    store = Store(tmp_path_factory.mktemp("scores") / "store", create=True)
    policy = load_policy(f"hf:{committed_checkpoint('calc', 0)}", "calc", device="cpu")
    tasks = env_class("calc").generate_tasks(3, 0)
    collect(store, "calc", policy, "random", tasks, 6, 0, "run-a", progress=False)
    return store


def _n_scores(store: Store) -> int:
    return int(connect(store).sql("SELECT count(*) FROM policy_scores").fetchall()[0][0])


@pytest.mark.slow
def test_trace_and_dsc_from_the_store(tiny_store: Store) -> None:
    store = tiny_store
    spec = f"hf:{committed_checkpoint('calc', 0)}"
    policy = load_policy(spec, "calc", device="cpu")
    version = str(policy.policy_version)
    trees = read_trees(store)

    # trace --param ref=SPEC: T2 scores of every TD state, computed once.
    report = score_and_credit(store, "trace", {"ref": spec}, progress=False)
    assert report.trees_done == 3
    scored = sum(not is_answer_tail(t, n) for t in trees for n in t.nodes)
    assert _n_scores(store) == scored > 0
    # The stored value is T2 computed by hand for one node.
    tree = trees[0]
    node = next(n for n in tree.nodes if n.parent_id is not None and not is_answer_tail(tree, n))
    gold = gold_answer(tree)
    assert gold.startswith("<answer>") and gold.endswith("</answer>")
    want = float(policy.score([tree.transcripts()[node.node_id]], [gold])[0].mean())
    rows = stored_scores(store, [tree.tree_id], GOLD, version)
    got = dict(zip(rows.column("node_id").to_pylist(), rows.column("value").to_pylist(),
                   strict=True))
    # the store's value was scored in a batch of many nodes, ``want`` alone: the batched
    # matmuls reduce in another order (5e-7 apart here), so the bound is the house's 1e-5
    assert got[node.node_id] == pytest.approx(want, abs=1e-5)
    # The credit is the pure estimator on those scores; params record the version.
    con = connect(store)
    params = con.sql("SELECT DISTINCT method_params FROM credits WHERE method = 'trace'"
                     ).fetchall()
    assert params and f'"ref": "{version}"' in params[0][0]
    batch = from_trees(trees)
    pure = trace(dataclasses.replace(batch, extras={REF_LOGPROB: _lbar(store, batch, version)}),
                 TraceParams(ref=version))
    stored = dict(((t, n), v) for t, n, v in con.sql(
        "SELECT tree_id, node_id, value FROM credits WHERE method = 'trace'").fetchall())
    for row in range(batch.n_nodes):
        key = (batch.tree_ids[batch.node_tree[row]], int(batch.node_ids[row]))
        assert stored[key] == pytest.approx(pure.node[row], abs=1e-9)
    # Computed once: a second call scores and credits nothing new.
    again = score_and_credit(store, "trace", {"ref": spec}, progress=False)
    assert again.trees_done == 0 and _n_scores(store) == scored

    # dsc --param target=SPEC with the policy that sampled the trees: pi = mu, so every
    # ratio is 1 (up to float32 logprobs) and transport equals reuse (D4).
    score_and_credit(store, "dsc", {"target": spec}, progress=False)
    actions = stored_scores(store, [t.tree_id for t in trees], ACTION, version)
    assert actions.num_rows == sum(1 for t in trees for n in t.nodes
                                   if n.parent_id not in (None, t.root().node_id))
    from rollout_store import read_arrow

    nodes = read_arrow(store, "nodes")
    extras = score_extras(nodes, actions, ACTION, version)
    ratio = extras[RATIO][np.isfinite(extras[RATIO])]
    assert ratio.size == actions.num_rows
    np.testing.assert_allclose(ratio, 1.0, atol=2e-3)
    credits = dict(((t, n), v) for t, n, v in connect(store).sql(
        "SELECT tree_id, node_id, value FROM credits WHERE method = 'dsc'").fetchall())
    reuse_rows = credit_trees(trees, "dsc", DSCParams(mode="reuse", target=version),
                              scores=actions)
    for t, n, v in zip(reuse_rows.column("tree_id").to_pylist(),
                       reuse_rows.column("node_id").to_pylist(),
                       reuse_rows.column("value").to_pylist(), strict=True):
        assert credits[(t, n)] == pytest.approx(v, abs=0.02)
    # The trainer's path: score in memory, credit in memory, same values as the store.
    mem = score_trees(trees, policy, ACTION)
    rows = credit_trees(trees, "dsc", DSCParams(target=version), scores=mem)
    for t, n, v in zip(rows.column("tree_id").to_pylist(), rows.column("node_id").to_pylist(),
                       rows.column("value").to_pylist(), strict=True):
        assert credits[(t, n)] == pytest.approx(v, abs=1e-6)
    assert STATE in extras


def _lbar(store: Store, batch: TreeArrays, version: str) -> np.ndarray:
    rows = stored_scores(store, list(batch.tree_ids), GOLD, version)
    got = {(t, n): v for t, n, v in zip(rows.column("tree_id").to_pylist(),
                                        rows.column("node_id").to_pylist(),
                                        rows.column("value").to_pylist(), strict=True)}
    return np.array([got.get((batch.tree_ids[b], int(n)), np.nan)
                     for b, n in zip(batch.node_tree, batch.node_ids, strict=True)])


def test_scored_methods_without_a_policy_say_which_param(store: Store) -> None:
    store.append_trees(bel_shaped_batch(2, seed=1), key="a")
    with pytest.raises(CreditError, match=r"trace needs input .* pass --param ref=SPEC"):
        compute_credits(store, "trace", progress=False)
    with pytest.raises(CreditError, match=r"dsc needs input .* pass --param target=SPEC"):
        compute_credits(store, "dsc", progress=False)
    with pytest.raises(CreditError, match="cannot load the scoring policy 'nope'"):
        score_and_credit(store, "trace", {"ref": "nope"}, progress=False)
    # A version made of digits stays a string (the params record the scorer's version).
    from train.credit import ESTIMATORS

    assert ESTIMATORS["trace"].parse_params({"ref": "123456789012"}).ref == "123456789012"


def test_a_store_from_before_policy_scores_opens_and_gains_the_table(store: Store) -> None:
    store.append_trees(bel_shaped_batch(2, seed=1), key="a")
    shutil.rmtree(store.path / "policy_scores")  # as a schema-version-1 store has it
    reopened = Store(store.path)
    assert (Path(reopened.path) / "policy_scores").is_dir()
    assert connect(reopened).sql("SELECT count(*) FROM policy_scores").fetchall() == [(0,)]
    assert compute_credits(reopened, "grpo", progress=False).trees_done == 2


def test_factor_and_sgcd_score_their_teachers_once_from_the_store(tiny_store: Store) -> None:
    """issue 24: ``--param teacher=SPEC`` scores plain / hindsight / contrast:template rows
    once per policy version; the committed credit is the pure estimator on them."""
    from train.credit.base import node_lists_to_tokens
    from train.credit.contrast import TemplateSummariser, reference
    from train.credit.factor import HINDSIGHT_LOGPROB, STUDENT_LOGPROB, FactorParams, factor
    from train.credit.scores import HINDSIGHT, HINDSIGHT_TURN, PLAIN

    store = tiny_store
    spec = f"hf:{committed_checkpoint('calc', 0)}"
    version = str(load_policy(spec, "calc", device="cpu").policy_version)
    trees = read_trees(store)
    assert score_and_credit(store, "factor", {"teacher": spec}, progress=False).trees_done == 3
    con = connect(store)
    kinds = dict(con.execute("SELECT kind, count(*) FROM policy_scores WHERE policy_version "
                             "= $v GROUP BY kind", {"v": version}).fetchall())
    steps = sum(1 for t in trees for n in t.nodes if n.parent_id is not None and n.action_text)
    assert kinds[PLAIN] == steps
    fed = sum(1 for t in trees for n in t.nodes if n.parent_id is not None
              and n.action_text and n.observation_text)
    assert kinds[HINDSIGHT_TURN] == fed and HINDSIGHT not in kinds  # the default context
    score_and_credit(store, "factor", {"teacher": spec, "context": "template"},
                     progress=False)  # the issue-24 template, kept under its name
    con = connect(store)
    kinds = dict(con.execute("SELECT kind, count(*) FROM policy_scores WHERE policy_version "
                             "= $v GROUP BY kind", {"v": version}).fetchall())
    assert kinds[HINDSIGHT] == fed and kinds[PLAIN] == steps
    before = _n_scores(store)
    report = score_and_credit(store, "sgcd", {"teacher": spec}, progress=False)
    assert report.trees_done == 3
    n_ref = sum(reference(t, TemplateSummariser()) is not None for t in trees)
    con = connect(store)  # a connection reads the tables as of its opening
    kinds = dict(con.sql("SELECT kind, count(DISTINCT tree_id) FROM policy_scores "
                         "GROUP BY kind").fetchall())
    assert kinds.get("contrast:template", 0) == n_ref
    assert _n_scores(store) > before or n_ref == 0  # plain rows were reused, not rescored
    # factor's committed credit is the pure estimator on the stored rows
    batch = from_trees(trees)
    extras = {}
    for name, kind in ((HINDSIGHT_LOGPROB, HINDSIGHT_TURN), (STUDENT_LOGPROB, PLAIN)):
        rows = stored_scores(store, [t.tree_id for t in trees], kind, version)
        got = {(t, int(n)): lp for t, n, lp in zip(*(rows.column(c).to_pylist() for c in (
            "tree_id", "node_id", "token_logprobs")), strict=True)}
        arr = np.empty(batch.n_nodes, dtype=object)
        for row in range(batch.n_nodes):
            arr[row] = got.get((batch.tree_ids[batch.node_tree[row]], int(batch.node_ids[row])))
        extras[name] = node_lists_to_tokens(batch, arr)
    pure = factor(dataclasses.replace(batch, extras=extras), FactorParams(teacher=version))
    stored = dict(((t, n), v) for t, n, v in con.sql(
        "SELECT tree_id, node_id, value FROM credits WHERE method = 'factor'").fetchall())
    for row in range(batch.n_nodes):
        key = (batch.tree_ids[batch.node_tree[row]], int(batch.node_ids[row]))
        assert stored[key] == pytest.approx(np.nan_to_num(pure.node[row]), abs=1e-12)
