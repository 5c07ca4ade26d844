// The fp32-FMA linear (the dot-product tiles here, the lane passes in linear_lanes.h), compiled
// once per ISA as part of kernels_impl.h (included there, inside the ISA's namespace, after its
// element helpers).

// Per build: the dot products' row tile, the fp32 row count from which lane passes run (the
// table's lane_rows_f32) and the cache level the weight prefetches fill. The AVX-512 build has 32
// vector registers, so its dot tiles take four rows (16 accumulators); and it prefetches weights
// into L2, not L1 (prefetcht1): on the AMD EPYC (Zen 4) the experts' decode stage, 2-8 rows a
// 64-expert fp32 stream on 2 threads, ran 1.2-1.7x as fast in turn, the lane passes 1.1-1.3x.
// Neither changes a bit: which rows share a tile and when a line arrives.
// kGroupRowsBuild: the row count from which a task reads an fp32 weight group it is given (the
// table's group_rows_f32). AVX2: moe_experts fp32, 128 cold experts, every expert R rows, 2
// threads, groups against in place alternated in one process, on the AVX2-only AMD EPYC (Zen 3):
// R = 2 0.80-0.85x, 3 0.83x, 4 0.99-1.09x, 6 1.01x, 8 1.52x, 12 1.33x (medians of 6; one row an
// expert streams its weight fastest through the in-place dot tiles). So the AVX2 table reads
// them from four rows. (On the Zen 4 running the AVX2 table, a CPU that runs the AVX-512 one,
// two rows had measured 1.12-1.32x.)
#if defined(TONP_AVX512)
constexpr int kDotTileRows = 4;
constexpr int kLaneRowsBuild = tonp::kLaneRowsZmm;
constexpr int kWeightPrefetch = 2;
constexpr int kGroupRowsBuild = 1;
#else
constexpr int kDotTileRows = 3;
constexpr int kLaneRowsBuild = tonp::kLaneRows;
constexpr int kWeightPrefetch = 3;
constexpr int kGroupRowsBuild = 4;
#endif
static inline void prefetch_w(uintptr_t a) { __builtin_prefetch(reinterpret_cast<const void*>(a), 0, kWeightPrefetch); }

// ---------------------------------------------------------------------------------------------
// Linear. The order of one output y[m, n] within a chunk of kc: eight lanes, lane l accumulating
// the products x[m, k] * w[n, k] for k = l, l + 8, ... in sequence (an FMA chain from 0), the
// last kc % 8 products going to lanes 0.. in order; then the fixed hsum tree. Every path (one row
// or many, any tile, any ISA) computes exactly this, so the bits depend only on x's row and W.
//
// Two layouts compute this. For few rows, dot products: each output's eight lanes in one vector,
// the weight streamed in place (1x8 tiles for one row, 3x4 for more (AVX-512: 4x4), narrower at a
// panel's edges; four weight rows at a time, every row tile on them: linear_rows), closed by hsum8.
// From 8 rows (AVX-512: 32; 20 with bf16 weights, 3 for chunks of at most 8:
// linear_lane_passes), lane passes: the chunk's weights transposed, and for each lane l an outer
// product over its k's, sixteen outputs of a row in two vectors (4x16 tiles), closed by the same
// tree across the eight lane vectors (the AVX-512 build: 8x16 tiles, a row's sixteen outputs in one
// zmm; its table on Intel 6x32 tiles on two panels, linear_panels2), x read lane-packed
// (pack_lanes, once per row block).
// The layout, the tile, the loop order and the row block are chosen from the task's row count:
// they change which outputs are computed side by side, never the FMA chains, the hsum tree or
// the chunk tree of an output. The row-invariance tests (M = 1 ... 301) cross every threshold.
// ---------------------------------------------------------------------------------------------
// part[i] = hsum(acc[i]) for a tile's NT accumulators (hsum8: the same tree, eight at a time).
template <int NT>
static inline void tile_hsum(const V8* acc, float* part) {
  for (int i = 0; i < NT; i += 8) {
    V8 g[8];
    for (int j = 0; j < 8; ++j) g[j] = i + j < NT ? acc[i + j] : vzero();
    float h[8];
    vstore(h, hsum8(g));
    for (int j = 0; j < 8 && i + j < NT; ++j) part[i + j] = h[j];
  }
}

