// The pair chains of bf16dot.h on the AVX512-BF16 instruction itself (isa_avx512bf16.cpp only):
// vdpbf16ps performs one step of eight (ymm) or sixteen (zmm) lanes' chains, bit for bit the
// emulation's step, and twice the multiply-adds per instruction of fp32 FMAs on 512-bit vectors.
// Included after kernels_impl.h and bf16dot.h, in the same namespace. Weight prefetches go to L2
// (prefetch_w): on the AMD EPYC (Zen 4) the experts' decode stage (1-32 rows a 64-expert stream, 2
// threads) ran 1.15-1.43x as fast in turn as with prefetches into L1.

// Sixteen bf16 from p, zero past `valid` (a chunk's last block).
static inline __m256i hw_block16(const uint16_t* p, int64_t valid) {
  if (valid >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_maskz_loadu_epi16(__mmask16((1u << valid) - 1u), p);
}

static inline __m256 hw_step(__m256 acc, __m256i a, __m256i b) {
  return _mm256_dpbf16_ps(acc, reinterpret_cast<__m256bh&>(a), reinterpret_cast<__m256bh&>(b));
}

using tonp::WeightWalk;  // kernels.h: in place or a weight group (block: 16 bf16, one pair-chain step)

// Few rows: an MR x NR tile, each output's eight lanes in one ymm (the same lanes as bf16dot.h).
// prefetch_ahead: columns past the tile's whose weights to fetch at each k (the next tile's: in
// place a weight row is a page or two, too short for the hardware streams to ramp up; a hint, no
// arithmetic). A weight group is one stream the hardware follows: on the AMD EPYC a prefetch added
// nothing there (measured as the group layout was), so fetch_bytes is 0 but on Intel, where the
// walk fetches its block's four lines kGroupFetchBf16 bytes on: moe_experts bf16 at 16 tokens (one
// row an expert; 128 cold experts in five layers cycled, top-8 of random routing, 2 threads, in
// one process, the distances alternated) 1.21x against none (23.1 -> 28.0 GB/s), 0.5 / 1 / 3 /
// 4 / 8 KB 1.13x / 1.16x / 1.22x / 1.17x / 1.15x. (The pair tiles' in-place rows keep the next
// tile's rows: the same 1-2 KB on along their own rows ran 0.77-0.87x at 4 and 8 rows an expert,
// 8-16 rows ahead 0.94-0.98x.) On Intel, pair tiles of up to kGroupPairsIntel pairs (6 rows)
// read the group too, all eight columns a step (hw_dot_tile2<MP, 8>), against the next-tile
// prefetch in place: 16 / 32 / 64 tokens 1.05x / 1.04x / 1.04x, 96 (six rows) 0.99x; the fetch at
// 1 / 4 / 8 KB on ran 0.95-0.98x / 0.95-0.99x / 0.90-0.96x of 2 KB.
constexpr int64_t kGroupFetchBf16 = 2048;
constexpr int kGroupPairsIntel = 3;
template <int MR, int NR>
static inline void hw_dot_tile(const uint16_t* x, int64_t ldx, int64_t xkc, const uint16_t* w, WeightWalk ww, int64_t kc,
                               int chunks, float* out, int64_t ldo, int64_t prefetch_ahead, int64_t fetch_bytes = 0) {
  constexpr int NT = MR * NR;
  float part[tonp::kMaxChunks][NT];
  for (int c = 0; c < chunks; ++c) {
    __m256 acc[NT];
    for (int i = 0; i < NT; ++i) acc[i] = _mm256_setzero_ps();
    const uint16_t* wc = w + c * ww.lc;
    for (int64_t k = 0; k < kc; k += 16) {
      const uint16_t* wk = wc + (k / 16) * ww.lb;
      if (fetch_bytes)  // a group's block: 16 bf16 of 8 columns, four lines (integer addresses, never faults)
        for (int j = 0; j < 4; ++j) prefetch_w(reinterpret_cast<uintptr_t>(wk) + uintptr_t(fetch_bytes + 64 * j));
      if (prefetch_ahead && (k & 31) == 0)  // once per cache line; integer addresses (never faults)
        for (int n = 0; n < NR; ++n)
          prefetch_w(reinterpret_cast<uintptr_t>(wk) + 2 * uintptr_t((n + prefetch_ahead) * ww.ln));
      __m256i xv[MR];
      for (int r = 0; r < MR; ++r) xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * ldx + c * xkc + k));
      for (int n = 0; n < NR; ++n) {
        const __m256i wv = hw_block16(wk + n * ww.ln, kc - k);
        for (int r = 0; r < MR; ++r) acc[r * NR + n] = hw_step(acc[r * NR + n], xv[r], wv);
      }
    }
    V8 av[NT];
    for (int i = 0; i < NT; ++i) av[i].v = acc[i];
    tile_hsum<NT>(av, part[c]);
  }
  tile_finish<MR, NR>(&part[0][0], chunks, out, ldo);
}

