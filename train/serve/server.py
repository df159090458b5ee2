"""An OpenAI-compatible chat-completions endpoint backed by a policy (``rtrees serve``).

``serve(policy, ...)`` starts a loopback server (``train.envs.agent.http``: binds
``127.0.0.1``, checks ``Host``, requires ``Authorization: Bearer KEY``, bounds every
request, answers bad input with a one-line 400 and never a traceback, executes nothing
a request holds) whose ``POST /v1/chat/completions`` samples from ``policy``:

* the request's messages become a transcript (``messages_transcript``): the messages
  before the first assistant message are the prompt, each assistant message an action
  (its ``tool_calls`` written back as ``<tool_call>{json}</tool_call>`` blocks, the text
  the model produced), the messages between two assistant messages one observation
  (``wire.render_messages``: a tool result reads ``<tool_response>...</tool_response>``);
* ``n`` branches share one prefill, branch k drawing from the stream ``seed + k``
  (``Rows``; a request without ``seed`` gets a random one), with the request's
  ``temperature`` (0: greedy, as ``top_p`` 1e-9), ``top_p`` and ``max_tokens``;
* every request of every client joins ONE continuously batched decoder (``Batcher``: the
  policy's ``decoder()``, the rollout engine's; a policy without one is called with the
  waiting rows as one ``sample_rows`` call per sampling config), so concurrent sessions
  share decode steps;
* the completion's text becomes ``tool_calls`` like vLLM's hermes parser
  (``wire.completion_message``); ``logprobs`` (when asked for) are the sampled tokens'
  log-probabilities under the untempered policy (the ``Continuation`` convention);
  ``stream`` sends the finished completion as server-sent chunks;
* every call is recorded (``record``: one JSON line per call: the request as sent, each
  completion's text, token ids and logprobs, the policy version, the seconds it took).

Proxy mode (``serve_upstream``, ``rtrees serve --upstream URL``): the same endpoint in
front of any OpenAI-compatible server (a vLLM server on a GPU box): each call is forwarded,
recorded (logprobs when the upstream gives them, ``logprobs_missing`` when not), and a
request byte-identical to a recorded one is answered from the record, asking nothing of
the upstream; an upstream failure is a one-line HTTP 502.

Tools. A request's ``tools`` are rendered into its prompt by the policy's chat template
(the policy's ``renderer``, ``train.policies.hf.render.ChatRenderer``, with the request's
tools in place of the ones it was loaded with: ``load_policy(..., env)``, the
environment's ``tool_schemas``); a request without ``tools`` gets the loaded ones. The
prompt is rendered on the decoding thread (the tokenizer is the policy's, so one thread
uses it), once per request, and recorded as ``prompt_ids``; rows with different tools
share the decoding batch. Tools the template cannot render are that request's one-line
400. A policy without a chat template (``tabular``) renders no tools.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from train.envs.agent.http import Endpoint, LoopbackServer, Unauthorized, same_key
from train.envs.agent.wire import (
    LIMITS,
    ChatRequest,
    Choice,
    Limits,
    WireError,
    content_text,
    render_messages,
    response_body,
)
from train.policies.base import Continuation, Policy, Rows, SampleConfig, Turn, sample_rows

DEFAULT_MAX_TOKENS = 256
"""Token cap of a completion whose request sets no ``max_tokens``."""
GREEDY_TOP_P = 1e-9
"""``top_p`` of ``temperature: 0`` requests: the most likely token only
(``train.policies.hf``: ``top_p`` always keeps the most likely token)."""


def _assistant_text(message: dict[str, Any]) -> str:
    text = content_text(message)
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise WireError("an assistant tool call needs a function object")
        args = fn.get("arguments", "{}")
        try:
            arguments = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise WireError("an assistant tool call's arguments are not JSON") from None
        text += "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": arguments}) \
            + "</tool_call>"
    return text


def messages_transcript(messages: Sequence[dict[str, Any]]) -> list[Turn]:
    """The policy transcript of chat ``messages`` (module docstring); ``WireError`` when
    the last message is the assistant's (nothing to continue)."""
    turns: list[Turn] = []
    group: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") != "assistant":
            group.append(m)
            continue
        turns.append(("prompt" if not turns else "observation", render_messages(group)))
        group = []
        turns.append(("action", _assistant_text(m)))
    if not group:
        raise WireError("the last message is the assistant's: nothing to continue")
    turns.append(("prompt" if not turns else "observation", render_messages(group)))
    return turns


