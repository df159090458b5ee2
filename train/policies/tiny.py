"""``tiny``: the embedded default policy, a ~0.8M-parameter Llama with our own tokenizer.

The model is a plain ``transformers`` ``LlamaForCausalLM`` (``TinyModelConfig``:
4 layers, hidden 128, 4 heads, MLP 352, tied embeddings; about 0.82M parameters)
and the tokenizer a ``PreTrainedTokenizerFast`` built here from a ``tokenizers``
``WordLevel`` model, so a checkpoint is an ordinary Hugging Face directory:
``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``
load it, and ``hf:PATH`` samples from it through the same code (``train.policies.hf``).

Tokenizer (``build_tokenizer``)
  * one token per character of printable ASCII plus ``\\n`` and ``\\t``; anything else
    is ``<unk>`` (every environment here writes ASCII);
  * special tokens ``<pad>``, ``<unk>``, ``<eos>`` and the role markers ``<|system|>``,
    ``<|user|>``, ``<|assistant|>``, ``<|tool|>``;
  * single tokens for the protocol boilerplate (``TAG_TOKENS``, ``CALC_TOKENS``: the
    calc call prefix ``<tool_call>{"name": "calc", "arguments": {"expr": "`` and suffix
    ``"}}</tool_call>``, ``<tool_response>``, ``<answer>``, ...), for each workflow
    action string as a whole (``WORKFLOW_ACTION_TOKENS``: an action is ONE token), and
    for the workflow environment's fixed phrases and stage names
    (``WORKFLOW_PHRASE_TOKENS``). Boilerplate tokens cut sequences about 3x;
    the workflow phrases cut an episode of the default mix from about
    2,300 characters to about 205 tokens (11x), which makes SFT on it affordable on CPU.
    ``build_tokenizer(env)`` appends the env's own phrases (``Environment.tiny_phrases``)
    after the shared vocabulary, so the calc and workflow tokenizers (and their
    checkpoints) are unchanged: sgls declares ``SGLS_PHRASE_TOKENS`` (each world's
    tool-schema block, every tool's call prefix, the JSON keys of arguments and responses,
    the fixed text of questions and replies); an sgls episode of the default mix
    is then ~305 tokens (about 12x fewer than characters; the prompt's ~2,100-character
    schema block is one token).
    Text is split on these tokens first (leftmost-longest), then into characters, so
    ``decode(encode(text)) == text`` for any ASCII text, and concatenating the
    encodings of turns equals encoding their concatenation.

Rendering (``render_segments``; the tokenizer's chat template gives the same text)::

    <|user|>{prompt}<|assistant|>{action}<|user|>{observation}<|assistant|>{action}...

Observations are ``user`` messages (the HF backend's default ``observation_role``),
so ``tiny`` and ``hf:PATH`` on a tiny checkpoint render identically. Generation
starts after ``<|assistant|>`` and stops at ``</tool_call>`` / ``</answer>``; the
model needs no end-of-turn token.

Checkpoints. ``rtrees policy init --env SPEC --seed S`` trains one by SFT on the env's
scripted expert (``train.policies.tiny_train``; any env with ``expert_action``) into
``default_cache_dir(SPEC, S)`` (``$RTREES_CACHE_DIR`` or ``$XDG_CACHE_HOME/rollout-trees``
or ``~/.cache/rollout-trees``, then ``policies/<name>-<seed>``, the name the spec made
safe for a path: ``checkpoint_name``). ``find_checkpoint`` looks there first, then in the
committed checkpoints ``COMMITTED_DIR/<name>`` (calc, workflow and sgls, seed 0 only),
which were made by::

    rtrees policy init --env calc --seed 0 --out train/policies/checkpoints/calc --force
    rtrees policy init --env workflow --seed 0 --out train/policies/checkpoints/workflow --force
    rtrees policy init --env sgls --seed 0 --out train/policies/checkpoints/sgls --force

The sgls run starts from the calc checkpoint (``SFTConfig.init_from``: the cached one,
else the committed one), its vocabulary grown by ``warm_start_model`` (the sgls
vocabulary extends the shared one, so the calc weights carry over and only the new
phrase tokens' embeddings are drawn). From random weights 3,000 steps never learned to
copy ids and prices from tool responses (0/200 held-out); from the calc policy 6,000
steps reach 23.5% on 200 held-out tasks (about 20 minutes on
one quiet core; the committed one was trained with ``threads=1``).

Training is seeded and its stopping rule counts optimizer steps, not seconds, so
the same command regenerates an equivalent checkpoint (same data, same steps; the
weights agree up to floating-point summation order of the machine's BLAS, so the
``policy_version`` hash may differ while the success rates match; on the machine
that made them, rerunning the command gave bit-identical files, even under load).
Only the ``--minutes`` cap, when it cuts training short on a slow machine, depends
on time.
"""