// x in row pairs (Kernels::pack_pairs): pair p's block b of chunk c at xp + ((c * nb + b) * P + p) * 32
// (nb = xkc / 16 blocks a chunk, P = ceil(rows / 2) pairs): row 2p's sixteen bf16, then row
// 2p + 1's (an odd last row: zeros). An exact copy, made once for all the panels of the rows.
static void hw_pack_pairs(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, int chunks, uint16_t* xp) {
  const int64_t nb = xkc / 16, P = (rows + 1) / 2;
  for (int c = 0; c < chunks; ++c)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t p = 0; p < P; ++p) {
        uint16_t* d = xp + ((c * nb + b) * P + p) * 32;
        const uint16_t* src = x + 2 * p * ldx + c * xkc + 16 * b;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 16),
                            2 * p + 1 < rows ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + ldx))
                                             : _mm256_setzero_si256());
      }
}

// hadd_ps on zmm: per 128-bit block [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
static inline __m512 hw_hadd(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The lane tree of sixteen outputs held two rows per zmm (lanes 0-7 one row's eight lanes of an
// output, lanes 8-15 the next row's): a[0..3] four columns of rows (i, i + 1), b[0..3] (null:
// zeros) the same columns of rows (i + 2, i + 3). Result: those rows' four outputs each, row by
// row, each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): hsum8's adds, in zmm (the same
// hadd steps, then the two halves of each row's lanes added across 128-bit blocks).
static inline __m512 hw_close8(const __m512* a, const __m512* b, __m512 zero) {
  const __m512 q0 = hw_hadd(hw_hadd(a[0], a[1]), hw_hadd(a[2], a[3]));
  const __m512 q1 = b ? hw_hadd(hw_hadd(b[0], b[1]), hw_hadd(b[2], b[3])) : zero;
  return _mm512_add_ps(_mm512_shuffle_f32x4(q0, q1, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(q0, q1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A pair tile's chunk closed (hw_dot_tile2): its accumulators' lanes to the chunk's partials,
// part: [2 * MP rows][NR] (each output's tree8, in zmm).
template <int MP, int NR>
static inline void hw_close_tile2(const __m512* acc, float* part) {
  constexpr int NT = 2 * MP * NR;
  if constexpr (NR == 8) {
    // A pair's eight columns close in zmm as two halves of four (hw_close8 with the upper half
    // in the second pair's place: the same adds), its 128-bit blocks (row 2p columns 0-3, row
    // 2p + 1 columns 0-3, row 2p columns 4-7, row 2p + 1 columns 4-7) put in row order.
    for (int p = 0; p < MP; ++p) {
      const __m512 s = hw_close8(acc + p * 8, acc + p * 8 + 4, _mm512_setzero_ps());
      _mm512_storeu_ps(part + 2 * p * 8, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0)));
    }
  } else if constexpr (NR == 4) {
    // Two pairs' four columns (one pair's and zeros for an odd last pair) close in zmm: part
    // rows 2p .. 2p + 3 are sixteen consecutive floats.
    for (int p = 0; p < MP; p += 2) {
      const __m512 z = _mm512_setzero_ps();
      const __m512 s = hw_close8(acc + p * 4, p + 1 < MP ? acc + (p + 1) * 4 : nullptr, z);
      if (p + 1 < MP) _mm512_storeu_ps(part + 2 * p * 4, s);
      else _mm256_storeu_ps(part + 2 * p * 4, _mm512_castps512_ps256(s));
    }
  } else {
    V8 av[NT];
    for (int p = 0; p < MP; ++p)
      for (int n = 0; n < NR; ++n) {
        av[(2 * p) * NR + n].v = _mm512_castps512_ps256(acc[p * NR + n]);
        av[(2 * p + 1) * NR + n].v = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p * NR + n]), 1));
      }
    tile_hsum<NT>(av, part);
  }
}

