"""TextWorld's generated text games as a tool world: a world whose state cannot be
serialised, branched by ``fork`` (with replay as its fallback).

Tested with textworld 1.7.0 (its games run on jericho 3.3's Z-machine, a C library).

Why ``fork``: an episode's state is the Z-machine's memory inside jericho's C library plus
TextWorld's Python game-state tracker (the quest's progress, the admissible commands);
TextWorld's env has an in-memory ``copy()`` but no bytes snapshot, so ``native`` cannot be
written. ``make_env`` builds the env in a worker process, and a snapshot is a frozen forked
copy of it (``train.envs.fork``); a snapshot that must outlive the process (references in
a later run, the reuse refresh) is replayed, which is exact because a generated game's
reset and step are deterministic (``rtrees env check`` verifies both strategies).

Mapping
  * **Task**: ``config = {"game_seed": int, "rooms": int, "objects": int, "quest_length":
    int, "game_sha256": str}``. The game is made by TextWorld's own generator
    (``textworld.generator.make_game`` with those ``GameOptions``, the same game as
    ``tw-make custom --world-size ROOMS --nb-objects OBJECTS --quest-length Q --seed
    SEED``), compiled to a Z-machine file by ``compile_game`` into the game cache
    (``game_dir``) on first use, and checked against ``game_sha256`` (sha256 of the game's
    canonical JSON): a TextWorld that generates another game from the same seed is a
    ``ValueError`` naming the task, never a silently different world.
  * **Observation**: the first one is the task's prompt (the game's objective, how to call
    the tool), a blank line, the room as TextWorld describes it (``look``) and a line
    ``Commands you can try: ...`` (TextWorld's admissible commands, sorted). Each valid
    call answers ``<tool_response>`` holding the game's feedback (its ``>`` prompt and
    status lines removed, blank runs collapsed) and, unless the game is over, the
    commands line.
  * **Action**: one tool ``act`` with one string argument ``command``, a text command such
    as ``take teacup from chair`` (free text, as the game's parser takes it; the
    admissible commands are a hint, not a menu). A command is at most
    ``MAX_COMMAND_CHARS`` printable ASCII characters and may not start with one of the
    interpreter's meta verbs (``META_VERBS``: save, restore, restart, quit, ...), which
    would write files or restart the story. A malformed action, another tool, bad
    arguments or a refused command get ``<tool_response>error: ...</tool_response>`` and
    use up the step (never an exception).
  * **Reward**: 1.0 when the game is won, 0.0 when it is lost, set on the step that ends
    it; ``Task.max_steps`` steps without an end give 0.0 (truncated); ``<answer>...
    </answer>`` gives up with 0.0 (the game has no answer to grade). ``reward_parts`` also
    holds ``score`` and ``max_score`` (the game's points), ``tool_calls``,
    ``tool_errors`` and ``truncated``.

The scripted expert (``expert_action``) plays the first of TextWorld's
``policy_commands``: the shortest command sequence to the quest's end from the current
state, recomputed after every step (so it recovers after a detour).

Games are cached by digest under ``$RTREES_TEXTWORLD_GAMES``, else
``$RTREES_CACHE_DIR/textworld``, else ``$XDG_CACHE_HOME/rollout-trees/textworld`` (or
``~/.cache/rollout-trees/textworld``); each is compiled in a private temporary directory
and renamed into place, so processes that need one game at once never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

try:
    import textworld
    from textworld import EnvInfos, GameOptions
    from textworld.generator import compile_game, make_game
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the TextWorld adapter needs textworld: pip install "
                      "'rollout-trees[textworld]'") from exc

from train.envs.base import (
    Environment,
    SnapshotStrategy,
    StepResult,
    Task,
    episode_parts,
    error_response,
    parse_action,
    require_state,
    run_step,
    tool_call_error,
    tool_response,
)

TOOL_NAME = "act"
MAX_COMMAND_CHARS = 100
META_VERBS = frozenset({
    "save", "restore", "restart", "quit", "q", "script", "unscript", "transcript",
    "noscript", "undo", "verbose", "brief", "superbrief", "notify", "version", "oops", "o",
})
"""Interpreter commands, not moves in the story: refused (they write files, restart the
story or change how it prints)."""
_COMMAND_RE = re.compile(r"[ -~]+")  # printable ASCII, no control characters
_SEED_RANGE = 2**31
_OPTIONS: dict[str, Any] = {"rooms": 2, "objects": 3, "quest_length": 2, "max_steps": None}
"""``generate_tasks`` options and defaults (``TextWorldEnv.generate_tasks``)."""
_INFOS = EnvInfos(admissible_commands=True, policy_commands=True, won=True, lost=True,
                  score=True, max_score=True, description=True, objective=True)

TOOL: dict[str, Any] = {
    "name": TOOL_NAME,
    "description": "Type one command into the text game (e.g. 'go north', 'open box', "
                   "'take key from table'); the response is the game's answer.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string",
                                   "description": "a command the game's parser takes"}},
        "required": ["command"],
        "additionalProperties": False,
    },
}


def act_text(command: str) -> str:
    """The action text of an ``act`` call."""
    return f"<tool_call>{json.dumps({'name': TOOL_NAME, 'arguments': {'command': command}})}" \
           "</tool_call>"


# ---------------------------------------------------------------------------
# Games: made by TextWorld's generator, compiled once into the cache


def game_dir() -> Path:
    """The game cache (module docstring)."""
    if os.environ.get("RTREES_TEXTWORLD_GAMES"):
        return Path(os.environ["RTREES_TEXTWORLD_GAMES"])
    if os.environ.get("RTREES_CACHE_DIR"):
        return Path(os.environ["RTREES_CACHE_DIR"]) / "textworld"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-trees" / "textworld"


def _options(game_seed: int, rooms: int, objects: int, quest_length: int) -> GameOptions:
    options = GameOptions()
    options.seeds = game_seed
    options.nb_rooms = rooms
    options.nb_objects = objects
    options.quest_length = quest_length
    return options


@lru_cache(maxsize=64)
def _make(game_seed: int, rooms: int, objects: int, quest_length: int
          ) -> tuple[Any, str]:
    """The generated game and sha256 of its canonical JSON."""
    game = make_game(_options(game_seed, rooms, objects, quest_length))
    body = json.dumps(game.serialize(), sort_keys=True, separators=(",", ":"))
    return game, hashlib.sha256(body.encode()).hexdigest()


def _game_config(task: Task) -> tuple[int, int, int, int, str]:
    """``(game_seed, rooms, objects, quest_length, game_sha256)``; ``ValueError`` naming
    what is wrong."""
    c = task.config
    ints = [c.get(k) for k in ("game_seed", "rooms", "objects", "quest_length")]
    digest = c.get("game_sha256")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints) or \
            not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"task {task.task_id!r} needs config 'game_seed', 'rooms', "
                         "'objects', 'quest_length' (integers >= 0) and 'game_sha256' "
                         "(64 hex digits)")
    seed, rooms, objects, quest_length = (int(v) for v in ints)  # type: ignore[arg-type]
    if not (1 <= rooms <= 20 and 0 <= objects <= 50 and 1 <= quest_length <= 20):
        raise ValueError(f"task {task.task_id!r}: rooms 1..20, objects 0..50, "
                         "quest_length 1..20")
    return seed, rooms, objects, quest_length, digest


def game_file(task: Task) -> Path:
    """The task's compiled game (``.z8``, its ``.json`` beside it), made and compiled into
    ``game_dir()`` if it is not there yet; ``ValueError`` when this TextWorld generates
    another game than the task records."""
    seed, rooms, objects, quest_length, digest = _game_config(task)
    root = game_dir()
    final = root / digest[:32]
    path = final / "game.z8"
    if path.is_file() and (final / "game.json").is_file():
        return path
    game, got = _make(seed, rooms, objects, quest_length)
    if got != digest:
        raise ValueError(f"task {task.task_id!r}: textworld {textworld.__version__} "
                         f"generates another game from seed {seed} (sha256 {got[:12]}, "
                         f"the task records {digest[:12]})")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".compile-", dir=root))
    try:
        options = _options(seed, rooms, objects, quest_length)
        options.path = str(tmp / "game.z8")
        options.force_recompile = True
        compile_game(game, options)
        try:
            os.rename(tmp, final)  # atomic; another process may have won the race
        except OSError:
            if not path.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---------------------------------------------------------------------------
# Text


def clean_feedback(text: str) -> str:
    """The game's text without its ``>`` prompt/status lines, blank runs collapsed."""
    lines = [line.rstrip() for line in text.splitlines()
             if not line.lstrip().startswith(">")]
    out = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return out


