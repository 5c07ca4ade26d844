"""Fake (meta) implementations of torch.ops.tonp.*: output shapes and dtypes only, for
torch.compile and meta tensors (imported once the extension is loaded; autograd is C++)."""
from __future__ import annotations

import torch

_lib = "tonp::"


@torch.library.register_fake(_lib + "linear")
def _(x, weight, bias, chunks, out_dtype):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype)


@torch.library.register_fake(_lib + "rms_norm")
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake(_lib + "silu_mul")
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.register_fake(_lib + "attention_varlen")
def _(q, k, v, cu_seqlens, scale, block):
    return torch.empty_like(q)


@torch.library.register_fake(_lib + "attention_paged")
def _(q, k_cache, v_cache, page_table, q_seq, q_pos, scale):
    return torch.empty_like(q)


@torch.library.register_fake(_lib + "lse_partial")
def _(logits, temperature, chunks):
    m = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return m, torch.empty_like(m)


@torch.library.register_fake(_lib + "lse_finish")
def _(maxes, sums):
    return maxes.new_empty(maxes.shape[1:])


@torch.library.register_fake(_lib + "max_with_index")
def _(logits):
    v = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return v, logits.new_empty(logits.shape[:-1], dtype=torch.int64)


@torch.library.register_fake(_lib + "argmax")
def _(logits):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


@torch.library.register_fake(_lib + "token_logprobs")
def _(logits, targets, temperature, chunks):
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32)


@torch.library.register_fake(_lib + "sample")
def _(logits, temperature, top_k, top_p, seed, request_ids, positions):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


@torch.library.register_fake(_lib + "moe_route")
def _(logits, top_k, normalize):
    shape = (logits.shape[0], top_k)
    return (logits.new_empty(shape, dtype=torch.int64),
            logits.new_empty(shape, dtype=torch.float32))


@torch.library.register_fake(_lib + "moe_combine")
def _(weights, expert_out):
    return expert_out.new_empty((expert_out.shape[0], expert_out.shape[2]))


@torch.library.register_fake(_lib + "moe_experts")
def _(x, expert_ids, gate_up, down, first_expert, chunks):
    return x.new_empty((x.shape[0], expert_ids.shape[1], x.shape[1]))


@torch.library.register_fake(_lib + "moe_experts_backward")
def _(grad, x, expert_ids, gate_up, down, first_expert, output_mask):
    return tuple(torch.empty_like(t) if want else t.new_empty(0)
                 for t, want in zip((x, gate_up, down), output_mask))


@torch.library.register_fake(_lib + "rope")
def _(x, cos, sin, positions):
    return torch.empty_like(x)
