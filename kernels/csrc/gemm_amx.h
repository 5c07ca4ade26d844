// The backward GEMM (gemm.h) on AMX-BF16 (isa_avx512bf16.cpp only), where both operands are bf16
// and this process may use AMX (amx_check.h: CPUID, XCR0 and the kernel's grant). Gradients are
// correct, not order-locked (CONTRACT.md, "Gradients"), and each build has its own backward
// GEMM; this one's order is fixed per call too: C in blocks of 32 x 32, four tile registers,
// each output's sum C (zero, or the C given when accumulating) then every k block's tdpbf16ps in
// sequence, one per 32 elements of k. An output's bits depend only on its C, its row of A and its
// column of B (a tile computes its elements independently; the padding rows, columns and k are
// zeros that meet no other output), never on which tile or thread holds it.
// TONP_BACKWARD_AMX=0 (read at each call) keeps the vdpbf16ps tiles (gemm_hw.h).
#define TONP_AMX_FN __attribute__((target("amx-tile,amx-bf16")))

constexpr int64_t kAmxK = 32;  // elements of k per tdpbf16ps (16 pairs: a 64-byte tile row)

// A's rows 0 .. m (zero rows up to a multiple of 32) and columns k0 .. k0 + kc (zeros up to kcp,
// a multiple of 32), row-major bf16 lda elements apart: ap[r * lda + kk].
static void amx_pack_a(const tonp::GemmOperand& a, int64_t m, int64_t k0, int64_t kc, int64_t kcp, uint16_t* ap, int64_t lda) {
  const int64_t mp = (m + 31) / 32 * 32;
  const uint16_t* s = static_cast<const uint16_t*>(a.p);
  for (int64_t r = 0; r < mp; ++r) {
    uint16_t* d = ap + r * lda;
    if (r >= m) {
      std::fill_n(d, kcp, uint16_t(0));
      continue;
    }
    if (a.cs == 1) {
      std::memcpy(d, s + r * a.rs + k0, size_t(kc) * 2);
    } else {
      for (int64_t kk = 0; kk < kc; ++kk) d[kk] = s[r * a.rs + (k0 + kk) * a.cs];
    }
    std::fill(d + kc, d + kcp, uint16_t(0));
  }
}

// The same from a column-major A (rs == 1: a weight gradient's A is the output gradient
// transposed), 16 rows by 32 k at a time: each k pair's sixteen row values interleaved into
// 32-bit pairs, then a 16 x 16 transpose of the pairs (hw_transpose16) puts a row's 16 pairs,
// one tile row, in one vector. A copy: the same values as amx_pack_a's element loop.
static void amx_pack_a_cols(const tonp::GemmOperand& a, int64_t m, int64_t k0, int64_t kc, int64_t kcp, uint16_t* ap,
                            int64_t lda) {
  const int64_t mp = (m + 31) / 32 * 32;
  const uint16_t* s = static_cast<const uint16_t*>(a.p);
  __m512i idx;
  {
    alignas(64) uint16_t v[32];
    for (int i = 0; i < 16; ++i) v[2 * i] = uint16_t(i), v[2 * i + 1] = uint16_t(32 + i);
    idx = _mm512_load_si512(v);
  }
  for (int64_t r0 = 0; r0 < mp; r0 += 16) {
    const __mmask16 rows = r0 + 16 <= m ? __mmask16(0xffff) : r0 < m ? __mmask16((1u << (m - r0)) - 1) : __mmask16(0);
    for (int64_t kb = 0; kb < kcp; kb += kAmxK) {
      __m512i v[16];
      for (int p = 0; p < 16; ++p) {
        const int64_t kk = kb + 2 * p;
        const __m256i lo = kk < kc ? _mm256_maskz_loadu_epi16(rows, s + r0 + (k0 + kk) * a.cs) : _mm256_setzero_si256();
        const __m256i hi = kk + 1 < kc ? _mm256_maskz_loadu_epi16(rows, s + r0 + (k0 + kk + 1) * a.cs) : _mm256_setzero_si256();
        v[p] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(lo), idx, _mm512_castsi256_si512(hi));
      }
      hw_transpose16(v);
      for (int r = 0; r < 16; ++r) _mm512_storeu_si512(ap + (r0 + r) * lda + kb, v[r]);
    }
  }
}

