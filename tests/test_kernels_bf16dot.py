"""The bf16 x bf16 linear's pair chains (kernels/csrc/bf16dot.h, CONTRACT.md): one arithmetic,
whichever build runs it.

The step (vdpbf16ps: per lane, the odd pair's product then the even one's, each an FMA with
subnormal inputs read as zero and results tiny after rounding flushed) is compared across the
builds this CPU has (portable std::fma with the flush written out, AVX2 FMAs under MXCSR
FTZ | DAZ, the AVX512-BF16 instruction) on random bit patterns and on the cases near FLT_MIN
where tininess before and after rounding differ; the linear is compared with a reference built
from that step (lanes, blocks of 16 with zero padding, tree8, chunk tree) and across builds on
hostile inputs (subnormals, infinities, NaN, cancellation).
"""
from __future__ import annotations

import pytest
import torch

import tonp_kernels as tk
from conftest import assert_bitwise, env, randn

ISAS = torch.ops.tonp.bf16_pair_isas()
FLT_MIN = torch.finfo(torch.float32).tiny
CANONICAL_NAN = 0x7FC00000
BUILDS = {"portable": ("TONP_FORCE_PORTABLE", "1"), "avx2": ("TONP_FORCE_AVX2", "1"),
          "native": ("TONP_FORCE_PORTABLE", None)}
# The AVX512-BF16 table's two bf16 paths, on whichever CPU runs the table: Intel's (the pair
# chains on FMAs, bf16dot_fma.h) and the other CPUs' (vdpbf16ps).
if "avx512bf16" in ISAS:
    BUILDS.update({"avx512 fma": ("TONP_FORCE_BF16_FMA", "1"), "avx512 vdpbf16ps": ("TONP_FORCE_BF16_FMA", "0")})


def _bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns with every NaN made canonical (NaN payloads inside a chain are not part
    of the arithmetic; the linear's output NaN is canonical)."""
    b = t.float().contiguous().view(torch.int32).clone()
    b[t.float().isnan()] = CANONICAL_NAN
    return b


def _step(acc, a, b, isa="portable"):
    return torch.ops.tonp.bf16_pair_step(acc, a, b, isa)


def _random_bits(n, gen):
    acc = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=gen).to(torch.int32).view(torch.float32)
    a, b = (torch.randint(-2 ** 15, 2 ** 15, (n, 2), generator=gen).to(torch.int16)
            .view(torch.bfloat16) for _ in range(2))
    return acc, a, b


def _near_flt_min(gen, n=1 << 21):
    """acc within 40 ulps of +-FLT_MIN, +-2 FLT_MIN or 0 (subnormal accs included), plus one
    product near 2^-150 (odd element; the even element is zero): the sums where the flush rules
    one might write disagree."""
    base = torch.tensor([0x00800000, 0x01000000, 0])[torch.randint(0, 3, (n,), generator=gen)]
    acc_bits = (base + torch.randint(-40, 40, (n,), generator=gen)).clamp(min=0)
    acc_bits = acc_bits | (torch.randint(0, 2, (n,), generator=gen) << 31)
    acc = acc_bits.to(torch.int32).view(torch.float32)
    ea = torch.randint(40, 90, (n,), generator=gen)
    eb = 104 - ea + torch.randint(-6, 7, (n,), generator=gen)       # products near 2^-150
    ma, mb = (torch.randint(0, 128, (n,), generator=gen) for _ in range(2))
    sb = torch.randint(0, 2, (n,), generator=gen) << 15
    odd_a = ((ea << 7) | ma).to(torch.int16).view(torch.bfloat16)
    odd_b = ((eb << 7) | mb | sb).to(torch.int32).to(torch.int16).view(torch.bfloat16)
    zero = torch.zeros_like(odd_a)
    return acc, torch.stack([zero, odd_a], 1), torch.stack([zero, odd_b], 1)


# --- the step -----------------------------------------------------------------------------------
def test_the_builds_this_cpu_has_include_portable_and_avx2():
    assert ISAS[0] == "portable"
    assert "avx2" in ISAS, "the tests run on x86-64 CPUs with AVX2 (see the Makefile's CI note)"


