"""Key/value buffers of the decoder: ``PrefixCache`` (prompts' keys/values kept across
calls, longest proper prefix reused) and ``BufferLayer`` (a ``DynamicLayer`` whose
keys/values grow in place in a preallocated buffer), ``buffered_cache`` making a cache of
them. The package docstring (``train.policies.hf``) says how sampling uses them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

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



def buffered_cache(config: Any, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose plain (full-attention) layers are
    ``BufferLayer``s of ``capacity`` positions (sliding-window and other layer kinds
    stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [BufferLayer(capacity) if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache
