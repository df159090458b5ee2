"""Environment snapshots: zstd compression and content hashes.

The ``snapshots`` table keeps each state zstd-compressed with the sha256 of the
raw bytes, so a restore can check it got exactly the state that was saved.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa
import zstandard

from rollout_store.schema import SNAPSHOTS

_LEVEL = 3  # zstd's default: fast, and states are small


def state_hash(state: bytes) -> str:
    return hashlib.sha256(state).hexdigest()


def compress(state: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=_LEVEL).compress(state)


def decompress(blob: bytes, expected_hash: str | None = None) -> bytes:
    """Raw state from a stored blob; raises ``ValueError`` if the hash does not match."""
    state = zstandard.ZstdDecompressor().decompress(blob)
    if expected_hash is not None and state_hash(state) != expected_hash:
        raise ValueError(f"snapshot state hash mismatch: expected {expected_hash}")
    return state


def to_stored(raw: pa.Table, commit_key: str) -> pa.Table:
    """``SNAPSHOT_INPUT`` rows (raw states) to ``SNAPSHOTS`` rows (compressed + hashed)."""
    states = raw.column("state").to_pylist()
    cctx = zstandard.ZstdCompressor(level=_LEVEL)
    return pa.table(
        {
            "snapshot_id": raw.column("snapshot_id"),
            "tree_id": raw.column("tree_id"),
            "env": raw.column("env"),
            "state": pa.array([cctx.compress(s) for s in states], pa.binary()),
            "state_hash": pa.array([state_hash(s) for s in states], pa.string()),
            "commit_key": pa.array([commit_key] * len(states), pa.string()),
        },
        schema=SNAPSHOTS,
    )


def from_stored(stored: pa.Table) -> pa.Table:
    """``SNAPSHOTS`` rows back to raw states (hash-checked)."""
    dctx = zstandard.ZstdDecompressor()
    raw = []
    for blob, h, sid in zip(stored.column("state").to_pylist(),
                            stored.column("state_hash").to_pylist(),
                            stored.column("snapshot_id").to_pylist(), strict=True):
        state = dctx.decompress(blob)
        if state_hash(state) != h:
            raise ValueError(f"snapshot {sid!r}: state hash mismatch (corrupt snapshot)")
        raw.append(state)
    return stored.drop_columns(["state", "state_hash", "commit_key"]).append_column(
        "state", pa.array(raw, pa.binary())
    )
