"""The scoring job: policy scores of stored text, computed on the rollout side and written
to ``policy_scores`` (issue 28); credit estimators only read what it wrote
(``train.credit.scores``, ``tests/test_layering.py``: ``train.credit`` imports nothing of
``train.policies``, ``train.envs`` or ``train.sampling``).

TRACE needs, at every node, the mean log-probability that a frozen reference policy
gives the task's gold answer after the transcript through that node (T2); DSC needs,
at every node of depth >= 2, the probability the target policy gives the node's own
action after the transcript through its parent (D3); factor and sgcd need per-token
scores of a teacher and a student (F3, Q3). All are forward passes of a named policy
over stored text; the kinds and the rows they give are described in
``train.credit.scores``. ``score_trees`` computes them for in-memory trees (the trainer
calls it with its frozen reference, the reuse stage's D7 calibration with the current
policy), ``ensure_scores`` for every stored tree that lacks them, ``score_for_credit``
what a method's params name (``rtrees credit --method trace --param ref=SPEC`` /
``--method dsc --param target=SPEC`` / ``--param teacher=SPEC``), and
``score_and_credit`` is ``rtrees credit``: that scoring, then
``train.credit.store_io.compute_credits`` on the stored scores.

Transcripts are rebuilt from the stored texts exactly as the samplers built them
(``rollout_store.tree.Tree.transcripts``): ``("prompt", root observation)``, then per node
``("action", action_text)``, ``("observation", observation_text)``; the refresh draws of
``train.reuse`` continue from them too. The gold answer of a tree is
``<answer>{env_config["answer"]}</answer>`` when the tree records its task's answer;
otherwise the environment's expert is replayed from the root snapshot and its first
answer action is the gold answer [R].
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

import numpy as np
import pyarrow as pa

from rollout_store.reader import connect, read_trees
from rollout_store.schema import POLICY_SCORES
from rollout_store.store import Store, now_utc
from rollout_store.tree import Node, Tree
from train.credit.base import Params
from train.credit.contrast import Summariser, make_summariser, reference
from train.credit.scores import (
    ACTION,
    CONTRAST,
    GOLD,
    HINDSIGHT,
    HINDSIGHT_TURN,
    PLAIN,
    ScoreError,
    ScoreKind,
    check_kind,
    is_answer_tail,
)
from train.credit.store_io import (
    SCORED,
    CreditError,
    CreditRunReport,
    compute_credits,
    resolve_method,
    token_score_kinds,
)
from train.policies.base import Policy, Transcript, Turn

FEEDBACK: Final[str] = "\n\n[feedback of your next step] "
"""F3, context ``template``: what precedes the feedback appended to the teacher's last
context turn [R]."""
_TREES_PER_COMMIT = 32


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


def _with_suffix(transcript: Transcript, index: int, suffix: str) -> list[Turn]:
    """``transcript`` with ``suffix`` appended to the text of turn ``index``."""
    turns: list[Turn] = list(transcript)
    role, text = turns[index]
    turns[index] = (role, text + suffix)
    return turns


def template_context(transcript: Transcript, feedback: str) -> list[Turn]:
    """F3, context ``template`` (kind ``hindsight``): ``feedback`` appended to the last
    turn of ``transcript`` after ``FEEDBACK``, a text the policy never saw in training."""
    return _with_suffix(transcript, -1, FEEDBACK + feedback)


def turn_context(transcript: Transcript, feedback: str) -> list[Turn]:
    """F3, context ``turn`` (kind ``hindsight_turn``): ``transcript`` followed by
    ``feedback`` as one more observation turn, rendered by the policy exactly as it renders
    the tool response that followed the action (e.g. the tiny policy's
    ``<|user|>\\n<tool_response>391</tool_response> ``): the feedback is the real next turn
    in the policy's own chat format, placed before the scored action, where the paper's
    hindsight context goes [R: the paper's layout is not published]."""
    return [*transcript, ("observation", feedback)]


TEACHER_CONTEXTS: Final[dict[str, Callable[[Transcript, str], list[Turn]]]] = {
    HINDSIGHT: template_context, HINDSIGHT_TURN: turn_context}
"""F3: the teacher's scoring context of each hindsight score kind, from the parent's
transcript and the node's feedback (``train.credit.base.HINDSIGHT_KINDS`` maps a
``FactorParams.context`` to its kind)."""


def teacher_contexts(tree: Tree, kind: str, turns: Mapping[int, Transcript],
                     summarisers: dict[str, Summariser] | None = None
                     ) -> list[tuple[Node, list[Turn]]]:
    """(node, scoring context) of every node scored under ``kind`` (``plain``,
    a hindsight kind of ``TEACHER_CONTEXTS`` or ``contrast:...``; module docstring): the
    parent's transcript, with the feedback (F3) or the contrast reference (Q2) added for
    the teachers."""
    out: list[tuple[Node, list[Turn]]] = []
    steps = [n for n in tree.nodes if n.parent_id is not None and n.action_text]
    if kind == PLAIN:
        return [(n, list(turns[n.parent_id])) for n in steps if n.parent_id is not None]
    hindsight = TEACHER_CONTEXTS.get(kind)
    if hindsight is not None:
        for n in steps:
            if n.parent_id is not None and n.observation_text:
                out.append((n, hindsight(turns[n.parent_id], n.observation_text)))
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
                gold: Mapping[str, str] | None = None, min_tokens: int = 1) -> pa.Table:
    """``policy_scores`` rows of ``kind`` for every scorable node of ``trees`` (one forward
    pass per node; module docstring). ``gold`` overrides the gold answer per tree id.
    ``min_tokens``: token kinds (plain, hindsight, contrast) skip nodes whose stored action
    has fewer tokens (the trainer passes ``Params.min_scored_tokens``: FACTOR's F5 weight
    of a one-token action is 1 whatever its gap, so its teacher pass is wasted)."""
    check_kind(kind)
    version = str(policy.policy_version)
    pairs: list[tuple[Transcript, str]] = []
    keys: list[tuple[str, int]] = []
    summarisers: dict[str, Summariser] = {}
    for tree in trees:
        turns = tree.transcripts()  # T1: S_k for the node at depth k
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
                if len(n.action_token_ids) < min_tokens:
                    continue
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