// part[i] = tree8 of the eight lane values lanes[l * stride + i], i < n (lane-wise, as hsum).
static inline void lanes_tree(const float* lanes, int64_t stride, int64_t n, float* part) {
  for (int64_t i = 0; i < n; i += 8) {
    auto L = [&](int l) { return vload(lanes + l * stride + i); };
    vstore(part + i, vadd(vadd(vadd(L(0), L(1)), vadd(L(2), L(3))), vadd(vadd(L(4), L(5)), vadd(L(6), L(7)))));
  }
}

// Row tiles of a block: f(r, integral_constant<MR>) for tiles of MAX rows from row r, then one
// tile of the remaining rows (MAX <= 8). Only which rows share a tile depends on this.
template <int MAX, typename F>
static inline void for_row_tiles(int64_t rows, F&& f) {
  int64_t r = 0;
  for (; r + MAX <= rows; r += MAX) f(r, std::integral_constant<int, MAX>());
  switch (rows - r) {
    case 7: if constexpr (MAX > 7) f(r, std::integral_constant<int, 7>()); break;
    case 6: if constexpr (MAX > 6) f(r, std::integral_constant<int, 6>()); break;
    case 5: if constexpr (MAX > 5) f(r, std::integral_constant<int, 5>()); break;
    case 4: if constexpr (MAX > 4) f(r, std::integral_constant<int, 4>()); break;
    case 3: if constexpr (MAX > 3) f(r, std::integral_constant<int, 3>()); break;
    case 2: if constexpr (MAX > 2) f(r, std::integral_constant<int, 2>()); break;
    case 1: f(r, std::integral_constant<int, 1>()); break;
    default: break;
  }
}

using tonp::WeightWalk;  // kernels.h: the weights in place (block: 8 fp32, one V8 step)

// One chunk of an MR x NR tile: part[r * NR + n] = the chunk's partial of output (r, n).
// prefetch_ahead: weight rows ahead of this tile to prefetch (0: none).
template <int MR, int NR, typename T>
static inline void dot_chunk(const float* xc, int64_t ldx, const T* wc, WeightWalk ww, int64_t kc, int64_t prefetch_ahead,
                             float* part) {
  constexpr int NT = MR * NR;
  const int64_t k8 = kc / 8 * 8;
  V8 acc[NT];
  for (int i = 0; i < NT; ++i) acc[i] = vzero();
  auto step = [&](int64_t k) {
    V8 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = vload(xc + r * ldx + k);
    const T* wk = wc + (k / 8) * ww.lb;
    for (int n = 0; n < NR; ++n) {
      const V8 wv = vload(wk + n * ww.ln);
      for (int r = 0; r < MR; ++r) acc[r * NR + n] = vfma(xv[r], wv, acc[r * NR + n]);
    }
  };
  // Per cache line of weights: prefetch rows ahead at this k (a weight row is a few pages, too
  // short for the hardware streams to ramp up; a hint, no arithmetic), then the line's steps.
  constexpr int64_t kLine = 64 / int64_t(sizeof(T));
  int64_t k = 0;
  for (; k + kLine <= k8; k += kLine) {
    if (prefetch_ahead)  // integer addresses: rows ahead of the last tile lie past W (a hint never faults)
      for (int n = 0; n < NR; ++n)
        prefetch_w(reinterpret_cast<uintptr_t>(wc) + sizeof(T) * uintptr_t((n + prefetch_ahead) * ww.ln + k));
    for (int64_t kk = 0; kk < kLine; kk += 8) step(k + kk);
  }
  for (; k < k8; k += 8) step(k);
  if (k8 < kc) {  // the tail products go to lanes 0.. in order, as a vector step would; the
    const int nt = int(kc - k8);  // other lanes keep their value exactly (a select, not an add)
    float xt[MR][8], wt[NR][8];
    const T* wk = wc + (k8 / 8) * ww.lb;
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 8; ++j) xt[r][j] = j < nt ? xc[r * ldx + k8 + j] : 0.f;
    for (int n = 0; n < NR; ++n)
      for (int j = 0; j < 8; ++j) wt[n][j] = j < nt ? to_f32(wk[n * ww.ln + j]) : 0.f;
    for (int r = 0; r < MR; ++r) {
      const V8 xv = vload(xt[r]);
      for (int n = 0; n < NR; ++n) {
        V8& a = acc[r * NR + n];
        a = vsel_first(nt, vfma(xv, vload(wt[n]), a), a);
      }
    }
  }
  tile_hsum<NT>(acc, part);
}

