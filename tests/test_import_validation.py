"""``rtrees import`` validates, never coerces (issue 50 item 5).

Every hostile or malformed ATIF file below was, before this change, either a raw
"unexpected" error (``RecursionError``, ``TypeError``, ``AttributeError``...), stored
silently with a coerced value, a hang (a FIFO) or a memory blow-up (``/dev/zero``). Each
is now one ``DumpImportError`` line naming the file and the field, and the store stays
empty. The verl / TRL readers share the file checks and the typed step.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_process import assert_one_line, counts, deep, rtrees
from typer.testing import CliRunner

from rollout_store.import_atif import import_atif_files
from rollout_store.import_checks import (
    MAX_IMPORT_BYTES,
    MAX_NESTING,
    DumpImportError,
    read_regular_file,
)
from rollout_store.importers import import_files
from rollout_store.reader import connect, read_trees
from rollout_store.store import Store

GOOD: dict[str, Any] = {
    "schema_version": "ATIF-v1.4", "session_id": "s-1",
    "agent": {"name": "a", "version": "1", "model_name": "m"},
    "steps": [
        {"step_id": 1, "source": "user", "message": "What is 2+2?"},
        {"step_id": 2, "source": "agent", "message": "<tool_call>calc</tool_call>",
         "observation": {"results": [{"source_call_id": None, "content": "4"}]},
         "metrics": {"prompt_token_ids": [1, 2], "completion_token_ids": [5, 6, 7],
                     "logprobs": [-0.5, -1.0, 0]},
         "extra": {"observation_token_ids": [9]}},
        {"step_id": 3, "source": "agent", "message": "4",
         "metrics": {"completion_token_ids": [8], "logprobs": [-0.25]}},
    ],
    "final_metrics": {"extra": {"reward": 1.0}},
    "extra": {"prompt_token_ids": [1, 2], "task_id": "t", "env": "calc"},
}


def _edit(path: str, value: Any) -> dict[str, Any]:
    """``GOOD`` with the field at dotted ``path`` (list indices as numbers) set to value."""
    doc = copy.deepcopy(GOOD)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node: Any = doc
    for key in parents:
        node = node[key]
    node[last] = value
    return doc


# (case, document or raw JSON text, the message's field and reason)
MALFORMED: list[tuple[str, Any, str]] = [
    ("null token id", _edit("steps.1.metrics.completion_token_ids", [None]),
     "steps[1].metrics.completion_token_ids[0]: expected an integer token id, got null"),
    ("1e400 token id", '{"schema_version": "ATIF-v1.4", "steps": [{"source": "agent", '
     '"message": "x", "metrics": {"completion_token_ids": [1e400]}}]}',
     "steps[0].metrics.completion_token_ids[0]: expected an integer token id, got Infinity"),
    ("metrics a list", _edit("steps.1.metrics", [1, 2]),
     "steps[1].metrics: expected an object, got [1, 2]"),
    ("observation a string", _edit("steps.1.observation", "4"),
     "steps[1].observation: expected an object, got \"4\""),
    ("results not a list", _edit("steps.1.observation", {"results": "4"}),
     "steps[1].observation.results: expected an array"),
    ("content not a string", _edit("steps.1.observation", {"results": [{"content": 4}]}),
     "steps[1].observation.results[0].content: expected a string, got 4"),
    ("steps an object", _edit("steps", {"a": 1}), "steps: expected an array"),
    ("step a string", _edit("steps.1", "agent"), "steps[1]: expected an object"),
    ("extra a list", _edit("extra", []), "extra: expected an object, got []"),
    ("final_metrics a string", _edit("final_metrics", "x"),
     "final_metrics: expected an object"),
    ("user message a number", _edit("steps.0.message", 5),
     "steps[0].message: expected a string, got 5"),
    ("unknown source", _edit("steps.0.source", "robot"), "steps[0].source: expected"),
    ("document an array", [1, 2], "expected a JSON object, got an array"),
    ("not JSON", "{not json", "not valid JSON"),
    ("bad UTF-8", b'{"a": "\xff"}', "not UTF-8"),
    ("deep nesting 100k", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("nesting 65 levels", _edit("extra.deep", json.loads("[" * 65 + "]" * 65)),
     "nested more than 64 levels deep"),
    ("lone surrogate", '{"schema_version": "ATIF-v1.4", "steps": [{"source": "user", '
     '"message": "\\ud800"}]}', "lone surrogate"),
    ("session_id a number", _edit("session_id", 7), "session_id: expected a string, got 7"),
    ("model_name a list", _edit("agent.model_name", ["m"]), "agent.model_name: expected"),
    ("step_id a float", _edit("steps.1.step_id", 2.5), "steps[1].step_id: expected an integer"),
    ("logprobs count", _edit("steps.2.metrics.logprobs", [-1.0, -2.0]),
     "steps[2].metrics.logprobs: 2 logprobs for 1 completion tokens"),
]
# values that were stored silently, coerced, before the change
COERCED: list[tuple[str, Any, str]] = [
    ("reward true", _edit("final_metrics.extra.reward", True),
     "final_metrics.extra.reward: expected a number, got true"),
    ("token id 1.9", _edit("steps.1.metrics.completion_token_ids", [5, 1.9, 7]),
     "steps[1].metrics.completion_token_ids[1]: expected an integer token id, got 1.9"),
    ("token ids a string", _edit("steps.1.metrics.completion_token_ids", "123"),
     "steps[1].metrics.completion_token_ids: expected an array of token ids, got \"123\""),
    ("token id true", _edit("extra.prompt_token_ids", [True]),
     "extra.prompt_token_ids[0]: expected an integer token id, got true"),
    ("token id out of range", _edit("steps.1.metrics.completion_token_ids", [5, 6, 2**31]),
     "token id 2147483648 is outside [0, 2147483647]"),
    ("negative token id", _edit("steps.1.extra.observation_token_ids", [-1]),
     "steps[1].extra.observation_token_ids[0]: token id -1 is outside"),
    ("token id a string", _edit("steps.2.metrics.completion_token_ids", ["8"]),
     "expected an integer token id, got \"8\""),
    ("positive logprob", _edit("steps.2.metrics.logprobs", [0.5]),
     "steps[2].metrics.logprobs[0]: a log-probability must be <= 0, got 0.5"),
    ("NaN logprob", '{"schema_version": "ATIF-v1.4", "steps": [{"source": "agent", '
     '"message": "x", "metrics": {"completion_token_ids": [1], "logprobs": [NaN]}}]}',
     "steps[0].metrics.logprobs[0]: expected a finite number, got NaN"),
    ("logprob a string", _edit("steps.2.metrics.logprobs", ["-1"]),
     "steps[2].metrics.logprobs[0]: expected a number, got \"-1\""),
    ("reward a string", _edit("final_metrics.extra.reward", "1"),
     "final_metrics.extra.reward: expected a number, got \"1\""),
    ("reward Infinity", '{"schema_version": "ATIF-v1.4", "steps": [{"source": "agent", '
     '"message": "x"}], "final_metrics": {"extra": {"reward": Infinity}}}',
     "final_metrics.extra.reward: expected a finite number"),
    ("task_id a number", _edit("extra.task_id", 12), "extra.task_id: expected a string"),
]


def _write(path: Path, doc: Any) -> Path:
    if isinstance(doc, bytes):
        path.write_bytes(doc)
    else:
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def _n_trees(store: Store) -> int:
    [(n,)] = connect(store).execute("SELECT count(*) FROM trees").fetchall()
    return int(n)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", create=True)


def test_good_file_imports_exactly(store: Store, tmp_path: Path) -> None:
    """The positive control: the typed reader keeps every value (ints stay ints, an int
    logprob 0 is 0.0) and the tree is what the trajectory says."""
    path = _write(tmp_path / "good.json", GOOD)
    report = import_atif_files(store, [path], "r")
    assert report.rows["trees"] == 1
    [tree] = read_trees(store, snapshots=False)
    chain = sorted(tree.nodes, key=lambda n: n.node_id)
    assert chain[0].observation_text == "What is 2+2?"
    assert list(chain[0].observation_token_ids) == [1, 2]
    assert list(chain[1].action_token_ids) == [5, 6, 7]
    assert list(chain[1].action_logprobs) == [-0.5, -1.0, 0.0]
    assert chain[1].observation_text == "4" and list(chain[1].observation_token_ids) == [9]
    assert chain[2].reward == 1.0 and chain[2].terminal
    assert tree.task_id == "t" and tree.env == "calc" and tree.policy_version == "m"
    assert import_atif_files(store, [path], "r").already_committed


@pytest.mark.parametrize(("case", "doc", "message"), MALFORMED + COERCED,
                         ids=[c[0] for c in MALFORMED + COERCED])
def test_malformed_atif_is_one_line_naming_the_field(store: Store, tmp_path: Path, case: str,
                                                    doc: Any, message: str) -> None:
    good = _write(tmp_path / "a-good.json", GOOD)  # imported in the same call: not stored
    bad = _write(tmp_path / "b-bad.json", doc)
    with pytest.raises(DumpImportError) as info:
        import_atif_files(store, [good, bad], "r")
    text = str(info.value)
    assert text.startswith(f"{bad}: "), text
    assert message in text, text
    assert "\n" not in text
    assert _n_trees(store) == 0


def test_fifo_is_refused_without_hanging(store: Store, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # no writer: a blocking open or read would hang the test
    with pytest.raises(DumpImportError, match="not a regular file: a FIFO"):
        import_atif_files(store, [fifo], "r")
    with pytest.raises(DumpImportError, match="not a regular file: a FIFO"):
        import_atif_files(store, [tmp_path], "r")  # found in a folder, refused too
    verl = tmp_path / "3.jsonl"
    os.mkfifo(verl)
    with pytest.raises(DumpImportError, match="not a regular file: a FIFO"):
        import_files(store, [verl], "verl-jsonl")
    assert _n_trees(store) == 0


def test_device_symlink_is_refused_without_reading(store: Store, tmp_path: Path) -> None:
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    with pytest.raises(DumpImportError,
                       match=r"not a regular file: a character device \(a symlink to it\)"):
        import_atif_files(store, [link], "r")
    parquet = tmp_path / "completions_00001.parquet"
    parquet.symlink_to("/dev/zero")
    with pytest.raises(DumpImportError, match="a character device"):
        import_files(store, [parquet], "trl-parquet")
    # a symlink to a regular file is followed
    target = _write(tmp_path / "real.txt", GOOD)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ok.json").symlink_to(target)
    assert import_atif_files(store, [tmp_path / "sub" / "ok.json"], "r").rows["trees"] == 1


def test_size_bound(store: Store, tmp_path: Path) -> None:
    assert MAX_IMPORT_BYTES == 256 * 2**20
    path = _write(tmp_path / "good.json", GOOD)
    size = path.stat().st_size
    assert read_regular_file(path, size) == path.read_bytes()
    with pytest.raises(DumpImportError, match=f"{size} bytes, over the import limit of "
                       f"{size - 1} bytes"):
        import_atif_files(store, [path], "r", max_bytes=size - 1)
    with pytest.raises(DumpImportError, match="over the import limit"):
        import_files(store, [path.rename(tmp_path / "3.jsonl")], "verl-jsonl", max_bytes=10)
    assert _n_trees(store) == 0


def test_missing_file_and_empty_folder(store: Store, tmp_path: Path) -> None:
    with pytest.raises(DumpImportError, match="no such file"):
        import_atif_files(store, [tmp_path / "nope.json"], "r")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpImportError, match=r"no ATIF \.json files given"):
        import_atif_files(store, [tmp_path / "empty"], "r")


@pytest.mark.parametrize(("step", "message"), [
    ("3", 'step must be an integer, got "3"'),
    (True, "step must be an integer, got true"),
    (2.5, "step must be an integer, got 2.5"),
])
def test_verl_step_is_typed(store: Store, tmp_path: Path, step: Any, message: str) -> None:
    """A JSON string step was parsed into an integer before (``"3"`` -> 3)."""
    path = tmp_path / "run" / "3.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"input": "p", "output": "o", "score": 1.0, "step": step})
                    + "\n")
    with pytest.raises(DumpImportError) as info:
        import_files(store, [path], "verl-jsonl")
    assert str(info.value) == f"{path}: line 1: {message}"
    assert _n_trees(store) == 0


def test_verl_reward_true_is_refused(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "run" / "3.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"input": "p", "output": "o", "score": True}) + "\n")
    with pytest.raises(DumpImportError, match="line 1: score must be a number, got true"):
        import_files(store, [path], "verl-jsonl")


def test_cli_one_line_and_max_mib(tmp_path: Path) -> None:
    from cli.main import app

    store = tmp_path / "store"
    bad = _write(tmp_path / "bad.json", _edit("steps.1.metrics.completion_token_ids", [1.9]))
    res = CliRunner().invoke(app, ["import", str(bad), "--store", str(store), "--format",
                                   "atif"])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert lines == [f"error: {bad}: steps[1].metrics.completion_token_ids[0]: expected an "
                     "integer token id, got 1.9"], res.output
    good = _write(tmp_path / "good.json", GOOD)
    res = CliRunner().invoke(app, ["import", str(good), "--store", str(store), "--format",
                                   "atif", "--max-mib", "0.0001"])
    assert res.exit_code == 1 and "over the import limit" in res.output, res.output
    res = CliRunner().invoke(app, ["import", str(good), "--store", str(store), "--format",
                                   "atif", "--max-mib", "0"])
    assert res.exit_code == 1 and "--max-mib must be a positive number" in res.output
    res = CliRunner().invoke(app, ["import", str(good), "--store", str(store), "--format",
                                   "atif"])
    assert res.exit_code == 0 and "1 trees imported" in res.output, res.output
    assert _n_trees(Store(store)) == 1


# ---- typed dump fields, deep nesting, lone surrogates (issue 21 item 10) ----------
GOOD_VERL = {"input": "What is 2+2?", "output": "4", "score": 1.0, "step": 1}
GOOD_TRL = {"step": [1, 1], "prompt": ["2+2?", "2+2?"], "completion": ["4", "5"],
            "accuracy": [1.0, 0.0]}


def _parquet(path: Path, cols: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)
    return path


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_trl_integer_prompt_is_refused_not_summed_into_the_reward(tmp_path: Path) -> None:
    store = Store(tmp_path / "store", create=True)
    path = _parquet(tmp_path / "run" / "completions" / "completions_00001.parquet",
                    {**GOOD_TRL, "prompt": [1, 1], "accuracy": [3.0, 0.0]})
    with pytest.raises(DumpImportError, match=r"column 'prompt' is int64: expected text"):
        import_files(store, [path], "trl-parquet")  # main: stored reward 1 + 3 = 4
    assert counts(store) == (0, 0)
    path = _parquet(tmp_path / "run" / "completions" / "completions_00002.parquet",
                    {**GOOD_TRL, "completion": [1.5, 2.5]})
    with pytest.raises(DumpImportError, match=r"column 'completion' is double"):
        import_files(store, [path], "trl-parquet")
    # Explicitly naming a text column as a reward column is refused too.
    good = _parquet(tmp_path / "run" / "completions" / "completions_00003.parquet", GOOD_TRL)
    with pytest.raises(DumpImportError, match=r"reward column 'prompt' is string"):
        import_files(store, [good], "trl-parquet", reward_columns=["prompt"])
    assert counts(store) == (0, 0)
    # Chat messages (TRL's conversational format) are still accepted.
    chat = _parquet(tmp_path / "chat" / "completions_00001.parquet", {
        **GOOD_TRL, "prompt": [[{"role": "user", "content": "2+2?"}]] * 2})
    assert import_files(store, [chat], "trl-parquet")[0].n_trees == 1
    rewards = connect(store).execute(
        "SELECT reward FROM nodes WHERE reward IS NOT NULL ORDER BY reward").fetchall()
    assert rewards == [(0.0,), (1.0,)]


@pytest.mark.parametrize(("row", "message"), [
    ({**GOOD_VERL, "output": ["4", "5"]}, "output must be text (a string), got list"),
    ({**GOOD_VERL, "output": 4}, "output must be text (a string), got int 4"),
    ({**GOOD_VERL, "input": 7}, "input must be text (a string) or chat messages"),
    ({**GOOD_VERL, "input": {"q": "2+2"}}, "input must be text (a string) or chat messages"),
])
def test_verl_wrong_field_types_are_refused(tmp_path: Path, row: dict[str, Any],
                                            message: str) -> None:
    store = Store(tmp_path / "store", create=True)
    path = _jsonl(tmp_path / "run" / "1.jsonl", [json.dumps(GOOD_VERL), json.dumps(row)])
    with pytest.raises(DumpImportError) as info:
        import_files(store, [path], "verl-jsonl")  # main: stored as the value's JSON text
    assert str(info.value).startswith(f"{path}: line 2: {message}"), str(info.value)
    assert counts(store) == (0, 0)


@pytest.mark.parametrize(("line", "message"), [
    (json.dumps(GOOD_VERL)[:-1] + ', "extra": ' + deep(20000) + "}",
     "JSON nested too deeply to read"),
    (json.dumps(GOOD_VERL)[:-1] + ', "extra": ' + deep(900) + "}",
     f"extra is nested more than {MAX_NESTING} levels deep"),
    (json.dumps({**GOOD_VERL, "output": "\ud800"}),
     "output holds a lone surrogate U+D800"),
    (json.dumps({**GOOD_VERL, "notes": {"k": ["\udfff"]}}),
     "notes holds a lone surrogate U+DFFF"),
    (json.dumps({**GOOD_VERL, "\ud83d": 1.0}), "a field name holds a lone surrogate U+D83D"),
])
def test_deep_nesting_and_lone_surrogates_are_named_errors(tmp_path: Path, line: str,
                                                           message: str) -> None:
    """On main: a raw RecursionError, a raw UnicodeEncodeError inside a [column_type]
    error, or (a surrogate in an extra field) silently stored."""
    path = _jsonl(tmp_path / "run" / "3.jsonl", [line])
    proc = rtrees("import", str(path), "--format", "verl-jsonl", "--store",
                  str(tmp_path / "store"))
    assert_one_line(proc, f"{path}: line 1: {message}")
    if (tmp_path / "store").exists():
        assert counts(Store(tmp_path / "store")) == (0, 0)
