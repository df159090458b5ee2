"""``vllm:PATH``: a vLLM engine with automatic prefix caching, imported lazily.

``vllm`` is an optional dependency (``pip install 'rollout-trees[gpu]'``); this
module imports without it and ``VLLMPolicy`` raises ``PolicyUnavailableError``
naming that command when it is missing. Written against the vLLM V1 engine
(``vllm>=0.10.2``, which has ``logprobs_mode``); it needs a GPU, so the CPU test
suite only checks that it is optional. On a GPU, check it against ``hf:PATH`` on the
same checkpoint: greedy texts equal, ``sample`` logprobs and ``score`` equal to the
HF backend's ``score`` (``dtype="float32"``), ``prefill_tokens`` of a repeated
transcript reduced by the prefix cache, every finished text ending in a stop string.

Same protocol and rendering as ``hf:PATH`` (``train.policies.hf.ChatRenderer``:
prompt -> user, action -> assistant, observation -> user or tool); prompts go to
the engine as token ids (``{"prompt_token_ids": ...}``), so both backends see the
same tokens.

* Shared prefixes: the engine runs with ``enable_prefix_caching=True``; ``n``
  branches are one request with ``SamplingParams(n=...)``, and a transcript whose
  prefix was computed by an earlier call (the parent node of a tree) hits the cache.
  ``prefill_tokens`` of branch 0 is the prompt length minus the request's
  ``num_cached_tokens``; the other branches report 0.
* Batches: ``sample_rows`` sends the rollout engine's whole wavefront (every tree's
  requests, with their own ``n`` and row seeds) in one ``generate`` call.
* Stops: ``stop=["</tool_call>", "</answer>"]`` with ``include_stop_str_in_output``;
  ``text`` is re-decoded from ``token_ids`` (vLLM cuts its text at the stop string,
  which may end inside the last token), as in the HF backend.
* Logprobs: ``logprobs_mode="raw_logprobs"`` (the engine default), i.e. the
  untempered model distribution, like ``score`` and the HF backend. ``logprobs=k``
  (``entropy_topk``, default 20 = vLLM's ``max_logprobs``) also returns the top-k
  alternatives, from which ``entropies`` are computed as
  ``-sum_topk p log p - r log r`` with ``r`` the mass outside the top k: a lower bound
  on the exact entropy (exact when the top k hold all the mass); ``meta`` carries
  ``entropy_topk``. ``entropy_topk=-1`` asks for the whole vocabulary (exact, slow;
  needs ``max_logprobs=-1``).
* ``score`` asks for ``prompt_logprobs=0`` on prompt + action with ``max_tokens=1``;
  vLLM recomputes such prompts instead of reading the prefix cache (prompt logprobs
  are not cached), so scoring is correct but does not reuse prefixes.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from train.policies.base import STOP_STRINGS, Continuation, Rows, SampleConfig, Transcript
from train.policies.errors import INSTALL_HINT, PolicyUnavailableError
from train.policies.hf import (
    ChatRenderer,
    ObservationRole,
    require_checkpoint_dir,
    weights_version,
)
from train.rundir import DIGESTS_KEY, read_meta, verify_checkpoint


def import_vllm() -> Any:
    """The ``vllm`` module, or ``PolicyUnavailableError`` naming the install command."""
    try:
        import vllm  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise PolicyUnavailableError(
            f"the vllm backend needs vLLM and a GPU: {INSTALL_HINT} ({exc})") from None
    return vllm


def topk_entropy(logprobs: Sequence[float]) -> float:
    """-sum p log p over the given (top-k) logprobs plus -r log r for the rest mass r."""
    probs = [math.exp(lp) for lp in logprobs if lp > -math.inf]
    entropy = -sum(p * math.log(p) for p in probs if p > 0.0)
    rest = max(0.0, 1.0 - sum(probs))
    return entropy - rest * math.log(rest) if rest > 1e-12 else entropy


class VLLMPolicy:
    """A vLLM ``LLM`` behind the ``Policy`` protocol (module docstring).

    ``engine_kw`` go to ``vllm.LLM`` (``gpu_memory_utilization``, ``dtype``,
    ``max_model_len``, ``tensor_parallel_size``, ...).
    """

    def __init__(self, path: str | Path, *, observation_role: ObservationRole = "user",
                 system: str | None = None, tools: list[dict[str, Any]] | None = None,
                 entropy_topk: int = 20, **engine_kw: Any) -> None:
        vllm = import_vllm()
        from transformers import AutoTokenizer

        self.path = Path(path)
        require_checkpoint_dir(self.path)
        if entropy_topk == 0 or entropy_topk < -1:
            raise ValueError(f"entropy_topk must be >= 1 or -1 (all), got {entropy_topk}")
        self.entropy_topk = entropy_topk
        meta = read_meta(self.path)
        if meta is not None and DIGESTS_KEY in meta:  # a checkpoint written by rtrees
            verify_checkpoint(self.path)
        # no code from the checkpoint ever runs (an auto_map in its config is not followed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True,
                                                       trust_remote_code=False)
        engine_kw["trust_remote_code"] = False
        self.renderer = ChatRenderer(self.tokenizer, observation_role, system, tools)
        engine_kw.setdefault("logprobs_mode", "raw_logprobs")
        if entropy_topk == -1:
            engine_kw.setdefault("max_logprobs", -1)
        self.llm = vllm.LLM(model=str(self.path), enable_prefix_caching=True, **engine_kw)
        self._sampling_params = vllm.SamplingParams
        self._version: str | None = None
        eos = self.tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else [])

    @property
    def policy_version(self) -> str:
        if self._version is None:
            self._version = weights_version(self.path)
        return self._version

    @property
    def policy_ref(self) -> str | None:
        return str(self.path.resolve())

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        """``config.n`` continuations of each transcript (``sample_rows``; transcript i is
        seeded ``config.seed + i * n``, so every branch of the call has its own stream)."""
        base = config.seed if config.seed is not None else secrets.randbits(62)
        return self.sample_rows([Rows(t, config.n, base + i * config.n)
                                 for i, t in enumerate(transcripts)], config)

    def sample_rows(self, rows: Sequence[Rows], config: SampleConfig
                    ) -> list[list[Continuation]]:
        """Every request in ONE ``generate`` call (the engine's whole wavefront; the prefix
        cache shares what the requests have in common). A request is one vLLM request
        with ``n`` = its branches and ``seed`` = its seed: vLLM seeds child k with
        seed + k, the stream convention of ``train.policies.base.Rows``."""
        prompts = [self.renderer.prompt_ids(r.transcript) for r in rows]
        params = [self._sampling_params(
            n=r.n, temperature=config.temperature, top_p=config.top_p,
            max_tokens=config.max_new_tokens, stop=list(STOP_STRINGS),
            include_stop_str_in_output=True, logprobs=self.entropy_topk, seed=r.seed)
            for r in rows]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
        meta = {"temperature": config.temperature, "top_p": config.top_p,
                "entropy_topk": float(self.entropy_topk)}
        results = []
        for prompt, request in zip(prompts, outputs, strict=True):
            cached = int(getattr(request, "num_cached_tokens", 0) or 0)
            conts = []
            for k, out in enumerate(sorted(request.outputs, key=lambda o: o.index)):
                ids = [int(t) for t in out.token_ids]
                logprobs, entropies = [], []
                for tok, alternatives in zip(ids, out.logprobs or [], strict=True):
                    logprobs.append(float(alternatives[tok].logprob))
                    entropies.append(topk_entropy([float(a.logprob)
                                                   for a in alternatives.values()]))
                text_ids = ids[:-1] if ids and ids[-1] in self.eos_ids else ids
                conts.append(Continuation(
                    text=str(self.tokenizer.decode(text_ids, skip_special_tokens=False,
                                                   clean_up_tokenization_spaces=False)),
                    token_ids=ids, logprobs=logprobs, entropies=entropies,
                    finished=out.finish_reason == "stop",
                    prefill_tokens=max(0, len(prompt) - cached) if k == 0 else 0,
                    meta=dict(meta)))
            results.append(conts)
        return results

    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        if len(transcripts) != len(actions):
            raise ValueError(f"{len(transcripts)} transcripts but {len(actions)} actions")
        pairs = [(self.renderer.prompt_ids(t), self.renderer.encode(a))
                 for t, a in zip(transcripts, actions, strict=True)]
        todo = [i for i, (_, action) in enumerate(pairs) if action]
        results = [np.zeros(0, dtype=np.float64) for _ in pairs]
        if not todo:
            return results
        params = self._sampling_params(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate(
            [{"prompt_token_ids": pairs[i][0] + pairs[i][1]} for i in todo], params,
            use_tqdm=False)
        for i, request in zip(todo, outputs, strict=True):
            prompt, action = pairs[i]
            entries = request.prompt_logprobs[len(prompt):]
            results[i] = np.array([float(entry[tok].logprob)
                                   for tok, entry in zip(action, entries, strict=True)],
                                  dtype=np.float64)
        return results
