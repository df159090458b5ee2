"""Import ATIF v1.x trajectories (``rtrees import --format atif``) as trees, one per file.

The source ``atif`` (``import_atif_files``; ``rtrees import --format atif``, next to the
verl and TRL dumps of ``rollout_store.importers``): ATIF v1.x trajectory files
(``*.json``, or folders of them, e.g. ``rtrees export --format atif``), one tree each: the
first ``user`` step's message is the root's prompt, each ``agent`` step one node below the
previous, with its text, token ids, logprobs and observation; the reward is
``final_metrics.extra.reward``. Every file is read and checked before the one commit
(keyed by the files' bytes), so a bad file writes nothing.

Every field read is checked as ``rollout_store.import_checks`` says (hostile input).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from rollout_store.import_checks import (
    MAX_IMPORT_BYTES,
    MAX_TOKEN_ID,
    DumpImportError,
    Fail,
    finite,
    is_number,
    parse_json_document,
    read_regular_file,
    shown_json,
    type_of,
)
from rollout_store.store import CommitReport, Store
from rollout_store.tree import Node, Tree
from rollout_store.validate import TreeValidationError

ATIF_FORMAT: Final[str] = "atif"
ATIF_SKIPPED: Final[frozenset[str]] = frozenset({"metadata.json", "dataset_info.json"})


def atif_files(paths: Sequence[str | Path]) -> list[Path]:
    """The ATIF files named: each file as given, each folder's ``*.json`` (recursively,
    sorted), leaving out an export's ``metadata.json`` and ``dataset_info.json``."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*.json") if f.name not in ATIF_SKIPPED)
        else:
            out.append(p)
    return out


def import_atif_files(store: Store, paths: Sequence[str | Path], run_id: str | None = None,
                      *, max_bytes: int = MAX_IMPORT_BYTES) -> CommitReport:
    """Read and check every ATIF file of ``paths`` (``atif_files``; each a regular file of
    at most ``max_bytes``), then append one tree per file in one commit keyed by the run
    id and the files' bytes (a second import of the same files is a no-op). A bad file
    raises ``DumpImportError`` naming it and the field, and nothing is written."""
    files = atif_files(paths)
    if not files:
        raise DumpImportError(None, "no ATIF .json files given")
    run = run_id or "import-atif"
    digest = hashlib.sha256(run.encode())
    trees = []
    for f in files:
        raw = read_regular_file(f, max_bytes)
        digest.update(raw)
        trees.append(atif_tree(parse_json_document(raw, str(f)), str(f), run))
    try:
        return store.append_trees(trees, key=f"import:atif:{digest.hexdigest()[:32]}")
    except TreeValidationError as exc:
        raise DumpImportError(None, str(exc)) from exc


