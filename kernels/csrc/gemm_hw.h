// The backward GEMM (gemm.h) on AVX-512 (isa_avx512bf16.cpp only): 6 x 64 zmm micro tiles, fp32
// FMAs, or vdpbf16ps when A and B are both bf16 (products exact, sums fp32; subnormals flushed,
// which gradients never notice). A fixed order per call, as gemm.h. A block of 1 MB or more written
// once (a weight gradient tile) goes out in non-temporal stores: no read for ownership of its lines.

// Columns j0.. of B's rows k0.. (nj <= 64 x strips): fp32 bp[kk][64], or bf16 pairs bp32[p][64]
// (rows 2p, 2p + 1), strip s (columns j0 + 64 s ..) at bp + s * gh_strip(kc, pairs). Row by row
// over all strips, a row-major B read in runs of nj contiguous elements, with the rows 16 ahead
// prefetched: the dX and dH of an expert's ~16 rows (weights streamed from memory once) spent
// more time here, stalled on memory, than in their multiply-adds (train.md: 30B layer, 2026-12-01).
static inline int64_t gh_strip(int64_t kc, bool pairs) { return (pairs ? (kc + 1) / 2 : kc) * 64; }  // floats

constexpr int64_t kPfPairs = 8;  // prefetch distance in row pairs

static void gh_pack_b(const tonp::GemmOperand& b, int64_t k0, int64_t kc, int64_t j0, int64_t nj, void* out, bool pairs) {
  const bool rowc = b.cs == 1;
  const int ns = int((nj + 63) / 64);
  if (!pairs) {
    float* bp = static_cast<float*>(out);
    for (int64_t kk = 0; kk < kc; ++kk)
      for (int st = 0; st < ns; ++st) {
        float* d = bp + st * gh_strip(kc, false) + kk * 64;
        const int64_t c0 = j0 + 64 * st;
        const int n = int(std::min<int64_t>(64, j0 + nj - c0));
        if (rowc && b.e == Elem::F32) {
          const float* src = static_cast<const float*>(b.p) + (k0 + kk) * b.rs + c0;
          if (kk + 2 * kPfPairs < kc)  // as the pairs' below
            for (int q = 0; q < n; q += 16)
              prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(src) + 4 * uintptr_t(2 * kPfPairs * b.rs + q)));
          for (int q = 0; q < 64; q += 16)
            _mm512_storeu_ps(d + q, _mm512_maskz_loadu_ps(__mmask16(n - q >= 16 ? 0xffff : n > q ? (1u << (n - q)) - 1 : 0), src + q));
        } else {
          for (int j = 0; j < 64; ++j) d[j] = j < n ? gemm_at(b, k0 + kk, c0 + j) : 0.f;
        }
      }
    return;
  }
  uint32_t* bp = static_cast<uint32_t*>(out);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                                      35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t p = 0; p < (kc + 1) / 2; ++p) {
    const int64_t r0 = k0 + 2 * p;
    const bool two = 2 * p + 1 < kc;
    for (int st = 0; st < ns; ++st) {
      uint32_t* d = bp + st * gh_strip(kc, true) + p * 64;
      const int64_t c0 = j0 + 64 * st;
      const int n = int(std::min<int64_t>(64, j0 + nj - c0));
      if (rowc) {
        const uint16_t* s0 = static_cast<const uint16_t*>(b.p) + r0 * b.rs + c0;
        if (2 * (p + kPfPairs) + 1 < kc)  // rows 16 ahead: a hint, integer addresses, never faults
          for (int r = 0; r < 2; ++r)
            for (int q = 0; q < n; q += 32)
              prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(s0) + 2 * uintptr_t((2 * kPfPairs + r) * b.rs + q)));
        for (int q = 0; q < 64; q += 32) {
          const __mmask32 m = n - q >= 32 ? ~__mmask32(0) : n > q ? __mmask32((1ull << (n - q)) - 1) : 0;
          const __m512i a0 = _mm512_maskz_loadu_epi16(m, s0 + q);
          const __m512i a1 = two ? _mm512_maskz_loadu_epi16(m, s0 + b.rs + q) : _mm512_setzero_si512();
          _mm512_storeu_si512(d + q, _mm512_permutex2var_epi16(a0, lo, a1));
          _mm512_storeu_si512(d + q + 16, _mm512_permutex2var_epi16(a0, hi, a1));
        }
      } else {
        const uint16_t* src = static_cast<const uint16_t*>(b.p);
        for (int j = 0; j < 64; ++j) {
          const uint32_t e0 = j < n ? src[r0 * b.rs + (c0 + j) * b.cs] : 0u;
          const uint32_t e1 = j < n && two ? src[(r0 + 1) * b.rs + (c0 + j) * b.cs] : 0u;
          d[j] = e0 | (e1 << 16);
        }
      }
    }
  }
}

// Rows i0.. (<= 6) of A's columns k0..: fp32 ap[kk][6], or bf16 pairs ap32[p][6].
static void gh_pack_a(const tonp::GemmOperand& a, int64_t i0, int nr, int64_t k0, int64_t kc, void* out, bool pairs) {
  if (!pairs) {
    float* ap = static_cast<float*>(out);
    if (a.e == Elem::F32 && nr == kGemmMr) {  // strided reads without a dtype test per element
      const float* s = static_cast<const float*>(a.p) + i0 * a.rs + k0 * a.cs;
      for (int64_t kk = 0; kk < kc; ++kk)
        for (int r = 0; r < kGemmMr; ++r) ap[kk * kGemmMr + r] = s[r * a.rs + kk * a.cs];
      return;
    }
    for (int64_t kk = 0; kk < kc; ++kk)
      for (int r = 0; r < kGemmMr; ++r) ap[kk * kGemmMr + r] = r < nr ? gemm_at(a, i0 + r, k0 + kk) : 0.f;
    return;
  }
  uint32_t* ap = static_cast<uint32_t*>(out);
  const uint16_t* s = static_cast<const uint16_t*>(a.p);
  if (a.cs == 1 && nr == kGemmMr && kc % 2 == 0) {  // rows with their pairs in place: 32-bit copies
    for (int r = 0; r < kGemmMr; ++r) {
      const uint16_t* row = s + (i0 + r) * a.rs + k0;
      for (int64_t p = 0; p < kc / 2; ++p) std::memcpy(ap + p * kGemmMr + r, row + 2 * p, 4);
    }
    return;
  }
  for (int64_t p = 0; p < (kc + 1) / 2; ++p)
    for (int r = 0; r < kGemmMr; ++r) {
      const int64_t base = (i0 + r) * a.rs + (k0 + 2 * p) * a.cs;
      const uint32_t e0 = r < nr ? s[base] : 0u, e1 = r < nr && 2 * p + 1 < kc ? s[base + a.cs] : 0u;
      ap[p * kGemmMr + r] = e0 | (e1 << 16);
    }
}

template <bool PAIRS, bool BF16OUT>
static void gh_micro(const void* apv, const void* bpv, int64_t steps, void* cv, int64_t ldc, int nr, int nj, bool accumulate,
                     bool stream) {
  __m512 acc[kGemmMr][4];
  for (int r = 0; r < kGemmMr; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    if (PAIRS) {
      const uint32_t* bp = static_cast<const uint32_t*>(bpv) + s * 64;
      const uint32_t* ap = static_cast<const uint32_t*>(apv) + s * kGemmMr;
      __m512i b[4];
      for (int q = 0; q < 4; ++q) b[q] = _mm512_loadu_si512(bp + q * 16);
      for (int r = 0; r < kGemmMr; ++r) {
        const __m512i av = _mm512_set1_epi32(int(ap[r]));
        for (int q = 0; q < 4; ++q)
          acc[r][q] = _mm512_dpbf16_ps(acc[r][q], reinterpret_cast<const __m512bh&>(av), reinterpret_cast<const __m512bh&>(b[q]));
      }
    } else {
      const float* bp = static_cast<const float*>(bpv) + s * 64;
      const float* ap = static_cast<const float*>(apv) + s * kGemmMr;
      __m512 b[4];
      for (int q = 0; q < 4; ++q) b[q] = _mm512_loadu_ps(bp + q * 16);
      for (int r = 0; r < kGemmMr; ++r) {
        const __m512 av = _mm512_set1_ps(ap[r]);
        for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_fmadd_ps(av, b[q], acc[r][q]);
      }
    }
  }
  if (stream && nj == 64) {  // whole cache lines the caches will not see again: no read for ownership
    for (int r = 0; r < nr; ++r)
      for (int q = 0; q < 4; q += BF16OUT ? 2 : 1) {
        if (BF16OUT) {
          const __m512bh v = _mm512_cvtne2ps_pbh(acc[r][q + 1], acc[r][q]);
          _mm512_stream_si512(reinterpret_cast<__m512i*>(static_cast<uint16_t*>(cv) + r * ldc + q * 16),
                              reinterpret_cast<const __m512i&>(v));
        } else {
          _mm512_stream_ps(static_cast<float*>(cv) + r * ldc + q * 16, acc[r][q]);
        }
      }
    return;
  }
  for (int r = 0; r < nr; ++r)
    for (int q = 0; q < 4 && q * 16 < nj; ++q) {
      const __mmask16 m = nj - q * 16 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (nj - q * 16)) - 1);
      if (BF16OUT) {  // the one rounding of a gradient, in registers (k within one block)
        const __m256bh v = _mm512_cvtneps_pbh(acc[r][q]);
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(cv) + r * ldc + q * 16, m, reinterpret_cast<const __m256i&>(v));
      } else {
        float* cr = static_cast<float*>(cv) + r * ldc + q * 16;
        const __m512 v = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, cr), acc[r][q]) : acc[r][q];
        _mm512_mask_storeu_ps(cr, m, v);
      }
    }
}

template <bool BF16OUT>
static void gemm_hw_impl(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k, void* cv,
                         int64_t ldc, bool accumulate, float* scratch) {
  IeeeScope ieee;
  float* c = static_cast<float*>(cv);
  if (BF16OUT && k == 0) {
    for (int64_t i = 0; i < m; ++i) std::fill_n(static_cast<uint16_t*>(cv) + i * ldc, n, uint16_t(0));
    return;
  }
  if (k == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.f);
    return;
  }
  const bool pairs = a.e == Elem::BF16 && b.e == Elem::BF16;
  // A large block written once (a weight gradient): streamed past the caches in whole lines.
  const int64_t cb = BF16OUT ? 2 : 4;
  const bool stream = !accumulate && k <= tonp::kGemmKc && m * n * cb >= (int64_t(1) << 20) && (ldc * cb) % 64 == 0 &&
                      reinterpret_cast<uintptr_t>(cv) % 64 == 0;
  // B strips packed together (256 KB of fp32 or of pairs), then each strip's micro tiles; a call
  // with one short k block (a weight gradient over an expert's rows) packs strip by strip, which
  // measured faster there (MoE dWdn 18 against 45 ms).
  const int64_t group = k < tonp::kGemmKc ? 64 : tonp::kGemmStrips / (pairs ? 1 : 2) * 64;
  float* bp = scratch;                                          // [strips][kGemmKc][64] fp32, or pairs
  float* ap = scratch + tonp::kGemmKc * 64 * tonp::kGemmStrips / 2;  // [row tiles][kGemmKc][6] fp32, or pairs
  for (int64_t k0 = 0; k0 < k; k0 += tonp::kGemmKc) {
    const int64_t kc = std::min<int64_t>(tonp::kGemmKc, k - k0), steps = pairs ? (kc + 1) / 2 : kc;
    const bool acc = accumulate || k0 > 0;
    for (int64_t i0 = 0; i0 < m; i0 += kGemmMr)
      gh_pack_a(a, i0, int(std::min<int64_t>(kGemmMr, m - i0)), k0, kc, ap + i0 * steps, pairs);
    for (int64_t g0 = 0; g0 < n; g0 += group) {
      gh_pack_b(b, k0, kc, g0, std::min(group, n - g0), bp, pairs);
      for (int64_t j0 = g0; j0 < std::min(n, g0 + group); j0 += 64) {
        const int nj = int(std::min<int64_t>(64, n - j0));
        const float* bs = bp + (j0 - g0) / 64 * gh_strip(kc, pairs);
        for (int64_t i0 = 0; i0 < m; i0 += kGemmMr) {
          const int nr = int(std::min<int64_t>(kGemmMr, m - i0));
          void* ct = BF16OUT ? static_cast<void*>(static_cast<uint16_t*>(cv) + i0 * ldc + j0) : c + i0 * ldc + j0;
          if (pairs)
            gh_micro<true, BF16OUT>(ap + i0 * steps, bs, steps, ct, ldc, nr, nj, acc, stream);
          else
            gh_micro<false, BF16OUT>(ap + i0 * steps, bs, steps, ct, ldc, nr, nj, acc, stream);
        }
      }
    }
  }
  if (stream) _mm_sfence();
}

static void gemm_hw(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k, float* c,
                    int64_t ldc, bool accumulate, float* scratch) {
  gemm_hw_impl<false>(a, b, m, n, k, c, ldc, accumulate, scratch);
}

static void gemm_bf16out_hw(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k,
                            uint16_t* c, int64_t ldc, float* scratch) {
  gemm_hw_impl<true>(a, b, m, n, k, c, ldc, false, scratch);
}

static void grad_to_bf16_hw(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<const __m256i&>(v));
  }
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
