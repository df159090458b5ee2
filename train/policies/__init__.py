"""Policy backends behind one protocol (``train.policies.base``; docs/architecture.md).

``load_policy(spec, env, **kw)`` builds one by spec:

============  ==============================================================
``tiny``      the embedded ~0.8M-parameter Llama trained for ``env`` (any env
              with a scripted expert; a seed-0 checkpoint of calc, workflow
              and sgls is committed) by ``rtrees policy init --env SPEC``;
              kw ``seed`` (0),
              ``checkpoint`` (a directory: any tiny checkpoint acts in any
              env), ``random_init=True`` (fresh random
              weights, nothing loaded: for tests and benchmarks)
``tiny:ENV``  the tiny policy trained for the env ``ENV`` (its cached or
              committed checkpoint), acting in ``env``: e.g. ``tiny:calc`` on
              an environment that has no tiny policy of its own
``hf:PATH``   any local transformers checkpoint with a chat template
              (``train.policies.hf``); kw ``device``, ``dtype``,
              ``observation_role``, ``system``, ``tools`` (default: the
              environment's tool schemas), ``max_batch``
``vllm:PATH`` the same through vLLM with prefix caching, on a GPU
              (``train.policies.vllm_backend``; needs ``pip install
              'rollout-trees[gpu]'``)
``tabular``   the exact softmax policy of the workflow environment
              (``train.policies.tabular``; envs whose class declares
              ``tabular_policy``); kw ``policies``
============  ==============================================================

A stored ``trees.policy_ref`` is a spec too (``load_policy_ref``; ``load_policy``
accepts one): ``tiny`` / ``hf:PATH`` / ``vllm:PATH`` / ``tabular``, or a plain
checkpoint directory, which is what the tiny and hf backends and the trainer's
checkpoints record (``policy_ref`` = the resolved directory). A directory holding
the tiny chat template (a committed or cached tiny checkpoint, or a trainer
checkpoint of the tiny model) reloads as ``tiny`` with that checkpoint; any other
checkpoint directory reloads as ``hf:PATH`` with the environment's tools. Given
the tree's ``policy_version``, the reloaded weights must have that version, else
``PolicyRefError`` names both; a directory that no longer exists (a trainer
checkpoint rotated away) also raises ``PolicyRefError`` naming the version.

Heavy modules (torch, transformers, vllm) are imported only by the backend asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_store.lazy import lazy_face
from train.policies.errors import INSTALL_HINT, PolicyRefError, PolicyUnavailableError

if TYPE_CHECKING:
    from train.policies.base import Policy

SPECS = ("tiny", "tiny:ENV", "hf:PATH", "vllm:PATH", "tabular")


def env_tools(env: str) -> list[dict[str, Any]] | None:
    """The environment's tools in the OpenAI function format that chat templates take
    (``Environment.tool_schemas``, checked by ``train.envs.tools.check_tool_schemas``;
    None where it has none or they differ per task)."""
    from train.envs import env_class
    from train.envs.tools import check_tool_schemas

    schemas = env_class(env).tool_schemas()
    return None if schemas is None else check_tool_schemas(schemas, env)


def load_policy(spec: str, env: str, **kw: Any) -> Policy:
    """A policy backend by spec (table in the module docstring).

    Raises ``ValueError`` for an unknown spec or environment, ``FileNotFoundError``
    for a PATH that is not a checkpoint, and ``PolicyUnavailableError`` when vLLM is
    not installed or no tiny checkpoint exists yet (the message gives the command).
    """
    from train.envs import env_class

    env_class(env)  # EnvSpecError (a ValueError) for a spec that does not resolve
    kind, sep, path = spec.partition(":")
    if kind in ("hf", "vllm") and (not sep or not path):
        raise ValueError(f"policy spec {spec!r} needs a checkpoint path: {kind}:PATH")
    if kind in ("hf", "vllm"):
        kw.setdefault("tools", env_tools(env))
    if spec == "tiny":
        from train.policies.tiny import load_tiny_policy, random_tiny_policy

        if kw.pop("random_init", False):
            return random_tiny_policy(seed=kw.pop("seed", 0), **kw)
        return load_tiny_policy(env, **kw)
    if kind == "tiny":  # tiny:OTHER: the tiny policy trained for OTHER, acting in env
        from train.policies.errors import PolicyUnavailableError
        from train.policies.tiny import find_checkpoint, load_tiny_policy

        env_class(path)
        found = find_checkpoint(path, kw.get("seed", 0))
        if found is None:
            raise PolicyUnavailableError(f"policy {spec!r}: no tiny {path} policy: run "
                                         f"`rtrees policy init --env {path}`")
        kw.pop("seed", None)
        return load_tiny_policy(env, checkpoint=found, **kw)
    if kind == "hf" and sep:
        from train.policies.hf import HFPolicy

        return HFPolicy.from_pretrained(Path(path), **kw)
    if kind == "vllm" and sep:
        from train.policies.vllm_backend import VLLMPolicy

        return VLLMPolicy(Path(path), **kw)
    if spec == "tabular":
        if not env_class(env).tabular_policy:
            raise ValueError(f"the tabular policy exists for the workflow environment only "
                             f"(an env class that declares tabular_policy), not {env!r}")
        from train.policies.tabular import TabularBackend

        return TabularBackend(**kw)
    if looks_like_path(spec):
        if not Path(spec).exists():  # a spec, not a stored policy_ref: no "--policy" hint
            raise FileNotFoundError(f"no such directory {spec!r} (a policy is "
                                    f"{', '.join(SPECS)}, or a checkpoint directory)")
        return load_policy_ref(spec, env, **kw)
    raise ValueError(f"unknown policy spec {spec!r}; expected one of {', '.join(SPECS)}, "
                     "or a checkpoint directory")


def looks_like_path(spec: str) -> bool:
    """True for a spec that names a directory rather than a backend (a stored policy_ref)."""
    return "/" in spec or spec.startswith(".") or Path(spec).is_dir()


def is_tiny_checkpoint(path: Path) -> bool:
    """A checkpoint directory whose chat template is the tiny policy's (``tiny.CHAT_TEMPLATE``)."""
    template = path / "chat_template.jinja"
    if not template.is_file():
        return False
    from train.policies.tiny import CHAT_TEMPLATE

    return template.read_text().strip() == CHAT_TEMPLATE


