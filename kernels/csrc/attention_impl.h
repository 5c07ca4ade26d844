// Causal attention's kernel body (Kernels::attention), compiled once per ISA: included by
// kernels_impl.h inside the ISA's namespace, after its element helpers. The AVX-512 build
// (TONP_AVX512) runs the same chains on zmm.

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
      [[maybe_unused]] int64_t kstride;  // the AVX-512 build reads its pairs (kw) in pair_keys order
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
      // After the last block: the caller's next task's first block of this head (AttnQuery::next_k).
      const int64_t bn = b + 1;
      const bool last = bn == nblocks && a0.next_k;
      const int nn = !fetch                ? 0
                     : last                ? int(a0.next_n)
                     : bn < nblocks ? int(a0.pos + 1 - bn * block < block ? a0.pos + 1 - bn * block : block)
                                    : 0;
      const int64_t offn = nn && !last ? (a0.pages ? int64_t(a0.pages[bn]) * a0.page_stride : bn * block * a0.pos_stride) + hoff
                                       : hoff;
      const uintptr_t kn = reinterpret_cast<uintptr_t>(last ? a0.next_k : a0.k_base) + sizeof(T) * uintptr_t(offn);
      const uintptr_t vn = reinterpret_cast<uintptr_t>(last ? a0.next_v : a0.v_base) + sizeof(T) * uintptr_t(offn);
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
