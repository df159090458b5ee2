"""Policy scores of stored text for TRACE (T2) and DSC (D3): computed once, stored, reused.

TRACE needs, at every node, the mean log-probability that a frozen reference policy
gives the task's gold answer after the transcript through that node (T2); DSC needs,
at every node of depth >= 2, the probability the target policy gives the node's own
action after the transcript through its parent (D3). Both are forward passes of a
named policy over stored text. ``score_trees`` computes them for in-memory trees
(the trainer calls it with its frozen reference), ``ensure_scores`` for every stored
tree that lacks them (``rtrees credit --method trace --param ref=SPEC`` /
``--method dsc --param target=SPEC``), and both give rows of the store's
``policy_scores`` table, keyed by (tree_id, node_id, kind, policy_version):

* kind ``gold_answer`` (T2): ``value`` = lbar, ``token_logprobs`` the gold answer's
  per-token log-probs; every node but answer tails (non-root leaves without
  observation, which TRACE does not score);
* kind ``action`` (D3): ``value`` = sum of the log-probs of the node's action text
  after its parent's transcript; ``token_logprobs`` per token; nodes of depth >= 2;
* kind ``plain`` (the student of F3 and Q3): the same for every node of depth >= 1 with
  an action text;
* kind ``hindsight`` (F3 teacher): the action after its parent's transcript with the
  feedback that followed it (the node's observation) appended to the last context turn;
  nodes of depth >= 1 with an action and an observation text;
* kind ``contrast:<summariser>`` (Q3 teacher): the action after its parent's transcript
  with the tree's contrast reference (Q2, ``train.credit.contrast``) appended to the
  prompt; every node of depth >= 1 with an action, in trees that have a reference.

Transcripts are rebuilt from the stored texts exactly as the samplers built them:
``("prompt", root observation)``, then per node ``("action", action_text)``,
``("observation", observation_text)``. The gold answer of a tree is
``<answer>{env_config["answer"]}</answer>`` when the tree records its task's answer;
otherwise the environment's expert is replayed from the root snapshot and its first
answer action is the gold answer [R].
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

import numpy as np
import pyarrow as pa

from rollout_store.reader import connect, read_trees
from rollout_store.schema import POLICY_SCORES
from rollout_store.store import Store, now_utc
from rollout_store.tree import Node, Tree
from train.credit.contrast import Summariser, make_summariser, reference

if TYPE_CHECKING:
    from train.policies.base import Policy, Transcript, Turn

ScoreKind = str
"""A ``policy_scores`` kind: ``GOLD``, ``ACTION``, ``PLAIN``, ``HINDSIGHT`` or
``CONTRAST`` + a summariser spec (module docstring)."""
GOLD: Final[ScoreKind] = "gold_answer"
ACTION: Final[ScoreKind] = "action"
PLAIN: Final[ScoreKind] = "plain"
HINDSIGHT: Final[ScoreKind] = "hindsight"
CONTRAST: Final[str] = "contrast:"
FEEDBACK: Final[str] = "\n\n[feedback of your next step] "
"""F3: what precedes the feedback appended to the teacher's last context turn [R]."""
_TOKEN_KINDS: Final[tuple[str, ...]] = (PLAIN, HINDSIGHT)
_TREES_PER_COMMIT = 32


class ScoreError(RuntimeError):
    """Scores cannot be computed (no gold answer, no policy); the message says why."""


def transcripts(tree: Tree) -> dict[int, Transcript]:
    """The transcript through each node of ``tree`` (T1: S_k for the node at depth k)."""
    out: dict[int, Transcript] = {}
    for n in tree.preorder():
        if n.parent_id is None:
            out[n.node_id] = [("prompt", n.observation_text or "")]
        else:
            out[n.node_id] = [*out[n.parent_id], ("action", n.action_text or ""),
                              ("observation", n.observation_text or "")]
    return out


def is_answer_tail(tree: Tree, node: Node) -> bool:
    """A non-root leaf without observation (the final answer, no TD state; trace.py)."""
    children = tree.children()
    return (node.parent_id is not None and not children[node.node_id]
            and not node.observation_token_ids and not node.observation_text)


