"""HierR, SLCA-GRPO's hierarchical reward (METHODS.md S2-S4), as pure functions.

The inputs are what a policy wrote over an episode (its ``<tool_call>`` blocks,
grouped by turn), the gold calls (grouped by step), the tool responses it got
and its final reply; the output is a :class:`HierR` holding the five process
terms, ``R_tool`` (S2), ``R_sum`` (S3, from a pluggable :class:`Judge`) and
the scalar ``reward = (R_tool + R_sum) / 2``.

Follows the reference implementation (SLCA-GRPO ``rl/slca_grpo/reward_fn.py``,
commit 68539c5) term by term, with these deliberate differences:

* a *block* for ``par`` is one policy turn (every valid ``<tool_call>`` of one
  action), not one ``<tool_call>`` tag: our protocol puts parallel calls in
  separate tags of the same turn, where the reference would always count one;
* an empty JSON list ``[]`` inside ``<tool_call>`` is an invalid block (the
  reference counts it as a valid block with no calls);
* :func:`loose_equal` compares lists and dicts by canonical JSON only (the
  reference first compares Python ``str()`` forms, which depend on key order);
* the scalar reward is normalised, ``(R_tool + R_sum) / 2`` (the reference's
  ``weighted_score_norm``; its RL ``score`` is the unnormalised sum). The S4
  omission guard therefore gives ``reward = (0 + (-0.5)) / 2 = -0.25``, where
  the reference's normalised score clamps to 0 and its raw score is -0.5.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# (S2) R_tool weights; SLCA-GRPO reward_fn.py defaults SLCA_WEIGHT_FORMAT/NAME/KEY/VALUE/PARALLEL.
W_FMT, W_NAME, W_KEY, W_VALUE, W_PAR = 0.10, 0.25, 0.15, 0.20, 0.30
# (S4) score when gold calls exist but the policy emitted no <tool_call> (NO_CALL_PENALTY).
NO_CALL_PENALTY = -0.5
# (S3) replies shorter than this (after strip) score R_sum = 0 (reward_fn.py).
MIN_REPLY_CHARS = 10
# Deeper JSON than this in one tool call is refused: tool arguments here are flat, and a
# bound keeps json.dumps/str() of stored calls far from the recursion limit.
MAX_JSON_DEPTH = 16

# Tag tokens. Blocks are found by walking these tokens (linear time) rather than with
# a lazy ``<tag>(.*?)</tag>`` regex, which is quadratic on text that repeats an
# unclosed tag (a 64 KiB action took seconds); the blocks found are the same.
TOOL_CALL_TAGS = re.compile(r"<(/?)tool_call>")
ANSWER_TAGS = re.compile(r"<(/?)answer>")
# The reference strips both <think> and <thinking> blocks before looking for calls.
THINK_TAGS = re.compile(r"<(/?)think(?:ing)?>")


@dataclass(frozen=True)
class Span:
    """One ``<tag>content</tag>`` block: ``text[start:end]``, content ``text[inner]``."""

    start: int
    end: int
    inner: slice


def tag_spans(text: str, tags: re.Pattern[str]) -> list[Span]:
    """Every block ``re.findall(r"<tag>(.*?)</tag>", text, re.DOTALL)`` would find, in order.

    ``tags`` matches an opening or closing tag, group 1 being ``/`` for a closing one.
    """
    spans: list[Span] = []
    opened: re.Match[str] | None = None
    for m in tags.finditer(text):
        if opened is None:
            if not m.group(1):
                opened = m
        elif m.group(1):
            spans.append(Span(opened.start(), m.end(), slice(opened.end(), m.start())))
            opened = None
    return spans


def strip_think(text: str) -> str:
    """``text`` without its ``<think>``/``<thinking>`` blocks."""
    pieces, at = [], 0
    for span in tag_spans(text, THINK_TAGS):
        pieces.append(text[at:span.start])
        at = span.end
    pieces.append(text[at:])
    return "".join(pieces)


def first_block(text: str) -> tuple[str, str] | None:
    """The first complete ``<tool_call>`` or ``<answer>`` block as ``(kind, content)``
    (the rule of ``base.parse_action``), or None when there is neither."""
    calls = tag_spans(text, TOOL_CALL_TAGS)
    answers = tag_spans(text, ANSWER_TAGS)
    if calls and (not answers or calls[0].start < answers[0].start):
        return "tool_call", text[calls[0].inner]
    if answers:
        return "answer", text[answers[0].inner]
    return None


@dataclass(frozen=True)
class Call:
    """One tool call: a name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}

    def canonical(self) -> str:
        """Canonical JSON text, equal for equal calls whatever the key order."""
        return canonical_json(self.to_json())

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Call:
        return cls(obj["name"], obj.get("arguments") or {})


