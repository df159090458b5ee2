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
     emits an end-of-sequence token (``DecodeBatch``). Keys/values grow in place in
     preallocated buffers (``BufferLayer``: no copy of the whole cache per token), and
     finished rows stay in the batch, fed padding, until fewer than ``COMPACT_BELOW`` of
     it (or at most ``FEW_ROWS`` rows) are live; then the cache is compacted
     (``batch_select_indices``). The tokens and logprobs are the same bits as dropping
     each finished row at once (one torch thread).

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
from dataclasses import dataclass, field
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


# A chat template that writes each message as ``<|role|>`` + content and ends with
# ``<|assistant|>`` to generate: the tiny policy's (``train.policies.tiny``). Its rendering
# is a concatenation of per-message pieces, each starting with a role token.
ROLE_CONCAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
PIECE_CACHE_ENTRIES = 65_536  # per renderer; cleared when full


@dataclass(frozen=True)
class ChatRenderer:
    """Transcripts to prompt token ids through a tokenizer's chat template (shared by
    the HF and vLLM backends).

    Fast path (``piecewise``): with ``ROLE_CONCAT_TEMPLATE``, no system text and no
    tools, the prompt ids of a transcript are the concatenation of each message's ids,
    ``ids(<|r1|>c1 <|r2|>c2 ... <|assistant|>) = ids(<|r1|>c1) + ids(<|r2|>c2) + ... +
    ids(<|assistant|>)``, with each piece's ids cached. This is exact when every role
    token is an added token that no other added token contains and that no text
    before it can merge into; construction checks that on the tokenizer and on a probe
    transcript, and otherwise renders and tokenizes the whole transcript each time
    (as every other template does: a step re-tokenizes its whole transcript).
    """

    tokenizer: Any
    observation_role: ObservationRole = "user"
    system: str | None = None
    tools: list[dict[str, Any]] | None = None

    piecewise: bool = field(init=False, default=False)
    _pieces: dict[tuple[str, str], list[int]] = field(init=False, default_factory=dict,
                                                      repr=False, compare=False)

    def __post_init__(self) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; hf:PATH and vllm:PATH "
                             "need a chat model")
        if self.observation_role not in ("user", "tool"):
            raise ValueError(f"observation_role must be 'user' or 'tool', "
                             f"got {self.observation_role!r}")
        object.__setattr__(self, "piecewise", self._piecewise_exact())

    def _piecewise_exact(self) -> bool:
        """Whether the fast path of the class docstring gives the template's ids."""
        if (str(self.tokenizer.chat_template).strip() != ROLE_CONCAT_TEMPLATE
                or self.system is not None or self.tools):
            return False
        roles = {f"<|{r}|>" for r in ("user", "assistant", "tool")}
        added = {str(t.content): t for t in
                 getattr(self.tokenizer, "added_tokens_decoder", {}).values()}
        for role in roles:
            token = added.get(role)
            if token is None or token.lstrip or token.rstrip:
                return False
            # another added token could match across a piece boundary: one with a proper
            # suffix that begins a role token (or that holds one)
            if any(role.startswith(other[k:]) or other[k:].startswith(role)
                   for other in added if other not in roles for k in range(1, len(other))):
                return False
        probe: Transcript = [("prompt", "a <b> c\n"), ("action", " x y"),
                             ("observation", "\n<tool_response>1</tool_response> "),
                             ("action", "<answer>2</answer>"), ("observation", "")]
        for end in range(1, len(probe) + 1):
            if probe[end - 1][0] == "action":
                continue
            whole = self.encode(self.render(probe[:end]))
            if whole != self._piece_ids(probe[:end]):
                return False
        return True

    def _piece_ids(self, transcript: Transcript) -> list[int]:
        """The fast path's ids: each message's cached ids, then ``<|assistant|>``'s."""
        if len(self._pieces) > PIECE_CACHE_ENTRIES:
            self._pieces.clear()
        ids: list[int] = []
        for message in [*transcript_messages(transcript, self.observation_role),
                        {"role": "assistant", "content": ""}]:
            key = (message["role"], message["content"])
            piece = self._pieces.get(key)
            if piece is None:
                piece = self.encode(f"<|{key[0]}|>{key[1]}")
                self._pieces[key] = piece
            ids += piece
        return ids

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
        if self.piecewise:
            return self._piece_ids(transcript)
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


