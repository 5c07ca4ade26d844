// An 8-lane fp32 vector, in AVX2 (TONP_AVX2=1) or portable scalar code (TONP_AVX2=0).
//
// Every operation is lane-wise IEEE arithmetic (add, mul, div, sqrt, fma, max, round), so the
// two builds give identical bits: the portable build is not an approximation of the AVX2 one,
// it is the same computation, lane for lane. Reductions across lanes happen only in hsum /
// hsum8, which both use one fixed tree. exp is built from these operations, so there is exactly
// one exp in tonp, whatever the ISA and whichever path (vector body or scalar tail) calls it.
//
// This header is included only by the ISA translation units (isa_*.cpp), never by code that
// includes torch headers, so no inline function compiled for AVX2 can leak into generic code.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if TONP_AVX2
#include <immintrin.h>
#endif

namespace tonp_simd {

inline float bf16_to_f32(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Round to nearest even, as c10::BFloat16 and torch's .to(torch.bfloat16) do.
inline uint16_t f32_to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

#if TONP_AVX2
struct V8 {
  __m256 v;
};
inline V8 vzero() { return {_mm256_setzero_ps()}; }
inline V8 vset1(float x) { return {_mm256_set1_ps(x)}; }
inline V8 vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline V8 vload(const uint16_t* p) {  // 8 bf16 -> fp32 (exact)
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline void vstore(float* p, V8 a) { _mm256_storeu_ps(p, a.v); }
// Eight floats rounded to bf16 as f32_to_bf16 rounds each (the same integer steps, lane by lane).
inline void vstore_bf16(uint16_t* p, V8 a) {
  const __m256i b = _mm256_castps_si256(a.v);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline V8 vadd(V8 a, V8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline V8 vsub(V8 a, V8 b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline V8 vmul(V8 a, V8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline V8 vdiv(V8 a, V8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline V8 vfma(V8 a, V8 b, V8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }  // a*b+c, one rounding
inline V8 vmax(V8 a, V8 b) { return {_mm256_max_ps(a.v, b.v)}; }  // (a > b) ? a : b
inline V8 vmin(V8 a, V8 b) { return {_mm256_min_ps(a.v, b.v)}; }  // (a < b) ? a : b
inline V8 vround(V8 a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral n in [-126, 127], built in the exponent bits.
inline V8 vpow2i(V8 n) {
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
}
// select(mask a < b, x, y) and friends
inline V8 vsel_lt(V8 a, V8 b, V8 x, V8 y) { return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ))}; }
inline V8 vsel_nan(V8 a, V8 x, V8 y) { return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q))}; }
// Lanes 0..n-1 from a, the others from b.
inline V8 vsel_first(int n, V8 a, V8 b) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return {_mm256_blendv_ps(b.v, a.v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx)))};
}
inline float lane(V8 a, int i) {
  alignas(32) float t[8];
  _mm256_store_ps(t, a.v);
  return t[i];
}
// Eight horizontal sums at once: lane i of the result is hsum(a[i]) with the same tree as hsum.
inline V8 hsum8(const V8* a) {
  __m256 h01 = _mm256_hadd_ps(a[0].v, a[1].v), h23 = _mm256_hadd_ps(a[2].v, a[3].v);
  __m256 h45 = _mm256_hadd_ps(a[4].v, a[5].v), h67 = _mm256_hadd_ps(a[6].v, a[7].v);
  __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
  return {_mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31))};
}
// In place: r[i] lane j <- r[j] lane i (an 8 x 8 transpose; moves values, no arithmetic).
inline void transpose8(V8* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i].v, r[i + 1].v), t[i + 1] = _mm256_unpackhi_ps(r[i].v, r[i + 1].v);
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i].v = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4].v = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#else
struct V8 {
  float v[8];
};
#define TONP_LANES for (int i = 0; i < 8; ++i)
inline V8 vzero() { V8 r; TONP_LANES r.v[i] = 0.f; return r; }
inline V8 vset1(float x) { V8 r; TONP_LANES r.v[i] = x; return r; }
inline V8 vload(const float* p) { V8 r; TONP_LANES r.v[i] = p[i]; return r; }
inline V8 vload(const uint16_t* p) { V8 r; TONP_LANES r.v[i] = bf16_to_f32(p[i]); return r; }
inline void vstore(float* p, V8 a) { TONP_LANES p[i] = a.v[i]; }
inline void vstore_bf16(uint16_t* p, V8 a) { TONP_LANES p[i] = f32_to_bf16(a.v[i]); }
inline V8 vadd(V8 a, V8 b) { TONP_LANES a.v[i] = a.v[i] + b.v[i]; return a; }
inline V8 vsub(V8 a, V8 b) { TONP_LANES a.v[i] = a.v[i] - b.v[i]; return a; }
inline V8 vmul(V8 a, V8 b) { TONP_LANES a.v[i] = a.v[i] * b.v[i]; return a; }
inline V8 vdiv(V8 a, V8 b) { TONP_LANES a.v[i] = a.v[i] / b.v[i]; return a; }
inline V8 vfma(V8 a, V8 b, V8 c) { TONP_LANES c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
inline V8 vmax(V8 a, V8 b) { TONP_LANES a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return a; }
inline V8 vmin(V8 a, V8 b) { TONP_LANES a.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return a; }
inline V8 vround(V8 a) { TONP_LANES a.v[i] = std::nearbyint(a.v[i]); return a; }
inline V8 vpow2i(V8 n) {
  V8 r;
  TONP_LANES {
    uint32_t e = uint32_t(int32_t(n.v[i]) + 127) << 23;
    std::memcpy(&r.v[i], &e, 4);
  }
  return r;
}
inline V8 vsel_lt(V8 a, V8 b, V8 x, V8 y) { TONP_LANES y.v[i] = a.v[i] < b.v[i] ? x.v[i] : y.v[i]; return y; }
inline V8 vsel_nan(V8 a, V8 x, V8 y) { TONP_LANES y.v[i] = std::isnan(a.v[i]) ? x.v[i] : y.v[i]; return y; }
inline V8 vsel_first(int n, V8 a, V8 b) { TONP_LANES b.v[i] = i < n ? a.v[i] : b.v[i]; return b; }
inline float lane(V8 a, int i) { return a.v[i]; }
inline V8 hsum8(const V8* a) {
  V8 r;
  TONP_LANES {
    const float* t = a[i].v;
    r.v[i] = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
  return r;
}
inline void transpose8(V8* r) {
  for (int i = 0; i < 8; ++i)
    for (int j = i + 1; j < 8; ++j) {
      const float t = r[i].v[j];
      r[i].v[j] = r[j].v[i];
      r[j].v[i] = t;
    }
}
#undef TONP_LANES
#endif

// A hint to fetch the cache line holding p into L1 (never faults; changes no value).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// The one horizontal-sum tree: ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
inline float hsum(V8 a) {
  float t[8];
  vstore(t, a);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

// exp(x) (Cephes expf, ~1 ulp): range reduction x = n ln2 + r with a two-constant ln2, a degree-6
// polynomial, and 2^n in the exponent bits. x < -87.3365 gives 0 (no denormals), x > 88 gives
// +inf, NaN stays NaN.
inline V8 vexp(V8 x) {
  const V8 lo = vset1(-87.33654475f), hi = vset1(88.0f);
  V8 xc = vmin(vmax(x, lo), hi);
  V8 n = vround(vmul(xc, vset1(1.44269504088896341f)));
  V8 r = vfma(n, vset1(-0.693359375f), xc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  V8 p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  V8 y = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
  y = vmul(y, vpow2i(n));
  y = vsel_lt(x, lo, vzero(), y);
  y = vsel_lt(hi, x, vset1(INFINITY), y);
  return vsel_nan(x, x, y);
}

inline float sexp(float x) { return lane(vexp(vset1(x)), 0); }

// Exponent split and an equality select, for vlog. vfrexp: x = m * 2^e for a positive normal x,
// m in [0.5, 1) (the exponent field set to 126), e integral; other inputs give garbage that
// vlog replaces.
#if TONP_AVX2
inline V8 vfrexp(V8 x, V8* e) {
  const __m256i b = _mm256_castps_si256(x.v);
  const __m256i ex = _mm256_and_si256(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(0xff));
  e->v = _mm256_cvtepi32_ps(_mm256_sub_epi32(ex, _mm256_set1_epi32(126)));
  const __m256i mant = _mm256_and_si256(b, _mm256_set1_epi32(0x007fffff));
  return {_mm256_castsi256_ps(_mm256_or_si256(mant, _mm256_set1_epi32(0x3f000000)))};
}
inline V8 vsel_eq(V8 a, V8 b, V8 x, V8 y) { return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ))}; }
#else
inline V8 vfrexp(V8 x, V8* e) {
  V8 m;
  for (int i = 0; i < 8; ++i) {
    uint32_t b;
    std::memcpy(&b, &x.v[i], 4);
    e->v[i] = float(int32_t((b >> 23) & 0xffu) - 126);
    b = (b & 0x007fffffu) | 0x3f000000u;
    std::memcpy(&m.v[i], &b, 4);
  }
  return m;
}
inline V8 vsel_eq(V8 a, V8 b, V8 x, V8 y) {
  for (int i = 0; i < 8; ++i) y.v[i] = a.v[i] == b.v[i] ? x.v[i] : y.v[i];
  return y;
}
#endif

// log(x) (Cephes logf, ~1 ulp; its Triton twin is tonp_kernels/accel/numerics.py `log`): x = m 2^e
// from the exponent bits (denormals scaled by 2^23 first), m folded into [sqrt(1/2), sqrt(2)) as
// 1 + f (exact), a degree-8 polynomial in f by FMAs, e ln2 added with a two-constant ln2.
// log(+-0) = -inf, log(x < 0) = NaN, log(inf) = inf, NaN stays NaN.
inline V8 vlog(V8 x) {
  const V8 one = vset1(1.0f), tiny = vset1(1.17549435e-38f), sqrthf = vset1(0.707106781186547524f);
  const V8 xs = vsel_lt(x, tiny, vmul(x, vset1(8388608.0f)), x);
  V8 e;
  const V8 m = vfrexp(xs, &e);
  e = vsub(e, vsel_lt(x, tiny, vset1(23.0f), vzero()));
  const V8 f = vsel_lt(m, sqrthf, vsub(vadd(m, m), one), vsub(m, one));
  e = vsel_lt(m, sqrthf, vsub(e, one), e);
  const V8 z = vmul(f, f);
  V8 p = vfma(f, vset1(7.0376836292e-2f), vset1(-1.1514610310e-1f));
  p = vfma(p, f, vset1(1.1676998740e-1f));
  p = vfma(p, f, vset1(-1.2420140846e-1f));
  p = vfma(p, f, vset1(1.4249322787e-1f));
  p = vfma(p, f, vset1(-1.6668057665e-1f));
  p = vfma(p, f, vset1(2.0000714765e-1f));
  p = vfma(p, f, vset1(-2.4999993993e-1f));
  p = vfma(p, f, vset1(3.3333331174e-1f));
  V8 y = vmul(vmul(p, f), z);
  y = vfma(e, vset1(-2.12194440e-4f), y);
  y = vfma(z, vset1(-0.5f), y);
  V8 r = vfma(e, vset1(0.693359375f), vadd(f, y));
  r = vsel_lt(x, vzero(), vset1(NAN), r);
  r = vsel_eq(x, vzero(), vset1(-INFINITY), r);
  r = vsel_eq(x, vset1(INFINITY), x, r);
  return vsel_nan(x, x, r);
}

inline float slog(float x) { return lane(vlog(vset1(x)), 0); }

}  // namespace tonp_simd
