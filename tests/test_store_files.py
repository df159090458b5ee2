"""Damaged, stray and foreign files; schema versions and fingerprints."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from rollout_store import (
    CorruptFileError,
    SchemaMismatchError,
    Store,
    StoreError,
    connect,
    iter_tree_batches,
    read_arrow,
    read_trees,
)
from rollout_store import schema as schema_mod
from rollout_store.maintenance import verify
from rollout_store.synthetic import bel_shaped_batch


@pytest.fixture
def filled(store: Store) -> Store:
    store.append_trees(bel_shaped_batch(30, seed=1, snapshot_bytes=16), key="a")
    return store


def test_truncated_file_is_named(filled: Store) -> None:
    path = filled.files("nodes")[0].path
    with open(path, "r+b") as fh:
        fh.truncate(1000)
    for read in (lambda: connect(filled), lambda: read_arrow(filled, "nodes"),
                 lambda: read_trees(filled), lambda: list(iter_tree_batches(filled))):
        with pytest.raises(CorruptFileError) as info:
            read()
        assert info.value.path == path and "truncated" in str(info.value)
    report = verify(filled)
    assert not report.ok and path in report.problems[0]


def test_bit_flip_is_named(filled: Store) -> None:
    path = filled.files("nodes")[0].path
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x10
    Path(path).write_bytes(bytes(data))
    for read in (lambda: read_arrow(filled, "nodes"), lambda: list(iter_tree_batches(filled)),
                 lambda: connect(filled, verify_checksums=True)):
        with pytest.raises(CorruptFileError) as info:
            read()
        assert info.value.path == path and "checksum" in str(info.value).lower()
    report = verify(filled)
    assert not report.ok and path in report.problems[0]


def test_missing_file_is_named(filled: Store) -> None:
    path = filled.files("trees")[0].path
    Path(path).unlink()
    with pytest.raises(CorruptFileError, match="missing"):
        connect(filled)


def test_stray_parquet_files_are_invisible(filled: Store) -> None:
    before = connect(filled).sql("SELECT count(*) FROM nodes").fetchall()
    extra = read_arrow(filled, "nodes")
    pq.write_table(extra, filled.path / "nodes" / "part-stray.parquet")
    pq.write_table(extra, filled.path / "nodes" / "stray.parquet")
    assert connect(filled).sql("SELECT count(*) FROM nodes").fetchall() == before
    assert read_arrow(filled, "nodes").num_rows == before[0][0]
    assert verify(filled).ok


def test_not_a_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such store"):
        Store(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="not a rollout-trees store"):
        Store(tmp_path / "empty")


def _table_config(store: Store, name: str) -> dict[str, str | None]:
    return DeltaTable(str(store.path / name)).metadata().configuration


def _rewrite_table(store: Store, name: str, schema: pa.Schema, version: str,
                   fingerprint: str) -> None:
    """Replace one table by an empty Delta table with another schema and version tag."""
    import shutil

    shutil.rmtree(store.path / name)
    DeltaTable.create(str(store.path / name), schema, configuration={
        schema_mod.CONFIG_TABLE_KEY: name, schema_mod.CONFIG_VERSION_KEY: version,
        schema_mod.CONFIG_FINGERPRINT_KEY: fingerprint}, raise_if_key_not_exists=False)


def test_newer_store_fails_naming_the_versions(store: Store) -> None:
    newer = schema_mod.SCHEMA_VERSION + 1
    _rewrite_table(store, "metrics", schema_mod.METRICS, str(newer),
                   schema_mod.fingerprint(schema_mod.METRICS))
    with pytest.raises(SchemaMismatchError,
                       match=f"version {newer}, newer than this rollout-trees"):
        Store(store.path)


def test_mismatched_schema_names_the_difference(store: Store) -> None:
    changed = schema_mod.METRICS.set(schema_mod.METRICS.get_field_index("value"),
                                     pa.field("value", pa.string()))
    _rewrite_table(store, "metrics", changed, "1", schema_mod.fingerprint(schema_mod.METRICS))
    with pytest.raises(SchemaMismatchError, match="column 'value' has type"):
        Store(store.path)


def test_a_store_opened_for_some_tables_checks_the_others_at_first_use(
        store: Store) -> None:
    """``Store(path, tables=...)`` (the ranking audit's open) checks only the named
    tables at once; a damaged other table is refused, by name, when first used."""
    changed = schema_mod.METRICS.set(schema_mod.METRICS.get_field_index("value"),
                                     pa.field("value", pa.string()))
    _rewrite_table(store, "metrics", changed, "1", schema_mod.fingerprint(schema_mod.METRICS))
    some = Store(store.path, tables=("trees", "nodes"))
    assert set(some.table_schema_version) == {"trees", "nodes"}
    assert some.version(("trees",)).versions["trees"] >= 0
    assert some.schema_version_of("credits") == schema_mod.SCHEMA_VERSION
    for _ in range(2):  # refused every time, not only the first
        with pytest.raises(SchemaMismatchError, match="column 'value' has type"):
            some.delta_table("metrics")
    with pytest.raises(StoreError, match="no table named 'bogus'"):
        Store(store.path, tables=("trees", "bogus"))  # type: ignore[arg-type]


def test_older_store_opens_and_reads_missing_columns_as_null(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store from an older schema version (here a made-up version 0 whose
    ``credits`` lacked ``token_values``) opens read-only; the column reads as null."""
    old_credits = schema_mod.CREDITS.remove(schema_mod.CREDITS.get_field_index("token_values"))
    history = dict(schema_mod.SCHEMA_HISTORY)
    history[0] = {**schema_mod.SCHEMAS, "credits": old_credits}
    monkeypatch.setattr("rollout_store.store.SCHEMA_HISTORY", history)
    _rewrite_table(store, "credits", old_credits, "0", schema_mod.fingerprint(old_credits))
    # Write one old-format row the way the old version would have.
    dt = DeltaTable(str(store.path / "credits"))
    from deltalake.transaction import AddAction

    from rollout_store.store import now_utc

    row = pa.Table.from_pylist([{"run_id": "r", "method": "grpo", "method_params_hash": "h",
                                 "method_params": None, "tree_id": "t", "node_id": 1,
                                 "value": 0.25, "policy_version": None,
                                 "created_at": now_utc()}], schema=old_credits)
    pq.write_table(row, store.path / "credits" / "old.parquet")
    size = (store.path / "credits" / "old.parquet").stat().st_size
    dt.create_write_transaction([AddAction("old.parquet", size, {}, 0, True, "{}")],
                                mode="append", schema=old_credits)
    reopened = Store(store.path)
    assert reopened.table_schema_version["credits"] == 0
    con = connect(reopened)
    assert con.sql("SELECT value, token_values FROM credits").fetchall() == [(0.25, None)]
    table = read_arrow(reopened, "credits")
    assert table.schema.field("token_values").type == schema_mod.CREDITS.field(
        "token_values").type and table.column("token_values").null_count == 1
    with pytest.raises(SchemaMismatchError, match="read-only"):
        reopened.append_credits(schema_mod.CREDITS.empty_table())


def test_parquet_footer_carries_schema_fingerprint(filled: Store) -> None:
    meta = pq.read_schema(filled.files("nodes")[0].path).metadata
    assert schema_mod.PARQUET_METADATA_KEY in meta
    assert schema_mod.fingerprint(schema_mod.NODES).encode() in meta[
        schema_mod.PARQUET_METADATA_KEY]
    assert _table_config(filled, "nodes")[schema_mod.CONFIG_FINGERPRINT_KEY] == \
        schema_mod.fingerprint(schema_mod.NODES)