// A pair tile's walk over a chunk's weight blocks (hw_dot_tile2, fma_dot_tile2): step(b, valid)
// for each block b, the last one `valid` elements long where kc is not a multiple of 16. In
// place, the next tile's columns fetched at each cache line of the rows (prefetch_ahead columns
// on); on a weight group, its lines fetch_bytes on.
template <int NR, class Step>
static inline void pair_tile_blocks(const uint16_t* wc, WeightWalk ww, int64_t kc, int64_t prefetch_ahead,
                                    int64_t fetch_bytes, Step&& step) {
  const int64_t full = kc / 16;  // whole weight blocks; a last partial one is read masked
  int64_t b = 0;
  for (; b + 2 <= full; b += 2) {  // two blocks: one cache line of each weight row in place
    if (prefetch_ahead)  // integer addresses (never faults)
      for (int n = 0; n < NR; ++n)
        prefetch_w(reinterpret_cast<uintptr_t>(wc) + 2 * uintptr_t((n + prefetch_ahead) * ww.ln + b * ww.lb));
    if (fetch_bytes)  // a group: the two blocks' lines, fetch_bytes on
      for (int64_t j = 0; j < 4 * ww.lb; j += 64) prefetch_w(reinterpret_cast<uintptr_t>(wc + b * ww.lb) + uintptr_t(fetch_bytes + j));
    step(b, 16);
    step(b + 1, 16);
  }
  for (; b < full; ++b) step(b, 16);
  if (full * 16 < kc) step(full, kc - full * 16);
}

// A column's weight block (16 bf16 at q, zero past valid) in both halves of a zmm.
static inline __m512i pair_tile_weights(const uint16_t* q, int64_t valid) {
  return valid >= 16 ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)))
                     : _mm512_broadcast_i64x4(hw_block16(q, valid));
}

// The same outputs for 2 * MP rows, two rows per zmm: lanes 0-7 hold row 2p's eight lanes of an
// output, lanes 8-15 row 2p + 1's, the weight block broadcast to both halves. vdpbf16ps is
// lane-wise, so each output's lanes see exactly the ymm tile's steps, in the same block order,
// closed by the same tile_hsum and chunk tree; a zmm does two rows' work per instruction.
// x comes packed in row pairs (hw_pack_pairs; xp: the tile's first pair, P pairs in all, nb
// blocks a chunk): a row pair is one load, and the weight block a broadcast from memory, so the
// loop runs no shuffle (against reading x in place, two loads and an insert per pair, on the AMD
// EPYC (Zen 4), one thread: 1.11-1.29x hot at 4-16 rows, 1.08-1.32x with cold weights at 4-8 and 16;
// the experts' two stages with Poisson rows, 2 threads, a mean of 8 rows an expert: 1.03-1.26x).
// A chunk's lanes close in zmm (hw_close8: two pairs' four columns, sixteen outputs, per call),
// not split into ymm halves for hsum8: the same adds in the same order. Against the ymm closure,
// one thread, hot weights, the old and new builds alternated: 8 rows at K = 2048 1.11x, at K = 768
// (six blocks a chunk, where the closure weighs most) 4 / 8 / 16 rows 1.36x / 1.23x / 1.24x;
// moe_experts (128 experts, cold, top-8 of random routing, 2 threads) at 8 rows an expert
// 42-50 ms against 49-54, at 16 rows 70-73 against 81-97, at 4 level within the noise.
// The weights: in place (prefetch_ahead: the next tile's columns at each line) or a weight group
// (NR = kGroupCols: one 256-byte block a step, one stream; fetch_bytes: its lines that far on).
template <int MP, int NR>
static inline void hw_dot_tile2(const uint16_t* xp, int64_t P, int64_t nb, const uint16_t* w, WeightWalk ww, int64_t kc,
                                int chunks, float* out, int64_t ldo, int64_t prefetch_ahead, int64_t fetch_bytes = 0) {
  constexpr int MR = 2 * MP, NT = MR * NR;
  float part[tonp::kMaxChunks][NT];
  for (int c = 0; c < chunks; ++c) {
    __m512 acc[MP * NR];
    for (int i = 0; i < MP * NR; ++i) acc[i] = _mm512_setzero_ps();
    const uint16_t* xc = xp + c * nb * P * 32;
    const uint16_t* wc = w + c * ww.lc;
    auto step = [&](int64_t b, int64_t valid) {
      __m512i xv[MP];
      for (int p = 0; p < MP; ++p) xv[p] = _mm512_loadu_si512(xc + (b * P + p) * 32);
      for (int n = 0; n < NR; ++n) {
        const __m512i wv = pair_tile_weights(wc + n * ww.ln + b * ww.lb, valid);
        for (int p = 0; p < MP; ++p)
          acc[p * NR + n] = _mm512_dpbf16_ps(acc[p * NR + n], reinterpret_cast<const __m512bh&>(xv[p]),
                                             reinterpret_cast<const __m512bh&>(wv));
      }
    };
    pair_tile_blocks<NR>(wc, ww, kc, prefetch_ahead, fetch_bytes, step);
    hw_close_tile2<MP, NR>(acc, part[c]);
  }
  tile_finish<MR, NR>(&part[0][0], chunks, out, ldo);
}

