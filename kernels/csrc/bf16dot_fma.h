// The pair chains on AVX-512F FMAs under FTZ | DAZ, for the table on Intel: its lane passes
// (from kLaneRowsPairsIntel rows) and its dot products' pair tiles of two row pairs or more. The
// arithmetic is the AVX2 emulation's (bf16dot.h: each step two FMAs, the odd pair's then the
// even's, one rounding each, subnormals flushed by MXCSR; bit for bit the instruction's step),
// on zmm. On Intel's AVX-512 cores vdpbf16ps issues one zmm every two cycles (latency eight)
// against two FMAs a cycle (the Xeon, family 6 model 167, one thread: 1.8 G instructions/s
// against 7.3 G, latencies 2.2 ns and 1.1 ns), so sixteen lanes' step costs one cycle of FMAs
// against two of the instruction once both operands are fp32. The weights are widened when a
// chunk is packed (lane passes) or as each block is read (pair tiles), x when a row block starts
// a chunk (lane passes) or once a call (fma_pack_pairs); none of it rounds. Against the
// instruction's passes on the same machine (2 threads, hot weights, alternated in one process,
// every output equal): lane passes 1.17-1.30x at 64-2048 rows (K = 768, 2048), pair tiles
// 1.18-1.37x at 6-32 rows; the experts' stage at 16-128 tokens (cold, near the memory bound)
// level. Included by bf16dot_hw.h, in its namespace.

// Where pair p = 8j + l (lane l, block j of nb) of a slab's chunk lies: the pairs of lanes 2h and
// 2h + 1 (one pass of fma_lane_tile) side by side in block order, so a pass reads its slab in
// sequence (in pair order, a lane's pairs lie 8 pairs apart: 4 KB at 64 columns, one L1 set).
static inline int64_t fma_pair_slot(int64_t p, int64_t nb) { return (((p & 7) >> 1) * nb + (p >> 3)) * 2 + (p & 1); }

// A 16-column group's pairs of the chunk widened to fp32 into its slab (ws = 16 or 32 columns
// wide; wf: the group's first column there): slot s (fma_pair_slot) holds the odd elements at
// wf + s * 2 * ws, the even ones ws further; zero past kc and past ncols <= 16.
static inline void fma_pack_chunk(const uint16_t* W, int64_t ldw, int ncols, int64_t kc, float* wf, int64_t ws) {
  const int64_t nb = (kc + 15) / 16;
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  hw_chunk_pairs16(W, ldw, ncols, kc, [&](int64_t p, __m512i v) {
    float* d = wf + fma_pair_slot(p, nb) * 2 * ws;
    _mm512_storeu_si512(d, _mm512_and_si512(v, hi));
    _mm512_storeu_si512(d + ws, _mm512_slli_epi32(v, 16));
  });
}