def canonical_json(value: Any) -> str:
    """Compact, key-sorted, ASCII JSON (the form snapshots and comparisons use)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Block:
    """One ``<tool_call>...</tool_call>`` block: its calls when valid, else an error."""

    calls: tuple[Call, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class ActionScan:
    """The ``<tool_call>`` blocks of one action text, ``<think>`` blocks stripped first."""

    n_open: int
    n_close: int
    blocks: tuple[Block, ...]

    @property
    def n_valid(self) -> int:
        return sum(1 for b in self.blocks if b.error is None)

    @property
    def calls(self) -> list[Call]:
        """The valid calls in order (one turn's predicted calls)."""
        return [c for b in self.blocks for c in b.calls]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value


def json_depth(value: Any) -> int:
    """Nesting depth of containers (a scalar is 0, ``{}`` is 1); iterative, never recurses."""
    best = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            depth += 1
            best = max(best, depth)
            if depth > MAX_JSON_DEPTH:
                return depth
            stack.extend((v, depth) for v in (item.values() if isinstance(item, dict) else item))
    return best


def load_json(text: str) -> Any:
    """Strict JSON: no NaN/Infinity, finite floats, bounded depth; raises ValueError."""
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError("nested too deeply")
    return value


def parse_block(content: str, allowed_tools: Collection[str]) -> Block:
    """Parse one block's content: a call object, or a non-empty list of call objects.

    A block is valid (counts for ``fmt``) when every object has a string ``name``
    among ``allowed_tools`` and object-valued ``arguments`` (missing or null: ``{}``).
    Schema conformance is not part of validity (as in the reference).
    """
    content = content.strip()
    if not content:
        return Block(error="tool call is empty")
    try:
        payload = load_json(content)
    except ValueError as exc:
        return Block(error=f"tool call is not valid JSON ({str(exc)[:80]})")
    objs = [payload] if isinstance(payload, dict) else payload
    if not isinstance(objs, list) or not objs:
        return Block(error="tool call must be a JSON object or a non-empty list of objects")
    calls: list[Call] = []
    for obj in objs:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return Block(error='each tool call needs a string "name"')
        if obj["name"] not in allowed_tools:
            return Block(error=f"unknown tool {safe_text(obj['name'])}")
        args = obj.get("arguments")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return Block(error='"arguments" must be a JSON object')
        calls.append(Call(obj["name"], args))
    return Block(calls=tuple(calls))


def scan_action(text: str, allowed_tools: Collection[str]) -> ActionScan:
    """Find and parse every ``<tool_call>`` block of ``text`` (think blocks stripped)."""
    text = strip_think(text)
    blocks = tuple(parse_block(text[span.inner], allowed_tools)
                   for span in tag_spans(text, TOOL_CALL_TAGS))
    return ActionScan(text.count("<tool_call>"), text.count("</tool_call>"), blocks)


def ascii_clip(text: str, limit: int = 200) -> str:
    """``text`` truncated and made ASCII (non-ASCII characters backslash-escaped)."""
    clipped = text[:limit].encode("ascii", "backslashreplace").decode("ascii")
    return clipped + ("..." if len(text) > limit else "")


def safe_text(text: str, limit: int = 64) -> str:
    """A user-supplied string made safe to echo: ASCII repr, truncated."""
    shown = ascii(text[:limit])
    return shown + ("..." if len(text) > limit else "")


# --------------------------------------------------------------------------- S2 terms


def format_score(n_valid: int, n_open: int, n_close: int) -> float:
    """(S2) fmt = valid blocks / max(#open, #close) tags; 0 when there are no tags."""
    denom = max(n_open, n_close)
    return n_valid / denom if denom > 0 else 0.0


def name_f1(pred_names: Sequence[str], gold_names: Sequence[str]) -> float:
    """(S2) name = multiset F1 of predicted vs gold tool names (1 when both are empty)."""
    if not pred_names and not gold_names:
        return 1.0
    if not pred_names or not gold_names:
        return 0.0
    overlap = sum((Counter(pred_names) & Counter(gold_names)).values())
    return 2.0 * overlap / (len(pred_names) + len(gold_names))


_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}


