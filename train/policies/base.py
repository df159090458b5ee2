"""The policy protocol every backend implements (README, "Architecture as built").

A transcript is the episode so far as typed turns: the prompt (the root's
observation), then alternating agent actions and environment observations.
Backends render it their own way (the tiny model with its own format, an HF
model with its chat template) and continue it with ONE agent step: generation
stops after a closing ``</tool_call>`` or ``</answer>`` (or at
``max_new_tokens``). Sampling ``n`` continuations of one transcript computes
the transcript's prefix once and shares it across the ``n`` branches (KV-cache
expansion for tiny/hf, prefix caching for vLLM): a branch never regenerates
its prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np

TurnRole = Literal["prompt", "action", "observation"]
Turn = tuple[TurnRole, str]
Transcript = Sequence[Turn]

STOP_STRINGS: tuple[str, ...] = ("</tool_call>", "</answer>")


@dataclass(frozen=True)
class Continuation:
    """One sampled agent step: its text, tokens, and per-token logprobs and entropies.

    ``logprobs[i]`` is log pi(token_i | prefix, tokens_<i) under the sampling
    distribution's policy (temperature 1 unless the backend says otherwise);
    ``entropies[i]`` the entropy of that next-token distribution (nats).
    ``finished`` is False when generation hit ``max_new_tokens`` first.
    ``prefill_tokens`` counts prefix tokens this branch had to compute itself
    (0 when it reused a shared prefix computation).
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    finished: bool = True
    prefill_tokens: int = 0
    meta: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SampleConfig:
    """How to sample: ``n`` branches per transcript, length cap, temperature, seed."""

    n: int = 1
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


@runtime_checkable
class Policy(Protocol):
    """Sample one agent step for many transcripts; score given steps; name the version."""

    @property
    def policy_version(self) -> str:
        """A stable name of the weights (e.g. a hash), recorded with every tree."""
        ...

    @property
    def policy_ref(self) -> str | None:
        """Where the weights live (a checkpoint path), so audits can reload them."""
        ...

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        """``config.n`` continuations of each transcript (outer list: transcripts)."""
        ...

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        """Per-token logprobs (float64 arrays) of ``actions[i]`` after ``transcripts[i]``."""
        ...
