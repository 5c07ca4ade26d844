// Kernel bodies, compiled once per ISA (isa_avx2.cpp, isa_portable.cpp) inside a namespace of
// that ISA. Only lane-wise V8 operations and the fixed hsum trees appear here, so every ISA
// computes the same bits. Each function computes complete outputs; nothing here splits a
// reduction across threads.
#include <type_traits>

#include "kernels.h"
#include "simd.h"

using namespace tonp_simd;
using tonp::AttnQuery;
using tonp::Elem;
using tonp::kPanel;

static inline float to_f32(float v) { return v; }
static inline float to_f32(uint16_t v) { return bf16_to_f32(v); }

static inline float load1(const void* p, int64_t i, Elem e) {
  return e == Elem::F32 ? static_cast<const float*>(p)[i]
                        : bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

static inline void store1(void* p, int64_t i, float v, Elem e) {
  if (e == Elem::F32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
}

// The value as the output dtype would hold it (HF rounds at these points too).
static inline float round_to(float v, Elem e) { return e == Elem::F32 ? v : bf16_to_f32(f32_to_bf16(v)); }

static inline V8 loadv(const void* p, int64_t i, Elem e) {
  return e == Elem::F32 ? vload(static_cast<const float*>(p) + i)
                        : vload(static_cast<const uint16_t*>(p) + i);
}

#include "linear_impl.h"

#include "attention_impl.h"  // attention_t, attention

// ---------------------------------------------------------------------------------------------
// Row-wise ops
// ---------------------------------------------------------------------------------------------
static void rms_norm(const void* x, const void* w, void* out, int64_t H, float eps, Elem e, Elem we) {
  V8 acc = vzero();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    V8 v = loadv(x, i, e);
    acc = vfma(v, v, acc);
  }
  float lanes[8];
  vstore(lanes, acc);
  for (int t = 0; i < H; ++i, ++t) {  // the tail goes to lanes 0.. in order, same as a vector would
    float v = load1(x, i, e);
    lanes[t] = std::fma(v, v, lanes[t]);
  }
  const float ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  const float r = 1.0f / std::sqrt(ss / float(H) + eps);
  for (int64_t j = 0; j < H; ++j) store1(out, j, load1(w, j, we) * round_to(load1(x, j, e) * r, e), e);
}

static void silu_mul(const void* g, const void* u, void* out, int64_t n, Elem e) {
  const V8 one = vset1(1.0f), zero = vzero();
  float s[8];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    V8 gv = loadv(g, i, e);
    vstore(s, vdiv(gv, vadd(one, vexp(vsub(zero, gv)))));
    for (int t = 0; t < 8; ++t) store1(out, i + t, round_to(s[t], e) * load1(u, i + t, e), e);
  }
  for (; i < n; ++i) {
    float gv = load1(g, i, e);
    float sv = gv / (1.0f + sexp(0.0f - gv));
    store1(out, i, round_to(sv, e) * load1(u, i, e), e);
  }
}

