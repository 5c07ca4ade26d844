"""A byte-level Hugging Face tokenizer built locally (no hub), for the tiny preset's vocabulary.

    tok = byte_tokenizer()          # transformers.PreTrainedTokenizerFast
    tok("407>")["input_ids"]        # [52, 48, 55, 62]: byte b is id b

Ids 0..255 are the UTF-8 bytes; <|endoftext|> 256 (bos, also the pad token), <|im_end|> 257
(eos), <|im_start|> 258: the tiny preset's bos / eos ids. Frameworks that take a
`processing_class` (TRL) run on it offline.
"""
from __future__ import annotations

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def byte_tokenizer():
    """A `PreTrainedTokenizerFast`: byte-level, no merges, a ChatML template, pad = bos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab.update({"<|endoftext|>": 256, "<|im_end|>": 257, "<|im_start|>": 258})
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    return fast


__all__ = ["byte_tokenizer", "CHAT_TEMPLATE"]
