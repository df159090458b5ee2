"""``hf:PATH``: any local transformers causal LM with a chat template (and the ``tiny`` one).

Rendering (``transcript_messages``). A transcript becomes chat messages:
``prompt`` -> ``user``, ``action`` -> ``assistant``, ``observation`` -> ``user``
(default) or ``tool`` (``observation_role="tool"``: the environment's own
``<tool_response>...</tool_response>`` wrapper is removed first, because templates
with a tool role, Qwen2.5's among them, add their own). An optional ``system`` text
and ``tools`` list (OpenAI function format) go to ``apply_chat_template``. The
prompt of one step is the template's rendering with ``add_generation_prompt=True``,
tokenized without extra special tokens; an action's tokens follow it directly.

Sampling (``HFPolicy.sample``), one agent step per transcript:
  1. transcripts are sorted by prompt length and cut into chunks of at most
     ``max_batch`` rows (``len(chunk) * n``);
  2. a chunk's prompts are left-padded into one batch (position ids count real tokens
     only) and prefilled ONCE into a ``DynamicCache``;
  3. for ``n > 1`` the cache and the last logits are expanded to the ``n`` branches
     (``DynamicCache.batch_repeat_interleave``): branch 0 reports the prompt's
     ``prefill_tokens``, branches 1..n-1 report 0, and no branch recomputes its prefix;
  4. each branch draws its tokens by inversion from its own counter-based stream
     (``Rows.seed + k``, ``train.policies.base.stream_uniforms``), so a row's tokens do
     not depend on the other rows of the batch (``sample_rows`` takes requests with
     different ``n``; ``sample`` seeds transcript i from ``config.seed`` and i);
  5. decoding runs one token per forward for every unfinished row; a row finishes when
     its text so far contains a stop string (``</tool_call>``, ``</answer>``) or it
     emits an end-of-sequence token, and finished rows are dropped from the cache
     (``batch_select_indices``).

Prefix cache across calls. The keys/values every row computed (its prompt, and its
prompt plus the step it generated) are kept in a ``PrefixCache`` (``prefix_cache_mib``,
least recently used out; emptied whenever the weights change in place), and a later
prompt is prefilled from its longest cached proper prefix: the next step of a rollout
computes only its new observation (and the re-rendered action when its tokens differ),
not the whole transcript. The row's cached part sits left of its new tokens, with
padding between (masked) and positions continuing the cached ones. The tokens are the
same as with a full prefill (logprobs equal up to float summation order, ~1e-6);
``prefill_tokens`` counts what was computed. ``prefix_cache_mib=0`` turns it off.

Threads. On CPU the constructor sets torch's threads (``configure_threads``):
``$RTREES_THREADS``, else ``$OMP_NUM_THREADS`` as torch read it, else one thread for a
model under ``SMALL_MODEL_PARAMS`` (the tiny model: several threads only spin) and the
usable CPUs (``os.sched_getaffinity``) otherwise.

Per-token values. ``logprobs[i]`` and ``entropies[i]`` are those of the model's
untempered next-token distribution softmax(z), the policy that ``score`` evaluates,
whatever ``temperature`` / ``top_p`` the tokens were drawn with (those two are kept
in ``Continuation.meta``). ``top_p`` always keeps the most likely token, so a tiny
``top_p`` (e.g. 1e-9) is greedy decoding. The text of a continuation is the decoding
of its tokens (a trailing end-of-sequence token is kept in ``token_ids`` but not in
``text``). ``score`` tokenizes the action text: it equals ``sample``'s logprobs for
every continuation whose tokens are the canonical tokenization of its text.
"""

from __future__ import annotations

import copy
import hashlib
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.utils import logging as hf_logging

from train.policies.base import (
    STOP_STRINGS,
    Continuation,
    Rows,
    SampleConfig,
    Transcript,
    stream_uniforms,
)
from train.rundir import DIGESTS_KEY, META_FILE, CheckpointError, read_meta, verify_checkpoint

