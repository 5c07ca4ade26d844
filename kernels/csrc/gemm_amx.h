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

// The packed operands (tonp::amx_packed_elems): blocks of 32 lines (A's rows, B's columns), each
// all of k in steps of 32 elements, a step 2 KB = two tiles of 1 KB read with a 64-byte stride.
// A block's step: rows 0-15 then rows 16-31, a tile row = 32 elements of k. B block's step:
// columns 0-15 then 16-31, a tile row = pair p (elements 2p, 2p + 1 of the step) of 16 columns.
// Lines beyond `lines` and k beyond k are zeros, which meet no other output.

// A's rows 0 .. lines (row-major, column-major or any strides), steps [s0, s1) of k -> dst (the
// pack's start).
static void amx_pack_a(const tonp::GemmOperand& a, int64_t lines, int64_t k, int64_t s0, int64_t s1, uint16_t* dst) {
  const int64_t kp = (k + kAmxK - 1) / kAmxK * kAmxK;
  const uint16_t* s = static_cast<const uint16_t*>(a.p);
  __m512i idx;  // the sixteen rows of k pair p interleaved into 32-bit pairs
  {
    alignas(64) uint16_t v[32];
    for (int i = 0; i < 16; ++i) v[2 * i] = uint16_t(i), v[2 * i + 1] = uint16_t(32 + i);
    idx = _mm512_load_si512(v);
  }
  for (int64_t b0 = 0; b0 < lines; b0 += 32) {
    uint16_t* db = dst + b0 * kp;
    for (int64_t kb = s0 * kAmxK; kb < s1 * kAmxK; kb += kAmxK) {
      uint16_t* d = db + kb * 32;
      const int64_t valid = k - kb;
      const __mmask32 km = valid >= 32 ? ~__mmask32(0) : __mmask32((1ull << valid) - 1u);
      if (a.cs == 1) {  // rows contiguous in k: one masked load a tile row
        for (int r = 0; r < 32; ++r)
          _mm512_storeu_si512(d + r * 32, b0 + r < lines ? _mm512_maskz_loadu_epi16(km, s + (b0 + r) * a.rs + kb)
                                                          : _mm512_setzero_si512());
      } else if (a.rs == 1) {  // columns contiguous (a weight gradient's A, the output gradient
        // transposed): each k pair's sixteen rows interleaved into pairs, then a 16 x 16
        // transpose of the pairs puts a row's 16 pairs, one tile row, in one vector
        for (int h = 0; h < 32; h += 16) {
          const int64_t r0 = b0 + h;
          const __mmask16 rows = r0 + 16 <= lines ? __mmask16(0xffff)
                                 : r0 < lines     ? __mmask16((1u << (lines - r0)) - 1)
                                                  : __mmask16(0);
          __m512i v[16];
          for (int p = 0; p < 16; ++p) {
            const int64_t kk = kb + 2 * p;
            const __m256i lo = kk < k ? _mm256_maskz_loadu_epi16(rows, s + r0 + kk * a.cs) : _mm256_setzero_si256();
            const __m256i hi = kk + 1 < k ? _mm256_maskz_loadu_epi16(rows, s + r0 + (kk + 1) * a.cs) : _mm256_setzero_si256();
            v[p] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(lo), idx, _mm512_castsi256_si512(hi));
          }
          hw_transpose16(v);
          for (int r = 0; r < 16; ++r) _mm512_storeu_si512(d + (h + r) * 32, v[r]);
        }
      } else {
        for (int r = 0; r < 32; ++r)
          for (int kk = 0; kk < 32; ++kk)
            d[r * 32 + kk] = b0 + r < lines && kb + kk < k ? s[(b0 + r) * a.rs + (kb + kk) * a.cs] : uint16_t(0);
      }
    }
  }
}