# ----- the shared decoder -------------------------------------------------------------------

@dataclass
class _Job:
    rows: Rows
    config: SampleConfig
    tools: list[dict[str, Any]] | None = None
    future: cf.Future[list[Continuation]] = field(default_factory=cf.Future)
    got: list[Continuation | None] = field(default_factory=list)
    prompt_ids: list[int] | None = None  # as rendered (policies with a chat template)


RENDERERS_KEPT = 32
"""Chat renderers kept per server, one per distinct ``tools`` list (least recent out)."""


class Batcher:
    """One thread owns ``policy`` and decodes the rows of every request together
    (module docstring). ``submit`` is thread-safe; ``close`` stops the thread."""

    def __init__(self, policy: Policy, max_rows: int = 128) -> None:
        self.policy, self.max_rows = policy, max_rows
        self._renderers: dict[str, Any] = {}
        self.inbox: queue.Queue[_Job | None] = queue.Queue()
        self.decode_steps = 0
        self.rows_decoded = 0
        self._running: dict[int, _Job] = {}
        self._thread = threading.Thread(target=self._loop, name="rtrees-serve-decode",
                                        daemon=True)
        self._thread.start()

    def submit(self, rows: Rows, config: SampleConfig,
               tools: list[dict[str, Any]] | None = None) -> _Job:
        """Sample ``rows``, its prompt rendered with ``tools`` (None: the policy's own;
        module docstring): the job's ``future`` gets the continuations, and its
        ``prompt_ids`` are set before it does (None: a policy without a chat renderer)."""
        job = _Job(rows, replace(config, n=1, seed=None), tools, got=[None] * rows.n)
        self.inbox.put(job)
        return job

    def _renderer(self, tools: list[dict[str, Any]] | None) -> Any:
        """The policy's chat renderer with ``tools`` (None: as loaded; no renderer: None)."""
        base = getattr(self.policy, "renderer", None)
        if base is None or tools is None or isinstance(base, type) or \
                not dataclasses.is_dataclass(base):
            return base
        base_renderer: Any = base
        key = json.dumps(tools, sort_keys=True)
        found = self._renderers.pop(key, None)
        if found is None:
            found = dataclasses.replace(base_renderer, tools=tools)
        self._renderers[key] = found  # most recent last
        while len(self._renderers) > RENDERERS_KEPT:
            del self._renderers[next(iter(self._renderers))]
        return found

    def _render(self, job: _Job) -> bool:
        """Render the job's prompt ids (``job.prompt_ids``); False when its tools do not
        render (the job's future then holds a ``WireError``)."""
        renderer = self._renderer(job.tools)
        if renderer is None:
            return True
        try:
            job.prompt_ids = list(renderer.prompt_ids(job.rows.transcript))
        except Exception as exc:  # the request's tools against the policy's template
            job.future.set_exception(WireError(
                "the request's messages or tools do not render with the policy's chat "
                f"template: {type(exc).__name__}: {str(exc)[:200]}"))
            return False
        return True

    def close(self) -> None:
        self.inbox.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        make = getattr(self.policy, "decoder", None)
        waiting: list[_Job] = []
        decoder = make() if callable(make) else None
        while True:
            idle = not waiting and (decoder is None or not decoder.live)
            try:
                item = self.inbox.get(timeout=None if idle else 0)
                while True:
                    if item is None:
                        return
                    waiting.append(item)
                    item = self.inbox.get_nowait()
            except queue.Empty:
                pass
            try:
                if decoder is None:
                    self._whole_calls(waiting)
                    waiting = []
                else:
                    waiting = self._admit(decoder, waiting)
                    if decoder.live:
                        self.decode_steps += 1
                        for tag, k, cont in decoder.step():
                            job: _Job = tag
                            job.got[k] = cont
                            if all(c is not None for c in job.got):
                                del self._running[id(job)]
                                job.future.set_result([c for c in job.got if c is not None])
            except Exception as exc:  # the policy failed: fail what is in flight, go on
                for job in waiting:
                    job.future.set_exception(exc)
                waiting = []
                if decoder is not None:
                    decoder = make() if callable(make) else None
                self._fail_running(exc)

    def _fail_running(self, exc: Exception) -> None:
        for job in self._running.values():
            if not job.future.done():
                job.future.set_exception(exc)
        self._running.clear()

    def _admit(self, decoder: Any, waiting: list[_Job]) -> list[_Job]:
        left: list[_Job] = []
        admit = getattr(decoder, "admit", None)  # prompt ids in (HF's ``DecodeBatch``)
        for job in waiting:
            free = self.max_rows - decoder.live
            if not decoder.accepting or (job.rows.n > max(free, 0) and decoder.live):
                left.append(job)
                continue
            if job.prompt_ids is None and not self._render(job):
                continue
            if job.prompt_ids is not None and callable(admit):
                admit([job.prompt_ids], [job.rows.n], [job.rows.seed], [job], job.config)
            else:
                decoder.add([job.rows], [job], job.config)
            self._running[id(job)] = job
            self.rows_decoded += job.rows.n
        return left

    def _whole_calls(self, waiting: list[_Job]) -> None:
        """One ``sample_rows`` call per sampling config and tools list; a policy with a
        renderer samples a tools group with the renderer of those tools in place (this
        thread alone uses the policy)."""
        by_config: dict[tuple[SampleConfig, str], list[_Job]] = {}
        for job in waiting:
            if not self._render(job):
                continue
            key = json.dumps(job.tools, sort_keys=True) if job.tools is not None else ""
            by_config.setdefault((job.config, key), []).append(job)
        for (config, _), jobs in by_config.items():
            base = getattr(self.policy, "renderer", None)
            renderer = self._renderer(jobs[0].tools)
            try:
                if renderer is not base:
                    self.policy.renderer = renderer  # type: ignore[attr-defined]
                got = sample_rows(self.policy, [j.rows for j in jobs], config)
            finally:
                if renderer is not base:
                    self.policy.renderer = base  # type: ignore[attr-defined]
            self.decode_steps += 1
            self.rows_decoded += sum(j.rows.n for j in jobs)
            for job, conts in zip(jobs, got, strict=True):
                job.future.set_result(conts)