def atif_tree(traj: Any, source: str, run_id: str) -> Tree:
    """One ATIF trajectory as a tree (module docstring), every field it reads checked by
    type (``DumpImportError`` naming ``source`` and the field's JSON path).

    Read: ``schema_version`` (``ATIF-v1.*``), ``session_id``, ``agent.model_name``,
    ``extra`` (``prompt_token_ids``, ``task_id``, ``env``), ``final_metrics.extra.reward``
    and per step ``source``, ``message``, ``metrics`` (``completion_token_ids``,
    ``logprobs``, one per token when given; ``prompt_token_ids``), ``observation``
    (``results[].content``) and ``extra.observation_token_ids``. A trajectory without
    logprobs gets 0.0 per token; without a reward, 0.0 (``meta.reward_missing``)."""
    def fail(detail: str) -> DumpImportError:
        return DumpImportError(source, detail)

    if not isinstance(traj, dict):
        raise fail(f"not an ATIF trajectory: expected a JSON object, got {type_of(traj)}")
    version = traj.get("schema_version")
    if not isinstance(version, str) or not version.startswith("ATIF-v1."):
        raise fail(f"not an ATIF trajectory: schema_version {shown_json(version)}")
    steps = traj.get("steps")
    if not isinstance(steps, list):
        raise fail(f"steps: expected an array, got {shown_json(steps)}")
    extra = _opt_object(traj, "extra", "extra", fail)
    agent = _opt_object(traj, "agent", "agent", fail)
    final = _opt_object(traj, "final_metrics", "final_metrics", fail)
    final_extra = _opt_object(final, "extra", "final_metrics.extra", fail)
    reward = final_extra.get("reward")
    if reward is not None:
        reward = finite(reward, "final_metrics.extra.reward", fail)
    session = _opt_str(traj, "session_id", "session_id", fail)
    model = _opt_str(agent, "model_name", "agent.model_name", fail)
    task = _opt_str(extra, "task_id", "extra.task_id", fail)
    env = _opt_str(extra, "env", "extra.env", fail)
    prompt_ids = _token_ids(extra.get("prompt_token_ids", []), "extra.prompt_token_ids",
                            fail)
    prompt: str | None = None
    nodes: list[Node] = []
    for i, s in enumerate(steps):
        where = f"steps[{i}]"
        if not isinstance(s, dict):
            raise fail(f"{where}: expected an object, got {shown_json(s)}")
        kind = s.get("source")
        if kind not in ("system", "user", "agent"):
            raise fail(f"{where}.source: expected 'system', 'user' or 'agent', got "
                       f"{shown_json(kind)}")
        message = s.get("message")
        if not isinstance(message, str):
            raise fail(f"{where}.message: expected a string, got {shown_json(message)}")
        step_id = s.get("step_id")
        if step_id is not None and (not is_number(step_id) or not isinstance(step_id, int)):
            raise fail(f"{where}.step_id: expected an integer, got {shown_json(step_id)}")
        metrics = _opt_object(s, "metrics", f"{where}.metrics", fail)
        observation = _opt_object(s, "observation", f"{where}.observation", fail)
        sx = _opt_object(s, "extra", f"{where}.extra", fail)
        if kind == "user" and prompt is None:
            prompt = message
        if kind != "agent":
            continue
        ids = _token_ids(metrics.get("completion_token_ids", []),
                         f"{where}.metrics.completion_token_ids", fail)
        _token_ids(metrics.get("prompt_token_ids", []), f"{where}.metrics.prompt_token_ids",
                   fail)
        lps = _logprobs(metrics.get("logprobs", []), f"{where}.metrics.logprobs", fail)
        if lps and len(lps) != len(ids):
            raise fail(f"{where}.metrics.logprobs: {len(lps)} logprobs for {len(ids)} "
                       "completion tokens")
        results = observation.get("results", [])
        if not isinstance(results, list):
            raise fail(f"{where}.observation.results: expected an array, got "
                       f"{shown_json(results)}")
        texts = []
        for j, r in enumerate(results):
            at = f"{where}.observation.results[{j}]"
            if not isinstance(r, dict):
                raise fail(f"{at}: expected an object, got {shown_json(r)}")
            content = r.get("content", "")
            if not isinstance(content, str):
                raise fail(f"{at}.content: expected a string, got {shown_json(content)}")
            texts.append(content)
        obs_ids = _token_ids(sx.get("observation_token_ids", []),
                             f"{where}.extra.observation_token_ids", fail)
        nid = len(nodes) + 1
        nodes.append(Node(nid, nid - 1, "decision" if nid == 1 else "feedback_response",
                          action_text=message, action_token_ids=ids,
                          action_logprobs=lps or [0.0] * len(ids),
                          observation_text="\n".join(texts), observation_token_ids=obs_ids,
                          meta={"atif_step_id": step_id}))
    if not nodes:
        raise fail("not an ATIF trajectory: no agent step")
    nodes[-1].terminal = True
    nodes[-1].reward = reward if reward is not None else 0.0
    root = Node(0, None, "prompt", observation_text=prompt or "",
                observation_token_ids=prompt_ids)
    session_id = session if session is not None else source
    tid = "atif-" + hashlib.sha256(f"{run_id}\x00{session_id}".encode()).hexdigest()[:16]
    return Tree(tid, [root, *nodes], run_id=run_id, task_id=task or session_id,
                env=env or "atif", sampler="import", policy_version=model,
                meta={"import": "atif", "session_id": session_id, "source": source,
                      "reward_missing": reward is None})


def _opt_object(parent: Mapping[str, Any], key: str, where: str, fail: Fail
                ) -> dict[str, Any]:
    """``parent[key]``, an object, or {} when absent or null."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"{where}: expected an object, got {shown_json(value)}")
    return value


def _opt_str(parent: Mapping[str, Any], key: str, where: str, fail: Fail) -> str | None:
    value = parent.get(key)
    if value is not None and not isinstance(value, str):
        raise fail(f"{where}: expected a string, got {shown_json(value)}")
    return value


def _token_ids(value: Any, where: str, fail: Fail) -> list[int]:
    """A list of token ids: integers (not booleans, floats or strings) in
    ``[0, MAX_TOKEN_ID]``."""
    if not isinstance(value, list):
        raise fail(f"{where}: expected an array of token ids, got {shown_json(value)}")
    for k, t in enumerate(value):
        if not is_number(t) or not isinstance(t, int):
            raise fail(f"{where}[{k}]: expected an integer token id, got {shown_json(t)}")
        if not 0 <= t <= MAX_TOKEN_ID:
            raise fail(f"{where}[{k}]: token id {t} is outside [0, {MAX_TOKEN_ID}]")
    return list(value)


def _logprobs(value: Any, where: str, fail: Fail) -> list[float]:
    """A list of log-probabilities: finite numbers ``<= 0``."""
    if not isinstance(value, list):
        raise fail(f"{where}: expected an array of numbers, got {shown_json(value)}")
    out = []
    for k, v in enumerate(value):
        lp = finite(v, f"{where}[{k}]", fail)
        if lp > 0:
            raise fail(f"{where}[{k}]: a log-probability must be <= 0, got {shown_json(v)}")
        out.append(lp)
    return out


__all__ = ["ATIF_FORMAT", "ATIF_SKIPPED", "atif_files", "atif_tree", "import_atif_files"]
