"""``rtrees train``: on-policy training on rollout trees (issue 11; ``train.trainer``).

``rtrees train --config FILE`` or ``rtrees train --env calc --policy tiny --sampler bel
--credit elpo --steps N --store DIR --out DIR [--resume] [--reuse MODE --reuse-from SQL
...] [--nproc N] [--shard none|fsdp]``; ``--agent module:function`` says ``--env
agent:module:function`` (an agent program, ``train.envs.agent``), as in ``rtrees
collect``; ``--nproc N`` runs N data-parallel ranks (``train.launch.launch``; the same run
as ``torchrun --nproc-per-node N -m cli.main train ...``).

The options that set a ``TrainConfig`` field are made from the dataclass
(``FIELD_OPTIONS``, read from the source of ``train/config.py`` so that ``rtrees`` starts
without torch): the option is the field's name with dashes (a ``dict`` field's
option is singular and repeatable, ``--sampler-param KEY=VALUE``), its type the field's,
its help the field's documentation. Every option is optional and passed on only when
given: the defaults live in ``train.config.TrainConfig`` alone (``--set FIELD=VALUE``
reaches any field; ``rtrees train --fields`` lists them with their documentation).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import itertools
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from cli._common import console, fail, parse_params

FIELD_OPTIONS: tuple[str, ...] = (
    "env", "policy", "sampler", "credit", "steps", "store", "out", "run_id",
    "sampler_params", "credit_params", "task_params", "reuse", "reuse_from",
    "reuse_per_step", "max_staleness", "is_cap", "is_mode", "reuse_params", "shard",
    "tensorboard")
"""``TrainConfig`` fields with an option of their own, in ``--help`` order."""
PATH_FIELDS = ("store", "out")
"""Fields whose option reads a path (passed on as its text)."""


def _option_name(field: str, dict_field: bool) -> str:
    """``--run-id`` for ``run_id``; ``--sampler-param`` for the dict ``sampler_params``."""
    name = field[:-1] if dict_field and field.endswith("s") else field
    return "--" + name.replace("_", "-")


def _help(doc: str) -> str:
    """A field's documentation as option help: its first sentence (a period before a
    capital letter ends it), with single inline-code marks."""
    return re.split(r"(?<=\.)\s+(?=[A-Z])", doc, maxsplit=1)[0].replace("``", "`")


def config_fields() -> dict[str, tuple[str, str]]:
    """``{field: (annotation text, docstring)}`` of ``TrainConfig``, read from the source
    of ``train/config.py`` without importing it (it imports torch, which ``rtrees`` loads
    only for the commands that need it)."""
    spec = importlib.util.find_spec("train.config")
    assert spec is not None and spec.origin is not None
    module = ast.parse(Path(spec.origin).read_text())
    body = next(n for n in module.body
                if isinstance(n, ast.ClassDef) and n.name == "TrainConfig").body
    return {a.target.id: (ast.unparse(a.annotation), " ".join(str(b.value.value).split()))
            for a, b in itertools.pairwise(body)
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def _field_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per ``FIELD_OPTIONS`` field, typed and documented by it: a
    ``bool`` field is a flag, a ``dict`` field a repeatable option, an ``int`` / ``float``
    field an option of that type, any other a text option (the config checks choices)."""
    found = config_fields()
    params = []
    for name in FIELD_OPTIONS:
        kind, doc = found[name]
        is_dict = kind.startswith("dict")
        option = _option_name(name, is_dict)
        annotation: Any
        if kind == "bool":
            annotation = Annotated[bool, typer.Option(option, help=_help(doc))]
            default: Any = False
        elif is_dict:
            annotation = Annotated[list[str] | None, typer.Option(
                option, help=f"KEY=VALUE (repeatable): {_help(doc)}")]
            default = None
        else:
            base = {"int": int, "float": float}.get(kind, Path if name in PATH_FIELDS else str)
            annotation = Annotated[base | None, typer.Option(option, help=_help(doc))]
            default = None
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                        default=default, annotation=annotation))
    return params


AGENT_PREFIX = "agent:"
"""``--agent SPEC`` is ``--env agent:SPEC`` (``train.envs.agent.program.AGENT_PREFIX``; not
imported, so that ``rtrees`` starts without the agent modules)."""


