"""What every ``rtrees`` command shares: the consoles, one-line errors, ``KEY=VALUE`` options.

``fail(message)`` prints ``error: message`` on one line to stderr and exits non-zero;
``parse_params(items)`` turns repeated ``KEY=VALUE`` options into a dict (a malformed item
is a one-line error naming it). ``main()`` in ``cli/main.py`` turns the library's named
errors that escape a command into the same one-line form (``one_line_error``).
"""

from __future__ import annotations

import errno
import json
import os
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console

console = Console()
err = Console(stderr=True, soft_wrap=True)  # never wrap error messages: users grep them

DEBUG_ENV = "RTREES_DEBUG"  # set to 1 to see the traceback of an unexpected error


class ParamError(ValueError):
    """A malformed ``KEY=VALUE`` option."""


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with ``code`` (non-zero)."""
    err.print(f"[bold red]error:[/] {one_line(message)}", highlight=False, markup=True)
    raise typer.Exit(code if code else 1)


def one_line(message: str) -> str:
    """``message`` with its lines joined, so an error is always exactly one line."""
    parts = [p.strip() for p in str(message).splitlines() if p.strip()]
    text = " | ".join(parts) or "(no message)"
    return text.replace("[", r"\[")  # rich markup in a message (e.g. a list) prints as is


def parse_params(items: list[str] | None, option: str = "--param") -> dict[str, str]:
    """``["a=1", "b = x"]`` -> ``{"a": "1", "b": "x"}``; keys and values are stripped.

    An item without ``=``, with an empty key, or a key given twice is a one-line error
    (``fail``) naming the option and the item."""
    try:
        return split_params(items, option)
    except ParamError as exc:
        fail(str(exc))


def parse_task_params(items: list[str] | None, code: int = 1) -> dict[str, Any]:
    """Repeated ``--task-param KEY=VALUE`` options as the env generator's options: each
    value read by ``train.coerce.literal_value`` (``12,18`` a tuple, ``true`` a bool, text
    starting with ``{`` or ``[`` JSON); a malformed one is a one-line error (exit ``code``)."""
    from train.coerce import CoerceError, literal_value

    try:
        return {k: literal_value(v, f"--task-param {k}")
                for k, v in parse_params(items, "--task-param").items()}
    except CoerceError as exc:
        fail(str(exc), code)


def split_params(items: list[str] | None, option: str = "--param") -> dict[str, str]:
    """``parse_params`` raising ``ParamError`` instead of exiting (for library-style callers)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ParamError(f"{option} {item!r}: expected KEY=VALUE")
        if key in out:
            raise ParamError(f"{option} {item!r}: {key!r} given twice")
        out[key] = value.strip()
    return out


def parse_json_params(items: list[str] | None, option: str) -> dict[str, Any]:
    """``parse_params`` whose values are JSON where they parse as JSON, else plain strings
    (``--mix difficulty=[1,2]`` -> ``{"difficulty": [1, 2]}``); raises ``ParamError``."""
    out: dict[str, Any] = {}
    for key, value in split_params(items, option).items():
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
        except RecursionError:  # valid JSON nested past the parser's depth (issue 21)
            raise ParamError(f"{option} {key}=...: JSON nested too deeply") from None
    return out


def require(condition: bool, message: str) -> None:
    """``fail(message)`` unless ``condition``: for option range checks."""
    if not condition:
        fail(message)


def debug_enabled() -> bool:
    """Whether ``RTREES_DEBUG`` asks for tracebacks."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


# Errors of writing that are the disk's, not a bug: errno -> what to say (issue 21: a full
# disk and a read-only --out printed raw OSError/RuntimeError text, often without a path).
_WRITE_ERRNOS = {errno.ENOSPC: "no space left on the device",
                 errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system",
                 errno.EFBIG: "file too large for the file system"}
# The same failures as wrapped by torch, safetensors or pyarrow (no errno left to read).
_WRITE_TEXT = (("No space left on device", errno.ENOSPC), ("StorageFull", errno.ENOSPC),
               ("Disk quota exceeded", errno.EDQUOT), ("Read-only file system", errno.EROFS),
               ("ReadOnlyFilesystem", errno.EROFS),
               ("PytorchStreamWriter failed writing", errno.ENOSPC))


def write_failure(exc: BaseException, out: str | None = None) -> str | None:
    """``cannot write PATH: REASON`` when ``exc`` is a full disk, an exceeded quota or a
    read-only file system, else None.

    Recognised by errno (an ``OSError``, or one in the exception's cause/context chain),
    by the text a library wrapped it in (safetensors, torch, pyarrow), or, for an error
    that names no cause (torch's ``enforce fail ... unexpected pos``), by ``out`` itself
    being on a read-only or full file system. ``PATH`` is the file the error names, else
    the command's ``--out`` (``out``). The library's named errors (``StoreError``...) keep
    their own message: it names the path (a store's, say), which may not be ``--out``."""
    if isinstance(exc, _named_error_types()):
        return None  # a named error already says what and where (a store's path, say)
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and len(chain) < 8:
        chain.append(link)
        link = link.__cause__ or link.__context__
    code: int | None = None
    filename: str | None = None
    for link in chain:
        if isinstance(link, OSError) and link.errno in _WRITE_ERRNOS:
            code, filename = link.errno, link.filename
            break
        code = next((c for needle, c in _WRITE_TEXT if needle in str(link)), None)
        if code is not None:
            break
    detail = ""
    if code is None and out is not None:
        code = _full_or_read_only(out)
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        detail = f" ({type(exc).__name__}: {first})"
    if code is None:
        return None
    where = f" {os.fspath(filename)}" if filename else f" under --out {out}" if out else ""
    if filename and out and not os.fspath(filename).startswith(out):
        where += f" (--out {out})"
    return f"cannot write{where}: {_WRITE_ERRNOS[code]}{detail}"


def _full_or_read_only(path: str) -> int | None:
    """``EROFS`` or ``ENOSPC`` when the file system holding ``path`` (or its nearest
    existing parent) is mounted read-only or has under 64 KiB free for us, else None."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    try:
        st = os.statvfs(here)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS
    return errno.ENOSPC if st.f_bavail * st.f_frsize < 64 * 1024 else None


def out_option(argv: list[str]) -> str | None:
    """The value of ``--out`` in a command line (``--out DIR`` or ``--out=DIR``), if any."""
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--out="):
            return arg.removeprefix("--out=")
    return None


def one_line_error(exc: BaseException, out: str | None = None) -> str:
    """The one-line message for an error that escaped a command: a full disk or read-only
    file system names the path (``write_failure``; ``out`` is the command's ``--out``); the
    library's named errors read as their message; anything else also names its type (it
    may be a bug) and says how to see the traceback."""
    written = write_failure(exc, out)
    if written is not None:
        return one_line(written)
    named = _named_error_types()
    if isinstance(exc, named):
        return one_line(str(exc) or type(exc).__name__)
    return (f"{type(exc).__name__}: {one_line(str(exc))} (unexpected: set {DEBUG_ENV}=1 "
            "for the traceback)")


def _named_error_types() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input or a bad store, not a bug: their message says it all."""
    from rollout_store import SchemaMismatchError, StoreError

    types: list[type[BaseException]] = [StoreError, SchemaMismatchError, ValueError,
                                        FileNotFoundError, NotADirectoryError,
                                        IsADirectoryError, PermissionError,
                                        FileExistsError]
    try:
        import duckdb

        types.append(duckdb.Error)
    except ImportError:  # pragma: no cover - duckdb is a dependency
        pass
    return tuple(types)


class RtreesApp(typer.Typer):
    """The ``rtrees`` app: run as the console script, every failure is one line on stderr.

    Usage errors (a bad option value) read ``error: ...`` with exit code 2; the library's
    named errors (``one_line_error``) exit 1 with their message; any other exception
    exits 1 with its type and message and a hint to set ``RTREES_DEBUG=1``, which
    re-raises it with the full traceback. Tests that drive the app through
    ``typer.testing.CliRunner`` see the commands' own behaviour.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        usage, exit_, abort, click_error = _click_exception_types()
        kwargs.setdefault("standalone_mode", False)
        try:
            code = super().__call__(*args, **kwargs)
        except usage as exc:
            ctx = getattr(exc, "ctx", None)
            hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            err.print(f"[bold red]error:[/] {one_line(exc.format_message())}{hint}",
                      highlight=False)
            raise SystemExit(2) from None
        except exit_ as exc:
            raise SystemExit(exc.exit_code) from None
        except (*abort, KeyboardInterrupt):
            err.print("[bold red]error:[/] interrupted", highlight=False)
            raise SystemExit(130) from None
        except click_error as exc:
            err.print(f"[bold red]error:[/] {one_line(exc.format_message())}", highlight=False)
            raise SystemExit(exc.exit_code or 1) from None
        except Exception as exc:  # the last line of defence: one line, never a traceback
            if debug_enabled():
                raise
            argv = kwargs.get("args") or (args[0] if args else None) or sys.argv[1:]
            err.print(f"[bold red]error:[/] {one_line_error(exc, out_option(list(argv)))}",
                      highlight=False)
            raise SystemExit(1) from None
        raise SystemExit(code if isinstance(code, int) else 0)


def _click_exception_types() -> tuple[Any, Any, Any, Any]:
    """click's UsageError, Exit, Abort and ClickException classes, of the click that typer
    runs (typer 0.2x vendors its own copy as ``typer._click``) and of plain click."""
    import click

    modules: list[Any] = [click.exceptions]
    try:
        from typer._click import exceptions as vendored

        modules.append(vendored)
    except ImportError:  # an older typer runs plain click
        pass
    def types(name: str, *extra: type[BaseException]) -> tuple[type[BaseException], ...]:
        return tuple({*extra, *(getattr(m, name) for m in modules if hasattr(m, name))})

    return (types("UsageError"), types("Exit", typer.Exit), types("Abort", typer.Abort),
            types("ClickException"))
