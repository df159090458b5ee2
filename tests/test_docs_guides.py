"""Every code block of every guide runs (``docs/guides/**/*.md``, found at collection, so a
page added later is picked up with no change here).

Per page, in one temporary directory, in document order (``tests/docs_blocks.py``): ``bash``
and ``bash runnable`` blocks as one bash script with the virtual environment's ``bin``
first on ``PATH``; ``python`` blocks written to files and run with its ``python``; ``toml``
and ``json`` blocks parsed; ``text`` is output. ``bash checked`` blocks (commands that need
a GPU, a Ray cluster, S3 or hours) are not run: every ``rtrees`` line in them is parsed against the
app (``tests/test_readme.py``'s parser). A fence of any other kind fails, so no block goes
untested by accident. A page whose run cannot be short says so with the comment
``<!-- docs-test: slow -->`` and runs only with the slow tests.

After a page ran, ``EXPECT`` checks what it made, where a page has more to check than its
own asserts (the environment guide: ``tests/test_docs_environments.py``).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from docs_blocks import EXTRAS, KINDS, ROOT, Block, blocks, failure, installed, run_blocks, script
from test_docs_environments import check_the_guide_ran
from test_guide_log_from_trainer import check_the_log_guide_ran
from test_readme import check_names, parse, rtrees_commands

GUIDES = ROOT / "docs" / "guides"
PAGES = sorted(GUIDES.glob("**/*.md"))
SLOW = "<!-- docs-test: slow -->"
EXPECT: dict[str, Callable[[Path, str], None]] = {
    "add-an-environment.md": check_the_guide_ran,
    "log-from-your-trainer.md": check_the_log_guide_ran,
}


def _name(page: Path) -> str:
    return page.relative_to(GUIDES).as_posix()


def _param(page: Path) -> object:
    text = page.read_text()
    # blocks for an installed optional extra (a TRL run) make the page long where they run
    slow = SLOW in text or any(b.marker in EXTRAS and installed(b.marker) for b in blocks(text))
    return pytest.param(page, id=_name(page), marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("page", [_param(p) for p in PAGES])
def test_the_guide_runs(page: Path, tmp_path: Path) -> None:
    found = blocks(page.read_text())
    odd = [f"line {b.line}: ```{b.lang} {b.marker}".rstrip() for b in found
           if (b.lang, b.marker) not in KINDS]
    assert odd == [], (f"{_name(page)}: fences the docs tests do not know (see "
                       f"docs/writing-docs.md): {odd}")
    assert any(b.runs for b in found), f"{_name(page)}: a guide shows code that runs"
    for block in found:
        if block.lang == "toml":
            tomllib.loads(block.body)
        elif block.lang == "json":
            json.loads(block.body)
    run = run_blocks(found, tmp_path)
    assert run.returncode == 0, failure(run, _name(page))
    if _name(page) in EXPECT:
        EXPECT[_name(page)](tmp_path, run.stdout)


@pytest.mark.parametrize("argv", [argv for page in PAGES for block in blocks(page.read_text())
                                  if block.marker == "checked"
                                  for argv in rtrees_commands(block.body)],
                         ids=lambda argv: " ".join(argv[1:3]))
def test_the_guides_checked_commands_parse(argv: list[str]) -> None:
    check_names(parse(argv))


def test_the_guide_pages_are_found() -> None:
    names = {_name(p) for p in PAGES}
    assert {"add-an-environment.md", "add-a-credit-method.md", "add-a-sampler.md"} <= names
    assert set(EXPECT) <= names, f"EXPECT names pages that do not exist: {set(EXPECT) - names}"


def test_blocks_and_script() -> None:
    """The fence parser and the script it makes, on a page with every kind of block."""
    page = ("# t\n```bash\necho a\n```\n```python title=\"m.py\"\nX = 1\n```\n"
            "```python\nimport m\nprint(m.X)\n```\n```text\n1\n```\n"
            "```bash checked\nrtrees collect --store s\n```\n"
            "- item\n\n  ```toml\n  [a]\n  b = 1\n  ```\n")
    found = blocks(page)
    assert [(b.lang, b.marker, b.title) for b in found] == [
        ("bash", "", None), ("python", "", "m.py"), ("python", "", None), ("text", "", None),
        ("bash", "checked", None), ("toml", "", None)]
    assert found[-1].body == "[a]\nb = 1\n" and found[0].line == 2
    text = script(found)
    assert "echo a" in text and "rtrees collect" not in text and "\n1\n" not in text
    assert text.index("cat > 'm.py'") < text.index("python 'm.py'") \
        < text.index("cat > 'block_2.py'") < text.index("python 'block_2.py'")


def test_a_failing_block_fails_the_page(tmp_path: Path) -> None:
    page = [Block("bash", "", None, "echo one\nfalse\necho never\n", 1)]
    run = run_blocks(page, tmp_path)
    assert run.returncode != 0 and "one" in run.stdout and "never" not in run.stdout
