"""What a step node records of its action text: segments and entropies.

* ``segments`` split the action tokens by the text they decode to: the
  ``<tool_call>...</tool_call>`` blocks are ``tool_call``, the
  ``<answer>...</answer>`` blocks ``answer``, and the rest is ``summary`` in a
  step that answers and ``text`` (reasoning) in any other step [R]
  (``action_segments``, with the token offsets of ``token_char_starts``);
* ``head_entropy``: the mean token entropy of a step's first tokens (BEL's E1-E2,
  the entropy sampler).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np

from rollout_store.schema import SegmentKind
from rollout_store.tree import Node, Segment
from train.policies.base import Continuation, Policy

_BLOCK_RE = re.compile(r"<tool_call>.*?</tool_call>|<answer>.*?</answer>", re.DOTALL)


def head_entropy(node: Node, n_tokens: int | None = None) -> float:
    """Mean entropy of the first ``n_tokens`` action tokens of ``node`` (all when None);
    NaN for a node without tokens."""
    ent = node.action_entropies if n_tokens is None else node.action_entropies[:n_tokens]
    return float(np.mean(ent)) if len(ent) else math.nan


def token_char_starts(policy: Policy, cont: Continuation) -> list[int]:
    """Character offset in ``cont.text`` where each token starts.

    In order of preference: the policy's ``token_texts()`` (each token id decoded
    alone, as ``HFPolicy`` offers) summed up; its ``decode(token_ids) -> str``
    applied to growing prefixes; one token per character when the counts match
    (a character tokenizer); else tokens spread evenly over the text [R: an
    approximation that moves segment borders by a token or so]. Offsets are
    clamped to the text (a trailing EOS token decodes to nothing in ``text``).
    """
    ids, text = cont.token_ids, cont.text
    n = len(ids)
    if not n:
        return []
    token_texts = getattr(policy, "token_texts", None)
    if callable(token_texts):
        table = token_texts()
        if all(0 <= i < len(table) for i in ids):
            lengths = np.cumsum([0] + [len(table[i]) for i in ids[:-1]])
            return [min(int(x), len(text)) for x in lengths]
    decode = getattr(policy, "decode", None)
    if callable(decode):
        try:
            return [min(len(str(decode(ids[:i]))), len(text)) for i in range(n)]
        except Exception:  # a decode that cannot do prefixes: fall back
            pass
    if n == len(text):
        return list(range(n))
    return [(i * len(text)) // n for i in range(n)]


def action_segments(text: str, char_starts: Sequence[int]) -> list[Segment]:
    """Token spans of an action: ``tool_call`` / ``answer`` blocks, the rest ``summary``
    (in a step that answers) or ``text`` (elsewhere). Every token is in one segment."""
    n = len(char_starts)
    if n == 0:
        return []
    blocks = [(m.start(), m.end(), "tool_call" if m.group().startswith("<tool_call>")
               else "answer") for m in _BLOCK_RE.finditer(text)]
    rest: SegmentKind = "summary" if any(k == "answer" for *_, k in blocks) else "text"
    labels: list[SegmentKind] = []
    b = 0
    for c in char_starts:
        while b < len(blocks) and blocks[b][1] <= c:
            b += 1
        inside = b < len(blocks) and blocks[b][0] <= c < blocks[b][1]
        labels.append(blocks[b][2] if inside else rest)  # type: ignore[arg-type]
    segments: list[Segment] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or labels[i] != labels[start]:
            segments.append(Segment(labels[start], start, i))
            start = i
    return segments


__all__ = ["action_segments", "head_entropy", "token_char_starts"]