from __future__ import annotations

import hashlib
import os
import re
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from train import rundir
from train.envs.calc import call_text
from train.envs.sgls import SglsEnv
from train.envs.sgls_phrases import SGLS_OTHER_KEYS as SGLS_OTHER_KEYS
from train.envs.sgls_phrases import SGLS_STRING_KEYS as SGLS_STRING_KEYS
from train.envs.sgls_phrases import SGLS_TEXT_TOKENS as SGLS_TEXT_TOKENS
from train.envs.workflow import STAGE_NAMES
from train.envs.workflow_model import ACTION_TEXTS, TOOLS
from train.policies.base import Transcript
from train.policies.hf import ROLE_CONCAT_TEMPLATE, HFPolicy, check_finite, quiet_progress
from train.rundir import write_checkpoint

PAD, UNK, EOS = "<pad>", "<unk>", "<eos>"
ROLE_TOKENS: dict[str, str] = {role: f"<|{role}|>" for role in
                               ("system", "user", "assistant", "tool")}
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, EOS, *ROLE_TOKENS.values())
CHARS: tuple[str, ...] = tuple(c for c in string.printable if c not in "\r\x0b\x0c")

_CALL = call_text("")  # <tool_call>{"name": "calc", "arguments": {"expr": ""}}</tool_call>
CALC_CALL_PREFIX = _CALL[:_CALL.index('"}}')]
CALC_CALL_SUFFIX = '"}}</tool_call>'
TAG_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<tool_response>",
                               "</tool_response>", "<answer>", "</answer>", "error: ")
CALC_TOKENS: tuple[str, ...] = (CALC_CALL_PREFIX, CALC_CALL_SUFFIX, "Compute ")
WORKFLOW_ACTION_TOKENS: tuple[str, ...] = tuple(ACTION_TEXTS[tool] for tool in TOOLS)
# The fixed text of train.envs.workflow_model (prompt, state lines, outcomes, endings).
# If that text changes, these only stop matching: encoding stays exact, just longer
# (tests/test_policies.py checks that each phrase still occurs in real episodes).
WORKFLOW_PHRASE_TOKENS: tuple[str, ...] = (
    "Run this workflow of ", " stages, in order, within ", " tool calls:", " (needs: ",
    "nothing",
    "\nIt succeeds when the last stage is done and no stage it depends on, directly or "
    "indirectly, was skipped.",
    '\nCall one tool per step: <tool_call>{"name": TOOL, "arguments": {}}</tool_call>',
    "\n  fast: run the current stage quickly; on failure the stage breaks (or the "
    "workflow crashes).",
    "\n  careful: run the current stage carefully; on failure nothing changes.",
    "\n  repair: fix a broken stage.",
    "\n  skip: move on without running the current stage.",
    "\nStage ", "). Status: ok. Steps left: ", "). Status: broken. Steps left: ",
    ". Valid tools: fast, careful, skip.", ". Valid tools: repair, skip.",
    *(f"{tool} on '" for tool in TOOLS), "': success.", "': failure.",
    " The stage is broken.", " The workflow crashed.", " Nothing changed.",
    " The stage is fixed.", " Still broken.", " The stage was skipped.",
    " The step was wasted.",
    "\nWorkflow complete. Reward 1.",
    "\nFinal check failed: a required stage was skipped. Reward 0.",
    "\nThe workflow crashed. Reward 0.", "\nOut of steps. Reward 0.",
    *STAGE_NAMES,
)
PHRASE_TOKENS: tuple[str, ...] = (*TAG_TOKENS, *CALC_TOKENS, *WORKFLOW_ACTION_TOKENS,
                                  *WORKFLOW_PHRASE_TOKENS)

# Only the sgls tokenizer has these (``SglsEnv.tiny_phrases``, appended after the shared
# vocabulary, so the calc and workflow tokenizers and their checkpoints are unchanged).
SGLS_PHRASE_TOKENS: tuple[str, ...] = tuple(
    p for p in SglsEnv.tiny_phrases() if p not in PHRASE_TOKENS)


