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

// ---------------------------------------------------------------------------------------------
// Attention: one query position, one KV head, its G query heads. Keys in blocks aligned to
// position 0; online softmax in fp32 over the blocks in order; one division at the end.
// A head's scores and probabilities are kept transposed, [key][query head] (the heads padded to a
// multiple of 8, Gp): the softmax's sequential max and sum over a block's keys then run for
// eight query heads at once, one chain a lane, where one head at a time each was a chain of
// scalar ops waiting on the last (a third of a cached bf16 decode's time, perf). Only which
// chains share an instruction changes.
// ---------------------------------------------------------------------------------------------
// P.V: per output element (g, d) a sequential FMA chain over the block's keys in order, starting
// from the rescaled running output; GG heads side by side, d = 0 .. dlen (o, vb from the first).
template <int GG, typename T>
static inline void pv_heads(float* o, const float* pt, int Gp, const float* alpha, const T* vb, int64_t pos_stride,
                            int n, int D, int g0, int dlen) {
  for (int d = 0; d < dlen; d += 8) {
    V8 acc[GG];
    for (int gg = 0; gg < GG; ++gg) acc[gg] = vmul(vload(o + int64_t(g0 + gg) * D + d), vset1(alpha[g0 + gg]));
    for (int j = 0; j < n; ++j) {
      const V8 v = vload(vb + j * pos_stride + d);
      for (int gg = 0; gg < GG; ++gg) acc[gg] = vfma(vset1(pt[int64_t(j) * Gp + g0 + gg]), v, acc[gg]);
    }
    for (int gg = 0; gg < GG; ++gg) vstore(o + int64_t(g0 + gg) * D + d, acc[gg]);
  }
}

// The scores of keys j0 .. j0 + 7 for one query head: per key an 8-lane FMA chain over d, then the
// fixed hsum tree; keys at kf + j * kstride (lanes past the block's valid keys read key 0 and are
// unused). A V8 over the eight keys.
static inline V8 scores8(const float* q, const float* kf, int64_t kstride, int n, int j0, int D, float scale) {
  const float* kj[8];
  for (int jj = 0; jj < 8; ++jj) kj[jj] = kf + (j0 + jj < n ? j0 + jj : 0) * kstride;
  V8 acc[8];
  for (int jj = 0; jj < 8; ++jj) acc[jj] = vzero();
  for (int d = 0; d < D; d += 8) {
    const V8 qv = vload(q + d);
    for (int jj = 0; jj < 8; ++jj) acc[jj] = vfma(qv, vload(kj[jj] + d), acc[jj]);
  }
  return vmul(hsum8(acc), vset1(scale));
}

#if defined(TONP_AVX512)
// The AVX-512 build's attention inner loops on zmm: the same chains, sixteen lanes an instruction.
// P.V: pv_heads over sixteen or thirty-two d's at a time (each output element's chain is its own
// lane, so the width changes no operation); the V8 pv_heads takes a last eight.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> fp32 (exact)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
template <int GG, int DV, typename T>
static inline void pv_heads16(float* o, const float* pt, int Gp, const float* alpha, const T* vb, int64_t pos_stride,
                              int n, int D, int g0, int d) {
  __m512 acc[DV][GG];
  _Pragma("GCC unroll 8") for (int gg = 0; gg < GG; ++gg) {
    const __m512 al = _mm512_set1_ps(alpha[g0 + gg]);
    for (int u = 0; u < DV; ++u) acc[u][gg] = _mm512_mul_ps(load16(o + int64_t(g0 + gg) * D + d + 16 * u), al);
  }
  for (int j = 0; j < n; ++j) {
    __m512 v[DV];
    for (int u = 0; u < DV; ++u) v[u] = load16(vb + j * pos_stride + d + 16 * u);
    const float* pj = pt + int64_t(j) * Gp + g0;
    _Pragma("GCC unroll 8") for (int gg = 0; gg < GG; ++gg) {
      const __m512 p = _mm512_set1_ps(pj[gg]);
      for (int u = 0; u < DV; ++u) acc[u][gg] = _mm512_fmadd_ps(p, v[u], acc[u][gg]);
    }
  }
  _Pragma("GCC unroll 8") for (int gg = 0; gg < GG; ++gg)
    for (int u = 0; u < DV; ++u) _mm512_storeu_ps(o + int64_t(g0 + gg) * D + d + 16 * u, acc[u][gg]);
}
template <int GG, typename T>
static inline void pv_heads_zmm(float* o, const float* pt, int Gp, const float* alpha, const T* vb, int64_t pos_stride,
                                int n, int D, int g0) {
  int d = 0;
  for (; d + 32 <= D; d += 32) pv_heads16<GG, 2, T>(o, pt, Gp, alpha, vb, pos_stride, n, D, g0, d);
  for (; d + 16 <= D; d += 16) pv_heads16<GG, 1, T>(o, pt, Gp, alpha, vb, pos_stride, n, D, g0, d);
  if (d < D) pv_heads<GG, T>(o + d, pt, Gp, alpha, vb + d, pos_stride, n, D, g0, D - d);
}
// Eight d's of keys a and b side by side in one zmm (bf16 widened: exact).
static inline __m512 pair8(const float* a, const float* b) {
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}
static inline __m512 pair8(const uint16_t* a, const uint16_t* b) {
  const __m256i w = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}
