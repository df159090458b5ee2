"""``rtrees audit ...``."""

from __future__ import annotations

import typer

audit_app = typer.Typer(help="audit commands.", no_args_is_help=True)
