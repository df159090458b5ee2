"""``calc``: arithmetic tasks solved through a calculator tool.

Episode format (the text protocol of ``train.envs.base``)::

    reset  -> "Compute (17*23)+5."                        the prompt, nothing else
    action -> <tool_call>{"name": "calc", "arguments": {"expr": "(17*23)+5"}}</tool_call>
    obs    <- <tool_response>396</tool_response>
    action -> <answer>396</answer>
    obs    <- ""                                         done=True, reward 1.0

* One tool, ``calc``, with one string argument ``expr`` (``TOOL_SCHEMA``). Its
  response is the exact value: an integer (``391``), a terminating decimal
  (``3.5``) or else a reduced fraction (``10/3``). Expressions are evaluated by
  ``evaluate``, a whitelist over Python's AST evaluated with exact rationals:
  numbers, ``+ - * / // % **``, parentheses, unary ``-``/``+``. ``/`` is exact
  division, ``//`` and ``%`` floor as in Python. Limits (``MAX_EXPR_CHARS``,
  ``MAX_PAREN_DEPTH``, ``MAX_AST_DEPTH``, ``MAX_AST_NODES``, ``MAX_EXPONENT``,
  ``MAX_ABS``) bound the work of any call; nothing is ever passed to ``eval``.
* Any action that is not a well-formed ``calc`` call or an answer (bad JSON,
  unknown tool, missing or non-string ``expr``, an expression that is refused or
  fails) gets a deterministic ``<tool_response>error: ...</tool_response>``
  and the episode goes on; it never raises.
* ``<answer>X</answer>`` ends the episode, observation ``""``. Reward 1.0 when
  ``X`` is a number (integer, decimal or ``p/q``) exactly equal to the gold
  answer (``396``, ``396.0`` and ``792/2`` all count), else 0.0.
* After ``Task.max_steps`` steps without an answer the episode ends with reward
  0.0; the observation of that last step is still the action's own response.
  Steps after the end return ``error: episode is over`` with done=True and
  change nothing.
* ``reward_parts`` is a summary of the state after the step: ``reward`` (0.0
  until the end), ``tool_calls`` (actions that parsed as a tool call, any tool),
  ``tool_errors`` (steps answered with an error), ``truncated`` (1.0 when the
  step limit ended the episode).
* ``snapshot()`` is canonical JSON (sorted keys, no spaces, ASCII) of the whole
  state: the task, the step and tool-call counts, the last observation, done and
  reward; ``restore()`` loads it with no replay, into any instance.

Tasks come from ``CalcEnv.generate_tasks`` (difficulty = number of binary
operations, 1 to 6, default mix 1-2). With ``one_op=True`` (``--task-param
one_op=true``) the calculator takes one binary operation per call (a longer
expression is answered with an error and costs the step) and the step limit is
the operations plus the answer, with no slack: depth 4-6 by default, so one
wrong or refused call mid-trajectory loses the episode (docs/METHODS.md
section 8.6, C1-C4). The scripted expert is
``CalcEnv.expert_action`` and, for SFT data with mistakes and recoveries,
``CalcEnv.noisy_expert_action``.

Example::

    >>> env = CalcEnv()
    >>> task = CalcEnv.generate_tasks(1, seed=0)[0]
    >>> env.reset(task) == task.prompt
    True
    >>> env.step(env.expert_action()).observation == f"<tool_response>{task.answer}</tool_response>"
    True
    >>> env.step(env.expert_action()).reward_parts["reward"]
    1.0
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import random
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from train.envs.base import OneToolEnv, Task, error_response, load_snapshot, tool_response
from train.envs.preamble import system_preamble

TOOL_NAME = "calc"
TOOL_SCHEMA: dict[str, Any] = {
    "name": TOOL_NAME,
    "description": "Evaluate an arithmetic expression exactly: numbers, + - * / // % **, "
                   "parentheses.",
    "parameters": {
        "type": "object",
        "properties": {"expr": {"type": "string", "description": "e.g. (17*23)+5"}},
        "required": ["expr"],
        "additionalProperties": False,
    },
}

# Evaluator limits. Generated tasks stay far inside them (|values| <= 10_000,
# under 60 characters); they exist so that no action can cost more than a
# bounded amount of work or produce a long observation.
MAX_EXPR_CHARS = 1000
MAX_PAREN_DEPTH = 32
MAX_AST_DEPTH = 64
MAX_AST_NODES = 256
_PARSE_LOCK = threading.Lock()
"""Serialises ``ast.parse``: CPython 3.11 keeps the AST constructor's recursion depth in
per-interpreter state, so two threads parsing at once (the rollout engine runs tool calls
in a thread pool) can corrupt it and one of them gets a spurious ``SystemError``
("AST constructor recursion depth mismatch", CPython gh-106905), which ended a training
run mid-way."""
MAX_EXPONENT = 64
MAX_ABS = 10**18  # bound on |value| and on the denominator of every intermediate result

DIFFICULTIES = range(1, 7)
DEFAULT_DIFFICULTIES = (1, 2)
DEFAULT_MAX_OPERAND = 30
DEFAULT_MAX_STEPS = 4
ONE_OP_DIFFICULTIES = (4, 5, 6)  # the one-operation variant's default depths
MAX_TASK_VALUE = 10_000  # generated tasks keep every intermediate |value| <= this

SNAPSHOT_FORMAT = "calc/1"


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is the observation."""