// The largest y_i = x[i] / T (T = 1: x[i] itself) of i in [b, end), NaN skipped, by the rule
// mx = y > mx ? y : mx from -inf: vmax is that rule lane by lane, then across the eight lanes in
// order (the portable build's lanes do the same). A maximum is one value in any order but for
// the sign of a zero, so a zero maximum is returned as +0. y, when non-null, receives the y_i
// (y[0] for i = b); *nan, when non-null, whether one was NaN. -inf when every y_i is NaN or -inf.
static float row_max(const void* x, int64_t b, int64_t end, Elem e, float temperature, float* y, bool* nan) {
  const bool scaled = temperature != 1.0f;
  const V8 tv = vset1(temperature), one = vset1(1.0f);
  V8 m = vset1(-INFINITY), bad = vzero();
  int64_t i = b;
  for (; i + 8 <= end; i += 8) {
    V8 v = loadv(x, i, e);
    if (scaled) v = vdiv(v, tv);
    if (y) vstore(y + (i - b), v);
    m = vmax(v, m);  // v > m ? v : m: a NaN v keeps m
    bad = vsel_nan(v, one, bad);
  }
  alignas(32) float lanes[8];
  vstore(lanes, m);
  float mx = -INFINITY;
  for (int l = 0; l < 8; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  vstore(lanes, bad);
  bool any_nan = false;
  for (int l = 0; l < 8; ++l) any_nan = any_nan || lanes[l] != 0.0f;
  for (; i < end; ++i) {
    const float v = scaled ? load1(x, i, e) / temperature : load1(x, i, e);
    if (y) y[i - b] = v;
    any_nan = any_nan || v != v;
    mx = v > mx ? v : mx;
  }
  if (nan) *nan = any_nan;
  return mx + 0.0f;  // -0 -> +0; every other value (and -inf) unchanged
}

// Per-chunk (max, sum exp(x/T - max)) of one row: lanes over the chunk, then the hsum tree.
static void lse_chunks(const void* x, int64_t V, Elem e, float temperature, int chunks, float* m, float* s) {
  const int64_t vc = V / chunks;
  const bool scaled = temperature != 1.0f;
  const V8 tv = vset1(temperature);
  for (int c = 0; c < chunks; ++c) {
    const int64_t b = c * vc, end = b + vc;
    // NaN never wins; a NaN among finite values makes the sum NaN. A zero max is +0, as the
    // callers make every chunk max (exp(y - 0) is 1 for y = +0 and -0 alike).
    const float mx = row_max(x, b, end, e, temperature, nullptr, nullptr);
    m[c] = mx;
    if (mx == -INFINITY) {  // every entry -inf (masked: sum 0) or NaN (the sum stays NaN)
      s[c] = 0.f;
      for (int64_t i = b; i < end; ++i)
        if (load1(x, i, e) != load1(x, i, e)) {
          s[c] = NAN;
          break;
        }
      continue;
    }
    const V8 mv = vset1(mx);
    V8 acc = vzero();
    int64_t i = b;
    for (; i + 8 <= end; i += 8) {
      V8 y = loadv(x, i, e);
      if (scaled) y = vdiv(y, tv);
      acc = vadd(acc, vexp(vsub(y, mv)));
    }
    float lanes[8];
    vstore(lanes, acc);
    for (int t = 0; i < end; ++i, ++t) {
      float y = scaled ? load1(x, i, e) / temperature : load1(x, i, e);
      lanes[t] = lanes[t] + sexp(y - mx);
    }
    s[c] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  }
}

static float row_max_f(const void* x, int64_t V, Elem e, float temperature, float* y, bool* nan) {
  return row_max(x, 0, V, e, temperature, y, nan);
}

// --- seeded sampling's noise (CONTRACT.md "sample"; vocab_ops.cpp's sample) ---
// Token t's hash h = splitmix64(key ^ t) as the three floats the noise is made of: hi = h's bits
// 32..62, lo = bits 1..31 with bit 0 set (int32 -> fp32, round to nearest), and sign = -1 where
// h's top bit is set, else +1. Eight tokens: ids[0..8) (kIds) or t0 .. t0 + 7.
#if TONP_AVX2
static inline __m256i mul64(__m256i a, uint64_t c) {  // a * c mod 2^64, per 64-bit lane
  const __m256i cl = _mm256_set1_epi64x(int64_t(c & 0xffffffffu)), ch = _mm256_set1_epi64x(int64_t(c >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), cl), _mm256_mul_epu32(a, ch));
  return _mm256_add_epi64(_mm256_mul_epu32(a, cl), _mm256_slli_epi64(cross, 32));
}
static inline __m256i splitmix64x4(__m256i z) {
  z = _mm256_add_epi64(z, _mm256_set1_epi64x(int64_t(0x9e3779b97f4a7c15ull)));
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xbf58476d1ce4e5b9ull);
  z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94d049bb133111ebull);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}
static inline __m256i low_dwords(__m256i a, __m256i b) {  // the low 32 bits of a's four lanes, then b's
  const __m256i idx = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  return _mm256_permute2x128_si256(_mm256_permutevar8x32_epi32(a, idx), _mm256_permutevar8x32_epi32(b, idx), 0x20);
}
template <bool kIds>
static inline void noise_bits8(uint64_t key, const int64_t* ids, int64_t t0, float* hi, float* lo, float* sign) {
  const __m256i k = _mm256_set1_epi64x(int64_t(key));
  const __m256i a = kIds ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids))
                         : _mm256_add_epi64(_mm256_set1_epi64x(t0), _mm256_setr_epi64x(0, 1, 2, 3));
  const __m256i b = kIds ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ids + 4)) : _mm256_add_epi64(a, _mm256_set1_epi64x(4));
  const __m256i ha = splitmix64x4(_mm256_xor_si256(k, a)), hb = splitmix64x4(_mm256_xor_si256(k, b));
  const __m256i top = low_dwords(_mm256_srli_epi64(ha, 32), _mm256_srli_epi64(hb, 32));  // h >> 32
  const __m256i low = low_dwords(_mm256_srli_epi64(ha, 1), _mm256_srli_epi64(hb, 1));
  const __m256i m31 = _mm256_set1_epi32(0x7fffffff);
  _mm256_store_ps(hi, _mm256_cvtepi32_ps(_mm256_and_si256(top, m31)));
  _mm256_store_ps(lo, _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(low, m31), _mm256_set1_epi32(1))));
  _mm256_store_ps(sign, _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(-1.0f), _mm256_castsi256_ps(top)));
}
#else
template <bool kIds>
static inline void noise_bits8(uint64_t key, const int64_t* ids, int64_t t0, float* hi, float* lo, float* sign) {
  for (int l = 0; l < 8; ++l) {
    const uint64_t h = tonp::splitmix64(key ^ uint64_t(kIds ? ids[l] : t0 + l));
    hi[l] = float(int32_t((h >> 32) & 0x7fffffffu));
    lo[l] = float(int32_t(((h >> 1) & 0x7fffffffu) | 1u));
    sign[l] = (h >> 63) ? -1.0f : 1.0f;
  }
}
#endif