// In place: r[i] dword j <- r[j] dword i (a 16 x 16 transpose of 32-bit pairs; moves, no arithmetic).
static inline void hw_transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
    const __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
    t[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xdd);
    t[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// A 16-column group's chunk of W as pairs: put(p, v) for each of the chunk's npairs = ceil(kc /
// 16) * 8 pairs p, v's dword n the pair p of weight row n (elements 2p, 2p + 1 of the chunk;
// zero past kc and past ncols <= 16).
template <class Put>
static inline void hw_chunk_pairs16(const uint16_t* W, int64_t ldw, int ncols, int64_t kc, Put&& put) {
  const int64_t npairs = (kc + 15) / 16 * 8;
  for (int64_t p0 = 0; p0 < npairs; p0 += 16) {
    __m512i r[16];
    const int64_t valid = kc - 2 * p0;
    const __mmask32 m = valid >= 32 ? ~__mmask32(0) : __mmask32((1ull << valid) - 1u);
    for (int n = 0; n < 16; ++n)
      r[n] = n < ncols ? _mm512_maskz_loadu_epi16(m, W + n * ldw + 2 * p0) : _mm512_setzero_si512();
    hw_transpose16(r);
    for (int i = 0; i < 16 && p0 + i < npairs; ++i) put(p0 + i, r[i]);
  }
}

// Rows in tiles of at most MAX (1 <= MAX <= 8), as even as they split (a lone row would load a
// weight pair for one step): f(first row, rows as an integral constant). The lane passes' tiles.
template <int MAX, class F>
static inline void even_row_tiles(int64_t rows, F&& f) {
  const int64_t tiles = (rows + MAX - 1) / MAX, small = rows / tiles, big = rows % tiles;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t mr = small + (t < big);
    switch (mr) {
#define TONP_ROW_TILE(n) \
  case n: if constexpr (n <= MAX) f(r, std::integral_constant<int, n>()); break;
      TONP_ROW_TILE(1) TONP_ROW_TILE(2) TONP_ROW_TILE(3) TONP_ROW_TILE(4)
      TONP_ROW_TILE(5) TONP_ROW_TILE(6) TONP_ROW_TILE(7) TONP_ROW_TILE(8)
#undef TONP_ROW_TILE
      default: break;
    }
    r += mr;
  }
}

#include "bf16dot_fma.h"