// The chunk tree over C partials spaced `stride` floats apart, in place, for n consecutive
// outputs: ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)), lane-wise. The result is in p[0..n).
static inline void chunk_tree(float* p, int64_t stride, int chunks, int64_t n) {
  for (int step = 1; step < chunks; step *= 2)
    for (int c = 0; c + step < chunks; c += 2 * step) {
      float* a = p + c * stride;
      const float* b = p + (c + step) * stride;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) vstore(a + i, vadd(vload(a + i), vload(b + i)));
      for (; i < n; ++i) a[i] = a[i] + b[i];
    }
}

// An MR x NR tile's chunk partials part[c][r * NR + n] closed by the chunk tree, into out.
template <int MR, int NR>
static inline void tile_finish(float* part, int chunks, float* out, int64_t ldo) {
  chunk_tree(part, MR * NR, chunks, MR * NR);
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) out[r * ldo + n] = part[r * NR + n];
}

// All chunks of one tile, then the tree (the one-row path: the tile streams its weight rows once).
// ldw: the stride between the tile's weight rows (two rows for a one-row call's interleaved
// tiles, dot_row_panel). Prefetching rows ahead pays when the tile computes more per byte (two or
// more rows) or its rows lie under a page apart (the hardware streams stop at each row's end).
// One row over rows a page or more apart streams as fast without the hints, which cost issue
// slots (measured cold on two threads: the router's bf16 GEMV 24 -> 20 us).
template <int MR, int NR, typename T>
static inline void dot_tile(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t kc, int chunks,
                            float* out /* [MR, ldo_part] */, int64_t ldo) {
  constexpr int NT = MR * NR;
  float part[tonp::kMaxChunks][NT];  // per-chunk partials of the tile's outputs
  const int64_t ahead = MR > 1 || ldw * int64_t(sizeof(T)) < 4096 ? 2 * NR : 0;
  const WeightWalk ww = WeightWalk::in_place(ldw, kc, Elem::F32);  // 8-element steps, fp32 or widened bf16 W
  for (int c = 0; c < chunks; ++c) dot_chunk<MR, NR, T>(x + c * kc, ldx, w + c * kc, ww, kc, ahead, part[c]);
  tile_finish<MR, NR>(&part[0][0], chunks, out, ldo);
}

// One row: the panel's outputs in 1 x 8 tiles, then narrower ones at an edge panel.
template <typename T>
static inline void dot_row_panel(const float* x, const T* w, int64_t ldw, int64_t kc, int chunks, int ncols, float* out) {
  int n = 0;
  if (ncols == kPanel) {
    // One row streams the weight, eight weight rows at a time (eight streams in flight): a full
    // panel's even rows, then its odd rows. Each stream then runs on into the next row, which the
    // hardware prefetcher has already begun to fetch, instead of all eight starting cold on rows
    // no stream has touched. Measured cold on two threads: the router's bf16 GEMV 24-29 -> 19-23
    // us, the down projection's 150-179 -> 116-146 us, fp32 even or faster. The same dot_tile
    // computes each output; only which rows share a tile changes.
    float t[8];
    for (int odd = 0; odd < 2; ++odd) {
      dot_tile<1, 8, T>(x, 0, w + odd * ldw, 2 * ldw, kc, chunks, t, 8);
      for (int j = 0; j < 8; ++j) out[2 * j + odd] = t[j];
    }
    return;
  }
  for (; n + 8 <= ncols; n += 8) dot_tile<1, 8, T>(x, 0, w + n * ldw, ldw, kc, chunks, out + n, kPanel);
  for (; n + 4 <= ncols; n += 4) dot_tile<1, 4, T>(x, 0, w + n * ldw, ldw, kc, chunks, out + n, kPanel);
  switch (ncols - n) {
    case 3: dot_tile<1, 3, T>(x, 0, w + n * ldw, ldw, kc, chunks, out + n, kPanel); break;
    case 2: dot_tile<1, 2, T>(x, 0, w + n * ldw, ldw, kc, chunks, out + n, kPanel); break;
    case 1: dot_tile<1, 1, T>(x, 0, w + n * ldw, ldw, kc, chunks, out + n, kPanel); break;
    default: break;
  }
}

#include "linear_finish.h"  // store_rows; the lane passes' finish (finish_rows_c, finish_panels)
#include "linear_lanes.h"  // the lane passes: pack_lanes, the lane tiles, linear_rows_blocked
                            // (and linear_streamed.h, the AVX2 and portable builds' streamed blocks)

