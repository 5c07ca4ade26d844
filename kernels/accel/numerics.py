"""The exact numerics shared by every Triton kernel: the CPU kernels' exp and log built from FMAs,
bf16 conversions in integer bits, the eight-lane hsum tree, order-free reduction trees.

Each function performs the operation sequence of its twin in kernels/csrc/simd.h (vexp, vlog,
f32_to_bf16, hsum), so IEEE fp32 gives the same bits on any device. Rules kept throughout
(docs/accelerators.md): products that the CPU fuses are written as tl.fma and the kernels
launch with fp fusion off; `/` and sqrt are div_rn / sqrt_rn; a select is tl.where with the
CPU's comparison (NaN goes where the CPU's `a < b ? x : y` sends it); constants are exact fp32
values, so no compiler rounds them.
"""
from __future__ import annotations

import struct

import triton
import triton.language as tl


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# fp32 constants by their bits: exactly the C++ float literals (named beside them).
CANONICAL_NAN = tl.constexpr(_f32(0x7FC00000))
LOG2E = tl.constexpr(_f32(0x3FB8AA3B))  # 1.44269504088896341f
EXP_LO = tl.constexpr(_f32(0xC2AEAC50))  # -87.33654475f
EXP_HI = tl.constexpr(88.0)
LN2_HI = tl.constexpr(0.693359375)
LN2_LO = tl.constexpr(_f32(0xB95E8083))  # -2.12194440e-4f
EXP_P0 = tl.constexpr(_f32(0x39506967))  # 1.9875691500e-4f
EXP_P1 = tl.constexpr(_f32(0x3AB743CE))  # 1.3981999507e-3f
EXP_P2 = tl.constexpr(_f32(0x3C088908))  # 8.3334519073e-3f
EXP_P3 = tl.constexpr(_f32(0x3D2AA9C1))  # 4.1665795894e-2f
EXP_P4 = tl.constexpr(_f32(0x3E2AAAAA))  # 1.6666665459e-1f
EXP_P5 = tl.constexpr(0.5)  # 5.0000001201e-1f
ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + M - M rounds |v| < 2^22 to nearest even
SQRT_HALF = tl.constexpr(_f32(0x3F3504F3))  # 0.707106781186547524f
MIN_NORMAL = tl.constexpr(_f32(0x00800000))  # 2^-126
TWO_23 = tl.constexpr(8388608.0)
LOG_P0 = tl.constexpr(_f32(0x3D9021BB))  # 7.0376836292e-2f
LOG_P1 = tl.constexpr(_f32(0xBDEBD1B8))  # -1.1514610310e-1f
LOG_P2 = tl.constexpr(_f32(0x3DEF251A))  # 1.1676998740e-1f
LOG_P3 = tl.constexpr(_f32(0xBDFE5D4F))  # -1.2420140846e-1f
LOG_P4 = tl.constexpr(_f32(0x3E11E9BF))  # 1.4249322787e-1f
LOG_P5 = tl.constexpr(_f32(0xBE2AAE50))  # -1.6668057665e-1f
LOG_P6 = tl.constexpr(_f32(0x3E4CCEAC))  # 2.0000714765e-1f
LOG_P7 = tl.constexpr(_f32(0xBE7FFFFC))  # -2.4999993993e-1f
LOG_P8 = tl.constexpr(_f32(0x3EAAAAAA))  # 3.3333331174e-1f


