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
// ---------------------------------------------------------------------------------------------
template <int GG, typename T>
static inline void pv_heads(float* o, const float* sc, const float* alpha, const T* vb, int64_t pos_stride, int n,
                            int D, int bpad, int g0) {
  for (int d = 0; d < D; d += 8) {
    V8 acc[GG];
    for (int gg = 0; gg < GG; ++gg) acc[gg] = vmul(vload(o + int64_t(g0 + gg) * D + d), vset1(alpha[g0 + gg]));
    for (int j = 0; j < n; ++j) {
      const V8 v = vload(vb + j * pos_stride + d);
      for (int gg = 0; gg < GG; ++gg) acc[gg] = vfma(vset1(sc[int64_t(g0 + gg) * bpad + j]), v, acc[gg]);
    }
    for (int gg = 0; gg < GG; ++gg) vstore(o + int64_t(g0 + gg) * D + d, acc[gg]);
  }
}

template <typename T>
static void attention_t(const AttnQuery& a, int G, int D, int block, float scale, float* scratch) {
  const int bpad = (block + 7) / 8 * 8;
  float* sc = scratch;                  // [G, bpad] scores, then probabilities
  float* o = sc + int64_t(G) * bpad;    // [G, D] running outputs
  float* m = o + int64_t(G) * D;        // [G] running max
  float* l = m + G;                     // [G] running sum
  float* alpha = l + G;                 // [G] rescale of the running output for this block
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) o[g * D + d] = 0.f;
  }
  const int64_t nblocks = a.pos / block + 1;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int n = int(a.pos + 1 - b * block < block ? a.pos + 1 - b * block : block);
    const int64_t off = a.pages ? int64_t(a.pages[b]) * a.page_stride : b * block * a.pos_stride;
    const T* kb = static_cast<const T*>(a.k_base) + off;
    const T* vb = static_cast<const T*>(a.v_base) + off;
    for (int g = 0; g < G; ++g) {
      const float* q = a.q + int64_t(g) * D;
      float* s = sc + int64_t(g) * bpad;
      // Scores: per key an 8-lane FMA chain over d, then the fixed hsum tree. Eight keys at a
      // time (independent chains); lanes past the block's valid keys read key 0 and are unused.
      for (int j0 = 0; j0 < n; j0 += 8) {
        const T* kj[8];
        for (int jj = 0; jj < 8; ++jj) kj[jj] = kb + (j0 + jj < n ? j0 + jj : 0) * a.pos_stride;
        V8 acc[8];
        for (int jj = 0; jj < 8; ++jj) acc[jj] = vzero();
        for (int d = 0; d < D; d += 8) {
          const V8 qv = vload(q + d);
          for (int jj = 0; jj < 8; ++jj) acc[jj] = vfma(qv, vload(kj[jj] + d), acc[jj]);
        }
        vstore(s + j0, vmul(hsum8(acc), vset1(scale)));
      }
      float mb = s[0];
      for (int j = 1; j < n; ++j) mb = s[j] > mb ? s[j] : mb;
      const float m_new = mb > m[g] ? mb : m[g];
      alpha[g] = m[g] == -INFINITY ? 0.f : sexp(m[g] - m_new);
      for (int j0 = 0; j0 < n; j0 += 8) vstore(s + j0, vexp(vsub(vload(s + j0), vset1(m_new))));
      float lg = l[g] * alpha[g];
      for (int j = 0; j < n; ++j) lg = lg + s[j];
      l[g] = lg;
      m[g] = m_new;
    }
    // P.V: per output element (g, d) a sequential FMA chain over the block's keys in order,
    // starting from the rescaled running output; the G heads run side by side.
    int g = 0;
    for (; g + 8 <= G; g += 8) pv_heads<8, T>(o, sc, alpha, vb, a.pos_stride, n, D, bpad, g);
    for (; g + 4 <= G; g += 4) pv_heads<4, T>(o, sc, alpha, vb, a.pos_stride, n, D, bpad, g);
    for (; g < G; ++g) pv_heads<1, T>(o, sc, alpha, vb, a.pos_stride, n, D, bpad, g);
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; d += 8)
      vstore(a.out + int64_t(g) * D + d, vdiv(vload(o + int64_t(g) * D + d), vset1(l[g])));
}

static void attention(const AttnQuery& a, int G, int D, int block, Elem kv, float scale, float* scratch) {
  if (kv == Elem::F32)
    attention_t<float>(a, G, D, block, scale, scratch);
  else
    attention_t<uint16_t>(a, G, D, block, scale, scratch);
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

// Per-chunk (max, sum exp(x/T - max)) of one row: lanes over the chunk, then the hsum tree.
static void lse_chunks(const void* x, int64_t V, Elem e, float temperature, int chunks, float* m, float* s) {
  const int64_t vc = V / chunks;
  const bool scaled = temperature != 1.0f;
  const V8 tv = vset1(temperature);
  for (int c = 0; c < chunks; ++c) {
    const int64_t b = c * vc, end = b + vc;
    float mx = -INFINITY;
    for (int64_t i = b; i < end; ++i) {
      float y = scaled ? load1(x, i, e) / temperature : load1(x, i, e);
      mx = y > mx ? y : mx;  // NaN never wins; a NaN among finite values makes the sum NaN
    }
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

