"""``HFPolicy``: a transformers causal LM behind the ``Policy`` protocol (the package
docstring, ``train.policies.hf``), and the torch threads it sets on CPU
(``configure_threads``)."""

from __future__ import annotations

import copy
import hashlib
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from train.policies.base import (
    STOP_STRINGS,
    Continuation,
    Rows,
    SampleConfig,
    Transcript,
)
from train.policies.hf import versions
from train.policies.hf.decode import DecodeBatch, widened
from train.policies.hf.kvcache import BufferLayer, PrefixCache
from train.policies.hf.render import ChatRenderer, ObservationRole
from train.rundir import DIGESTS_KEY, CheckpointError, read_meta, verify_checkpoint

SMALL_MODEL_PARAMS = 20_000_000
"""Below this many parameters a CPU forward is too small to split over threads."""
THREADS_ENV = "RTREES_THREADS"


def usable_cpus() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``: a container's or a
    ``taskset``'s share, not the machine's count)."""
    return max(1, len(os.sched_getaffinity(0)))


def auto_threads(n_params: int, cpus: int | None = None) -> int:
    """Torch threads for a model of ``n_params`` on CPU: 1 for a small model (its
    matmuls are too small to split: extra threads only spin, and on a shared machine
    they burn several times the CPU for the same work), else every usable CPU."""
    cpus = usable_cpus() if cpus is None else cpus
    return 1 if n_params < SMALL_MODEL_PARAMS else max(1, cpus)


def configure_threads(model: torch.nn.Module) -> int:
    """Set torch's intra-op threads for ``model`` on CPU and return them: ``$RTREES_THREADS``
    when set, else ``$OMP_NUM_THREADS`` when set (left as torch read it), else
    ``auto_threads``; never more than the usable CPUs."""
    if os.environ.get(THREADS_ENV):
        threads = int(os.environ[THREADS_ENV])
    elif os.environ.get("OMP_NUM_THREADS"):
        return int(torch.get_num_threads())
    else:
        threads = auto_threads(sum(p.numel() for p in model.parameters()))
    threads = max(1, min(threads, usable_cpus()))
    torch.set_num_threads(threads)
    return threads



def _row_seed(base: int, index: int) -> int:
    """The stream seed of transcript ``index`` of a ``sample`` call seeded ``base``."""
    digest = hashlib.sha256(f"{base}\x1f{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)



class HFPolicy:
    """A transformers causal LM behind the ``Policy`` protocol (the package docstring).

    ``model`` and ``tokenizer`` are loaded objects (``from_pretrained`` loads a
    directory). ``ref`` is the checkpoint path recorded as ``policy_ref``;
    ``version`` overrides the weight hash. ``max_batch`` bounds the rows (branches) of
    one decoding batch. ``stop_strings`` end a step (the protocol's by default;
    benchmarks pass none, and clear ``eos_ids``, to generate a fixed length).
    """

    def __init__(self, model: Any, tokenizer: Any, *, ref: str | None = None,
                 version: str | None = None, observation_role: ObservationRole = "user",
                 system: str | None = None, tools: list[dict[str, Any]] | None = None,
                 max_batch: int = 128, stop_strings: Sequence[str] = STOP_STRINGS,
                 prefix_cache_mib: float = 256.0) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.prefix_cache = PrefixCache(int(prefix_cache_mib * 2**20)) \
            if prefix_cache_mib > 0 else None
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, observation_role, system, tools)
        self.max_batch = max_batch
        self._ref = ref
        self._version = version
        self._token_texts: list[str] | None = None
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            configure_threads(model)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                          else tokenizer.eos_token_id if tokenizer.eos_token_id is not None
                          else 0)
        eos: set[int] = set()
        generation_config = getattr(model, "generation_config", None)
        for source in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id",
                                                       None)):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, list | tuple):
                eos.update(int(x) for x in source)
        self.eos_ids = frozenset(eos)
        self.stop_strings = tuple(stop_strings)
        self._stop_window = max((len(s) for s in self.stop_strings), default=0)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | None = None,
                        dtype: str | torch.dtype | None = None, **kw: Any) -> HFPolicy:
        """Load a local checkpoint directory (model and tokenizer); no downloads, and no
        code from the checkpoint ever runs (``trust_remote_code=False``: an ``auto_map``
        in its config is ignored for a known ``model_type``, refused otherwise).

        A checkpoint whose ``rtrees_policy.json`` records file digests
        (``train.rundir``) is verified first; the loaded weights must be finite; the
        ``policy_version`` that file names is used only if it is recomputed from the
        loaded weights (``recorded_version``). Damage is a ``CheckpointError`` naming
        the file."""
        path = Path(path)
        versions.require_checkpoint_dir(path)
        meta = read_meta(path)  # a training checkpoint names its version and digests
        if meta is not None and DIGESTS_KEY in meta:
            verify_checkpoint(path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            with versions.quiet_progress():
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                          trust_remote_code=False)
                model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                             trust_remote_code=False,
                                                             dtype=dtype or "auto")
        except (OSError, ValueError, KeyError, TypeError, RuntimeError,
                SafetensorError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CheckpointError(f"{path} does not load as a transformers checkpoint "
                                  f"({type(exc).__name__}: {first})") from None
        versions.check_finite(model, path)
        model = model.to(device)  # type: ignore[arg-type]  # (transformers' .to stub)
        if "version" not in kw and meta is not None:
            def as_saved() -> torch.nn.Module:
                with versions.quiet_progress():
                    return AutoModelForCausalLM.from_pretrained(
                        path, local_files_only=True, trust_remote_code=False, dtype="auto")

            version = versions.recorded_version(path, model, meta,
                                                as_saved if dtype not in (None, "auto") else None)
            if version is not None:
                kw["version"] = version
        return cls(model, tokenizer, ref=str(path.resolve()), **kw)

    def published(self, ref: str | None, version: str) -> HFPolicy:
        """This policy (same model object, tokenizer and rendering) under another identity:
        the trainer publishes each weight version as ``policy_version`` / ``policy_ref``."""
        other = copy.copy(self)
        other._ref, other._version = ref, version
        return other

    # ----- identity -------------------------------------------------------------------

    @property
    def policy_version(self) -> str:
        if self._version is None:
            self._version = (versions.weights_version(self._ref) if self._ref is not None
                             else versions.state_dict_version(self.model))
        return self._version

    @property
    def policy_ref(self) -> str | None:
        return self._ref

    # ----- rendering ------------------------------------------------------------------

    def render(self, transcript: Transcript, add_generation_prompt: bool = True) -> str:
        """The chat-template text of a transcript (generation prompt appended)."""
        return self.renderer.render(transcript, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.renderer.encode(text)

    def prompt_ids(self, transcript: Transcript) -> list[int]:
        """Token ids of the prompt that one step continues."""
        return self.renderer.prompt_ids(transcript)

    def token_texts(self) -> list[str]:
        """Each token id decoded alone (stop strings are detected on their concatenation;
        exact for ASCII stop strings without spaces, which ours are)."""
        if self._token_texts is None:
            self._token_texts = list(self.tokenizer.batch_decode(
                [[i] for i in range(len(self.tokenizer))], skip_special_tokens=False,
                clean_up_tokenization_spaces=False))
        return self._token_texts

    # ----- sampling -------------------------------------------------------------------

    def sample(self, transcripts: Sequence[Transcript], config: SampleConfig
               ) -> list[list[Continuation]]:
        """``config.n`` continuations of each transcript, sharing each prefix's KV cache
        (``sample_rows`` with transcript i seeded ``mix(config.seed, i)``)."""
        base = config.seed if config.seed is not None else secrets.randbits(63)
        return self.sample_rows([Rows(t, config.n, _row_seed(base, i))
                                 for i, t in enumerate(transcripts)], config)

    def sample_rows(self, rows: Sequence[Rows], config: SampleConfig
                    ) -> list[list[Continuation]]:
        """``rows[i].n`` continuations of each request in as few batches as ``max_batch``
        allows (transcripts of any lengths, left-padded together); each request's prefix
        is prefilled once and its KV cache expanded to its ``n`` branches, and branch k of
        request i draws from the stream ``rows[i].seed + k`` only (``stream_uniforms``)."""
        prompts = [self.prompt_ids(r.transcript) for r in rows]
        results: list[list[Continuation]] = [[] for _ in prompts]
        for chunk in self._chunks(prompts, [r.n for r in rows]):
            got = self._sample_chunk([prompts[i] for i in chunk], [rows[i].n for i in chunk],
                                     [rows[i].seed for i in chunk], config)
            for i, conts in zip(chunk, got, strict=True):
                results[i] = conts
        return results

    def decoder(self) -> DecodeBatch:
        """An empty continuously batched decoder (``train.policies.base.Decoder``): the
        rollout engine admits rows into it between steps, whatever their
        ``SampleConfig``, so a row that ends its step makes room for another at once
        instead of waiting for the slowest row of a call."""
        return DecodeBatch(self, SampleConfig())

    def _chunks(self, prompts: list[list[int]], ns: Sequence[int]) -> Iterator[list[int]]:
        """Indices of ``prompts`` sorted by length, cut into chunks of <= max_batch rows
        (branches; a request with more branches than that is a chunk of its own)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        chunk: list[int] = []
        rows = 0
        for i in order:
            if chunk and rows + ns[i] > self.max_batch:
                yield chunk
                chunk, rows = [], 0
            chunk.append(i)
            rows += ns[i]
        if chunk:
            yield chunk

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
        """(ids, attention mask, position ids), each (B, T), real tokens right-aligned."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            if row:
                ids[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
                mask[b, width - len(row):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return ids.to(self.device), mask.to(self.device), positions.to(self.device)

    def _weights_stamp(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.model.parameters())

    def cached_prefixes(self, prompts: Sequence[list[int]]
                        ) -> list[tuple[int, list[Any] | None]]:
        """Each prompt's longest cached proper prefix: (its length, its per-layer keys and
        values), (0, None) without one."""
        pc = self.prefix_cache
        if pc is None:
            return [(0, None)] * len(prompts)
        pc.check(self._weights_stamp())
        return [pc.get(p) for p in prompts]

    def _prefill_inputs(self, prompts: list[list[int]], cache: DynamicCache, extra: int = 0,
                        hits: Sequence[tuple[int, list[Any] | None]] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """(ids, attention mask, position ids) of the tokens to prefill, with the longest
        cached prefix of each prompt (``hits``, default ``cached_prefixes``) loaded into
        ``cache`` first (its ``BufferLayer``s sized for the prompts and ``extra`` new
        tokens), and the cached lengths. Row b's layout is ``[pad][cached c_b][pad][suffix
        s_b]`` (mask 0 on pads); positions continue the cached ones, so the suffix sees
        exactly the context it would see recomputed."""
        hits = self.cached_prefixes(prompts) if hits is None else hits
        width = max(c for c, _ in hits)
        suffixes = [p[c:] for p, (c, _) in zip(prompts, hits, strict=True)]
        s_width = max(len(s) for s in suffixes)
        for buffered in cache.layers:  # room for the prompt and ``extra`` new tokens
            if isinstance(buffered, BufferLayer):
                buffered.capacity = width + s_width + extra
        if width == 0:
            return (*self._left_pad(prompts), [0] * len(prompts))
        m = len(prompts)
        ids = torch.full((m, s_width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((m, width + s_width), dtype=torch.long)
        positions = torch.zeros((m, s_width), dtype=torch.long)
        for b, (suffix, (c, _)) in enumerate(zip(suffixes, hits, strict=True)):
            ids[b, s_width - len(suffix):] = torch.tensor(suffix, dtype=torch.long)
            mask[b, width - c:width] = 1
            mask[b, width + s_width - len(suffix):] = 1
            positions[b, s_width - len(suffix):] = torch.arange(c, c + len(suffix))
        layers = len(next(kv for _, kv in hits if kv is not None))
        for layer in range(layers):
            ref_k, ref_v = next(kv for _, kv in hits if kv is not None)[layer]
            keys = ref_k.new_zeros((m, ref_k.shape[0], width, ref_k.shape[2]))
            values = ref_v.new_zeros((m, ref_v.shape[0], width, ref_v.shape[2]))
            for b, (c, kv) in enumerate(hits):
                if kv is not None:
                    keys[b, :, width - c:] = kv[layer][0]
                    values[b, :, width - c:] = kv[layer][1]
            cache.update(keys, values, layer)
        return (ids.to(self.device), mask.to(self.device), positions.to(self.device),
                [c for c, _ in hits])

    def _remember(self, seq: list[int], cache: DynamicCache, mask: torch.Tensor, row: int
                  ) -> None:
        """Store row ``row``'s keys/values of ``seq`` (its real positions, in order)."""
        assert self.prefix_cache is not None
        if not seq:
            return
        key = self.prefix_cache.key(seq)
        if self.prefix_cache.holds(seq, key):
            return
        where = mask[row].nonzero().squeeze(1)
        if len(where) < len(seq):
            return
        where = where[:len(seq)]
        first = int(where[0])
        # a row's real positions are one run of columns (a slice copies faster than a
        # gather); anything else is gathered
        at: slice | torch.Tensor = (slice(first, first + len(seq))
                                    if int(where[-1]) - first + 1 == len(seq) else where)
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in cache.layers:
            if type(layer) not in (DynamicLayer, BufferLayer):  # sliding windows etc.
                return
            keys, values = getattr(layer, "keys"), getattr(layer, "values")  # noqa: B009
            k, v = keys[row][:, at], values[row][:, at]
            kv.append((k.clone(), v.clone()) if isinstance(at, slice) else (k, v))
        self.prefix_cache.put(seq, kv, key)

    def _sample_chunk(self, prompts: list[list[int]], ns: list[int], seeds: list[int],
                      config: SampleConfig) -> list[list[Continuation]]:
        """One batch (``DecodeBatch``) decoded until every row's step ended."""
        batch = DecodeBatch(self, config, prompts, ns, seeds)
        results: list[list[Continuation | None]] = [[None] * n for n in ns]
        while batch.live:
            for t, k, cont in batch.step():
                results[t][k] = cont
        return [[c for c in conts if c is not None] for conts in results]

    # ----- scoring --------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, transcripts: Sequence[Transcript], actions: Sequence[str]
              ) -> list[np.ndarray]:
        """log pi(action tokens | transcript), float64, one array per pair."""
        if len(transcripts) != len(actions):
            raise ValueError(f"{len(transcripts)} transcripts but {len(actions)} actions")
        pairs = [(self.prompt_ids(t), self.encode(a)) for t, a in zip(transcripts, actions,
                                                                     strict=True)]
        results: list[np.ndarray] = [np.zeros(0, dtype=np.float64) for _ in pairs]
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
        for start in range(0, len(order), self.max_batch):
            chunk = [i for i in order[start:start + self.max_batch] if pairs[i][1]]
            if not chunk:
                continue
            ids, mask, positions = self._left_pad([pairs[i][0] + pairs[i][1] for i in chunk])
            keep = max(len(pairs[i][1]) for i in chunk) + 1
            logits = widened(self.model(input_ids=ids, attention_mask=mask,
                                        position_ids=positions,
                                        logits_to_keep=keep).logits)  # (B, keep, V)
            logp = torch.log_softmax(logits, dim=-1)
            for b, i in enumerate(chunk):
                action = pairs[i][1]
                # action token k sits at column T - a + k; its logits at index keep - a + k - 1
                start_col = keep - len(action) - 1
                rows = logp[b, start_col:start_col + len(action)]
                target = torch.tensor(action, device=self.device)[:, None]
                results[i] = rows.gather(1, target).squeeze(1).double().cpu().numpy()
        return results