def env_phrase_tokens(env: str | None) -> tuple[str, ...]:
    """The tokens the tiny tokenizer of ``env`` (a spec) adds after the shared vocabulary:
    its class's ``tiny_phrases()`` not already in ``PHRASE_TOKENS``, in order (sgls:
    ``SGLS_PHRASE_TOKENS``; most envs: none)."""
    if env is None:
        return ()
    from train.envs import env_class

    return tuple(dict.fromkeys(p for p in env_class(env).tiny_phrases()
                               if p not in PHRASE_TOKENS))

# Renders exactly like ``render_segments`` (checked by the tests).
CHAT_TEMPLATE = ROLE_CONCAT_TEMPLATE  # each message's ids can be computed on its own

COMMITTED_DIR = Path(__file__).resolve().parent / "checkpoints"


@dataclass(frozen=True)
class TinyModelConfig:
    """The tiny Llama's shape. The defaults are the feasibility study's model
    (4 layers, hidden 128, 4 heads, ~0.8M parameters learned on 2 cores)."""

    hidden_size: int = 128
    intermediate_size: int = 352  # ~ 8/3 * hidden, Llama's MLP ratio
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    max_position_embeddings: int = 2048  # RoPE, nothing learned per position
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of "
                             f"num_attention_heads {self.num_attention_heads}")


def build_tokenizer(env: str | None = None) -> PreTrainedTokenizerFast:
    """The tiny tokenizer: characters plus single boilerplate tokens (module docstring),
    then the env's own phrases (``env_phrase_tokens``: sgls's ``SGLS_PHRASE_TOKENS``; an
    env that declares none gets the shared vocabulary)."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    core.add_special_tokens([AddedToken(t, normalized=False, special=True)
                             for t in SPECIAL_TOKENS])
    phrases = (*PHRASE_TOKENS, *env_phrase_tokens(env))
    core.add_tokens([AddedToken(t, normalized=False, special=False) for t in phrases])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, unk_token=UNK, eos_token=EOS,
        clean_up_tokenization_spaces=False, padding_side="left",
        model_max_length=TinyModelConfig.max_position_embeddings)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def init_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0,
               shape: TinyModelConfig | None = None) -> LlamaForCausalLM:
    """A freshly initialised tiny Llama (seeded) for ``tokenizer``'s vocabulary."""
    shape = shape or TinyModelConfig()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def warm_start_model(tokenizer: PreTrainedTokenizerFast, source: str | Path, seed: int = 0
                     ) -> LlamaForCausalLM:
    """The tiny checkpoint at ``source`` with its vocabulary grown to ``tokenizer``'s, to
    start SFT from (``SFTConfig.init_from``). The source's tokens must be the first
    entries of ``tokenizer`` (``build_tokenizer("sgls")`` extends the shared one), so
    their embeddings keep their meaning; each new token's embedding is drawn from a
    normal with the old embeddings' mean and covariance (transformers' mean resizing),
    seeded. ``ValueError`` when the vocabularies do not line up."""
    old = PreTrainedTokenizerFast.from_pretrained(str(source), local_files_only=True,
                                                  trust_remote_code=False)
    old_vocab, new_vocab = old.get_vocab(), tokenizer.get_vocab()
    moved = [t for t, i in old_vocab.items() if new_vocab.get(t) != i]
    if moved or len(old_vocab) > len(new_vocab):
        raise ValueError(f"the tokenizer of {source} is not a prefix of this one "
                         f"({len(moved)} of its {len(old_vocab)} tokens differ)")
    model = LlamaForCausalLM.from_pretrained(str(source), local_files_only=True,
                                             trust_remote_code=False)
    check_finite(model, source)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


def n_parameters(model: torch.nn.Module) -> int:
    """Learned parameters, tied weights counted once."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------
# Rendering


def render_segments(transcript: Transcript) -> list[tuple[str, bool]]:
    """The transcript as ``(text, is_action)`` pieces whose concatenation is the tiny
    rendering (without the generation prompt). Action pieces hold exactly the action
    text; role markers belong to the non-action piece before them (SFT masks by this)."""
    pieces: list[tuple[str, bool]] = []
    for role, text in transcript:
        if role == "action":
            pieces.append((ROLE_TOKENS["assistant"], False))
            pieces.append((text, True))
        elif role in ("prompt", "observation"):
            pieces.append((ROLE_TOKENS["user"] + text, False))
        else:
            raise ValueError(f"unknown turn role {role!r}")
    return pieces


def render(transcript: Transcript, add_generation_prompt: bool = True) -> str:
    """The tiny rendering of a transcript, ending with ``<|assistant|>`` to generate."""
    text = "".join(piece for piece, _ in render_segments(transcript))
    return text + ROLE_TOKENS["assistant"] if add_generation_prompt else text


# ---------------------------------------------------------------------------
# Checkpoints


def cache_root() -> Path:
    """``$RTREES_CACHE_DIR``, else ``$XDG_CACHE_HOME/rollout-trees``, else
    ``~/.cache/rollout-trees``."""
    if os.environ.get("RTREES_CACHE_DIR"):
        return Path(os.environ["RTREES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollout-trees"


def checkpoint_name(env: str) -> str:
    """``env`` (a spec) as a directory name: itself when it is letters, digits, ``_`` and
    ``-`` (the built-in names), else those characters with every other one as ``_`` and
    8 hex digits of its sha256 (``mypkg.env:MyEnv`` -> ``mypkg_env_MyEnv-1a2b3c4d``), so
    no ``:``, ``.`` or ``/`` reaches a path and two specs never share a directory."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", env)
    if safe == env and env:
        return env
    return f"{safe[:64]}-{hashlib.sha256(env.encode()).hexdigest()[:8]}"


