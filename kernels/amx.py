"""What AMX-BF16's `tdpbf16ps` computes, written as plain torch over the contract's own step.

The measurement behind docs/CONTRACT.md ("AMX and the pair chains"): on hostile inputs the
instruction gave, bit for bit, `tdpbf16ps_model` below, and none of the orders one reads in the
instruction's documentation. Per output (m, n) of one instruction with K pairs:

    E = +0;  for k = 0..K-1:  E = step(a[m, k, 0], b[k, n, 0], E)      (even elements)
    O = +0;  for k = 0..K-1:  O = step(a[m, k, 1], b[k, n, 1], O)      (odd elements)
    C' = add(daz(C), add(E, O))

where `step` is the pair chains' step (CONTRACT.md: an FMA with subnormal bf16 inputs read as zero
and results tiny after rounding flushed) and `add` is an IEEE fp32 add with the same flush. So
the accumulator enters each instruction last, after two chains of its own: the contract's chains
(which start each step from the accumulator) cannot be fed through it except one product per
instruction and lane. `linear_blocks_reference` is the order the proposal there makes of it.

Everything here is built from `torch.ops.tonp.bf16_pair_step` on the portable build, whose step
tests/test_kernels_bf16dot.py holds to vdpbf16ps and the AVX2 emulation bit for bit; the adds are
fp64 adds rounded once to fp32 (exact: fp64 has more than 2 * 24 + 2 bits). The functions are
vectorised over all outputs and slow only in the instruction's serial K.
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (registers torch.ops.tonp)

FLT_MIN = torch.finfo(torch.float32).tiny
BLOCK = 32  # elements of K one instruction takes per output: 16 pairs


def available() -> bool:
    """Whether this CPU runs AMX-BF16 and the kernel granted this process its tile state."""
    return bool(torch.ops.tonp.amx_available())


def _flush(r: torch.Tensor) -> torch.Tensor:
    return torch.where(r.abs() < FLT_MIN, torch.zeros_like(r).copysign(r), r)


def daz(c: torch.Tensor) -> torch.Tensor:
    """fp32 with subnormals read as zeros of their sign."""
    return _flush(c.float())


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y in IEEE fp32, a result below FLT_MIN flushed to a zero of its sign (for an add,
    tininess before and after rounding agree: a sum below FLT_MIN is exact)."""
    return _flush((x.double() + y.double()).float())


def step(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One step of the pair chains on one product: step(a, b, acc), elementwise (acc fp32, a and
    b bf16, broadcast together). The pair step with the odd element -0 x 1, which leaves every
    accumulator (signed zeros included) as it is."""
    acc, a, b = torch.broadcast_tensors(acc.float(), a, b)
    shape = acc.shape
    neg0 = torch.full(shape, -0.0, dtype=torch.bfloat16)
    one = torch.ones(shape, dtype=torch.bfloat16)
    pa = torch.stack((a.bfloat16(), neg0), -1).reshape(-1, 2)
    pb = torch.stack((b.bfloat16(), one), -1).reshape(-1, 2)
    return torch.ops.tonp.bf16_pair_step(acc.reshape(-1).contiguous(), pa, pb, "portable").reshape(shape)


def _chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """step chains from +0 over the last dim of a and b (broadcast), in order."""
    a, b = torch.broadcast_tensors(a, b)
    acc = torch.zeros(a.shape[:-1])
    for k in range(a.shape[-1]):
        acc = step(acc, a[..., k], b[..., k])
    return acc


def tdpbf16ps_model(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The measured instruction: c [M, N] fp32, a [M, K, 2] bf16, b [K, N, 2] bf16 -> [M, N]."""
    am = a.unsqueeze(1)                     # [M, 1, K, 2]
    bm = b.permute(1, 0, 2).unsqueeze(0)    # [1, N, K, 2]
    even, odd = _chain(am[..., 0], bm[..., 0]), _chain(am[..., 1], bm[..., 1])
    return add(daz(c), add(even, odd))


def pair_chain_order(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The contract's chains over the same operands: from C, pair by pair, the odd product then
    the even one (what the instruction would give if it ran vdpbf16ps's steps)."""
    am, bm = torch.broadcast_tensors(a.unsqueeze(1), b.permute(1, 0, 2).unsqueeze(0))
    acc = daz(c)
    for k in range(a.shape[1]):
        acc = step(step(acc, am[..., k, 1], bm[..., k, 1]), am[..., k, 0], bm[..., k, 0])
    return acc


def documented_order(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Intel's pseudocode for TDPBF16PS (SDM vol. 2, 'TDPBF16PS'): from C, pair by pair,
    `+= even product` then `+= odd product`, read as FMAs with DAZ / FTZ."""
    am, bm = torch.broadcast_tensors(a.unsqueeze(1), b.permute(1, 0, 2).unsqueeze(0))
    acc = daz(c)
    for k in range(a.shape[1]):
        acc = step(step(acc, am[..., k, 0], bm[..., k, 0]), am[..., k, 1], bm[..., k, 1])
    return acc


def chunk_tree(parts):
    """The linear's chunk tree (kernels_impl.h): neighbours at doubling strides, IEEE adds."""
    parts = list(parts)
    s = 1
    while s < len(parts):
        for c in range(0, len(parts) - s, 2 * s):
            parts[c] = (parts[c].double() + parts[c + s].double()).float()
        s *= 2
    return parts[0]


def linear_blocks_reference(x: torch.Tensor, w: torch.Tensor, chunks: int) -> torch.Tensor:
    """The proposed "block chains" order of a bf16 x bf16 linear, fp32 out (no bias): K in
    `chunks` chunks of kc; a chunk's partial starts at +0 and takes, for each block of 32
    elements (the last one zero padded), the instruction's step: acc = add(acc, add(E, O)), E
    and O the step chains over the block's 16 even and 16 odd elements; then the chunk tree."""
    M, K = x.shape
    N = w.shape[0]
    if K % chunks:
        raise ValueError(f"chunks={chunks} must divide K={K}")
    kc = K // chunks
    nb = -(-kc // BLOCK)
    pad = nb * BLOCK - kc

    def blocks(t):  # [R, K] -> [R, chunks, nb, 16, 2]
        t = t.bfloat16().reshape(t.shape[0], chunks, kc)
        t = torch.nn.functional.pad(t, (0, pad)) if pad else t
        return t.reshape(t.shape[0], chunks, nb, BLOCK // 2, 2)

    xb, wb = blocks(x)[:, None], blocks(w)[None]          # [M, 1, ...], [1, N, ...]
    even, odd = _chain(xb[..., 0], wb[..., 0]), _chain(xb[..., 1], wb[..., 1])  # [M, N, chunks, nb]
    acc = torch.zeros(M, N, chunks)
    for j in range(nb):
        acc = add(acc, add(even[..., j], odd[..., j]))
    return chunk_tree(acc.unbind(-1))