@pytest.mark.parametrize("isa", [i for i in ("avx2", "avx512bf16")])
def test_step_equals_portable_on_random_bit_patterns(isa, gen):
    if isa not in ISAS:
        pytest.skip(f"this CPU has no {isa} (available: {ISAS})")
    acc, a, b = _random_bits(1 << 21, gen)
    want, got = _step(acc, a, b), _step(acc, a, b, isa)
    assert bool(want.isnan().any()) and bool((want.abs() < FLT_MIN).any())  # NaN and zeros occur
    assert torch.equal(_bits(got), _bits(want)), f"{isa} differs from portable"


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512bf16"])
def test_step_flushes_what_is_tiny_after_rounding(isa, gen):
    """Near FLT_MIN the three rules one might write differ, and the step is the x86 one:
    round to 24 bits with an unbounded exponent, flush if that is below FLT_MIN."""
    if isa not in ISAS:
        pytest.skip(f"this CPU has no {isa} (available: {ISAS})")
    acc, a, b = _near_flt_min(gen)
    got = _step(acc, a, b, isa)
    acc_daz = torch.where(acc.abs() < FLT_MIN, torch.zeros_like(acc).copysign(acc), acc)
    exact = acc_daz.double() + a[:, 1].double() * b[:, 1].double()           # exact here
    plain = exact.float()          # IEEE gradual underflow: one rounding to the subnormal grid
    tiny_before = exact.abs() < FLT_MIN
    kept_min = (got.abs() == FLT_MIN) & tiny_before       # tiny before rounding, kept: after rounding decides
    flushed_min = (got == 0) & (plain.abs() == FLT_MIN)   # the subnormal grid rounds to FLT_MIN, 24 bits do not
    assert int(kept_min.sum()) > 100 and int(flushed_min.sum()) > 100, "the cases were not reached"
    # every result: flushed iff 24-bit rounding of the exact value is below FLT_MIN
    m, e = torch.frexp(exact)
    r24 = torch.ldexp(torch.round(torch.ldexp(m, torch.full_like(e, 24))), e - 24)   # ties: see below
    tiny_after = r24.abs() < FLT_MIN
    want = torch.where(tiny_after, torch.zeros_like(plain).copysign(plain), plain)
    want = want + 0.0          # the even pair's product, +0: a flushed -0 becomes +0
    # torch.round is half-to-even, as the hardware's RNE; r24 is exact in float64.
    assert torch.equal(_bits(got), _bits(want))
    if isa != "portable":
        assert torch.equal(_bits(got), _bits(_step(acc, a, b)))


def test_step_reads_subnormal_inputs_as_zero():
    """A subnormal bf16 times 2^100 is a normal number in IEEE arithmetic (the twin), and 0 in
    the step, on either side of the product and in either element of the pair."""
    sub = torch.tensor([0x0001, 0x807F, 0x0040], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    big = torch.full((3,), 2.0 ** 100, dtype=torch.bfloat16)
    zero, acc = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3)
    ieee = sub.float() * big.float()
    assert bool((ieee != 0).all())
    for isa in ISAS:
        for a, b in ((sub, big), (big, sub)):
            for pair in (lambda v: torch.stack([zero, v], 1), lambda v: torch.stack([v, zero], 1)):
                out = _step(acc, pair(a), pair(b), isa)
                assert bool((out == 0).all()), isa


