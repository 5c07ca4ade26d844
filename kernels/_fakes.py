"""The fake (meta) kernel of every tonp op with tensors: its outputs' shapes and dtypes, for meta
tensors and torch.compile. Each function is named after its op (table.py's `schema` rows) and
registered by _register.py."""
from __future__ import annotations

import torch



def linear(x, weight, bias, chunks, out_dtype, weight_groups=None):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype)


def rms_norm(x, weight, eps):
    return torch.empty_like(x)


def silu_mul(gate, up):
    return torch.empty_like(gate)


def attention_varlen(q, k, v, cu_seqlens, scale, block):
    return torch.empty_like(q)


def attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, scale):
    return torch.empty_like(q)


def lse_partial(logits, temperature, chunks):
    m = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return m, torch.empty_like(m)


def lse_finish(maxes, sums):
    return maxes.new_empty(maxes.shape[1:])


def max_with_index(logits):
    v = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    return v, logits.new_empty(logits.shape[:-1], dtype=torch.int64)


def argmax(logits):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


def token_logprobs(logits, targets, temperature, chunks):
    return logits.new_empty(logits.shape[:-1], dtype=torch.float32)


def sample(logits, temperature, top_k, top_p, seed, request_ids, positions):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


def moe_route(router_logits, top_k, normalize):
    shape = (router_logits.shape[0], top_k)
    return (router_logits.new_empty(shape, dtype=torch.int64),
            router_logits.new_empty(shape, dtype=torch.float32))


def moe_combine(weights, expert_out):
    return expert_out.new_empty((expert_out.shape[0], expert_out.shape[2]))


def moe_experts(x, expert_ids, gate_up, down, first_expert, chunks, gate_up_groups=None,
                down_groups=None):
    return x.new_empty((x.shape[0], expert_ids.shape[1], x.shape[1]))


def moe_experts_backward(grad, x, expert_ids, gate_up, down, first_expert, output_mask):
    return tuple(torch.empty_like(t) if want else t.new_empty(0)
                 for t, want in zip((x, gate_up, down), output_mask))


def moe_experts_train(x, expert_ids, gate_up, down, first_expert, chunks):
    R = x.shape[0] * expert_ids.shape[1]
    return (x.new_empty((x.shape[0], expert_ids.shape[1], x.shape[1])),
            x.new_empty((R, gate_up.shape[1])))


def moe_experts_grad(grad, x, expert_ids, gate_up, down, gate_up_out, first_expert, chunks,
                     output_mask):
    return tuple(torch.empty_like(t) if want else t.new_empty(0)
                 for t, want in zip((x, gate_up, down), output_mask))


def linear_backward(grad, x, weight, output_mask, bias_dtype):
    return (torch.empty_like(x) if output_mask[0] else x.new_empty(0),
            torch.empty_like(weight) if output_mask[1] else weight.new_empty(0),
            grad.new_empty(grad.shape[1], dtype=bias_dtype or grad.dtype) if output_mask[2]
            else grad.new_empty(0))


def rms_norm_backward(grad, x, weight, eps, output_mask):
    return tuple(torch.empty_like(t) if want else t.new_empty(0)
                 for t, want in zip((x, weight), output_mask))


def silu_mul_backward(grad, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def rope_backward(grad, cos, sin, positions, dtype):
    return grad.new_empty(grad.shape, dtype=dtype)


def moe_route_backward(grad_weights, router_logits, expert_ids, weights, normalize):
    return torch.empty_like(router_logits)


def moe_combine_backward(grad, weights, expert_out, output_mask):
    return tuple(torch.empty_like(t) if want else t.new_empty(0)
                 for t, want in zip((weights, expert_out), output_mask))


def embedding_backward(grad, ids, num_rows):
    return grad.new_empty((num_rows, grad.shape[-1]))


def rope(x, cos, sin, positions):
    return torch.empty_like(x)


def attention_varlen_backward(grad, q, k, v, out, cu_seqlens, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
