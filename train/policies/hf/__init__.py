"""``hf:PATH``: any local transformers causal LM with a chat template (and the ``tiny`` one).

Rendering (``transcript_messages``). A transcript becomes chat messages:
``prompt`` -> ``user``, ``action`` -> ``assistant``, ``observation`` -> ``user``
(default) or ``tool`` (``observation_role="tool"``: the environment's own
``<tool_response>...</tool_response>`` wrapper is removed first, because templates
with a tool role, Qwen2.5's among them, add their own). An optional ``system`` text
and ``tools`` list (OpenAI function format) go to ``apply_chat_template``. The
prompt of one step is the template's rendering with ``add_generation_prompt=True``,
tokenized without extra special tokens; an action's tokens follow it directly.

Sampling (``HFPolicy.sample``), one agent step per transcript:
  1. transcripts are sorted by prompt length and cut into chunks of at most
     ``max_batch`` rows (``len(chunk) * n``);
  2. a chunk's prompts are left-padded into one batch (position ids count real tokens
     only) and prefilled ONCE into a ``DynamicCache``;
  3. for ``n > 1`` the cache and the last logits are expanded to the ``n`` branches
     (``DynamicCache.batch_repeat_interleave``): branch 0 reports the prompt's
     ``prefill_tokens``, branches 1..n-1 report 0, and no branch recomputes its prefix;
  4. each branch draws its tokens by inversion from its own counter-based stream
     (``Rows.seed + k``, ``train.policies.base.stream_uniforms``), so a row's tokens do
     not depend on the other rows of the batch (``sample_rows`` takes requests with
     different ``n``; ``sample`` seeds transcript i from ``config.seed`` and i);
  5. decoding runs one token per forward for every unfinished row; a row finishes when
     its text so far contains a stop string (``</tool_call>``, ``</answer>``) or it
     emits an end-of-sequence token (``DecodeBatch``). Keys/values grow in place in
     preallocated buffers (``BufferLayer``: no copy of the whole cache per token), and
     finished rows stay in the batch, fed padding, until fewer than ``COMPACT_BELOW`` of
     it (or at most ``FEW_ROWS`` rows) are live; then the cache is compacted
     (``batch_select_indices``). The tokens and logprobs are the same bits as dropping
     each finished row at once (one torch thread).

Prefix cache across calls. The keys/values every row computed (its prompt, and its
prompt plus the step it generated) are kept in a ``PrefixCache`` (``prefix_cache_mib``,
least recently used out; emptied whenever the weights change in place), and a later
prompt is prefilled from its longest cached proper prefix: the next step of a rollout
computes only its new observation (and the re-rendered action when its tokens differ),
not the whole transcript. The row's cached part sits left of its new tokens, with
padding between (masked) and positions continuing the cached ones. The tokens are the
same as with a full prefill (logprobs equal up to float summation order, ~1e-6);
``prefill_tokens`` counts what was computed. ``prefix_cache_mib=0`` turns it off.

Threads. On CPU the constructor sets torch's threads (``configure_threads``):
``$RTREES_THREADS``, else ``$OMP_NUM_THREADS`` as torch read it, else one thread for a
model under ``SMALL_MODEL_PARAMS`` (the tiny model: several threads only spin) and the
usable CPUs (``os.sched_getaffinity``) otherwise.

Per-token values. ``logprobs[i]`` and ``entropies[i]`` are those of the model's
untempered next-token distribution softmax(z), the policy that ``score`` evaluates,
whatever ``temperature`` / ``top_p`` the tokens were drawn with (those two are kept
in ``Continuation.meta``). ``top_p`` always keeps the most likely token, so a tiny
``top_p`` (e.g. 1e-9) is greedy decoding. The text of a continuation is the decoding
of its tokens (a trailing end-of-sequence token is kept in ``token_ids`` but not in
``text``). ``score`` tokenizes the action text: it equals ``sample``'s logprobs for
every continuation whose tokens are the canonical tokenization of its text.

Layout (one module per part): ``render`` (chat rendering, ``ChatRenderer``),
``versions`` (weight versions and checkpoint checks), ``kvcache`` (``PrefixCache``,
``BufferLayer``), ``decode`` (the continuously batched decoder, ``DecodeBatch``) and
``policy`` (``HFPolicy``, threads). Every name is re-exported here: import from
``train.policies.hf``. A constant that tests or benchmarks patch lives in its module
(``train.policies.hf.decode.COMPACT_BELOW``, ``FEW_ROWS``, ``DROP_COLUMNS_FROM``).
"""

from train.policies.hf.decode import (
    COMPACT_BELOW,
    DROP_COLUMNS_FROM,
    FEW_ROWS,
    DecodeBatch,
    widened,
)
from train.policies.hf.kvcache import BufferLayer, PrefixCache, buffered_cache
from train.policies.hf.policy import (
    SMALL_MODEL_PARAMS,
    THREADS_ENV,
    HFPolicy,
    auto_threads,
    configure_threads,
    usable_cpus,
)
from train.policies.hf.render import (
    PIECE_CACHE_ENTRIES,
    ROLE_CONCAT_TEMPLATE,
    ChatRenderer,
    ObservationRole,
    transcript_messages,
)
from train.policies.hf.versions import (
    check_finite,
    quiet_progress,
    recorded_version,
    require_checkpoint_dir,
    state_dict_version,
    weights_version,
)

__all__ = [
    "COMPACT_BELOW",
    "DROP_COLUMNS_FROM",
    "FEW_ROWS",
    "PIECE_CACHE_ENTRIES",
    "ROLE_CONCAT_TEMPLATE",
    "SMALL_MODEL_PARAMS",
    "THREADS_ENV",
    "BufferLayer",
    "ChatRenderer",
    "DecodeBatch",
    "HFPolicy",
    "ObservationRole",
    "PrefixCache",
    "auto_threads",
    "buffered_cache",
    "check_finite",
    "configure_threads",
    "quiet_progress",
    "recorded_version",
    "require_checkpoint_dir",
    "state_dict_version",
    "transcript_messages",
    "usable_cpus",
    "weights_version",
    "widened",
]
