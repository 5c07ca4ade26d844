"""The Triton exp and log equal simd.h's, and the vocabulary kernels the C++ ones, bit for bit.

exp and log: a sweep of ~1.1M inputs (random bit patterns, denormals, +-0, +-inf, NaNs, 1, every
power of two) through the Triton functions and through simd.h's vexp/sexp/vlog/slog (compiled
here from the header, portable and AVX2 builds): identical bits, log within 1 ulp of float64.
lse_partial's (max, sum), lse_finish, token_logprobs (both sides finish with the explicit log),
max_with_index and argmax equal the C++ ops, with masked chunks, NaN-only chunks and -0 maxima;
the lse tree over vocab shards equals the one-call partial. Twins: torch.log, torch.max and a
stock log-softmax give other bits.
"""
from __future__ import annotations

import ctypes
import os
import subprocess

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import tonp_kernels
from conftest import assert_bitwise, randn
from triton_interpreted import bits, numerics, vocab

# Inputs with inf and NaN on purpose: numpy (the interpreter) warns about them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CSRC = os.path.join(os.path.dirname(tonp_kernels.__file__), "csrc")
SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#if TONP_AVX2
#include <immintrin.h>
#pragma GCC target("avx2,fma")
#endif
#include "simd.h"
using namespace tonp_simd;
extern "C" void vlog_n(const float* x, float* y, int64_t n) { for (int64_t i = 0; i < n; i += 8) vstore(y + i, vlog(vload(x + i))); }
extern "C" void slog_n(const float* x, float* y, int64_t n) { for (int64_t i = 0; i < n; ++i) y[i] = slog(x[i]); }
extern "C" void vexp_n(const float* x, float* y, int64_t n) { for (int64_t i = 0; i < n; i += 8) vstore(y + i, vexp(vload(x + i))); }
extern "C" void sexp_n(const float* x, float* y, int64_t n) { for (int64_t i = 0; i < n; ++i) y[i] = sexp(x[i]); }
"""


@pytest.fixture(scope="module")
def simd(tmp_path_factory):
    """{build: ctypes library} of simd.h compiled with the extension's flags (no contraction)."""
    d = tmp_path_factory.mktemp("simd")
    (d / "shim.cpp").write_text(SHIM)
    builds = {"portable": 0}
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        builds["avx2"] = 1
    libs = {}
    for name, avx2 in builds.items():
        so = d / f"{name}.so"
        subprocess.run([os.environ.get("CXX", "c++"), "-O3", "-std=c++17", "-ffp-contract=off",
                        "-fno-fast-math", "-shared", "-fPIC", f"-DTONP_AVX2={avx2}", f"-I{CSRC}",
                        str(d / "shim.cpp"), "-o", str(so)], check=True, timeout=120)
        libs[name] = ctypes.CDLL(str(so))
    return libs