// The Gumbel-max draw over n tokens (ids[0..n), ascending, or with kIds false the tokens 0..n-1)
// whose logit y[token] is not -inf: the first token of the largest score y[t] - log(E_t), E_t
// the exponential variate of token t's hash (noise_bits8): w = (hi * 2^-31 + lo * 2^-62) * 0.5,
// in [2^-63, 1/2]; E = -log(w) where sign < 0, else -log1p(-w) by Goldberg's formula
// log(u) * w / (u - 1), u = 1 - w (E = w where u rounds to 1); log is tonp's vlog. Lane-wise IEEE
// operations on eight tokens at a time, the portable build's lanes the same arithmetic; a last
// partial eight is padded with -inf logits, which never win. Four eights at a time, stage by
// stage, so that their long dependent chains (two logs) overlap in the core: against one eight
// at a time, 1.6-2.0x (sample, 64 rows of 16,384 and of 151,936 logits, 2 threads, AMD EPYC Zen
// 3, AVX2 table). score: n floats of scratch. At least one token must be finite.
template <bool kIds>
static int64_t gumbel_draw(const float* y, const int64_t* ids, int64_t n, uint64_t key, float* score) {
  constexpr int U = 4;
  const V8 one = vset1(1.0f), zero = vzero(), half = vset1(0.5f), c31 = vset1(0x1p-31f), c62 = vset1(0x1p-62f);
  alignas(32) float hi[U][8], lo[U][8], sign[U][8], yv[U][8], sc[U][8];
  alignas(32) int64_t pad[8];
  V8 m = vset1(-INFINITY);
  for (int64_t j0 = 0; j0 < n; j0 += 8 * U) {
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + 8 * u, nb = n - j < 0 ? 0 : n - j < 8 ? n - j : 8;
      const int64_t* idu = kIds ? ids + j : nullptr;
      if (kIds && nb < 8) {
        for (int l = 0; l < 8; ++l) pad[l] = l < nb ? ids[j + l] : 0;
        idu = pad;
      }
      noise_bits8<kIds>(key, idu, j, hi[u], lo[u], sign[u]);
      for (int l = 0; l < 8; ++l) yv[u][l] = l < nb ? y[kIds ? idu[l] : j + l] : -INFINITY;
    }
    V8 w[U], uu[U], lu[U], E[U];
    for (int u = 0; u < U; ++u) {
      w[u] = vmul(vadd(vmul(vload(hi[u]), c31), vmul(vload(lo[u]), c62)), half);
      uu[u] = vsel_lt(vload(sign[u]), zero, w[u], vsub(one, w[u]));  // sign < 0: u = w (E = -log w)
    }
    for (int u = 0; u < U; ++u) lu[u] = vlog(uu[u]);
    for (int u = 0; u < U; ++u)
      E[u] = vsel_lt(vload(sign[u]), zero, vsub(zero, lu[u]),
                     vsel_eq(uu[u], one, w[u], vdiv(vmul(lu[u], w[u]), vsub(uu[u], one))));
    for (int u = 0; u < U; ++u) lu[u] = vlog(E[u]);
    for (int u = 0; u < U; ++u) {
      const V8 s = vsub(vload(yv[u]), lu[u]);
      m = vmax(s, m);
      vstore(sc[u], s);
    }
    const int64_t nw = n - j0 < 8 * U ? n - j0 : 8 * U;
    std::memcpy(score + j0, &sc[0][0], sizeof(float) * nw);
  }
  alignas(32) float lanes[8];
  vstore(lanes, m);
  float mx = -INFINITY;
  for (int l = 0; l < 8; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  for (int64_t j = 0; j < n; ++j)  // the first token of the largest score (a finite token's)
    if (score[j] == mx) return kIds ? ids[j] : j;
  return kIds ? ids[0] : 0;  // not reached: a finite logit gives a finite score
}

static int64_t gumbel_argmax(const float* y, const int64_t* ids, int64_t n, uint64_t key, float* score) {
  return ids ? gumbel_draw<true>(y, ids, n, key, score) : gumbel_draw<false>(y, nullptr, n, key, score);
}

// Token-owned MoE combine: out = sum over slots k in order of w_k * y_k, an fp32 FMA chain.
static void moe_combine(const float* w, const void* y, void* out, int64_t K, int64_t H, Elem e) {
  int64_t h = 0;
  for (; h + 8 <= H; h += 8) {
    V8 acc = vzero();
    for (int64_t k = 0; k < K; ++k) acc = vfma(vset1(w[k]), loadv(y, k * H + h, e), acc);
    if (e == Elem::F32) vstore(static_cast<float*>(out) + h, acc);
    else vstore_bf16(static_cast<uint16_t*>(out) + h, acc);
  }
  for (; h < H; ++h) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc = std::fma(w[k], load1(y, k * H + h, e), acc);
    store1(out, h, acc, e);
  }
}

// log of n floats: vlog on whole vectors, slog (the same lane arithmetic) on the tail.
static void log_n(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vstore(y + i, vlog(vload(x + i)));
  for (; i < n; ++i) y[i] = slog(x[i]);
}