def score_for_credit(store: Store, method: str,
                     params: Mapping[str, str] | Params | None = None,
                     progress: bool = False) -> Params:
    """The params of ``method`` with every scoring policy they name (trace ``ref``, dsc
    ``target``, factor / sgcd ``teacher``: a policy spec) replaced by its version, after
    scoring every stored tree that lacks that policy's scores of the kinds the method
    reads (``ensure_scores``; computed once per policy version). Params naming no policy
    come back parsed and unchanged. ``CreditError`` names what failed."""
    _, p = resolve_method(method, params)
    if method in SCORED and getattr(p, SCORED[method][0]) is not None:
        field, kind = SCORED[method]
        try:
            version, _ = ensure_scores(store, kind, str(getattr(p, field)), progress)
        except ScoreError as exc:
            raise CreditError(f"{method}: {exc}") from exc
        p = replace(p, **{field: version})
    token_kinds = token_score_kinds(method, p)
    if token_kinds and p.teacher is not None:
        try:
            versions = {ensure_scores(store, kind, str(p.teacher), progress)[0]
                        for kind in dict.fromkeys(token_kinds.values())}
        except ScoreError as exc:
            raise CreditError(f"{method}: {exc}") from exc
        p = replace(p, teacher=versions.pop())
    return p


def score_and_credit(store: Store, method: str,
                     params: Mapping[str, str] | None = None, run_id: str | None = None,
                     progress: bool = True, **kwargs: Any) -> CreditRunReport:
    """``rtrees credit``: ``score_for_credit``, then ``compute_credits`` with the params
    it returned (keyword arguments pass through), so the credit reads stored scores
    only."""
    p = score_for_credit(store, method, params, progress)
    return compute_credits(store, method, p, run_id=run_id, progress=progress, **kwargs)


__all__ = ["FEEDBACK", "TEACHER_CONTEXTS", "ensure_scores", "gold_answer", "score_and_credit",
           "score_for_credit", "score_trees", "teacher_contexts", "template_context",
           "turn_context"]
