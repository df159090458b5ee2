"""The policy protocol every backend implements (docs/architecture.md).

A transcript is the episode so far as typed turns: the prompt (the root's
observation), then alternating agent actions and environment observations.
Backends render it their own way (the tiny model with its own format, an HF
model with its chat template) and continue it with ONE agent step: generation
stops after a closing ``</tool_call>`` or ``</answer>`` (or at
``max_new_tokens``). Sampling ``n`` continuations of one transcript computes
the transcript's prefix once and shares it across the ``n`` branches (KV-cache
expansion for tiny/hf, prefix caching for vLLM): a branch never regenerates
its prefix.

Rows and random streams (issue 22). ``sample_rows`` takes ``Rows(transcript, n, seed)``
requests whose ``n`` may differ, and the ``k``-th branch of a request draws from the
stream ``stream_uniforms(seed + k, ...)`` and from nothing else: its tokens depend on its
transcript, its seed and the weights, never on which other rows shared the call or on
the batch size (up to the float reductions of batched matmuls). The rollout engine
(``train.sampling.engine``) gives each row a seed keyed by (tree seed, node, draw). A
backend without a ``sample_rows`` method is called once per branch
(``sample_rows(policy, rows, config)``), which is batch-independent too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
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
class Decoding:
    """How one agent step is decoded: the fields ``SampleConfig`` (one sampling call) and
    ``train.sampling.base.SamplerConfig`` (every step of a tree) share, declared once."""

    max_new_tokens: int = 128
    """Token cap of one agent step."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus mass (in (0, 1])."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class SampleConfig(Decoding):
    """How to sample: ``n`` branches per transcript, and a seed, besides the decoding."""

    n: int = 1
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        super().__post_init__()


@dataclass(frozen=True)
class Rows:
    """``n`` continuations of one transcript; branch ``k`` draws from the stream ``seed + k``."""

    transcript: Transcript
    n: int
    seed: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def stream_uniforms(seeds: np.ndarray, step: int | np.ndarray) -> np.ndarray:
    """The ``step``-th draw of each row's stream: u in [0, 1), float64, shape of ``seeds``.

    A counter-based generator (SplitMix64 of ``seed + (step + 1) * golden``), so a row's
    draws depend on its seed and the token index only, whatever rows share the batch.
    ``step`` is one index for every row or an array of per-row indices (a continuously
    batched decoder's rows are at different tokens of their steps)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64 by design
        counter = (np.asarray(step, dtype=np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
        z = seeds.astype(np.uint64) + counter
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_rows(policy: Policy, rows: Sequence[Rows], config: SampleConfig
                ) -> list[list[Continuation]]:
    """``rows[i].n`` continuations of each request (``config.n`` and ``config.seed`` are
    ignored): one ``policy.sample_rows`` call when the backend has one, else one
    ``policy.sample`` call per branch, branch k seeded ``seed + k`` (batch-independent
    too, but without batching or a shared prefix)."""
    if not rows:
        return []
    method = getattr(policy, "sample_rows", None)
    if callable(method):
        out: list[list[Continuation]] = method(rows, config)
    else:  # branch by branch, so a request split in parts draws what the whole would
        out = [[policy.sample([r.transcript], replace(config, n=1, seed=r.seed + k))[0][0]
                for k in range(r.n)] for r in rows]
    if len(out) != len(rows) or any(len(o) != r.n for o, r in zip(out, rows, strict=True)):
        raise RuntimeError(f"policy returned {[len(o) for o in out]} continuations for "
                           f"requests of n={[r.n for r in rows]}")
    return out


class Decoder(Protocol):
    """A continuously batched decoder (``decoder()`` of a backend that has one, e.g.
    ``HFPolicy``): rows join between steps, each step draws one token for every live
    row, and a row leaves when its agent step ends. The rollout engine uses it instead
    of whole ``sample_rows`` calls, so rows never wait for the slowest row of a call."""

    @property
    def live(self) -> int:
        """Rows still decoding."""
        ...

    @property
    def accepting(self) -> bool:
        """Whether ``add`` may be called now."""
        ...

    def add(self, rows: Sequence[Rows], tags: Sequence[object], config: SampleConfig
            ) -> None:
        """Admit ``rows[i].n`` branches of each request (branch k from the stream
        ``rows[i].seed + k``), tagged ``tags[i]``, sampled by ``config`` (its ``n`` and
        ``seed`` ignored; rows of different configs may share the decoder)."""
        ...

    def step(self) -> list[tuple[object, int, Continuation]]:
        """One token for every live row; ``(tag, k, continuation)`` of each row whose
        step ended."""
        ...


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