# ----- the endpoint -------------------------------------------------------------------------

class _PolicyEndpoint:
    def __init__(self, batcher: Batcher, model: str, version: str,
                 record: Path | None, limits: Limits, token_text: Any) -> None:
        self.batcher, self.model, self.version = batcher, model, version
        self.record, self.limits, self.token_text = record, limits, token_text
        self.calls = 0
        self._lock = threading.Lock()

    @property
    def models(self) -> tuple[str, ...] | None:
        return (self.model,)

    def complete(self, request: ChatRequest) -> dict[str, Any]:
        start = time.perf_counter()
        transcript = messages_transcript(request.messages)
        greedy = request.temperature == 0.0
        config = SampleConfig(
            n=1, max_new_tokens=request.max_tokens or min(DEFAULT_MAX_TOKENS,
                                                           self.limits.max_tokens),
            temperature=1.0 if greedy else request.temperature,
            top_p=GREEDY_TOP_P if greedy else request.top_p)
        seed = request.seed if request.seed is not None else secrets.randbits(62)
        job = self.batcher.submit(Rows(transcript, request.n, seed & ((1 << 62) - 1)),
                                  config, request.tools)
        conts = job.future.result()
        prompt_ids = job.prompt_ids
        choices = [Choice(c.text, tuple(c.token_ids), tuple(c.logprobs), c.finished)
                   for c in conts]
        texts = [[self.token_text(t) for t in c.token_ids] for c in conts] \
            if request.logprobs else None
        with self._lock:
            self.calls += 1
            number = self.calls
        body = response_body(request, choices, sum(c.prefill_tokens for c in conts),
                             f"chatcmpl-{number}-{secrets.token_hex(4)}", texts)
        if self.record is not None:
            line = json.dumps({"call": number, "request": request.body,
                               "policy_version": self.version, "prompt_ids": prompt_ids,
                               "seconds": round(time.perf_counter() - start, 6),
                               "completions": [{"text": c.text, "token_ids": list(c.token_ids),
                                                "logprobs": list(c.logprobs),
                                                "finished": c.finished} for c in conts]})
            with self._lock, self.record.open("a", encoding="utf-8") as f:
                f.write(line + "\n")
        return body