// A block's keys in pairs for zmm_scores8: pair p (keys 2p and 2p + 1) at kp + 2 p D, each eight-d
// step of key 2p followed by the same step of key 2p + 1; keys from n to the next multiple of 8
// copy key 0, as scores8 reads it there (their scores are unused).
template <typename T>
static inline void pair_keys(const T* kb, int64_t pos_stride, int n, int64_t D, float* kp) {
  const int n8 = (n + 7) / 8 * 8;
  for (int j = 0; j < n8; j += 2, kp += 2 * D) {
    const T* a = kb + int64_t(j < n ? j : 0) * pos_stride;
    const T* b = kb + int64_t(j + 1 < n ? j + 1 : 0) * pos_stride;
    for (int64_t d = 0; d < D; d += 8) _mm512_storeu_ps(kp + 2 * d, pair8(a + d, b + d));
  }
}
// scores8 from pair_keys (kp: keys j0's pair) for NQ query heads at once (q, q + D, ...): key 2p's
// eight-lane chain in the low half of acc[h][p], key 2p + 1's in the high half, q's eight d's in
// both; then the same hsum tree. Two heads give eight independent chains, enough to cover the
// FMA's latency (four were bound by it).
template <int NQ>
static inline void zmm_scores8(const float* q, const float* kp, int64_t D, float scale, V8* out) {
  __m512 acc[NQ][4];
  for (int h = 0; h < NQ; ++h)
    for (int p = 0; p < 4; ++p) acc[h][p] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 k[4];
    for (int p = 0; p < 4; ++p) k[p] = _mm512_loadu_ps(kp + p * 2 * D + 2 * d);
    for (int h = 0; h < NQ; ++h) {
      const __m512 qv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + h * D + d))));
      for (int p = 0; p < 4; ++p) acc[h][p] = _mm512_fmadd_ps(qv, k[p], acc[h][p]);
    }
  }
  for (int h = 0; h < NQ; ++h) {
    V8 a8[8];
    for (int p = 0; p < 4; ++p) {
      a8[2 * p] = {_mm512_castps512_ps256(acc[h][p])};
      a8[2 * p + 1] = {_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[h][p]), 1))};
    }
    out[h] = vmul(hsum8(a8), vset1(scale));
  }
}
#endif