def default_cache_dir(env: str, seed: int) -> Path:
    """Where ``rtrees policy init --env ENV --seed SEED`` writes by default:
    ``policies/<checkpoint_name(ENV)>-<SEED>`` under ``cache_root()``."""
    return cache_root() / "policies" / f"{checkpoint_name(env)}-{seed}"


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_meta(path: Path) -> dict[str, Any] | None:
    """The training record saved beside a checkpoint, or None; ``CheckpointError`` when
    it is not a JSON object."""
    return rundir.read_meta(path)


def committed_checkpoint(env: str, seed: int) -> Path | None:
    """The checkpoint committed to the repository for ``(env, seed)``, if any."""
    path = COMMITTED_DIR / checkpoint_name(env)
    meta = read_meta(path) if is_checkpoint(path) else None
    if meta is None or meta.get("env") != env or meta.get("seed") != seed:
        return None
    return path


def find_checkpoint(env: str, seed: int = 0) -> Path | None:
    """The cache directory's checkpoint for ``(env, seed)``, else the committed one."""
    cached = default_cache_dir(env, seed)
    if is_checkpoint(cached):
        return cached
    return committed_checkpoint(env, seed)


def save_checkpoint(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path,
                    meta: dict[str, Any]) -> Path:
    """Write weights (safetensors), config, tokenizer (with chat template) and ``meta``
    with the sha256 of every file (``train.rundir.write_checkpoint``).

    Written into a sibling temporary directory and renamed into place, so a reader never
    sees half a checkpoint and an interrupted write leaves the old one intact.
    """
    def fill(tmp: Path) -> None:
        with quiet_progress():
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    # 0644: safetensors writes 0600, and a shared cache must be readable
    return write_checkpoint(Path(path), fill, meta, mode=0o644)


def shape_dict(shape: TinyModelConfig | None = None) -> dict[str, Any]:
    return asdict(shape or TinyModelConfig())


# ---------------------------------------------------------------------------
# Policies


def random_tiny_policy(seed: int = 0, **kw: Any) -> HFPolicy:
    """A tiny policy with freshly initialised (random) weights, nothing loaded or saved:
    the fast stand-in for tests and benchmarks where training is not the point."""
    tokenizer = build_tokenizer()
    return HFPolicy(init_model(tokenizer, seed=seed), tokenizer, **kw)


def load_tiny_policy(env: str, seed: int = 0, checkpoint: str | Path | None = None,
                     **kw: Any) -> HFPolicy:
    """The trained tiny policy of ``env`` (any spec that resolves): ``checkpoint`` if
    given (any tiny checkpoint acts in any env: the text protocol is shared), else
    ``find_checkpoint(env, seed)``; ``EnvSpecError`` (a ``ValueError``) for a spec that
    does not resolve, ``PolicyUnavailableError`` (with the command that trains one) when
    there is no checkpoint."""
    from train.envs import env_class
    from train.policies.errors import PolicyUnavailableError

    env_class(env)
    path = Path(checkpoint) if checkpoint is not None else find_checkpoint(env, seed)
    if path is None:
        committed = COMMITTED_DIR / checkpoint_name(env)
        where = f" or {committed}" if committed.is_dir() else ""
        raise PolicyUnavailableError(
            f"no tiny {env} policy for seed {seed} in {default_cache_dir(env, seed)}{where}: "
            f"run `rtrees policy init --env {env} --seed {seed}` (a few minutes on 2 CPU "
            "cores; the env needs a scripted expert, expert_action)")
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a tiny policy checkpoint")
    kw.setdefault("device", "cpu")
    return HFPolicy.from_pretrained(path, **kw)