COMPACT_BELOW = 0.5
"""Decoding compacts its batch (and KV cache) to the live rows once fewer than this
fraction of its positions are still decoding (``HFPolicy._sample_chunk``)."""
FEW_ROWS = 3
"""... or once at most this many are: CPU BLAS multiplies a batch of 1-3 rows with
another kernel (matrix-vector) than a larger one, in another summation order (measured
with torch's CPU linear: rows of a 1-3 row product differ in the last bits from the same
rows in a product of 4 or more, and agree bit for bit for any size from 4 up). Compacting
exactly then makes every row meet the kernel it met when finished rows were dropped at
once, so the lazy compaction gives the same bits as the eager one: with one torch thread
(the tiny model's, ``auto_threads``); with several, BLAS splits a product's rows over the
threads by batch size and the last bits depend on the batch anyway."""

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


def widened(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` at float32 or wider: a bfloat16/float16 model's are cast up, a float64
    model's stay float64 (its sampling and logprobs keep its precision)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


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

    @staticmethod
    def key(ids: Sequence[int]) -> tuple[int, int]:
        """The entry key of ``ids``: its length and its hash."""
        return len(ids), _prefix_hashes(ids)[-1]

    def holds(self, ids: Sequence[int], key: tuple[int, int] | None = None) -> bool:
        """Whether ``ids`` (entry key ``key``, computed if None) is stored; then it becomes
        the most recently used. A caller skips copying keys the cache already has (rows of
        a group often end a step with the same tokens)."""
        key = key or self.key(ids)
        entry = self._entries.get(key)
        if entry is None or entry[0] != tuple(ids):
            return False
        self._entries.move_to_end(key)
        return True

    def put(self, ids: Sequence[int], layers: list[Any],
            key: tuple[int, int] | None = None) -> None:
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in layers)
        if not ids or size > self.max_bytes:
            return
        key = key or self.key(ids)
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


class BufferLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values live in a preallocated buffer.

    ``DynamicLayer.update`` grows K and V by ``torch.cat`` at every step, copying the
    whole cache (B, H, L, D) per token: O(L) per step and O(L^2) per decode. Here the
    buffer holds ``capacity`` positions, the L in use start at column ``offset``,
    ``update`` writes the new positions in place after them and ``keys`` / ``values``
    are the views ``buffer[:, :, offset:offset + L]``, so attention reads exactly the
    same L keys as with ``torch.cat`` (the same numbers, bit for bit); the buffer is
    reallocated (doubled) only when a write would pass its end. Positions in use are
    never written again, so a view taken earlier stays valid. The buffers may hold more
    batch rows than the ``rows`` in use: ``batch_select_indices`` moves the selected
    rows to the front in place when they fit (else, as ``batch_repeat_interleave``
    expanding a prefill, it copies them into new buffers), and ``grow_rows`` hands out
    zeroed rows, doubling the row capacity when it runs out. A running batch that rows
    join (``DecodeBatch``) also moves the start: ``pad_left`` takes zeroed columns from
    the room before ``offset`` (reallocating only when there is too little) and
    ``drop_left`` advances it, neither copying the cache.
    """

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.offset = 0
        self.rows = 0  # batch rows in use (the buffers may hold more: ``grow_rows``)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def _alloc(self, like_k: torch.Tensor, like_v: torch.Tensor, rows: int, capacity: int,
               offset: int = 0, row_capacity: int = 0) -> None:
        """New buffers of ``max(rows, row_capacity)`` rows and ``capacity`` columns, the
        used ones of the rows in use copied to start at ``offset``; the columns before it
        zeroed (``pad_left`` hands them out)."""
        self.capacity = capacity
        shape_k = (max(rows, row_capacity), like_k.shape[1], capacity, like_k.shape[3])
        shape_v = (max(rows, row_capacity), like_v.shape[1], capacity, like_v.shape[3])
        k, v = like_k.new_empty(shape_k), like_v.new_empty(shape_v)
        if offset:
            k[:, :, :offset] = 0
            v[:, :, :offset] = 0
        if self._k is not None and self._v is not None and self.length:
            keep = min(rows, self.rows)
            k[:keep, :, offset:offset + self.length] = self._k[:keep, :, self._used()]
            v[:keep, :, offset:offset + self.length] = self._v[:keep, :, self._used()]
        self._k, self._v, self.offset, self.rows = k, v, offset, rows

    def _used(self) -> slice:
        return slice(self.offset, self.offset + self.length)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._k is not None and self._v is not None
        keys = self._k[:self.rows, :, self._used()]
        values = self._v[:self.rows, :, self._used()]
        self.keys, self.values = keys, values
        return keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.device = key_states.device
            self.is_initialized = True
        end = self.offset + self.length + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            # the room kept before the used columns is at most their number (columns
            # dropped by ``drop_left`` are not carried over forever)
            room = min(self.offset, self.length)
            self._alloc(key_states, value_states, key_states.shape[0],
                        room + max(end - self.offset, self.capacity - self.offset,
                                   2 * (self._k.shape[-2] - self.offset
                                        if self._k is not None else 0)),
                        room, self._k.shape[0] if self._k is not None else 0)
        assert self._k is not None and self._v is not None
        start = self.offset + self.length
        self._k[:self.rows, :, start:start + key_states.shape[-2]] = key_states
        self._v[:self.rows, :, start:start + key_states.shape[-2]] = value_states
        self.length += key_states.shape[-2]
        return self._views()

    def get_seq_length(self) -> int:
        return self.length

    def _reindex(self, index: torch.Tensor) -> None:
        """Rows ``index`` of the rows in use become the rows in use: in place when they
        fit the buffers (a running batch shrunk to its live rows grows again without a new
        allocation), else in new buffers (a prefill expanded to its branches)."""
        if self._k is None or self._v is None or not self.length:
            return
        n, used = len(index), self._used()
        if n <= self._k.shape[0]:
            keys = self._k[:, :, used][index]  # (n, H, L, D): a copy, so no aliasing
            values = self._v[:, :, used][index]
            self._k[:n, :, used] = keys
            self._v[:n, :, used] = values
            self.rows = n
            self._views()
            return
        k = self._k.new_empty((n, *self._k.shape[1:]))
        v = self._v.new_empty((n, *self._v.shape[1:]))
        torch.index_select(self._k[:self.rows, :, used], 0, index, out=k[:, :, used])
        torch.index_select(self._v[:self.rows, :, used], 0, index, out=v[:, :, used])
        if self.offset:
            k[:, :, :self.offset] = 0
            v[:, :, :self.offset] = 0
        self._k, self._v, self.rows = k, v, n
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(indices.to(self.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is not None:
            self._reindex(torch.arange(self.rows, device=self.device
                                       ).repeat_interleave(repeats))

    # ----- rows joining a running batch (``DecodeBatch.admit``) ------------------------

    def grow_rows(self, extra: int) -> None:
        """``extra`` more batch rows at the end, their keys zero (never uninitialised
        memory: a masked key still enters q.k, and NaN times a zero weight is NaN); the
        buffers are reallocated only when their row capacity is used up, then doubled."""
        assert self._k is not None and self._v is not None
        rows, end = self.rows, self.offset + self.length
        if rows + extra > self._k.shape[0]:
            self._alloc(self._k, self._v, rows, self._k.shape[-2], self.offset,
                        max(rows + extra, 2 * self._k.shape[0]))
            assert self._k is not None and self._v is not None
        self._k[rows:rows + extra, :, :end] = 0
        self._v[rows:rows + extra, :, :end] = 0
        self.rows = rows + extra
        self._views()

    def pad_left(self, columns: int) -> None:
        """``columns`` zero positions before every row's keys (the batch's mask moves the
        same way): from the room before ``offset``, else a new buffer with as much room
        again as it has columns."""
        assert self._k is not None and self._v is not None
        if columns > self.offset:
            room = columns + self.offset + self.length
            self._alloc(self._k, self._v, self.rows,
                        room + self._k.shape[-2] - self.offset, room, self._k.shape[0])
            assert self._k is not None and self._v is not None
        self.offset -= columns
        self._k[:, :, self.offset:self.offset + columns] = 0
        self._v[:, :, self.offset:self.offset + columns] = 0
        self.length += columns
        self._views()

    def drop_left(self, columns: int) -> None:
        """Forget the first ``columns`` positions of every row (no live row has a key
        there)."""
        self.offset += columns
        self.length -= columns
        self._views()

    def place(self, rows: torch.Tensor, columns: torch.Tensor, source: BufferLayer,
              source_rows: torch.Tensor, source_columns: torch.Tensor) -> None:
        """Copy ``source``'s keys/values at (source_rows[i], source_columns[i]) to
        (rows[i], columns[i]), columns counted from each layer's first used one; all
        index tensors (N,), long."""
        assert self._k is not None and self._v is not None
        assert source._k is not None and source._v is not None
        self._k[rows, :, columns + self.offset] = source._k[source_rows, :,
                                                            source_columns + source.offset]
        self._v[rows, :, columns + self.offset] = source._v[source_rows, :,
                                                            source_columns + source.offset]

    def reset(self) -> None:
        self._k = self._v = None
        self.length = self.offset = self.rows = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove and self.length:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()


def require_checkpoint_dir(path: Path) -> None:
    """``FileNotFoundError`` unless ``path`` holds a transformers ``config.json`` (the first
    check of every loader of a transformers checkpoint)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a transformers checkpoint (no config.json)")


def buffered_cache(config: Any, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose plain (full-attention) layers are
    ``BufferLayer``s of ``capacity`` positions (sliding-window and other layer kinds
    stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [BufferLayer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


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
        require_checkpoint_dir(path)
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


@dataclass
class _Branch:
    """One row of a ``DecodeBatch``: its requester's tag, branch, stream, first cache
    column, and what it drew so far."""

    request: Any
    k: int
    prompt: list[int]
    stream: int
    prefill_tokens: int
    config: SampleConfig
    start: int = 0  # the first cache column holding one of its keys
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    tail: str = ""  # recent decoded text, for stop strings


def _sampling_probs(logits: torch.Tensor, logp: torch.Tensor,
                    settings: Sequence[tuple[float, float]]) -> torch.Tensor:
    """The distribution each row draws from, (R, V): softmax(z / temperature), then the
    ``top_p`` nucleus, per row's ``(temperature, top_p)`` (rows of one setting computed
    together; ``logp`` is log softmax(z), reused at temperature 1)."""

    def one(z: torch.Tensor, lp: torch.Tensor, temperature: float, top_p: float
            ) -> torch.Tensor:
        probs = torch.softmax(z / temperature, dim=-1) if temperature != 1.0 else lp.exp()
        return _top_p_filter(probs, top_p) if top_p < 1.0 else probs

    kinds = sorted(set(settings))
    if len(kinds) == 1:
        return one(logits, logp, *kinds[0])
    probs = torch.empty_like(logp)
    for kind in kinds:
        index = torch.tensor([i for i, s in enumerate(settings) if s == kind],
                             device=logits.device)
        probs[index] = one(logits[index], logp[index], *kind)
    return probs


def _similar_suffixes(lengths: Sequence[int]) -> list[list[int]]:
    """Indices of ``lengths`` (tokens each prompt still has to compute) in groups of
    similar length, shortest first: a group's longest is at most twice its shortest
    plus 8. One padded prefill per group instead of one for all: a prefill forward
    computes every row at the longest suffix's width."""
    groups: list[list[int]] = []
    first = 0
    for t in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if not groups or lengths[t] > 2 * first + 8:
            groups.append([])
            first = lengths[t]
        groups[-1].append(t)
    return groups


DROP_COLUMNS_FROM = 32
"""A running batch forgets its leading cache columns once no live row has a key in the
first ``DROP_COLUMNS_FROM`` of them and they are at least a quarter of its width:
attention reads rows x width keys per token (every row decodes at the batch's last
column), and dropping costs no copy (``BufferLayer.drop_left``)."""


class DecodeBatch:
    """The decoding batch of ``HFPolicy`` (steps 2-5 of the module docstring), continuous.

    ``admit(prompts, ns, seeds, tags)`` prefills the prompts (their longest cached
    prefixes first), each prefix once, expands each to its ``n`` branches and adds the
    branches to the batch; ``step()`` draws one token for every live row (branch k of
    request t from the stream ``seeds[t] + k``, the row's j-th token with
    ``stream_uniforms(., j)``), runs one forward and returns ``(tag, k, Continuation)``
    for each row whose step ended (a stop string, an end-of-sequence token, or
    ``max_new_tokens``). Rows may be admitted between any two steps (continuous
    batching, the rollout engine's ``decoder``): an admission splits its prompts into
    groups of similar uncomputed-suffix length (``_similar_suffixes``); into a batch with
    no live row the first group is laid out as one prefill (left-padded), and every other
    group is prefilled in a batch of its own whose rows' keys are copied into free
    positions of this one, right-aligned at the current column (their positions continue
    their own count; the columns left of them are masked). A row's numbers depend on its
    prompt, its stream and the weights; which rows share its steps changes only the float
    reductions of the batched matmuls.

    Cost per token. Keys/values live in ``BufferLayer`` buffers (written in place, no
    ``torch.cat`` of the whole cache per token), the mask is preallocated ahead of the
    current column. A finished row stays in the batch (fed padding, its outputs unused)
    until its position is given to an admitted row or fewer than ``COMPACT_BELOW`` of
    the positions, or at most ``FEW_ROWS``, are live; only then are cache and mask
    compacted to the live rows (one copy instead of one per finishing step). Leading
    columns no live row uses are dropped once rows have joined (``DROP_COLUMNS_FROM``).
    Without rows joining after the first prefill, every live row sees the same keys and
    meets the same matmul kernels as when finished rows were dropped at once, so the
    numbers are the same bits.
    """

    def __init__(self, policy: HFPolicy, config: SampleConfig,
                 prompts: Sequence[list[int]] = (), ns: Sequence[int] = (),
                 seeds: Sequence[int] = (), tags: Sequence[Any] | None = None) -> None:
        self.policy = policy
        self.config = config  # the default of ``admit``; each row keeps its own
        self.slots: list[_Branch] = []  # batch position -> its row (finished ones too)
        self.live_pos: list[int] = []  # positions still decoding, ascending
        self.cache: DynamicCache = buffered_cache(policy.model.config, 0)
        self.logits = torch.empty(0)  # (positions, V) next-token logits
        self.next_pos = torch.empty(0, dtype=torch.long)  # (positions,)
        # (positions, >= col0 + width + 1): column col0 + j of the mask is cache column j
        self.mask = torch.empty(0, dtype=torch.long)
        self.col0 = 0
        self.width = 0  # columns in use (the cache length)
        self.padded = False  # whether any position has a masked column
        self.merged = False  # whether rows joined while others decoded
        if prompts:
            self.admit(prompts, ns, seeds, tags)

    @property
    def live(self) -> int:
        return len(self.live_pos)

    @property
    def accepting(self) -> bool:
        """Whether rows can be admitted now: always into a batch with no live row, and
        into a running one when every cache layer is a ``BufferLayer`` (sliding-window
        and other layer kinds cannot be re-laid out)."""
        return not self.live_pos or self._joinable

    @property
    def _joinable(self) -> bool:
        """Whether every cache layer is a ``BufferLayer`` (rows of another prefill can be
        merged in)."""
        return all(isinstance(layer, BufferLayer) for layer in self.cache.layers)

    def add(self, rows: Sequence[Rows], tags: Sequence[Any], config: SampleConfig) -> None:
        """Admit ``rows[i].n`` branches of each request, tagged ``tags[i]``, sampled by
        ``config`` (its ``n`` and ``seed`` ignored; the rollout engine's ``Decoder``
        protocol)."""
        self.admit([self.policy.prompt_ids(r.transcript) for r in rows],
                   [r.n for r in rows], [r.seed for r in rows], tags, config)

    @torch.inference_mode()
    def admit(self, prompts: Sequence[list[int]], ns: Sequence[int], seeds: Sequence[int],
              tags: Sequence[Any] | None = None, config: SampleConfig | None = None) -> None:
        """Add ``ns[t]`` branches of each prompt (class docstring), sampled by ``config``
        (default: the batch's; rows of different configs share a batch); ``tags[t]``
        (default ``t``) comes back with each of its rows' continuations."""
        if any(not p for p in prompts):
            raise ValueError("a transcript rendered to zero tokens")
        tags = list(range(len(prompts))) if tags is None else list(tags)
        config = config or self.config
        if not self.live_pos and not self._joinable:  # a layer kind rows cannot join
            self._prefill(prompts, ns, seeds, tags, config)
            return
        if not self.accepting:
            raise RuntimeError("rows cannot join a running batch of this model (a cache "
                               "layer is not full attention); admit them when it is empty")
        hits = self.policy.cached_prefixes(prompts)
        # Rows whose suffixes differ widely are prefilled in separate forwards, also
        # into an empty batch: a fresh root prompt (hundreds of tokens) beside rows
        # whose cached prefix leaves only an observation to compute would make every
        # row compute at the root's width (measured on workflow H = 18: 56 rows x 334
        # query positions where most needed about 25).
        for group in _similar_suffixes([len(p) - c for p, (c, _) in
                                        zip(prompts, hits, strict=True)]):
            part = ([prompts[t] for t in group], [ns[t] for t in group],
                    [seeds[t] for t in group], [tags[t] for t in group])
            if not self.live_pos:
                self._prefill(*part, config, [hits[t] for t in group])
                continue
            other = DecodeBatch(self.policy, config)
            other._prefill(*part, config, [hits[t] for t in group])
            self._merge(other)

    def _prefill(self, prompts: Sequence[list[int]], ns: Sequence[int], seeds: Sequence[int],
                 tags: Sequence[Any], config: SampleConfig,
                 hits: Sequence[tuple[int, list[Any] | None]] | None = None) -> None:
        """Make this (empty) batch the prefill of ``prompts`` expanded to their branches,
        sampled by ``config`` (``hits``: their cached prefixes, looked up when not
        given)."""
        pol = self.policy
        cache = buffered_cache(pol.model.config, 0)
        ids, mask, positions, cached = pol._prefill_inputs(list(prompts), cache,
                                                           config.max_new_tokens, hits)
        # Without padding the causal mask alone is right: passing no attention mask
        # lets attention skip building one at every step (a large part of a tiny
        # model's per-token cost).
        self.padded = bool((mask == 0).any())
        out = pol.model(input_ids=ids, attention_mask=mask if self.padded else None,
                        position_ids=positions, cache=cache, use_cache=True,
                        logits_to_keep=1)
        if pol.prefix_cache is not None:
            for t, prompt in enumerate(prompts):
                pol._remember(prompt, cache, mask, t)
        logits = widened(out.logits[:, -1, :])  # (m, V)
        next_pos = mask.sum(-1)  # (m,) position of each row's next token
        if any(n > 1 for n in ns):  # one prefix computation, expanded to the n branches
            if len(set(ns)) == 1:
                cache.batch_repeat_interleave(ns[0])
                expand = torch.arange(len(ns), device=pol.device).repeat_interleave(ns[0])
            else:
                expand = torch.repeat_interleave(
                    torch.arange(len(ns), device=pol.device),
                    torch.tensor(list(ns), device=pol.device))
                cache.batch_select_indices(expand)
            logits, mask, next_pos = logits[expand], mask[expand], next_pos[expand]
        starts = (mask != 0).long().argmax(-1).tolist()
        self.slots = [
            _Branch(tags[t], k, prompts[t], (seeds[t] + k) & _MASK64,
                    len(prompts[t]) - cached[t] if k == 0 else 0, config)
            for t, n in enumerate(ns) for k in range(n)]
        for slot, start in zip(self.slots, starts, strict=True):
            slot.start = start
        self.live_pos = list(range(len(self.slots)))
        self.cache, self.logits, self.next_pos = cache, logits, next_pos
        self.width = mask.shape[1]
        self.mask = torch.cat([mask, mask.new_ones((len(self.slots), config.max_new_tokens))],
                              dim=1)
        self.col0 = 0

    @property
    def cols(self) -> torch.Tensor:
        """The mask from the first column in use (a view: writes reach ``mask``)."""
        return self.mask[:, self.col0:]

    def _buffers(self) -> list[BufferLayer]:
        return [layer for layer in self.cache.layers if isinstance(layer, BufferLayer)]

    def _merge(self, other: DecodeBatch) -> None:
        """Move ``other``'s rows (a fresh prefill) into free positions of this batch, each
        row's keys right-aligned at this batch's current column."""
        n = len(other.slots)
        real = other.mask[:, :other.width] != 0  # (n, W2)
        counts = real.sum(-1)  # (n,) keys of each new row
        need = int(counts.max())
        if need > self.width:  # a longer prompt than any column so far: room on the left
            self._pad_left(need - self.width)
        width = self.width
        live = set(self.live_pos)
        free = [p for p in range(len(self.slots)) if p not in live][:n]
        if len(free) < n:
            first = len(self.slots)
            self._grow(n - len(free))
            free += range(first, len(self.slots))
        target = torch.tensor(free, device=self.mask.device)
        src_row, src_col = real.nonzero(as_tuple=True)  # row-major: each row's keys in order
        offsets = counts.cumsum(0) - counts
        rank = torch.arange(len(src_row), device=src_row.device) - offsets[src_row]
        dst_col = width - counts[src_row] + rank
        dst_row = target[src_row]
        for mine, theirs in zip(self._buffers(), other._buffers(), strict=True):
            mine.place(dst_row, dst_col, theirs, src_row, src_col)
        self._ensure_columns(width + 1)
        cols = self.cols  # after _ensure_columns, which may replace the mask
        cols[target] = 0
        cols[dst_row, dst_col] = 1
        cols[target, width:] = 1
        self.next_pos[target] = other.next_pos
        self.logits[target] = other.logits
        for pos, slot, count in zip(free, other.slots, counts.tolist(), strict=True):
            slot.start = width - count
            self.slots[pos] = slot
        self.live_pos = sorted(self.live_pos + free)
        self.padded = self.merged = True

    def _grow(self, extra: int) -> None:
        """``extra`` more positions (zero keys, masked)."""
        for layer in self._buffers():
            layer.grow_rows(extra)
        self.mask = torch.cat([self.mask, self.mask.new_zeros((extra, self.mask.shape[1]))])
        self.next_pos = torch.cat([self.next_pos, self.next_pos.new_zeros(extra)])
        self.logits = torch.cat([self.logits, self.logits.new_zeros((extra,
                                                                      self.logits.shape[1]))])
        self.slots += [_Branch(None, 0, [], 0, 0, self.config) for _ in range(extra)]

    def _pad_left(self, columns: int) -> None:
        for layer in self._buffers():
            layer.pad_left(columns)
        if columns > self.col0:  # room before col0 for as many columns again as in use
            room = columns + self.col0 + self.width
            self.mask = torch.cat([self.mask.new_zeros((self.mask.shape[0], room)),
                                   self.mask], dim=1)
            self.col0 += room
        self.col0 -= columns
        self.mask[:, self.col0:self.col0 + columns] = 0
        self.width += columns
        for slot in self.slots:
            slot.start += columns

    def _ensure_columns(self, columns: int) -> None:
        """At least ``columns`` mask columns (the ones past the width are ones: every
        position attends to the keys it will write)."""
        have = self.mask.shape[1] - self.col0
        if have < columns:  # grow on the right, keeping at most ``have`` columns of room
            room = min(self.col0, have)
            more = max(columns - have, have)
            self.mask = torch.cat([self.mask[:, self.col0 - room:],
                                   self.mask.new_ones((self.mask.shape[0], more))], dim=1)
            self.col0 = room

    def _drop_columns(self) -> None:
        """``DROP_COLUMNS_FROM``: forget the leading columns no live row uses (only in a
        batch rows joined: one prefill's batch keeps its layout to the end)."""
        if not self.merged:
            return
        lo = min(self.slots[p].start for p in self.live_pos)
        if lo < DROP_COLUMNS_FROM or 4 * lo < self.width:
            return
        for layer in self._buffers():
            layer.drop_left(lo)
        self.col0 += lo
        self.width -= lo
        for slot in self.slots:
            slot.start = max(0, slot.start - lo)

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, int, Continuation]]:
        """One token for every live row, then one forward (class docstring)."""
        if not self.live:
            return []
        pol = self.policy
        every = self.live == len(self.slots)
        live_index = None if every else torch.tensor(self.live_pos, device=pol.device)
        logits = self.logits if live_index is None else self.logits[live_index]
        logp = torch.log_softmax(logits, dim=-1)  # (R, V) untempered policy
        entropy = torch.special.entr(logp.exp()).sum(-1)  # (R,), 0 log 0 = 0
        rows = [self.slots[j] for j in self.live_pos]
        probs = _sampling_probs(logits, logp, [(r.config.temperature, r.config.top_p)
                                               for r in rows])
        streams = np.array([r.stream for r in rows], dtype=np.uint64)
        drawn = np.array([len(r.tokens) for r in rows], dtype=np.uint64)
        chosen = _inverse_cdf(probs, stream_uniforms(streams, drawn))  # (R,)
        chosen_lp = logp.gather(1, chosen[:, None]).squeeze(1)
        token_texts = pol.token_texts()
        window = pol._stop_window
        keep: list[int] = []  # indices into live_pos of the rows that go on
        done: list[tuple[int, bool]] = []  # (index into live_pos, stopped)
        for i, (r, tok, lp, ent) in enumerate(zip(rows, chosen.tolist(), chosen_lp.tolist(),
                                                  entropy.tolist(), strict=True)):
            r.tokens.append(tok)
            r.logprobs.append(lp)
            r.entropies.append(ent)
            # ids past the tokenizer (padded embedding rows of some models) decode to ""
            piece = token_texts[tok] if tok < len(token_texts) else ""
            r.tail = (r.tail + piece)[-(window + len(piece)):]
            if tok in pol.eos_ids or any(s in r.tail for s in pol.stop_strings):
                done.append((i, True))
            elif len(r.tokens) == r.config.max_new_tokens:
                done.append((i, False))
            else:
                keep.append(i)
        out: list[tuple[Any, int, Continuation]] = []
        seen = self.cols[:, :self.width]
        for i, stopped in done:
            r = rows[i]
            meta = {"temperature": r.config.temperature, "top_p": r.config.top_p}
            if pol.prefix_cache is not None:  # what the row computed
                pol._remember(r.prompt + r.tokens[:-1], self.cache, seen, self.live_pos[i])
            text_ids = r.tokens[:-1] if r.tokens[-1] in pol.eos_ids else r.tokens
            out.append((r.request, r.k, Continuation(
                text=pol.tokenizer.decode(text_ids, skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False),
                token_ids=r.tokens, logprobs=r.logprobs, entropies=r.entropies,
                finished=stopped, prefill_tokens=r.prefill_tokens, meta=meta)))
        if not keep:  # every row's step ended
            self.live_pos = []
            return out
        if done:
            chosen = chosen[torch.tensor(keep, device=pol.device)]
            self.live_pos = [self.live_pos[i] for i in keep]
            if self.live < COMPACT_BELOW * len(self.slots) or self.live <= FEW_ROWS:
                index = torch.tensor(self.live_pos, device=pol.device)
                self.cache.batch_select_indices(index)
                self.mask, self.next_pos = self.mask[index], self.next_pos[index]
                self.slots = [self.slots[j] for j in self.live_pos]
                self.live_pos = list(range(len(self.slots)))
        if self.live < len(self.slots):  # finished positions decode padding
            step_ids = chosen.new_full((len(self.slots),), pol.pad_id)
            step_ids[torch.tensor(self.live_pos, device=pol.device)] = chosen
        else:
            step_ids = chosen
        self._ensure_columns(self.width + 1)
        result = pol.model(input_ids=step_ids[:, None],
                           attention_mask=self.cols[:, :self.width + 1] if self.padded
                           else None,
                           position_ids=self.next_pos[:, None], cache=self.cache,
                           use_cache=True)
        self.width += 1
        self.next_pos = self.next_pos + 1
        self.logits = widened(result.logits[:, -1, :])  # (positions, V)
        self._drop_columns()
        return out
