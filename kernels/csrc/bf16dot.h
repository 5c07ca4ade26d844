// The bf16 x bf16 linear ("pair chains"), compiled once per ISA after kernels_impl.h, in the same
// namespace. Its arithmetic is the step of the AVX512-BF16 instruction vdpbf16ps (CONTRACT.md,
// "linear, bf16 weights and bf16 activations"):
//
//   chunk c of kc elements, read in blocks of 16 (the last one padded with zeros); in block j,
//   lane l (0..7) takes the pair i = 16j + 2l, i + 1:
//       a_l = step(x[i + 1], w[i + 1], a_l);  a_l = step(x[i], w[i], a_l)
//   step(a, b, c) = fma(a, b, c) with subnormal inputs read as zeros of their sign and a result
//   that is tiny after rounding to 24 bits (unbounded exponent) flushed to a zero of its sign;
//   then tree8, the chunk tree, + bias, one rounding; a NaN output is the canonical NaN.
//
// Three implementations give these bits: the hardware instruction (bf16dot_hw.h), FMAs under
// MXCSR FTZ | DAZ on AVX2 (x86 detects tininess after rounding, as the instruction does: measured
// bit for bit, tests/test_kernels_bf16dot.py), and the portable build's std::fma with the flush
// written out. Only the chains flush; trees and bias are plain IEEE adds in every build (a TP
// rank's partials are summed by the same tree outside the kernel).
// The including file includes <cfloat>, and <xmmintrin.h> on x86 (never inside a namespace).
#if defined(__x86_64__) || defined(__i386__)
#define TONP_HAS_MXCSR 1
#else
#define TONP_HAS_MXCSR 0
#endif

// The kernel runs with IEEE MXCSR (round to nearest even, no FTZ / DAZ), whatever the caller set
// (torch.set_flush_denormal); the caller's MXCSR is restored on exit.
struct IeeeScope {
#if TONP_HAS_MXCSR
  unsigned saved;
  IeeeScope() : saved(_mm_getcsr()) { _mm_setcsr(0x1f80u); }
  ~IeeeScope() { _mm_setcsr(saved); }
#endif
};

static inline uint32_t f32_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

#if TONP_AVX2
// The chains: FMAs under FTZ | DAZ (set by ChainScope; trees run outside it).
struct ChainScope {
  ChainScope() { _mm_setcsr(0x9fc0u); }
  ~ChainScope() { _mm_setcsr(0x1f80u); }
};
// The odd and even elements of 8 pairs (16 bf16) as fp32: lane l = element 2l + 1, 2l.
static inline void vpairs(const uint16_t* p, V8& odd, V8& even) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  odd.v = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
  even.v = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline void vpair1(uint32_t pair, V8& odd, V8& even) {
  const __m256i w = _mm256_set1_epi32(int(pair));
  odd.v = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
  even.v = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline V8 vstep(V8 a, V8 b, V8 c) { return vfma(a, b, c); }
#else
struct ChainScope {};
// A bf16 with a zero exponent (subnormal) reads as a zero of its sign.
static inline float daz_bf16(uint16_t h) { return bf16_to_f32((h & 0x7f80u) ? h : uint16_t(h & 0x8000u)); }
static inline void vpairs(const uint16_t* p, V8& odd, V8& even) {
  for (int l = 0; l < 8; ++l) odd.v[l] = daz_bf16(p[2 * l + 1]), even.v[l] = daz_bf16(p[2 * l]);
}
static inline void vpair1(uint32_t pair, V8& odd, V8& even) {
  const float o = daz_bf16(uint16_t(pair >> 16)), e = daz_bf16(uint16_t(pair));
  for (int l = 0; l < 8; ++l) odd.v[l] = o, even.v[l] = e;
}
// One step; a, b are bf16 values (subnormals already zero), c is zero or normal.
static inline float step1(float a, float b, float c) {
  const float r = std::fma(a, b, c), m = std::fabs(r);
  if (m > FLT_MIN || m == 0.f || m != m) return r;
  if (m < FLT_MIN) return std::copysign(0.f, r);
  // |r| = FLT_MIN after rounding to the subnormal grid; 2v rounds to 24 bits like v with an
  // unbounded exponent (2a, 2c are exact unless they overflow, when v cannot be near FLT_MIN).
  const float r2 = std::fma(2.f * a, b, 2.f * c);
  return std::isfinite(r2) && std::fabs(r2) < 2.f * FLT_MIN ? std::copysign(0.f, r) : r;
}
static inline V8 vstep(V8 a, V8 b, V8 c) {
  for (int l = 0; l < 8; ++l) c.v[l] = step1(a.v[l], b.v[l], c.v[l]);
  return c;
}
#endif

// One step of the chains on n lanes: out[i] = step(a odd, b odd, DAZ(acc[i])) then the even pair
// (a, b: n pairs of bf16). The instruction's unit of work, exposed for the equality tests.
static void bf16_pair_step(const float* acc, const uint16_t* a, const uint16_t* b, float* out, int64_t n) {
  IeeeScope ieee;
  for (int64_t i = 0; i < n; i += 8) {
    float c[8];
    uint16_t ta[16] = {0}, tb[16] = {0};
    const int nl = int(n - i < 8 ? n - i : 8);
    for (int l = 0; l < 8; ++l) {
      uint32_t cb = l < nl ? f32_bits(acc[i + l]) : 0u;
      if (!(cb & 0x7f800000u)) cb &= 0x80000000u;  // DAZ on the accumulator too
      std::memcpy(&c[l], &cb, 4);
    }
    std::memcpy(ta, a + 2 * i, sizeof(uint16_t) * 2 * nl);
    std::memcpy(tb, b + 2 * i, sizeof(uint16_t) * 2 * nl);
    V8 ao, ae, bo, be, cv = vload(c);
    vpairs(ta, ao, ae);
    vpairs(tb, bo, be);
    {
      ChainScope chain;
      cv = vstep(ae, be, vstep(ao, bo, cv));
    }
    vstore(c, cv);
    for (int l = 0; l < nl; ++l) out[i + l] = c[l];
  }
}

// Sixteen elements of a weight row from k on, zero past `valid` (the chunk's last block).
static inline const uint16_t* block16(const uint16_t* p, int64_t valid, uint16_t* tmp) {
  if (valid >= 16) return p;
  for (int i = 0; i < 16; ++i) tmp[i] = i < valid ? p[i] : uint16_t(0);
  return tmp;
}

// ---------------------------------------------------------------------------------------------
// Few rows: dot products. An MR x NR tile: each output's eight lanes in one vector, blocks of
// 16 in order; x rows are read with chunk stride xkc (a multiple of 16, zero padded by the op).
// Every chunk's chains run under one ChainScope (its MXCSR writes cost what a short chunk
// computes), their raw lanes kept; the trees follow under IEEE. Tiles fit the 16 vector
// registers of AVX2 (1 x 8: 12, 2 x 4: 14), so no accumulator is spilled.
// ---------------------------------------------------------------------------------------------
// One block of 16 elements of an MR x NR tile: w's NR rows at stride ldw, all 16 valid.
template <int MR, int NR>
static inline void pair_dot_block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, V8* acc) {
  V8 xo[MR], xe[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) vpairs(x + r * ldx, xo[r], xe[r]);
#pragma GCC unroll 8
  for (int n = 0; n < NR; ++n) {
    V8 wo, we;
    vpairs(w + n * ldw, wo, we);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r * NR + n] = vstep(xe[r], we, vstep(xo[r], wo, acc[r * NR + n]));
  }
}

// A row tile's share of the next weight lines to fetch (pair_dot_rows): NR weight rows `ld`
// bytes apart from the integer address `at`, one cache line of each every `period` blocks
// (a hint: never a fault).
struct PairFetch {
  uintptr_t at;
  int64_t ld;
  int period;
};

template <int MR, int NR>
static inline void pair_dot_tile(const uint16_t* x, int64_t ldx, int64_t xkc, const uint16_t* w, int64_t ldw,
                                 int64_t kc, int chunks, float* out, int64_t ldo, PairFetch fetch = {0, 0, 0}) {
  constexpr int NT = MR * NR;
  V8 raw[tonp::kMaxChunks][NT];  // each chunk's lanes, before the trees
  const int64_t kfull = kc / 16 * 16;
  // Without a share: the next tile's weight rows are prefetched only where rows lie under a page
  // apart (K < 2048 in bf16): measured on the AMD EPYC (AVX2), one row at K = 2048 streams
  // faster without.
  const bool ahead = ldw * 2 < 4096;
  int count = fetch.period;
  {
    ChainScope chain;
    for (int c = 0; c < chunks; ++c) {
      V8 acc[NT];
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) acc[i] = vzero();
      const uint16_t* xc = x + c * xkc;
      const uint16_t* wc = w + c * kc;
      int64_t k = 0;
      if (fetch.period)
        for (; k < kfull; k += 16) {
          if (--count == 0) {
            count = fetch.period;
#pragma GCC unroll 8
            for (int n = 0; n < NR; ++n)
              prefetch(reinterpret_cast<const void*>(fetch.at + uintptr_t(n * fetch.ld)));
            fetch.at += 64;
          }
          pair_dot_block<MR, NR>(xc + k, ldx, wc + k, ldw, acc);
        }
      else if (ahead)  // per cache line of the weight rows, the next tile's rows (integer addresses: a hint)
        for (; k + 32 <= kfull; k += 32) {
#pragma GCC unroll 8
          for (int n = 0; n < NR; ++n)
            prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(wc + k) + 2 * uintptr_t((n + NR) * ldw)));
          pair_dot_block<MR, NR>(xc + k, ldx, wc + k, ldw, acc);
          pair_dot_block<MR, NR>(xc + k + 16, ldx, wc + k + 16, ldw, acc);
        }
      for (; k < kfull; k += 16) pair_dot_block<MR, NR>(xc + k, ldx, wc + k, ldw, acc);
      if (kfull < kc) {  // the chunk's last block, zero past kc
        uint16_t tail[NR][16];
        for (int n = 0; n < NR; ++n)
          for (int i = 0; i < 16; ++i) tail[n][i] = kfull + i < kc ? wc[n * ldw + kfull + i] : uint16_t(0);
        pair_dot_block<MR, NR>(xc + kfull, ldx, &tail[0][0], 16, acc);
      }
#pragma GCC unroll 16
      for (int i = 0; i < NT; ++i) raw[c][i] = acc[i];
    }
  }
  float part[tonp::kMaxChunks][NT];
  for (int c = 0; c < chunks; ++c) tile_hsum<NT>(raw[c], part[c]);
  tile_finish<MR, NR>(&part[0][0], chunks, out, ldo);
}

// One row: the tiles stream the weight, eight rows at a time.
static inline void pair_dot_row(const uint16_t* x, int64_t xkc, const uint16_t* w, int64_t ldw, int64_t kc, int chunks,
                                int ncols, float* out) {
  int n = 0;
  for (; n + 8 <= ncols; n += 8) pair_dot_tile<1, 8>(x, 0, xkc, w + n * ldw, ldw, kc, chunks, out + n, kPanel);
  for (; n + 4 <= ncols; n += 4) pair_dot_tile<1, 4>(x, 0, xkc, w + n * ldw, ldw, kc, chunks, out + n, kPanel);
  for (; n < ncols; ++n) pair_dot_tile<1, 1>(x, 0, xkc, w + n * ldw, ldw, kc, chunks, out + n, kPanel);
}

// Two rows or more (fewer than the lane passes take): four columns at a time, every row tile
// (two rows, an odd last one alone) over them while their weight rows are in cache. So that the
// weights stream while the tiles compute, not only while the first one does, the tiles share out
// the fetch of the next four columns' rows: tile t of T fetches the t-th of T stretches of those
// rows, one line of each every 2T blocks, spread over its arithmetic (one tile over rows a page
// or more apart fetches nothing, as one row). Before, each row tile ran over all the panel's
// columns and only the first tile's pass read memory: the later tiles computed on cached weights
// while the bus idled. Measured on the AMD EPYC (Zen 3, AVX2) with benchmarks/table_ab.py
// (table_ab_amd_epyc_avx2.md), the experts' two stages (128 cold experts, 2 threads, rows an
// expert ~ Poisson): 1.20x at a mean of 4 and of 8 rows, level at 1; hot (one thread, weights in
// L2) 0.89-1.00x at K = 2048, 1.01-1.09x at K = 768. Not kept: every tile over one chunk at a time (the weight
// rows read 512 bytes at a time, which the hardware prefetchers follow worse: 0.6-0.8x hot, no
// faster cold), only the first tile fetching the next columns (1.04-1.06x cold), groups of
// eight columns with the odd row in a 1 x 8 tile (level with four).
static inline void pair_dot_rows(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, const uint16_t* w,
                                 int64_t ldw, int64_t kc, int chunks, int ncols, float* res) {
  const int tiles = int((rows + 1) / 2);
  const int64_t steps = chunks * (kc / 16) / (2 * tiles);  // fetch steps (a line of each row) a tile
  const bool fetch = tiles > 1 || ldw * 2 < 4096;
  int n = 0;
  for (; n + 4 <= ncols; n += 4) {
    const uintptr_t next = reinterpret_cast<uintptr_t>(w) + 2 * uintptr_t((n + 4) * ldw);  // may lie past W: a hint
    for_row_tiles<2>(rows, [&](int64_t r, auto mr) {
      const PairFetch f = {next + uintptr_t(64 * steps * (r / 2)), 2 * ldw, 2 * tiles};
      pair_dot_tile<mr(), 4>(x + r * ldx, ldx, xkc, w + n * ldw, ldw, kc, chunks, res + r * kPanel + n, kPanel,
                             fetch ? f : PairFetch{0, 0, 0});
    });
  }
  for (; n < ncols; ++n)
    for_row_tiles<2>(rows, [&](int64_t r, auto mr) {
      pair_dot_tile<mr(), 1>(x + r * ldx, ldx, xkc, w + n * ldw, ldw, kc, chunks, res + r * kPanel + n, kPanel);
    });
}

// ---------------------------------------------------------------------------------------------
// Many rows: lane passes. The chunk's weights unpacked once to fp32, pair by pair ([pair][odd,
// even][16 columns], zero past kc and past ncols); per lane l an outer product over its pairs.
// ---------------------------------------------------------------------------------------------
static inline void pair_unpack_chunk(const uint16_t* W, int64_t ldw, int ncols, int64_t kc, float* wt) {
  const int64_t npairs = (kc + 15) / 16 * 8;
  for (int n0 = 0; n0 < kPanel; n0 += 8)
    for (int64_t p = 0; p < npairs; p += 8) {
      V8 odd[8], even[8];
      for (int i = 0; i < 8; ++i) {
        uint16_t tmp[16];
        if (n0 + i < ncols)
          vpairs(block16(W + (n0 + i) * ldw + 2 * p, kc - 2 * p, tmp), odd[i], even[i]);
        else
          odd[i] = even[i] = vzero();
      }
      transpose8(odd);
      transpose8(even);
      for (int i = 0; i < 8; ++i) {
        vstore(wt + ((p + i) * 2) * kPanel + n0, odd[i]);
        vstore(wt + ((p + i) * 2 + 1) * kPanel + n0, even[i]);
      }
    }
}

template <int MR>
static inline void pair_lane_tile(const uint16_t* xc, int64_t ldx, const float* wt, int64_t npairs, float* part) {
  float lanes[8][MR * kPanel];
  {
    ChainScope chain;
    for (int l = 0; l < 8; ++l) {
      V8 acc[MR][2];
      for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = vzero();
      for (int64_t p = l; p < npairs; p += 8) {
        const float* wp = wt + p * 2 * kPanel;
        const V8 wo0 = vload(wp), wo1 = vload(wp + 8), we0 = vload(wp + kPanel), we1 = vload(wp + kPanel + 8);
        for (int r = 0; r < MR; ++r) {
          uint32_t pair;
          std::memcpy(&pair, xc + r * ldx + 2 * p, 4);
          V8 xo, xe;
          vpair1(pair, xo, xe);
          acc[r][0] = vstep(xe, we0, vstep(xo, wo0, acc[r][0]));
          acc[r][1] = vstep(xe, we1, vstep(xo, wo1, acc[r][1]));
        }
      }
      for (int r = 0; r < MR; ++r) {
        vstore(lanes[l] + r * kPanel, acc[r][0]);
        vstore(lanes[l] + r * kPanel + 8, acc[r][1]);
      }
    }
  }
  lanes_tree(&lanes[0][0], MR * kPanel, MR * kPanel, part);
}

static void pair_rows_blocked(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, const uint16_t* W, int64_t ldw,
                              int64_t kc, int chunks, int ncols, float* res, float* pbuf, float* wt) {
  const int64_t cstride = rows * kPanel, npairs = (kc + 15) / 16 * 8;
  for (int c = 0; c < chunks; ++c) {
    pair_unpack_chunk(W + c * kc, ldw, ncols, kc, wt);
    const uint16_t* xc = x + c * xkc;
    float* pc = pbuf + c * cstride;
    for_row_tiles<4>(rows, [&](int64_t r, auto mr) { pair_lane_tile<mr()>(xc + r * ldx, ldx, wt, npairs, pc + r * kPanel); });
  }
  chunk_tree(pbuf, cstride, chunks, cstride);
  for (int64_t i = 0; i < cstride; ++i) res[i] = pbuf[i];
}

// Finished sums [rows, ldr] + bias -> out (one rounding; a NaN becomes the canonical NaN).
static inline void pair_store(const float* res, int64_t ldr, int64_t rows, int ncols, const float* bias, void* out,
                              int64_t ldo, Elem oelem) {
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < ncols; ++j) {
      float v = res[r * ldr + j];
      if (bias) v = v + bias[j];
      store1(out, r * ldo + j, v != v ? NAN : v, oelem);
    }
}

// 16 columns of the emulated entry below.
static void pair_panel16(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, const uint16_t* W, int64_t ldw,
                         int64_t kc, int chunks, const float* bias, int ncols, void* out, int64_t ldo, Elem oelem,
                         float* scratch) {
  float* res = scratch;
  if (tonp::bf16_lane_passes(rows, kc, false)) {
    float* pbuf = res + rows * kPanel;
    pair_rows_blocked(x, ldx, xkc, rows, W, ldw, kc, chunks, ncols, res, pbuf, pbuf + chunks * rows * kPanel);
  } else if (rows == 1) {
    pair_dot_row(x, xkc, W, ldw, kc, chunks, ncols, res);
  } else {
    pair_dot_rows(x, ldx, xkc, rows, W, ldw, kc, chunks, ncols, res);
  }
  pair_store(res, kPanel, rows, ncols, bias, out, ldo, oelem);
}

// The emulated table entry (AVX2 FMAs under FTZ | DAZ, or the portable flush): ncols <=
// kPanelPairs outputs per row, sixteen at a time, rows in blocks of kRowBlock.
static void linear_panel_bf16(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, const uint16_t* W, int64_t ldw,
                              int64_t kc, int chunks, const float* bias, int ncols, void* out, int64_t ldo, Elem oelem,
                              float* scratch, const uint16_t* /* xpairs: this build reads x in place */,
                              const uint16_t* /* wgroups: ignored, W read in place (weight_groups_bf16 false) */) {
  IeeeScope ieee;
  const int64_t osz = oelem == Elem::F32 ? 4 : 2;
  for (int64_t r0 = 0; r0 < rows; r0 += tonp::kRowBlock)
    for (int s = 0; s < ncols; s += kPanel)
      pair_panel16(x + r0 * ldx, ldx, xkc, std::min<int64_t>(tonp::kRowBlock, rows - r0), W + s * ldw, ldw, kc, chunks,
                   bias ? bias + s : nullptr, std::min(kPanel, ncols - s), static_cast<char*>(out) + (r0 * ldo + s) * osz,
                   ldo, oelem, scratch);
}