def loose_equal(pred: Any, gold: Any) -> bool:
    """Loose value equality (reference ``_loose_value_equal``).

    None only equals None; lists/dicts compare as canonical JSON; otherwise equal
    when the trimmed lower-cased strings match, the numbers match within 1e-9, or
    both read as the same boolean (``true``/``false``/``1``/``0``).
    """
    if pred is None or gold is None:
        return pred is None and gold is None
    containers = isinstance(pred, list | dict), isinstance(gold, list | dict)
    if any(containers):
        return all(containers) and canonical_json(pred) == canonical_json(gold)
    pred_s, gold_s = str(pred).strip().lower(), str(gold).strip().lower()
    if pred_s == gold_s:
        return True
    try:
        if abs(float(pred) - float(gold)) < 1e-9:
            return True
    except (ValueError, TypeError, OverflowError):
        pass
    pb, gb = _BOOL_WORDS.get(pred_s), _BOOL_WORDS.get(gold_s)
    return pb is not None and gb is not None and pb == gb


def key_value_scores(pred: Sequence[Call], gold: Sequence[Call]) -> tuple[float, float]:
    """(S2) key and value terms by greedy matching (reference ``_compute_detailed_match_scores``).

    Only gold calls with arguments are scored (none: both terms are 1). Each takes
    the unused predicted call of the same name with the highest key + value (the
    first on ties; a candidate scoring 0 is never taken), where key is the Jaccard
    similarity of argument keys and value is (keys present in both with loosely
    equal values) / |gold keys|. Both terms average over the scored gold calls.
    """
    scored = [g for g in gold if g.arguments]
    if not scored:
        return 1.0, 1.0
    if not pred:
        return 0.0, 0.0
    used: set[int] = set()
    key_total = value_total = 0.0
    for g in scored:
        gold_keys = set(g.arguments)
        best_key = best_value = 0.0
        best_idx = -1
        for idx, p in enumerate(pred):
            if idx in used or p.name != g.name:
                continue
            pred_keys = set(p.arguments)
            key = len(pred_keys & gold_keys) / len(pred_keys | gold_keys) if pred_keys else 0.0
            value = sum(1 for k in pred_keys & gold_keys
                        if loose_equal(p.arguments[k], g.arguments[k])) / len(gold_keys)
            if key + value > best_key + best_value:
                best_key, best_value, best_idx = key, value, idx
        if best_idx >= 0:
            used.add(best_idx)
        key_total += best_key
        value_total += best_value
    return key_total / len(scored), value_total / len(scored)


def parallel_score(pred_steps: Sequence[Sequence[Call]],
                   gold_steps: Sequence[Sequence[Call]]) -> float:
    """(S2) par = 1 if the first predicted turn has as many calls as the first gold step."""
    pred_first = len(pred_steps[0]) if pred_steps else 0
    gold_first = len(gold_steps[0]) if gold_steps else 0
    return 1.0 if pred_first == gold_first else 0.0


def tool_reward(fmt: float, name: float, key: float, value: float, par: float) -> float:
    """(S2) R_tool = 0.10·fmt + 0.25·name + 0.15·key + 0.20·value + 0.30·par."""
    return W_FMT * fmt + W_NAME * name + W_KEY * key + W_VALUE * value + W_PAR * par


# --------------------------------------------------------------------------- S3 judge


class Judge(Protocol):
    """Rates a final reply 1-5 given the question and the tool responses (S3).

    Returns None when it fails (an LLM judge that times out or answers
    unparseably); R_sum is then 0. Exceptions are not caught.
    """

    def rate(self, question: str, tool_responses: Sequence[str], reply: str) -> int | None: ...


_NUMBER_RE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\w)")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _is_number(fact: str) -> bool:
    return re.fullmatch(r"\d+(?:\.\d+)?", fact) is not None