ObservationRole = Literal["user", "tool"]
_RESPONSE_OPEN, _RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_MASK64 = (1 << 64) - 1


def transcript_messages(transcript: Transcript, observation_role: ObservationRole = "user",
                        system: str | None = None) -> list[dict[str, str]]:
    """Chat messages of a transcript (mapping in the module docstring)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for role, text in transcript:
        if role == "prompt":
            messages.append({"role": "user", "content": text})
        elif role == "action":
            messages.append({"role": "assistant", "content": text})
        elif role == "observation":
            if observation_role == "tool":
                if text.startswith(_RESPONSE_OPEN) and text.endswith(_RESPONSE_CLOSE):
                    text = text[len(_RESPONSE_OPEN):-len(_RESPONSE_CLOSE)]
                messages.append({"role": "tool", "content": text})
            else:
                messages.append({"role": "user", "content": text})
        else:
            raise ValueError(f"unknown turn role {role!r}")
    return messages


@dataclass(frozen=True)
class ChatRenderer:
    """Transcripts to prompt token ids through a tokenizer's chat template (shared by
    the HF and vLLM backends)."""

    tokenizer: Any
    observation_role: ObservationRole = "user"
    system: str | None = None
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; hf:PATH and vllm:PATH "
                             "need a chat model")
        if self.observation_role not in ("user", "tool"):
            raise ValueError(f"observation_role must be 'user' or 'tool', "
                             f"got {self.observation_role!r}")

    def render(self, transcript: Transcript, add_generation_prompt: bool = True) -> str:
        """The chat-template text of a transcript (generation prompt appended)."""
        messages = transcript_messages(transcript, self.observation_role, self.system)
        kwargs: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def prompt_ids(self, transcript: Transcript) -> list[int]:
        """Token ids of the prompt that one step continues."""
        if not transcript:
            raise ValueError("empty transcript: it needs at least the prompt")
        if transcript[-1][0] == "action":
            raise ValueError("the transcript ends with an action; a step continues a "
                             "prompt or an observation")
        return self.encode(self.render(transcript))


def weights_version(path: str | Path) -> str:
    """First 12 hex digits of the sha256 of a checkpoint's safetensors file (of the
    per-file digests, in name order, when the checkpoint is sharded)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    digests = []
    for file in files:
        h = hashlib.sha256()
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digests.append(h.hexdigest())
    if len(digests) == 1:
        return digests[0][:12]
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:12]


def state_dict_version(model: torch.nn.Module) -> str:
    """A hash of in-memory weights (names, shapes, dtypes, bytes), for unsaved models."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "mem-" + h.hexdigest()[:12]


def check_finite(model: torch.nn.Module, where: str | Path) -> None:
    """``CheckpointError`` naming the first parameter or buffer with a NaN or inf."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{where} holds non-finite weights (NaN or inf in {name})")


def recorded_version(path: Path, model: torch.nn.Module, meta: dict[str, Any],
                     as_saved: Callable[[], torch.nn.Module] | None = None) -> str | None:
    """The ``policy_version`` that ``meta`` (a checkpoint's ``rtrees_policy.json``) names,
    once recomputed from the loaded ``model``; None when it names none.

    A version is accepted only when the weights reproduce it: the trainer's
    ``RUN-mem-HASH`` (``state_dict_version``: HASH is recomputed), a bare ``mem-HASH``,
    or the file hash ``weights_version(path)``. ``as_saved`` reloads the weights in
    their saved dtype, for a ``model`` loaded in another one. Anything else (a label the
    weights cannot confirm, or weights edited after it was written) is a
    ``CheckpointError`` naming both versions."""
    version = meta.get("policy_version")
    if version is None:
        return None
    memory = state_dict_version(model)
    if not (isinstance(version, str) and version.endswith(memory)) and as_saved is not None:
        memory = state_dict_version(as_saved())  # the dtype on disk, as the trainer hashed
    if isinstance(version, str) and (version == memory or version.endswith("-" + memory)):
        return version
    try:
        on_disk = weights_version(path)
    except FileNotFoundError:
        on_disk = None
    if isinstance(version, str) and version == on_disk:
        return version
    raise CheckpointError(
        f"{path / META_FILE} names policy version {version!r}, but the weights hash to "
        f"{memory!r} (file hash {on_disk!r}): the weights or the metadata were changed "
        "after the checkpoint was written")


@contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' progress bars off (loading and saving a tiny model is instant)."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


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


def _inverse_cdf(probs: torch.Tensor, uniforms: np.ndarray) -> torch.Tensor:
    """One token per row by inversion: the first index whose cumulative mass exceeds
    u * total. Shapes (R, V), (R,) -> (R,) long. Rows are independent (a row's draw
    depends on its probabilities and its own u only)."""
    cdf = probs.double().cumsum(-1)  # (R, V)
    target = torch.from_numpy(uniforms).to(cdf.device) * cdf[:, -1]
    index = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the nucleus: keep the smallest set of most likely tokens
    whose mass reaches ``top_p`` (the most likely token always stays). Shapes (B, V)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the tokens ranked above
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # rank 0 has before = 0: kept
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


_HASH_MOD = (1 << 61) - 1
_HASH_MUL = 1_000_003


def _prefix_hashes(ids: Sequence[int]) -> list[int]:
    """h[L] = polynomial hash of ids[:L] (L = 0..len(ids))."""
    out = [0]
    h = 0
    for t in ids:
        h = (h * _HASH_MUL + t + 1) % _HASH_MOD
        out.append(h)
    return out


class PrefixCache:
    """Key/value tensors of token sequences computed before, reused as the prefix of later
    prompts (the next step of a rollout continues the transcript its last step ended).

    ``get(ids)`` returns the longest stored sequence that is a proper prefix of ``ids``
    (at least one token is left to compute) with its per-layer (K, V), each (H, L, D);
    least recently used entries go once they hold more than ``max_bytes``. ``stamp`` is
    the weights' in-place version counters: any update of the weights empties the cache.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, int],
                                   tuple[tuple[int, ...], list[Any], int]] = OrderedDict()
        self._lengths: dict[int, int] = {}  # length -> entries of that length
        self.tokens = self.bytes = 0
        self.stamp: tuple[int, ...] | None = None

    def check(self, stamp: tuple[int, ...]) -> None:
        if stamp != self.stamp:
            self._entries.clear()
            self._lengths.clear()
            self.tokens = self.bytes = 0
            self.stamp = stamp

    def get(self, ids: Sequence[int]) -> tuple[int, list[Any] | None]:
        if not self._entries:
            return 0, None
        hashes = _prefix_hashes(ids)
        for length in sorted((n for n in self._lengths if n < len(ids)), reverse=True):
            key = (length, hashes[length])
            entry = self._entries.get(key)
            if entry is not None and entry[0] == tuple(ids[:length]):
                self._entries.move_to_end(key)
                return length, entry[1]
        return 0, None

    def put(self, ids: Sequence[int], layers: list[Any]) -> None:
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in layers)
        if not ids or size > self.max_bytes:
            return
        key = (len(ids), _prefix_hashes(ids)[-1])
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = (tuple(ids), layers, size)
        self._lengths[len(ids)] = self._lengths.get(len(ids), 0) + 1
        self.tokens += len(ids)
        self.bytes += size
        while self.bytes > self.max_bytes:
            (length, _), (_, _, dropped) = self._entries.popitem(last=False)
            self.tokens -= length
            self.bytes -= dropped
            self._lengths[length] -= 1
            if not self._lengths[length]:
                del self._lengths[length]


class HFPolicy:
    """A transformers causal LM behind the ``Policy`` protocol (module docstring).

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
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a transformers checkpoint "
                                    "(no config.json)")
        meta = read_meta(path)  # a training checkpoint names its version and digests
        if meta is not None and DIGESTS_KEY in meta:
            verify_checkpoint(path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            with quiet_progress():
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
        check_finite(model, path)
        model = model.to(device)  # type: ignore[arg-type]  # (transformers' .to stub)
        if "version" not in kw and meta is not None:
            def as_saved() -> torch.nn.Module:
                with quiet_progress():
                    return AutoModelForCausalLM.from_pretrained(
                        path, local_files_only=True, trust_remote_code=False, dtype="auto")

            version = recorded_version(path, model, meta,
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
            self._version = (weights_version(self._ref) if self._ref is not None
                             else state_dict_version(self.model))
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

    def _prefill_inputs(self, prompts: list[list[int]], cache: DynamicCache
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """(ids, attention mask, position ids) of the tokens to prefill, with the longest
        cached prefix of each prompt loaded into ``cache`` first, and the cached lengths.
        Row b's layout is
        ``[pad][cached c_b][pad][suffix s_b]`` (mask 0 on pads); positions continue the
        cached ones, so the suffix sees exactly the context it would see recomputed."""
        pc = self.prefix_cache
        hits: list[tuple[int, list[Any] | None]] = [(0, None)] * len(prompts)
        if pc is not None:
            pc.check(self._weights_stamp())
            hits = [pc.get(p) for p in prompts]
        width = max(c for c, _ in hits)
        if width == 0:
            return (*self._left_pad(prompts), [0] * len(prompts))
        suffixes = [p[c:] for p, (c, _) in zip(prompts, hits, strict=True)]
        s_width = max(len(s) for s in suffixes)
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
        where = mask[row].nonzero().squeeze(1)
        if len(where) < len(seq) or not seq:
            return
        where = where[:len(seq)]
        kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in cache.layers:
            if type(layer) is not DynamicLayer:  # sliding windows etc.: nothing to reuse
                return
            keys, values = getattr(layer, "keys"), getattr(layer, "values")  # noqa: B009
            kv.append((keys[row][:, where], values[row][:, where]))
        self.prefix_cache.put(seq, kv)

    @torch.inference_mode()
    def _sample_chunk(self, prompts: list[list[int]], ns: list[int], seeds: list[int],
                      config: SampleConfig) -> list[list[Continuation]]:
        if any(not p for p in prompts):
            raise ValueError("a transcript rendered to zero tokens")
        cache = DynamicCache(config=self.model.config)
        ids, mask, positions, cached = self._prefill_inputs(prompts, cache)
        # Without padding the causal mask alone is right: passing no attention mask
        # lets attention skip building one at every step (a large part of a tiny
        # model's per-token cost).
        padded = bool((mask == 0).any())
        out = self.model(input_ids=ids, attention_mask=mask if padded else None,
                         position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=1)
        if self.prefix_cache is not None:
            for t, prompt in enumerate(prompts):
                self._remember(prompt, cache, mask, t)
        logits = out.logits[:, -1, :].float()  # (m, V)
        next_pos = mask.sum(-1)  # (m,) position of each row's next token
        if any(n > 1 for n in ns):  # one prefix computation, expanded to the n branches
            if len(set(ns)) == 1:
                cache.batch_repeat_interleave(ns[0])
                expand = torch.arange(len(ns), device=self.device).repeat_interleave(ns[0])
            else:
                expand = torch.repeat_interleave(
                    torch.arange(len(ns), device=self.device),
                    torch.tensor(ns, device=self.device))
                cache.batch_select_indices(expand)
            logits, mask, next_pos = logits[expand], mask[expand], next_pos[expand]
        owner = [t for t, n in enumerate(ns) for _ in range(n)]  # branch -> its request
        branch = [k for n in ns for k in range(n)]
        n_rows = len(owner)
        stream = np.array([(seeds[t] + k) & _MASK64 for t, k in zip(owner, branch,
                                                                     strict=True)],
                          dtype=np.uint64)
        rows = list(range(n_rows))  # active row j -> branch index rows[j]
        tokens: list[list[int]] = [[] for _ in range(n_rows)]
        logprobs: list[list[float]] = [[] for _ in range(n_rows)]
        entropies: list[list[float]] = [[] for _ in range(n_rows)]
        tails = [""] * n_rows  # recent decoded text of each branch, for stop strings
        finished = [False] * n_rows
        token_texts = self.token_texts()
        window = self._stop_window
        for step in range(config.max_new_tokens):
            logp = torch.log_softmax(logits, dim=-1)  # (R, V) untempered policy
            entropy = torch.special.entr(logp.exp()).sum(-1)  # (R,), 0 log 0 = 0
            probs = (torch.softmax(logits / config.temperature, dim=-1)
                     if config.temperature != 1.0 else logp.exp())
            if config.top_p < 1.0:
                probs = _top_p_filter(probs, config.top_p)
            chosen = _inverse_cdf(probs, stream_uniforms(stream[rows], step))  # (R,)
            chosen_lp = logp.gather(1, chosen[:, None]).squeeze(1)
            keep: list[int] = []
            for j, (b, tok, lp, ent) in enumerate(zip(rows, chosen.tolist(), chosen_lp.tolist(),
                                                      entropy.tolist(), strict=True)):
                tokens[b].append(tok)
                logprobs[b].append(lp)
                entropies[b].append(ent)
                # ids past the tokenizer (padded embedding rows of some models) decode to ""
                piece = token_texts[tok] if tok < len(token_texts) else ""
                tail = (tails[b] + piece)[-(window + len(piece)):]
                tails[b] = tail
                if tok in self.eos_ids or any(s in tail for s in self.stop_strings):
                    finished[b] = True
                else:
                    keep.append(j)
            if self.prefix_cache is not None:  # what the rows leaving now computed
                for j in ([j for j in range(len(rows)) if j not in set(keep)]
                          if keep and step < config.max_new_tokens - 1 else range(len(rows))):
                    b = rows[j]
                    self._remember(prompts[owner[b]] + tokens[b][:-1], cache, mask, j)
            if not keep or step == config.max_new_tokens - 1:
                break
            if len(keep) < len(rows):  # drop finished rows from the batch and the cache
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask, next_pos, chosen = mask[index], next_pos[index], chosen[index]
                rows = [rows[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            out = self.model(input_ids=chosen[:, None], attention_mask=mask if padded else None,
                             position_ids=next_pos[:, None], cache=cache, use_cache=True)
            next_pos = next_pos + 1
            logits = out.logits[:, -1, :].float()
        meta = {"temperature": config.temperature, "top_p": config.top_p}
        results: list[list[Continuation]] = [[] for _ in prompts]
        for b in range(n_rows):
            t, k = owner[b], branch[b]
            ids_b = tokens[b]
            text_ids = ids_b[:-1] if ids_b and ids_b[-1] in self.eos_ids else ids_b
            results[t].append(Continuation(
                text=self.tokenizer.decode(text_ids, skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False),
                token_ids=ids_b, logprobs=logprobs[b], entropies=entropies[b],
                finished=finished[b],
                prefill_tokens=len(prompts[t]) - cached[t] if k == 0 else 0,
                meta=dict(meta)))
        return results

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
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                logits_to_keep=keep).logits.float()  # (B, keep, V)
            logp = torch.log_softmax(logits, dim=-1)
            for b, i in enumerate(chunk):
                action = pairs[i][1]
                # action token k sits at column T - a + k; its logits at index keep - a + k - 1
                start_col = keep - len(action) - 1
                rows = logp[b, start_col:start_col + len(action)]
                target = torch.tensor(action, device=self.device)[:, None]
                results[i] = rows.gather(1, target).squeeze(1).double().cpu().numpy()
        return results