def _given(options: dict[str, Any]) -> dict[str, Any]:
    """The ``TrainConfig`` fields given on the command line, as ``apply_overrides`` takes
    them: ``--set`` first, then each field option that was given (a flag only when set, a
    repeatable option only when used); ``--agent SPEC`` sets ``env`` to ``agent:SPEC``
    (with ``--env`` or ``--set env=...`` too: a one-line error)."""
    given: dict[str, Any] = dict(parse_params(options.pop("set_"), "--set"))
    agent = options.pop("agent", None)
    if agent is not None:
        if options.get("env") is not None or "env" in given:
            fail("give one of --env and --agent (--agent SPEC is --env agent:SPEC)")
        options["env"] = AGENT_PREFIX + agent
    for name, value in options.items():
        if value is None or value is False:
            continue
        if isinstance(value, list | tuple):  # a repeatable KEY=VALUE option
            if value:
                given[name] = parse_params(list(value), _option_name(name, True))
        else:
            given[name] = str(value) if isinstance(value, Path) else value
    return given


def train_command(config: Path | None = None, set_: list[str] | None = None,
                  nproc: int | None = None, resume: bool = False, fields: bool = False,
                  **options: Any) -> None:
    """Train a policy on-policy on rollout trees (sample, commit, credit, PPO, publish)."""
    from train.config import ConfigError, apply_overrides, field_docs, load_config, read_config
    from train.distributed import DistributedError
    from train.launch import launch
    from train.trainer import TrainError

    if fields:
        for name, doc in field_docs().items():
            console.print(f"{name}: {doc}", highlight=False, markup=False)
        return
    out = options.get("out")
    given = _given({"set_": set_, **options})
    try:
        if resume and config is None and out is not None:  # the run's own config
            cfg = apply_overrides(read_config(out), given)
        else:
            cfg = load_config(config, given)
        report = launch(cfg, resume=resume, **({} if nproc is None else {"nproc": nproc}))
    except (ConfigError, TrainError, DistributedError) as exc:
        fail(f"{type(exc).__name__}: {exc}", code=2)
    if report.rank == 0:  # under torchrun every rank runs this command
        console.print(report.summary(), highlight=False, markup=False)


def _signature() -> inspect.Signature:
    """``train_command``'s options for typer: ``--config`` and ``--set``, the field options
    (``FIELD_OPTIONS``; ``--agent`` after ``--env``), then ``--nproc``, ``--resume`` and
    ``--fields``."""
    kw = inspect.Parameter.KEYWORD_ONLY

    def option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
        return inspect.Parameter(name, kw, default=default, annotation=annotation)

    fields = _field_parameters()
    cut = FIELD_OPTIONS.index("sampler_params")
    shard = FIELD_OPTIONS.index("shard")
    env = FIELD_OPTIONS.index("env")
    return inspect.Signature([
        option("config", Annotated[Path | None, typer.Option(
            "--config", help="TOML file of TrainConfig fields.")], None),
        *fields[:env + 1],
        option("agent", Annotated[str | None, typer.Option(
            "--agent", help="An agent program module:function (run(task, base_url, api_key) "
                            "-> reward): the same as --env agent:module:function.")], None),
        *fields[env + 1:cut],
        option("set_", Annotated[list[str] | None, typer.Option(
            "--set", help="Any TrainConfig field as FIELD=VALUE (repeatable).")], None),
        *fields[cut:shard],
        option("nproc", Annotated[int | None, typer.Option(
            help="Data-parallel ranks on this machine (train.distributed; gloo on CPU).")],
            None),
        fields[shard],
        option("resume", Annotated[bool, typer.Option(
            "--resume", help="Continue the run in --out from its newest checkpoint.")], False),
        *fields[shard + 1:],
        option("fields", Annotated[bool, typer.Option(
            "--fields", help="List TrainConfig's fields and exit.")], False),
    ], return_annotation=None)


def register(app: typer.Typer) -> None:
    """Add the ``train`` command to the ``rtrees`` app."""
    train_command.__signature__ = _signature()  # type: ignore[attr-defined]
    app.command("train")(train_command)