// B's columns 0 .. lines, steps [s0, s1) of k -> dst (pairs of k, 16 columns a tile row).
static void amx_pack_b(const tonp::GemmOperand& b, int64_t lines, int64_t k, int64_t s0, int64_t s1, uint16_t* dst) {
  const int64_t kp = (k + kAmxK - 1) / kAmxK * kAmxK;
  const uint16_t* s = static_cast<const uint16_t*>(b.p);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                                      35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t b0 = 0; b0 < lines; b0 += 32) {
    uint16_t* db = dst + b0 * kp;
    const int64_t nc = std::min<int64_t>(32, lines - b0);
    const __mmask32 cm = nc >= 32 ? ~__mmask32(0) : __mmask32((1ull << nc) - 1u);
    for (int64_t kb = s0 * kAmxK; kb < s1 * kAmxK; kb += kAmxK) {
      uint16_t* d = db + kb * 32;
      if (b.cs == 1) {  // rows of B (one k each) contiguous in n: two rows interleaved into pairs
        for (int p = 0; p < 16; ++p) {
          const int64_t kk = kb + 2 * p;
          const __m512i r0 = kk < k ? _mm512_maskz_loadu_epi16(cm, s + kk * b.rs + b0) : _mm512_setzero_si512();
          const __m512i r1 = kk + 1 < k ? _mm512_maskz_loadu_epi16(cm, s + (kk + 1) * b.rs + b0) : _mm512_setzero_si512();
          _mm512_storeu_si512(d + p * 32, _mm512_permutex2var_epi16(r0, lo, r1));
          _mm512_storeu_si512(d + 512 + p * 32, _mm512_permutex2var_epi16(r0, hi, r1));
        }
      } else if (b.rs == 1) {  // columns contiguous in k: a column's 16 pairs, transposed
        const int64_t valid = k - kb;
        const __mmask32 km = valid >= 32 ? ~__mmask32(0) : __mmask32((1ull << valid) - 1u);
        for (int q = 0; q < 2; ++q) {
          __m512i v[16];
          for (int c = 0; c < 16; ++c) {
            const int64_t col = b0 + q * 16 + c;
            v[c] = col < lines ? _mm512_maskz_loadu_epi16(km, s + col * b.cs + kb) : _mm512_setzero_si512();
          }
          hw_transpose16(v);
          for (int p = 0; p < 16; ++p) _mm512_storeu_si512(d + q * 512 + p * 32, v[p]);
        }
      } else {
        for (int q = 0; q < 2; ++q)
          for (int p = 0; p < 16; ++p)
            for (int c = 0; c < 16; ++c)
              for (int e = 0; e < 2; ++e) {
                const int64_t col = b0 + q * 16 + c, kk = kb + 2 * p + e;
                d[q * 512 + p * 32 + 2 * c + e] = col < lines && kk < k ? s[kk * b.rs + col * b.cs] : uint16_t(0);
              }
      }
    }
  }
}

// One 32 x 32 block of C over `steps` steps of k, in four tile registers: loaded from cin (ldin
// floats a row: the sums so far) or, null, zero; one tdpbf16ps a tile pair a step in sequence;
// stored to c (ldc floats a row). ap, bp: the blocks' first step. Spread over its steps, the
// block prefetches na lines (64 bytes) from pa and nb from pb into L2: its share of the next k
// block.
TONP_AMX_FN static void amx_block(const uint16_t* ap, const uint16_t* bp, int64_t steps, const float* cin, int64_t ldin,
                                  float* c, int64_t ldc, const char* pa, int64_t na, const char* pb, int64_t nb) {
  const int64_t lb = ldc * 4, li = ldin * 4;
  if (cin) {
    _tile_loadd(0, cin, li);
    _tile_loadd(1, cin + 16, li);
    _tile_loadd(2, cin + 16 * ldin, li);
    _tile_loadd(3, cin + 16 * ldin + 16, li);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t j = 0; j < steps; ++j) {
    for (int64_t l = j * na / steps; l < (j + 1) * na / steps; ++l) _mm_prefetch(pa + l * 64, _MM_HINT_T1);
    for (int64_t l = j * nb / steps; l < (j + 1) * nb / steps; ++l) _mm_prefetch(pb + l * 64, _MM_HINT_T1);
    const uint16_t *a = ap + j * 1024, *b = bp + j * 1024;
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a + 512, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
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

// The block's nr x nc final sums (t, 32 floats a row) to C at row i0, column j0: fp32, or bf16
// rounded once (the one rounding of a gradient).
static inline void amx_write_block(const float* t, int64_t nr, int64_t nc, void* cv, Elem ce, int64_t ldc, int64_t i0,
                                   int64_t j0) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t j = 0; j < nc; j += 16) {
      const __mmask16 mk = nc - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (nc - j)) - 1);
      const __m512 v = _mm512_load_ps(t + r * 32 + j);
      if (ce == Elem::BF16) {
        const __m256bh h = _mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(cv) + (i0 + r) * ldc + j0 + j, mk, reinterpret_cast<const __m256i&>(h));
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(cv) + (i0 + r) * ldc + j0 + j, mk, v);
      }
    }
}

