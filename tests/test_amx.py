"""AMX-BF16's tdpbf16ps, measured (kernels/amx.py, kernels/csrc/amx_ops.cpp, CONTRACT.md "AMX and
the pair chains").

On a CPU with AMX the instruction is compared bit for bit with tonp's model of it on hostile
inputs (subnormal, near-FLT_MIN, infinite and NaN operands and accumulators, cancellation), and
shown to be neither the contract's pair chains nor its documented order; the prototype of the
proposed "block chains" linear on AMX is held to its torch reference and to row and thread
invariance. Everywhere, the model and the reference are checked for what they can be checked
without the instruction (a linear's value; not the contract's bits), and the tools refuse clearly
on CPUs without AMX.
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
import tonp_kernels.amx as amx
from conftest import num_threads, randn

CANONICAL_NAN = 0x7FC00000
HAS_AMX = amx.available()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX-BF16 (the instruction under test)")


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().split()
    except OSError:
        return []


HAS_AVX512F = "avx512f" in _cpu_flags()
needs_avx512f = pytest.mark.skipif(not HAS_AVX512F, reason="this CPU has no AVX-512F (the FMA kernel under test)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    b = t.float().contiguous().view(torch.int32).clone()
    b[t.isnan()] = CANONICAL_NAN  # NaN payloads are the device's (CONTRACT.md)
    return b


def _bf16_bits(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _hostile_bf16(shape, gen):
    """A mix per element: any bit pattern (infinities, NaN, subnormals), tiny normals (products
    below FLT_MIN), and values near 1 (long cancellations)."""
    n = 1
    for s in shape:
        n *= s
    kind = torch.randint(0, 3, (n,), generator=gen)
    raw = torch.randint(0, 1 << 16, (n,), generator=gen)
    tiny_e = 40 + torch.randint(0, 60, (n,), generator=gen)
    mid_e = 120 + torch.randint(0, 16, (n,), generator=gen)
    e = torch.where(kind == 1, tiny_e, mid_e)
    v = torch.where(kind == 0, raw, (raw & 0x8000) | (e << 7) | (raw & 0x7F))
    return _bf16_bits(v).reshape(shape)


def _hostile_acc(shape, gen):
    """Accumulators: within 32 ulps of +-FLT_MIN, subnormal, any bit pattern, or near 1."""
    n = 1
    for s in shape:
        n *= s
    kind = torch.randint(0, 4, (n,), generator=gen)
    r = torch.randint(0, 1 << 31, (n,), generator=gen)
    v = torch.where(kind == 0, 0x00800000 + r % 64 - 32,
                    torch.where(kind == 1, r % 0x00800000,
                                torch.where(kind == 2, r, (120 + r % 16) << 23 | (r & 0x7FFFFF))))
    v = v | (torch.randint(0, 2, (n,), generator=gen) << 31)
    v = torch.where(v >= 1 << 31, v - (1 << 32), v)
    return v.to(torch.int32).view(torch.float32).reshape(shape)


def test_availability_matches_what_the_cpu_reports():
    flags = _cpu_flags()
    reported = "amx_bf16" in flags and "amx_tile" in flags
    if HAS_AMX:
        assert reported, "amx_available() without amx_bf16/amx_tile in /proc/cpuinfo"
    elif reported:
        pytest.fail("the CPU reports AMX-BF16 but the process was not granted its tile state "
                    "(arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16 or newer)")


@pytest.mark.skipif(HAS_AMX, reason="the refusal is for CPUs without AMX-BF16")
def test_without_amx_the_tools_refuse_clearly():
    with pytest.raises(RuntimeError, match="no AMX-BF16"):
        torch.ops.tonp.amx_tdpbf16ps(torch.zeros(1, 1), torch.zeros(1, 1, 2, dtype=torch.bfloat16),
                                     torch.zeros(1, 1, 2, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="no AMX-BF16"):
        torch.ops.tonp.amx_linear_blocks(torch.zeros(1, 32, dtype=torch.bfloat16),
                                         torch.zeros(1, 32, dtype=torch.bfloat16), 1)


def test_the_tools_check_their_arguments():
    z = torch.zeros(1, 1, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        torch.ops.tonp.amx_tdpbf16ps(torch.zeros(17, 1), torch.zeros(17, 1, 2, dtype=torch.bfloat16), z)
    with pytest.raises(TypeError, match="bfloat16"):
        torch.ops.tonp.amx_tdpbf16ps(torch.zeros(1, 1), z.float(), z)
    with pytest.raises(ValueError, match="divide K"):
        torch.ops.tonp.amx_linear_blocks(torch.zeros(1, 30, dtype=torch.bfloat16),
                                         torch.zeros(1, 30, dtype=torch.bfloat16), 4)
    w = torch.zeros(20, 64, dtype=torch.bfloat16)
    packed = torch.ops.tonp.amx_pack_blocks(w, 2)   # 2 groups of 16 columns, 2 chunks, 1 block each
    assert packed.shape == (2 * 2 * 1 * 512,)
    with pytest.raises(ValueError, match="amx_pack_blocks"):
        torch.ops.tonp.amx_linear_blocks(torch.zeros(1, 64, dtype=torch.bfloat16), w, 4, packed)


@needs_amx
@pytest.mark.parametrize("M,N,K", [(16, 16, 1), (16, 16, 2), (16, 16, 16), (5, 7, 3), (1, 1, 16)])
def test_the_instruction_is_the_model_on_hostile_inputs(M, N, K, gen):
    """Two step chains (even, odd elements) from +0, then C + (E + O): bit for bit, NaN by
    position, on every input class at once (about 80k outputs per shape)."""
    reps = max(1, 20_000 // (M * N))
    for _ in range(reps):
        c, a, b = _hostile_acc((M, N), gen), _hostile_bf16((M, K, 2), gen), _hostile_bf16((K, N, 2), gen)
        got = torch.ops.tonp.amx_tdpbf16ps(c, a, b)
        want = amx.tdpbf16ps_model(c, a, b)
        assert torch.equal(_bits(got), _bits(want)), (c, a, b, got, want)


@needs_amx
def test_the_instruction_chains_across_calls_only_through_c(gen):
    """Three instructions in a row equal the model applied three times (the accumulator is the
    only state between them)."""
    c = _hostile_acc((16, 16), gen)
    want = c
    for _ in range(3):
        a, b = _hostile_bf16((16, 16, 2), gen), _hostile_bf16((16, 16, 2), gen)
        c = torch.ops.tonp.amx_tdpbf16ps(c, a, b)
        want = amx.tdpbf16ps_model(want, a, b)
    assert torch.equal(_bits(c), _bits(want))


def _normal_operands(gen, M=16, N=16, K=16):
    return (randn(M, N, gen=gen), randn(M, K, 2, gen=gen, dtype=torch.bfloat16),
            randn(K, N, 2, gen=gen, dtype=torch.bfloat16))


@needs_amx
def test_the_instruction_is_not_the_pair_chains_nor_its_documented_order(gen):
    """The twin: on ordinary values the orders one could assume (the contract's chains from C,
    odd product first; Intel's pseudocode, even first) disagree with the instruction in most
    outputs of a 16-pair instruction, while the model agrees with all of them."""
    c, a, b = _normal_operands(gen)
    hw = _bits(torch.ops.tonp.amx_tdpbf16ps(c, a, b))
    assert torch.equal(hw, _bits(amx.tdpbf16ps_model(c, a, b)))
    for order in (amx.pair_chain_order, amx.documented_order):
        differ = (hw != _bits(order(c, a, b))).float().mean().item()
        assert differ > 0.2, (order.__name__, differ)


def test_the_model_is_not_the_pair_chains(gen):
    """The same twin on any CPU, model against model: the accumulator entering last is a
    different sum from the contract's chains."""
    c, a, b = _normal_operands(gen)
    model = _bits(amx.tdpbf16ps_model(c, a, b))
    assert (model != _bits(amx.pair_chain_order(c, a, b))).float().mean().item() > 0.2
    # ... and it is the sum it claims to be: within a few roundings of the exact value
    exact = c.double() + torch.einsum("mke,kne->mn", a.double(), b.double())
    assert torch.allclose(amx.tdpbf16ps_model(c, a, b).double(), exact, rtol=1e-5, atol=1e-4)


def test_block_chains_reference_is_a_linear(gen):
    x, w = randn(5, 200, gen=gen, dtype=torch.bfloat16), randn(7, 200, gen=gen, dtype=torch.bfloat16)
    for chunks in (1, 2, 8):
        got = amx.linear_blocks_reference(x, w, chunks)
        assert torch.allclose(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)


def test_block_chains_are_not_the_current_pair_chains(gen):
    """The proposal is a change of bits: tk.linear's bf16 pair chains differ from it."""
    x, w = randn(8, 512, gen=gen, dtype=torch.bfloat16), randn(32, 512, gen=gen, dtype=torch.bfloat16)
    ref = amx.linear_blocks_reference(x, w, 8)
    cur = tk.linear(x, w, chunks=8, out_dtype=torch.float32)
    assert (_bits(ref) != _bits(cur)).float().mean().item() > 0.2


BLOCK_KERNELS = [pytest.param("amx", marks=needs_amx), pytest.param("fma", marks=needs_avx512f)]


@pytest.mark.parametrize("kernel", BLOCK_KERNELS)
@pytest.mark.parametrize("M,N,K,chunks", [(1, 1, 32, 1), (5, 17, 200, 4), (17, 40, 200, 8), (33, 33, 96, 2),
                                          (40, 16, 256, 8), (3, 50, 2048, 8)])
@pytest.mark.parametrize("inputs", ["hostile", "normal"])
def test_block_chain_kernels_equal_the_reference(kernel, M, N, K, chunks, inputs, gen):
    """The prototypes of the proposed order, on AMX and on AVX-512 FMAs under FTZ | DAZ (so a
    CPU without AMX can follow it exactly), give the reference's bits: K tails (kc not a multiple
    of 32), row and column tails, weights packed in the call or beforehand."""
    op = getattr(torch.ops.tonp, f"{kernel}_linear_blocks")
    if inputs == "hostile":
        x, w = _hostile_bf16((M, K), gen), _hostile_bf16((N, K), gen)
    else:
        x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen, dtype=torch.bfloat16)
    got = op(x, w, chunks)
    assert torch.equal(_bits(got), _bits(amx.linear_blocks_reference(x, w, chunks)))
    packed = torch.ops.tonp.amx_pack_blocks(w, chunks)
    assert torch.equal(_bits(op(x, w, chunks, packed)), _bits(got))


@pytest.mark.parametrize("kernel", BLOCK_KERNELS)
def test_block_chain_kernels_are_row_and_thread_invariant(kernel, gen):
    """Each row's bits alone equal its bits in a batch of 70 (AMX tiles of 16 and 32 rows, FMA
    tiles of 4, and their tails), with one thread or two."""
    op = getattr(torch.ops.tonp, f"{kernel}_linear_blocks")
    x, w = randn(70, 512, gen=gen, dtype=torch.bfloat16), randn(48, 512, gen=gen, dtype=torch.bfloat16)
    full = op(x, w, 8)
    with num_threads(1):
        assert torch.equal(op(x, w, 8), full)
    for r in (0, 3, 15, 16, 31, 32, 69):
        assert torch.equal(op(x[r:r + 1], w, 8), full[r:r + 1])
    assert torch.equal(op(x[3:40], w, 8), full[3:40])
