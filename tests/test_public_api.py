"""The documented public surface (issue 45 item 3): the package faces resolve every name
they list, lazily, and a script in a temporary directory outside the repository logs,
credits, audits and reads trees back through those faces alone.

``rollout_store.TreeLogger``'s own rules (parents, rewards at leaves, retries) are
checked here too.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout_store import PREVIOUS, Step, Store, TreeLogger, connect, read_trees

ROOT = Path(__file__).resolve().parents[1]
FACES = ("rollout_store", "train", "train.sampling", "train.policies", "analysis")


@pytest.mark.parametrize("face", FACES)
def test_every_listed_name_resolves(face: str) -> None:
    module = importlib.import_module(face)
    names = list(module.__all__)
    assert len(set(names)) == len(names)
    for name in names:
        if name == "TreeLoggerCallback" and importlib.util.find_spec("trl") is None:
            continue  # the trl extra; tests/test_trl_callback.py covers it
        assert getattr(module, name) is not None, f"{face}.{name}"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        module.nope  # noqa: B018


def test_faces_are_lazy() -> None:
    """Importing the faces loads no torch, no samplers, no trainer (a fresh interpreter)."""
    code = ("import sys, train, analysis, train.sampling, train.policies; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'trl') or "
            "m.startswith(('train.trainer', 'train.sampling.', 'train.credit', "
            "'analysis.ranking', 'analysis.viewer'))); print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr


SCRIPT = '''
from pathlib import Path

from analysis import RankingConfig, ranking_audit
from rollout_store import Step, TreeLogger, connect, read_trees
from train import ReferenceConfig, collect_references, compute_credits

# 1. log: three GRPO groups (flat lists of completions) and one branching tree
with TreeLogger("trees", run_id="my-run") as log:
    for q, (a, b) in enumerate([(2, 3), (4, 1), (6, 6)]):
        answers = [str(a + b), "7", str(a + b), "0"]
        rewards = [1.0 if x == str(a + b) else 0.0 for x in answers]
        log.group(f"{a}+{b}=", answers, rewards, policy_version="step-0",
                  advantages=[0.5, -0.5, 0.5, -0.5] if q < 2 else [-0.5, 0.5, -0.5, 0.5],
                  prompt_token_ids=[10 + a, 11, 10 + b, 12])
    log.tree("book a flight", [
        Step("search()", token_ids=[5, 6], logprobs=[-0.1, -0.2], observation="3 found"),
        Step("book(1)", token_ids=[7], logprobs=[-0.3], reward=1.0),
        Step("book(2)", token_ids=[8], logprobs=[-2.0], reward=0.0, parent=0),
        Step("give up", reward=0.0, parent=None),
    ], policy_version="step-0")
assert log.report.trees == 4 and log.report.credits == 12, log.report

# 2. read back
trees = {t.task_id: t for t in read_trees("trees")}
assert len(trees) == 4
branchy = next(t for t in trees.values() if t.root().observation_text == "book a flight")
assert [(n.node_id, n.parent_id) for n in branchy.preorder()] == \\
    [(0, None), (1, 0), (2, 1), (3, 1), (4, 0)]
# logprobs are stored to about four significant digits (rollout_store/precision.py)
assert [round(x, 3) for x in branchy.node(1).action_logprobs] == [-0.1, -0.2]
assert [n.node_id for n in branchy.leaves()] == [2, 3, 4]
group = next(t for t in trees.values() if t.root().observation_text == "2+3=")
assert group.root().observation_token_ids == [12, 11, 13, 12]
assert [n.reward for n in group.leaves()] == [1.0, 0.0, 1.0, 0.0]

# 3. credit: GRPO's z-scores, winners above losers, summing to zero per group
report = compute_credits(log.store, "grpo", progress=False)
assert report.trees_done == 4, report
con = connect(log.store)
rows = con.execute("SELECT tree_id, node_id, value FROM credits WHERE method = 'grpo' "
                   "AND node_id > 0").fetchall()
by_tree = {}
for tree_id, node_id, value in rows:
    by_tree.setdefault(tree_id, {})[node_id] = value
g = by_tree[group.tree_id]
assert g[1] == g[3] > 0 > g[2] == g[4] and abs(sum(g.values())) < 1e-9

# 4. audit: references for leaf children need no policy (successes are k or 0); the
# branching tree's root has a non-leaf child, which would need an environment snapshot
groups = [t.tree_id for t in trees.values() if t is not branchy]
refs = collect_references(log.store, ReferenceConfig(k=1), tree_ids=groups, progress=False)
assert refs.leaves == refs.children == 12 and refs.rollouts == 0, refs.summary()
result = ranking_audit(log.store, RankingConfig(("grpo", "source_advantage"), k=1,
                                                n_boot=100))
stats = {m.label: m for m in result.stats.methods}
assert result.stats.n_prefixes == 3 and result.stats.n_trees == 3
assert stats["grpo"].pairwise_accuracy.value == 1.0
# the third group's advantages were logged with the wrong sign: the audit sees it
assert stats["source_advantage"].pairwise_accuracy.value < 0.75
print("public API OK", stats["source_advantage"].pairwise_accuracy.value)
'''


def test_public_api_from_a_directory_outside_the_repository(tmp_path: Path) -> None:
    """Log, credit, audit and read back from ``tmp_path`` with the faces' imports only."""
    (tmp_path / "use_api.py").write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "use_api.py"], cwd=tmp_path, capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "public API OK" in out.stdout
    assert (tmp_path / "trees").is_dir() and not (ROOT / "trees").exists()


# ----- TreeLogger's rules -------------------------------------------------------------


def test_default_parents_make_a_chain_and_leaves_take_the_rewards(tmp_path: Path) -> None:
    with TreeLogger(tmp_path / "s", run_id="r") as log:
        t = log.tree("p", [Step("a"), Step("b"), Step("c", reward=0.5)])
    assert [(n.node_id, n.parent_id, n.terminal) for n in t.nodes] == \
        [(0, None, False), (1, 0, False), (2, 1, False), (3, 2, True)]
    assert PREVIOUS == -1 and t.budget == 1
    (back,) = read_trees(Store(tmp_path / "s"))
    assert back.node(3).reward == 0.5 and back.run_id == "r" and back.env == "external"


@pytest.mark.parametrize("steps,message", [
    ([Step("a")], "step 0 is a leaf .* but has no reward"),
    ([Step("a", reward=1.0), Step("b", reward=1.0)], "step 0 has a reward but is not a leaf"),
    ([Step("a", reward=1.0, parent=0)], r"step 0 parent must be an earlier step's index"),
    ([Step("a"), Step("b", reward=1.0, parent=3)], "step 1 parent must be"),
    ([Step("a", token_ids=[1, 2], logprobs=[float("nan"), 0.0], reward=1.0)],
     "step 0 logprobs must be finite"),
    ([Step("a", token_ids=["x"], reward=1.0)], "step 0 token_ids must hold ints"),  # type: ignore[list-item]
    ([], "at least one step"),
])
def test_bad_input_is_one_clear_error_and_buffers_nothing(tmp_path: Path, steps: list[Step],
                                                          message: str) -> None:
    log = TreeLogger(tmp_path / "s")
    with pytest.raises(ValueError, match=message):
        log.tree("p", steps)
    assert log.pending == 0 and log.flush() is None


def test_group_checks_its_lengths_and_token_logprob_pairs(tmp_path: Path) -> None:
    log = TreeLogger(tmp_path / "s")
    with pytest.raises(ValueError, match="rewards has 1 values for 2 completions"):
        log.group("p", ["a", "b"], [1.0])
    with pytest.raises(ValueError, match="length"):  # validate.py's length_mismatch
        log.group("p", [Step("a", token_ids=[1, 2], logprobs=[-0.1])], [1.0])
    assert log.pending == 0


def test_a_retried_flush_stores_each_tree_once(tmp_path: Path) -> None:
    def log_once() -> TreeLogger:
        with TreeLogger(tmp_path / "s", run_id="r") as log:
            log.group("p", ["a", "b"], [1.0, 0.0], advantages=[1.0, -1.0],
                      policy_version="v0")
            log.group("p", ["a", "b"], [1.0, 0.0], policy_version="v0")  # same content
        return log

    first, second = log_once(), log_once()
    assert first.report.tree_ids == second.report.tree_ids
    assert len(set(first.report.tree_ids)) == 2  # the twin got a counter
    assert second.report.already_stored == 2
    con = connect(Store(tmp_path / "s"))
    assert con.execute("SELECT count(*) FROM trees").fetchall()[0][0] == 2
    assert con.execute("SELECT count(*) FROM credits").fetchall()[0][0] == 2


def test_an_exception_in_the_block_commits_nothing_unflushed(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), TreeLogger(tmp_path / "s") as log:
        log.group("p", ["a"], [1.0])
        log.flush()
        log.group("q", ["b"], [0.0])
        raise RuntimeError("boom")
    assert [t.root().observation_text for t in read_trees(Store(tmp_path / "s"))] == ["p"]