class UpstreamError(WireError):
    """The upstream server failed or answered something that is not a completion (502)."""

    status = 502


class _ProxyEndpoint:
    """``--upstream``: forwards each request to an OpenAI-compatible server, records it, and
    answers a request byte-identical to a recorded one (same messages, same ``seed``...)
    from the record without asking the upstream (``replayed``)."""

    def __init__(self, upstream: str, upstream_key: str | None, model: str | None,
                 record: Path | None, timeout_s: float) -> None:
        import urllib.parse

        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--upstream {upstream!r}: an http(s) URL of an "
                             "OpenAI-compatible server (e.g. http://host:8000/v1)")
        self.upstream = upstream.rstrip("/")
        self.upstream_key, self.model, self.record = upstream_key, model, record
        self.timeout_s = timeout_s
        self.calls = self.replayed = 0
        self._seen: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @property
    def models(self) -> tuple[str, ...] | None:
        return (self.model,) if self.model else None

    def _forward(self, body: dict[str, Any]) -> dict[str, Any]:
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.upstream_key:
            headers["Authorization"] = f"Bearer {self.upstream_key}"
        req = urllib.request.Request(f"{self.upstream}/chat/completions", method="POST",
                                     data=json.dumps({**body, "stream": False}).encode(),
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as response:
                raw = response.read(LIMITS.max_body_bytes * 4 + 1)
        except urllib.error.HTTPError as exc:
            detail = exc.read(2000).decode("utf-8", "replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                detail = str(json.loads(detail)["error"]["message"])
            raise UpstreamError(f"upstream answered HTTP {exc.code}: "
                                f"{detail.splitlines()[0][:200] if detail else ''}") from None
        except (OSError, ValueError) as exc:
            raise UpstreamError(f"upstream {self.upstream} unreachable: "
                                f"{type(exc).__name__}") from None
        try:
            answer = json.loads(raw)
        except ValueError:
            raise UpstreamError("upstream answered something that is not JSON") from None
        if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list):
            raise UpstreamError("upstream answered something that is not a chat completion")
        return answer

    def complete(self, request: ChatRequest) -> dict[str, Any]:
        start = time.perf_counter()
        key = json.dumps({k: v for k, v in request.body.items()
                          if k not in ("stream", "stream_options")}, sort_keys=True)
        with self._lock:
            recorded = self._seen.get(key)
        replayed = recorded is not None
        answer = recorded if recorded is not None else self._forward(request.body)
        with self._lock:
            self.calls += 1
            self.replayed += replayed
            self._seen.setdefault(key, answer)
            number = self.calls
        if self.record is not None:
            completions = []
            for choice in answer["choices"]:
                content = (choice.get("logprobs") or {}).get("content") \
                    if isinstance(choice, dict) else None
                message = choice.get("message", {}) if isinstance(choice, dict) else {}
                completions.append({
                    "message": message,
                    "logprobs": [t.get("logprob") for t in content] if content else None,
                    "logprobs_missing": not content})
            line = json.dumps({"call": number, "request": request.body, "replayed": replayed,
                               "policy_version": f"upstream:{self.upstream}",
                               "seconds": round(time.perf_counter() - start, 6),
                               "completions": completions})
            with self._lock, self.record.open("a", encoding="utf-8") as f:
                f.write(line + "\n")
        return answer


@dataclass
class ServeHandle:
    """A running ``serve``: its base URL (``.../v1``), its key, what it has served."""

    url: str
    key: str
    model: str
    server: LoopbackServer
    batcher: Batcher | None
    endpoint: _PolicyEndpoint | _ProxyEndpoint

    @property
    def calls(self) -> int:
        return self.endpoint.calls

    def close(self) -> None:
        self.server.close()
        if self.batcher is not None:
            self.batcher.close()


def serve_upstream(upstream: str, *, upstream_key: str | None = None,
                   model: str | None = None, key: str | None = None, port: int = 0,
                   record: str | Path | None = None, limits: Limits = LIMITS,
                   timeout_s: float = 600.0) -> ServeHandle:
    """Proxy mode (``rtrees serve --upstream URL``): the same loopback endpoint, its calls
    forwarded to the OpenAI-compatible server at ``upstream`` (``.../v1``) with
    ``upstream_key``, each recorded (logprobs when the upstream gives them, else
    ``logprobs_missing``), a request identical to a recorded one answered from the record.
    ``model``: the one model name accepted (None: any, passed on)."""
    api_key = _key(key)
    endpoint = _ProxyEndpoint(upstream, upstream_key, model,
                              Path(record) if record is not None else None, timeout_s)

    server = LoopbackServer(_route(api_key, endpoint), port=port, limits=limits)
    return ServeHandle(server.url("/v1"), api_key, model or "", server, None, endpoint)


def _route(api_key: str, endpoint: Endpoint) -> Callable[[str, str], Endpoint]:
    """The server's one route: ``/v1`` with the owner's key answers from ``endpoint``."""

    def route(path: str, given: str) -> Endpoint:
        if path != "/v1":
            raise KeyError(path)
        if not same_key(given, api_key):
            raise Unauthorized(path)
        return endpoint

    return route


def _key(key: str | None) -> str:
    if key is not None and len(key) < 16:
        raise ValueError("an API key needs at least 16 characters")
    return key or secrets.token_urlsafe(32)


def serve(policy: Policy, *, model: str = "policy", key: str | None = None, port: int = 0,
          record: str | Path | None = None, limits: Limits = LIMITS, max_rows: int = 128
          ) -> ServeHandle:
    """Serve ``policy`` on ``127.0.0.1:port`` (0: a free port) under the model name
    ``model`` with the API key ``key`` (default: a fresh ``secrets.token_urlsafe(32)``);
    ``record``: a JSONL file every call is appended to."""
    api_key = _key(key)
    tokenizer = getattr(policy, "tokenizer", None)

    def token_text(token_id: int) -> str:
        if tokenizer is None:
            return str(token_id)
        return str(tokenizer.decode([token_id]))

    batcher = Batcher(policy, max_rows)
    endpoint = _PolicyEndpoint(batcher, model, str(policy.policy_version),
                               Path(record) if record is not None else None, limits,
                               token_text)

    server = LoopbackServer(_route(api_key, endpoint), port=port, limits=limits)
    return ServeHandle(server.url("/v1"), api_key, model, server, batcher, endpoint)


__all__ = ["Batcher", "ServeHandle", "UpstreamError", "messages_transcript", "serve",
           "serve_upstream"]