template <typename T>
static void attention_t(const AttnQuery& a0, int heads, int G, int D, int block, float scale, float* scratch) {
  const int bpad = (block + 7) / 8 * 8, Gp = (G + 7) / 8 * 8;
  const int64_t hfl = tonp::attn_head_floats(G, D, block);
  float* kw = scratch + heads * hfl;  // [bpad, D] the block's keys as the scores read them (bf16 widened)
  // Head h's state at scratch + h * hfl: scores, then probabilities [bpad, Gp] (transposed); the
  // running outputs [G, D]; the running max, running sum and this block's rescale [Gp] each.
  auto state = [&](int h, float*& pt, float*& o, float*& m, float*& l, float*& alpha) {
    pt = scratch + h * hfl;
    o = pt + int64_t(bpad) * Gp;
    m = o + int64_t(G) * D;
    l = m + Gp;
    alpha = l + Gp;
  };
  for (int h = 0; h < heads; ++h) {
    float *pt, *o, *m, *l, *alpha;
    state(h, pt, o, m, l, alpha);
    for (int g = 0; g < Gp; ++g) m[g] = -INFINITY, l[g] = 0.f;
    for (int64_t i = 0; i < int64_t(G) * D; ++i) o[i] = 0.f;
  }
  const int64_t nblocks = a0.pos / block + 1;
  const bool fetch = a0.pages || !std::is_same_v<T, float>;  // the next block's rows (below)
  for (int64_t b = 0; b < nblocks; ++b)
    for (int h = 0; h < heads; ++h) {
      float *pt, *o, *m, *l, *alpha;
      state(h, pt, o, m, l, alpha);
      const int64_t hoff = int64_t(h) * D;  // this KV head's slice of a position
      const float* qh = a0.q + int64_t(h) * G * D;
      const int n = int(a0.pos + 1 - b * block < block ? a0.pos + 1 - b * block : block);
      const int64_t off = (a0.pages ? int64_t(a0.pages[b]) * a0.page_stride : b * block * a0.pos_stride) + hoff;
      const T* kb = static_cast<const T*>(a0.k_base) + off;
      const T* vb = static_cast<const T*>(a0.v_base) + off;
      // The keys the G heads' score chains read: bf16 widened to fp32 once a block, not once a
      // head (exact: the same operands); on the AVX-512 build in pairs for its zmm chains.
      const float* kf;
      int64_t kstride;
#if defined(TONP_AVX512)
      pair_keys(kb, a0.pos_stride, n, D, kw);
      kf = kw, kstride = D;
#else
      if constexpr (std::is_same_v<T, uint16_t>) {
        for (int j = 0; j < n; ++j)
          for (int d = 0; d < D; d += 8) vstore(kw + int64_t(j) * D + d, vload(kb + j * a0.pos_stride + d));
        kf = kw, kstride = D;
      } else {
        kf = kb, kstride = a0.pos_stride;
      }
#endif
      // The next block's K and V rows of this head fetched into L2 while this block computes,
      // spread over its score iterations: a head's slice of each position is a short run a cache
      // row from the next, which the hardware prefetchers do not follow (hints only: integer
      // addresses, no arithmetic). Not on an fp32 varlen call, whose keys the queries before
      // had read (measured there a loss: docs/performance.md).
      const int64_t bn = b + 1;
      const int nn = bn < nblocks && fetch ? int(a0.pos + 1 - bn * block < block ? a0.pos + 1 - bn * block : block) : 0;
      const int64_t offn = nn ? (a0.pages ? int64_t(a0.pages[bn]) * a0.page_stride : bn * block * a0.pos_stride) + hoff : 0;
      const uintptr_t kn = reinterpret_cast<uintptr_t>(a0.k_base) + sizeof(T) * uintptr_t(offn);
      const uintptr_t vn = reinterpret_cast<uintptr_t>(a0.v_base) + sizeof(T) * uintptr_t(offn);
      const int iters = G * ((n + 7) / 8);
      int it = 0;
      auto fetch_next = [&]() {
        if (!nn) return;
        const int j1 = int(int64_t(it + 1) * nn / iters);
        for (int j = int(int64_t(it) * nn / iters); j < j1; ++j)
          for (int64_t by = 0; by < int64_t(sizeof(T)) * D; by += 64) {
            const uintptr_t row = sizeof(T) * uintptr_t(j * a0.pos_stride) + uintptr_t(by);
            __builtin_prefetch(reinterpret_cast<const void*>(kn + row), 0, 2);
            __builtin_prefetch(reinterpret_cast<const void*>(vn + row), 0, 2);
          }
        ++it;
      };
      // Scores, eight keys by eight query heads at a time, stored transposed.
      for (int g0 = 0; g0 < Gp; g0 += 8)
        for (int j0 = 0; j0 < n; j0 += 8) {
          V8 sg[8];
          for (int gg = 0; gg < 8; ++gg) {
            if (g0 + gg >= G) {
              sg[gg] = vzero();
              continue;
            }
            fetch_next();
            const float* q = qh + int64_t(g0 + gg) * D;
#if defined(TONP_AVX512)
            if (gg + 1 < 8 && g0 + gg + 1 < G) {  // two heads at once
              fetch_next();
              zmm_scores8<2>(q, kf + int64_t(j0) * D, D, scale, sg + gg);
              ++gg;
            } else {
              zmm_scores8<1>(q, kf + int64_t(j0) * D, D, scale, sg + gg);
            }
#else
            sg[gg] = scores8(q, kf, kstride, n, j0, D, scale);
#endif
          }
          transpose8(sg);  // sg[jj]: key j0 + jj's scores of the eight heads
          for (int jj = 0; jj < 8; ++jj) vstore(pt + int64_t(j0 + jj) * Gp + g0, sg[jj]);
        }
      // The online softmax of eight heads a lane each: the block's max, the new running max, the
      // rescale of the running output, the probabilities, and the running sum as a sequential
      // chain over the keys in order.
      for (int g0 = 0; g0 < Gp; g0 += 8) {
        V8 mb = vload(pt + g0);
        for (int j = 1; j < n; ++j) mb = vmax(vload(pt + int64_t(j) * Gp + g0), mb);  // s[j] > mb ? s[j] : mb
        const V8 mo = vload(m + g0), mn = vmax(mb, mo);                             // mb > m ? mb : m
        const V8 al = vsel_eq(mo, vset1(-INFINITY), vzero(), vexp(vsub(mo, mn)));  // m = -inf: 0
        V8 lg = vmul(vload(l + g0), al);
        for (int j = 0; j < n; ++j) {
          const V8 p = vexp(vsub(vload(pt + int64_t(j) * Gp + g0), mn));
          vstore(pt + int64_t(j) * Gp + g0, p);
          lg = vadd(lg, p);
        }
        vstore(l + g0, lg);
        vstore(m + g0, mn);
        vstore(alpha + g0, al);
      }
      int g = 0;
#if defined(TONP_AVX512)
      for (; g + 8 <= G; g += 8) pv_heads_zmm<8, T>(o, pt, Gp, alpha, vb, a0.pos_stride, n, D, g);
      for (; g + 4 <= G; g += 4) pv_heads_zmm<4, T>(o, pt, Gp, alpha, vb, a0.pos_stride, n, D, g);
      for (; g < G; ++g) pv_heads_zmm<1, T>(o, pt, Gp, alpha, vb, a0.pos_stride, n, D, g);
#else
      for (; g + 8 <= G; g += 8) pv_heads<8, T>(o, pt, Gp, alpha, vb, a0.pos_stride, n, D, g, D);
      for (; g + 4 <= G; g += 4) pv_heads<4, T>(o, pt, Gp, alpha, vb, a0.pos_stride, n, D, g, D);
      for (; g < G; ++g) pv_heads<1, T>(o, pt, Gp, alpha, vb, a0.pos_stride, n, D, g, D);
#endif
    }
  for (int h = 0; h < heads; ++h) {
    float *pt, *o, *m, *l, *alpha;
    state(h, pt, o, m, l, alpha);
    float* out = a0.out + int64_t(h) * G * D;
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < D; d += 8) vstore(out + int64_t(g) * D + d, vdiv(vload(o + int64_t(g) * D + d), vset1(l[g])));
  }
}

// `heads` consecutive KV heads of one query (kernels.h: Kernels::attention), block by block.
static void attention(const AttnQuery& a, int heads, int G, int D, int block, Elem kv, float scale, float* scratch) {
  if (kv == Elem::F32)
    attention_t<float>(a, heads, G, D, block, scale, scratch);
  else
    attention_t<uint16_t>(a, heads, G, D, block, scale, scratch);
}

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
  float t[8];
  for (; h + 8 <= H; h += 8) {
    V8 acc = vzero();
    for (int64_t k = 0; k < K; ++k) acc = vfma(vset1(w[k]), loadv(y, k * H + h, e), acc);
    vstore(t, acc);
    for (int i = 0; i < 8; ++i) store1(out, h + i, t[i], e);
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

