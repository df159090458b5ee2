"""``rtrees env ...``: drive an environment by hand (issue 3).

``rtrees env play --env calc --seed 3 --action '<tool_call>...</tool_call>' --action ...``
runs one episode of the seeded task ``generate_tasks(1, seed)[0]`` and prints one JSON
line per step. ``--snapshot-out`` / ``--snapshot-in`` save and continue an episode.

``rtrees env check SPEC`` runs the conformance check (``train.envs.check.check_env``, issue
44): one line per check, then what the env supports; exit 1 when a required check fails,
2 when the spec does not resolve.

The snapshot file is JSON: ``{"format": "rtrees-env-snapshot/1", "env", "task_id",
"step", "done", "state"}`` with ``state`` the base64 of ``Environment.snapshot()``, so
that ``--snapshot-in`` can check the environment and continue the step numbering. A
file holding raw ``Environment.snapshot()`` bytes is accepted too (steps then count
from 0 and the task id is unknown).

The logic lives in ``start_episode`` / ``step_episode`` / ``snapshot_file`` so that
tests and notebooks can call it without the command line.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from cli._common import ParamError, fail, parse_json_params
from train.envs import ENVIRONMENTS, Environment, env_class, make_env

env_app = typer.Typer(help="Try tool environments by hand.", no_args_is_help=True)

SNAPSHOT_FILE_FORMAT = "rtrees-env-snapshot/1"
# The largest --snapshot-in file read (issue 21: /dev/zero was read without bound). Our
# environments' snapshots are kilobytes; base64 in the JSON wrapper adds a third.
MAX_SNAPSHOT_FILE_BYTES = 64 << 20


class EnvCommandError(Exception):
    """A problem with the command's input (unknown environment, bad option, bad
    snapshot file): reported in one line, exit code 2."""


@dataclass
class Episode:
    """An environment mid-episode and what the command line knows about it."""

    env: Environment
    env_name: str
    task_id: str | None
    step: int
    done: bool = False


def load_env(name: str) -> Environment:
    """``make_env(name)``, with unknown or unavailable environments as ``EnvCommandError``."""
    try:
        env_class(name)
    except ValueError as exc:  # EnvSpecError
        raise EnvCommandError(str(exc)) from None
    try:
        return make_env(name)
    except Exception as exc:  # a missing module or a failing constructor alike
        raise EnvCommandError(f"environment {name!r} is not available: "
                              f"{type(exc).__name__}: {exc}") from None


def parse_mix(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` options for ``generate_tasks``; VALUE is JSON, else a plain string."""
    try:
        return parse_json_params(items, "--mix")
    except ParamError as exc:
        raise EnvCommandError(str(exc)) from None


def start_episode(env_name: str, seed: int, mix: dict[str, Any] | None = None,
                  snapshot_in: bytes | None = None) -> tuple[Episode, dict[str, Any]]:
    """A fresh episode of ``generate_tasks(1, seed, **mix)[0]``, or one restored from a
    snapshot file's bytes; returns it with the first output record."""
    env = load_env(env_name)
    try:
        if snapshot_in is not None:
            episode = _restore(env, env_name, snapshot_in)
            return episode, {"step": episode.step, "task_id": episode.task_id,
                             "restored": True, "done": episode.done}
        try:
            task = type(env).generate_tasks(1, seed, **(mix or {}))[0]
        except (TypeError, ValueError) as exc:
            raise EnvCommandError(f"cannot generate a {env_name} task: {exc}") from None
        observation = env.reset(task)
    except BaseException:
        env.close()
        raise
    return (Episode(env, env_name, task.task_id, 0),
            {"step": 0, "task_id": task.task_id, "observation": observation, "done": False})