def gold_answer(tree: Tree) -> str:
    """The gold answer text y* of a tree's task (module docstring)."""
    config = tree.env_config or {}
    if config.get("answer") is not None:
        return f"<answer>{config['answer']}</answer>"
    root = tree.root()
    state = tree.snapshots.get(root.snapshot_id or "")
    if state is None:
        raise ScoreError(f"tree {tree.tree_id!r} records no gold answer and no root snapshot "
                         "to replay the expert from")
    from train.envs import make_env
    from train.envs.base import parse_action

    env = make_env(tree.env)
    try:
        env.restore(state)
        for _ in range(int(config.get("max_steps", 64)) + 1):
            action = env.expert_action()
            if parse_action(action).kind == "answer":
                return action
            if env.step(action).done:
                break
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        raise ScoreError(f"tree {tree.tree_id!r}: no gold answer ({exc})") from exc
    finally:
        env.close()
    raise ScoreError(f"tree {tree.tree_id!r}: the {tree.env} expert never answered")


def check_kind(kind: str) -> None:
    """Raise ``ScoreError`` for a kind that is not one of the module docstring's."""
    if kind in (GOLD, ACTION, *_TOKEN_KINDS):
        return
    if kind.startswith(CONTRAST):
        try:
            make_summariser(kind[len(CONTRAST):])
        except ValueError as exc:
            raise ScoreError(str(exc)) from exc
        return
    raise ScoreError(f"unknown score kind {kind!r}; choose from "
                     f"{[GOLD, ACTION, *_TOKEN_KINDS, CONTRAST + 'SUMMARISER']}")


def _with_suffix(transcript: Transcript, index: int, suffix: str) -> list[Turn]:
    """``transcript`` with ``suffix`` appended to the text of turn ``index``."""
    turns: list[Turn] = list(transcript)
    role, text = turns[index]
    turns[index] = (role, text + suffix)
    return turns


def teacher_contexts(tree: Tree, kind: str, turns: Mapping[int, Transcript],
                     summarisers: dict[str, Summariser] | None = None
                     ) -> list[tuple[Node, list[Turn]]]:
    """(node, scoring context) of every node scored under ``kind`` (``plain``,
    ``hindsight`` or ``contrast:...``; module docstring): the parent's transcript, with the
    feedback (F3) or the contrast reference (Q2) added for the teachers."""
    out: list[tuple[Node, list[Turn]]] = []
    steps = [n for n in tree.nodes if n.parent_id is not None and n.action_text]
    if kind == PLAIN:
        return [(n, list(turns[n.parent_id])) for n in steps if n.parent_id is not None]
    if kind == HINDSIGHT:
        for n in steps:
            if n.parent_id is not None and n.observation_text:
                out.append((n, _with_suffix(turns[n.parent_id], -1,
                                            FEEDBACK + n.observation_text)))
        return out
    spec = kind[len(CONTRAST):]
    cache = summarisers if summarisers is not None else {}
    if spec not in cache:
        cache[spec] = make_summariser(spec)
    ref = reference(tree, cache[spec])
    if ref is None:
        return out
    for n in steps:
        if n.parent_id is not None:
            out.append((n, _with_suffix(turns[n.parent_id], 0, "\n\n" + ref)))
    return out