// All ncols <= kPanelPairs columns (out: [rows, kPanelPairs]): one row (x in place; MP = 0), or
// 2 * MP rows over x in row pairs. Each tile prefetches the next tile's weight rows (the panel's
// last tile: rows past it, the next panel's or past W). wg: these columns' weight group
// (ncols == kGroupCols) or null, read by the one-row tile and, on Intel (kIntel), by pair
// tiles of up to kGroupPairsIntel pairs too, each walk fetching kGroupFetchBf16 bytes on. xw: on
// Intel the tile's pairs in fma_pack_pairs' widened copy.
template <int MP, bool kIntel>
static inline void hw_dot_cols(const uint16_t* x, int64_t ldx, int64_t xkc, const uint16_t* xp, const float* xw, int64_t P,
                               int64_t nb, const uint16_t* w, int64_t ldw, int64_t kc, int chunks, int ncols, float* out,
                               const uint16_t* wg) {
  constexpr int64_t ld = tonp::kPanelPairs;
  const WeightWalk in_place = WeightWalk::in_place(ldw, kc, tonp::Elem::BF16);
  int n = 0;
  if constexpr (MP == 0) {
    static_assert(tonp::kGroupCols == 8, "a weight group is one hw_dot_tile<1, 8>");
    if (wg && ncols == tonp::kGroupCols) {
      hw_dot_tile<1, 8>(x, ldx, xkc, wg, WeightWalk::bf16_group(kc), kc, chunks, out, ld, 0, kIntel ? kGroupFetchBf16 : 0);
      return;
    }
    for (; n + 8 <= ncols; n += 8) hw_dot_tile<1, 8>(x, ldx, xkc, w + n * ldw, in_place, kc, chunks, out + n, ld, 8);
    for (; n + 4 <= ncols; n += 4) hw_dot_tile<1, 4>(x, ldx, xkc, w + n * ldw, in_place, kc, chunks, out + n, ld, 4);
    for (; n < ncols; ++n) hw_dot_tile<1, 1>(x, ldx, xkc, w + n * ldw, in_place, kc, chunks, out + n, ld, 0);
  } else {
    // On Intel, from two row pairs, the FMA tiles over the widened copy of x (xw); one pair
    // stays on the instruction (the FMA tile ran it 0.85-0.92x at K = 768-2048, hot weights: a
    // weight block's widening weighs as much as its two FMAs there).
    auto tile = [&](auto nr, const uint16_t* wn, WeightWalk walk, int64_t ahead, int64_t fetch, float* o) {
      if constexpr (kIntel && MP >= 2) fma_dot_tile2<MP, nr()>(xw, P, nb, wn, walk, kc, chunks, o, ld, ahead, fetch);
      else hw_dot_tile2<MP, nr()>(xp, P, nb, wn, walk, kc, chunks, o, ld, ahead, fetch);
    };
    if constexpr (kIntel && MP <= kGroupPairsIntel) {
      if (wg && ncols == tonp::kGroupCols) {
        tile(std::integral_constant<int, 8>(), wg, WeightWalk::bf16_group(kc), 0, kGroupFetchBf16, out);
        return;
      }
    }
    for (; n + 4 <= ncols; n += 4) tile(std::integral_constant<int, 4>(), w + n * ldw, in_place, 4, 0, out + n);
    for (; n < ncols; ++n) tile(std::integral_constant<int, 1>(), w + n * ldw, in_place, 0, 0, out + n);
  }
}

#include "bf16dot_lanes.h"