# --- the linear ---------------------------------------------------------------------------------
def _tree(parts):
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def pair_linear_reference(x, w, bias=None, chunks=8, out_dtype=None):
    """The documented arithmetic, step by step: chunks of kc, blocks of 16 zero padded, lane l
    takes the pair (16j + 2l, + 1), tree8, the pairwise chunk tree, + bias, one rounding."""
    M, K = x.shape
    N, kc = w.shape[0], K // chunks
    blocks = -(-kc // 16)
    parts = []
    for c in range(chunks):
        xc = torch.zeros(M, blocks * 16, dtype=torch.bfloat16)
        wc = torch.zeros(N, blocks * 16, dtype=torch.bfloat16)
        xc[:, :kc], wc[:, :kc] = x[:, c * kc:(c + 1) * kc], w[:, c * kc:(c + 1) * kc]
        acc = torch.zeros(M * N * 8)
        for j in range(blocks):
            a = xc[:, 16 * j:16 * j + 16].reshape(M, 1, 8, 2).expand(M, N, 8, 2).reshape(-1, 2)
            b = wc[:, 16 * j:16 * j + 16].reshape(1, N, 8, 2).expand(M, N, 8, 2).reshape(-1, 2)
            acc = _step(acc, a, b)
        lanes = acc.view(M, N, 8).unbind(-1)
        parts.append(_tree(list(lanes)))
    y = _tree(parts)
    if bias is not None:
        y = y + bias.float()
    y = torch.where(y.isnan(), torch.full_like(y, float("nan")), y)
    return y.to(out_dtype or x.dtype)


@pytest.mark.parametrize("K,N", [(24, 37), (40, 16), (104, 21), (384, 19), (768, 20), (2048, 33)])
def test_linear_is_the_documented_pair_arithmetic(K, N, gen):
    """kc = 3, 5, 13 (odd chunk starts, padded blocks), 48 (a prefetched pair of blocks and one
    more), 96 and 256 (the model's)."""
    x = randn(130, K, dtype=torch.bfloat16, gen=gen)
    w = randn(N, K, dtype=torch.bfloat16, gen=gen, scale=K ** -0.5)
    bias = randn(N, dtype=torch.bfloat16, gen=gen)
    for out in (torch.float32, torch.bfloat16):
        want = pair_linear_reference(x, w, bias, out_dtype=out)
        # dot products (vdpbf16ps: row tiles of 8, 6, 4, 2 rows two per zmm, a last odd row of 3,
        # 5 or 7 paired with a zero row, a lone one (1, 9, 17 ...) alone; on Intel the tiles of
        # two pairs or more on FMAs; emulated: tiles of 2 rows and an odd one over four columns
        # at a time, sharing the fetch of the next four; one row 8 columns wide), lane passes (on
        # vdpbf16ps from 48 rows, from 24 when kc <= 96, on an AMD Zen 5 from 112 at every
        # chunk length: tiles of 3 and 2 rows over pairs of 16-column groups, an odd group over
        # tiles of 5 and 4; on Intel from 64 rows on FMAs, tiles of up to 6 rows over 32-column
        # slabs, an odd group over tiles of up to 8; 97, 98, 112, 113 and 130 end on a 96-row
        # block and a block of 1-34 rows; emulated from 20)
        for M in (1, 2, 3, 5, 7, 8, 9, 11, 12, 13, 15, 17, 21, 23, 24, 25, 47, 48, 53, 63, 64, 65, 97, 98, 111, 112,
                  113, 130):
            for name in ("native", "avx512 fma", "avx512 vdpbf16ps"):  # both paths of the table where it runs
                if name in BUILDS:
                    with env(*BUILDS[name]):
                        got = tk.linear(x[:M], w, bias, out_dtype=out)
                    assert torch.equal(_bits(got), _bits(want[:M])), f"{name} M={M} out={out}"


def _hostile(M, K, gen):
    """Normal values with subnormals, huge values (products overflow), infinities, NaN and exact
    cancellation mixed in."""
    x = randn(M, K, dtype=torch.float32, gen=gen)
    pick = torch.rand(M, K, generator=gen)
    x = torch.where(pick < 0.05, x * 1e-39, x)                     # bf16 subnormals
    x = torch.where((pick > 0.05) & (pick < 0.08), x * 1e-19, x)     # products near FLT_MIN
    x = torch.where((pick > 0.08) & (pick < 0.09), x * 3e38, x)      # overflow
    x[0, 3], x[1, 5], x[2, 7] = float("inf"), float("-inf"), float("nan")
    x[3, 1::2] = -x[3, 0::2]                                         # cancellation in every pair
    return x.bfloat16()


@pytest.mark.parametrize("K,N", [(64, 37), (2048, 48), (40, 16)])
def test_linear_builds_agree_on_hostile_inputs(K, N, gen):
    x = _hostile(70, K, gen)
    w = _hostile(N, K, gen)
    w[:, 1::2] = w[:, 0::2]
    outs = {}
    for name, (var, val) in BUILDS.items():
        with env(var, val):  # one row, one row pair, four pairs, lane passes on every build
            outs[name] = [tk.linear(x[:m], w, out_dtype=torch.float32) for m in (1, 2, 7, 30, 50, 70)]
    for name, got in outs.items():
        for a, b in zip(got, outs["portable"]):
            assert torch.equal(_bits(a), _bits(b)), f"{name} differs from portable"
    y = outs["native"][-1]
    assert bool(y.isnan().any()) and bool(y.isinf().any())
    assert torch.equal(_bits(y[:1]), _bits(outs["native"][0]))          # one row = its row of 70


def test_fp32_activations_keep_fp32_fmas(gen):
    """Pair chains need bf16 on both sides: an fp32 x with bf16 weights (or the reverse) runs the
    fp32 FMA lanes, and the two arithmetics differ somewhere (so both are tested)."""
    K, N = 512, 64
    x = randn(20, K, dtype=torch.bfloat16, gen=gen)
    w = randn(N, K, dtype=torch.bfloat16, gen=gen, scale=K ** -0.5)
    pairs = tk.linear(x, w, out_dtype=torch.float32)
    fp32_x = tk.linear(x.float(), w, out_dtype=torch.float32)
    fp32_w = tk.linear(x, w.float(), out_dtype=torch.float32)
    assert_bitwise(fp32_x, fp32_w)
    assert not torch.equal(pairs, fp32_x)
    assert torch.equal(_bits(pairs), _bits(pair_linear_reference(x, w, out_dtype=torch.float32)))


def test_the_kernel_ignores_and_restores_the_callers_flush_mode(gen):
    """torch.set_flush_denormal(True) sets MXCSR FTZ | DAZ for the caller; the pair chains' trees
    still run in IEEE arithmetic (same bits), and the caller's mode is back afterwards."""
    K, N = 256, 40
    x = _hostile(12, K, gen)
    w = randn(N, K, dtype=torch.bfloat16, gen=gen, scale=0.05)
    ref = tk.linear(x, w, out_dtype=torch.float32)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot set flush-denormal mode")
    try:
        got = tk.linear(x, w, out_dtype=torch.float32)
        tiny = torch.tensor([1e-39]) * 1.0
        assert float(tiny[0]) == 0.0, "the caller's flush mode was not restored"
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(_bits(got), _bits(ref))


def test_a_bf16_model_rolls_out_and_trains_to_the_same_bits_on_every_build():
    """Rollout (paged decode) and training-forward logprobs of a bf16 model: identical bits on
    the portable build, the AVX2 emulation and this CPU's native build, and rollout = training on
    each (the model's linears, experts, router and LM head all run pair chains; kc = 16 and 8)."""
    from model_helpers import tiny_model
    from tonp_models import generate
    model = tiny_model(dtype=torch.bfloat16, hidden_size=128, moe_intermediate_size=64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (5, 17, 9)]
    got = {}
    for name, (var, val) in BUILDS.items():
        with env(var, val):
            out = generate(model, prompts, 6, temperature=0.8, seed=3, max_batch_size=2)
            with torch.no_grad():
                train = model.token_logprobs(out.sequences, temperature=0.8)
        for lp, tr, p in zip(out.logprobs, train, out.prompt_lengths):
            assert torch.equal(lp, tr[p - 1:]), f"{name}: rollout != training"
        got[name] = (out.sequences, train)
    for name, (seqs, train) in got.items():
        for a, b in zip(seqs + train, got["portable"][0] + got["portable"][1]):
            assert torch.equal(a, b), f"{name} differs from portable"