def read_snapshot_file(path: Path, limit: int = MAX_SNAPSHOT_FILE_BYTES) -> bytes:
    """The bytes of a ``--snapshot-in`` file: a regular file of at most ``limit`` bytes.

    A device (``/dev/zero``), FIFO or directory is refused before reading (the FIFO is
    opened non-blocking, so a missing writer cannot hang the command), and a file that
    grows past ``limit`` while it is read is refused too: ``EnvCommandError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise EnvCommandError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise EnvCommandError(f"{path} is not a regular file (a snapshot file is one "
                                  "written by --snapshot-out)")
        if info.st_size > limit:
            raise EnvCommandError(f"{path} is {info.st_size:,} bytes, larger than a "
                                  f"snapshot file can be ({limit:,} bytes)")
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise EnvCommandError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > limit:
        raise EnvCommandError(f"{path} grew past {limit:,} bytes while it was read")
    return data


def _restore(env: Environment, env_name: str, data: bytes) -> Episode:
    wrapper = _read_wrapper(data)
    if wrapper is None:  # raw Environment.snapshot() bytes
        state, task_id, step, done = data, None, 0, False
    else:
        if wrapper["env"] != env_name:
            raise EnvCommandError(f"the snapshot is of environment {wrapper['env']!r}, "
                                  f"not {env_name!r}")
        state, task_id, step, done = (wrapper["state"], wrapper["task_id"], wrapper["step"],
                                      wrapper["done"])
    try:
        env.restore(state)
    except Exception as exc:
        raise EnvCommandError(f"cannot restore the snapshot: {exc}") from None
    return Episode(env, env_name, task_id, step, done)


def _read_wrapper(data: bytes) -> dict[str, Any] | None:
    """The fields of a snapshot file, or None when ``data`` is not one."""
    try:
        wrapper = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    except RecursionError:  # JSON, but nested too deeply for the parser
        raise EnvCommandError("malformed snapshot file: JSON nested too deeply") from None
    if not isinstance(wrapper, dict) or wrapper.get("format") != SNAPSHOT_FILE_FORMAT:
        return None
    try:
        fields = {"env": str(wrapper["env"]), "task_id": wrapper.get("task_id"),
                  "step": int(wrapper["step"]), "done": bool(wrapper.get("done", False)),
                  "state": base64.b64decode(wrapper["state"], validate=True)}
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise EnvCommandError(f"malformed snapshot file: {exc}") from None
    return fields


def step_episode(episode: Episode, action: str) -> dict[str, Any]:
    """Apply one action; the output record of that step."""
    result = episode.env.step(action)
    episode.step += 1
    episode.done = result.done
    return {"step": episode.step, "observation": result.observation,
            "reward_parts": result.reward_parts, "done": result.done}


def snapshot_file(episode: Episode) -> bytes:
    """The snapshot file's bytes for the episode's current state."""
    record = {"format": SNAPSHOT_FILE_FORMAT, "env": episode.env_name,
              "task_id": episode.task_id, "step": episode.step, "done": episode.done,
              "state": base64.b64encode(episode.env.snapshot()).decode("ascii")}
    return (json.dumps(record, sort_keys=True) + "\n").encode()


def _error(message: str, code: int) -> typer.Exit:
    fail(message, code)


@env_app.command("play")
def play(
    env: Annotated[str, typer.Option("--env", help=f"Environment: {', '.join(ENVIRONMENTS)}, "
                                                   "an installed name or module:Class.")],
    seed: Annotated[int, typer.Option(help="Task seed: the task is generate_tasks(1, seed)[0].")
                    ] = 0,
    action: Annotated[list[str] | None, typer.Option(
        "--action", help="One action text per step, in order (repeat the option).")] = None,
    snapshot_in: Annotated[Path | None, typer.Option(
        help="Start from this saved state instead of the task's start (--seed, --difficulty "
             "and --mix are then ignored).")] = None,
    snapshot_out: Annotated[Path | None, typer.Option(
        help="Save the state after the last action here.")] = None,
    difficulty: Annotated[list[int] | None, typer.Option(
        help="Task difficulty (repeat for a mix): generate_tasks(..., difficulties=[...]).")
                          ] = None,
    mix: Annotated[list[str] | None, typer.Option(
        help="Other generate_tasks option as KEY=JSON, e.g. max_steps=6 (repeatable).")
                   ] = None,
) -> None:
    """Run one episode with the given actions; print one JSON line per step."""
    try:
        options = parse_mix(mix or [])
        if difficulty:
            options["difficulties"] = list(difficulty)
        state = None
        if snapshot_in is not None:
            state = read_snapshot_file(snapshot_in)
        episode, first = start_episode(env, seed, options, state)
    except EnvCommandError as exc:
        raise _error(str(exc), 2) from None
    try:
        print(json.dumps(first))
        for text in action or []:
            print(json.dumps(step_episode(episode, text)), flush=True)
        saved = snapshot_file(episode) if snapshot_out is not None else None
    except Exception as exc:  # an environment bug: report it in one line, no traceback
        raise _error(f"environment {env!r} failed: {type(exc).__name__}: {exc}", 1) from None
    finally:
        episode.env.close()
    if snapshot_out is not None and saved is not None:
        try:
            snapshot_out.write_bytes(saved)
        except OSError as exc:
            raise _error(f"cannot write {snapshot_out}: {exc.strerror}", 1) from None


@env_app.command("check")
def check(
    spec: Annotated[str | None, typer.Argument(
        help=f"Environment: {', '.join(ENVIRONMENTS)}, an installed name, module:Class or "
             "agent:module:function.")] = None,
    agent: Annotated[str | None, typer.Option(
        "--agent", help="An agent program module:function instead of SPEC (the same as "
                        "agent:module:function): a replay that diverges names the first "
                        "divergent call and the field that differed.")] = None,
    prefixes: Annotated[int, typer.Option(
        min=1, help="Random prefixes per snapshot strategy (restore-then-step determinism).")
                        ] = 20,
    seed: Annotated[int, typer.Option(help="Seed of the tasks and of the random actions.")
                    ] = 0,
    tasks: Annotated[int, typer.Option(min=1, help="Tasks generated (generate_tasks).")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check that an environment works before collecting: tasks, tools, episodes, snapshot
    strategies (restore-then-step determinism, cost), reseed, threads; then what it supports."""
    from train.envs import EnvSpecError
    from train.envs.check import CheckResult, check_env
    from train.sampling import SAMPLERS

    def show(result: CheckResult) -> None:
        typer.echo(result.line())

    if (spec is None) == (agent is None):
        raise _error("give exactly one of SPEC and --agent", 2)
    try:
        report = check_env(spec if spec is not None else f"agent:{agent}",
                           prefixes=prefixes, seed=seed, tasks=tasks,
                           samplers=list(SAMPLERS), on_result=None if as_json else show)
    except EnvSpecError as exc:
        raise _error(str(exc), 2) from None
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for line in report.summary_lines():
            typer.echo(line)
    if not report.passed:
        raise typer.Exit(1)
