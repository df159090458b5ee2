"""Reading policy scores of stored text (TRACE T2, DSC D3, factor F3, sgcd Q3): the rows
of the store's ``policy_scores`` table, keyed by (tree_id, node_id, kind,
policy_version), that the scoring job wrote (``train.scoring``: it loads the policy and
replays environments, on the rollout side; credit only reads, issue 28):

* kind ``gold_answer`` (T2): ``value`` = lbar, ``token_logprobs`` the gold answer's
  per-token log-probs; every node but answer tails (non-root leaves without
  observation, which TRACE does not score; ``is_answer_tail``);
* kind ``action`` (D3): ``value`` = sum of the log-probs of the node's action text
  after its parent's transcript; ``token_logprobs`` per token; nodes of depth >= 2;
* kind ``plain`` (the student of F3 and Q3): the same for every node of depth >= 1 with
  an action text;
* kind ``hindsight`` (F3 teacher, context ``template``): the action after its parent's
  transcript with the feedback that followed it (the node's observation) appended to the
  last context turn after ``[feedback of your next step]``; nodes of depth >= 1 with an
  action and an observation text;
* kind ``hindsight_turn`` (F3 teacher, context ``turn``): the same nodes, the action after
  its parent's transcript followed by the feedback as one more observation turn (the
  policy's own rendering of a tool response);
* kind ``contrast:<summariser>`` (Q3 teacher): the action after its parent's transcript
  with the tree's contrast reference (Q2, ``train.credit.contrast``) appended to the
  prompt; every node of depth >= 1 with an action, in trees that have a reference.

``stored_scores`` reads a tree's rows, ``score_extras`` / ``token_score_lists`` turn them
into estimator inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import pyarrow as pa

from rollout_store.reader import connect
from rollout_store.store import Store
from rollout_store.tree import Node, Tree
from train.credit.base import ACTION, GOLD, HINDSIGHT, HINDSIGHT_TURN, PLAIN, ScoreKind
from train.credit.contrast import make_summariser

# The kinds live in train.credit.base, beside ``Params.node_scores`` that names them.
CONTRAST: Final[str] = "contrast:"
_TOKEN_KINDS: Final[tuple[str, ...]] = (PLAIN, HINDSIGHT, HINDSIGHT_TURN)


class ScoreError(RuntimeError):
    """Scores cannot be computed (no gold answer, no policy); the message says why."""


def is_answer_tail(tree: Tree, node: Node) -> bool:
    """A non-root leaf without observation (the final answer, no TD state; trace.py)."""
    children = tree.children()
    return (node.parent_id is not None and not children[node.node_id]
            and not node.observation_token_ids and not node.observation_text)


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


__all__ = ["ACTION", "CONTRAST", "GOLD", "HINDSIGHT", "HINDSIGHT_TURN", "PLAIN", "ScoreError",
           "ScoreKind", "check_kind", "is_answer_tail", "score_extras", "scores_by_node",
           "stored_scores", "token_score_lists"]