def simd_call(lib, fn, x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    getattr(lib, fn)(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                     ctypes.c_int64(x.size))
    return out


@triton.jit
def _exp_log_kernel(x_ptr, e_ptr, l_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(e_ptr + i, numerics.exp(x), mask=i < n)
    tl.store(l_ptr + i, numerics.log(x), mask=i < n)


def _sweep() -> np.ndarray:
    rng = np.random.default_rng(0)
    special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7FA00001, 1,
               0x007FFFFF, 0x00800000, 0x3F800000, 0x3F7FFFFF, 0x3F800001, 0xBF800000]
    parts = [rng.integers(0, 2 ** 32, size=1 << 20, dtype=np.uint64).astype(np.uint32),
             np.array(special, dtype=np.uint32),
             np.arange(1, 255, dtype=np.uint32) << 23,  # 2^-126 .. 2^127
             np.uint32(1) << np.arange(23, dtype=np.uint32),  # denormal powers of two
             (rng.standard_normal(1 << 16) * 30).astype(np.float32).view(np.uint32),
             (1 + rng.standard_normal(1 << 14) * 1e-3).astype(np.float32).view(np.uint32)]
    x = np.concatenate(parts).view(np.float32)
    return np.concatenate([x, np.ones((-x.size) % 8, np.float32)])


def test_exp_and_log_equal_simd_h_on_a_sweep(simd):
    x = _sweep()
    xt = torch.from_numpy(x.copy())
    e, lg = torch.empty_like(xt), torch.empty_like(xt)
    BLOCK = 1 << 19
    _exp_log_kernel[(triton.cdiv(x.size, BLOCK),)](xt, e, lg, x.size, BLOCK=BLOCK)
    e, lg = e.numpy(), lg.numpy()
    for build, lib in simd.items():
        for fn, ours in (("vexp_n", e), ("sexp_n", e), ("vlog_n", lg), ("slog_n", lg)):
            ref = simd_call(lib, fn, x)
            bad = ref.view(np.uint32) != ours.view(np.uint32)
            assert not bad.any(), (f"{build} {fn}: {int(bad.sum())} inputs differ, e.g. x="
                                   f"{x[bad][:3]} -> {ref[bad][:3]} vs {ours[bad][:3]}")
    ok = (x > 0) & np.isfinite(x)
    exact = np.log(x[ok].astype(np.float64))
    ulp = np.abs(lg[ok].astype(np.float64) - exact) / np.spacing(np.abs(exact).astype(np.float32))
    assert ulp.max() <= 1.0, f"log is {ulp.max():.2f} ulp off at x={x[ok][ulp.argmax()]}"
    assert np.isneginf(lg[x == 0]).all() and np.isnan(lg[x < 0]).all()
    # The twin: torch.log's bits are not the explicit log's everywhere.
    stock = torch.log(xt[torch.from_numpy(ok)]).numpy()
    assert (stock.view(np.uint32) != lg[ok].view(np.uint32)).any()


def _logits(M, V, dtype, gen, chunks):
    """Random logits with a chunk all -inf, a NaN, a chunk whose max is a -0 before a +0, and a
    chunk of only NaN and -inf (its sum is NaN, the row's result NaN)."""
    x = randn(M, V, dtype=dtype, gen=gen, scale=4.0)
    vc = V // chunks
    if chunks > 1:
        x[0, :vc] = float("-inf")
    if M > 1:
        x[1, 3] = float("nan")
    if M > 2:
        x[2] = -x[2].abs() - 1
        x[2, 1], x[2, 2] = -0.0, 0.0
    if M > 3 and chunks > 1:
        x[3, vc:2 * vc] = float("-inf")
        x[3, vc + vc // 2] = float("nan")
    return x


CASES = ((200, 8), (96, 4), (37, 1), (64, 8))  # chunk tails of 1 and 4, chunks of exactly 8


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_lse_partial_equals_cpp(dtype, gen):
    for V, C in CASES:
        for T in (1.0, 0.7):
            x = _logits(17 if V == 64 else 3, V, dtype, gen, C)
            m, s = vocab.lse_partial(x, T, C)
            rm, rs = torch.ops.tonp.lse_partial(x, T, C)
            assert_bitwise((bits(m), bits(s)), (bits(rm), bits(rs)),
                           f"lse_partial V={V} C={C} T={T}")


def test_lse_tree_over_vocab_shards_equals_the_one_call_partial(gen):
    """P vocab shards' C/P-chunk partials (C++), finished by the Triton tree, give the C++
    one-call C-chunk (max, sum): the vocab-parallel invariance, through the Triton tree."""
    V, C = 256, 8
    x = _logits(5, V, torch.float32, gen, C)
    full = torch.ops.tonp.lse_partial(x, 0.7, C)
    for P in (1, 2, 4, 8):
        shards = [x[:, p * V // P:(p + 1) * V // P].contiguous() for p in range(P)]
        maxes, sums = zip(*(torch.ops.tonp.lse_partial(xs, 0.7, C // P) for xs in shards))
        m, s = vocab.lse_tree(torch.stack(maxes), torch.stack(sums))
        assert_bitwise((bits(m), bits(s)), (bits(full[0]), bits(full[1])), f"{P} shards")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_token_logprobs_and_lse_finish_equal_cpp(dtype, gen):
    """Both sides finish m + log(s) with the explicit log, so the fused rollout op and the
    shards' finish agree bit for bit (NaN rows included, compared as bits)."""
    for V, C in CASES:
        for T in (1.0, 0.7):
            x = _logits(5, V, dtype, gen, C)
            t = torch.randint(0, V, (5,), generator=gen)
            assert_bitwise(bits(vocab.token_logprobs(x, t, T, C)),
                           bits(torch.ops.tonp.token_logprobs(x, t, T, C)),
                           f"token_logprobs V={V} C={C} T={T}")
            m, s = torch.ops.tonp.lse_partial(x, T, C)
            P = 2 if V % 2 == 0 else 1
            mp, sp = m.view(P, -1) if P == 1 else torch.stack([m, m]), \
                s.view(P, -1) if P == 1 else torch.stack([s, s * 0.5])
            assert_bitwise(bits(vocab.lse_finish(mp, sp)),
                           bits(torch.ops.tonp.lse_finish(mp.contiguous(), sp.contiguous())),
                           f"lse_finish V={V} P={P}")
    x = randn(3, 64, dtype=dtype, gen=gen)
    x[1] = float("-inf")
    x[2, 5] = float("inf")
    t = torch.zeros(3, dtype=torch.long)
    for rows, rule in (([0, 1, 2], "row 1: every logit is -inf"), ([0, 2], "row 1: .*reach \\+inf")):
        for op in (vocab.token_logprobs, torch.ops.tonp.token_logprobs):
            with pytest.raises(ValueError, match=rule):
                op(x[rows], t[:len(rows)], 1.0, 8)
    # The twin: a stock log-softmax gives other bits.
    x = randn(64, 1000, gen=gen, scale=4.0)
    t = torch.randint(0, 1000, (64,), generator=gen)
    stock = torch.log_softmax(x, -1).gather(1, t[:, None])[:, 0]
    assert not torch.equal(stock, vocab.token_logprobs(x, t))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_max_with_index_equals_cpp(dtype, gen):
    """Ties (lowest index), NaN skipped, an all-NaN row (index 0), -inf, a -0 / +0 tie; V over
    several blocks."""
    x = randn(6, 2500, dtype=dtype, gen=gen)
    x[0, 7] = x[0, 2400] = 50.0
    x[1, :5] = float("nan")
    x[1, 1700] = float("nan")
    x[2] = float("nan")
    x[3] = float("-inf")
    x[4] = -x[4].abs() - 1
    x[4, 100], x[4, 200] = -0.0, 0.0
    x[5] = -x[5].abs() - 1  # zeros of both signs as the maximum, in two blocks, +0 first in one
    x[5, 300], x[5, 310], x[5, 1500] = -0.0, 0.0, 0.0
    v, i = vocab.max_with_index(x)
    rv, ri = torch.ops.tonp.max_with_index(x)
    assert_bitwise((bits(v), i), (bits(rv), ri), f"max_with_index {dtype}")
    assert not torch.equal(x.float().max(-1).indices, i)  # the twin: torch.max takes a NaN
    assert i[5] == 300 and bits(v)[5] == bits(torch.tensor(-0.0))  # its own sign
    ok = [0, 3, 4, 5]  # argmax: the same index where no NaN, refusal naming the first NaN row
    assert_bitwise(vocab.argmax(x[ok]), torch.ops.tonp.argmax(x[ok]), f"argmax {dtype}")
    for op in (vocab.argmax, torch.ops.tonp.argmax):
        with pytest.raises(ValueError, match="row 1 holds a NaN logit"):
            op(x[[0, 1, 2]])


def test_bad_inputs_raise_clear_errors(gen):
    x = randn(3, 40, gen=gen)
    with pytest.raises(ValueError, match="not divisible"):
        vocab.lse_partial(x, 1.0, 16)
    with pytest.raises(ValueError, match="temperature"):
        vocab.token_logprobs(x, torch.tensor([0, 1, 2]), 0.0)
    with pytest.raises(IndexError, match="out of range"):
        vocab.token_logprobs(x, torch.tensor([0, 40, 2]))
    with pytest.raises(TypeError, match="integer"):
        vocab.token_logprobs(x, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="power of two"):
        vocab.lse_finish(torch.zeros(3, 2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="V > 0"):
        vocab.max_with_index(x[:, :0])
