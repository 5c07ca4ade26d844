"""The invariant backend: the tonp ops (`torch.ops.tonp.*`) behind the public ops; signatures
mirror stock.py (the op table, table.py, lists both). The C++ dispatcher picks each op's kernel by
device: the C++ kernels (csrc/) for CPU tensors, the Triton kernels (accel/, registered by
_register.py) for CUDA / NPU tensors; under `use(..., backend="triton")` CPU tensors go through
Triton's interpreter (_interpreted.py). The ops check
their tensors; Python checks only what a reshape here needs, and the composites (lse + gather)
whose kernels would name another op. Every op handle is called directly: autograd is registered
in C++ for every device, so a call without gradients costs one dispatcher hop, never
torch.library's Python autograd wrapper."""
from __future__ import annotations

import math

import torch

from . import _arg_checks as check, _op_checks as opcheck
from ._library import op
from .stock import gather_logit, target_logit, true_div  # noqa: F401  (one gather, one division)

_LINEAR, _RMS_NORM, _SILU_MUL = op("linear"), op("rms_norm"), op("silu_mul")
_ATTENTION_VARLEN, _ATTENTION_PAGED, _ROPE = (op("attention_varlen"), op("attention_paged"),
                                              op("rope"))
_MOE_ROUTE, _MOE_COMBINE, _MOE_EXPERTS = op("moe_route"), op("moe_combine"), op("moe_experts")
_LSE_PARTIAL, _LSE_FINISH, _TOKEN_LOGPROBS = (op("lse_partial"), op("lse_finish"),
                                              op("token_logprobs"))
_ARGMAX, _MAX_WITH_INDEX, _SAMPLE = op("argmax"), op("max_with_index"), op("sample")


# --- linear, normalisation, elementwise, attention, MoE ---------------------------------------
def linear(x, weight, bias, chunks, out_dtype, weight_groups=None):
    if x.dim() == 2:  # the decode / training shape: no reshapes (each costs ~3 us)
        return _LINEAR(x, weight, bias, chunks, out_dtype, weight_groups)
    check.floats(x, op="linear", name="x", layout="[..., K]")
    y = _LINEAR(x.reshape(-1, x.shape[-1]), weight, bias, chunks, out_dtype, weight_groups)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# The ops whose arguments the C++ op takes as they are: the op handle itself (no Python frame).
rms_norm = _RMS_NORM                   # (x [..., H], weight [H], eps)
silu_mul = _SILU_MUL                   # (gate, up)
attention_varlen = _ATTENTION_VARLEN   # (q, k, v, cu_seqlens, scale, block)
attention_paged = _ATTENTION_PAGED     # (q, k_cache, v_cache, page_table, q_seq, q_pos, scale)
rope = _ROPE                           # (x, cos, sin, positions)
moe_route = _MOE_ROUTE                 # (router_logits [M, E], top_k, normalize)
moe_experts = _MOE_EXPERTS             # (x, expert_ids, gate_up, down, first_expert, chunks,
#                                         gate_up_groups, down_groups)


def moe_combine(weights, expert_out):
    if weights.dtype != torch.float32:  # bfloat16 routing weights are widened (exact)
        check.floats(weights, op="moe_combine", name="weights", dims=2, layout="[M, K]")
        weights = weights.float()
    return _MOE_COMBINE(weights, expert_out)


# --- vocabulary reductions ---------------------------------------------------------------------
def _partial(op, logits, temperature, chunks, softmax):
    """(max, sum) of one chunk tree over logits [..., V], refusing rows no softmax exists for."""
    lead = logits.shape[:-1]
    m, s = _LSE_PARTIAL(logits.reshape(-1, logits.shape[-1]), temperature, chunks)
    check.row_maxima(m, temperature, op=op, softmax=softmax, sums=s)
    return m.reshape(lead), s.reshape(lead)


def _lse(op, logits, temperature, chunks, softmax):
    opcheck.vocab(op, logits, chunks)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogSumExp.apply(logits, temperature, chunks, op, softmax)
    m, s = _partial(op, logits, temperature, chunks, softmax)  # no autograd node
    return _finish(m.unsqueeze(0), s.unsqueeze(0))


class _LogSumExp(torch.autograd.Function):
    """Forward: the chunk-tree kernel. Backward: d lse / dx = softmax(x / T) / T (torch math)."""

    @staticmethod
    def forward(ctx, logits, temperature, chunks, op, softmax):
        ctx.save_for_backward(logits)
        ctx.temperature = temperature
        m, s = _partial(op, logits, temperature, chunks, softmax)
        return _finish(m.unsqueeze(0), s.unsqueeze(0))

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        p = torch.softmax(logits.float() / ctx.temperature, dim=-1) / ctx.temperature
        return (grad.unsqueeze(-1) * p).to(logits.dtype), None, None, None, None