@triton.jit
def round_even(v):
    """v rounded to the nearest integer, ties to even (vround), for |v| < 2^22."""
    return (v + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def pow2i(n):
    """2^n for an integral fp32 n in [-126, 127], built in the exponent bits (vpow2i)."""
    return ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """tonp's one exp (simd.h vexp, Cephes expf, ~1 ulp): x < -87.3365 -> 0, x > 88 -> inf."""
    xc = tl.where(x > EXP_LO, x, EXP_LO)  # vmax(x, lo): a NaN x takes lo (restored below)
    xc = tl.where(xc < EXP_HI, xc, EXP_HI)
    n = round_even(xc * LOG2E)
    r = tl.fma(n, -LN2_HI, xc)
    r = tl.fma(n, -LN2_LO, r)
    p = tl.fma(r, EXP_P0, EXP_P1)  # fma(c0, r, c1): the same exact product
    p = tl.fma(p, r, EXP_P2)
    p = tl.fma(p, r, EXP_P3)
    p = tl.fma(p, r, EXP_P4)
    p = tl.fma(p, r, EXP_P5)
    y = tl.fma(p, r * r, r) + 1.0
    y = y * pow2i(n)
    y = tl.where(x < EXP_LO, 0.0, y)
    y = tl.where(x > EXP_HI, float("inf"), y)  # hi < x
    return tl.where(x != x, x, y)


@triton.jit
def log(x):
    """tonp's one log (simd.h vlog, Cephes logf with FMAs, ~1 ulp). log(+-0) = -inf,
    log(x < 0) = NaN, log(inf) = inf, NaN stays NaN; denormals are scaled by 2^23 first."""
    tiny = x < MIN_NORMAL
    xs = tl.where(tiny, x * TWO_23, x)
    bits = xs.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 126  # xs = m * 2^e, m in [0.5, 1)
    m = ((bits & 0x007FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)
    e = e.to(tl.float32) - tl.where(tiny, 23.0, 0.0)
    low = m < SQRT_HALF
    f = tl.where(low, (m + m) - 1.0, m - 1.0)  # exact (Sterbenz)
    e = tl.where(low, e - 1.0, e)
    z = f * f
    p = tl.fma(f, LOG_P0, LOG_P1)
    p = tl.fma(p, f, LOG_P2)
    p = tl.fma(p, f, LOG_P3)
    p = tl.fma(p, f, LOG_P4)
    p = tl.fma(p, f, LOG_P5)
    p = tl.fma(p, f, LOG_P6)
    p = tl.fma(p, f, LOG_P7)
    p = tl.fma(p, f, LOG_P8)
    y = (p * f) * z
    y = tl.fma(e, LN2_LO, y)
    y = tl.fma(z, -0.5, y)
    r = f + y
    r = tl.fma(e, LN2_HI, r)
    r = tl.where(x < 0.0, float("nan"), r)
    r = tl.where(x == 0.0, float("-inf"), r)
    r = tl.where(x == float("inf"), x, r)
    return tl.where(x != x, x, r)


@triton.jit
def bf16_to_f32(h):
    """bf16 bits (int16) -> fp32, exact."""
    return ((h.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _rne_bits(x):
    """fp32 -> its bf16 rounding as the top 16 bits of an int32 (f32_to_bf16: NaN -> 0x7fc0).
    Signed integers only (triton-ascend documents no unsigned ones); the adds wrap as uint32's."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # & 0xffff0000
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, r)


@triton.jit
def f32_to_bf16(x):
    """fp32 -> bf16 bits (int16), round to nearest even, NaN -> 0x7fc0 (simd.h f32_to_bf16)."""
    return (_rne_bits(x) >> 16).to(tl.int16)


@triton.jit
def round_bf16(x):
    """The fp32 value x takes once rounded to bf16 (kernels_impl.h round_to)."""
    return _rne_bits(x).to(tl.float32, bitcast=True)


@triton.jit
def load_f32(ptr, mask, BF16: tl.constexpr):
    """Load fp32 values, or bf16 bits (an int16 pointer) widened exactly."""
    if BF16:
        return bf16_to_f32(tl.load(ptr, mask=mask, other=0))
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def store_f32(ptr, v, mask, BF16: tl.constexpr):
    """Store fp32 values, or their bf16 rounding (an int16 pointer)."""
    if BF16:
        tl.store(ptr, f32_to_bf16(v), mask=mask)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def round_to(v, BF16: tl.constexpr):
    """v as the activation dtype holds it (identity for fp32)."""
    if BF16:
        return round_bf16(v)
    else:
        return v


@triton.jit
def hsum8_3d(a, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 8] lanes -> [A, B]: ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), the one hsum tree."""
    ev, od = tl.split(tl.reshape(a, [A, B, 4, 2]))
    s = ev + od  # (l0+l1), (l2+l3), (l4+l5), (l6+l7)
    ev, od = tl.split(tl.reshape(s, [A, B, 2, 2]))
    s = ev + od  # (l0+l1)+(l2+l3), (l4+l5)+(l6+l7)
    ev, od = tl.split(s)
    return ev + od


@triton.jit
def hsum8_2d(a, A: tl.constexpr):
    """[A, 8] lanes -> [A] by the hsum tree."""
    return tl.reshape(hsum8_3d(tl.reshape(a, [A, 1, 8]), A, 1), [A])


@triton.jit
def _tree(x, A: tl.constexpr, N: tl.constexpr, OP: tl.constexpr):
    """[A, N] -> [A] (N a power of two <= 2^12) by a pairwise tree of OP: 0 max, 1 min (by `<`
    and `>` selects), 2 add. Only triton.language builtins: no reduction whose order or NaN rule
    the compiler picks, and no Triton library function (which would be compiled, not
    interpreted, when triton was imported before TRITON_INTERPRET was set)."""
    for lvl in tl.static_range(12):
        if (N >> lvl) > 1:
            a, b = tl.split(tl.reshape(x, [A, N >> (lvl + 1), 2]))
            if OP == 0:
                x = tl.where(b > a, b, a)
            elif OP == 1:
                x = tl.where(b < a, b, a)
            else:
                x = a + b
    return tl.reshape(x, [A])


@triton.jit
def row_max(x, A: tl.constexpr, N: tl.constexpr):
    """Max over the last axis of [A, N] (NaN-free input: the value is order-free)."""
    return _tree(x, A, N, 0)


@triton.jit
def row_min(x, A: tl.constexpr, N: tl.constexpr):
    """Min over the last axis of [A, N] (integers here: order-free)."""
    return _tree(x, A, N, 1)


# Order-free reductions by the compiler's own tree (tl.reduce), where any order gives the same
# result: integers, and fp32 maxima without NaN (up to the sign of a zero maximum: only for
# callers whose output never carries that sign). They compile in a fraction of `_tree`'s time
# at wide rows. With Triton 3.6 (the H200's), moe_route at 128 experts took 303 s to compile
# with `_tree` and 0.4 s with these; max_with_index at 1024 columns took 263 s and 1.0 s.
@triton.jit
def _max_op(a, b):
    return tl.where(b > a, b, a)


@triton.jit
def _min_op(a, b):
    return tl.where(b < a, b, a)


@triton.jit
def _add_op(a, b):
    return a + b


@triton.jit
def row_min_free(x):
    """Min over the last axis of an integer [A, N] (order-free)."""
    return tl.reduce(x, 1, _min_op)


@triton.jit
def row_max_free(x):
    """Max over the last axis of an integer [A, N], or of fp32 holding no NaN: the value does
    not depend on the order, except the sign of a zero maximum when both zeros are present."""
    return tl.reduce(x, 1, _max_op)


@triton.jit
def take_int(v, hit):
    """take(v, hit) by tl.reduce: an integer sum of one value and zeros is order-free."""
    one = tl.reduce(tl.where(hit, v.to(tl.int32, bitcast=True), 0), 1, _add_op)
    return one.to(tl.float32, bitcast=True)


@triton.jit
def take(v, hit, A: tl.constexpr, N: tl.constexpr):
    """[A, N] fp32 -> [A]: the one element of each row where `hit` is true, bits exact (an
    integer sum of one value and zeros: no float rounding, no lost sign of zero)."""
    one = _tree(tl.where(hit, v.to(tl.int32, bitcast=True), 0), A, N, 2)
    return one.to(tl.float32, bitcast=True)