def score_trees(trees: Sequence[Tree], policy: Policy, kind: ScoreKind, *,
                policy_ref: str | None = None, run_id: str | None = None,
                gold: Mapping[str, str] | None = None) -> pa.Table:
    """``policy_scores`` rows of ``kind`` for every scorable node of ``trees`` (one forward
    pass per node; module docstring). ``gold`` overrides the gold answer per tree id."""
    check_kind(kind)
    version = str(policy.policy_version)
    pairs: list[tuple[Transcript, str]] = []
    keys: list[tuple[str, int]] = []
    summarisers: dict[str, Summariser] = {}
    for tree in trees:
        turns = transcripts(tree)
        by_id = {n.node_id: n for n in tree.nodes}
        if kind == GOLD:
            y = (gold or {}).get(tree.tree_id) or gold_answer(tree)
            for n in tree.nodes:
                if not is_answer_tail(tree, n):
                    pairs.append((turns[n.node_id], y))
                    keys.append((tree.tree_id, n.node_id))
        elif kind == ACTION:
            for n in tree.nodes:
                parent = by_id.get(n.parent_id) if n.parent_id is not None else None
                if parent is not None and parent.parent_id is not None:  # depth >= 2
                    pairs.append((turns[parent.node_id], n.action_text or ""))
                    keys.append((tree.tree_id, n.node_id))
        else:
            for n, context in teacher_contexts(tree, kind, turns, summarisers):
                pairs.append((context, n.action_text or ""))
                keys.append((tree.tree_id, n.node_id))
    logprobs = policy.score([t for t, _ in pairs], [a for _, a in pairs]) if pairs else []
    values = []
    for (tree_id, node_id), lp in zip(keys, logprobs, strict=True):
        if lp.size == 0:
            raise ScoreError(f"tree {tree_id!r}, node {node_id}: the scored text is empty")
        values.append(float(lp.mean() if kind == GOLD else lp.sum()))
    count = len(keys)
    offsets = np.concatenate([[0], np.cumsum([lp.size for lp in logprobs])]).astype(np.int32)
    flat = np.concatenate(logprobs).astype(np.float32) if count else np.zeros(0, np.float32)
    return pa.table({
        "run_id": pa.array([run_id or f"scores-{kind}-{version}"] * count, pa.string()),
        "tree_id": pa.array([k[0] for k in keys], pa.string()),
        "node_id": pa.array([k[1] for k in keys], pa.int64()),
        "kind": pa.array([kind] * count, pa.string()),
        "policy_version": pa.array([version] * count, pa.string()),
        "policy_ref": pa.array([policy_ref] * count, pa.string()),
        "value": pa.array(values, pa.float64()),
        "token_logprobs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)),
        "created_at": pa.array([now_utc()] * count, POLICY_SCORES.field("created_at").type),
    }, schema=POLICY_SCORES)


def ensure_scores(store: Store, kind: ScoreKind, spec: str, progress: bool = False
                  ) -> tuple[str, int]:
    """Score every stored tree that lacks ``kind`` rows under the policy ``spec``; commit.

    Returns (the scoring policy's version, trees scored now). Trees already scored
    by that version are skipped, so scores are computed once per policy version.
    One environment per store call (the policy is loaded for it).
    """
    from train.policies import load_policy

    con = connect(store)
    envs = [e for (e,) in con.sql("SELECT DISTINCT env FROM trees ORDER BY env").fetchall()]
    if not envs:
        return "", 0
    if len(envs) > 1:
        raise ScoreError(f"the store holds trees of several environments {envs}; score "
                         "them one environment at a time")
    try:
        policy: Policy = load_policy(spec, envs[0])
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise ScoreError(f"cannot load the scoring policy {spec!r}: {exc}") from exc
    version = str(policy.policy_version)
    todo = [t for (t,) in con.execute(
        "SELECT tree_id FROM trees WHERE tree_id NOT IN (SELECT tree_id FROM policy_scores "
        "WHERE kind = $k AND policy_version = $v) ORDER BY tree_id",
        {"k": kind, "v": version}).fetchall()]
    from rich.progress import Progress

    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"scores {kind} ({version})", total=len(todo))
        for start in range(0, len(todo), _TREES_PER_COMMIT):
            ids = todo[start:start + _TREES_PER_COMMIT]
            rows = score_trees(read_trees(store, ids), policy, kind, policy_ref=spec)
            digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]
            store.append_policy_scores(rows, key=f"scores:{kind}:{version}:{digest}")
            bar.advance(task, len(ids))
    return version, len(todo)


def scores_by_node(scores: pa.Table, kind: ScoreKind, version: str
                   ) -> dict[tuple[str, int], float]:
    """(tree_id, node_id) -> value of the ``scores`` rows of ``kind`` and ``version``."""
    out: dict[tuple[str, int], float] = {}
    cols = [scores.column(c).to_pylist() for c in ("tree_id", "node_id", "kind",
                                                   "policy_version", "value")]
    for tree_id, node_id, k, v, value in zip(*cols, strict=True):
        if k == kind and v == version:
            out[(tree_id, int(node_id))] = float(value)
    return out