// One 32 x 32 block of C over a k block, in four tile registers: loaded from c (ldc floats a
// row; `load`: the sums so far) or zero, one tdpbf16ps per 32 elements of k in sequence (rows
// of ap, lda elements apart; the pairs of a 64-column B strip from column q * 16 on, pair p's
// 64 columns at bs + p * 64), stored back to c.
TONP_AMX_FN static void amx_block(const uint16_t* ap, int64_t lda, const uint32_t* bs, int q, int64_t nsteps, float* c,
                                  int64_t ldc, bool load) {
  const int64_t lb = ldc * 4;
  if (load) {
    _tile_loadd(0, c, lb);
    _tile_loadd(1, c + 16, lb);
    _tile_loadd(2, c + 16 * ldc, lb);
    _tile_loadd(3, c + 16 * ldc + 16, lb);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j = 0; j < nsteps; ++j) {
    _tile_loadd(4, ap + j * kAmxK, lda * 2);
    _tile_loadd(6, bs + j * 16 * 64 + q * 16, 256);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, bs + j * 16 * 64 + (q + 1) * 16, 256);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, ap + 16 * lda + j * kAmxK, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, lb);
  _tile_stored(1, c + 16, lb);
  _tile_stored(2, c + 16 * ldc, lb);
  _tile_stored(3, c + 16 * ldc + 16, lb);
}

TONP_AMX_FN static void amx_config() {  // all eight tiles 16 rows by 64 bytes
  static const tonp_amx::TileConfig cfg = [] {
    tonp_amx::TileConfig c;
    for (int t = 0; t < 8; ++t) c.set(t, 16, 64);
    return c;
  }();
  _tile_loadconfig(&cfg);
}
TONP_AMX_FN static void amx_release() { _tile_release(); }

