"""The generated references stay current: docs/CLI.md from the typer app,
docs/reference/config.md from the configuration dataclasses, and the store schema section of
docs/reference/store-schema.md from ``rollout_store/schema.py`` (``cli.reference``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from cli.reference import (
    CLI_DOC,
    CONFIG_DOC,
    REGENERATE,
    SCHEMA_DOC,
    DocsError,
    arrow_type,
    cli_markdown,
    config_page,
    main,
    root_command,
    schema_markdown,
    schema_section,
    stale,
    walk,
    with_schema_section,
    write,
)


def test_cli_doc_is_current() -> None:
    assert CLI_DOC.is_file(), f"docs/CLI.md is missing: run `{REGENERATE}`"
    assert CLI_DOC.read_text() == cli_markdown(), \
        f"docs/CLI.md is stale (the typer app changed): run `{REGENERATE}`"


def test_config_doc_is_current() -> None:
    assert CONFIG_DOC.is_file(), f"docs/reference/config.md is missing: run `{REGENERATE}`"
    assert CONFIG_DOC.read_text() == config_page(), \
        f"docs/reference/config.md is stale (a config dataclass changed): run `{REGENERATE}`"


def test_schema_section_is_current() -> None:
    assert schema_section(SCHEMA_DOC.read_text()) == schema_markdown(), \
        f"docs/reference/store-schema.md's schema section is stale: run `{REGENERATE}`"


def test_every_command_and_option_is_documented() -> None:
    """Each command has a heading, each option its flag and help, in the generated text."""
    text = cli_markdown()
    commands = walk(root_command())
    assert len(commands) > 20
    for path, command in commands:
        heading = f"`{' '.join(path)}`\n"
        assert f"## {heading}" in text or f"### {heading}" in text, f"no section {path}"
        for param in command.params:
            if param.param_type_name == "option":
                assert f"`{param.opts[0]}" in text, f"{' '.join(path)} {param.opts[0]}"
    assert "| `--tasks <str>` | `64` | Number of generated tasks, or a JSONL task file. |" \
        in text  # collect
    assert "| `--store <path>` | `required` |" in text


def test_every_table_and_column_is_listed() -> None:
    from rollout_store.schema import SCHEMAS

    text = schema_markdown()
    for table, schema in SCHEMAS.items():
        assert f"**`{table}`**" in text
        for f in schema:
            assert f"| `{f.name}` | `" in text, f"{table}.{f.name}"


def test_an_undocumented_column_is_named() -> None:
    schemas = {"trees": pa.schema([pa.field("tree_id", pa.string(), nullable=False),
                                   pa.field("brand_new", pa.int32())])}
    with pytest.raises(DocsError, match=r"trees\.brand_new"):
        schema_markdown(schemas, version=99)
    with pytest.raises(DocsError, match="no_such_table"):
        schema_markdown({"no_such_table": pa.schema([])}, version=99)


def test_arrow_types_read_short() -> None:
    assert arrow_type(pa.list_(pa.float32())) == "list<float32>"
    assert arrow_type(pa.map_(pa.string(), pa.float64())) == "map<string, float64>"
    assert arrow_type(pa.timestamp("us", tz="UTC")) == "timestamp[us, UTC]"
    assert arrow_type(pa.struct([pa.field("a", pa.int32())])) == "struct<a: int32>"


def test_schema_markers() -> None:
    text = "intro\n<!-- schema: x -->\nold\n<!-- /schema -->\nrest\n"
    with pytest.raises(DocsError, match="markers"):
        schema_section(text)
    from cli.reference import SCHEMA_BEGIN, SCHEMA_END

    text = f"intro\n{SCHEMA_BEGIN}\nold\n{SCHEMA_END}\nrest\n"
    new = with_schema_section(text, "new\n")
    assert schema_section(new) == "new\n"
    assert new.startswith("intro\n") and new.endswith(f"{SCHEMA_END}\nrest\n")


def test_check_and_write_a_copy(tmp_path: Path) -> None:
    """``stale`` names an edited copy's files; ``write`` makes them current again."""
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    schema = tmp_path / "docs" / "reference" / "store-schema.md"
    shutil.copy(SCHEMA_DOC, schema)
    (tmp_path / "docs" / "CLI.md").write_text("# hand-edited\n")
    schema.write_text(with_schema_section(schema.read_text(), "hand-edited\n"))
    assert stale(tmp_path) == ["docs/CLI.md", "docs/reference/config.md",
                               "docs/reference/store-schema.md (store schema section)"]
    write(tmp_path)
    assert stale(tmp_path) == []
    assert main(["--check"]) == (1 if stale() else 0)


def test_config_fields_are_listed() -> None:
    """``rtrees train`` / ``rtrees demo`` keep their defaults in dataclasses: every field is
    in the reference with its default."""
    import dataclasses

    from train.config import TrainConfig

    text = config_page()
    for f in dataclasses.fields(TrainConfig):
        assert f"| `{f.name}` | `" in text, f"TrainConfig.{f.name}"
    assert "| `steps` | `int` | `60` |" in text
