"""``rtrees serve`` (issue 49): the OpenAI-compatible endpoint driven by the real
``openai`` client: tool calls, logprobs, ``n``, seeds, greedy decoding, ``max_tokens``,
streaming, the call record, concurrent sessions sharing decode steps; and its security:
loopback only, Host check, the bearer key, bounded requests answered with one-line 400s."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from train.envs.agent.wire import Limits  # noqa: E402
from train.policies import load_policy  # noqa: E402
from train.policies.base import Policy  # noqa: E402
from train.serve import ServeHandle, messages_transcript, serve  # noqa: E402

PROMPT = [{"role": "user", "content": "Compute 3+4."}]


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_policy("tiny:calc", "calc")


@pytest.fixture(scope="module")
def server(policy: Policy, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeHandle]:
    record = tmp_path_factory.mktemp("serve") / "calls.jsonl"
    handle = serve(policy, model="tiny", record=record,
                   limits=Limits(max_body_bytes=64 << 10, max_messages=32, max_n=8,
                                 max_tokens=256))
    yield handle
    handle.close()


def _client(server: ServeHandle, key: str | None = None) -> Any:
    return openai.OpenAI(base_url=server.url, api_key=key or server.key, max_retries=0)


def test_tool_calls_logprobs_n_and_seeds(server: ServeHandle) -> None:
    client = _client(server)
    reply = client.chat.completions.create(model="tiny", messages=PROMPT, n=3, seed=11,
                                           logprobs=True, max_tokens=64)
    assert len(reply.choices) == 3
    again = client.chat.completions.create(model="tiny", messages=PROMPT, n=3, seed=11,
                                           logprobs=True, max_tokens=64)
    assert [c.message.content for c in reply.choices] == \
        [c.message.content for c in again.choices]
    assert [c.message.tool_calls for c in reply.choices] == \
        [c.message.tool_calls for c in again.choices]
    with_calls = [c for c in reply.choices if c.message.tool_calls]
    assert with_calls, "the calc policy calls its tool first"
    call = with_calls[0]
    assert call.finish_reason == "tool_calls"
    assert call.message.tool_calls[0].function.name == "calc"
    assert isinstance(json.loads(call.message.tool_calls[0].function.arguments), dict)
    assert call.logprobs is not None and call.logprobs.content
    assert all(t.logprob <= 0.0 for t in call.logprobs.content)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices
                                                if c.logprobs and c.logprobs.content)


def test_tool_result_turn_greedy_and_max_tokens(server: ServeHandle) -> None:
    client = _client(server)
    first = client.chat.completions.create(model="tiny", messages=PROMPT, temperature=0)
    message = first.choices[0].message
    assert message.tool_calls
    follow = [*PROMPT, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "7"}]
    answers = {client.chat.completions.create(model="tiny", messages=follow, temperature=0,
                                              seed=s).choices[0].message.content
               for s in (1, 2)}
    assert answers == {"<answer>7</answer>"}  # greedy: the seed changes nothing
    short = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=2)
    assert short.usage is not None and short.usage.completion_tokens <= 2
    assert short.choices[0].finish_reason == "length"


def test_stream_carries_the_same_completion(server: ServeHandle) -> None:
    client = _client(server)
    whole = client.chat.completions.create(model="tiny", messages=PROMPT, seed=5)
    chunks = list(client.chat.completions.create(model="tiny", messages=PROMPT, seed=5,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    message = whole.choices[0].message
    assert content == (message.content or "")
    assert [t.function.name for t in calls if t.function] == \
        [t.function.name for t in message.tool_calls or []]
    assert chunks[-1].usage is not None


def test_every_call_is_recorded(server: ServeHandle) -> None:
    client = _client(server)
    before = server.calls
    client.chat.completions.create(model="tiny", messages=PROMPT, n=2, seed=3)
    assert server.calls == before + 1
    assert server.endpoint.record is not None
    lines = server.endpoint.record.read_text().splitlines()
    assert len(lines) == server.calls
    last = json.loads(lines[-1])
    assert last["request"]["messages"] == PROMPT and last["request"]["n"] == 2
    assert len(last["completions"]) == 2
    for c in last["completions"]:
        assert len(c["token_ids"]) == len(c["logprobs"]) > 0
    assert last["policy_version"] and last["seconds"] >= 0


TOOLS_TEMPLATE = (
    "{%- if tools -%}{{- '<|system|>' -}}{%- for t in tools -%}"
    "{{- t['function']['name'] + ': ' + t['function']['description'] + ' ('"
    " + t['function']['parameters']['type'] + ')\\n' -}}{%- endfor -%}{%- endif -%}"
    "{%- for message in messages -%}{{- '<|' + message['role'] + '|>' + message['content'] -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}")
"""The tiny checkpoint's template with a tool list in front, as chat templates that take
``tools`` (Qwen's, Llama 3's) put them in the system turn."""
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_a_requests_tools_reach_its_prompt(policy: Policy, tmp_path: Path) -> None:
    """The request's ``tools`` are rendered by the policy's chat template in place of the
    ones it was loaded with (recorded prompt ids, decoded by the policy's tokenizer); a
    request without tools gets the loaded ones; tools the template cannot render are a
    one-line 400 and the server goes on."""
    import copy

    from train.policies import env_tools
    from train.policies.hf import HFPolicy

    assert isinstance(policy, HFPolicy)
    tokenizer = copy.deepcopy(policy.tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    with_tools = HFPolicy(policy.model, tokenizer, tools=env_tools("calc"), version="tools")
    record = tmp_path / "calls.jsonl"
    handle = serve(with_tools, model="tiny", record=record)
    try:
        client = _client(handle)
        for tools in (WEATHER, None):
            kwargs: dict[str, Any] = {"tools": tools} if tools else {}
            client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=8,
                                           seed=0, **kwargs)
        bad = [{"type": "function", "function": {"name": "now", "description": "time"}}]
        with pytest.raises(openai.BadRequestError, match="do not render"):
            client.chat.completions.create(model="tiny", messages=PROMPT, tools=bad)
        client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=4,
                                       tools=WEATHER)
    finally:
        handle.close()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 3
    prompts = [tokenizer.decode(line["prompt_ids"]) for line in lines]
    assert prompts[0] == ("<|system|>get_weather: Weather in a city (object)\n"
                          "<|user|>Compute 3+4.<|assistant|>")
    assert prompts[0] == prompts[2] and lines[0]["request"]["tools"] == WEATHER
    assert prompts[1].startswith("<|system|>calc: ") and "get_weather" not in prompts[1]


def test_concurrent_sessions_share_decode_steps(server: ServeHandle) -> None:
    client = _client(server)
    assert server.batcher is not None
    steps = server.batcher.decode_steps

    def one(i: int) -> int:
        reply = client.chat.completions.create(model="tiny", messages=PROMPT, seed=i)
        return reply.usage.completion_tokens if reply.usage else 0

    with cf.ThreadPoolExecutor(16) as pool:
        tokens = list(pool.map(one, range(32)))
    assert all(t > 0 for t in tokens)
    # 32 sessions' tokens in fewer decode steps than tokens: they were batched together
    assert server.batcher.decode_steps - steps < sum(tokens)


def _raw(server: ServeHandle, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.server.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def test_security_and_bad_input(server: ServeHandle) -> None:
    assert server.server._server.server_address[0] == "127.0.0.1"
    host = f"127.0.0.1:{server.server.port}"
    good = {"Host": host, "Authorization": f"Bearer {server.key}",
            "Content-Type": "application/json"}
    ok = json.dumps({"model": "tiny", "messages": PROMPT}).encode()
    cases = [
        (ok, {**good, "Host": "evil.example:80"}, 400, "Host header"),
        (ok, {k: v for k, v in good.items() if k != "Authorization"}, 401, "API key"),
        (ok, {**good, "Authorization": "Bearer wrong"}, 401, "API key"),
        (b"{not json", good, 400, "not JSON"),
        (b"x" * (65 << 10), good, 400, "over"),
        (json.dumps({"model": "gpt-9", "messages": PROMPT}).encode(), good, 400, "gpt-9"),
        (json.dumps({"model": "tiny", "messages": PROMPT, "tool_exec": 1}).encode(), good,
         400, "tool_exec"),
        (json.dumps({"model": "tiny", "messages": PROMPT, "n": 9}).encode(), good, 400, "n"),
        (json.dumps({"model": "tiny", "messages": PROMPT, "max_tokens": 10**9}).encode(),
         good, 400, "max_tokens"),
        (json.dumps({"model": "tiny", "messages": PROMPT * 40}).encode(), good, 400,
         "messages"),
        (json.dumps({"model": "tiny", "messages": [{"role": "root", "content": "x"}]}
                    ).encode(), good, 400, "role"),
        (json.dumps({"model": "tiny", "messages": [*PROMPT, {"role": "assistant",
                                                             "content": "hi"}]}).encode(),
         good, 400, "nothing to continue"),
    ]
    for body, headers, status, needle in cases:
        got, text = _raw(server, body, headers)
        assert got == status, (needle, got, text)
        message = json.loads(text)["error"]["message"]
        assert needle in message and "\n" not in message and "Traceback" not in text
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="x" * 40).chat.completions.create(model="tiny", messages=PROMPT)
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        _client(server).chat.completions.create(model="nope", messages=PROMPT)


def test_messages_become_the_policy_transcript() -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be exact."}, *PROMPT,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "calc", "arguments": '{"expr": "3+4"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "7"}]
    assert messages_transcript(messages) == [
        ("prompt", "Be exact.\nCompute 3+4."),
        ("action", '<tool_call>{"name": "calc", "arguments": {"expr": "3+4"}}</tool_call>'),
        ("observation", "<tool_response>7</tool_response>")]


def test_serve_command_refuses_bad_options(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    result = CliRunner().invoke(app, ["serve", "--policy", "tiny:calc", "--port", "70000"])
    assert result.exit_code != 0 and "--port" in result.output


def test_proxy_records_and_replays_in_front_of_an_upstream(
        server: ServeHandle, tmp_path: Path) -> None:
    """``--upstream``: a second endpoint in front of the first (any OpenAI-compatible
    server): calls pass through with their tool calls and logprobs, are recorded, and an
    identical request is answered from the record without reaching the upstream."""
    from train.serve import serve_upstream

    record = tmp_path / "proxy.jsonl"
    proxy = serve_upstream(server.url, upstream_key=server.key, model="tiny", record=record)
    try:
        client = _client(proxy)
        upstream_calls = server.calls
        first = client.chat.completions.create(model="tiny", messages=PROMPT, seed=9,
                                               logprobs=True)
        again = client.chat.completions.create(model="tiny", messages=PROMPT, seed=9,
                                               logprobs=True)
        plain = client.chat.completions.create(model="tiny", messages=PROMPT, seed=10)
        assert first.choices[0].message == again.choices[0].message
        assert server.calls == upstream_calls + 2  # the repeat came from the record
        lines = [json.loads(line) for line in record.read_text().splitlines()]
        assert [line["replayed"] for line in lines] == [False, True, False]
        assert lines[0]["completions"][0]["logprobs"] and not \
            lines[0]["completions"][0]["logprobs_missing"]
        assert lines[2]["completions"][0]["logprobs_missing"]
        assert plain.choices[0].message.content is not None or \
            plain.choices[0].message.tool_calls
        with pytest.raises(openai.BadRequestError, match="unknown model"):
            client.chat.completions.create(model="other", messages=PROMPT)
    finally:
        proxy.close()
    dead = serve_upstream("http://127.0.0.1:9/v1", model="tiny")
    try:
        with pytest.raises(openai.InternalServerError, match="unreachable"):
            _client(dead).chat.completions.create(model="tiny", messages=PROMPT)
    finally:
        dead.close()
    with pytest.raises(ValueError, match="http"):
        serve_upstream("file:///etc/passwd")