def _commands_line(state: Any) -> str:
    return "Commands you can try: " + ", ".join(sorted(state.admissible_commands or []))


def command_error(command: str) -> str | None:
    """Why ``command`` is refused (module docstring), or None."""
    if not command.strip():
        return "empty command"
    if len(command) > MAX_COMMAND_CHARS or not _COMMAND_RE.fullmatch(command):
        return f"a command is at most {MAX_COMMAND_CHARS} printable ASCII characters"
    verb = command.split()[0].lower().rstrip(".!,")
    if verb in META_VERBS:
        return f"{verb!r} is an interpreter command, not a move in the game"
    return None


# ---------------------------------------------------------------------------
# The environment


@dataclass
class _State:
    task: Task
    steps: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    reward: float = 0.0
    truncated: bool = False
    score: int = 0
    max_score: int = 0


class TextWorldEnv(Environment):
    """TextWorld games played with one ``act`` tool, branched by fork (module docstring)."""

    name: ClassVar[str] = "textworld"
    snapshot_strategy: ClassVar[SnapshotStrategy] = "fork"
    tool: ClassVar[dict[str, Any]] = TOOL

    def __init__(self) -> None:
        self._state: _State | None = None
        self._game: Any = None  # the live textworld env
        self._game_path: Path | None = None
        self._last: Any = None  # textworld's GameState after the last step

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]] | None:
        return [{"type": "function", "function": TOOL}]

    def _require(self) -> _State:
        return require_state(self._state, type(self).__name__)

    def reset(self, task: Task) -> str:
        path = game_file(task)
        if path != self._game_path:
            self.close()
            with warnings.catch_warnings():  # jericho: "not fully supported" (it cannot
                # read a TextWorld game's score; TextWorld's own tracker does, which we use)
                warnings.simplefilter("ignore")
                self._game = textworld.start(str(path), request_infos=_INFOS)
            self._game_path = path
        self._last = self._game.reset()
        self._state = _State(task=task, max_score=int(self._last.max_score or 0))
        room = clean_feedback(self._last.description or "")
        return f"{task.prompt}\n\n{room}\n{_commands_line(self._last)}"

    def step(self, action_text: str) -> StepResult:
        s = self._require()
        result = run_step(s, action_text, self._act)
        return StepResult(result.observation, result.done,
                          {**episode_parts(s), "score": float(s.score),
                           "max_score": float(s.max_score)})

    def _act(self, s: _State, action_text: str) -> tuple[str, bool]:
        action = parse_action(action_text)
        if action.kind == "answer":  # giving up: the game has no answer to grade
            s.done, s.reward = True, 0.0
            return "", False
        refused = tool_call_error(s, action, TOOL)
        if refused is not None:
            return refused, True
        command = str((action.arguments or {})["command"])
        problem = command_error(command)
        if problem is not None:
            return error_response(problem), True
        state, _, done = self._game.step(command.strip())
        self._last = state
        s.score = int(state.score or 0)
        text = clean_feedback(state.feedback or "")
        if done or state.won or state.lost:
            text = text.split("*** The End ***")[0].strip()  # drop the replay menu
            s.done, s.reward = True, 1.0 if state.won else 0.0
            ending = "You won" if state.won else "You lost"
            return tool_response(f"{text}\n{ending}; reward {s.reward:g}."), False
        return tool_response(f"{text}\n{_commands_line(state)}"), False

    def expert_action(self) -> str:
        """The first of TextWorld's ``policy_commands`` (module docstring)."""
        s = self._require()
        if s.done:
            raise RuntimeError("TextWorldEnv.expert_action: the episode is over")
        commands = list(self._last.policy_commands or [])
        if not commands:
            raise RuntimeError("TextWorldEnv.expert_action: the game gives no way to win "
                               "from here")
        return act_text(commands[0])

    def close(self) -> None:
        if self._game is not None:
            self._game.close()
        self._game, self._game_path, self._last = None, None, None

    # -- tasks -------------------------------------------------------------

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        """``n`` games drawn from ``random.Random(seed)``, one game seed each (so
        ``generate_tasks(k, s)`` is a prefix of ``generate_tasks(n, s)``).

        Options: ``rooms`` (2), ``objects`` (3), ``quest_length`` (2): TextWorld's
        ``--world-size``, ``--nb-objects`` and ``--quest-length``; ``max_steps`` (default
        ``4 * quest_length + 4``). Each game is generated here (about 0.2-3 s; its
        compilation waits for the first ``reset``)."""
        unknown = sorted(set(mix) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"unknown {cls.name} task option(s) {unknown}; choose from "
                             f"{sorted(_OPTIONS)}")
        options = {**_OPTIONS, **mix}
        rooms, objects, quest = options["rooms"], options["objects"], options["quest_length"]
        max_steps = options["max_steps"]
        for key in ("rooms", "objects", "quest_length"):
            v = options[key]
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{key} must be an integer, got {v!r}")
        if max_steps is None:
            max_steps = 4 * quest + 4
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not (
                1 <= max_steps <= 1000):
            raise ValueError(f"max_steps must be an integer in 1..1000, got {max_steps!r}")
        rng = random.Random(seed)
        tasks: list[Task] = []
        for i in range(n):
            game_seed = rng.randrange(_SEED_RANGE)
            config: dict[str, Any] = {"game_seed": game_seed, "rooms": rooms,
                                      "objects": objects, "quest_length": quest,
                                      "game_sha256": ""}
            probe = Task(task_id=f"tw-{seed}-{i}", env=cls.name, prompt="",
                         config={**config, "game_sha256": "0" * 64})
            _game_config(probe)  # the option ranges, named
            game, digest = _make(game_seed, rooms, objects, quest)
            config["game_sha256"] = digest
            objective = " ".join(str(game.objective).split())
            prompt = (f"{objective}\n\nPlay by calling the act tool with one command at a "
                      f"time, e.g. {act_text('look')}. You have {max_steps} commands.")
            tasks.append(Task(task_id=f"tw-{seed}-{i}-{digest[:8]}", env=cls.name,
                              prompt=prompt, max_steps=max_steps, config=config))
        return tasks


__all__ = ["MAX_COMMAND_CHARS", "META_VERBS", "TOOL", "TextWorldEnv", "act_text",
           "clean_feedback", "command_error", "game_dir", "game_file"]
