"""Text in and out of the service: the checkpoint's tokenizer and chat template when it ships
them (transformers' AutoTokenizer, read from the checkpoint directory only), else token ids only.

Without a tokenizer, text prompts and chat requests are refused with a message that says so,
completions come back as token ids (`token_ids` on each choice) with an empty `text`, and a
token's string is "token_id:<id>" (vLLM's convention).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TextCodec:
    """Encode prompts, render chats and decode completions for one checkpoint directory."""

    def __init__(self, path: Optional[str] = None):
        self.tokenizer = None
        if path and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(path)

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def eos_ids(self) -> List[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [eos] if isinstance(eos, int) else []

    def encode(self, text: str, what: str, add_special_tokens: bool = False) -> List[int]:
        if self.tokenizer is None:
            raise ValueError(f"{what} is text, but this model has no tokenizer (the checkpoint "
                             f"directory holds none of {', '.join(TOKENIZER_FILES)}): send "
                             f"token ids instead")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def chat(self, messages: List[Dict], add_special_tokens: bool = False,
             **template_kwargs) -> List[int]:
        """The prompt of a chat: the checkpoint's chat template with the generation prompt."""
        if not self.has_chat_template:
            why = "no tokenizer" if self.tokenizer is None else "a tokenizer without a " \
                "chat_template"
            raise ValueError(f"/v1/chat/completions needs the checkpoint's chat template, but "
                             f"this model has {why}; use /v1/completions or /generate with "
                             f"token ids")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **template_kwargs)
        return self.encode(text, "the chat", add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "" if self.tokenizer is None else \
            self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int, as_id: bool = False) -> str:
        """A token's string (vLLM's "token_id:<id>" with as_id or without a tokenizer)."""
        return f"token_id:{token_id}" if as_id or self.tokenizer is None else \
            self.decode([token_id])


class Detokenizer:
    """Incremental text of a growing completion: `add(ids)` returns the new text, holding back
    a trailing incomplete UTF-8 character ("\ufffd") until the next token completes it (or the
    end). Each call decodes a window of a few tokens (from the last emitted boundary), not the
    whole completion, as vLLM's and TGI's incremental detokenizers do."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = False):
        self.codec, self.ids, self.skip = codec, [], skip_special_tokens
        self.prefix, self.read = 0, 0      # the window's start, and where its new text starts

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(ids)
        before = self.codec.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.codec.decode(self.ids[self.prefix:], self.skip)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class StopText:
    """The text of a growing completion cut at the first stop string it completes (vLLM's
    semantics): `add(ids)` -> the stop string its tokens completed, or None. `text` is the
    completion's text, trimmed before the stop string (through it with `include`); `visible`
    holds back, until the end, a tail that may be the start of a stop string."""

    def __init__(self, codec: TextCodec, stops: Sequence[str], include: bool = False,
                 skip_special_tokens: bool = True):
        self.detok = Detokenizer(codec, skip_special_tokens)
        self.stops, self.include, self.text, self.hit = list(stops), include, "", None
        self.hold = max(map(len, self.stops), default=1) - 1 if not include else 0

    def add(self, ids: Sequence[int], final: bool = False) -> Optional[str]:
        if self.hit is not None:
            return None
        before = len(self.text)
        self.text += self.detok.add(ids, final)
        found = [(i, -len(s), s) for s in self.stops
                 for i in [self.text.find(s, max(0, before - len(s) + 1))] if i >= 0]
        if found:           # the earliest in the text (then the longest)
            i, _, s = min(found)
            self.text, self.hit = self.text[:i + len(s) if self.include else i], s
        return self.hit

    def visible(self, done: bool) -> str:
        return self.text if done or self.hit is not None else \
            self.text[:max(len(self.text) - self.hold, 0)]
