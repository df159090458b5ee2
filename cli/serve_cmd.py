"""``rtrees serve``: an OpenAI-compatible chat-completions endpoint on 127.0.0.1 backed by
a policy's continuously batched decoder (``train.serve``, issue 49). It prints the base URL
and the API key (a fresh one, or ``$RTREES_API_KEY``) to its owner and serves until
Ctrl-C; every call is appended to ``--record``. ``--upstream URL`` puts the same endpoint
in front of another OpenAI-compatible server (proxy mode)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Annotated

import typer

from cli._common import fail


def serve_command(
    policy: Annotated[str | None, typer.Option(
        help="Policy spec (tiny, tiny:ENV, hf:PATH).")] = None,
    upstream: Annotated[str | None, typer.Option(
        help="Proxy mode: forward to this OpenAI-compatible server (http(s)://HOST:PORT/v1; "
             "its key from $RTREES_UPSTREAM_API_KEY), record every call, answer a repeated "
             "identical request from the record.")] = None,
    env: Annotated[str, typer.Option(
        help="Environment whose tools the policy's chat template renders for a request "
             "without tools (a request's own tools replace them), and whose tiny "
             "checkpoint 'tiny' loads.")] = "calc",
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0: a free one).")] = 0,
    model: Annotated[str | None, typer.Option(
        "--model", help="The model name clients must send (default: policy; with "
                        "--upstream, any name, passed on).")] = None,
    record: Annotated[Path | None, typer.Option(
        help="Append every call (request, completions with token ids and logprobs, policy "
             "version, seconds) to this JSONL file.")] = None,
) -> None:
    """Serve a policy as an OpenAI-compatible chat-completions endpoint on 127.0.0.1."""
    from train.policies import PolicyUnavailableError, load_policy
    from train.serve import serve, serve_upstream

    if not 0 <= port <= 65535:
        fail(f"--port must be in 0..65535, got {port}")
    if (policy is None) == (upstream is None):
        fail("give exactly one of --policy and --upstream")
    key = os.environ.get("RTREES_API_KEY") or None
    try:
        if upstream is not None:
            handle = serve_upstream(upstream, upstream_key=os.environ.get(
                "RTREES_UPSTREAM_API_KEY") or None, model=model, key=key, port=port,
                record=record)
        else:
            handle = serve(load_policy(str(policy), env), model=model or "policy", key=key,
                           port=port, record=record)
    except (ValueError, OSError, PolicyUnavailableError) as exc:
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    what = upstream if upstream is not None else policy
    typer.echo(f"serving {what} as model {handle.model or 'any'!r} at {handle.url}")
    typer.echo(f"API key: {handle.key}")
    typer.echo("(clients: OpenAI(base_url=URL, api_key=KEY); Ctrl-C stops)", err=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        handle.close()


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to the ``rtrees`` app."""
    app.command("serve")(serve_command)
