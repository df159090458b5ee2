"""SGCD's contrast reference (docs/METHODS.md Q2): a successful and a failed sibling of a
tree, summarised into a training-only hint.

* ``contrast_pair``: the best successful trajectory and the failed one closest to it;
* ``template`` (``TemplateSummariser``): a deterministic stand-in for the paper's LLM
  summary (the first step at which the two differ, rendered as a hint);
* ``hf:PATH`` (``HFSummariser``): a local chat model prompted with both transcripts
  (loaded with ``trust_remote_code=False``), greedy.

``reference(tree, summariser)`` is the reference of one tree, or None when the tree
lacks either outcome.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Final, Protocol

from rollout_store.tree import Node, Tree

SUCCESS: Final[float] = 1.0
"""A trajectory succeeds when its leaf reward is >= this (the trainer's success)."""

Path_ = Sequence[Node]


class Summariser(Protocol):
    def __call__(self, prompt: str, success: Path_, failed: Path_) -> str:
        """The reference text contrasting two root-to-leaf paths of one task."""
        ...


def contrast_pair(tree: Tree) -> tuple[list[Node], list[Node]] | None:
    """(best successful path, closest failed path), each root first, or None.

    Best success: highest leaf reward, first in preorder on ties. Closest failure: the
    failed leaf whose path shares the most nodes with the best success's, first in
    preorder on ties (Q2 [R]).
    """
    leaves = [n for n in tree.leaves() if n.reward is not None and n.parent_id is not None]
    good = [n for n in leaves if n.reward is not None and n.reward >= SUCCESS]
    bad = [n for n in leaves if n.reward is not None and n.reward < SUCCESS]
    if not good or not bad:
        return None
    best = max(good, key=lambda n: n.reward or 0.0)  # max keeps the first of ties
    success = tree.path_to(best.node_id)
    on_success = {n.node_id for n in success}

    def shared(leaf: Node) -> int:
        return sum(1 for n in tree.path_to(leaf.node_id) if n.node_id in on_success)

    closest = max(bad, key=shared)
    return success, tree.path_to(closest.node_id)


def first_difference(success: Path_, failed: Path_) -> tuple[int, str, str] | None:
    """(step k >= 1, successful action, failed action) at the first step whose action
    texts differ (a missing step reads ``(no step)``), or None when they never differ."""
    depth = max(len(success), len(failed))
    for k in range(1, depth):
        a = success[k].action_text if k < len(success) else "(no step)"
        b = failed[k].action_text if k < len(failed) else "(no step)"
        if (a or "") != (b or ""):
            return k, a or "", b or ""
    return None


class TemplateSummariser:
    """Q2 ``template``: the deterministic stand-in for the paper's LLM summary."""

    def __call__(self, prompt: str, success: Path_, failed: Path_) -> str:
        diff = first_difference(success, failed)
        if diff is None:
            steps = " then ".join(n.action_text or "" for n in success[1:])
            return f"Hint from a solved attempt: its steps were {steps}."
        k, good, bad = diff
        return (f"Hint from a solved attempt: at step {k}, do {good} "
                f"(a failed attempt did {bad}).")


_INSTRUCTION = ("Two attempts at the same task follow, one that succeeded and one that "
                "failed. In one or two sentences, say which step made the difference and "
                "what to do at that step. Do not restate the task.")


def _render_path(path: Path_) -> str:
    lines = []
    for k, n in enumerate(path[1:], start=1):
        lines.append(f"Step {k}: {n.action_text or ''}")
        if n.observation_text:
            lines.append(f"Result {k}: {n.observation_text}")
    return "\n".join(lines)


@lru_cache(maxsize=2)
def _load_chat_model(path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False)
    model.eval()
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"summariser hf:{path}: the tokenizer has no chat template")
    return tokenizer, model


class HFSummariser:
    """Q2 ``hf:PATH``: a local chat model (the paper's external LLM), greedy decoding."""

    def __init__(self, path: str, max_new_tokens: int = 96) -> None:
        self.path = path
        self.max_new_tokens = max_new_tokens

    def __call__(self, prompt: str, success: Path_, failed: Path_) -> str:
        import torch

        tokenizer, model = _load_chat_model(self.path)
        content = (f"{_INSTRUCTION}\n\nTask:\n{prompt}\n\nSucceeded:\n{_render_path(success)}"
                   f"\n\nFailed:\n{_render_path(failed)}")
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id
                                 if tokenizer.pad_token_id is not None
                                 else tokenizer.eos_token_id)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        return f"Hint from a solved attempt: {reply.strip()}"


def make_summariser(spec: str) -> Summariser:
    """``template`` or ``hf:PATH`` (Q2); a one-line ValueError otherwise."""
    if spec == "template":
        return TemplateSummariser()
    if spec.startswith("hf:") and len(spec) > 3:
        return HFSummariser(spec[3:])
    raise ValueError(f"unknown summariser {spec!r}; use 'template' or 'hf:PATH'")


def reference(tree: Tree, summariser: Summariser) -> str | None:
    """The contrast reference of ``tree`` (Q2), or None without both outcomes."""
    pair = contrast_pair(tree)
    if pair is None:
        return None
    success, failed = pair
    return summariser(tree.root().observation_text or "", success, failed)


__all__ = ["SUCCESS", "HFSummariser", "Summariser", "TemplateSummariser", "contrast_pair",
           "first_difference", "make_summariser", "reference"]