# ---------------------------------------------------------------------------
# The safe evaluator


_BINOPS: dict[type[ast.operator], str] = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
    ast.Mod: "%", ast.Pow: "**",
}
_REFUSED: dict[type[ast.AST], str] = {
    ast.Name: "names are not allowed",
    ast.Attribute: "attribute access is not allowed",
    ast.Call: "function calls are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.Subscript: "subscripts are not allowed",
}


def _check_value(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS or value.denominator > MAX_ABS:
        raise CalcError("result out of range (|value| and denominators at most 1e18)")
    return value


def _constant(value: object) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float):
        kind = "strings" if isinstance(value, str | bytes) else f"{type(value).__name__} values"
        raise CalcError(f"{kind} are not allowed; only numbers")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("number out of range")
    # repr gives the shortest decimal that round-trips, so 0.1 is exactly 1/10
    return _check_value(Fraction(value) if isinstance(value, int) else Fraction(repr(value)))


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalcError("exponent must be an integer")
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent out of range (|exponent| <= {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    # base and exponent are bounded, so this is at most a few thousand bits of work
    return base ** int(exponent)


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op in ("/", "//", "%") and b == 0:
        raise CalcError("division by zero")
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a / b
    if op == "//":
        return Fraction(a // b)
    if op == "%":
        return a % b
    return _power(a, b)


def _eval_node(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_AST_DEPTH:
        raise CalcError(f"expression nests deeper than {MAX_AST_DEPTH} levels")
    if isinstance(node, ast.Expression):
        return _eval_node(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        return _constant(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval_node(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left = _eval_node(node.left, depth + 1)
        right = _eval_node(node.right, depth + 1)
        return _check_value(_apply(_BINOPS[type(node.op)], left, right))
    for kind, message in _REFUSED.items():
        if isinstance(node, kind):
            raise CalcError(message + "; only numbers and + - * / // % **")
    raise CalcError(f"{type(node).__name__} is not allowed; only numbers and + - * / // % **")


def evaluate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression, or ``CalcError`` with the reason
    (``_checked_tree``, then a depth-limited walk that bounds every intermediate value)."""
    return _eval_node(_checked_tree(expr), 0)


def _checked_tree(expr: str) -> ast.Expression:
    """The parsed expression, or ``CalcError``. The checks run cheapest first, so a
    hostile string is refused before the parser sees it: length, parenthesis depth,
    syntax, node count."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression is longer than {MAX_EXPR_CHARS} characters")
    if not expr.strip():
        raise CalcError("empty expression")
    depth = 0
    for char in expr:
        if char in "([{":
            depth += 1
            if depth > MAX_PAREN_DEPTH:
                raise CalcError(f"parentheses nest deeper than {MAX_PAREN_DEPTH} levels")
        elif char in ")]}":
            depth -= 1
    try:
        tree = _parse(expr.strip())
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        # SyntaxError messages vary across Python versions; the observation must not
        raise CalcError("invalid syntax") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_AST_NODES:
        raise CalcError(f"expression has more than {MAX_AST_NODES} parts")
    return tree


def _operations(tree: ast.AST) -> int:
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))


def _parse(expr: str) -> ast.Expression:
    """``ast.parse(expr, mode="eval")`` under ``_PARSE_LOCK``; a ``SystemError`` (the
    interpreter's AST state disturbed by a parse outside the lock) is retried once."""
    with _PARSE_LOCK:
        try:
            return ast.parse(expr, mode="eval")
        except SystemError:
            return ast.parse(expr, mode="eval")


def count_operations(expr: str) -> int:
    """The binary operations in ``expr`` (0 when ``evaluate`` would refuse it)."""
    try:
        return _operations(_checked_tree(expr))
    except CalcError:
        return 0


def one_op_plan(expr: str) -> list[str]:
    """The one-operation calls that compute ``expr``: its binary operations in post-order
    (left operand first), each with its operands' values written out, e.g. ``(3+4)*5``
    -> ``["3+4", "7*5"]``. A negative operand is parenthesised (``5-(-3)``)."""

    def text(value: Fraction) -> str:
        number = format_number(value)
        return f"({number})" if value < 0 or "/" in number else number

    calls: list[str] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            op = _BINOPS[type(node.op)]
            calls.append(f"{text(left)}{op}{text(right)}")
            return _apply(op, left, right)
        return _eval_node(node, 0)

    walk(_parse(expr))
    return calls


def format_number(value: Fraction) -> str:
    """Exact text of a value: ``391``, ``-3.5`` (terminating decimals) or ``10/3``."""
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    sign = "-" if value < 0 else ""
    return f"{sign}{scaled // 10**places}.{scaled % 10**places:0{places}d}"


_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def parse_number(text: str) -> Fraction | None:
    """An answer's exact value (``396``, ``-3.50``, ``792/2``), or None if it is not a number."""
    text = text.strip()
    if len(text) > 100 or not _NUMBER_RE.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


_RESPONSE_RE = re.compile(r"<tool_response>(.*)</tool_response>", re.DOTALL)


def call_text(expr: str) -> str:
    """The action text of a ``calc`` call, in the canonical spelling the expert uses."""
    payload = {"name": TOOL_NAME, "arguments": {"expr": expr}}
    return f"<tool_call>{json.dumps(payload)}</tool_call>"


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


# ---------------------------------------------------------------------------
# The task generator


@dataclass(frozen=True)
class _Expr:
    text: str
    value: int
    leaf: bool

    def operand(self) -> str:
        return self.text if self.leaf else f"({self.text})"


def _random_expr(rng: random.Random, n_ops: int, max_operand: int) -> _Expr:
    """A random expression tree with ``n_ops`` binary operations whose every
    intermediate value is an integer with |value| <= ``MAX_TASK_VALUE``.

    Division is only drawn where it is exact; a ``*`` or ``/`` that cannot be
    made to fit falls back to ``+``/``-``, so generation never loops.
    """
    if n_ops == 0:
        value = rng.randint(1, max_operand)
        return _Expr(str(value), value, True)
    n_left = rng.randint(0, n_ops - 1)
    op = rng.choice("+-*/")
    right = _random_expr(rng, n_ops - 1 - n_left, max_operand)
    left = _random_expr(rng, n_left, max_operand)
    if op == "/":
        if right.value == 0:
            op = "+"
        elif n_left == 0:
            # a leaf dividend: make it a multiple of the divisor
            quotient = rng.randint(1, max(1, min(max_operand, MAX_TASK_VALUE // abs(right.value))))
            left = _Expr(str(quotient * abs(right.value)), quotient * abs(right.value), True)
        else:
            for _ in range(10):
                if left.value % right.value == 0:
                    break
                left = _random_expr(rng, n_left, max_operand)
            else:
                op = "*"
    if op == "*" and abs(left.value * right.value) > MAX_TASK_VALUE:
        op = "+"
    value = {"+": left.value + right.value, "-": left.value - right.value,
             "*": left.value * right.value,
             "/": left.value // right.value if right.value else 0}[op]
    if abs(value) > MAX_TASK_VALUE:  # only + and - can still overflow here
        op = "-" if op == "+" else "+"
        value = left.value - right.value if op == "-" else left.value + right.value
    return _Expr(f"{left.operand()}{op}{right.operand()}", value, False)


# ---------------------------------------------------------------------------
# The environment


@dataclass
class _State:
    task: Task
    expected: str  # format_number of the gold value: the response of a correct calc call
    steps: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    last_observation: str = ""
    done: bool = False
    reward: float = 0.0
    truncated: bool = False


_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "expected": str, "steps": int, "tool_calls": int, "tool_errors": int,
    "last_observation": str, "done": bool, "reward": float, "truncated": bool}


def _check_state(s: _State) -> None:
    """Types of a decoded snapshot, so that a corrupt one fails here, not in a later step."""
    for name, kind in _STATE_TYPES.items():
        if not isinstance(getattr(s, name), kind):
            raise ValueError(f"not a calc snapshot: {name!r} must be {kind}")
    t = s.task
    if not (isinstance(t.task_id, str) and isinstance(t.prompt, str)
            and isinstance(t.max_steps, int) and isinstance(t.config, dict)
            and isinstance(t.config.get("expr"), str)):
        raise ValueError("not a calc snapshot: malformed task")


class CalcEnv(OneToolEnv[_State]):
    """Arithmetic through a ``calc`` tool; exact-answer reward (see the module docstring)."""

    name: ClassVar[str] = "calc"
    tool: ClassVar[dict[str, Any]] = TOOL_SCHEMA
    snapshot_format: ClassVar[str] = SNAPSHOT_FORMAT
    task_group_key: ClassVar[str | None] = "difficulty"
    tiny_sft: ClassVar[dict[str, Any]] = {"noise": "noisy_expert"}
    """``policy init``: SFTConfig's defaults, the noise from ``noisy_expert_action``."""

    def __init__(self, system_prompt_chars: int = 0) -> None:
        self._state: _State | None = None
        # a long shared system prompt ahead of the task (train.envs.preamble; 0 = none)
        self._preamble = system_preamble(self.name, [self.tool], system_prompt_chars)

    # -- episode -----------------------------------------------------------

    def reset(self, task: Task) -> str:
        expr = task.config.get("expr")
        if not isinstance(expr, str):
            raise ValueError(f"calc task {task.task_id!r} needs config['expr'] (a string)")
        gold = parse_number(task.answer) if task.answer is not None else evaluate(expr)
        if gold is None:
            raise ValueError(f"calc task {task.task_id!r} has a non-numeric answer "
                             f"{task.answer!r}")
        self._state = _State(task=task, expected=format_number(gold))
        return self._preamble + task.prompt

    def _act(self, s: _State, action_text: str) -> tuple[str, bool]:
        observation, is_error = super()._act(s, action_text)
        s.last_observation = observation
        return observation, is_error

    def _grade(self, s: _State, answer: str) -> float:
        value = parse_number(answer)
        return 1.0 if value is not None and value == parse_number(s.expected) else 0.0

    def _run_tool(self, s: _State, arguments: dict[str, Any]) -> tuple[str, bool]:
        try:
            tree = _checked_tree(arguments["expr"])  # parsed once, for both checks
            if s.task.config.get("one_op") and (n := _operations(tree)) > 1:
                return error_response(f"one operation per call (this has {n})"), True
            result = format_number(_eval_node(tree, 0))
        except CalcError as exc:
            return error_response(str(exc)), True
        return tool_response(result), False

    # -- snapshot ----------------------------------------------------------

    def restore(self, state: bytes) -> None:
        """Replace the whole state; ``ValueError`` if ``state`` is not a calc snapshot."""
        try:
            data = load_snapshot(state, SNAPSHOT_FORMAT)
            restored = _State(task=Task(**data.pop("task")), **data)
        except (ValueError, TypeError, KeyError) as exc:  # UnicodeDecodeError is a ValueError
            raise ValueError(f"not a calc snapshot: {type(exc).__name__}: {exc}") from None
        _check_state(restored)
        self._state = restored

    # -- experts -----------------------------------------------------------

    def expert_action(self) -> str:
        """Call ``calc`` on the task's expression until the last response shows the
        right value, then answer it; with one step left, answer at once. One-operation
        tasks: the calls of ``one_op_plan`` in order, then the value the last response
        shows."""
        s = self._require()
        if s.done:
            raise RuntimeError("CalcEnv.expert_action: the episode is over")
        if s.task.config.get("one_op"):
            # the plan's calls in order (the position: the steps that were not errors; a
            # refused call is redone), then the answer the last response shows: what an
            # agent could know, so the gold answer does not repair a lost step
            plan = one_op_plan(s.task.config["expr"])
            done = s.steps - s.tool_errors
            if done >= len(plan) or s.steps + 1 >= s.task.max_steps:
                shown = _RESPONSE_RE.fullmatch(s.last_observation)
                value = parse_number(shown.group(1)) if shown else None
                return answer_text("0" if value is None else format_number(value))
            return call_text(plan[done])
        if (s.last_observation == tool_response(s.expected)
                or s.steps + 1 >= s.task.max_steps):
            return answer_text(s.expected)
        return call_text(s.task.config["expr"])

    def noisy_expert_action(self, rng: random.Random, p_error: float) -> str:
        """The expert's action, replaced with probability ``p_error`` by a mistake.

        Mistakes where the expert would call the tool: a call with one operand off
        by 1-3 (``wrong_operand``), an answer without the tool that is off by 1-10
        (``no_tool``), or a call with broken JSON (``malformed``). Where it would
        answer: a wrong answer (off by 1-10) or a broken call. The expert recovers
        from each (it calls again until it sees the right value), so traces mix
        mistakes with corrections. Deterministic given ``rng``'s state.
        """
        action = self.expert_action()
        if rng.random() >= p_error:
            return action
        s = self._require()
        gold = parse_number(s.expected) or Fraction(0)
        wrong_answer = answer_text(format_number(gold + rng.choice([-1, 1]) * rng.randint(1, 10)))
        broken = call_text(s.task.config["expr"])[:-len("}</tool_call>")] + "</tool_call>"
        if action.startswith("<answer>"):
            return rng.choice([wrong_answer, broken])
        kind = rng.choice(["wrong_operand", "no_tool", "malformed"])
        if kind == "no_tool":
            return wrong_answer
        if kind == "malformed":
            return broken
        expr: str = s.task.config["expr"]
        numbers = list(re.finditer(r"\d+", expr))
        if not numbers:  # a hand-made task without operands to perturb
            return broken
        pick = rng.choice(numbers)
        value = int(pick.group())
        delta = rng.randint(1, 3)
        new = value - delta if value - delta >= 1 else value + delta
        return call_text(expr[:pick.start()] + str(new) + expr[pick.end():])

    # -- tasks -------------------------------------------------------------

    @classmethod
    def generate_tasks(cls, n: int, seed: int, **mix: Any) -> list[Task]:
        """``n`` seeded tasks ``Compute <expr>.`` with integer answers.

        Mix options: ``difficulties`` (default ``(1, 2)``): each task's number of
        binary operations is drawn uniformly from it (repeat a value to weight it),
        each in 1-6; ``max_operand`` (default 30): operands are drawn from
        1..max_operand (a dividend may be a larger multiple of its divisor);
        ``max_steps`` (default 4): the step limit, room for the expert's two steps
        and one recovered mistake. The default mix is 1-2 operations because a
        tiny CPU policy learns one-operation tasks well and two-operation ones
        only slowly (the calculator feasibility study); harder mixes are
        there for evaluation and curricula. ``one_op`` (default False): the
        one-operation variant (module docstring): ``difficulties`` default to
        4-6, the prompt says so, and ``max_steps`` defaults to each task's
        operations + 1 (the answer), no slack.

        Tasks are drawn one after another from ``random.Random(seed)``, so
        ``generate_tasks(k, s)`` is a prefix of ``generate_tasks(n, s)`` for k < n.
        """
        one_op = mix.get("one_op", False)
        if not isinstance(one_op, bool):
            raise ValueError(f"one_op must be true or false, got {one_op!r}")
        options: dict[str, Any] = {
            "difficulties": ONE_OP_DIFFICULTIES if one_op else DEFAULT_DIFFICULTIES,
            "max_operand": DEFAULT_MAX_OPERAND, "max_steps": None if one_op
            else DEFAULT_MAX_STEPS, "one_op": one_op}
        unknown = sorted(set(mix) - set(options))
        if unknown:
            raise ValueError(f"unknown calc task option(s) {unknown}; choose from "
                             f"{sorted(options)}")
        options.update(mix)
        raw = options["difficulties"]  # one integer is a one-value mix
        difficulties = (raw,) if isinstance(raw, int) else tuple(raw)
        if not difficulties or any(isinstance(d, bool) or d not in DIFFICULTIES
                                   for d in difficulties):
            raise ValueError(f"difficulties must be a non-empty list of integers 1-6, "
                             f"got {difficulties!r}")
        max_operand, max_steps = options["max_operand"], options["max_steps"]
        if not isinstance(max_operand, int) or not 1 <= max_operand <= 1000:
            raise ValueError(f"max_operand must be an integer in 1..1000, got {max_operand!r}")
        if not (max_steps is None and one_op) and (
                not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            difficulty = rng.choice(difficulties)
            expr = _random_expr(rng, difficulty, max_operand)
            prompt = (f"Compute {expr.text}, one operation per calc call." if one_op
                      else f"Compute {expr.text}.")
            digest = hashlib.sha256(prompt.encode()).hexdigest()[:8]
            config: dict[str, Any] = {"expr": expr.text, "difficulty": difficulty}
            if one_op:
                config["one_op"] = True
            tasks.append(Task(task_id=f"calc-{seed}-{i}-{digest}", env=cls.name, prompt=prompt,
                              answer=str(expr.value),
                              max_steps=difficulty + 1 if max_steps is None else max_steps,
                              config=config))
        return tasks
