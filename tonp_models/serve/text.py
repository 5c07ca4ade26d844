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

    def encode(self, text: str, what: str) -> List[int]:
        if self.tokenizer is None:
            raise ValueError(f"{what} is text, but this model has no tokenizer (the checkpoint "
                             f"directory holds none of {', '.join(TOKENIZER_FILES)}): send "
                             f"token ids instead")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(self, messages: List[Dict], **template_kwargs) -> List[int]:
        """The prompt of a chat: the checkpoint's chat template with the generation prompt."""
        if not self.has_chat_template:
            why = "no tokenizer" if self.tokenizer is None else "a tokenizer without a " \
                "chat_template"
            raise ValueError(f"/v1/chat/completions needs the checkpoint's chat template, but "
                             f"this model has {why}; use /v1/completions or /generate with "
                             f"token ids")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True, **template_kwargs)
        return self.encode(text, "the chat")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "" if self.tokenizer is None else \
            self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokenizer is None else self.decode([token_id])


class Detokenizer:
    """Incremental text of a growing completion: `add(ids)` returns the new text, holding back
    a trailing incomplete UTF-8 character ("\ufffd") until the next token completes it."""

    def __init__(self, codec: TextCodec):
        self.codec, self.ids, self.sent = codec, [], 0

    def add(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta
