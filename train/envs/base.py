"""The environment interface and the text protocol shared by every tool world.

Protocol (the one Qwen/Hermes-style chat models emit):

* a tool call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* the environment answers ``<tool_response>...</tool_response>``;
* the final answer is ``<answer>...</answer>``.

An environment implements ``reset(task) -> observation``,
``step(action_text) -> StepResult``, ``snapshot() -> bytes`` and
``restore(bytes)``. Restore-then-step is deterministic: the same snapshot and
the same action give byte-identical observations and reward parts. A malformed
action gets a deterministic error observation, never an exception; a per-task
step limit ends the episode with reward 0.

``reward_parts`` always holds ``"reward"`` (the scalar outcome, set on the
step that ends the episode, 0.0 before) plus any environment-specific parts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, NamedTuple, Protocol, TypeVar

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Task:
    """One task instance: the prompt, the gold answer, and a JSON-able config."""

    task_id: str
    env: str
    prompt: str
    answer: str | None = None
    max_steps: int = 8
    config: dict[str, Any] = field(default_factory=dict)


class StepResult(NamedTuple):
    observation: str
    done: bool
    reward_parts: dict[str, float]


ActionKind = Literal["tool_call", "answer", "malformed"]


@dataclass(frozen=True)
class ParsedAction:
    """An action text split into what the environment acts on."""

    kind: ActionKind
    name: str | None = None
    arguments: dict[str, Any] | None = None
    answer: str | None = None
    error: str | None = None


def _find_block(text: str, open_tag: str, close_tag: str) -> tuple[int, str] | None:
    """The first ``open_tag ... close_tag`` block: (start, inner text), as the regexes find it.

    Linear time. ``TOOL_CALL_RE.search`` retries from every later open tag when no
    close tag follows, which is quadratic: 20k unclosed ``<tool_call>`` took 21 s.
    The leftmost match always starts at the first open tag (if no close tag follows
    it, none follows a later one), so two ``str.find`` calls give the same block.
    """
    start = text.find(open_tag)
    if start < 0:
        return None
    end = text.find(close_tag, start + len(open_tag))
    if end < 0:
        return None
    return start, text[start + len(open_tag):end]


MAX_JSON_DEPTH = 64
_JSON_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET_RE = re.compile(r"[\[\]{}]")


def _json_too_deep(text: str) -> bool:
    """Whether brackets outside JSON strings nest deeper than ``MAX_JSON_DEPTH``.

    Checked before ``json.loads``, which recurses per level and raises RecursionError
    at a depth that depends on the caller's stack: the outcome must not.
    """
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    depth = 0
    for match in _JSON_BRACKET_RE.finditer(_JSON_STRING_RE.sub("", text)):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            return True
    return False


def parse_action(text: str) -> ParsedAction:
    """Parse one step's text: the first ``<tool_call>`` or ``<answer>`` block wins.

    Anything else (no block, bad JSON, a call without a string ``name`` or
    with non-object ``arguments``) is ``malformed`` with an ``error`` message.
    """
    call = _find_block(text, "<tool_call>", "</tool_call>")
    answer = _find_block(text, "<answer>", "</answer>")
    if call and (not answer or call[0] < answer[0]):
        if _json_too_deep(call[1]):
            return ParsedAction("malformed", error="tool call JSON is nested more than "
                                                   f"{MAX_JSON_DEPTH} levels deep")
        try:
            payload = json.loads(call[1])
        except json.JSONDecodeError as exc:
            return ParsedAction("malformed", error=f"tool call is not valid JSON: {exc.msg}")
        except ValueError:  # an integer over sys.get_int_max_str_digits() digits
            return ParsedAction("malformed", error="tool call JSON holds a number too large "
                                                   "to read")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return ParsedAction("malformed", error='tool call needs a string "name"')
        args = payload.get("arguments", {})
        if not isinstance(args, dict):
            return ParsedAction("malformed", error='"arguments" must be a JSON object')
        return ParsedAction("tool_call", name=payload["name"], arguments=args)
    if answer:
        return ParsedAction("answer", answer=answer[1].strip())
    # No literal tags: tool responses escape them (``escape_tool_text``).
    return ParsedAction("malformed", error="expected a tool_call block holding a JSON object, "
                                           "or an answer block")


PROTOCOL_TAGS = ("tool_response", "tool_call", "answer")
_TAG = re.compile(r"<(/?\s*(?:" + "|".join(PROTOCOL_TAGS) + r")\b)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_tool_text(text: str) -> str:
    """Tool output made safe to embed in a ``<tool_response>`` block.

    A tool result must never end its own block or fake an action: the ``<`` of every
    protocol tag (``<tool_response>``, ``</tool_response>``, ``<tool_call>``, ``<answer>``
    and their closing forms, any case) becomes ``&lt;``, and control characters other
    than newline and tab (NUL, ESC, DEL, C1) become ``\\xNN`` escapes, so no terminal
    sequence or NUL reaches a tokenizer or a log."""
    text = _TAG.sub(r"&lt;\1", text)
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def tool_response(content: str) -> str:
    """``content`` as a tool response block, escaped (``escape_tool_text``)."""
    return f"<tool_response>{escape_tool_text(content)}</tool_response>"


def error_response(message: str) -> str:
    return tool_response(f"error: {message}")


class ToolEpisode(Protocol):
    """The counters of a one-tool episode (``CalcEnv`` and ``PythonEnv`` states)."""

    task: Task
    steps: int
    tool_calls: int
    tool_errors: int
    done: bool
    reward: float
    truncated: bool


EpisodeT = TypeVar("EpisodeT", bound=ToolEpisode)


def require_state(state: EpisodeT | None, env: str) -> EpisodeT:
    """``state``, or the error every env gives for a step before ``reset``/``restore``."""
    if state is None:
        raise RuntimeError(f"{env}: call reset() or restore() first")
    return state


def task_identity(task: Task) -> tuple[str, str]:
    """What makes two tasks the same task whatever their ids: the prompt and the config
    (canonical JSON). A prompt alone is not enough: every gymnasium lake of one size
    shares one prompt, its map is in the config."""
    return task.prompt, json.dumps(task.config, sort_keys=True, default=str)


def episode_parts(s: ToolEpisode) -> dict[str, float]:
    """``reward_parts`` of a one-tool episode: the reward (0 until the end), the tool calls
    and errors so far, and whether the step limit truncated it."""
    return {"reward": s.reward if s.done else 0.0, "tool_calls": float(s.tool_calls),
            "tool_errors": float(s.tool_errors), "truncated": float(s.truncated)}


def run_step(s: EpisodeT, action_text: str,
             act: Callable[[EpisodeT, str], tuple[str, bool]]) -> StepResult:
    """The step skeleton shared by the one-tool envs: refuse a step after the end, count
    it, ``act`` (observation, is_error), count errors, truncate at ``task.max_steps``
    (reward 0)."""
    if s.done:
        return StepResult(error_response("episode is over"), True, episode_parts(s))
    s.steps += 1
    observation, is_error = act(s, action_text)
    s.tool_errors += is_error
    if not s.done and s.steps >= s.task.max_steps:
        s.done, s.truncated, s.reward = True, True, 0.0
    return StepResult(observation, s.done, episode_parts(s))


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,), "null": (type(None),),
}


def check_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """Check ``arguments`` against a JSON-schema object (types, required, enum, extras).

    Covers the subset tool schemas use: ``properties`` with ``type`` (and
    ``enum``, ``items.type``), ``required`` and ``additionalProperties: false``.
    Returns an error message, or None when the arguments conform.
    """
    props: dict[str, Any] = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in arguments:
            return f"missing required argument {key!r}"
    for key, value in arguments.items():
        if key not in props:
            if schema.get("additionalProperties", True) is False:
                return f"unknown argument {key!r}"
            continue
        spec = props[key]
        expected = spec.get("type")
        if expected is not None:
            types = _JSON_TYPES[expected]
            ok = isinstance(value, types) and not (
                expected in ("integer", "number") and isinstance(value, bool))
            if not ok:
                return f"argument {key!r} must be of type {expected}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}"
        item_type = spec.get("items", {}).get("type")
        if item_type and isinstance(value, list) and not all(
                isinstance(v, _JSON_TYPES[item_type]) for v in value):
            return f"argument {key!r} must be a list of {item_type}"
    return None


MAX_MESSAGE_CHARS = 200  # error observations quote user text clipped to this


def clip_quoted(text: str) -> str:
    """User text inside an observation: repr-escaped (no control or lone surrogate
    characters reach the tokenizer) and clipped to ``MAX_MESSAGE_CHARS``."""
    quoted = repr(text)
    if len(quoted) > MAX_MESSAGE_CHARS:
        return quoted[:MAX_MESSAGE_CHARS] + "...(clipped)"
    return quoted


def tool_call_error(s: ToolEpisode, action: ParsedAction, tool: dict[str, Any]) -> str | None:
    """The error observation for a non-answer ``action`` of a one-tool env, or None when it
    is a valid call of ``tool`` (a JSON tool schema: ``name``, ``parameters``).

    A malformed action is refused first; every other action counts in ``s.tool_calls``,
    then an unknown tool name or arguments that break the schema are refused."""
    if action.kind == "malformed":
        return error_response(action.error or "malformed action")
    s.tool_calls += 1
    if action.name != tool["name"]:
        return error_response(f"unknown tool {clip_quoted(action.name or '')}; "
                              f"the only tool is {tool['name']!r}")
    problem = check_arguments(action.arguments or {}, tool["parameters"])
    if problem is not None:
        return error_response(problem[:MAX_MESSAGE_CHARS])
    return None


def dump_snapshot(fmt: str, s: Any) -> bytes:
    """Canonical JSON (sorted keys, no spaces, ASCII) of a dataclass episode state ``s``
    holding a ``task``, tagged with the snapshot format ``fmt``."""
    state = {"format": fmt, "task": dataclasses.asdict(s.task),
             **{f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "task"}}
    return json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def load_snapshot(state: bytes, fmt: str) -> dict[str, Any]:
    """The fields of a ``dump_snapshot`` of format ``fmt``, without the format tag.

    Raises ``ValueError`` (``json.JSONDecodeError``, ``UnicodeDecodeError``) when
    ``state`` is not JSON or not an object of that format."""
    data = json.loads(state)
    if not isinstance(data, dict) or data.pop("format", None) != fmt:
        raise ValueError(f"expected format {fmt!r}")
    return data


class SnapshotDivergence(RuntimeError):
    """Restoring a snapshot did not reach the recorded state: a replayed step or model call
    came out other than when it was recorded (the environment is not deterministic given
    the task and what it was answered). ``where`` names the first difference, JSON-able
    (``{"step": 3}`` for a replayed step; ``{"call": 2, "field": "messages[2].content"}``
    for an agent program's model call).

    Consumers catch this class, never an environment's own: the tree builder drops the
    rollout that would have started from the restored state and marks the node
    (``train.sampling.base.TreeBuilder``)."""

    def __init__(self, message: str, **where: Any) -> None:
        super().__init__(message)
        self.where: dict[str, Any] = dict(where)


SnapshotStrategy = Literal["native", "replay", "fork"]
"""How an environment's states are saved and restored (``train.envs.strategies``)."""


class Environment(ABC):
    """A tool world that can be branched from any of its states.

    Required: ``reset``, ``step`` and ``generate_tasks``. How a state is saved is the
    class's ``snapshot_strategy``, recorded in every snapshot it produces:

    * ``native``: the env implements ``snapshot() -> bytes`` (its whole state) and
      ``restore(bytes)`` itself;
    * ``replay``: ``reset`` and ``step`` (and ``reseed``, if it has one) are deterministic
      given the task; ``make_env`` wraps it so that a snapshot is the task and the actions
      (and reseed keys) so far, and ``restore`` is a reset plus a replay of them (O(depth)
      steps; a replay that diverges is an error naming the step);
    * ``fork``: the env lives in a worker process, built and stepped on that process's main
      thread; a snapshot is a frozen forked copy of the process, with the replay record
      as its fallback.

    Optional: ``expert_action`` (a scripted expert: ``rtrees policy init``, ``env check``),
    ``reseed(key)`` (a fresh random stream after ``restore``, so siblings branched from one
    state do not share tool outcomes), ``tool_schemas()`` (the tools in the OpenAI function
    format: every policy's chat template gets them), ``step_meta()`` (JSON-able facts
    about the step just taken, merged into its tree node's ``meta`` by the tree builder:
    an agent program's model call, ``{"call": {...}}``), ``close()``.

    Threads: the engine builds, steps, snapshots and closes each instance on its
    tool-pool threads, one call at a time per instance but not always on the same thread.
    A library that must run on a main thread (signal handlers) or on one thread only
    declares ``snapshot_strategy = "fork"``.
    """

    name: ClassVar[str]
    snapshot_strategy: ClassVar[SnapshotStrategy] = "native"
    exact_values: ClassVar[bool] = False
    """Whether every task is a tabular model whose optimal and policy values are exact
    (``train.envs.workflow_model``): studies then measure exact quantities (recovery
    probabilities, the values of tree nodes) where they otherwise sample. Default False:
    values are estimated by sampling, right for any environment without such a model."""
    tabular_policy: ClassVar[bool] = False
    """Whether the ``tabular`` policy backend (exact softmax policies over the workflow
    action strings, ``train.policies.tabular``) can act here; default False."""
    task_group_key: ClassVar[str | None] = None
    """The ``Task.config`` key whose value groups tasks in success reports (``rtrees policy
    init``'s per-group held-out success: calc's ``difficulty``); None (the default): one
    group of all tasks."""
    tiny_sft: ClassVar[dict[str, Any]] = {}
    """``rtrees policy init``'s recipe for this env: ``SFTConfig`` fields
    (``train.policies.tiny_train``) over their defaults, e.g. ``minutes``, ``p_error``,
    ``noise`` (how the scripted expert is perturbed; default ``"none"``: its own actions
    only, which needs nothing but ``expert_action``). Default {}: the generic recipe."""

    @classmethod
    def tiny_phrases(cls) -> tuple[str, ...]:
        """Fixed text of this env (prompt blocks, tool-call prefixes, JSON keys) that the
        tiny policy's tokenizer makes single tokens, after its shared vocabulary
        (``train.policies.tiny.build_tokenizer``). Default (): the shared vocabulary, so a
        checkpoint of another env with it loads here too."""
        return ()

    spec: str | None = None
    """The spec ``make_env`` built this instance from (what the store records)."""
    tool_lag: ClassVar[int] = 0
    """For slow tools (a remote call, a sandbox start): decode steps of the other trees a
    step of this env may overlap (``train.sampling.engine.Work.lag``; a work item of k
    steps, k times as many). Its answer is collected that many decode steps after the
    step started, whatever the thread timing, so trees stay reproducible; 0 collects it
    after the next decode step. About the tool's latency over one decode step's time."""

    @abstractmethod
    def reset(self, task: Task) -> str:
        """Start an episode of ``task``; returns the first observation (the prompt)."""

    @abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply one action; never raises for a malformed or hostile action."""

    def snapshot(self) -> bytes:
        """The whole episode state, compact, enough to ``restore`` without replay by the
        caller (``native`` environments; the others are wrapped by ``make_env``)."""
        raise NotImplementedError(f"{type(self).__name__} has no snapshot(): implement it, "
                                  "or set snapshot_strategy = 'replay' or 'fork'")

    def restore(self, state: bytes) -> None:
        """Return to a state from ``snapshot`` (possibly taken by another instance)."""
        raise NotImplementedError(f"{type(self).__name__} has no restore(): implement it, "
                                  "or set snapshot_strategy = 'replay' or 'fork'")

    def expert_action(self) -> str:
        """The scripted expert's next action text in the current state (optional)."""
        raise NotImplementedError(f"{type(self).__name__} has no scripted expert")

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]] | None:
        """The tools, as ``[{"type": "function", "function": {"name", "description",
        "parameters"}}]`` (the OpenAI function format chat templates take); None where
        the env has none or they differ per task."""
        return None

    @classmethod
    @abstractmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        """``n`` tasks from a seeded generator (the same seed gives the same tasks)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most worlds hold no resources
        """Release resources (subprocesses); the default holds none."""


class OneToolEnv(Environment, Generic[EpisodeT]):
    """The skeleton of an environment with one tool (``CalcEnv``, ``PythonEnv``).

    A step (``run_step``) parses the action: an answer ends the episode with the reward
    ``_grade`` gives; a malformed action, an unknown tool or bad arguments get an error
    observation (``tool_call_error``); a valid call runs ``_run_tool``. The episode state
    ``_state`` is a dataclass; ``snapshot`` is its ``dump_snapshot`` in ``snapshot_format``.
    """

    tool: ClassVar[dict[str, Any]]
    """The JSON tool schema (``name``, ``parameters``)."""
    snapshot_format: ClassVar[str]
    _state: EpisodeT | None

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]] | None:
        """The one tool, in the OpenAI function format."""
        return [{"type": "function", "function": cls.tool}]

    def _require(self) -> EpisodeT:
        return require_state(self._state, type(self).__name__)

    def step(self, action_text: str) -> StepResult:
        return run_step(self._require(), action_text, self._act)

    def _act(self, s: EpisodeT, action_text: str) -> tuple[str, bool]:
        """The observation of one action and whether it is an error; ends the episode on
        an answer."""
        action = parse_action(action_text)
        if action.kind == "answer":
            s.done = True
            s.reward = self._grade(s, action.answer or "")
            return "", False
        refused = tool_call_error(s, action, self.tool)
        if refused is not None:
            return refused, True
        return self._run_tool(s, action.arguments or {})

    @abstractmethod
    def _grade(self, s: EpisodeT, answer: str) -> float:
        """The reward of the final ``answer``."""

    @abstractmethod
    def _run_tool(self, s: EpisodeT, arguments: dict[str, Any]) -> tuple[str, bool]:
        """The observation of a valid tool call (its ``arguments`` fit the schema) and
        whether it is an error."""

    def snapshot(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces, ASCII) of the whole episode state."""
        return dump_snapshot(self.snapshot_format, self._require())
