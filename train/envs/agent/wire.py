"""The OpenAI chat-completions wire format: checking a request, turning a completion's
text into a message with ``tool_calls``, rendering messages as the shared text protocol,
and writing responses (whole or streamed as server-sent events).

Used by the per-episode endpoint of agent programs (``train.envs.agent.program``) and by
``rtrees serve`` (``train.serve``). Nothing in a request is executed: it is parsed
as JSON, checked against ``LIMITS`` and the known fields, and read as data.

Tool calls (``completion_message``). A completion that holds one or more
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of valid JSON becomes
an assistant message with ``tool_calls`` (``arguments`` as a JSON string, the OpenAI
convention) and ``content`` the text outside the blocks (None when only whitespace);
``finish_reason`` is ``"tool_calls"``. A block that is not valid JSON, or lacks a string
``name``, leaves the whole text as ``content`` with no ``tool_calls`` (vLLM's hermes
parser behaves the same way). A call's ``id`` is ``call_`` and 16 hex digits of the
sha256 of the completion text and the call's index, so the same completion always gets
the same ids (a re-run program sends byte-identical requests: replay depends on it).

Rendering (``render_messages``): the text the policies see. A ``tool`` message becomes
``<tool_response>content</tool_response>`` (escaped, ``train.envs.base.tool_response``),
every other message its content (text parts joined), messages joined by a newline; so a
program driving a calculator tool reads to the policy exactly as the ``calc`` world does.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from train.envs.base import TOOL_CALL_RE, tool_response


class WireError(ValueError):
    """A request that breaks the format or a limit: one line, answered with HTTP
    ``status`` (400; 502 for an upstream that failed, ``rtrees serve --upstream``)."""

    status: int = 400


@dataclass(frozen=True)
class Limits:
    """Bounds on one request (a request past one gets a 400 naming it)."""

    max_body_bytes: int = 4 << 20
    max_messages: int = 512
    max_n: int = 16
    max_tokens: int = 4096
    max_tools: int = 128


LIMITS = Limits()
ROLES = ("system", "developer", "user", "assistant", "tool")
KNOWN_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "parallel_tool_calls", "n", "temperature",
    "top_p", "max_tokens", "max_completion_tokens", "seed", "stream", "stream_options",
    "logprobs", "top_logprobs", "stop", "user", "metadata", "store", "frequency_penalty",
    "presence_penalty", "response_format"})
"""Request fields accepted; any other is a 400 naming it. ``tool_choice``,
``parallel_tool_calls``, ``stop``, ``user``, ``metadata``, ``store``, the penalties and
``response_format`` are accepted and ignored (the model's own protocol decides)."""


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    n: int
    temperature: float
    top_p: float
    max_tokens: int | None
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    body: dict[str, Any]
    """The whole request as sent (the record; fingerprints of replay)."""


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float,
            *, open_lo: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or value > hi or value < lo or (open_lo and value == lo):
        bound = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise WireError(f"{key} must be a number in {bound}, got {value!r}")
    return float(value)


def _integer(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise WireError(f"{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def parse_body(raw: bytes, limits: Limits = LIMITS) -> dict[str, Any]:
    """The JSON object of a request body (``WireError`` when it is too large or not one)."""
    if len(raw) > limits.max_body_bytes:
        raise WireError(f"request body is over {limits.max_body_bytes} bytes")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise WireError("request body is not JSON") from None
    if not isinstance(body, dict):
        raise WireError("request body must be a JSON object")
    return body


def _check_message(i: int, m: Any) -> None:
    if not isinstance(m, dict):
        raise WireError(f"messages[{i}] must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise WireError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got "
                        f"{str(role)[:40]!r}")
    content = m.get("content")
    if content is not None and not isinstance(content, str | list):
        raise WireError(f"messages[{i}].content must be a string, a list of parts or null")
    if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
        raise WireError(f"messages[{i}].content parts must be objects")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise WireError(f"messages[{i}].tool_calls must be a list")


def parse_request(body: dict[str, Any], models: tuple[str, ...] | None = None,
                  limits: Limits = LIMITS) -> ChatRequest:
    """A ``ChatRequest`` of a request body; ``WireError`` naming the first problem (an
    unknown field, a model not in ``models`` when given, a bound of ``limits``)."""
    for key in body:
        if key not in KNOWN_FIELDS:
            raise WireError(f"unknown field {str(key)[:60]!r}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise WireError("model must be a non-empty string")
    if models is not None and model not in models:
        raise WireError(f"unknown model {model[:80]!r}; this server serves "
                        f"{', '.join(models)}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WireError("messages must be a non-empty list")
    if len(messages) > limits.max_messages:
        raise WireError(f"messages holds {len(messages)} messages, over the limit of "
                        f"{limits.max_messages}")
    for i, m in enumerate(messages):
        _check_message(i, m)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or len(tools) > limits.max_tools
                              or not all(isinstance(t, dict) and t.get("type") == "function"
                                         and isinstance(t.get("function"), dict)
                                         and isinstance(t["function"].get("name"), str)
                                         for t in tools)):
        raise WireError(f"tools must be a list of at most {limits.max_tools} "
                        '{"type": "function", "function": {"name": ...}} objects')
    n = _integer(body, "n", 1, limits.max_n) or 1
    max_tokens = _integer(body, "max_tokens", 1, limits.max_tokens)
    completion_cap = _integer(body, "max_completion_tokens", 1, limits.max_tokens)
    stream_options = body.get("stream_options")
    include_usage = isinstance(stream_options, dict) and bool(
        stream_options.get("include_usage"))
    return ChatRequest(
        model=model, messages=messages, tools=tools, n=n,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_lo=True),
        max_tokens=completion_cap if completion_cap is not None else max_tokens,
        seed=_integer(body, "seed", -(1 << 63), (1 << 63) - 1),
        stream=bool(body.get("stream", False)), include_usage=include_usage,
        logprobs=bool(body.get("logprobs", False)), body=body)


# ----- completions as messages --------------------------------------------------------------

def completion_message(text: str) -> tuple[dict[str, Any], str]:
    """The assistant message of a completion's text and its ``finish_reason`` (module
    docstring, "Tool calls")."""
    calls: list[dict[str, Any]] = []
    for j, match in enumerate(TOOL_CALL_RE.finditer(text)):
        try:
            payload = json.loads(match.group(1))
        except (ValueError, RecursionError):
            return {"role": "assistant", "content": text}, "stop"
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return {"role": "assistant", "content": text}, "stop"
        arguments = payload.get("arguments", {})
        digest = hashlib.sha256(f"{j}\x1f{text}".encode("utf-8", "surrogatepass")).hexdigest()
        calls.append({"id": f"call_{digest[:16]}", "type": "function", "function": {
            "name": payload["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    if not calls:
        return {"role": "assistant", "content": text}, "stop"
    rest = TOOL_CALL_RE.sub("", text).strip()
    return {"role": "assistant", "content": rest or None, "tool_calls": calls}, "tool_calls"


def content_text(message: Mapping[str, Any]) -> str:
    """A message's content as text (list parts: their ``text`` joined)."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def render_messages(messages: list[dict[str, Any]]) -> str:
    """The policies' text of ``messages`` (module docstring, "Rendering")."""
    parts = [tool_response(content_text(m)) if m.get("role") == "tool" else content_text(m)
             for m in messages]
    return "\n".join(p for p in parts if p)


# ----- responses ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    """One sampled completion: its text, tokens and per-token logprobs (empty when not
    known) and whether generation stopped by itself (False: it hit ``max_tokens``)."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    finished: bool = True


def _logprobs_of(choice: Choice, tokens: list[str] | None) -> dict[str, Any] | None:
    if not choice.logprobs:
        return None
    names = tokens or [str(t) for t in choice.token_ids]
    return {"content": [{"token": name, "logprob": float(lp), "bytes": None,
                         "top_logprobs": []}
                        for name, lp in zip(names, choice.logprobs, strict=False)]}


def response_body(request: ChatRequest, choices: list[Choice], prompt_tokens: int,
                  completion_id: str, token_text: list[list[str]] | None = None
                  ) -> dict[str, Any]:
    """The ``chat.completion`` object of ``choices`` (logprobs only when asked for)."""
    out = []
    for i, choice in enumerate(choices):
        message, reason = completion_message(choice.text)
        if not choice.finished and reason == "stop":
            reason = "length"
        out.append({"index": i, "message": message, "finish_reason": reason,
                    "logprobs": _logprobs_of(choice, token_text[i] if token_text else None)
                    if request.logprobs else None})
    completion = sum(len(c.token_ids) for c in choices)
    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": out,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}


def stream_events(request: ChatRequest, body: dict[str, Any]) -> Iterator[bytes]:
    """A whole response as server-sent ``chat.completion.chunk`` events: per choice, one
    chunk with the role and content, one per tool call, one with the finish reason; then
    usage (when ``stream_options.include_usage``) and ``[DONE]``."""
    base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
            "model": body["model"]}

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + json.dumps({**base, "choices": choices, **extra}).encode() + b"\n\n"

    for choice in body["choices"]:
        i, message = choice["index"], choice["message"]
        yield event([{"index": i, "delta": {"role": "assistant",
                                            "content": message.get("content") or ""},
                      "logprobs": choice["logprobs"], "finish_reason": None}])
        for j, call in enumerate(message.get("tool_calls") or []):
            yield event([{"index": i, "delta": {"tool_calls": [{"index": j, **call}]},
                          "finish_reason": None}])
        yield event([{"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}])
    if request.include_usage:
        yield event([], usage=body["usage"])
    yield b"data: [DONE]\n\n"


def error_body(message: str, kind: str = "invalid_request_error") -> bytes:
    """The OpenAI error object of a one-line message."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": None}}).encode()


__all__ = ["KNOWN_FIELDS", "LIMITS", "ROLES", "ChatRequest", "Choice", "Limits",
           "WireError", "completion_message", "content_text", "error_body", "parse_body",
           "parse_request", "render_messages", "response_body", "stream_events"]
