"""A small store for the viewer's tests (and docs/viewer.png): two calc-shaped trees
with known credit, Mean@k references, snapshots, a training run's metrics.

* ``bel-0``: a BEL-shaped tree (critical step node 2), credit ``grpo`` (node values only)
  and ``tree_grpo`` (with per-token values) that disagree in sign at node 4 and in rank
  below node 1;
* ``cal-0``: a CALIPER-shaped tree: node 1's children 3 (the original step y_0) and 4, 5
  (``local`` resamples) form one local group; a refreshed copy ``ref-0`` of ``bel-0``
  records lineage.

Token ids are the tiny calc policy's tokenizer's (``policy_ref`` is its checkpoint
directory), so the viewer decodes them.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from rollout_store import Store
from rollout_store.schema import CREDITS, MC_REFERENCES, METRICS
from rollout_store.tree import Node, Segment, Tree

ROOT = Path(__file__).resolve().parents[1]
CALC = ROOT / "train" / "policies" / "checkpoints" / "calc"
# node 2 of bel-0
ACTION_2 = '<tool_call>{"name": "calc", "arguments": {"expr": "17+23"}}</tool_call>'
RUN = "viewer-run"
TRAIN_RUN = "train-viewer"
# (tree, node) -> (grpo, tree_grpo)
CREDIT = {("bel-0", 1): (0.5, 0.25), ("bel-0", 2): (-0.5, -0.75), ("bel-0", 3): (0.5, 0.1),
          ("bel-0", 4): (0.5, -0.2), ("bel-0", 5): (-0.5, -0.6), ("bel-0", 6): (0.5, 0.9),
          ("cal-0", 1): (0.2, 0.3), ("cal-0", 2): (0.1, 0.4), ("cal-0", 3): (-0.4, -0.5),
          ("cal-0", 4): (0.4, 0.5), ("cal-0", 5): (0.0, 0.2)}


def _encode(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(CALC / "tokenizer.json")).encode(text).ids)


def _node(nid: int, parent: int | None, action: str, obs: str, reward: float | None = None,
          **kw: object) -> Node:
    ids = _encode(action)
    n = len(ids)
    return Node(node_id=nid, parent_id=parent,
                kind="prompt" if parent is None else "decision" if parent == 0
                else "feedback_response",
                action_text=action, action_token_ids=ids,
                action_logprobs=[-0.05 * (i % 7) for i in range(n)],
                action_entropies=[0.1 * (i % 5) for i in range(n)],
                observation_text=obs, observation_token_ids=_encode(obs)[:64],
                segments=[Segment("tool_call", 0, n)] if n else [],
                terminal=reward is not None, reward=reward,
                snapshot_id=None if parent is None else f"s{nid}",
                tool_calls=0 if parent is None else 1, **kw)  # type: ignore[arg-type]


def _trees() -> list[Tree]:
    prompt = "What is 17*23+5? Use the calc tool."
    bel = [
        _node(0, None, "", prompt),
        _node(1, 0, '<tool_call>{"name": "calc", "arguments": {"expr": "17*23"}}</tool_call>',
              "391"),
        _node(2, 0, ACTION_2, "40"),
        _node(3, 1, "<answer>396</answer>", "", 1.0),
        _node(4, 1, "<answer>395</answer>", "", 0.0),
        _node(5, 2, "<answer>45</answer>", "", 0.0),
        _node(6, 2, "<answer>396</answer>", "", 1.0),
    ]
    cal = [
        _node(0, None, "", prompt.replace("17", "19")),
        _node(1, 0, '<tool_call>{"name": "calc", "arguments": {"expr": "19*23"}}</tool_call>',
              "437", phase="explore"),
        _node(2, 0, "<answer>437</answer>", "", 0.0, phase="explore"),
        _node(3, 1, "<answer>400</answer>", "", 0.0, phase="explore",
              meta={"caliper_y0": True, "caliper_bucket": "F9"}),
        _node(4, 1, "<answer>442</answer>", "", 1.0, phase="local",
              meta={"caliper_bucket": "F9"}),
        _node(5, 1, "<answer>441</answer>", "", 0.0, phase="local",
              meta={"caliper_bucket": "F9"}),
    ]
    ref = [_node(n.node_id, n.parent_id, n.action_text, n.observation_text, n.reward,
                 meta={"copy_of": n.node_id} if n.node_id == 0 else
                 {"refresh_of": "bel-0"}) for n in bel[:3]]
    ref += [_node(3, 1, "<answer>396</answer>", "", 1.0), _node(4, 2, "<answer>40</answer>",
                                                                "", 0.0)]
    common = dict(run_id=RUN, env="calc", policy_version="v0", policy_ref=str(CALC))

    def snaps(nodes: list[Node]) -> dict[str, bytes]:
        return {n.snapshot_id: json.dumps({"node": n.node_id, "memory": [n.observation_text]}
                                          ).encode()
                for n in nodes if n.snapshot_id}

    return [
        Tree("bel-0", bel, task_id="calc-17", sampler="bel", critical_node_id=2,
             snapshots=snaps(bel), **common),  # type: ignore[arg-type]
        Tree("cal-0", cal, task_id="calc-19", sampler="caliper", snapshots=snaps(cal),
             **common),  # type: ignore[arg-type]
        Tree("ref-0", ref, task_id="calc-17", sampler="refresh", snapshots=snaps(ref),
             meta={"refresh_of": "bel-0", "refresh_of_version": "v0",
                   "refreshed_nodes": [1, 2], "lineage": {"1": 1, "2": 2}},
             **common),  # type: ignore[arg-type]
    ]


def token_credit(tree: str, node: int, n_tokens: int) -> list[float]:
    """The stored per-token ``tree_grpo`` values of a node: its value, ramped."""
    value = CREDIT[(tree, node)][1]
    return [value * (i + 1) / n_tokens for i in range(n_tokens)]


def build(path: Path) -> Store:
    """Write the store at ``path`` (see the module docstring) and return it."""
    store = Store(path, create=True)
    trees = _trees()
    store.append_trees(trees, key="viewer-fixture")
    n_tokens = {(t.tree_id, n.node_id): len(n.action_token_ids) for t in trees
                for n in t.nodes}
    now = datetime.now(UTC)
    rows = []
    for (tid, nid), values in CREDIT.items():
        for method, value in zip(("grpo", "tree_grpo"), values, strict=True):
            rows.append({"run_id": RUN, "method": method, "method_params_hash": f"h-{method}",
                         "method_params": "{}", "tree_id": tid, "node_id": nid,
                         "value": value,
                         "token_values": token_credit(tid, nid, n_tokens[(tid, nid)])
                         if method == "tree_grpo" else None,
                         "policy_version": "v0", "created_at": now})
    store.append_credits(pa.Table.from_pylist(rows, schema=CREDITS), key="viewer-credit")
    mc = [{"run_id": RUN, "tree_id": "bel-0", "node_id": nid, "k": 8, "successes": s,
           "policy_version": "v0", "created_at": now} for nid, s in ((1, 6), (2, 3))]
    store.append_mc_references(pa.Table.from_pylist(mc, schema=MC_REFERENCES), key="viewer-mc")
    metrics = [{"run_id": TRAIN_RUN, "step": step, "name": name, "value": value,
                "created_at": now}
               for step in range(6)
               for name, value in (("reward", 0.2 + 0.1 * step), ("loss", 1.0 / (step + 1)))]
    store.append_metrics(pa.Table.from_pylist(metrics, schema=METRICS), key="viewer-metrics")
    return store
