"""Fake (meta) registrations for torch.ops.tonp.* (imported once the extension is loaded), so
torch.compile and meta tensors see shapes and dtypes. Autograd is C++ (csrc/autograd.cpp):
forward = the invariant kernel; backward = the *_backward / *_grad ops below (gradients need to
be correct, not invariant, and are deterministic)."""
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


@torch.library.register_fake(_lib + "moe_experts_train")
def _(x, expert_ids, gate_up, down, first_expert, chunks):
    R = x.shape[0] * expert_ids.shape[1]
    return (x.new_empty((x.shape[0], expert_ids.shape[1], x.shape[1])),
            x.new_empty((R, gate_up.shape[1])))


@torch.library.register_fake(_lib + "moe_experts_grad")
def _(grad, x, expert_ids, gate_up, down, gate_up_out, first_expert, chunks, output_mask):
    return tuple(torch.empty_like(t) if want else t.new_empty(0)
                 for t, want in zip((x, gate_up, down), output_mask))


@torch.library.register_fake(_lib + "linear_backward")
def _(grad, x, weight, output_mask, bias_dtype):
    return (torch.empty_like(x) if output_mask[0] else x.new_empty(0),
            torch.empty_like(weight) if output_mask[1] else weight.new_empty(0),
            grad.new_empty(grad.shape[1], dtype=bias_dtype or grad.dtype) if output_mask[2]
            else grad.new_empty(0))


@torch.library.register_fake(_lib + "rms_norm_backward")
def _(grad, x, weight, eps, output_mask):
    return tuple(torch.empty_like(t) if want else t.new_empty(0)
                 for t, want in zip((x, weight), output_mask))


@torch.library.register_fake(_lib + "silu_mul_backward")
def _(grad, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


@torch.library.register_fake(_lib + "rope_backward")
def _(grad, cos, sin, positions, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


@torch.library.register_fake(_lib + "moe_route_backward")
def _(grad_weights, router_logits, expert_ids, weights, normalize):
    return torch.empty_like(router_logits)


@torch.library.register_fake(_lib + "moe_combine_backward")
def _(grad, weights, expert_out, output_mask):
    return tuple(torch.empty_like(t) if want else t.new_empty(0)
                 for t, want in zip((weights, expert_out), output_mask))


@torch.library.register_fake(_lib + "embedding_backward")
def _(grad, ids, num_rows):
    return grad.new_empty((num_rows, grad.shape[-1]))


@torch.library.register_fake(_lib + "rope")
def _(x, cos, sin, positions):
    return torch.empty_like(x)


@torch.library.register_fake(_lib + "attention_varlen_backward")
def _(grad, q, k, v, out, cu_seqlens, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Autograd: every differentiable op has C++ autograd (csrc/autograd.cpp), whose backward calls
# the *_backward / *_grad ops registered above.