// C (fp32 row stride ldc, or bf16 rounded once) += A B over every k block in sequence, each a
// chain of tdpbf16ps in the tiles. A is packed once for all of k; then a group of columns at a
// time (its fp32 C, at most 768 rows x 512 columns, stays in L2 while every k block passes),
// each k block's B strips packed and every 32 x 32 block run. A whole block of fp32 C is read
// and written by the tiles in place; an edge block, or bf16 C, through t (its nr x nj values,
// zeros around them): each output's arithmetic is the same on either path, its C then its steps.
// (Against k blocks outermost, C streamed from L3 in every block: 2048^3 1.14x.)
template <bool BF16OUT>
static void gemm_amx_impl(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k,
                          void* cv, int64_t ldc, bool accumulate, float* scratch) {
  // No MXCSR scope: tdpbf16ps does not read MXCSR (its rounding and flushing are its own:
  // CONTRACT.md, "What AMX computes"), nor does the one other operation, a bf16 C's rounding by
  // vcvtneps2bf16.
  constexpr int64_t KC = tonp::kGemmKc;
  const int64_t kcmax = (std::min(KC, k) + kAmxK - 1) / kAmxK * kAmxK;
  const int64_t sstride = kcmax / 2 * 64;  // uint32 per packed B strip: kcmax / 2 pairs of 64 columns
  const int64_t group = tonp::kGemmStrips * 64;  // columns packed at once (kGemmStrips strips)
  uint32_t* bp = reinterpret_cast<uint32_t*>(scratch);
  const int64_t mp = (m + 31) / 32 * 32;
  static thread_local std::vector<uint16_t> abuf;
  abuf.resize(size_t(mp * kcmax));
  uint16_t* ap = abuf.data();
  alignas(64) float t[32 * 32];
  amx_config();
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    const int64_t kc = std::min<int64_t>(KC, k - k0), kcp = (kc + kAmxK - 1) / kAmxK * kAmxK;
    const bool load = accumulate || k0 > 0;
    if (a.rs == 1 && a.cs != 1)
      amx_pack_a_cols(a, m, k0, kc, kcp, ap, kcmax);
    else
      amx_pack_a(a, m, k0, kc, kcp, ap, kcmax);
    for (int64_t g0 = 0; g0 < n; g0 += group) {
      const int64_t gn = std::min(group, n - g0);
      for (int64_t s = 0; s * 64 < gn; ++s) {  // each strip's pairs, zero from (kc + 1) / 2 to kcp / 2
        uint32_t* d = bp + s * sstride;
        gh_pack_b(b, k0, kc, g0 + 64 * s, std::min<int64_t>(64, gn - 64 * s), d, true);
        std::fill(d + (kc + 1) / 2 * 64, d + kcp / 2 * 64, 0u);
      }
      for (int64_t j0 = g0; j0 < g0 + gn; j0 += 32) {
        const int nj = int(std::min<int64_t>(32, n - j0));
        const uint32_t* bs = bp + (j0 - g0) / 64 * sstride;
        const int q = int((j0 - g0) % 64 / 16);
        for (int64_t i0 = 0; i0 < m; i0 += 32) {
          const int nr = int(std::min<int64_t>(32, m - i0));
          const uint16_t* ai = ap + i0 * kcmax;
          if (!BF16OUT && nr == 32 && nj == 32) {
            amx_block(ai, kcmax, bs, q, kcp / kAmxK, static_cast<float*>(cv) + i0 * ldc + j0, ldc, load);
            continue;
          }
          float* cb = BF16OUT ? nullptr : static_cast<float*>(cv) + i0 * ldc + j0;
          if (load)
            for (int r = 0; r < 32; ++r)
              for (int j = 0; j < 32; ++j) t[r * 32 + j] = r < nr && j < nj ? cb[r * ldc + j] : 0.f;
          amx_block(ai, kcmax, bs, q, kcp / kAmxK, t, 32, load);
          for (int r = 0; r < nr; ++r)
            for (int qq = 0; qq < 2 && qq * 16 < nj; ++qq) {
              const __mmask16 mk = nj - qq * 16 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (nj - qq * 16)) - 1);
              const __m512 v = _mm512_loadu_ps(t + r * 32 + qq * 16);
              if (BF16OUT) {  // the one rounding of a gradient (k within one block)
                const __m256bh h = _mm512_cvtneps_pbh(v);
                _mm256_mask_storeu_epi16(static_cast<uint16_t*>(cv) + (i0 + r) * ldc + j0 + qq * 16, mk,
                                         reinterpret_cast<const __m256i&>(h));
              } else {
                _mm512_mask_storeu_ps(cb + r * ldc + qq * 16, mk, v);
              }
            }
        }
      }
    }
  }
  amx_release();
}

// Whether this process runs bf16 x bf16 backward GEMMs on AMX now (Kernels::gemm_on_amx).
static bool gemm_on_amx() {
  static const bool ready = tonp_amx::amx_ready();
  if (!ready) return false;
  const char* e = std::getenv("TONP_BACKWARD_AMX");
  return !(e && e[0] == '0');
}

// The table's gemm and gemm_bf16out: bf16 x bf16 on AMX where it runs (gemm_on_amx), everything
// else on the zmm tiles (gemm_hw.h).
static void gemm_amx_hw(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k, float* c,
                        int64_t ldc, bool accumulate, float* scratch) {
  if (k > 0 && a.e == Elem::BF16 && b.e == Elem::BF16 && gemm_on_amx())
    gemm_amx_impl<false>(a, b, m, n, k, c, ldc, accumulate, scratch);
  else
    gemm_hw(a, b, m, n, k, c, ldc, accumulate, scratch);
}

static void gemm_bf16out_amx_hw(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k,
                                uint16_t* c, int64_t ldc, float* scratch) {
  if (k > 0 && a.e == Elem::BF16 && b.e == Elem::BF16 && gemm_on_amx())
    gemm_amx_impl<true>(a, b, m, n, k, c, ldc, false, scratch);
  else
    gemm_bf16out_hw(a, b, m, n, k, c, ldc, scratch);
}
