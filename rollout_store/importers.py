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

A third source, ``atif`` (``import_atif_files``; ``rtrees import --format atif``): ATIF
v1.x trajectory files (``*.json``, or folders of them, e.g. ``rtrees export --format
atif``), one tree each: the first ``user`` step's message is the root's prompt, each
``agent`` step one node below the previous, with its text, token ids, logprobs and
observation; the reward is ``final_metrics.extra.reward``. Every file is read and checked
before the one commit (keyed by the files' bytes), so a bad file writes nothing.

Hostile input (issue 50 item 5) is refused in one line naming the file and the field,
never coerced:

* only regular files are read (a symlink is judged by its target): a FIFO, a device
  (``/dev/zero``), a socket or a directory is refused before a byte is read, and the
  file is opened non-blocking and checked again after the open;
* a file holds at most ``MAX_IMPORT_BYTES`` (256 MiB; ``max_bytes`` to change it) and is
  read with a bounded read;
* JSON nests at most ``MAX_NESTING`` (64) levels (deeper input, which Python's parser
  meets with a ``RecursionError``, is one line);
* typed fields: a number is never a boolean (``true`` is not a reward of 1.0); a token
  id is an integer in ``[0, MAX_TOKEN_ID]`` (not ``1.9``, ``null``, ``1e400`` or a
  string); logprobs are finite numbers ``<= 0``; rewards finite numbers; ATIF
  ``metrics``, ``observation`` and ``extra`` are objects as the ATIF schema
  (``rollout_store.exporters.ATIF_SCHEMA``) says, messages strings; a step is an
  integer (a JSON string ``"3"`` is refused). The message says where, e.g.
  ``steps[3].metrics.completion_token_ids[0]: expected an integer token id, got 1.9``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal, get_args

import pyarrow as pa
import pyarrow.parquet as pq

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

_HASH_CHUNK: Final[int] = 1 << 20
# Deepest nesting of lists and objects accepted in one dump row (issue 21: a deeply nested
# field raised a raw RecursionError). Chat messages need 3 or 4 levels.
MAX_NESTING: Final[int] = 64

# Largest dump file read (bytes; ``max_bytes`` overrides it): far above one training
# step's rollouts, low enough that a wrong path (a disk image, /dev/zero behind a link)
# is refused instead of exhausting memory (issue 50 item 5).
MAX_IMPORT_BYTES: Final[int] = 256 * 1024 * 1024
# Token ids are int32 in the store (schema.NODES): a vocabulary index in [0, 2**31).
MAX_TOKEN_ID: Final[int] = 2**31 - 1
ATIF_FORMAT: Final[str] = "atif"
ATIF_SKIPPED: Final[frozenset[str]] = frozenset({"metadata.json", "dataset_info.json"})

# Builds the error for the line or row being read, given the detail.
_Fail = Callable[[str], "DumpImportError"]


class DumpImportError(ValueError):
    """A dump cannot be imported; the message names the file and the line or row.

    ``path`` is the file (None for an error about the arguments), ``line`` the
    1-based JSONL line, ``row`` the 0-based Parquet row, ``detail`` the reason.
    """

    def __init__(self, path: str | None, detail: str, *, line: int | None = None,
                 row: int | None = None) -> None:
        self.path = path
        self.line = line
        self.row = row
        self.detail = detail
        where = [] if path is None else [path]
        if line is not None:
            where.append(f"line {line}")
        if row is not None:
            where.append(f"row {row}")
        super().__init__(": ".join([*where, detail]))


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
def read_regular_file(path: str | Path, max_bytes: int = MAX_IMPORT_BYTES) -> bytes:
    """The bytes of ``path``, a regular file (a symlink is judged by its target) of at
    most ``max_bytes`` bytes; ``DumpImportError`` naming the file otherwise.

    A FIFO, device, socket or directory is refused by ``os.stat`` before it is opened;
    the open is non-blocking (a FIFO swapped in meanwhile cannot hang it) and the opened
    file is checked again (``fstat``: still a regular file, the same inode). The read
    stops after ``max_bytes + 1`` bytes, so a file that grows meanwhile is refused too."""
    shown = str(path)
    if max_bytes < 0:
        raise DumpImportError(None, f"max_bytes must be >= 0, got {max_bytes}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DumpImportError(shown, "no such file") from None
    except OSError as exc:
        raise DumpImportError(shown, f"cannot read it ({exc.strerror or exc})") from None
    _require_regular(shown, path, st.st_mode)
    limit = (f"over the import limit of {max_bytes} bytes ({max_bytes / 2**20:g} MiB; "
             "raise max_bytes to import it)")
    if st.st_size > max_bytes:
        raise DumpImportError(shown, f"{st.st_size} bytes, {limit}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise DumpImportError(shown, f"cannot read it ({exc.strerror or exc})") from None
    try:
        opened = os.fstat(fd)
        _require_regular(shown, path, opened.st_mode)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise DumpImportError(shown, "replaced while it was opened")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(_HASH_CHUNK, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise DumpImportError(shown, f"grew past {max_bytes} bytes while read, {limit}")
        return b"".join(chunks)
    except OSError as exc:
        raise DumpImportError(shown, f"cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def _require_regular(shown: str, path: str | Path, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)"
            if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket"
            if stat.S_ISSOCK(mode) else "not a regular file")
    link = " (a symlink to it)" if os.path.islink(path) else ""
    raise DumpImportError(shown, f"not a regular file: {kind}{link}")


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
        _check_value(value, key, fail)
        _check_value(key, "a field name", fail)
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
        if _is_number(value):
            if math.isnan(value):
                missing.append(key)
            elif math.isinf(value):
                raise fail(f"reward component {key!r} is {value}")
            else:
                parts[key] = float(value)
        else:
            meta[key] = _jsonable(value)
    if missing:
        meta["missing_reward_parts"] = missing
    group_meta = {"gts": _jsonable(obj["gts"])} if "gts" in obj else {}
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
            _check_value(cols[c][i], c, fail)
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
        meta.update({c: _jsonable(cols[c][i]) for c in extras})
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


# ----------------------------------------------------------------------- ATIF
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


def parse_json_document(raw: bytes, shown: str) -> Any:
    """``raw`` parsed as one JSON document; ``DumpImportError`` naming ``shown`` for bytes
    that are not UTF-8 JSON, or that nest more than ``MAX_NESTING`` levels (or hold a lone
    surrogate: ``_check_value``)."""
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DumpImportError(shown, f"not valid JSON ({exc.msg} at line {exc.lineno} "
                              f"column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise DumpImportError(shown, f"not UTF-8 text ({exc.reason})") from None
    except RecursionError:  # Python's parser recurses per level: ~1000 levels
        raise DumpImportError(shown, f"JSON nested too deeply to read (at most "
                              f"{MAX_NESTING} levels)") from None

    def fail(detail: str) -> DumpImportError:
        return DumpImportError(shown, detail)

    _check_value(doc, "the document", fail)
    return doc


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
        raise fail(f"not an ATIF trajectory: expected a JSON object, got {_type_of(traj)}")
    version = traj.get("schema_version")
    if not isinstance(version, str) or not version.startswith("ATIF-v1."):
        raise fail(f"not an ATIF trajectory: schema_version {_shown(version)}")
    steps = traj.get("steps")
    if not isinstance(steps, list):
        raise fail(f"steps: expected an array, got {_shown(steps)}")
    extra = _opt_object(traj, "extra", "extra", fail)
    agent = _opt_object(traj, "agent", "agent", fail)
    final = _opt_object(traj, "final_metrics", "final_metrics", fail)
    final_extra = _opt_object(final, "extra", "final_metrics.extra", fail)
    reward = final_extra.get("reward")
    if reward is not None:
        reward = _finite(reward, "final_metrics.extra.reward", fail)
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
            raise fail(f"{where}: expected an object, got {_shown(s)}")
        kind = s.get("source")
        if kind not in ("system", "user", "agent"):
            raise fail(f"{where}.source: expected 'system', 'user' or 'agent', got "
                       f"{_shown(kind)}")
        message = s.get("message")
        if not isinstance(message, str):
            raise fail(f"{where}.message: expected a string, got {_shown(message)}")
        step_id = s.get("step_id")
        if step_id is not None and (not _is_number(step_id) or not isinstance(step_id, int)):
            raise fail(f"{where}.step_id: expected an integer, got {_shown(step_id)}")
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
                       f"{_shown(results)}")
        texts = []
        for j, r in enumerate(results):
            at = f"{where}.observation.results[{j}]"
            if not isinstance(r, dict):
                raise fail(f"{at}: expected an object, got {_shown(r)}")
            content = r.get("content", "")
            if not isinstance(content, str):
                raise fail(f"{at}.content: expected a string, got {_shown(content)}")
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


def _opt_object(parent: Mapping[str, Any], key: str, where: str, fail: _Fail
                ) -> dict[str, Any]:
    """``parent[key]``, an object, or {} when absent or null."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(f"{where}: expected an object, got {_shown(value)}")
    return value


def _opt_str(parent: Mapping[str, Any], key: str, where: str, fail: _Fail) -> str | None:
    value = parent.get(key)
    if value is not None and not isinstance(value, str):
        raise fail(f"{where}: expected a string, got {_shown(value)}")
    return value


def _token_ids(value: Any, where: str, fail: _Fail) -> list[int]:
    """A list of token ids: integers (not booleans, floats or strings) in
    ``[0, MAX_TOKEN_ID]``."""
    if not isinstance(value, list):
        raise fail(f"{where}: expected an array of token ids, got {_shown(value)}")
    for k, t in enumerate(value):
        if not _is_number(t) or not isinstance(t, int):
            raise fail(f"{where}[{k}]: expected an integer token id, got {_shown(t)}")
        if not 0 <= t <= MAX_TOKEN_ID:
            raise fail(f"{where}[{k}]: token id {t} is outside [0, {MAX_TOKEN_ID}]")
    return list(value)


def _logprobs(value: Any, where: str, fail: _Fail) -> list[float]:
    """A list of log-probabilities: finite numbers ``<= 0``."""
    if not isinstance(value, list):
        raise fail(f"{where}: expected an array of numbers, got {_shown(value)}")
    out = []
    for k, v in enumerate(value):
        lp = _finite(v, f"{where}[{k}]", fail)
        if lp > 0:
            raise fail(f"{where}[{k}]: a log-probability must be <= 0, got {_shown(v)}")
        out.append(lp)
    return out


def _finite(value: Any, where: str, fail: _Fail) -> float:
    """A finite number (``true`` is not 1.0)."""
    if not _is_number(value):
        raise fail(f"{where}: expected a number, got {_shown(value)}")
    if not math.isfinite(value):
        raise fail(f"{where}: expected a finite number, got {_shown(value)}")
    return float(value)


def _type_of(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """``value`` as its JSON text (strings quoted, floats as written), at most 60
    characters."""
    try:
        text = json.dumps(_jsonable(value) if not isinstance(value, float) else value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


# -------------------------------------------------------------------- helpers
def _shared_group_meta(group: Sequence[DumpRow]) -> dict[str, Any]:
    """``group_meta`` entries on which every row of the group agrees."""
    first = group[0].group_meta
    return {k: v for k, v in first.items()
            if all(k in r.group_meta and r.group_meta[k] == v for r in group[1:])}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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


def _as_step(value: Any, fail: _Fail) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():  # a pandas float column: exact
        return int(value)
    # A string ("3") is not a step: it was parsed into one on main (issue 50 item 5).
    raise fail(f"step must be an integer, got {_shown(value)}")


def _is_text_type(t: pa.DataType) -> bool:
    """Text, or chat messages (a list of structs), or all-null (each row then refused)."""
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t):
        return True
    return bool((pa.types.is_list(t) or pa.types.is_large_list(t))
                and pa.types.is_struct(t.value_type))


def _as_text(value: Any, name: str, fail: _Fail, *, chat: bool) -> tuple[str, bool]:
    """A prompt or completion as text; with ``chat``, chat messages (a list of objects
    with a string ``role``) are accepted too, as JSON. Anything else is refused."""
    if isinstance(value, str):
        return value, False
    if value is None:
        raise fail(f"{name} is null")
    if chat and isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        return json.dumps(_jsonable(value), ensure_ascii=False, sort_keys=True), True
    shown = json.dumps(_jsonable(value))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    expected = "text (a string) or chat messages (a list of objects with a 'role')" if chat \
        else "text (a string)"
    raise fail(f"{name} must be {expected}, got {type(value).__name__} {shown}")


def _check_value(value: Any, name: str, fail: _Fail) -> None:
    """Refuse ``value`` (a JSON or Arrow value of field ``name``) if it nests deeper than
    ``MAX_NESTING`` or holds a string with a lone UTF-16 surrogate (valid JSON, ``"\\ud800"``,
    but not Unicode text: it could not be stored). Iterative, so any depth is safe."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = item[exc.start]
                raise fail(f"{name} holds a lone surrogate U+{ord(bad):04X} (not valid "
                           "Unicode text)") from None
        elif isinstance(item, dict | list | tuple):
            if depth >= MAX_NESTING:
                raise fail(f"{name} is nested more than {MAX_NESTING} levels deep")
            children = ([*item.keys(), *item.values()] if isinstance(item, dict)
                        else list(item))
            stack.extend((child, depth + 1) for child in children)


def _as_reward(value: Any, name: str, fail: _Fail) -> float:
    if not _is_number(value):
        raise fail(f"{name} must be a number, got {_shown(value)}")
    if not math.isfinite(value):
        raise fail(f"{name} is {value}")
    return float(value)


def _as_advantage(value: Any, fail: _Fail) -> float | None:
    if value is None:
        return None
    return _as_reward(value, ADVANTAGE_FIELD, fail)


def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON data: non-finite floats become null, unknown types text."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


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