def mentions(text: str, fact: str) -> bool:
    """Whether ``text`` states ``fact``.

    A numeric fact matches any number in the text within half a cent (``45.9``,
    ``45.90``, ``$45.90`` and ``1,045.90`` all count); any other fact matches
    case-insensitively as a whole token (``ORD-1A2B3C`` is not found in
    ``ORD-1A2B3CD``).
    """
    if _is_number(fact):
        target = float(fact)
        numbers = _NUMBER_RE.findall(_THOUSANDS_RE.sub("", text))
        return any(abs(float(n) - target) < 0.005 for n in numbers)
    pattern = r"(?<![A-Za-z0-9])" + re.escape(fact) + r"(?![A-Za-z0-9])"
    return re.search(pattern, text, re.IGNORECASE) is not None


def grounding_text(tool_responses: Sequence[str]) -> str:
    """The tool responses that can ground a fact: all but the ``error: ...`` ones."""
    return "\n".join(r for r in tool_responses if not r.startswith("error:"))


@dataclass(frozen=True)
class RuleJudge:
    """The built-in judge: how many of the task's facts the reply states, grounded.

    A fact counts when the reply states it *and* some successful tool response
    states it (errors, which may echo the policy's own arguments, do not count),
    so a guessed order id or total earns nothing. With k of n facts,
    rating = 1 + floor(4k/n): all facts give 5, none gives 1. [R] The paper
    uses an LLM judge (gpt-oss-120b); this rule is our stand-in.
    """

    facts: tuple[str, ...]

    def rate(self, question: str, tool_responses: Sequence[str], reply: str) -> int | None:
        if not self.facts:
            return 5
        evidence = grounding_text(tool_responses)
        found = sum(1 for f in self.facts if mentions(reply, f) and mentions(evidence, f))
        return 1 + (4 * found) // len(self.facts)


def summary_reward(question: str, tool_responses: Sequence[str], reply: str | None,
                   judge: Judge) -> float:
    """(S3) R_sum = (rating - 1)/4; 0 with no tool response, a reply under 10 characters,
    or a failed judge (None, or a rating outside 1-5)."""
    if not tool_responses:
        return 0.0
    if reply is None or len(reply.strip()) < MIN_REPLY_CHARS:
        return 0.0
    rating = judge.rate(question, tool_responses, reply)
    if not isinstance(rating, int) or isinstance(rating, bool) or not 1 <= rating <= 5:
        return 0.0
    return (rating - 1) / 4


# --------------------------------------------------------------------------- S2-S4


@dataclass(frozen=True)
class HierR:
    """The HierR parts of one episode (S2-S4); ``reward = (r_tool + r_sum) / 2``."""

    fmt: float
    name: float
    key: float
    value: float
    par: float
    r_tool: float
    r_sum: float
    omitted: bool = False  # the S4 omission guard fired

    @property
    def reward(self) -> float:
        """Normalised HierR score in [-0.25, 1] (Success@0.9 thresholds this, S6)."""
        return (self.r_tool + self.r_sum) / 2

    def parts(self) -> dict[str, float]:
        return {"reward": self.reward, "fmt": self.fmt, "name": self.name, "key": self.key,
                "value": self.value, "par": self.par, "r_tool": self.r_tool,
                "r_sum": self.r_sum}


def hierr(pred_steps: Sequence[Sequence[Call]], gold_steps: Sequence[Sequence[Call]], *,
          n_open: int, n_close: int, n_valid: int, question: str,
          tool_responses: Sequence[str], reply: str | None, judge: Judge) -> HierR:
    """HierR of one episode (S2-S4).

    ``pred_steps``: the valid calls of each policy turn that had any, in order;
    ``n_open``/``n_close``/``n_valid``: ``<tool_call>`` / ``</tool_call>`` tags and
    valid blocks over every action text (think blocks stripped); ``reply``: the
    final ``<answer>`` text (None when the episode ended without one).

    (S4) Gold calls exist but no ``<tool_call>`` tag was written: every term is 0,
    R_tool = 0 and R_sum = -0.5.
    """
    gold_flat = [c for step in gold_steps for c in step]
    if gold_flat and n_open == 0:
        return HierR(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, NO_CALL_PENALTY, omitted=True)
    pred_flat = [c for step in pred_steps for c in step]
    fmt = format_score(n_valid, n_open, n_close)
    name = name_f1([c.name for c in pred_flat], [c.name for c in gold_flat])
    key, value = key_value_scores(pred_flat, gold_flat)
    par = parallel_score(pred_steps, gold_steps)
    r_tool = tool_reward(fmt, name, key, value, par)
    r_sum = summary_reward(question, tool_responses, reply, judge)
    return HierR(fmt, name, key, value, par, r_tool, r_sum)