def stored_scores(store: Store, tree_ids: Sequence[str], kind: ScoreKind, version: str | None
                  ) -> pa.Table:
    """The stored ``policy_scores`` rows of ``tree_ids`` for (kind, version); version None:
    each tree's rows scored by its own ``policy_version``."""
    con = connect(store)
    con.register("_score_trees", pa.table({"tree_id": pa.array(list(tree_ids), pa.string())}))
    if version is None:
        return con.sql("SELECT s.* FROM policy_scores s JOIN trees t USING (tree_id) "
                       "WHERE s.kind = $k AND s.policy_version = t.policy_version "
                       "AND s.tree_id IN (SELECT tree_id FROM _score_trees)",
                       params={"k": kind}).to_arrow_table()
    return con.sql("SELECT * FROM policy_scores WHERE kind = $k AND policy_version = $v "
                   "AND tree_id IN (SELECT tree_id FROM _score_trees)",
                   params={"k": kind, "v": version}).to_arrow_table()


def score_extras(nodes: pa.Table, scores: pa.Table, kind: ScoreKind, version: str
                 ) -> dict[str, np.ndarray]:
    """Estimator extras (rows follow ``nodes``) from ``policy_scores`` rows.

    ``gold_answer`` gives ``trace_ref_logprob`` (N,) (NaN where unscored, e.g. answer
    tails). ``action`` gives ``dsc_ratio`` (N,) = exp(log pi(action) - log mu(action)),
    mu from the stored sampling log-probs (D3), and ``dsc_state`` (N,): the parent's
    node id, i.e. siblings share the state they branched from [R]; both NaN / -1 at
    depths 0-1 and where unscored.
    """
    from train.credit.dsc import RATIO, STATE
    from train.credit.trace import REF_LOGPROB

    values = scores_by_node(scores, kind, version)
    keys = list(zip(nodes.column("tree_id").to_pylist(), nodes.column("node_id").to_pylist(),
                    strict=True))
    got = np.array([values.get((t, int(n)), np.nan) for t, n in keys], np.float64)
    if kind == GOLD:
        return {REF_LOGPROB: got}
    mu = np.array([float(np.sum(lp)) if lp else 0.0
                   for lp in nodes.column("action_logprobs").to_pylist()], np.float64)
    parent = nodes.column("parent_id").to_pylist()
    with np.errstate(over="ignore"):
        ratio = np.exp(got - mu)
    state = np.array([-1 if p is None else int(p) for p in parent], np.int64)
    return {RATIO: ratio, STATE: state}


def token_score_lists(trees: pa.Table, nodes: pa.Table, scores: pa.Table, kind: ScoreKind,
                      version: str | None) -> np.ndarray:
    """(N,) object array, rows following ``nodes``: each node's ``token_logprobs`` of
    ``kind`` (float64 array) or None where unscored. ``version`` None reads each tree's
    scores of its own ``policy_version`` (the ``trees`` rows), as the trainer writes them."""
    own = dict(zip(trees.column("tree_id").to_pylist(),
                   trees.column("policy_version").to_pylist(), strict=True))
    found: dict[tuple[str, int], np.ndarray] = {}
    cols = [scores.column(c).to_pylist() for c in ("tree_id", "node_id", "kind",
                                                   "policy_version", "token_logprobs")]
    for tree_id, node_id, k, v, lp in zip(*cols, strict=True):
        want = own.get(tree_id) if version is None else version
        if k == kind and v is not None and v == want:
            found[(tree_id, int(node_id))] = np.asarray(lp or [], np.float64)
    out = np.empty(nodes.num_rows, dtype=object)
    for i, (t, n) in enumerate(zip(nodes.column("tree_id").to_pylist(),
                                   nodes.column("node_id").to_pylist(), strict=True)):
        out[i] = found.get((t, int(n)))
    return out


__all__ = ["ACTION", "CONTRAST", "GOLD", "HINDSIGHT", "PLAIN", "ScoreError", "ScoreKind",
           "check_kind", "ensure_scores", "gold_answer", "score_extras", "score_trees",
           "scores_by_node", "stored_scores", "teacher_contexts", "token_score_lists",
           "transcripts"]