def lse_partial(logits, temperature, chunks):
    opcheck.vocab("lse_partial", logits, chunks)
    return _partial("lse_partial", logits, temperature, chunks, softmax=False)


def lse_finish(maxes, sums):
    check.floats(maxes, op="lse_finish", name="maxes", layout="[P, ...]")
    if check.floats(sums, op="lse_finish", name="sums") != maxes.shape:
        raise ValueError(f"tonp.lse_finish: maxes {tuple(maxes.shape)} and sums "
                         f"{tuple(sums.shape)} differ")
    if bool((maxes == math.inf).any()):  # what lse_partial refuses to hand out
        raise ValueError("tonp.lse_finish: a partial's max is +inf (an infinite logit, or fp32 "
                         "overflow of logits / temperature): no finite logsumexp")
    return _finish(maxes, sums)


def _finish(maxes, sums):
    P = maxes.shape[0]
    out = _LSE_FINISH(maxes.reshape(P, -1).float().contiguous(),
                      sums.reshape(P, -1).float().contiguous())
    return out.reshape(maxes.shape[1:])


def logsumexp(logits, temperature, chunks):
    return _lse("logsumexp", logits, temperature, chunks, softmax=False)


def log_softmax(logits, temperature, chunks):
    lse = _lse("log_softmax", logits, temperature, chunks, softmax=True)
    x = logits.float()
    # Elementwise IEEE ops round the same in torch's vector and scalar loops: invariant (the
    # division by T through true_div: torch's CUDA division by a number is not IEEE's).
    return true_div(x, temperature) - lse.unsqueeze(-1)


def token_logprobs(logits, targets, temperature, chunks):
    if logits.dim() == 2 and not (torch.is_grad_enabled() and logits.requires_grad) and \
            not torch.compiler.is_compiling():
        return _TOKEN_LOGPROBS(logits, targets, temperature, chunks)  # the rollout: one fused op
    opcheck.vocab("token_logprobs", logits, chunks)
    opcheck.targets("token_logprobs", logits, targets)
    if torch.is_grad_enabled() and logits.requires_grad and not torch.compiler.is_compiling():
        return _TokenLogprobs.apply(logits, targets, temperature, chunks)
    if torch.compiler.is_compiling():
        # Traced: lse + gather + subtraction under autograd (the same bits as the fused op).
        lse = _lse("token_logprobs", logits, temperature, chunks, softmax=True)
        return gather_logit(logits, targets, temperature) - lse
    V = logits.shape[-1]
    out = _TOKEN_LOGPROBS(logits.reshape(-1, V), targets.reshape(-1), temperature, chunks)
    return out.reshape(targets.shape)


class _TokenLogprobs(torch.autograd.Function):
    """Training: lse + gather + subtraction (the fused op's bits); the backward in one buffer,
    d lp / dx_v = ([v == target] - exp(x_v / T - lse)) / T (the row's own lse, no softmax)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunks):
        lse = _lse("token_logprobs", logits, temperature, chunks, softmax=True)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        return gather_logit(logits, targets, temperature) - lse

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse = ctx.saved_tensors
        T = ctx.temperature
        x = logits.float()
        p = torch.sub(x / T if T != 1.0 else x, lse.unsqueeze(-1)).exp_()
        g = grad.float() / T if T != 1.0 else grad.float()
        p.mul_(g.neg().unsqueeze(-1)).scatter_add_(-1, targets.long().unsqueeze(-1), g.unsqueeze(-1))
        return p.to(logits.dtype), None, None, None


def argmax(logits):
    if logits.dim() == 2:  # the generator's [S, V]: one op call
        return _ARGMAX(logits)
    opcheck.vocab("argmax", logits, None)
    return _ARGMAX(logits.reshape(-1, logits.shape[-1])).reshape(logits.shape[:-1])


def max_with_index(logits):
    opcheck.vocab("max_with_index", logits, None)
    lead = logits.shape[:-1]
    v, i = _MAX_WITH_INDEX(logits.reshape(-1, logits.shape[-1]))
    return v.reshape(lead), i.reshape(lead)


def sample(logits, temperature, top_k, top_p, seed, request_ids, positions):
    return _SAMPLE(logits, temperature, top_k or 0, 1.0 if top_p is None else top_p, seed,
                   request_ids, positions)
