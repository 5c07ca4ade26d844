// The lane passes of the AVX512-BF16 table (many rows; bf16_lane_passes): the panel's weights
// packed once a chunk, then rows in blocks, each chunk's lanes in outer-product tiles, the chunk
// tree, the store. On vdpbf16ps here (hw_lane_tile), or on FMAs (bf16dot_fma.h's fma_lane_tile)
// in the table on Intel. Included by bf16dot_hw.h after bf16dot_fma.h, in its namespace.

// wp[p * ldp + n] = the pair p of weight row n (elements 2p, 2p + 1 of the chunk; zero past kc
// and past ncols <= 16), for the chunk's npairs = ceil(kc / 16) * 8 pairs.
static inline void hw_pack_chunk(const uint16_t* W, int64_t ldw, int ncols, int64_t kc, uint32_t* wp, int64_t ldp) {
  hw_chunk_pairs16(W, ldw, ncols, kc, [&](int64_t p, __m512i v) { _mm512_storeu_si512(wp + p * ldp, v); });
}

// Many rows: an outer product of MR rows and NZ x 16 columns over the lanes in two groups of four
// (l = 0-3, then 4-7): each lane's chain runs over its pairs p = l, l + 8, ... in one zmm
// accumulator per (row, 16 columns), the weight pairs as the register operand and the row's
// pair of x broadcast (a product is the same either way round: one exact product, one
// rounding). A group's four lanes close in registers as (a0 + a1) + (a2 + a3) and the two
// groups' sums are added: tree8 with no lane value stored (a store per lane and output is what
// short chunks cannot hide). wp: the chunk's pairs, pair p's columns at wp + p * ldp.
// part: [MR, kPanelPairs] from this tile's first column.
template <int MR, int NZ>
static inline void hw_lane_tile(const uint16_t* xc, int64_t ldx, const uint32_t* wp, int64_t ldp, int64_t npairs,
                                float* part) {
  constexpr int W = tonp::kPanelPairs;
  __m512 first[MR][NZ];
  for (int g = 0; g < 2; ++g) {
    __m512 acc[MR][NZ][4];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < NZ; ++q)
        for (int l = 0; l < 4; ++l) acc[r][q][l] = _mm512_setzero_ps();
    for (int64_t p0 = 4 * g; p0 < npairs; p0 += 8)
      for (int l = 0; l < 4; ++l) {
        __m512i w[NZ];
        for (int q = 0; q < NZ; ++q) w[q] = _mm512_loadu_si512(wp + (p0 + l) * ldp + 16 * q);
        for (int r = 0; r < MR; ++r) {
          int32_t pair;
          std::memcpy(&pair, xc + r * ldx + 2 * (p0 + l), 4);
          for (int q = 0; q < NZ; ++q)
            acc[r][q][l] = _mm512_dpbf16_ps(acc[r][q][l], reinterpret_cast<const __m512bh&>(w[q]),
                                            (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < NZ; ++q) {
        const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[r][q][0], acc[r][q][1]), _mm512_add_ps(acc[r][q][2], acc[r][q][3]));
        if (g == 0) first[r][q] = s;
        else _mm512_storeu_ps(part + r * W + 16 * q, _mm512_add_ps(first[r][q], s));
      }
  }
}

// A row block's partials of one chunk: the panel's 16-column groups two at a time over tiles of
// three rows (24 accumulators), an odd last group alone over tiles of five (20).
static void hw_chunk_rows(const uint16_t* xc, int64_t ldx, int64_t rows, const uint32_t* wp, int nz, int64_t npairs,
                          float* pc) {
  constexpr int W = tonp::kPanelPairs;
  const int64_t ldp = nz * 16;
  if (nz >= 2)
    even_row_tiles<3>(rows, [&](int64_t r, auto mr) {
      for (int q = 0; q + 2 <= nz; q += 2) hw_lane_tile<mr(), 2>(xc + r * ldx, ldx, wp + q * 16, ldp, npairs, pc + r * W + q * 16);
    });
  if (nz % 2) {
    const int q = nz - 1;
    even_row_tiles<5>(rows, [&](int64_t r, auto mr) {
      hw_lane_tile<mr(), 1>(xc + r * ldx, ldx, wp + q * 16, ldp, npairs, pc + r * W + q * 16);
    });
  }
}

