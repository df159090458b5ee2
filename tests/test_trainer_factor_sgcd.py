"""``credit="factor"`` and ``credit="sgcd"`` in the trainer (issue 24): the weights that
sampled each tree score its actions with and without the teacher's extra context (F3, Q3),
the scores are committed to ``policy_scores``, and the committed credit is a function of
the stored trees and scores alone; SGCD's dynamic sampling (Q1) reports its extra budget
and the student trains on exactly the sampled transcript (Q5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rollout_store.reader import connect, read_trees
from rollout_store.store import open_store
from train.batches import make_rows
from train.config import load_config
from train.credit.contrast import TemplateSummariser, reference
from train.credit.scores import HINDSIGHT_TURN, PLAIN, stored_scores
from train.credit.store_io import credit_trees, credit_trees_full
from train.scoring import teacher_contexts
from train.sequences import build_sequences
from train.trainer import credit_for, load_start_policy, read_metrics, train


def _stored_credit(store: str) -> dict[tuple[str, int], tuple[str, str, float, list[float]]]:
    return {(t, n): (m, h, v, list(tv or [])) for t, n, m, h, v, tv in connect(store).sql(
        "SELECT tree_id, node_id, method, method_params_hash, value, token_values "
        "FROM credits").fetchall()}


def test_factor_scores_and_credit_from_stored_data(tmp_path: Path) -> None:
    cfg = load_config(None, {
        "credit": "factor", "aggregation": "action-mean", "steps": 1, "tasks_per_step": 2,
        "n_total": 3, "minibatches": 2, "heldout_tasks": 0, "max_new_tokens": 40,
        "progress": False, "run_id": "fa", "store": str(tmp_path / "store"),
        "out": str(tmp_path / "run")})
    train(cfg)
    trees = read_trees(cfg.store)
    assert len(trees) == 2
    con = connect(cfg.store)
    rows = con.sql("SELECT s.kind, s.policy_version = t.policy_version FROM policy_scores s "
                   "JOIN trees t USING (tree_id)").fetchall()
    assert {k for k, _ in rows} == {PLAIN, HINDSIGHT_TURN}  # the default context (F3)
    assert all(same for _, same in rows)  # scored by the weights that sampled the tree
    stored = _stored_credit(cfg.store)
    assert len(stored) == sum(len(t.nodes) for t in trees)
    assert {m for m, *_ in stored.values()} == {"factor"}
    ids = [t.tree_id for t in trees]
    s = open_store(cfg.store)
    import pyarrow as pa

    scores = pa.concat_tables([stored_scores(s, ids, k, None) for k in (PLAIN, HINDSIGHT_TURN)])
    again = credit_trees(trees, "factor", {}, scores=scores)
    assert set(again.column("method_params_hash").to_pylist()) == {
        h for _, h, _, _ in stored.values()}
    spread = 0
    for t, n, v, tv in zip(*(again.column(c).to_pylist() for c in (
            "tree_id", "node_id", "value", "token_values")), strict=True):
        _, _, sv, stv = stored[(t, n)]
        assert sv == v
        np.testing.assert_array_equal(np.asarray(stv), np.asarray(tv or []))
        if tv and len(tv) > 1 and v != 0:
            assert abs(np.mean(tv) - v) < 1e-5  # F5: mean weight 1
            spread += np.ptp(tv) > 1e-6
    assert spread  # the hindsight gap moved some weights: the check can fail
    m = read_metrics(cfg.store, "fa")
    assert np.isfinite(m["loss"][0][1])


def test_the_credit_stage_sets_factors_step_for_the_eta_schedule(tmp_path: Path) -> None:
    """F5 (issue 47): the trainer records each iteration as factor's ``step``, so the
    committed params name the eta used; a method without a step is unchanged, and a run
    that sets the step itself is refused."""
    import pytest

    from train.config import ConfigError
    from train.credit_stage import make_credit

    base = {"steps": 1, "progress": False, "store": str(tmp_path / "s"),
            "out": str(tmp_path / "r")}
    stage = make_credit(load_config(None, {**base, "credit": "factor"}))
    later = stage.at_step(25)
    assert later.pairs["step"] == "25" and later.params.eta_now == pytest.approx(0.35)  # type: ignore[attr-defined]
    assert later.params.params_hash() != stage.params.params_hash()
    assert stage.at_step(60).params.token_score_kinds() == {}  # eta 0: no teacher passes
    grpo = make_credit(load_config(None, {**base, "credit": "grpo"}))
    assert grpo.at_step(25) is grpo
    with pytest.raises(ConfigError, match="step"):
        make_credit(load_config(None, {**base, "credit": "factor",
                                       "credit_params": {"step": "3"}}))


def test_sgcd_dynamic_sampling_and_the_clean_student(tmp_path: Path) -> None:
    cfg = load_config(None, {
        "credit": "sgcd", "steps": 1, "tasks_per_step": 2, "n_total": 4, "minibatches": 1,
        "heldout_tasks": 0, "max_new_tokens": 40, "progress": False, "run_id": "sg",
        "dynamic_sampling": "resample", "dynamic_rounds": 2,
        "store": str(tmp_path / "store"), "out": str(tmp_path / "run")})
    train(cfg)
    trees = read_trees(cfg.store)
    m = {k: v[0][1] for k, v in read_metrics(cfg.store, "sg").items()}
    for name in ("ds_extra_trees", "ds_extra_rollouts", "ds_extra_tool_steps",
                 "ds_dropped_trees"):
        assert name in m
    assert m["ds_extra_rollouts"] == 4 * m["ds_extra_trees"]  # n_total leaves each
    assert len(trees) == 2  # resample keeps one tree per task
    con = connect(cfg.store)
    kinds = {k for (k,) in con.sql("SELECT DISTINCT kind FROM policy_scores").fetchall()}
    assert PLAIN in kinds
    summariser = TemplateSummariser()
    refs = {t.tree_id: reference(t, summariser) for t in trees}
    if any(r is not None for r in refs.values()):
        assert "contrast:template" in kinds
    stored = _stored_credit(cfg.store)
    assert {meth for meth, *_ in stored.values()} == {"sgcd"}
    # Q5: the student's training rows are the sampled transcript: the loss targets are the
    # stored action tokens, node by node, and no reference text reaches the sequences.
    policy = load_start_policy(cfg)
    _, credit = credit_for(trees, cfg, stored_scores(open_store(cfg.store),
                                                     [t.tree_id for t in trees],
                                                     PLAIN, None))
    for tree in trees:
        seqs = build_sequences(tree, policy.prompt_ids)
        rows = make_rows([seqs], credit, "tree")
        want = [tok for n in tree.preorder() for tok in n.action_token_ids]
        assert [tok for r in rows for tok in r.targets] == want
        text = policy.tokenizer.decode([i for r in rows for i in r.ids])
        assert "Hint from a solved attempt" not in text
        ref = refs[tree.tree_id]
        if ref is not None:  # the teacher did see it
            contexts = teacher_contexts(tree, "contrast:template", tree.transcripts())
            assert contexts and all(ref in c[0][1] for _, c in contexts)


def test_credit_trees_full_returns_the_rows_batch(tmp_path: Path) -> None:
    from rollout_store.synthetic import bel_shaped_batch

    trees = bel_shaped_batch(2, seed=1).to_trees()
    rows, batch, credit = credit_trees_full(trees, "factor", {"eta": "0"})
    assert rows.num_rows == batch.n_nodes == credit.node.size


def test_dynamic_sampling_resamples_or_drops_and_counts_the_budget(tmp_path: Path) -> None:
    from dataclasses import replace
    from functools import partial

    from rollout_store.tree import Tree
    from train.envs import env_class, make_env
    from train.sampling import make_sampler
    from train.sampling.dynamic import dynamic_sampling
    from train.sampling.dynamic import mixed as is_mixed
    from train.trainer import load_start_policy

    cfg = load_config(None, {"dynamic_sampling": "resample", "dynamic_rounds": 2,
                             "n_total": 2, "store": str(tmp_path / "s"),
                             "out": str(tmp_path / "r"), "run_id": "ds"})
    policy = load_start_policy(cfg)
    sampler = make_sampler("group", max_new_tokens=40, temperature=1.0)
    env = make_env("calc")
    tasks = env_class("calc").generate_tasks(2, 0)
    tree = sampler.sample_tree(env, policy, tasks[0], 2, seed=1, tree_id="t0", run_id="ds")
    leaves = {n.node_id for n in tree.leaves()}
    assert len(leaves) == 2

    def with_rewards(values: list[float], tree_id: str) -> Tree:
        it = iter(values)
        return replace(tree, tree_id=tree_id, nodes=[
            replace(n, reward=next(it)) if n.node_id in leaves else n for n in tree.nodes])

    flat, mixed = with_rewards([0.0, 0.0], "flat"), with_rewards([1.0, 0.0], "mixed")
    assert not is_mixed(flat, 1.0) and is_mixed(mixed, 1.0)
    run = partial(dynamic_sampling, env="calc", n_total=cfg.n_total, seed=cfg.seed, it=0,
                  run_id="ds")
    kept, ds = run([flat, mixed], tasks, sampler, policy, rounds=2)
    assert 1 <= ds["ds_extra_trees"] <= 2  # the flat tree was resampled
    # every discarded tree (each resampled one, and a last one still without both
    # outcomes, dropped) counts its 2 rollouts against the budget
    assert ds["ds_extra_rollouts"] == 2 * (ds["ds_extra_trees"] + ds["ds_dropped_trees"])
    assert len(kept) == 2 - ds["ds_dropped_trees"] and kept[-1].tree_id == "mixed"
    assert all(t.tree_id != "flat" for t in kept)
    dropped, ds = run([flat, mixed], tasks, sampler, policy, rounds=0)
    assert [t.tree_id for t in dropped] == ["mixed"]
    assert ds == {"ds_dropped_trees": 1.0, "ds_extra_trees": 0.0, "ds_extra_rollouts": 2.0,
                  "ds_extra_tool_steps": float(sum(n.tool_calls or 0 for n in flat.nodes))}


def test_factor_skips_teacher_passes_of_one_token_actions_without_changing_credit(
        tmp_path: Path) -> None:
    """F5: a one-token action's weight is 1 whatever its gap, so the trainer's scoring job
    skips those nodes for factor (``min_scored_tokens``); on workflow trees (one-token tool
    calls) the committed credit is the same as with every node scored."""
    import pyarrow as pa

    from rollout_store.store import Store
    from train.credit.factor import FactorParams
    from train.envs import env_class
    from train.policies import load_policy
    from train.sampling.collect import collect
    from train.scoring import score_trees

    policy = load_policy("tiny", "workflow")
    store = Store(str(tmp_path / "s"), create=True)
    tasks = env_class("workflow").generate_tasks(2, 0, horizons=[4], mark_optional=True)
    collect(store, "workflow", policy, "bel", tasks, 4, 0, "wf", progress=False)
    trees = read_trees(store)
    kinds = list(dict.fromkeys(FactorParams().token_score_kinds().values()))
    full = pa.concat_tables([score_trees(trees, policy, k) for k in kinds])
    lean = pa.concat_tables([score_trees(trees, policy, k, min_tokens=2) for k in kinds])
    one = sum(1 for t in trees for n in t.nodes if len(n.action_token_ids) == 1)
    assert one > 0 and lean.num_rows < full.num_rows
    a = credit_trees(trees, "factor", {}, scores=full)
    b = credit_trees(trees, "factor", {}, scores=lean)
    for x, y in zip(a.column("token_values").to_pylist(), b.column("token_values").to_pylist(),
                    strict=True):
        np.testing.assert_allclose(np.asarray(x or []), np.asarray(y or []), atol=1e-12)
    assert a.column("value").to_pylist() == b.column("value").to_pylist()
