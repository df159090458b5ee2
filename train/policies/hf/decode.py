"""The continuously batched decoder of ``HFPolicy`` (``DecodeBatch``, steps 2-5 of the
package docstring, ``train.policies.hf``) and its per-token sampling: temperature and
``top_p`` (``_sampling_probs``), draws by inversion from each row's own stream
(``_inverse_cdf``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from transformers import DynamicCache

from train.policies.base import (
    Continuation,
    Rows,
    SampleConfig,
    Transcript,
    stream_uniforms,
)
from train.policies.hf.kvcache import BufferLayer, PrefixCache, buffered_cache


class DecodeHost(Protocol):
    """What ``DecodeBatch`` uses of its policy (``HFPolicy``, in ``train.policies.hf.policy``,
    which imports this module: the decoder names the policy by this protocol, not by
    import)."""

    model: Any
    tokenizer: Any
    device: torch.device
    pad_id: int
    eos_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    _stop_window: int
    prefix_cache: PrefixCache | None

    def prompt_ids(self, transcript: Transcript) -> list[int]: ...

    def token_texts(self) -> list[str]: ...

    def cached_prefixes(self, prompts: Sequence[list[int]]
                        ) -> list[tuple[int, list[Any] | None]]: ...

    def _prefill_inputs(self, prompts: list[list[int]], cache: DynamicCache, extra: int = 0,
                        hits: Sequence[tuple[int, list[Any] | None]] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]: ...

    def _remember(self, seq: list[int], cache: DynamicCache, mask: torch.Tensor, row: int
                  ) -> None: ...


_MASK64 = (1 << 64) - 1


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


def widened(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` at float32 or wider: a bfloat16/float16 model's are cast up, a float64
    model's stay float64 (its sampling and logprobs keep its precision)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))



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
    """The decoding batch of ``HFPolicy`` (steps 2-5 of the package docstring), continuous.

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

    def __init__(self, policy: DecodeHost, config: SampleConfig,
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
