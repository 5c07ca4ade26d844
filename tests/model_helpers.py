"""Helpers shared by the model tests: tiny random configs, the transformers oracle, kernel modes."""
from __future__ import annotations

import torch

import tonp_kernels as tk
from tonp_models import Qwen3MoeConfig, Qwen3MoeForCausalLM

# Random tiny configs covering the layer kinds: a dense layer via mlp_only_layers,
# decoder_sparse_step > 1, norm_topk_prob False, tied embeddings, GQA 4:1 and 2:1.
CONFIGS = {
    "mlp_only": dict(mlp_only_layers=[1], norm_topk_prob=True),
    "sparse_step2": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[],
                         norm_topk_prob=False),
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=1, mlp_only_layers=[]),
}


def tiny_config(name: str = "mlp_only", **overrides) -> Qwen3MoeConfig:
    # A wider init than HF's 0.02 gives peaked logits and decisive routing (no near-ties
    # that a 1e-7 difference between implementations could flip).
    base = dict(num_hidden_layers=3, initializer_range=0.08, max_position_embeddings=256)
    return Qwen3MoeConfig.preset("tiny", **{**base, **CONFIGS[name], **overrides})


def tiny_model(name: str = "mlp_only", seed: int = 0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(tiny_config(name, **overrides), dtype=dtype)


def invariant_built() -> bool:
    """True, or ImportError saying how to build: for test files that still write
    `skipif(not invariant_built())`, which therefore never skips (a missing build fails)."""
    tk.isa()
    return True


def use_mode(mode: str):
    """tk.use(mode), for the tests that run one body in both kernel modes. Invariant mode needs
    the C++ build: without it the test fails (ImportError saying how to build), never skips."""
    return tk.use(mode)


def hf_twin(model: Qwen3MoeForCausalLM, tmp_path):
    """transformers' Qwen3MoeForCausalLM with the same weights (through save_pretrained)."""
    import transformers
    path = tmp_path / "hf_twin"
    model.save_pretrained(path)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                          dtype=model.dtype)
    return hf.eval()


def packed(seqs):
    """(ids [T], cu_seqlens int32 [S+1]) of a list of 1-D sequences."""
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0)
    return torch.cat(seqs), cu


def random_seqs(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
