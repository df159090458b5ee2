"""The Mean@K ranking audit (METHODS.md §2.4, E10-E11) and its reference job.

Math three ways: per-prefix τ_b equals ``scipy.stats.kendalltau``
(variant b) on random data with ties, pairwise accuracy equals a loop over pairs,
and on the ``workflow`` environment an oracle score (each child's exact success
probability under the tabular policy) approaches τ_b = 1 as the reference's k
grows while a random score stays near 0. The reference job runs for real: trees
built by stepping the environment with a tabular policy, stored, continued from
their snapshots.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import scipy.stats
from typer.testing import CliRunner

from analysis.ranking import (
    Estimate,
    RankingConfig,
    RankingError,
    RankingStatistics,
    group_index,
    prefix_stats,
    ranking_audit,
    ranking_statistics,
)
from cli.main import app
from rollout_store import Store, connect
from rollout_store.schema import CREDITS
from rollout_store.store import now_utc
from rollout_store.tree import Node, Tree
from train.envs.base import Task
from train.envs.workflow import (
    TOOLS,
    TabularPolicy,
    WorkflowEnv,
    WorkflowModel,
    action_text,
)
from train.policies.base import Continuation, Policy, SampleConfig, Transcript
from train.sampling import references as references_module
from train.sampling.references import (
    ReferenceConfig,
    ReferenceJobError,
    collect_references,
)

runner = CliRunner()
POLICY_VERSION = "tabular-uniform"  # the fallback adapter's version


# ----- a tabular policy behind the Policy protocol, and trees built with it ------------------


class TabularTextPolicy:
    """The uniform ``TabularPolicy`` of each workflow task behind the ``Policy`` protocol.

    A fallback for ``train.policies.load_policy("tabular", "workflow")`` (written
    beside this work; ``tabular_policy`` prefers it when it loads). A transcript's
    task is found by its prompt; its state by the last state line. One "token" per
    action: the tool's index, with its exact logprob and entropy.
    """

    def __init__(self, tasks: Sequence[Task]) -> None:
        self.by_prompt = {t.prompt: TabularPolicy(WorkflowModel.from_config(t.config))
                          for t in tasks}

    @property
    def policy_version(self) -> str:
        return POLICY_VERSION

    @property
    def policy_ref(self) -> str | None:
        return "tabular"

    def _state(self, transcript: Transcript) -> tuple[TabularPolicy, object]:
        policy = self.by_prompt[transcript[0][1]]
        key = policy.model.key_from_text(transcript[-1][1])
        if key is None:
            raise ValueError(f"no state line in {transcript[-1][1][-80:]!r}")
        return policy, key

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        rng = random.Random(config.seed)
        out = []
        for transcript in transcripts:
            policy, key = self._state(transcript)
            conts = []
            for _ in range(config.n):
                text = policy.sample(key, rng)  # type: ignore[arg-type]
                tool = TOOLS.index(json.loads(text[len("<tool_call>"):-len("</tool_call>")])
                                   ["name"])
                conts.append(Continuation(text, [tool],
                                          [policy.log_prob(key, text)],  # type: ignore[arg-type]
                                          [policy.entropy(key)]))  # type: ignore[arg-type]
            out.append(conts)
        return out

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        return [np.array([self._state(t)[0].log_prob(self._state(t)[1], a)])  # type: ignore[arg-type]
                for t, a in zip(transcripts, actions, strict=True)]


def tabular_policy(tasks: Sequence[Task]) -> Policy:
    """The uniform tabular policy: the ``tabular`` backend when it loads, else the adapter.
    Both draw each valid tool with probability 1/|valid tools|, which is what the oracle
    (``TabularPolicy(model).values()``, uniform logits) assumes."""
    try:
        from train.policies import load_policy

        return load_policy("tabular", "workflow")
    except (ImportError, ValueError):
        return TabularTextPolicy(tasks)


def build_tree(env: WorkflowEnv, policy: TabularPolicy, task: Task, tree_id: str,
               rng: random.Random, n_branch: int = 3, version: str = POLICY_VERSION) -> Tree:
    """One trajectory sampled with ``policy``, then at ``n_branch`` of its inner nodes one
    extra child per other valid tool (environment restored from the node's snapshot),
    each continued with the policy to the end: a tree whose branching children differ."""
    prompt = env.reset(task)
    nodes = [Node(0, None, kind="prompt", observation_text=prompt, snapshot_id=f"{tree_id}/0")]
    snaps = {0: env.snapshot()}
    done: dict[int, bool] = {0: False}

    def step(parent: int, action: str, key: int) -> int:
        env.restore(snaps[parent])
        env.reseed(key)
        result = env.step(action)
        nid = len(nodes)
        reward = float(result.reward_parts["reward"]) if result.done else None
        nodes.append(Node(nid, parent, action_text=action, observation_text=result.observation,
                          terminal=result.done, reward=reward,
                          reward_parts=dict(result.reward_parts) if result.done else {},
                          snapshot_id=f"{tree_id}/{nid}"))
        snaps[nid], done[nid] = env.snapshot(), result.done
        return nid

    def rollout(start: int) -> list[int]:
        path = [start]
        while not done[path[-1]]:
            env.restore(snaps[path[-1]])
            path.append(step(path[-1], policy.sample(env.state, rng), rng.getrandbits(32)))
        return path

    trunk = rollout(0)
    inner = trunk[:-1]
    for v in rng.sample(inner, min(n_branch, len(inner))):
        env.restore(snaps[v])
        taken = nodes[trunk[trunk.index(v) + 1]].action_text
        for tool in env.model.valid_tools(env.state):
            if action_text(tool) != taken:
                rollout(step(v, action_text(tool), rng.getrandbits(32)))
    return Tree(tree_id, nodes, run_id="test", task_id=task.task_id, env="workflow",
                sampler="test-branch", env_config={"task": task.config,
                                                   "max_steps": task.max_steps},
                policy_version=version, policy_ref="tabular", seed=0,
                snapshots={f"{tree_id}/{n.node_id}": snaps[n.node_id] for n in nodes})


def credit_table(method: str, values: dict[tuple[str, int], float],
                 params_hash: str | None = None) -> pa.Table:
    n = len(values)
    return pa.table({
        "run_id": ["test"] * n, "method": [method] * n,
        "method_params_hash": [params_hash or f"{method}-h"] * n, "method_params": ["{}"] * n,
        "tree_id": [t for t, _ in values], "node_id": [nid for _, nid in values],
        "value": list(values.values()), "token_values": [None] * n,
        "policy_version": [POLICY_VERSION] * n, "created_at": [now_utc()] * n,
        "clip_low": [None] * n, "clip_high": [None] * n,
    }, schema=CREDITS)


def workflow_store(path: Path, n_trees: int, seed: int = 0) -> tuple[Store, Policy]:
    """Trees on ``n_trees`` workflow tasks sampled with the uniform tabular policy (whose
    ``policy_version`` they record), with ``oracle`` and ``random`` credits."""
    tasks = WorkflowEnv.generate_tasks(n_trees, seed=seed)
    policy = tabular_policy(tasks)
    env = WorkflowEnv()
    rng = random.Random(seed)
    trees = []
    oracle: dict[tuple[str, int], float] = {}
    noise: dict[tuple[str, int], float] = {}
    for i, task in enumerate(tasks):
        tab = TabularPolicy(WorkflowModel.from_config(task.config))
        tree = build_tree(env, tab, task, f"t{i:03d}", rng, version=policy.policy_version)
        values = tab.values().tree_values(
            [n.node_id for n in tree.nodes], [n.parent_id for n in tree.nodes],
            [n.action_text for n in tree.nodes], [n.observation_text for n in tree.nodes])
        for nid, v in values.items():
            oracle[(tree.tree_id, nid)] = v
            noise[(tree.tree_id, nid)] = rng.random()
        trees.append(tree)
    store = Store(path, create=True)
    store.append_trees(trees, key="trees")
    store.append_credits(credit_table("oracle", oracle), key="oracle")
    store.append_credits(credit_table("random", noise), key="random")
    return store, policy


@pytest.fixture(scope="module")
def wf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, Policy]:
    """One store shared by the workflow tests: 40 trees, references at k=4 and k=64."""
    store, policy = workflow_store(tmp_path_factory.mktemp("wf") / "store", 40)
    for k in (4, 64):
        collect_references(store, ReferenceConfig(k=k, seed=1), policy=policy, progress=False)
    return store, policy


# ----- the statistics against scipy and loops ----------------------------------------------


def random_groups(rng: np.random.Generator, n_groups: int, n_methods: int = 2
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tree, group, q, scores) with many ties: integer-valued references and scores."""
    sizes = rng.integers(2, 9, n_groups)
    group = np.repeat(np.arange(n_groups), sizes)
    tree = group // 4
    q = rng.integers(0, 5, len(group)) / 4
    scores = np.column_stack([rng.integers(0, 4, len(group)).astype(float),
                              *(rng.normal(size=len(group)) for _ in range(n_methods - 1))])
    return tree, group, q, scores


@pytest.mark.parametrize("small_prefix", [0, 5, 16])  # pair loop only, both roads, matrices
def test_tau_b_equals_scipy_on_every_prefix(small_prefix: int) -> None:
    rng = np.random.default_rng(0)
    tree, group, q, scores = random_groups(rng, 600)
    tau = prefix_stats(tree, group, q, scores, pair_chunk=97,  # chunks split prefixes
                       small_prefix=small_prefix).tau_b()
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    bounds = np.r_[starts, len(group)]
    checked = skipped = zeroed = 0
    for g in range(len(starts)):
        sl = slice(bounds[g], bounds[g + 1])
        for m in range(scores.shape[1]):
            want = scipy.stats.kendalltau(scores[sl, m], q[sl], variant="b").statistic
            if np.isnan(want):  # scipy: undefined when either side is constant
                if len(set(q[sl])) == 1:
                    assert np.isnan(tau[g, m])  # E11: skipped
                    skipped += 1
                else:
                    assert tau[g, m] == 0.0  # [R] all scores tied: 0
                    zeroed += 1
            else:
                assert tau[g, m] == pytest.approx(want, abs=1e-12)
                checked += 1
    assert checked > 900 and skipped > 5 and zeroed > 5


def test_pairwise_accuracy_and_pooled_tau_equal_loops_over_pairs() -> None:
    rng = np.random.default_rng(1)
    tree, group, q, scores = random_groups(rng, 300)
    stats = ranking_statistics(tree, group, q, scores, ["ints", "normal"], n_boot=0)
    for m, ms in enumerate(stats.methods):
        hits = pairs = 0.0
        conc = untied_s = untied_q = 0
        taus = []
        for g in np.unique(group):
            idx = np.flatnonzero(group == g)
            if len(set(q[idx])) == 1:
                continue
            for i, j in itertools.combinations(idx, 2):
                ds = np.sign(scores[i, m] - scores[j, m])
                dq = np.sign(q[i] - q[j])
                conc += int(ds * dq)
                untied_s += ds != 0
                untied_q += dq != 0
                if dq != 0:
                    pairs += 1
                    hits += 1.0 if ds == dq else 0.5 if ds == 0 else 0.0
            t = scipy.stats.kendalltau(scores[idx, m], q[idx], variant="b").statistic
            taus.append(0.0 if np.isnan(t) else t)
        assert ms.pairwise_accuracy.value == pytest.approx(hits / pairs, abs=1e-12)
        assert ms.n_pairs == pairs and ms.n_prefixes == len(taus)
        assert ms.tau_b_macro.value == pytest.approx(np.mean(taus), abs=1e-12)
        assert ms.tau_b_pooled.value == pytest.approx(conc / math.sqrt(untied_s * untied_q),
                                                      abs=1e-12)


def test_hand_computed_prefixes() -> None:
    """Two prefixes: (s, q) = (3,1), (2,.5), (1,0) -> perfect; (1,1), (1,0), (0,.5)."""
    tree = np.array([0, 0, 0, 1, 1, 1])
    group = np.array([0, 0, 0, 1, 1, 1])
    q = np.array([1.0, 0.5, 0.0, 1.0, 0.0, 0.5])
    s = np.array([3.0, 2.0, 1.0, 1.0, 1.0, 0.0])
    stats = ranking_statistics(tree, group, q, s, ["m"], n_boot=0).methods[0]
    # Prefix 2: pairs (a,b): s tie, q differ -> ½; (a,c): concordant; (b,c): s 1>0, q 0<.5
    # discordant. n_c - n_d = 0, n_0 - n_1 = 2, n_0 - n_2 = 3 -> τ_b = 0.
    assert stats.pairwise_accuracy.value == pytest.approx((3 + 1.5) / 6)
    assert stats.tau_b_macro.value == pytest.approx((1.0 + 0.0) / 2)
    assert stats.tau_b_pooled.value == pytest.approx(3 / math.sqrt(5 * 6))
    assert (stats.n_prefixes, stats.n_pairs, stats.n_prefixes_score_tied) == (2, 6, 0)


def test_bootstrap_resamples_trees_and_pairs_methods() -> None:
    rng = np.random.default_rng(2)
    tree, group, q, scores = random_groups(rng, 400)
    a = ranking_statistics(tree, group, q, scores, ["x", "y"], n_boot=500, seed=3)
    b = ranking_statistics(tree, group, q, scores, ["x", "y"], n_boot=500, seed=3)
    assert a.methods == b.methods and a.differences == b.differences  # seeded
    d = a.differences[0]
    assert d.pairwise_accuracy.value == pytest.approx(
        a.methods[0].pairwise_accuracy.value - a.methods[1].pairwise_accuracy.value)
    for est in (a.methods[0].pairwise_accuracy, a.methods[0].tau_b_macro, d.tau_b_pooled):
        assert est.ci[0] <= est.value <= est.ci[1]
    # The same score twice: a paired difference of exactly 0 in every resample.
    same = ranking_statistics(tree, group, q, scores[:, [0, 0]], ["x", "x2"], n_boot=200)
    assert same.differences[0].tau_b_macro.ci == (0.0, 0.0)


@pytest.mark.slow
def test_bootstrap_interval_covers_the_true_value_at_its_nominal_rate() -> None:
    """Percentile tree-bootstrap 95% intervals over 1,000 simulated studies of 100 trees
    (3 prefixes of 2-5 children each; q = Binomial(16, p)/16, scores p + noise) cover
    the population value (from one study of 200,000 trees) about 95% of the time.
    Measured: 0.93-0.945 for every statistic (percentile intervals run slightly short)."""
    rng = np.random.default_rng(7)

    def study(n_trees: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        sizes = rng.integers(2, 6, n_trees * 3)
        group = np.repeat(np.arange(len(sizes)), sizes)
        tree = group // 3
        p = rng.beta(1.5, 1.5, len(group))
        q = rng.binomial(16, p) / 16
        scores = np.column_stack([p + rng.normal(0, 0.15, len(p)),
                                  p + rng.normal(0, 0.4, len(p))])
        return tree, group, q, scores

    def estimates(s: RankingStatistics) -> list[Estimate]:
        m, d = s.methods[0], s.differences[0]
        return [m.pairwise_accuracy, m.tau_b_macro, m.tau_b_pooled,
                d.pairwise_accuracy, d.tau_b_macro, d.tau_b_pooled]

    truth = [e.value for e in estimates(ranking_statistics(*study(200_000), ["a", "b"],
                                                           n_boot=0))]
    hits = np.zeros(len(truth))
    reps = 1000
    for r in range(reps):
        got = estimates(ranking_statistics(*study(100), ["a", "b"], n_boot=800, seed=r))
        hits += [e.ci[0] <= w <= e.ci[1] for e, w in zip(got, truth, strict=True)]
    coverage = hits / reps
    assert np.all((coverage > 0.915) & (coverage < 0.975)), coverage
    assert 0.925 < coverage.mean() < 0.965, coverage


# ----- the audit on workflow trees, references sampled for real ----------------------------


def test_oracle_reaches_tau_near_one_as_k_grows(wf: tuple[Store, Policy]) -> None:
    store, _ = wf
    small = ranking_audit(store, RankingConfig(("oracle", "random"), k=4, n_boot=300))
    large = ranking_audit(store, RankingConfig(("oracle", "random"), k=64, n_boot=300))
    o4, o64 = small.stats.method("oracle"), large.stats.method("oracle")
    assert o64.tau_b_macro.value > 0.8 and o64.tau_b_pooled.value > 0.8
    assert o64.pairwise_accuracy.value > 0.85
    assert o64.tau_b_macro.value > o4.tau_b_macro.value
    assert o64.tau_b_pooled.value > o4.tau_b_pooled.value
    # More rollouts separate more children: fewer prefixes with every reference tied.
    assert large.stats.n_prefixes_reference_tied < small.stats.n_prefixes_reference_tied
    diff = large.stats.differences[0]  # oracle - random
    assert diff.tau_b_macro.ci[0] > 0.5


def test_random_score_is_centred_on_zero(wf: tuple[Store, Policy]) -> None:
    store, _ = wf
    result = ranking_audit(store, RankingConfig(("random",), k=64, n_boot=500))
    m = result.stats.methods[0]
    assert m.tau_b_macro.ci[0] < 0.0 < m.tau_b_macro.ci[1]
    assert m.pairwise_accuracy.ci[0] < 0.5 < m.pairwise_accuracy.ci[1]
    # Many random scores on the same prefixes: mean τ_b within a few standard errors of 0.
    d = result.data
    rng = np.random.default_rng(0)
    noise = rng.random((len(d.q), 300))
    stats = ranking_statistics(d.tree, d.group, d.q, noise, [str(i) for i in range(300)],
                               n_boot=0)
    taus = np.array([s.tau_b_macro.value for s in stats.methods])
    assert abs(taus.mean()) < 4 * taus.std() / math.sqrt(len(taus))
    accs = np.array([s.pairwise_accuracy.value for s in stats.methods])
    assert abs(accs.mean() - 0.5) < 4 * accs.std() / math.sqrt(len(accs))


def test_references_are_unbiased_estimates_of_the_exact_values(
        wf: tuple[Store, Policy]) -> None:
    """successes ~ Binomial(k, p) with p the oracle value: the job continues each child
    from its own snapshot and transcript, with the tree's policy."""
    store, _ = wf
    rows = connect(store).sql("""
        SELECT r.successes, r.k, c.value FROM mc_references r
        JOIN credits c USING (tree_id, node_id) WHERE c.method = 'oracle'""").fetchall()
    for k in (4, 64):
        got = np.array([(s, p) for s, kk, p in rows if kk == k])
        assert len(got) == connect(store).sql("SELECT count(*) FROM siblings").fetchall()[0][0]
        p = got[:, 1]
        z = (got[:, 0] - k * p).sum() / math.sqrt((k * p * (1 - p)).sum())
        assert abs(z) < 4, z
        sure = (p == 0) | (p == 1)  # dead or certain children: exactly 0 or k successes
        assert np.array_equal(got[sure, 0], k * p[sure])


def test_references_are_reused_on_rerun(wf: tuple[Store, Policy]) -> None:
    store, policy = wf
    version = store.version()
    report = collect_references(store, ReferenceConfig(k=64, seed=1), policy=policy,
                                progress=False)
    assert (report.sampled, report.commits, report.rollouts) == (0, 0, 0)
    assert report.reused == report.children > 0
    assert store.version() == version
    # The tree's own policy (policy=None) is not even loaded when nothing is missing.
    again = collect_references(store, ReferenceConfig(k=4, seed=1), progress=False)
    assert again.sampled == 0 and store.version() == version


def test_reference_job_is_deterministic_and_keyed(tmp_path: Path) -> None:
    a, policy = workflow_store(tmp_path / "a", 6, seed=3)
    b, _ = workflow_store(tmp_path / "b", 6, seed=3)
    for s in (a, b):
        collect_references(s, ReferenceConfig(k=8, seed=5, commit_children=7),
                           policy=policy, progress=False)
    query = "SELECT tree_id, node_id, successes FROM mc_references ORDER BY ALL"
    assert connect(a).sql(query).fetchall() == connect(b).sql(query).fetchall()
    # The same children under the same settings commit under the same keys (idempotent).
    def keys(store: Store) -> list[str]:
        return sorted(e["rollout_trees.commit_key"]
                      for e in store.delta_table("mc_references").history()
                      if "rollout_trees.commit_key" in e)

    assert keys(a) == keys(b) and len(keys(a)) > 1
    assert all(k.startswith("mcref:") for k in keys(a))
    report = collect_references(b, ReferenceConfig(k=8, seed=6), policy=policy, progress=False)
    assert report.sampled == 0  # another seed does not resample what is stored


def test_missing_credits_name_the_command(wf: tuple[Store, Policy]) -> None:
    store, _ = wf
    with pytest.raises(RankingError, match=r"rtrees credit --store .* --method elpo"):
        ranking_audit(store, RankingConfig(("oracle", "elpo"), k=64, n_boot=0))
    with pytest.raises(RankingError, match=r"no branching node"):
        ranking_audit(store, RankingConfig(("oracle",), k=5, n_boot=0))
    result = runner.invoke(app, ["audit", "ranking", "--store", str(store.path), "--methods",
                                 "oracle,grpo", "--k", "64", "--out", "/nonexistent/x"])
    assert result.exit_code == 1
    assert "rtrees credit --store" in result.output and "--method grpo" in result.output


def test_partial_credit_and_partial_references(tmp_path: Path) -> None:
    store, policy = workflow_store(tmp_path / "s", 4, seed=9)
    con = connect(store)
    first = con.sql("""SELECT tree_id, parent_id, min(child_id) FROM siblings
                       GROUP BY ALL ORDER BY ALL LIMIT 1""").fetchall()[0]
    # A reference for one child of one prefix only: that prefix is left out and counted.
    rows = pa.table({"run_id": ["x"], "tree_id": [first[0]], "node_id": [first[2]], "k": [3],
                     "successes": [1], "policy_version": [policy.policy_version],
                     "created_at": [now_utc()]}).cast(store_schema("mc_references"))
    store.append_mc_references(rows, key="partial")
    with pytest.raises(RankingError, match="no branching node"):
        ranking_audit(store, RankingConfig(("oracle",), k=3, n_boot=0))
    collect_references(store, ReferenceConfig(k=3), policy=policy,
                       tree_ids=[first[0]], progress=False)
    result = ranking_audit(store, RankingConfig(("oracle",), k=3, n_boot=0))
    assert result.stats.n_trees == 1
    assert result.data.n_prefixes_missing_reference == 0  # the job completed that prefix
    assert result.data.n_prefixes_branching == con.sql(
        "SELECT count(DISTINCT (tree_id, parent_id)) FROM siblings").fetchall()[0][0]
    # A method with credit for other trees only: an error naming the method ...
    elsewhere = con.sql(f"SELECT tree_id, node_id FROM nodes WHERE tree_id <> '{first[0]}'"
                        ).fetchall()
    store.append_credits(credit_table("partial", {(t, n): 0.0 for t, n in elsewhere}),
                         key="p")
    with pytest.raises(RankingError, match=r"'partial'.*1 of 1 audited trees"):
        ranking_audit(store, RankingConfig(("oracle", "partial"), k=3, n_boot=0))
    # ... or, for report rebuilds, the method is left out with the reason.
    dropped = ranking_audit(store, RankingConfig(("oracle", "partial"), k=3, n_boot=0),
                            on_missing_credit="drop")
    assert list(dropped.data.labels) == ["oracle"] and "partial" in dropped.dropped_methods


def store_schema(name: str) -> pa.Schema:
    from rollout_store.schema import SCHEMAS

    return SCHEMAS[name]  # type: ignore[index]


def test_method_hash_selection(tmp_path: Path) -> None:
    store, policy = workflow_store(tmp_path / "s", 4, seed=2)
    collect_references(store, ReferenceConfig(k=4), policy=policy, progress=False)
    con = connect(store)
    ids = con.sql("SELECT tree_id, node_id FROM nodes").fetchall()
    old = credit_table("noisy", {(t, n): 1.0 for t, n in ids}, "aaa111")
    new = credit_table("noisy", {(t, n): float(n) for t, n in ids}, "bbb222")
    store.append_credits(old, key="old")
    store.append_credits(new, key="new")  # written last: the default
    latest = ranking_audit(store, RankingConfig(("noisy",), k=4, n_boot=0))
    named = ranking_audit(store, RankingConfig(("noisy@aaa",), k=4, n_boot=0))
    assert latest.methods[0].params_hash == "bbb222"
    assert named.methods[0].params_hash == "aaa111"
    assert named.stats.methods[0].tau_b_macro.value == 0.0  # constant score: τ_b := 0
    assert named.stats.methods[0].pairwise_accuracy.value == 0.5
    with pytest.raises(RankingError, match="no noisy parameter hashes start with 'zzz'"):
        ranking_audit(store, RankingConfig(("noisy@zzz",), k=4, n_boot=0))


# ----- the command line and the report -----------------------------------------------------


def test_cli_ranking_writes_results_and_report_rebuilds_them(
        wf: tuple[Store, Policy], tmp_path: Path) -> None:
    store, _ = wf
    out = tmp_path / "ranking"
    result = runner.invoke(app, ["audit", "ranking", "--store", str(store.path), "--methods",
                                 "oracle,random", "--k", "64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "0 children sampled" in result.output  # every reference was already there
    doc = json.loads((out / "results.json").read_text())
    for name in ("oracle", "random"):
        m = doc["methods"][name]
        assert set(m) >= {"pairwise_accuracy", "kendall_tau_b", "n_prefixes", "ci", "n_pairs"}
        assert set(m["kendall_tau_b"]) == {"macro", "pooled"}
        lo, hi = m["ci"]["pairwise_accuracy"]
        assert lo <= m["pairwise_accuracy"] <= hi
    assert doc["paired_differences"]["oracle-random"]["kendall_tau_b"]["macro"]["estimate"] > 0
    for f in ("report.md", "ranking.png", "score_vs_reference.png"):
        assert (out / f).stat().st_size > 0
    assert "Paired differences" in (out / "report.md").read_text()

    rebuilt = tmp_path / "reports"
    result = runner.invoke(app, ["audit", "report", "--store", str(store.path), "--out",
                                 str(rebuilt)])
    assert result.exit_code == 0, result.output
    again = json.loads((rebuilt / "ranking-k64" / "results.json").read_text())
    assert again["methods"] == doc["methods"]  # same store, bootstrap and seed
    assert (rebuilt / "ranking-k4" / "results.json").exists()
    index = (rebuilt / "report.md").read_text()
    assert "ranking-k4/report.md" in index and "ranking-k64/report.md" in index


def test_cli_runs_the_reference_job_with_the_trees_policy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, policy = workflow_store(tmp_path / "s", 5, seed=4)
    loaded: list[tuple[str, str]] = []

    def load(spec: object, env: str) -> Policy:
        loaded.append((str(spec), env))
        return policy

    monkeypatch.setattr(references_module, "resolve_policy", load)
    args = ["audit", "ranking", "--store", str(store.path), "--methods", "oracle", "--k", "8",
            "--out", str(tmp_path / "out"), "--bootstrap", "100"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert loaded == [("tabular", "workflow")]  # trees.policy_ref, once
    n = connect(store).sql("SELECT count(*) FROM mc_references WHERE k = 8").fetchall()[0][0]
    assert n == connect(store).sql("SELECT count(*) FROM siblings").fetchall()[0][0]
    version = store.version()
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and store.version() == version  # reused, nothing committed
    assert "0 children sampled" in result.output

    class Retrained:
        """The same actions under another version: what a retrained checkpoint looks like."""

        policy_version, policy_ref = "retrained", None
        sample, score = policy.sample, policy.score

    other = Retrained()
    monkeypatch.setattr(references_module, "resolve_policy", lambda spec, env: other)
    with pytest.raises(ReferenceJobError, match="now loads version 'retrained'"):
        collect_references(store, ReferenceConfig(k=2), progress=False)
    # --policy samples references with another policy, kept apart by policy_version.
    result = runner.invoke(app, [*args[:-4], "--out", str(tmp_path / "o2"), "--policy", "x",
                                 "--bootstrap", "0"])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "o2" / "results.json").read_text())
    assert doc["reference_policy"] == "retrained"
    rows = connect(store).sql("SELECT DISTINCT policy_version FROM mc_references "
                              "WHERE k = 8 ORDER BY 1").fetchall()
    assert rows == [("retrained",), (policy.policy_version,)]
    # --policy naming the very policy that collected the trees (same weights, same
    # version): its references are the ones already stored, found and reused (this
    # stopped with "no branching node ... has references" while the named version was
    # coded apart from the trees' own).
    monkeypatch.setattr(references_module, "resolve_policy", lambda spec, env: policy)
    version = store.version()
    result = runner.invoke(app, [*args[:-4], "--out", str(tmp_path / "o3"), "--policy",
                                 "tabular", "--bootstrap", "0"])
    assert result.exit_code == 0, result.output
    assert "0 children sampled" in result.output and store.version() == version
    doc = json.loads((tmp_path / "o3" / "results.json").read_text())
    assert doc["reference_policy"] == policy.policy_version
    assert doc["coverage"]["n_pairs"] > 0


def test_split_by_run_and_sampler(wf: tuple[Store, Policy]) -> None:
    """``--by``: one group holding every tree is the pooled audit, intervals included; a
    subset of trees is the audit of those trees' rows alone."""
    store, _ = wf
    for by in ("run", "sampler"):
        res = ranking_audit(store, RankingConfig(("oracle", "random"), k=4, n_boot=200,
                                                 by=by))
        assert len(res.groups) == 1
        (group,) = res.groups.values()
        for m in ("oracle", "random"):
            assert group.method(m).pairwise_accuracy == res.stats.method(m).pairwise_accuracy
            assert group.method(m).tau_b_macro == res.stats.method(m).tau_b_macro
        assert res.to_json()["by"] == by
    data = res.data
    even = np.arange(len(data.tree_ids)) % 2 == 0
    part = data.subset(even)
    rows = even[data.tree]
    assert np.array_equal(part.q, data.q[rows])
    manual = ranking_statistics(data.tree[rows], group_index([data.tree[rows],
                                                              data.parent_id[rows]]),
                                data.q[rows], data.scores[rows], data.labels, n_boot=0)
    got = part.statistics(n_boot=0)
    assert got.method("oracle").pairwise_accuracy.value == \
        manual.method("oracle").pairwise_accuracy.value
    with pytest.raises(ValueError, match="by must be one of"):
        RankingConfig(("oracle",), by="task")  # type: ignore[arg-type]


def test_factor_and_sgcd_are_audited(tmp_path: Path) -> None:
    """issue 24: factor's TD credit and sgcd's node credit go through ``rtrees credit`` and
    ``rtrees audit ranking`` like every estimator (teacher weights off: the tabular policy
    has no text to score)."""
    store, policy = workflow_store(tmp_path / "s", 6, seed=4)
    collect_references(store, ReferenceConfig(k=8, seed=1), policy=policy, progress=False)
    for method, param in (("factor", "eta=0"), ("sgcd", "kappa=0")):
        result = runner.invoke(app, ["credit", "--store", str(store.path), "--method", method,
                                     "--param", param])
        assert result.exit_code == 0, result.output
    out = tmp_path / "ranking"
    result = runner.invoke(app, ["audit", "ranking", "--store", str(store.path), "--methods",
                                 "factor,sgcd,oracle", "--k", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "results.json").read_text())
    for name in ("factor", "sgcd"):
        m = doc["methods"][name]
        assert m["n_prefixes"] > 0 and 0.0 <= m["pairwise_accuracy"] <= 1.0
