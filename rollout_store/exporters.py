"""Export the paths of stored trees in standard formats (``rtrees export``), and import ATIF
trajectories back (``rtrees import --format atif``): issue 26.

Every root-to-leaf path of the selected trees (one run, some tree ids, or all) is one
record:

* ``hf``: a Hugging Face ``datasets`` directory: ``data/train-XXXXX-of-YYYYY.parquet``
  shards (``PATH_SCHEMA``: one row per path, its steps as a list of structs) and
  ``dataset_info.json`` (features, split sizes); ``datasets.load_dataset("parquet",
  data_dir=DIR / "data")`` reads it, as does ``pyarrow.dataset``.
* ``atif``: one ATIF v1.4 trajectory per path (``trajectories/<n>.json``): a ``user``
  step with the prompt (the root's observation), then one ``agent`` step per node with
  its action as ``message``, its tool call (parsed from ``<tool_call>{...}</tool_call>``
  where the action holds one), its observation, and in ``metrics`` the prompt token ids
  (every token before the action along the path), the completion token ids and their
  logprobs; the leaf reward and each step's credit by method in ``extra``.
* ``adp``: one Agent Data Protocol record per path (``adp.jsonl``): ``content`` alternates
  a ``text_observation`` (the prompt from ``user``, each observation from
  ``environment``) with an ``api_action`` (a parsed tool call) or ``message_action``.

Each export also writes ``metadata.json``: the format, the store's schema version, the
store version exported (every table's Delta version), the git commit of this code,
the counts and per-column statistics of the path table (nulls; min, max, mean of
numbers; total list lengths). ``ATIF_SCHEMA`` and ``ADP_SCHEMA`` are JSON Schemas of the
fields we write, transcribed from the formats' specifications (ATIF RFC 0001 v1.4;
ADP, arXiv 2510.24702); the tests validate every record against them.

Reading ATIF trajectories back as trees is ``rollout_store.import_atif.import_atif_files``
(``rtrees import --format atif``), which checks every field's type.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rollout_store.reader import connect, read_trees
from rollout_store.schema import SCHEMA_VERSION
from rollout_store.store import Store
from rollout_store.tree import Tree

ExportFormat = Literal["hf", "atif", "adp"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("hf", "atif", "adp")
ATIF_VERSION = "ATIF-v1.4"
SHARD_ROWS = 10_000  # paths per Parquet shard
_TREES_PER_READ = 256
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

STEP = pa.struct([
    pa.field("node_id", pa.int64()), pa.field("kind", pa.string()),
    pa.field("action_text", pa.string()), pa.field("observation_text", pa.string()),
    pa.field("action_token_ids", pa.list_(pa.int32())),
    pa.field("action_logprobs", pa.list_(pa.float32())),
    pa.field("observation_token_ids", pa.list_(pa.int32())),
    pa.field("credit", pa.list_(pa.struct([pa.field("method", pa.string()),
                                           pa.field("value", pa.float64())]))),
])
PATH_SCHEMA = pa.schema([
    pa.field("tree_id", pa.string()), pa.field("leaf_id", pa.int64()),
    pa.field("run_id", pa.string()), pa.field("task_id", pa.string()),
    pa.field("env", pa.string()), pa.field("sampler", pa.string()),
    pa.field("policy_version", pa.string()), pa.field("reward", pa.float64()),
    pa.field("prompt", pa.string()), pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("n_steps", pa.int32()), pa.field("steps", pa.list_(STEP)),
])

_STR = {"type": "string"}
_INT_LIST = {"type": "array", "items": {"type": "integer"}}
ATIF_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["schema_version", "session_id", "agent", "steps"],
    "properties": {
        "schema_version": {"const": ATIF_VERSION},
        "session_id": _STR,
        "agent": {"type": "object", "required": ["name", "version"],
                  "properties": {"name": _STR, "version": _STR, "model_name": _STR,
                                 "extra": {"type": "object"}}},
        "notes": _STR,
        "final_metrics": {"type": "object", "properties": {
            "total_prompt_tokens": {"type": "integer"},
            "total_completion_tokens": {"type": "integer"},
            "total_steps": {"type": "integer"}, "extra": {"type": "object"}}},
        "extra": {"type": "object"},
        "steps": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["step_id", "source", "message"],
            "properties": {
                "step_id": {"type": "integer", "minimum": 1},
                "timestamp": _STR,
                "source": {"enum": ["system", "user", "agent"]},
                "model_name": _STR, "message": _STR,
                "tool_calls": {"type": "array", "items": {
                    "type": "object", "required": ["tool_call_id", "function_name",
                                                   "arguments"],
                    "properties": {"tool_call_id": _STR, "function_name": _STR,
                                   "arguments": {"type": "object"}}}},
                "observation": {"type": "object", "required": ["results"], "properties": {
                    "results": {"type": "array", "items": {"type": "object", "properties": {
                        "source_call_id": {"type": ["string", "null"]},
                        "content": _STR}}}}},
                "metrics": {"type": "object", "properties": {
                    "prompt_tokens": {"type": "integer"},
                    "completion_tokens": {"type": "integer"},
                    "prompt_token_ids": _INT_LIST, "completion_token_ids": _INT_LIST,
                    "logprobs": {"type": "array", "items": {"type": "number"}},
                    "extra": {"type": "object"}}},
                "extra": {"type": "object"}}}},
    },
}
ADP_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["id", "content", "details"],
    "properties": {
        "id": _STR, "details": {"type": "object"},
        "content": {"type": "array", "minItems": 1, "items": {"oneOf": [
            {"type": "object", "required": ["class_", "content", "source"], "properties": {
                "class_": {"const": "text_observation"}, "content": _STR,
                "source": {"enum": ["user", "environment"]}, "name": _STR}},
            {"type": "object", "required": ["class_", "function", "kwargs"], "properties": {
                "class_": {"const": "api_action"}, "function": _STR,
                "kwargs": {"type": "object"}, "description": {"type": ["string", "null"]}}},
            {"type": "object", "required": ["class_", "content"], "properties": {
                "class_": {"const": "message_action"}, "content": _STR,
                "description": {"type": ["string", "null"]}}},
        ]}},
    },
}


@dataclass(frozen=True)
class ExportReport:
    """What ``export_paths`` wrote."""

    out: Path
    fmt: str
    trees: int
    paths: int
    files: int

    def summary(self) -> str:
        return (f"exported {self.paths} paths of {self.trees} trees as {self.fmt} to "
                f"{self.out} ({self.files} files, metadata.json)")


def git_commit() -> str | None:
    """The commit of the checkout this code runs from, or None outside one."""
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None if res.returncode == 0 else None


def parse_tool_call(action: str) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` of the first ``<tool_call>{"name": .., "arguments": {..}}
    </tool_call>`` in ``action``, or None (no call, or not that JSON)."""
    m = _TOOL_CALL.search(action or "")
    if not m:
        return None
    try:
        obj = json.loads(m.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return obj["name"], args if isinstance(args, dict) else {"value": args}


def _credits(store: Store, version: Any, tree_ids: list[str]) -> dict[tuple[str, int],
                                                                       list[dict[str, Any]]]:
    con = connect(store, version, restricted=True)
    con.register("_wanted", pa.table({"tree_id": pa.array(tree_ids, pa.string())}))
    rows = con.execute("""
        SELECT tree_id, node_id, method, arg_max(value, created_at) AS value FROM credits
        WHERE tree_id IN (SELECT tree_id FROM _wanted)
        GROUP BY tree_id, node_id, method ORDER BY method""").fetchall()
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for tid, nid, method, value in rows:
        out.setdefault((tid, int(nid)), []).append({"method": method, "value": float(value)})
    return out


def path_rows(store: Store, run_id: str | None = None, tree_ids: Sequence[str] | None = None
              ) -> Iterator[dict[str, Any]]:
    """One ``PATH_SCHEMA`` row per root-to-leaf path of the selected trees, tree by tree
    (trees read ``_TREES_PER_READ`` at a time, without snapshots)."""
    version = store.version()
    con = connect(store, version, restricted=True)
    sql, params = "SELECT tree_id FROM trees", []
    if run_id:
        sql, params = sql + " WHERE run_id = ?", [run_id]
    ids = [r[0] for r in con.execute(sql + " ORDER BY tree_id", params).fetchall()]
    if tree_ids:
        known = set(ids)
        missing = [t for t in tree_ids if t not in known]
        if missing:
            raise ValueError(f"no tree {missing[0]!r} in {store.path}"
                             + (f" (run {run_id})" if run_id else ""))
        ids = list(dict.fromkeys(tree_ids))
    for i in range(0, len(ids), _TREES_PER_READ):
        chunk = ids[i:i + _TREES_PER_READ]
        credit = _credits(store, version, chunk)
        for tree in read_trees(store, chunk, version, snapshots=False):
            yield from _tree_paths(tree, credit)


def _tree_paths(tree: Tree, credit: dict[tuple[str, int], list[dict[str, Any]]]
                ) -> Iterator[dict[str, Any]]:
    root = tree.root()
    for leaf in tree.leaves():
        path = tree.path_to(leaf.node_id)
        steps = [{"node_id": n.node_id, "kind": n.kind, "action_text": n.action_text,
                  "observation_text": n.observation_text,
                  "action_token_ids": list(n.action_token_ids),
                  "action_logprobs": list(n.action_logprobs),
                  "observation_token_ids": list(n.observation_token_ids),
                  "credit": credit.get((tree.tree_id, n.node_id), [])} for n in path[1:]]
        yield {"tree_id": tree.tree_id, "leaf_id": leaf.node_id, "run_id": tree.run_id,
               "task_id": tree.task_id, "env": tree.env, "sampler": tree.sampler,
               "policy_version": tree.policy_version, "reward": leaf.reward,
               "prompt": root.observation_text,
               "prompt_token_ids": list(root.observation_token_ids),
               "n_steps": len(steps), "steps": steps}


def atif_trajectory(row: dict[str, Any]) -> dict[str, Any]:
    """The ATIF v1.4 trajectory of one path row (module docstring)."""
    steps: list[dict[str, Any]] = [{"step_id": 1, "source": "user", "message": row["prompt"]}]
    context = list(row["prompt_token_ids"])
    total_prompt = total_completion = 0
    for i, s in enumerate(row["steps"], start=2):
        step: dict[str, Any] = {"step_id": i, "source": "agent",
                                "message": s["action_text"] or ""}
        if row["policy_version"]:
            step["model_name"] = row["policy_version"]
        call = parse_tool_call(s["action_text"])
        call_id = None
        if call is not None:
            call_id = f"call-{row['tree_id']}-{s['node_id']}"
            step["tool_calls"] = [{"tool_call_id": call_id, "function_name": call[0],
                                   "arguments": call[1]}]
        if s["observation_text"]:
            step["observation"] = {"results": [{"source_call_id": call_id,
                                                "content": s["observation_text"]}]}
        step["metrics"] = {"prompt_tokens": len(context),
                           "completion_tokens": len(s["action_token_ids"]),
                           "prompt_token_ids": list(context),
                           "completion_token_ids": list(s["action_token_ids"]),
                           "logprobs": [float(v) for v in s["action_logprobs"]]}
        step["extra"] = {"node_id": s["node_id"], "kind": s["kind"],
                         "observation_token_ids": list(s["observation_token_ids"]),
                         "credit": {c["method"]: c["value"] for c in s["credit"]}}
        total_prompt += len(context)
        total_completion += len(s["action_token_ids"])
        context += list(s["action_token_ids"]) + list(s["observation_token_ids"])
        steps.append(step)
    return {
        "schema_version": ATIF_VERSION,
        "session_id": f"{row['tree_id']}/{row['leaf_id']}",
        "agent": {"name": "rollout-trees", "version": str(SCHEMA_VERSION),
                  **({"model_name": row["policy_version"]} if row["policy_version"] else {})},
        "steps": steps,
        "final_metrics": {"total_prompt_tokens": total_prompt,
                          "total_completion_tokens": total_completion,
                          "total_steps": len(steps), "extra": {"reward": row["reward"]}},
        "extra": {k: row[k] for k in ("tree_id", "leaf_id", "run_id", "task_id", "env",
                                      "sampler")}
        | {"prompt_token_ids": list(row["prompt_token_ids"])},
    }


def adp_record(row: dict[str, Any]) -> dict[str, Any]:
    """The ADP record of one path row (module docstring)."""
    content: list[dict[str, Any]] = [{"class_": "text_observation", "content": row["prompt"],
                                      "source": "user"}]
    for s in row["steps"]:
        call = parse_tool_call(s["action_text"])
        if call is not None:
            content.append({"class_": "api_action", "function": call[0], "kwargs": call[1],
                            "description": s["action_text"]})
        else:
            content.append({"class_": "message_action", "content": s["action_text"] or "",
                            "description": None})
        if s["observation_text"]:
            content.append({"class_": "text_observation", "content": s["observation_text"],
                            "source": "environment"})
    details = {k: row[k] for k in ("tree_id", "leaf_id", "run_id", "task_id", "env",
                                   "sampler", "policy_version", "reward")}
    details["credit"] = {str(s["node_id"]): {c["method"]: c["value"] for c in s["credit"]}
                         for s in row["steps"] if s["credit"]}
    return {"id": f"{row['tree_id']}/{row['leaf_id']}", "content": content, "details": details}


def column_stats(table: pa.Table) -> dict[str, dict[str, Any]]:
    """Per column: rows, nulls; numbers: min, max, mean; strings: total characters; lists:
    total elements."""
    out: dict[str, dict[str, Any]] = {}
    for name in table.column_names:
        col = table.column(name)
        st: dict[str, Any] = {"type": str(col.type), "rows": len(col), "nulls": col.null_count}
        if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
            mm = pc.min_max(col).as_py()
            st.update(min=mm["min"], max=mm["max"], mean=pc.mean(col).as_py())
        elif pa.types.is_string(col.type):
            st["characters"] = pc.sum(pc.utf8_length(col)).as_py() or 0
        elif pa.types.is_list(col.type):
            st["elements"] = pc.sum(pc.list_value_length(col)).as_py() or 0
        out[name] = st
    return out


def _hf_features(schema: pa.Schema) -> dict[str, Any]:
    def feature(t: pa.DataType) -> Any:
        if pa.types.is_list(t):
            return {"feature": feature(t.value_type), "_type": "List"}
        if pa.types.is_struct(t):
            return {f.name: feature(f.type) for f in t}
        dtype = {"string": "string", "int64": "int64", "int32": "int32", "float": "float32",
                 "double": "float64", "bool": "bool"}[str(t)]
        return {"dtype": dtype, "_type": "Value"}
    return {f.name: feature(f.type) for f in schema}


# What an export writes directly under --out (module docstring).
_WRITTEN = ("metadata.json", "dataset_info.json", "data", "trajectories", "adp.jsonl")


def refuse_out_in_store(store: Store, out: Path) -> None:
    """``ValueError`` when ``out``, or a file or folder an export writes there (``_WRITTEN``:
    one may be a link), is the local ``store``'s directory or inside it: an export must
    never write into a store (a stray file in a table's ``_delta_log`` breaks it). Both
    paths are resolved (links followed, ``..`` removed) first."""
    if store.loc.remote:
        return  # --out is a local directory: never inside an object store
    root = Path(str(store.path)).resolve()
    for path in (out, *(out / name for name in _WRITTEN)):
        try:
            real = path.resolve()
        except (OSError, RuntimeError) as exc:  # a loop of links
            raise ValueError(f"--out {out}: cannot resolve {path}: {exc}") from None
        if real == root or root in real.parents:
            raise ValueError(f"--out {out}: the export would write {real}, in the store "
                             f"{root}; export to a directory outside the store")


def export_paths(store: Store, fmt: str, out: str | Path, *, run_id: str | None = None,
                 tree_ids: Sequence[str] | None = None) -> ExportReport:
    """Write every root-to-leaf path of the selected trees to ``out`` as ``fmt`` (module
    docstring). ``ValueError``: an unknown format, nothing selected, an unknown tree, an
    ``out`` that already holds an export, or an ``out`` inside a local store
    (``refuse_out_in_store``); each is raised before anything is written."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (one of {', '.join(EXPORT_FORMATS)})")
    out = Path(out)
    refuse_out_in_store(store, out)
    if (out / "metadata.json").exists():
        raise ValueError(f"{out} already holds an export (metadata.json); choose a new --out")
    version = store.version()
    rows = list(path_rows(store, run_id, tree_ids))
    if not rows:
        raise ValueError("no path selected (check --run and --tree)")
    out.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=PATH_SCHEMA)
    files = 0
    if fmt == "hf":
        (out / "data").mkdir(exist_ok=True)
        n_shards = max(1, -(-table.num_rows // SHARD_ROWS))
        for k in range(n_shards):
            pq.write_table(table.slice(k * SHARD_ROWS, SHARD_ROWS),
                           out / "data" / f"train-{k:05d}-of-{n_shards:05d}.parquet",
                           compression="zstd")
        files = n_shards
        info = {"description": "Root-to-leaf paths of rollout trees (rollout-trees "
                               "`rtrees export --format hf`).",
                "features": _hf_features(PATH_SCHEMA),
                "splits": {"train": {"name": "train", "num_examples": table.num_rows,
                                     "num_bytes": table.nbytes, "dataset_name": "paths"}},
                "dataset_name": "paths", "config_name": "default"}
        (out / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
    elif fmt == "atif":
        folder = out / "trajectories"
        folder.mkdir(exist_ok=True)
        for k, row in enumerate(rows):
            (folder / f"{k:06d}.json").write_text(json.dumps(atif_trajectory(row)) + "\n")
        files = len(rows)
    else:
        with (out / "adp.jsonl").open("w") as f:
            for row in rows:
                f.write(json.dumps(adp_record(row)) + "\n")
        files = 1
    flat = table.drop_columns(["steps"])
    meta = {"format": fmt, "format_version": {"hf": "parquet", "atif": ATIF_VERSION,
                                              "adp": "adp"}[fmt],
            "schema_version": SCHEMA_VERSION, "store": str(store.path),
            "store_version": dict(version), "git_commit": git_commit(),
            "exported_at": datetime.now(UTC).isoformat(), "run_id": run_id,
            "trees": len({r["tree_id"] for r in rows}), "paths": len(rows),
            "steps": int(pc.sum(table.column("n_steps")).as_py() or 0),
            "columns": column_stats(flat)}
    (out / "metadata.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return ExportReport(out, fmt, len({r["tree_id"] for r in rows}), len(rows), files)


__all__ = ["ADP_SCHEMA", "ATIF_SCHEMA", "EXPORT_FORMATS", "PATH_SCHEMA", "SCHEMA_VERSION",
           "ExportReport", "adp_record", "atif_trajectory", "export_paths", "path_rows"]