// ncols <= kPanelPairs outputs per row (the hardware build's panel: 64 columns). kIntel (the
// table on Intel): the tiles on a weight group prefetch along it, pair tiles of up to
// kGroupPairsIntel pairs read it too (hw_dot_cols), the pair tiles of two pairs or more and the
// lane passes (from kLaneRowsPairsIntel rows) run on FMAs (bf16dot_fma.h), and xpairs holds
// fma_pack_pairs' two copies. kLaneRows: the table's lane_rows_bf16 (bf16_lane_passes; 0: the
// instruction's rule by chunk length).
template <bool kIntel, int kLaneRows>
static void linear_panel_bf16_hw(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, const uint16_t* W,
                                 int64_t ldw, int64_t kc, int chunks, const float* bias, int ncols, void* out,
                                 int64_t ldo, Elem oelem, float* scratch, const uint16_t* xpairs,
                                 const uint16_t* wgroups) {
  IeeeScope ieee;  // the trees' adds
  constexpr int64_t WP = tonp::kPanelPairs;
  if (tonp::bf16_lane_passes(rows, kc, true, kLaneRows)) {
    float* pbuf = scratch;
    uint32_t* wp = reinterpret_cast<uint32_t*>(pbuf + chunks * std::min<int64_t>(rows, tonp::kRowBlock) * WP);
    if constexpr (kIntel) hw_rows_blocked<true>(x, ldx, xkc, rows, W, ldw, kc, chunks, bias, ncols, out, ldo, oelem, pbuf, wp);
    else hw_rows_blocked<false>(x, ldx, xkc, rows, W, ldw, kc, chunks, bias, ncols, out, ldo, oelem, pbuf, wp);
    return;
  }
  float* res = scratch;  // [rows + 1, WP]: a padded pair tile also writes its zero row
  const int64_t P = (rows + 1) / 2, nb = xkc / 16;  // xpairs: the rows in pairs (required from 2 rows)
  const uint16_t* xp = xpairs;
  const float* xw = kIntel && xp ? reinterpret_cast<const float*>(xp) + P * chunks * xkc : nullptr;  // fma_pack_pairs' widened copy
  // Eight columns at a time (their weight rows stay in L1), every row tile over them: tiles of up
  // to 8 rows (two per zmm), so any row count streams the weights once. An odd last row of 3, 5
  // or 7 left over rides in its pair's upper half against zeros (hw_pack_pairs): its zero row's
  // outputs go to res and are never stored (vdpbf16ps is lane-wise: a row's lanes never meet its
  // neighbour's, so the bits are the row's alone). A lone row left over (one row, or 8k + 1) runs
  // the one-row tile. Against the one-row tile after the pairs, hot weights, one thread, 3 / 5 /
  // 7 / 11 / 15 rows: 1.44x / 1.27x / 1.17x / 1.14x / 1.10x at K = 2048, 1.23x / 1.10x / 1.11x /
  // 1.08x / 1.07x at K = 768; padding a lone row after 8 (9 rows into pair tiles of 3 and 2)
  // lost 0.90x at K = 2048, so a lone row keeps its tile.
  for (int n0 = 0; n0 < ncols; n0 += 8) {
    const int nc = std::min(8, ncols - n0);
    const uint16_t* w = W + n0 * ldw;
    // Weight groups serve one row, and on Intel up to kGroupPairsIntel row pairs (one pair tile
    // over the group's eight columns, one stream); with more rows the row tiles read these
    // columns in place, and a lone last row's tile finds them in L1 there (the group would be a
    // second read). On the AMD EPYC the pair tiles reading the groups (then two tiles over a
    // group's two column halves) ran the experts' stage at 128 tokens 0.6-0.7x as fast, cold, on
    // either bus.
    const uint16_t* wg = wgroups && (rows == 1 || (kIntel && rows <= 2 * kGroupPairsIntel))
                             ? wgroups + (n0 / tonp::kGroupCols) * tonp::weight_group_elems(kc * chunks, chunks, tonp::Elem::BF16)
                             : nullptr;
    int64_t r = 0;
    auto tile = [&](auto mr) {
      hw_dot_cols<mr() / 2, kIntel>(x + r * ldx, ldx, xkc, xp ? xp + (r / 2) * 32 : nullptr,
                                         xw ? xw + (r / 2) * 64 : nullptr, P, nb, w, ldw, kc, chunks, nc,
                                         res + r * WP + n0, wg);
      r += mr();
    };
    while (rows - r >= 8) tile(std::integral_constant<int, 8>());
    switch (rows - r) {
      case 7: tile(std::integral_constant<int, 8>()); break;  // 7 rows and the zero row
      case 6: tile(std::integral_constant<int, 6>()); break;
      case 5: tile(std::integral_constant<int, 6>()); break;
      case 4: tile(std::integral_constant<int, 4>()); break;
      case 3: tile(std::integral_constant<int, 4>()); break;
      case 2: tile(std::integral_constant<int, 2>()); break;
      case 1: tile(std::integral_constant<int, 1>()); break;
      default: break;
    }
  }
  pair_store(res, WP, rows, ncols, bias, out, ldo, oelem);
}

static void bf16_pair_step_hw(const float* acc, const uint16_t* a, const uint16_t* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const int nl = int(n - i < 8 ? n - i : 8);
    const __mmask8 m = __mmask8((1u << nl) - 1u);
    const __m256 c = _mm256_maskz_loadu_ps(m, acc + i);
    const __m256i av = _mm256_maskz_loadu_epi32(m, a + 2 * i), bv = _mm256_maskz_loadu_epi32(m, b + 2 * i);
    _mm256_mask_storeu_ps(out + i, m, hw_step(c, av, bv));
  }
}