// The dot products (bf16 weights are widened to fp32 as they are loaded, exactly, so they cost half
// the bytes). One row: dot_row_panel. Two rows or more: four weight rows at a time (a column group), every row tile of the block on
// them before the next group, so a weight row comes from memory once and back from L1 or L2 for
// the other row tiles while the next groups' rows are prefetched. Row tiles outer and the panel
// inner, as before, streamed the whole panel for the first row tile and then computed the others
// on cached weights with the memory bus idle: against that, on the AMD EPYC (Zen 4), 2 threads,
// 128 experts' gate_up (K = 2048, N = 1536) and down (K = 768, N = 2048) cold, the builds
// alternated: 6 rows an expert 1.2x, 8 rows 1.10-1.14x, 12 rows 1.07-1.34x, 16 rows 1.03-1.11x,
// 24 rows 1.08x; 2 and 4 rows (one row tile) level. Tried and slower: chunks outer over the
// column groups (1.3x slower: 16 short weight streams), 8 x 2 tiles (2x slower), prefetching in
// the first row tile only or one weight row per row tile (1.0-1.2x slower), prefetching twice
// as far (level). Which outputs share a tile changes; no output's arithmetic does.
template <typename T>
static void linear_rows(const float* x, int64_t ldx, int64_t rows, const T* W, int64_t ldw, int64_t kc,
                        int chunks, int ncols, float* res) {
  if (rows == 1) {
    dot_row_panel<T>(x, W, ldw, kc, chunks, ncols, res);
    return;
  }
  for (int n = 0; n < ncols; n += 4) {
    const int nr = ncols - n < 4 ? ncols - n : 4;
    const T* wn = W + n * ldw;
    for_row_tiles<kDotTileRows>(rows, [&](int64_t r, auto mr) {
      constexpr int MR = decltype(mr)::value;
      float* o = res + r * kPanel + n;
      switch (nr) {
        case 4: dot_tile<MR, 4, T>(x + r * ldx, ldx, wn, ldw, kc, chunks, o, kPanel); break;
        case 3: dot_tile<MR, 3, T>(x + r * ldx, ldx, wn, ldw, kc, chunks, o, kPanel); break;
        case 2: dot_tile<MR, 2, T>(x + r * ldx, ldx, wn, ldw, kc, chunks, o, kPanel); break;
        default: dot_tile<MR, 1, T>(x + r * ldx, ldx, wn, ldw, kc, chunks, o, kPanel); break;
      }
    });
  }
}