// C[m, n] (fp32 row stride ldc, += when accumulating; or bf16, rounded once) from packed A
// blocks (amx_pack_a of k) and B: packed blocks bp (amx_pack_b of k), or, where bsrc is given,
// B's columns 0 .. n packed here a k block at a time. k in blocks of kAmxSteps steps; within
// one, each row block of A (its 16 KB kept in L1) meets every column block of B in turn (B's k
// block, n / 32 x 16 KB, from L2), and every block prefetches its share of the next k block's A
// and packed B into L2 (2048^3 ran 0.91x without it, in one process). C, loaded and stored by the
// tiles, stays in L2 between k blocks (tiles of kAmxTileRows x kAmxTileCols: 256 KB). fp32 C
// whose blocks are all whole is summed in place; otherwise in scratch until a block's last k
// block, whose sums go through a 4 KB buffer to C (copied, or rounded to bf16) while in L1.
// scratch: mp * np floats (m, n rounded up to 32), then with bsrc a k block of B (np * 128).
static void amx_tile_impl(const uint16_t* ap, const uint16_t* bp, const tonp::GemmOperand* bsrc, int64_t m, int64_t n,
                          int64_t k, void* cv, Elem ce, int64_t ldc, bool accumulate, float* scratch) {
  // No MXCSR scope: tdpbf16ps does not read MXCSR (its rounding and flushing are its own:
  // CONTRACT.md, "What AMX computes"), nor does the one other operation, a bf16 C's rounding by
  // vcvtneps2bf16.
  if (m <= 0 || n <= 0) return;
  const int64_t kp = (k + kAmxK - 1) / kAmxK * kAmxK, steps = kp / kAmxK;
  const int64_t mp = (m + 31) / 32 * 32, np = (n + 31) / 32 * 32;
  const bool direct = ce == Elem::F32 && mp == m && np == n;
  float* c = direct ? static_cast<float*>(cv) : scratch;
  const int64_t ld = direct ? ldc : np;
  uint16_t* bk = reinterpret_cast<uint16_t*>(scratch + mp * np);  // with bsrc: this k block of B
  if (!direct && accumulate)
    for (int64_t i = 0; i < mp; ++i)
      for (int64_t j = 0; j < np; ++j) c[i * ld + j] = i < m && j < n ? static_cast<const float*>(cv)[i * ldc + j] : 0.f;
  const int64_t ni = mp / 32, nj = np / 32;
  alignas(64) float t[32 * 32];  // a block's sums after its last k block, where C is not summed in place
  amx_config();
  for (int64_t s0 = 0; s0 < steps; s0 += tonp::kAmxSteps) {
    const int64_t ns = std::min<int64_t>(tonp::kAmxSteps, steps - s0), s1 = s0 + ns;
    const bool load = accumulate || s0 > 0, last = s1 == steps;
    // B's k block: block j's steps from bj + j * bstride (packed here from bsrc: ns steps a block).
    const uint16_t* bj = bk;
    int64_t bstride = 32 * ns * kAmxK;
    if (bsrc) {
      const tonp::GemmOperand rows{static_cast<const uint16_t*>(bsrc->p) + s0 * kAmxK * bsrc->rs, bsrc->rs, bsrc->cs,
                                   bsrc->e};
      amx_pack_b(rows, n, std::min(k - s0 * kAmxK, ns * kAmxK), 0, ns, bk);
    } else {
      bj = bp + s0 * 1024, bstride = 32 * kp;
    }
    // The next k block: 32 lines a step in each row block of A and column block of packed B.
    // Block (i, j) fetches the j-th share of A's row block i and the i-th of B's column block j.
    const int64_t lines = std::min<int64_t>(tonp::kAmxSteps, steps - s1) * 32;
    const int64_t la = (lines + nj - 1) / nj, lbb = bsrc ? 0 : (lines + ni - 1) / ni;
    for (int64_t i = 0; i < ni; ++i)
      for (int64_t j = 0; j < nj; ++j) {
        const uint16_t* a = ap + i * 32 * kp;
        const int64_t fa = std::max<int64_t>(0, std::min(la, lines - j * la));
        const int64_t fb = std::max<int64_t>(0, std::min(lbb, lines - i * lbb));
        float* cb = c + i * 32 * ld + j * 32;
        const bool out = last && !direct;  // the block's final sums: to t, then to C while in L1
        amx_block(a + s0 * 1024, bj + j * bstride, ns, load ? cb : nullptr, ld, out ? t : cb, out ? 32 : ld,
                  reinterpret_cast<const char*>(a + s1 * 1024) + j * la * 64, fa,
                  bsrc ? nullptr : reinterpret_cast<const char*>(bp + j * 32 * kp + s1 * 1024) + i * lbb * 64, fb);
        if (out) amx_write_block(t, std::min<int64_t>(32, m - i * 32), std::min<int64_t>(32, n - j * 32), cv, ce, ldc, i * 32, j * 32);
      }
  }
  amx_release();
}

