"""The stored precision of per-token logprobs and entropies (issue 26, "A smaller archive").

``nodes.action_logprobs`` and ``nodes.action_entropies`` keep their Arrow type
(``list<float32>``), but the writer rounds every finite value to ``MANTISSA_BITS`` explicit
mantissa bits (round half to even) before it is stored: the float32 exponent is kept, so
the range is float32's and the relative error is at most ``RELATIVE_ERROR``:

    |stored - x| <= 2^-(MANTISSA_BITS + 1) * |x|   (= 1.22e-4 |x| at 12 bits)

i.e. about four significant decimal digits; a logprob of -10 is stored within 1.2e-3, an
importance ratio exp(logp_new - logp_stored) within 0.12% of the exact one. The 11 low
mantissa bits of a float32 are noise for these values and do not compress; zeroing them
cut the nodes files of ``benchmarks/bench_store_size.py`` by about a third. Non-finite
values, and finite values whose rounding would overflow, are stored unchanged. Rounding is
idempotent, so rewriting stored rows (compaction) changes nothing. Content digests
(``digests.py``) never covered logprobs, so retries under a commit key are unaffected.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MANTISSA_BITS: Final[int] = 12
RELATIVE_ERROR: Final[float] = 2.0 ** -(MANTISSA_BITS + 1)
ROUNDED_COLUMNS: Final[tuple[str, ...]] = ("action_logprobs", "action_entropies")

_DROP = 23 - MANTISSA_BITS  # float32 has 23 explicit mantissa bits


def round_float32(values: np.ndarray) -> np.ndarray:
    """``values`` (float32) rounded to ``MANTISSA_BITS`` mantissa bits, half to even."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    u = x.view(np.uint32)
    half = np.uint32((1 << (_DROP - 1)) - 1)
    mask = np.uint32((0xFFFFFFFF >> _DROP) << _DROP)
    rounded = ((u + half + ((u >> np.uint32(_DROP)) & np.uint32(1))) & mask).view(np.float32)
    keep = ~np.isfinite(x) | ~np.isfinite(rounded)
    return np.where(keep, x, rounded).astype(np.float32)


def round_list_column(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """A ``list<float32>`` column with every value rounded (``round_float32``); nulls and
    list boundaries unchanged."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return arr
    arr = pc.cast(arr, pa.list_(pa.float32()))
    assert isinstance(arr, pa.ListArray)
    flat = arr.values.slice(arr.offsets[0].as_py(), arr.offsets[-1].as_py()
                            - arr.offsets[0].as_py())
    data = flat.to_numpy(zero_copy_only=False)
    valid = None if flat.null_count == 0 else np.asarray(flat.is_valid())
    rounded = pa.array(round_float32(np.nan_to_num(data) if valid is not None else data),
                       pa.float32(), mask=None if valid is None else ~valid)
    offsets = pc.subtract(arr.offsets, arr.offsets[0])
    return pa.ListArray.from_arrays(offsets, rounded, type=arr.type,
                                    mask=arr.is_null() if arr.null_count else None)


def round_nodes(nodes: pa.Table) -> pa.Table:
    """``nodes`` with ``ROUNDED_COLUMNS`` rounded to the stored precision."""
    for name in ROUNDED_COLUMNS:
        if name in nodes.column_names:
            i = nodes.column_names.index(name)
            nodes = nodes.set_column(i, nodes.schema.field(i),
                                     round_list_column(nodes.column(name)))
    return nodes


__all__ = ["MANTISSA_BITS", "RELATIVE_ERROR", "ROUNDED_COLUMNS", "round_float32",
           "round_list_column", "round_nodes"]