// A row block's x of one chunk widened to fp32: xf[r * ld + i] = x[r * ldx + i], i < len (a
// multiple of 16: the chunk stride the op zero-pads x to).
static inline void fma_widen_rows(const uint16_t* xc, int64_t ldx, int64_t rows, int64_t len, float* xf, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < len; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + r * ldx + i));
      _mm512_storeu_si512(xf + r * ld + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

// MR rows by NZ x 16 columns: lanes two at a time (l = 2h, 2h + 1; each lane's chain over its
// pairs p = l, l + 8, ...), one zmm accumulator per (lane, row, 16 columns), each step the odd
// pair's FMA then the even's. The raw lanes go to the stack under FTZ | DAZ; their tree8,
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), runs after, under IEEE, as hw_lane_tile's.
// part: [MR, kPanelPairs] from the tile's first column.
template <int MR, int NZ>
static inline void fma_lane_tile(const float* xf, int64_t ldxf, const float* slab, int64_t npairs, float* part) {
  constexpr int W = tonp::kPanelPairs, WS = 16 * NZ;
  const int64_t nb = npairs / 8;
  __m512 lanes[8][MR][NZ];
  {
    ChainScope chain;
    for (int h = 0; h < 8; h += 2) {
      __m512 acc[2][MR][NZ];
      for (int l = 0; l < 2; ++l)
        for (int r = 0; r < MR; ++r)
          for (int q = 0; q < NZ; ++q) acc[l][r][q] = _mm512_setzero_ps();
      const float* wh = slab + (h / 2) * nb * 4 * WS;
      for (int64_t j = 0; j < nb; ++j)
        for (int l = 0; l < 2; ++l) {
          const float* wp = wh + (2 * j + l) * 2 * WS;
          __m512 wo[NZ], we[NZ];
          for (int q = 0; q < NZ; ++q) wo[q] = _mm512_loadu_ps(wp + 16 * q), we[q] = _mm512_loadu_ps(wp + WS + 16 * q);
          for (int r = 0; r < MR; ++r) {
            const float* xr = xf + r * ldxf + 2 * (8 * j + h + l);
            const __m512 xo = _mm512_set1_ps(xr[1]), xe = _mm512_set1_ps(xr[0]);
            for (int q = 0; q < NZ; ++q)
              acc[l][r][q] = _mm512_fmadd_ps(xe, we[q], _mm512_fmadd_ps(xo, wo[q], acc[l][r][q]));
          }
        }
      for (int l = 0; l < 2; ++l)
        for (int r = 0; r < MR; ++r)
          for (int q = 0; q < NZ; ++q) lanes[h + l][r][q] = acc[l][r][q];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NZ; ++q) {
      const __m512 a = _mm512_add_ps(_mm512_add_ps(lanes[0][r][q], lanes[1][r][q]), _mm512_add_ps(lanes[2][r][q], lanes[3][r][q]));
      const __m512 b = _mm512_add_ps(_mm512_add_ps(lanes[4][r][q], lanes[5][r][q]), _mm512_add_ps(lanes[6][r][q], lanes[7][r][q]));
      _mm512_storeu_ps(part + r * W + 16 * q, _mm512_add_ps(a, b));
    }
}

// A row block's partials of one chunk (wf: the chunk's slabs, fma_slab): the panel's 16-column
// groups two at a time (a 32-column slab), every row tile over a slab before the next (its
// widened weights, 32 KB at 128 pairs, stay in L1 over the row tiles), an odd last group alone.
template <class T>
static inline T* fma_slab(T* wf, int q, int64_t npairs) { return wf + (q / 2) * npairs * 64; }
static void fma_chunk_rows(const float* xf, int64_t ldxf, int64_t rows, const float* wf, int nz, int64_t npairs,
                           float* pc) {
  constexpr int W = tonp::kPanelPairs;
  for (int q = 0; q + 2 <= nz; q += 2)
    even_row_tiles<6>(rows, [&](int64_t r, auto mr) {
      fma_lane_tile<mr(), 2>(xf + r * ldxf, ldxf, fma_slab(wf, q, npairs), npairs, pc + r * W + q * 16);
    });
  if (nz % 2) {
    const int q = nz - 1;
    even_row_tiles<8>(rows, [&](int64_t r, auto mr) {
      fma_lane_tile<mr(), 1>(xf + r * ldxf, ldxf, fma_slab(wf, q, npairs), npairs, pc + r * W + q * 16);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Two rows a zmm (hw_dot_tile2's layout) on FMAs. The table's pack_pairs on Intel writes
// hw_pack_pairs' copy (for the one-pair tiles, on the instruction), then, P * chunks * xkc
// floats on, x widened: pair p's block b of chunk c at ((c * nb + b) * P + p) * 64 floats, the
// odd elements of rows 2p (lanes 0-7) and 2p + 1 (lanes 8-15), then the even ones (an odd last
// row: zeros). Both fit pairs_floats(rows, chunks, xkc, true) floats.
// ---------------------------------------------------------------------------------------------
static void fma_pack_pairs(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, int chunks, uint16_t* out) {
  hw_pack_pairs(x, ldx, xkc, rows, chunks, out);
  const int64_t nb = xkc / 16, P = (rows + 1) / 2;
  float* xp = reinterpret_cast<float*>(out) + P * chunks * xkc;
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  for (int c = 0; c < chunks; ++c)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t p = 0; p < P; ++p) {
        const uint16_t* src = x + 2 * p * ldx + c * xkc + 16 * b;
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        const __m256i up = 2 * p + 1 < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + ldx)) : _mm256_setzero_si256();
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), up, 1);
        float* d = xp + ((c * nb + b) * P + p) * 64;
        _mm512_storeu_si512(d, _mm512_and_si512(v, hi));
        _mm512_storeu_si512(d + 16, _mm512_slli_epi32(v, 16));
      }
}

// hw_dot_tile2's outputs and closure; each step widens the weight block (broadcast to both
// halves) and runs the odd pair's FMA then the even's for each row pair. A chunk's chains run
// under FTZ | DAZ, its closure under IEEE.
template <int MP, int NR>
static inline void fma_dot_tile2(const float* xp, int64_t P, int64_t nb, const uint16_t* w, WeightWalk ww, int64_t kc,
                                 int chunks, float* out, int64_t ldo, int64_t prefetch_ahead, int64_t fetch_bytes = 0) {
  constexpr int MR = 2 * MP, NT = MR * NR;
  float part[tonp::kMaxChunks][NT];
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  for (int c = 0; c < chunks; ++c) {
    __m512 acc[MP * NR];
    for (int i = 0; i < MP * NR; ++i) acc[i] = _mm512_setzero_ps();
    const float* xc = xp + c * nb * P * 64;
    const uint16_t* wc = w + c * ww.lc;
    auto step = [&](int64_t b, int64_t valid) {
      __m512 xo[MP], xe[MP];
      for (int p = 0; p < MP; ++p) xo[p] = _mm512_loadu_ps(xc + (b * P + p) * 64), xe[p] = _mm512_loadu_ps(xc + (b * P + p) * 64 + 16);
      for (int n = 0; n < NR; ++n) {
        const __m512i wv = pair_tile_weights(wc + n * ww.ln + b * ww.lb, valid);
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(wv, hi)), we = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
        for (int p = 0; p < MP; ++p) acc[p * NR + n] = _mm512_fmadd_ps(xe[p], we, _mm512_fmadd_ps(xo[p], wo, acc[p * NR + n]));
      }
    };
    {
      ChainScope chain;
      pair_tile_blocks<NR>(wc, ww, kc, prefetch_ahead, fetch_bytes, step);
    }
    hw_close_tile2<MP, NR>(acc, part[c]);
  }
  tile_finish<MR, NR>(&part[0][0], chunks, out, ldo);
}
