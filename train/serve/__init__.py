"""``rtrees serve``: an OpenAI-compatible chat-completions endpoint on ``127.0.0.1`` backed
by a rollout-trees policy's continuously batched decoder (``train.serve.server``)."""

from train.serve.server import (
    Batcher,
    ServeHandle,
    UpstreamError,
    messages_transcript,
    serve,
    serve_upstream,
)

__all__ = ["Batcher", "ServeHandle", "UpstreamError", "messages_transcript", "serve",
           "serve_upstream"]
