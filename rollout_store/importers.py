"""Import the rollout dumps trainers already write (``rtrees import``) as one-level trees.

Two sources, named by ``ImportFormat``:

* ``verl-jsonl``: the files verl writes to ``trainer.rollout_data_dir``, one
  ``{step}.jsonl`` per training step, one JSON object per line with ``input``
  (the prompt), ``output`` (the completion), ``score`` (the reward), ``step``,
  usually ``gts`` (the ground truth), and whatever extra fields the reward
  function returned (``reward_extra_infos_dict``).
* ``trl-parquet``: the files TRL's GRPO trainer writes to
  ``<output_dir>/completions/completions_{step:05d}.parquet`` (newer versions:
  ``completions/<mode>/...``), with columns ``step``, ``prompt``, ``completion``,
  one column per reward function, extra logged columns and ``advantage``.

Rows of one file that share (prompt, step) form one tree (GRPO's group): the
root is a ``prompt`` node holding the prompt in ``observation_text``; each
completion is a terminal ``decision`` leaf holding the completion in
``action_text`` and its reward. The reward of a leaf is

* verl: ``score``; every other numeric field is a reward component
  (``reward_parts``); an ``advantage`` field, if a dump carries one, is the
  source advantage instead;
* TRL: the sum of the reward columns (by default every integer or floating
  column except ``step`` and ``advantage``, or the ``reward_columns`` the caller
  names), each column also a reward component. TRL itself takes a *weighted*
  sum (``reward_weights``), and the weights are not in the dump: name the
  columns, or re-weight in SQL from ``reward_parts``, when they are not all 1.
  A NaN or null reward cell means "this reward function does not apply"
  (TRL's ``nansum``): it is left out of the sum and of ``reward_parts`` and
  listed in the leaf's ``meta.missing_reward_parts``; a row whose every reward
  cell is missing is refused.

A source advantage is kept as a ``credits`` row with method
``"source_advantage"`` (one per leaf; none for the root). Non-numeric fields
go to the leaf's ``meta`` (verl ``gts`` to the tree's ``meta`` when the whole
group agrees on it, as it does for one prompt). Booleans count as non-numeric.

Determinism and idempotency: a tree id is a hash of (format, run id, file
name, step, prompt), and a file is appended under the key
``import:<format>:<sha256 of its bytes>``, so importing a file twice stores it
once (the second report says so). A different file of the same run and name
(a re-dumped step) that repeats a (prompt, step) of a stored one is refused
rather than stored twice; pass another run id to keep both.

A file is read and validated whole before anything is appended: a bad file
writes nothing, and the ``DumpImportError`` names the file and the line (JSONL,
1-based) or row (Parquet, 0-based as in pyarrow/pandas). ``import_files``
imports file by file, so files before a bad one stay imported; rerunning after
the fix skips them.

Modules: the ATIF import is ``rollout_store.import_atif`` and the checks every import
makes of hostile input (regular files of bounded size, bounded nesting, typed fields; the
error type ``DumpImportError``) are ``rollout_store.import_checks``: their docstrings say
the rules. This module reads verl and TRL dumps.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, get_args

import pyarrow as pa
import pyarrow.parquet as pq

from rollout_store.import_checks import (
    MAX_IMPORT_BYTES,
    MAX_NESTING,
    DumpImportError,
    Fail,
    check_value,
    is_number,
    jsonable,
    read_regular_file,
    shown_json,
)
from rollout_store.schema import CREDITS
from rollout_store.store import CommitReport, Store
from rollout_store.tree import Node, Tree, TreeBatch
from rollout_store.validate import TreeValidationError

ImportFormat = Literal["verl-jsonl", "trl-parquet"]
IMPORT_FORMATS: Final[tuple[ImportFormat, ...]] = get_args(ImportFormat)

# The `trees.env` of imported trees, per format.
ENV_OF_FORMAT: Final[dict[ImportFormat, str]] = {"verl-jsonl": "verl", "trl-parquet": "trl"}

SOURCE_ADVANTAGE_METHOD: Final[str] = "source_advantage"
ADVANTAGE_FIELD: Final[str] = "advantage"

# verl's _dump_generations (verl/trainer/ppo/ray_trainer.py) writes input, output,
# gts, score, step, then every reward_extra_info list of the batch's length.
VERL_REQUIRED: Final[tuple[str, ...]] = ("input", "output", "score")
VERL_KNOWN: Final[frozenset[str]] = frozenset(
    {"input", "output", "score", "step", "gts", ADVANTAGE_FIELD}
)
TRL_REQUIRED: Final[tuple[str, ...]] = ("prompt", "completion")
# Never default reward columns: the step, the advantage, a pandas index column.
TRL_NOT_REWARDS: Final[frozenset[str]] = frozenset({"step", ADVANTAGE_FIELD})


@dataclass(frozen=True)
class DumpRow:
    """One completion read from a dump, checked and normalised.

    ``index`` is its JSONL line (1-based) or Parquet row (0-based); ``meta`` its
    non-numeric fields; ``group_meta`` fields that belong to the prompt (verl
    ``gts``) and go to the tree's meta when the whole group agrees on them.
    """

    index: int
    step: int
    prompt: str
    completion: str
    reward: float
    reward_parts: dict[str, float]
    advantage: float | None
    meta: dict[str, Any]
    group_meta: dict[str, Any] = field(default_factory=dict)
    structured_prompt: bool = False


@dataclass(frozen=True)
class LoadedDump:
    """A dump file read into trees and source-advantage credits, not yet stored.

    ``key`` is the deterministic idempotency key of the file's append.
    """

    path: str
    fmt: ImportFormat
    run_id: str
    key: str
    sha256: str
    n_rows: int
    steps: tuple[int, ...]
    trees: list[Tree]
    credits: pa.Table  # schema.CREDITS, one row per leaf with a source advantage


@dataclass(frozen=True)
class ImportReport:
    """What importing one file did; ``summary()`` is the line ``rtrees import`` prints."""

    path: str
    fmt: ImportFormat
    run_id: str
    key: str
    n_rows: int
    n_trees: int
    n_credits: int
    steps: tuple[int, ...]
    trees_commit: CommitReport | None  # None when the file had no rows
    credits_commit: CommitReport | None  # None when the file had no source advantages

    @property
    def already_stored(self) -> bool:
        """True when an earlier import of the same bytes had stored this file."""
        return self.trees_commit is not None and self.trees_commit.already_committed

    def summary(self) -> str:
        name = Path(self.path).name
        if self.n_rows == 0:
            return f"{name}: no rows, nothing written"
        if self.already_stored:
            return f"{name}: already stored (key {self.key}), nothing written"
        credits = f", {self.n_credits} source advantages" if self.n_credits else ""
        return (f"{name}: {self.n_trees} trees, {self.n_rows} completions{credits} "
                f"({_describe_steps(self.steps)}, run {self.run_id!r}, {self.fmt}) stored")


# ----------------------------------------------------------------- public API
def import_files(store: Store, paths: Sequence[str | Path], fmt: str, *,
                 run_id: str | None = None,
                 reward_columns: Sequence[str] | None = None,
                 max_bytes: int = MAX_IMPORT_BYTES) -> list[ImportReport]:
    """Import dump files one by one (see ``import_file``); one report per file, in order.

    A bad file raises ``DumpImportError`` and writes nothing of that file; the
    files before it stay imported (rerunning skips them: appends are idempotent).
    ``max_bytes``: the largest file read (``MAX_IMPORT_BYTES``, 256 MiB, by default).
    """
    checked = check_format(fmt, reward_columns)
    reports: list[ImportReport] = []
    for path in paths:
        try:
            reports.append(import_file(store, path, checked, run_id=run_id,
                                       reward_columns=reward_columns, max_bytes=max_bytes))
        except DumpImportError as exc:
            if reports:
                note = (f" ({len(reports)} earlier file(s) were imported; rerunning "
                        "skips them)")
                raise DumpImportError(exc.path, exc.detail + note, line=exc.line,
                                      row=exc.row) from exc
            raise
    return reports


def import_file(store: Store, path: str | Path, fmt: str, *, run_id: str | None = None,
                reward_columns: Sequence[str] | None = None,
                max_bytes: int = MAX_IMPORT_BYTES) -> ImportReport:
    """Read, validate and append one dump file (trees, then its source advantages).

    ``fmt`` is one of ``IMPORT_FORMATS``; ``run_id`` defaults to
    ``default_run_id(path, fmt)``; ``reward_columns`` (TRL only) names the
    columns whose sum is the reward; ``max_bytes`` bounds the file's size. Raises
    ``DumpImportError`` (nothing written) for bad input.
    """
    dump = load_dump(path, fmt, run_id=run_id, reward_columns=reward_columns,
                     max_bytes=max_bytes)
    trees_commit: CommitReport | None = None
    credits_commit: CommitReport | None = None
    # The key is the file's sha256: the same bytes are the same import wherever the file
    # lies (its path-derived default run id may differ), so a stored key is a no-op here,
    # decided before the store's digest check (which refuses other content under a key).
    if dump.trees and store.delta_table("trees").transaction_version(dump.key) is not None:
        trees_commit = CommitReport(dump.key, skipped=["trees"])
    elif dump.trees:
        try:
            trees_commit = store.append_trees(TreeBatch.from_trees(dump.trees), key=dump.key)
        except TreeValidationError as exc:
            hint = ""
            if exc.rule == "duplicate_tree_id":
                hint = (f" (another file named {Path(dump.path).name!r} of run "
                        f"{dump.run_id!r} with different bytes is already stored; "
                        "pass a distinct run id if this is another run)")
            raise DumpImportError(dump.path, f"{exc}{hint}") from exc
    if dump.credits.num_rows and (
            store.delta_table("credits").transaction_version(dump.key) is not None):
        credits_commit = CommitReport(dump.key, skipped=["credits"])
    elif dump.credits.num_rows:
        # Its own commit after the trees: the same key makes a retry after a crash
        # between the two commits add the credits exactly once.
        credits_commit = store.append_credits(dump.credits, key=dump.key)
    return ImportReport(
        path=dump.path, fmt=dump.fmt, run_id=dump.run_id, key=dump.key, n_rows=dump.n_rows,
        n_trees=len(dump.trees), n_credits=dump.credits.num_rows, steps=dump.steps,
        trees_commit=trees_commit, credits_commit=credits_commit,
    )


def load_dump(path: str | Path, fmt: str, *, run_id: str | None = None,
              reward_columns: Sequence[str] | None = None,
              max_bytes: int = MAX_IMPORT_BYTES) -> LoadedDump:
    """Read and check a whole dump file (a regular file of at most ``max_bytes``) into
    trees and credits, writing nothing."""
    checked = check_format(fmt, reward_columns)
    p = Path(path)
    shown = str(path)
    if checked == "verl-jsonl":
        rows, sha = read_verl_jsonl(p, max_bytes)
    else:
        rows, sha = read_trl_parquet(p, reward_columns, max_bytes)
    run = run_id if run_id is not None else default_run_id(p, checked)
    if not run:
        raise DumpImportError(None, "run id must not be empty")
    trees, credits = build_trees(rows, checked, run_id=run, source=p, sha256=sha)
    return LoadedDump(
        path=shown, fmt=checked, run_id=run, key=f"import:{checked}:{sha}", sha256=sha,
        n_rows=len(rows), steps=tuple(sorted({r.step for r in rows})), trees=trees,
        credits=credits,
    )


def check_format(fmt: str, reward_columns: Sequence[str] | None = None) -> ImportFormat:
    """``fmt`` as an ``ImportFormat``; ``DumpImportError`` for an unknown one or bad options."""
    for known in IMPORT_FORMATS:
        if fmt == known:
            if reward_columns is not None and known != "trl-parquet":
                raise DumpImportError(None, "reward columns apply to trl-parquet only "
                                      f"(the {known} reward is its 'score' field)")
            if reward_columns is not None and not reward_columns:
                raise DumpImportError(None, "reward columns, when given, must name at least "
                                      "one column")
            return known
    raise DumpImportError(None, f"unknown import format {fmt!r}; expected one of "
                          f"{', '.join(IMPORT_FORMATS)}")


def default_run_id(path: str | Path, fmt: str) -> str:
    """The run id of a dump when none is given: the name of the run's directory.

    verl writes every step of a run to one ``rollout_data_dir``; TRL to
    ``<output_dir>/completions[/<mode>]/``. So the run id is the name of the
    directory holding the file, skipping TRL's fixed ``completions[/<mode>]``
    levels, so that all steps of one run share one id. A file with no named
    parent directory falls back to its own stem.
    """
    directory = Path(path).absolute().parent
    if fmt == "trl-parquet":
        if directory.name in ("train", "eval") and directory.parent.name == "completions":
            directory = directory.parent
        if directory.name == "completions":
            directory = directory.parent
    return directory.name or Path(path).stem


# -------------------------------------------------------------------- readers


def read_verl_jsonl(path: Path, max_bytes: int = MAX_IMPORT_BYTES
                    ) -> tuple[list[DumpRow], str]:
    """Parse a verl rollout JSONL file (``read_regular_file``: at most ``max_bytes``) line
    by line; return its rows and the sha256 of its bytes."""
    data = read_regular_file(path, max_bytes)
    digest = hashlib.sha256(data)
    rows: list[DumpRow] = []
    shown = str(path)
    name_step = _step_from_name(path)
    with io.BytesIO(data) as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DumpImportError(shown, f"not UTF-8 text ({exc.reason})",
                                      line=line_no) from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DumpImportError(shown, f"not valid JSON ({exc.msg} at column "
                                      f"{exc.colno})", line=line_no) from None
            except RecursionError:
                raise DumpImportError(shown, "JSON nested too deeply to read (at most "
                                      f"{MAX_NESTING} levels)", line=line_no) from None
            rows.append(_verl_row(obj, line_no, shown, name_step))
    return rows, digest.hexdigest()


def _verl_row(obj: Any, line_no: int, shown: str, name_step: int | None) -> DumpRow:
    def fail(detail: str) -> DumpImportError:
        return DumpImportError(shown, detail, line=line_no)

    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    for key in VERL_REQUIRED:
        if key not in obj:
            raise fail(f"missing required field {key!r}")
    for key, value in obj.items():
        check_value(value, key, fail)
        check_value(key, "a field name", fail)
    if "step" in obj:
        step = _as_step(obj["step"], fail)
    elif name_step is not None:
        step = name_step
    else:
        raise fail("missing field 'step' (and the file name carries no step)")
    # verl dumps decoded text (tokenizer.batch_decode): a list or a number in either field
    # is not a verl dump, and was stored as its JSON text on main (issue 21).
    prompt, structured = _as_text(obj["input"], "input", fail, chat=True)
    completion, _ = _as_text(obj["output"], "output", fail, chat=False)
    reward = _as_reward(obj["score"], "score", fail)
    advantage = _as_advantage(obj.get(ADVANTAGE_FIELD), fail)
    parts: dict[str, float] = {}
    meta: dict[str, Any] = {"source_line": line_no}
    missing: list[str] = []
    for key, value in obj.items():
        if key in VERL_KNOWN:
            continue
        if is_number(value):
            if math.isnan(value):
                missing.append(key)
            elif math.isinf(value):
                raise fail(f"reward component {key!r} is {value}")
            else:
                parts[key] = float(value)
        else:
            meta[key] = jsonable(value)
    if missing:
        meta["missing_reward_parts"] = missing
    group_meta = {"gts": jsonable(obj["gts"])} if "gts" in obj else {}
    return DumpRow(index=line_no, step=step, prompt=prompt, completion=completion,
                   reward=reward, reward_parts=parts, advantage=advantage, meta=meta,
                   group_meta=group_meta, structured_prompt=structured)


def read_trl_parquet(path: Path, reward_columns: Sequence[str] | None = None,
                     max_bytes: int = MAX_IMPORT_BYTES) -> tuple[list[DumpRow], str]:
    """Read a TRL completions Parquet file (``read_regular_file``: at most ``max_bytes``);
    return its rows and the sha256 of its bytes.

    ``reward_columns`` names the reward columns; by default every integer or
    floating column except ``step``, ``advantage`` and pandas index columns.
    """
    shown = str(path)
    data = read_regular_file(path, max_bytes)
    digest = hashlib.sha256(data)
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (OSError, pa.ArrowException) as exc:
        raise DumpImportError(shown, f"not a readable Parquet file ({exc})") from None
    schema = table.schema
    missing = [c for c in TRL_REQUIRED if c not in schema.names]
    if missing:
        raise DumpImportError(shown, f"missing required column(s) {', '.join(missing)} "
                              f"(columns: {', '.join(schema.names)})")
    for col in TRL_REQUIRED:  # on main an integer prompt column was summed into the reward
        if not _is_text_type(schema.field(col).type):
            raise DumpImportError(shown, f"column {col!r} is {schema.field(col).type}: "
                                  "expected text (string) or chat messages (a list of "
                                  "structs with 'role' and 'content')")
    index_columns = _pandas_index_columns(schema)
    numeric = [f.name for f in schema if _is_numeric_type(f.type)
               and f.name not in TRL_REQUIRED]
    if reward_columns is None:
        rewards = [c for c in numeric if c not in TRL_NOT_REWARDS and c not in index_columns]
        if not rewards:
            raise DumpImportError(shown, "no numeric reward columns (columns: "
                                  f"{', '.join(schema.names)}); name them with reward_columns")
    else:
        rewards = list(dict.fromkeys(reward_columns))
        for col in rewards:
            if col not in schema.names:
                raise DumpImportError(shown, f"reward column {col!r} does not exist "
                                      f"(columns: {', '.join(schema.names)})")
            if col not in numeric:
                raise DumpImportError(shown, f"reward column {col!r} is {schema.field(col).type}, "
                                      "not numeric")
    name_step = _step_from_name(path)
    if "step" not in schema.names and name_step is None:
        raise DumpImportError(shown, "no 'step' column, and the file name carries no step")
    skip = {*TRL_REQUIRED, "step", ADVANTAGE_FIELD, *rewards, *index_columns}
    extras = [c for c in schema.names if c not in skip]
    try:
        cols = {c: table.column(c).to_pylist() for c in schema.names if c not in index_columns}
    except UnicodeDecodeError as exc:
        raise DumpImportError(shown, f"a string column holds bytes that are not UTF-8 "
                              f"({exc.reason})") from None
    rows = []
    for i in range(table.num_rows):
        def fail(detail: str, i: int = i) -> DumpImportError:
            return DumpImportError(shown, detail, row=i)

        step = _as_step(cols["step"][i], fail) if "step" in cols else name_step
        assert step is not None  # checked above
        for c in ("prompt", "completion", *extras):
            check_value(cols[c][i], c, fail)
        prompt, structured = _as_text(cols["prompt"][i], "prompt", fail, chat=True)
        completion, _ = _as_text(cols["completion"][i], "completion", fail, chat=True)
        parts: dict[str, float] = {}
        absent: list[str] = []
        for col in rewards:
            value = cols[col][i]
            if value is None or math.isnan(value):
                absent.append(col)
            elif math.isinf(value):
                raise fail(f"reward column {col!r} is {value}")
            else:
                parts[col] = float(value)
        if not parts:
            raise fail(f"every reward column ({', '.join(rewards)}) is null or NaN")
        advantage = (_as_advantage(cols[ADVANTAGE_FIELD][i], fail)
                     if ADVANTAGE_FIELD in cols else None)
        meta: dict[str, Any] = {"source_row": i}
        meta.update({c: jsonable(cols[c][i]) for c in extras})
        if absent:
            meta["missing_reward_parts"] = absent
        rows.append(DumpRow(index=i, step=step, prompt=prompt, completion=completion,
                            reward=math.fsum(parts.values()), reward_parts=parts,
                            advantage=advantage, meta=meta, structured_prompt=structured))
    return rows, digest.hexdigest()


# ---------------------------------------------------------------------- trees
def build_trees(rows: Sequence[DumpRow], fmt: ImportFormat, *, run_id: str, source: Path,
                sha256: str) -> tuple[list[Tree], pa.Table]:
    """Group rows by (step, prompt) into one-level trees; return them and their credits.

    Trees come in the order of their first row; leaves (node ids 1..n, root 0)
    in row order. ``credits`` has one ``source_advantage`` row per leaf whose
    row carried an advantage.
    """
    groups: dict[tuple[int, str], list[DumpRow]] = {}
    for r in rows:
        groups.setdefault((r.step, r.prompt), []).append(r)
    env = ENV_OF_FORMAT[fmt]
    created = datetime.now(UTC)
    params = json.dumps({"source": fmt, "field": ADVANTAGE_FIELD}, sort_keys=True)
    params_hash = hashlib.sha256(params.encode()).hexdigest()[:16]
    trees: list[Tree] = []
    credit_rows: list[dict[str, Any]] = []
    for (step, prompt), group in groups.items():
        tree_id = tree_id_for(fmt, run_id, source.name, step, prompt)
        tree_meta: dict[str, Any] = {
            "source_format": fmt, "source_file": str(source.absolute()),
            "source_sha256": sha256, "step": step,
        }
        if group[0].structured_prompt:
            tree_meta["prompt_format"] = "json"
        shared = _shared_group_meta(group)
        tree_meta.update(shared)
        nodes = [Node(node_id=0, parent_id=None, kind="prompt", observation_text=prompt)]
        for node_id, r in enumerate(group, start=1):
            leaf_meta = dict(r.meta)
            leaf_meta.update({k: v for k, v in r.group_meta.items() if k not in shared})
            nodes.append(Node(node_id=node_id, parent_id=0, kind="decision",
                              action_text=r.completion, terminal=True, reward=r.reward,
                              reward_parts=dict(r.reward_parts), meta=leaf_meta))
            if r.advantage is not None:
                credit_rows.append({
                    "run_id": run_id, "method": SOURCE_ADVANTAGE_METHOD,
                    "method_params_hash": params_hash, "method_params": params,
                    "tree_id": tree_id, "node_id": node_id, "value": r.advantage,
                    "token_values": None, "policy_version": None, "created_at": created,
                })
        trees.append(Tree(tree_id=tree_id, nodes=nodes, run_id=run_id,
                          task_id=task_id_for(prompt), env=env, sampler="group",
                          budget=len(group), created_at=created, meta=tree_meta))
    return trees, pa.Table.from_pylist(credit_rows, schema=CREDITS)


def tree_id_for(fmt: ImportFormat, run_id: str, file_name: str, step: int, prompt: str) -> str:
    """The deterministic id of the tree of ``prompt`` at ``step`` in file ``file_name``."""
    key = json.dumps([fmt, run_id, file_name, step, prompt], ensure_ascii=False)
    return f"{ENV_OF_FORMAT[fmt]}-{hashlib.sha256(key.encode()).hexdigest()[:32]}"


def task_id_for(prompt: str) -> str:
    """The task id of a prompt: a short sha256 of its text."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