def load_policy_ref(ref: str, env: str, version: str | None = None, **kw: Any) -> Policy:
    """The policy a stored ``trees.policy_ref`` names, with exactly the weights it recorded.

    ``ref`` is a spec (``tiny``, ``hf:PATH``, ...) or a checkpoint directory (module
    docstring). ``version``, the tree's ``policy_version``, when given must equal the
    reloaded policy's version, which is recomputed from the loaded weights (the file
    hash, or the trainer's ``RUN-mem-HASH`` with HASH recomputed:
    ``hf.recorded_version``), never read from ``rtrees_policy.json`` on trust. No code
    of the checkpoint runs (``trust_remote_code=False``). Raises ``PolicyRefError`` for
    a directory that no longer exists, that now holds other weights, or that is damaged
    (a file digest, a non-finite weight, metadata the weights do not confirm),
    ``FileNotFoundError`` for a directory that is not a checkpoint.
    """
    from train.rundir import CheckpointError

    named = f" (policy version {version!r})" if version is not None else ""
    try:
        policy = _load_ref(ref, env, named, **kw)
    except CheckpointError as exc:
        raise PolicyRefError(f"policy_ref {ref!r}{named} is not usable: {exc}; pass "
                             "--policy SPEC to use another policy") from None
    if version is not None and str(policy.policy_version) != version:
        raise PolicyRefError(
            f"policy_ref {ref!r} now loads policy version {policy.policy_version!r}, not the "
            f"{version!r} that made the trees; pass --policy SPEC to use another policy")
    return policy


def _load_ref(ref: str, env: str, named: str, **kw: Any) -> Policy:
    """``load_policy_ref`` without the version check."""
    kind = ref.partition(":")[0]
    if ref in ("tiny", "tabular") or (kind in ("hf", "vllm") and ":" in ref):
        policy = load_policy(ref, env, **kw)
    else:
        path = Path(ref)
        if not path.exists():
            raise PolicyRefError(
                f"policy_ref {ref!r}{named} does not exist any more (a training run keeps "
                "only some checkpoints); pass --policy SPEC to use another policy")
        from train.policies.tiny import is_checkpoint, load_tiny_policy

        if not is_checkpoint(path):
            raise FileNotFoundError(f"policy_ref {ref!r} is not a checkpoint directory "
                                    "(no config.json and *.safetensors)")
        if is_tiny_checkpoint(path):
            policy = load_tiny_policy(env, checkpoint=path, **kw)
        else:
            policy = load_policy(f"hf:{path}", env, **kw)
    return policy


def describe_policy(spec: str, env: str, **kw: Any) -> dict[str, Any]:
    """What ``rtrees policy info`` prints: the loaded policy's version and reference,
    its size, and for a tiny checkpoint the training record saved beside it."""
    policy = load_policy(spec, env, **kw)
    info: dict[str, Any] = {"spec": spec, "env": env, "backend": type(policy).__name__,
                            "policy_version": policy.policy_version,
                            "policy_ref": policy.policy_ref}
    model = getattr(policy, "model", None)
    tokenizer = getattr(policy, "tokenizer", None)
    if model is not None and hasattr(model, "parameters"):
        info["parameters"] = sum(p.numel() for p in model.parameters())
        config = model.config
        info["model"] = {key: getattr(config, key, None) for key in (
            "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "intermediate_size", "vocab_size")}
    if tokenizer is not None:
        info["vocab_size"] = len(tokenizer)
    actions = getattr(policy, "action_vocab", None)
    if actions is not None:
        info["action_vocab"] = list(actions)
    if policy.policy_ref is not None:
        from train.policies.tiny import read_meta

        meta = read_meta(Path(policy.policy_ref))
        if meta is not None:
            info["training"] = {key: meta.get(key) for key in (
                "seed", "steps", "train_seconds", "stop_reason", "test", "command")}
    return info


# Names of the backends' modules, resolved lazily (``from train.policies import HFPolicy``
# loads torch and transformers then, not on ``import train.policies``); a module that
# moves needs only its line here changed.
_WHERE = {
    "train.policies.base": ("Policy", "Rows", "SampleConfig", "Turn"),
    "train.policies.hf": ("HFPolicy",),
    "train.policies.tiny": ("find_checkpoint", "load_tiny_policy"),
}
__getattr__, _ = lazy_face("train.policies", _WHERE)


__all__ = ["INSTALL_HINT", "SPECS", "HFPolicy", "Policy", "PolicyRefError",
           "PolicyUnavailableError", "Rows", "SampleConfig", "Turn", "describe_policy",
           "env_tools", "find_checkpoint", "is_tiny_checkpoint", "load_policy",
           "load_policy_ref", "load_tiny_policy", "looks_like_path"]
