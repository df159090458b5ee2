"""Chat rendering of ``hf:PATH`` and ``vllm:PATH``: transcripts to chat messages
(``transcript_messages``) and to prompt token ids (``ChatRenderer``); the mapping is in
the package docstring (``train.policies.hf``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from train.policies.base import (
    Transcript,
)

ObservationRole = Literal["user", "tool"]
_RESPONSE_OPEN, _RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def transcript_messages(transcript: Transcript, observation_role: ObservationRole = "user",
                        system: str | None = None) -> list[dict[str, str]]:
    """Chat messages of a transcript (mapping in the package docstring, ``train.policies.hf``)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for role, text in transcript:
        if role == "prompt":
            messages.append({"role": "user", "content": text})
        elif role == "action":
            messages.append({"role": "assistant", "content": text})
        elif role == "observation":
            if observation_role == "tool":
                if text.startswith(_RESPONSE_OPEN) and text.endswith(_RESPONSE_CLOSE):
                    text = text[len(_RESPONSE_OPEN):-len(_RESPONSE_CLOSE)]
                messages.append({"role": "tool", "content": text})
            else:
                messages.append({"role": "user", "content": text})
        else:
            raise ValueError(f"unknown turn role {role!r}")
    return messages


# A chat template that writes each message as ``<|role|>`` + content and ends with
# ``<|assistant|>`` to generate: the tiny policy's (``train.policies.tiny``). Its rendering
# is a concatenation of per-message pieces, each starting with a role token.
ROLE_CONCAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)
PIECE_CACHE_ENTRIES = 65_536  # per renderer; cleared when full


@dataclass(frozen=True)
class ChatRenderer:
    """Transcripts to prompt token ids through a tokenizer's chat template (shared by
    the HF and vLLM backends).

    Fast path (``piecewise``): with ``ROLE_CONCAT_TEMPLATE``, no system text and no
    tools, the prompt ids of a transcript are the concatenation of each message's ids,
    ``ids(<|r1|>c1 <|r2|>c2 ... <|assistant|>) = ids(<|r1|>c1) + ids(<|r2|>c2) + ... +
    ids(<|assistant|>)``, with each piece's ids cached. This is exact when every role
    token is an added token that no other added token contains and that no text
    before it can merge into; construction checks that on the tokenizer and on a probe
    transcript, and otherwise renders and tokenizes the whole transcript each time
    (as every other template does: a step re-tokenizes its whole transcript).
    """

    tokenizer: Any
    observation_role: ObservationRole = "user"
    system: str | None = None
    tools: list[dict[str, Any]] | None = None

    piecewise: bool = field(init=False, default=False)
    _pieces: dict[tuple[str, str], list[int]] = field(init=False, default_factory=dict,
                                                      repr=False, compare=False)

    def __post_init__(self) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; hf:PATH and vllm:PATH "
                             "need a chat model")
        if self.observation_role not in ("user", "tool"):
            raise ValueError(f"observation_role must be 'user' or 'tool', "
                             f"got {self.observation_role!r}")
        object.__setattr__(self, "piecewise", self._piecewise_exact())

    def _piecewise_exact(self) -> bool:
        """Whether the fast path of the class docstring gives the template's ids."""
        if (str(self.tokenizer.chat_template).strip() != ROLE_CONCAT_TEMPLATE
                or self.system is not None or self.tools):
            return False
        roles = {f"<|{r}|>" for r in ("user", "assistant", "tool")}
        added = {str(t.content): t for t in
                 getattr(self.tokenizer, "added_tokens_decoder", {}).values()}
        for role in roles:
            token = added.get(role)
            if token is None or token.lstrip or token.rstrip:
                return False
            # another added token could match across a piece boundary: one with a proper
            # suffix that begins a role token (or that holds one)
            if any(role.startswith(other[k:]) or other[k:].startswith(role)
                   for other in added if other not in roles for k in range(1, len(other))):
                return False
        probe: Transcript = [("prompt", "a <b> c\n"), ("action", " x y"),
                             ("observation", "\n<tool_response>1</tool_response> "),
                             ("action", "<answer>2</answer>"), ("observation", "")]
        for end in range(1, len(probe) + 1):
            if probe[end - 1][0] == "action":
                continue
            whole = self.encode(self.render(probe[:end]))
            if whole != self._piece_ids(probe[:end]):
                return False
        return True

    def _piece_ids(self, transcript: Transcript) -> list[int]:
        """The fast path's ids: each message's cached ids, then ``<|assistant|>``'s."""
        if len(self._pieces) > PIECE_CACHE_ENTRIES:
            self._pieces.clear()
        ids: list[int] = []
        for message in [*transcript_messages(transcript, self.observation_role),
                        {"role": "assistant", "content": ""}]:
            key = (message["role"], message["content"])
            piece = self._pieces.get(key)
            if piece is None:
                piece = self.encode(f"<|{key[0]}|>{key[1]}")
                self._pieces[key] = piece
            ids += piece
        return ids

    def render(self, transcript: Transcript, add_generation_prompt: bool = True) -> str:
        """The chat-template text of a transcript (generation prompt appended)."""
        messages = transcript_messages(transcript, self.observation_role, self.system)
        kwargs: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def prompt_ids(self, transcript: Transcript) -> list[int]:
        """Token ids of the prompt that one step continues."""
        if not transcript:
            raise ValueError("empty transcript: it needs at least the prompt")
        if transcript[-1][0] == "action":
            raise ValueError("the transcript ends with an action; a step continues a "
                             "prompt or an observation")
        if self.piecewise:
            return self._piece_ids(transcript)
        return self.encode(self.render(transcript))