// Finished sums [rows, kPanelPairs] + bias -> out, sixteen outputs per step: pair_store's
// arithmetic (one fp32 add, a NaN made canonical, round to nearest even in integers, as
// f32_to_bf16; vcvtneps2bf16 would flush subnormals).
static inline void hw_pair_store(const float* res, int64_t rows, int ncols, const float* bias, void* out, int64_t ldo,
                                 Elem oelem) {
  constexpr int64_t W = tonp::kPanelPairs;
  const __m512i nan32 = _mm512_set1_epi32(0x7fc00000), bit = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < ncols; j += 16) {
      const __mmask16 m = ncols - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (ncols - j)) - 1u);
      __m512 v = _mm512_maskz_loadu_ps(m, res + r * W + j);
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + j));
      __m512i b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castps_si512(v), nan32);
      if (oelem == Elem::F32) {
        _mm512_mask_storeu_epi32(static_cast<float*>(out) + r * ldo + j, m, b);
      } else {
        b = _mm512_add_epi32(b, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(b, 16), bit)));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + r * ldo + j, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
      }
    }
}

// Many rows: the panel's weights packed once, chunk by chunk (wp: [chunks][npairs][nz x 16]
// pairs, or with kFma [chunks][npairs][odd, even][nz x 16] fp32), then rows in blocks of
// kRowBlock: each chunk's lane tiles (kFma: on FMAs over the block's x widened, xf), the chunk
// tree, the store.
template <bool kFma>
static void hw_rows_blocked(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, const uint16_t* W, int64_t ldw,
                            int64_t kc, int chunks, const float* bias, int ncols, void* out, int64_t ldo, Elem oelem,
                            float* pbuf, uint32_t* wp) {
  constexpr int64_t WP = tonp::kPanelPairs;
  const int64_t npairs = (kc + 15) / 16 * 8;
  const int nz = (ncols + 15) / 16;
  const int64_t wstride = npairs * nz * 16 * (kFma ? 2 : 1), osz = oelem == Elem::F32 ? 4 : 2;
  float* wf = reinterpret_cast<float*>(wp);
  float* xf = wf + chunks * wstride;  // kFma: [kRowBlock][2 npairs]
  for (int c = 0; c < chunks; ++c) {
    // Fetch the next chunk's weights while this one is packed: a pass with no arithmetic to hide
    // a miss (a hint; integer addresses, never faults).
    if (c + 1 < chunks)
      for (int n = 0; n < ncols; ++n)
        for (int64_t k = 0; k < kc; k += 32)
          prefetch_w(reinterpret_cast<uintptr_t>(W) + 2 * uintptr_t(n * ldw + (c + 1) * kc + k));
    for (int q = 0; q < nz; ++q)
      if constexpr (kFma)
        fma_pack_chunk(W + q * 16 * ldw + c * kc, ldw, std::min(16, ncols - 16 * q), kc,
                       fma_slab(wf + c * wstride, q, npairs) + (q % 2) * 16, q / 2 * 2 + 2 <= nz ? 32 : 16);
      else
        hw_pack_chunk(W + q * 16 * ldw + c * kc, ldw, std::min(16, ncols - 16 * q), kc, wp + c * wstride + q * 16, nz * 16);
  }
  for (int64_t r0 = 0; r0 < rows; r0 += tonp::kRowBlock) {
    const int64_t n = std::min<int64_t>(tonp::kRowBlock, rows - r0), cstride = n * WP;
    for (int c = 0; c < chunks; ++c) {
      const uint16_t* xc = x + r0 * ldx + c * xkc;
      float* pc = pbuf + c * cstride;
      if constexpr (kFma) {
        fma_widen_rows(xc, ldx, n, 2 * npairs, xf, 2 * npairs);
        fma_chunk_rows(xf, 2 * npairs, n, wf + c * wstride, nz, npairs, pc);
      } else {
        hw_chunk_rows(xc, ldx, n, wp + c * wstride, nz, npairs, pc);
      }
    }
    chunk_tree(pbuf, cstride, chunks, cstride);
    hw_pair_store(pbuf, n, ncols, bias, static_cast<char*>(out) + r0 * ldo * osz, ldo, oelem);
  }
}