// The table's amx_tile (Kernels::amx_tile): both operands packed.
static void amx_tile(const uint16_t* ap, const uint16_t* bp, int64_t m, int64_t n, int64_t k, void* cv, Elem ce,
                     int64_t ldc, bool accumulate, float* scratch) {
  amx_tile_impl(ap, bp, nullptr, m, n, k, cv, ce, ldc, accumulate, scratch);
}

// One call's GEMM on AMX (gemm and gemm_bf16out of the table; m <= kGemmMaxM): k in spans of
// kAmxCallK elements (an output's steps run in order across them, its fp32 sum carried in C);
// in each, A packed once into this thread's buffer (at most kGemmMaxM x kAmxCallK: bounded
// whatever k a call brings, an expert's rows or a sequence), then column tiles of
// kAmxTileCols, all m rows each, B packed a k block at a time into the scratch (a call's B can
// be megabytes of expert weight read by a few rows: packed whole first, it went to L3 and back,
// and the bf16 training step at 30B-A3B shapes took 1.07x the time of packing it by k block;
// spans of 1024 against one span for all of k: level there).
template <bool BF16OUT>
static void gemm_amx_impl(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k,
                          void* cv, int64_t ldc, bool accumulate, float* scratch) {
  constexpr int64_t kAmxCallK = 1024;
  static_assert(kAmxCallK % (tonp::kAmxSteps * kAmxK) == 0, "a span holds whole k blocks");
  static thread_local std::vector<uint16_t> pack;
  const int64_t eb = BF16OUT ? 2 : 4;
  for (int64_t k0 = 0; k0 < k; k0 += kAmxCallK) {  // bf16 C: k <= kGemmKc, one span (the caller's rule)
    const int64_t kc = std::min(kAmxCallK, k - k0), na = tonp::amx_packed_elems(m, kc);
    if (int64_t(pack.size()) < na) pack.resize(size_t(na));
    amx_pack_a({static_cast<const uint16_t*>(a.p) + k0 * a.cs, a.rs, a.cs, a.e}, m, kc, 0, (kc + kAmxK - 1) / kAmxK,
               pack.data());
    for (int64_t j0 = 0; j0 < n; j0 += tonp::kAmxTileCols) {
      const tonp::GemmOperand bj{static_cast<const uint16_t*>(b.p) + k0 * b.rs + j0 * b.cs, b.rs, b.cs, b.e};
      amx_tile_impl(pack.data(), nullptr, &bj, m, std::min(tonp::kAmxTileCols, n - j0), kc,
                    static_cast<char*>(cv) + j0 * eb, BF16OUT ? Elem::BF16 : Elem::F32, ldc, accumulate || k0 > 0,
                    scratch);
    }
  }
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