// TR: the lane tiles' rows, the layout of xl (pack_lanes_tiled<TR>): kLaneTileRows; the AVX-512
// table on Intel kLaneTileRowsPair. kSpread: lane tiles on fp32 groups spread the prefetch of the
// next block over a chunk's row tiles (GroupFetch; the AVX-512 table on Intel, and its two-panel
// tiles always).
template <int TR, bool kSpread = false>
static void linear_panel_tiled(const float* x, int64_t ldx, int64_t rows, const void* W, int64_t ldw, Elem welem,
                               int64_t kc, int chunks, const float* bias, int ncols, void* out, int64_t ldo,
                               Elem oelem, float* scratch, const float* xl, const float* wgroups) {
  if (ncols > kPanel) {  // whole panels (Kernels::group_panels_f32, lane_panels_f32)
#if !defined(TONP_AVX512)
    const StreamPlan plan(wgroups, kc, rows);
    if (welem == Elem::F32 && ncols == 2 * kPanel && rows >= kGroupRowsBuild && rows <= kTwoPanelRows && plan.on) {
      linear_panels_streamed2(plan, xl, rows, kc, chunks, scratch, wgroups, bias, out, ldo, oelem);
      return;
    }
#else
    if (TR == kLaneTileRowsPair && welem == Elem::F32 && ncols == 2 * kPanel && kc > 8 &&
        (wgroups ? rows >= kGroupRowsBuild : tonp::linear_lane_passes(rows, kc, welem, kLaneRowsBuild))) {
      float* wt = scratch + 2 * int64_t(chunks) * rows * kPanel;  // [2][kc, 16] (W in place)
      linear_panels2<TR>(xl, rows, static_cast<const float*>(W), ldw, kc, chunks, scratch, wt, wgroups, bias, out,
                         ldo, oelem);
      return;
    }
#endif
    const int64_t wsz = welem == Elem::F32 ? 4 : 2, osz = oelem == Elem::F32 ? 4 : 2, gsz = kc * chunks * kPanel;
    for (int n = 0; n < ncols; n += kPanel) {  // a panel at a time
      const int nc = std::min(kPanel, ncols - n);
      linear_panel_tiled<TR, kSpread>(x, ldx, rows, static_cast<const char*>(W) + n * ldw * wsz, ldw, welem, kc, chunks,
                             bias ? bias + n : nullptr, nc, static_cast<char*>(out) + n * osz, ldo, oelem, scratch, xl,
                             wgroups && nc == kPanel ? wgroups + n / kPanel * gsz : nullptr);
    }
    return;
  }
  float* res = scratch;  // [rows, 16] finished sums
  float* pbuf = scratch + rows * kPanel;  // [chunks, rows, 16] partials (lane passes only)
  float* wt = pbuf + int64_t(chunks) * rows * kPanel;  // [kc, 16] transposed chunk (lane passes only)
  // Few rows stream the weight in place as dot products (bf16 widened as it is loaded: half the
  // bytes of fp32); more rows (linear_lane_passes) run lane passes, and so does every row count
  // from kGroupRowsBuild given the panel's fp32 weight group.
  const float* wg = welem == Elem::F32 && ncols == kPanel && rows >= kGroupRowsBuild ? wgroups : nullptr;
  const bool lanes = wg || tonp::linear_lane_passes(rows, kc, welem, kLaneRowsBuild);
  if (lanes) {  // stored from the chunk tree's result (store_rows)
    if (welem == Elem::F32)
      linear_rows_blocked<TR, kSpread>(x, ldx, xl, rows, static_cast<const float*>(W), ldw, kc, chunks, ncols, pbuf, wt, wg,
                              bias, out, ldo, oelem);
    else
      linear_rows_blocked<TR, kSpread>(x, ldx, xl, rows, static_cast<const uint16_t*>(W), ldw, kc, chunks, ncols, pbuf, wt,
                              static_cast<const float*>(nullptr), bias, out, ldo, oelem);
    return;
  }
  if (welem == Elem::F32)
    linear_rows(x, ldx, rows, static_cast<const float*>(W), ldw, kc, chunks, ncols, res);
  else
    linear_rows(x, ldx, rows, static_cast<const uint16_t*>(W), ldw, kc, chunks, ncols, res);
  store_rows(res, rows, ncols, bias, out, ldo, oelem);
}
static void linear_panel(const float* x, int64_t ldx, int64_t rows, const void* W, int64_t ldw, Elem welem,
                         int64_t kc, int chunks, const float* bias, int ncols, void* out, int64_t ldo,
                         Elem oelem, float* scratch, const float* xl, const float* wgroups) {
  linear_panel_tiled<kLaneTileRows>(x, ldx, rows, W, ldw, welem, kc, chunks, bias, ncols, out, ldo, oelem, scratch, xl,
                                    wgroups);
}
#if defined(TONP_AVX512)
// The AVX-512 table on Intel (Kernels::lane_panels_f32 2): chunks of at most kPairTileMaxKc in
// the two-panel tiles' rows, longer ones in the one-panel tiles' (tile_rows_for); x is packed
// for the same rows (pack_lanes_pairs).
static void linear_panel_pairs(const float* x, int64_t ldx, int64_t rows, const void* W, int64_t ldw, Elem welem,
                               int64_t kc, int chunks, const float* bias, int ncols, void* out, int64_t ldo,
                               Elem oelem, float* scratch, const float* xl, const float* wgroups) {
  if (kc <= tonp::kPairTileMaxKc)
    linear_panel_tiled<kLaneTileRowsPair, true>(x, ldx, rows, W, ldw, welem, kc, chunks, bias, ncols, out, ldo, oelem, scratch,
                                          xl, wgroups);
  else
    linear_panel_tiled<kLaneTileRows, true>(x, ldx, rows, W, ldw, welem, kc, chunks, bias, ncols, out, ldo, oelem, scratch, xl,
                                      wgroups);
}
static void pack_lanes_pairs(const float* x, int64_t ldx, int64_t rows, int64_t kc, int chunks, float* xl) {
  if (kc <= tonp::kPairTileMaxKc)
    pack_lanes_tiled<kLaneTileRowsPair>(x, ldx, rows, kc, chunks, xl);
  else
    pack_lanes_tiled<kLaneTileRows>(x, ldx, rows, kc, chunks, xl);
}
#endif