# -------------------------------------------------------------------- helpers
def _shared_group_meta(group: Sequence[DumpRow]) -> dict[str, Any]:
    """``group_meta`` entries on which every row of the group agrees."""
    first = group[0].group_meta
    return {k: v for k, v in first.items()
            if all(k in r.group_meta and r.group_meta[k] == v for r in group[1:])}


def _is_numeric_type(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t))


def _pandas_index_columns(schema: pa.Schema) -> set[str]:
    """Columns pandas stored for a DataFrame index (e.g. ``__index_level_0__``)."""
    names = {c for c in schema.names if c.startswith("__index_level_")}
    try:
        pandas_meta = schema.pandas_metadata
    except (ValueError, TypeError):  # malformed metadata: not written by pandas
        pandas_meta = None
    if pandas_meta:
        names.update(c for c in pandas_meta.get("index_columns", []) if isinstance(c, str))
    return names


def _as_step(value: Any, fail: Fail) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():  # a pandas float column: exact
        return int(value)
    # A string ("3") is not a step: it was parsed into one on main (issue 50 item 5).
    raise fail(f"step must be an integer, got {shown_json(value)}")


def _is_text_type(t: pa.DataType) -> bool:
    """Text, or chat messages (a list of structs), or all-null (each row then refused)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t):
        return True
    return bool((pa.types.is_list(t) or pa.types.is_large_list(t))
                and pa.types.is_struct(t.value_type))


def _as_text(value: Any, name: str, fail: Fail, *, chat: bool) -> tuple[str, bool]:
    """A prompt or completion as text; with ``chat``, chat messages (a list of objects
    with a string ``role``) are accepted too, as JSON. Anything else is refused."""
    if isinstance(value, str):
        return value, False
    if value is None:
        raise fail(f"{name} is null")
    if chat and isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        return json.dumps(jsonable(value), ensure_ascii=False, sort_keys=True), True
    shown = json.dumps(jsonable(value))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    expected = "text (a string) or chat messages (a list of objects with a 'role')" if chat \
        else "text (a string)"
    raise fail(f"{name} must be {expected}, got {type(value).__name__} {shown}")


def _as_reward(value: Any, name: str, fail: Fail) -> float:
    if not is_number(value):
        raise fail(f"{name} must be a number, got {shown_json(value)}")
    if not math.isfinite(value):
        raise fail(f"{name} is {value}")
    return float(value)


def _as_advantage(value: Any, fail: Fail) -> float | None:
    if value is None:
        return None
    return _as_reward(value, ADVANTAGE_FIELD, fail)


def _step_from_name(path: Path) -> int | None:
    """The step a dump's file name carries (``3.jsonl``, ``completions_00003.parquet``)."""
    match = re.search(r"(\d+)$", path.stem)
    return int(match.group(1)) if match else None


def _describe_steps(steps: Sequence[int]) -> str:
    if not steps:
        return "no steps"
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {steps[0]}-{steps[-1]}"
