"""``rtrees env ...``: drive an environment by hand (issue 3)."""

from __future__ import annotations

import typer

env_app = typer.Typer(help="Try tool environments by hand.", no_args_is_help=True)
