"""``rtrees env play``: from outside the process once (an episode split across two runs
by a snapshot file), through ``CliRunner`` for the rest."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import assert_one_line, deep, rtrees
from typer.testing import CliRunner

import cli.env_cmd
from cli.main import app
from train.envs import ENVIRONMENTS
from train.envs.calc import CalcEnv, answer_text, call_text

RTREES = Path(sys.executable).parent / "rtrees"
TASK = CalcEnv.generate_tasks(1, seed=3)[0]
CALL = call_text(TASK.config["expr"])
ANSWER = answer_text(TASK.answer or "")


def _lines(stdout: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stdout.splitlines()]


def _play(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["env", "play", *args])
    return result.exit_code, result.stdout, result.stderr


def test_episode_across_two_processes(tmp_path: Path) -> None:
    snap = tmp_path / "state.json"
    first = subprocess.run(
        [str(RTREES), "env", "play", "--env", "calc", "--seed", "3", "--action", CALL,
         "--snapshot-out", str(snap)], capture_output=True, text=True, timeout=60, check=False)
    assert first.returncode == 0, first.stderr
    start, step1 = _lines(first.stdout)
    assert start == {"step": 0, "task_id": TASK.task_id, "observation": TASK.prompt,
                     "done": False}
    assert step1["observation"] == f"<tool_response>{TASK.answer}</tool_response>"
    assert step1["done"] is False

    second = subprocess.run(
        [str(RTREES), "env", "play", "--env", "calc", "--snapshot-in", str(snap),
         "--action", ANSWER], capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode == 0, second.stderr
    restored, step2 = _lines(second.stdout)
    assert restored == {"step": 1, "task_id": TASK.task_id, "restored": True, "done": False}
    assert step2 == {"step": 2, "observation": "", "done": True,
                     "reward_parts": {"reward": 1.0, "tool_calls": 1.0, "tool_errors": 0.0,
                                      "truncated": 0.0}}


def test_unknown_env_from_outside_exits_2_without_traceback() -> None:
    result = subprocess.run([str(RTREES), "env", "play", "--env", "nope"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "unknown environment 'nope'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_output_matches_the_library() -> None:
    actions = ["junk", CALL, ANSWER, ANSWER]
    code, out, _ = _play("--env", "calc", "--seed", "3", *[f"--action={a}" for a in actions])
    assert code == 0
    env = CalcEnv()
    env.reset(TASK)
    expected = [{"step": i, "observation": r.observation, "reward_parts": r.reward_parts,
                 "done": r.done} for i, r in enumerate((env.step(a) for a in actions), 1)]
    assert _lines(out)[1:] == expected
    assert expected[-1]["observation"] == "<tool_response>error: episode is over</tool_response>"


def test_no_actions_prints_the_start(tmp_path: Path) -> None:
    code, out, _ = _play("--env", "calc", "--seed", "3", "--snapshot-out",
                         str(tmp_path / "s.json"))
    assert code == 0 and len(_lines(out)) == 1
    code, out, _ = _play("--env", "calc", "--snapshot-in", str(tmp_path / "s.json"),
                         "--action", CALL, "--action", ANSWER)
    assert code == 0 and [line["step"] for line in _lines(out)] == [0, 1, 2]
    assert _lines(out)[-1]["reward_parts"]["reward"] == 1.0  # type: ignore[index]


def test_difficulty_and_mix_reach_the_generator() -> None:
    code, out, _ = _play("--env", "calc", "--seed", "0", "--difficulty", "5",
                         "--mix", "max_steps=1", "--action", "junk")
    assert code == 0
    start, step = _lines(out)
    task = CalcEnv.generate_tasks(1, 0, difficulties=[5], max_steps=1)[0]
    assert start["task_id"] == task.task_id
    assert step["done"] is True and step["reward_parts"]["truncated"] == 1.0  # type: ignore[index]


def test_raw_snapshot_file_is_accepted(tmp_path: Path) -> None:
    env = CalcEnv()
    env.reset(TASK)
    env.step(CALL)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(env.snapshot())
    code, out, _ = _play("--env", "calc", "--snapshot-in", str(raw), "--action", ANSWER)
    assert code == 0
    restored, step = _lines(out)
    assert restored == {"step": 0, "task_id": None, "restored": True, "done": False}
    assert step["reward_parts"]["reward"] == 1.0  # type: ignore[index]


def _wrapper(env: str, state: bytes) -> bytes:
    return json.dumps({"format": cli.env_cmd.SNAPSHOT_FILE_FORMAT, "env": env, "task_id": "t",
                       "step": 1, "done": False,
                       "state": base64.b64encode(state).decode()}).encode()


@pytest.mark.parametrize(("args", "message"), [
    (["--env", "nope"], "unknown environment 'nope'"),
    (["--env", "ghost"], "module 'train.envs.ghost_does_not_exist' does not import "
                           "(ModuleNotFoundError"),
    (["--env", "calc", "--difficulty", "9"], "difficulties must be"),
    (["--env", "calc", "--mix", "colour=3"], "unknown calc task option"),
    (["--env", "calc", "--mix", "novalue"], "--mix 'novalue': expected KEY=VALUE"),
    (["--env", "calc", "--snapshot-in", "{missing}"], "cannot read"),
    (["--env", "calc", "--snapshot-in", "{garbage}"], "cannot restore the snapshot"),
    (["--env", "calc", "--snapshot-in", "{other_env}"], "the snapshot is of environment "
                                                         "'workflow'"),
    (["--env", "calc", "--snapshot-in", "{bad_state}"], "not a calc snapshot"),
    (["--env", "calc", "--snapshot-in", "{bad_wrapper}"], "malformed snapshot file"),
])
def test_input_errors_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             args: list[str], message: str) -> None:
    monkeypatch.setitem(ENVIRONMENTS, "ghost", "train.envs.ghost_does_not_exist:Ghost")
    files = {"missing": tmp_path / "missing", "garbage": tmp_path / "garbage",
             "other_env": tmp_path / "other", "bad_state": tmp_path / "bad_state",
             "bad_wrapper": tmp_path / "bad_wrapper"}
    files["garbage"].write_bytes(b"\x00not a snapshot")
    files["other_env"].write_bytes(_wrapper("workflow", b"{}"))
    files["bad_state"].write_bytes(_wrapper("calc", b'{"format": "calc/1"}'))
    files["bad_wrapper"].write_bytes(json.dumps(
        {"format": cli.env_cmd.SNAPSHOT_FILE_FORMAT, "env": "calc", "step": 1,
         "state": "!!not base64"}).encode())
    code, out, err = _play(*[a.format(**files) for a in args])
    assert code == 2
    assert out == ""
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_environment_failure_exits_1_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    class Exploding(CalcEnv):
        def step(self, action_text: str):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

    monkeypatch.setattr(cli.env_cmd, "make_env", lambda name: Exploding())
    code, out, err = _play("--env", "calc", "--action", "x")
    assert code == 1
    assert len(_lines(out)) == 1  # the start line came out before the failure
    assert err == "error: environment 'calc' failed: RuntimeError: boom\n"


def test_unwritable_snapshot_out_exits_1(tmp_path: Path) -> None:
    code, _, err = _play("--env", "calc", "--snapshot-out", str(tmp_path / "no" / "such"))
    assert code == 1 and err.startswith("error: cannot write")


# ---- deep JSON and bounded snapshot files (issue 21 item 10) --------------------
def test_deep_json_in_options_and_snapshots_is_a_named_error(tmp_path: Path) -> None:
    proc = rtrees("env", "play", "--env", "calc", "--mix", f"difficulties={deep(20000)}")
    assert_one_line(proc, "--mix difficulties=...: JSON nested too deeply")
    snap = tmp_path / "deep.snapshot"
    snap.write_text('{"format": "rtrees-env-snapshot/1", "env": "calc", "state": '
                    + deep(20000) + "}")
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", str(snap))
    assert_one_line(proc, "malformed snapshot file: JSON nested too deeply")


# ------------------------------------------------------------------- env play snapshots
def test_snapshot_in_reads_only_a_bounded_regular_file(tmp_path: Path) -> None:
    # /dev/zero: main read it until memory ran out (here: under a 4 GiB address-space
    # limit, MemoryError); now it is refused before reading.
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", "/dev/zero",
                  timeout=60, limit_as=4 << 30)
    assert_one_line(proc, "/dev/zero is not a regular file")
    assert proc.returncode == 2
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # main blocked in open() until a writer came
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", str(fifo), timeout=60)
    assert_one_line(proc, f"{fifo} is not a regular file")
    big = tmp_path / "big.snapshot"
    with open(big, "wb") as fh:  # sparse: no disk used
        fh.truncate(100 << 20)
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", str(big), timeout=60)
    assert_one_line(proc, f"{big} is 104,857,600 bytes, larger than a snapshot file can be")
    # A real snapshot still round-trips.
    out = tmp_path / "ok.snapshot"
    proc = rtrees("env", "play", "--env", "calc", "--seed", "3", "--snapshot-out", str(out))
    assert proc.returncode == 0, proc.stderr
    proc = rtrees("env", "play", "--env", "calc", "--snapshot-in", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[0])["restored"] is True
