// The fp32-FMA linear's lane passes (the many-row layout, and every row count on an fp32 weight
// group), compiled once per ISA: included by linear_impl.h, inside the ISA's namespace, after the
// dot tiles (for_row_tiles, chunk_tree, tile_hsum's tree) and linear_finish.h (how the passes'
// partials are finished and stored), and before linear_panel, which calls linear_rows_blocked.
// The order these passes compute is linear_impl.h's header.

// The many-row path computes the same lane chains transposed. Lane l of output (m, n) is the
// chain over k = l, l + 8, ... of the chunk (k mod 8 = l, tail included): for a fixed lane that is
// an outer product, sixteen outputs of a row in two vectors, one broadcast of x[m, k] per k, so a
// row tile needs no horizontal sum. Each lane's chains go to `lanes`, and the eight lane values
// of an output are finished by the hsum tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), lane-wise
// across vectors: exactly the values and the order of dot_chunk, without a horizontal sum per
// output. wt: the chunk's weights transposed, [kc, 16] (columns past ncols zero).
#if defined(TONP_AVX512)
constexpr int kLaneTileRows = 8;  // the AVX-512 build: a row's sixteen outputs in one zmm, eight rows a tile
#else
constexpr int kLaneTileRows = 4;  // AVX2, portable: a row's sixteen outputs in two vectors, four rows a tile
#endif

// x lane-packed: the row block's x in the order the lane passes read it, made once per row block
// and read by every panel of it. Tile by tile (kLaneTileRows rows, the last tile the rows left;
// tile r's data at xl + r * K), chunk by chunk (at c * MR * kc within the tile), lane by lane, the
// lane's k = l, l + 8, ... in order, the tile's rows innermost. A lane pass then takes its
// broadcasts from one contiguous run rather than from MR strided rows: an exact copy, the same
// operands in the same order (AMD EPYC, lane passes reading x in place against packed, in turn:
// AVX2 on Zen 3 1.1-1.3x at K = 768-4096; the zmm tiles on Zen 4 1.0-1.26x).
// TR: the tile's rows (kLaneTileRows; the AVX-512 table on Intel kLaneTileRowsPair, the two-panel
// tiles' rows): the layout the table's linear_panel reads.
template <int TR>
static void pack_lanes_tiled(const float* x, int64_t ldx, int64_t rows, int64_t kc, int chunks, float* xl) {
  for_row_tiles<TR>(rows, [&](int64_t r0, auto mr) {
    constexpr int MR = decltype(mr)::value;
    float* t = xl + r0 * kc * chunks;
    if (kc % 8 == 0 && MR >= 4) {
      // Eight k's of the tile's rows at a time: an 8 x 8 transpose puts lane l's step (the rows'
      // x[., k0 + l]) in one vector, stored where the scalar order below puts it (chunk c, lane l,
      // step i at c * MR * kc + MR * (l * kc / 8 + i)). The same floats at the same places; on
      // the AMD EPYC (Zen 4), one thread, 256 rows: K = 768 0.074 -> 0.020 ms, K = 2048 0.19 ->
      // 0.066 ms (a 256-row block's pack had cost 1.3 panels of its GEMM); whole fp32 linears
      // with weight groups, 2 threads, against the previous build in one process, 1.00-1.03x
      // (benchmarks/table_ab.py). Tiles of 1-3 rows copy one float at a time, as before:
      // transposing 8 rows for them ran 1.1-2.5x slower.
      const int64_t steps = kc / 8;
      for (int c = 0; c < chunks; ++c, t += MR * kc)
        for (int64_t i = 0; i < steps; ++i) {
          V8 v[8];
          for (int r = 0; r < 8; ++r) v[r] = r < MR ? vload(x + (r0 + r) * ldx + c * kc + 8 * i) : vzero();
          transpose8(v);
          for (int l = 0; l < 8; ++l) {
            float* d = t + MR * (l * steps + i);
            if constexpr (MR == 8) {
              vstore(d, v[l]);
            } else {
              float tmp[8];
              vstore(tmp, v[l]);
              for (int r = 0; r < MR; ++r) d[r] = tmp[r];
            }
          }
        }
      return;
    }
    for (int c = 0; c < chunks; ++c)
      for (int l = 0; l < 8; ++l)
        for (int64_t k = l; k < kc; k += 8)
          for (int r = 0; r < MR; ++r) *t++ = x[(r0 + r) * ldx + c * kc + k];
  });
}
static void pack_lanes(const float* x, int64_t ldx, int64_t rows, int64_t kc, int chunks, float* xl) {
  pack_lanes_tiled<kLaneTileRows>(x, ldx, rows, kc, chunks, xl);
}

// Where a lane tile finds its weights: lane l's step i (k = l + 8 i) at lane(l) + i * step floats
// from the chunk's block. The chunk transposed per task (transpose_chunk, [kc, 16] in k order):
// l * 16, step 128. An fp32 weight group's chunk (kernels.h): lane_group_start, in this build's
// lane order (kGroupLaneRuns): the AVX-512 build's passes take two lanes at once, so its groups
// hold the lanes in pairs, step 32, and a pass reads its pair's run front to back; the AVX2 and
// portable passes take one lane, so theirs hold each lane's steps in one run, step 16 (`ahead`:
// floats ahead of it to prefetch, 0: none). Only addresses differ: each lane meets the same
// weights in the same order.
// The lanes' starts depend on kc alone, so a linear_rows_blocked call computes them once
// (LaneStarts), not every pass of every tile: on the AVX-512 tiles of 1-7 rows, 1.02-1.08x at
// K = 2048 and 1.06-1.15x at K = 768 (AMD EPYC, Zen 4, one thread, hot weights, one process);
// the AVX2 table level (0.97-1.10x).
#if defined(TONP_AVX512)
constexpr bool kGroupLaneRuns = false;
#else
constexpr bool kGroupLaneRuns = true;
#endif
struct LaneStarts {
  static constexpr int64_t gstep = tonp::lane_group_step(kGroupLaneRuns);  // floats between a lane's steps in a group
  int64_t transposed[8], grouped[8];
  explicit LaneStarts(int64_t kc) {
    for (int l = 0; l < 8; ++l) transposed[l] = l * kPanel, grouped[l] = tonp::lane_group_start(kc, l, kGroupLaneRuns);
  }
};
// Lane passes over an fp32 weight group (kernels.h) tile by tile (the AVX-512 build, and the
// AVX2 and portable builds' blocks of more than kStreamBlockRows rows): the prefetch distance, in
// floats, of a row tile of `rows` rows. Full tiles (kLaneTileRows rows) 4 KB ahead: measured on the AMD EPYC (Zen
// 4), 2 threads, 128 cold experts' gate_up (K = 2048), against the weights in place, 8 rows an
// expert 1.16-1.24x with it, 0.88-0.93x without (results/packed_experts.md's first, prototype
// run, in git history). Tiles of 2-7 rows 8 KB ahead: moe_experts fp32, 128 cold experts, top-8
// of random routing, 2 threads, processes with each distance alternated; 64 tokens (about 4 rows
// an expert) 59-61 ms against 67-71 with none on a 60-67 GB/s bus, 74-79 against 83-86 on a
// 35-37 GB/s one (16 KB: 59-64 / 76-79; 32 KB: 58-67 fast; 4 KB about level with none: 67-70 /
// 81); 128 tokens 82-89 against 94-98 (slow bus). One-row tiles 8 KB ahead too: on the Zen 4
// one row (16 tokens: one or two rows an expert) had run level with or without; on an Intel Xeon
// (AMX; 2 threads, 128 cold experts in three layers cycled, top-8 of random routing, a run-time
// switch alternated in one process) 8, 16 and 32 tokens 1.08x, 1.06x, 1.04x (26-27 -> 28 GB/s;
// 4 KB and 16 KB ahead the same).
constexpr int64_t kGroupAhead = 1024, kGroupAheadSmall = 2048;
inline int64_t group_ahead(int64_t rows, int tile_rows = kLaneTileRows) {
  return rows == tile_rows ? kGroupAhead : kGroupAheadSmall;
}

// How a lane tile on an fp32 weight group prefetches (a hint: integer addresses, no arithmetic,
// no bit): at steps phase, phase + every, ... of each pass, the lines `ahead` floats on from the
// step's own two. A chunk that one row tile reads: every step, group_ahead's 4-8 KB on in the
// same run. A chunk that two or more tiles read, where the table spreads (linear_panel_tiled's
// kSpread: the AVX-512 table on Intel): the block the call reads next at the step's offsets
// (the next chunk, or after the last the first chunk of the panels that follow), tile t of T at
// steps t, t + T, ..., so every line of that block is fetched once, evenly over the chunk's
// tiles. With `ahead` alone only a chunk's first tile missed, and the bus sat idle while the
// others computed from cache; on the Intel Xeon (2 threads, cold groups, against ahead alone in
// one process): tk.linear 2048 -> 5120 at 32 / 64 / 128 rows 1.27x / 1.32x / 1.21x, 4096 ->
// 2048 1.22x / 1.27x / 1.13x, the LM head 2048 -> 16384 at 64 / 128 1.31x / 1.18x, 8-16 rows
// 1.01-1.07x; moe_experts fp32 at 8 / 16 rows an expert 1.04x / 1.10x; the fp32 model's
// prefill 1.11-1.21x (its row blocks' weights come from beyond L2 too), decode steps at batch
// 16 / 64 / 128 1.01x / 1.04x / 1.05x. The AMD tables keep `ahead` alone (not measured there).
// The same table's lone tiles of fewer rows than a tile (the experts' decode rows: 1-5 an
// expert) fetch only kGroupAheadNear floats (1 KB) on: a plain read of a cold array on that Xeon,
// 2 threads, ran 32 GB/s with no prefetch, 38 with prefetcht1 1 KB ahead, 37 at 2 KB, 34 at 4 KB,
// 32 at 16 KB. moe_experts fp32 (128 cold experts in three layers cycled, top-8 of random routing,
// 2 threads, distances alternated in one process), against 8 KB: 16 tokens (one row an expert)
// 1.13x (29.5 -> 33.2 GB/s), 64 tokens (four) 1.09x (27.5 -> 29.9); 2 KB 1.08x / 1.06x, 4 KB
// 1.03x / 1.05x, 0.5 KB level with 1 KB; tk.linear at 2 and 4 rows 1.06-1.17x. The two-panel
// tiles' chunks that exactly two tiles read (7-12 rows) fetch the same way from each tile when
// longer than kShortChunk (group_fetch's `pairs`): cold, against the spread, tk.linear at K = 2048
// 1.04-1.11x (N = 1536-16384), moe_experts at 8 and 12 rows an expert 1.035x / 1.026x (6 rows
// 1.01x); on chunks of 96 (K = 768) it ran 0.94-0.97x, and from three tiles on the spread stays
// (1 KB from every tile: 0.96-1.00x at 16 rows, K = 2048).
constexpr int64_t kGroupAheadNear = 256;
struct GroupFetch {
  int64_t ahead, every, phase;
};
// spread: the Intel table's plan (kSpread); pairs: the two-panel tiles (linear_panels2), whose
// chunks of more than kShortChunk that exactly two tiles read take the 1 KB fetch from each tile.
static inline GroupFetch group_fetch(bool spread, bool pairs, int64_t kc, int64_t next, int64_t tiles, int64_t r, int mr,
                                     int tile_rows) {
  if (spread && pairs && tiles == 2 && kc > tonp::kShortChunk) return {kGroupAheadNear, 1, 0};
  if (spread && tiles >= 2) return {next, tiles, r / tile_rows};
  if (spread && mr < tile_rows) return {kGroupAheadNear, 1, 0};
  return {group_ahead(mr, tile_rows), 1, 0};
}
struct LaneWalk {
  const float* w;
  int64_t kc, step, ahead;
  const int64_t* start;  // lane l's first weight at w + start[l]
  int64_t every = 1, phase = 0;  // prefetches at steps phase, phase + every, ... (GroupFetch)
  static LaneWalk transposed(const float* wt, int64_t kc, const LaneStarts& s) { return {wt, kc, 8 * kPanel, 0, s.transposed}; }
  static LaneWalk grouped(const float* g, int64_t kc, GroupFetch f, const LaneStarts& s) {
    return {g, kc, s.gstep, f.ahead, s.grouped, f.every, f.phase};
  }
  const float* lane(int l) const { return w + start[l]; }
};

#if defined(TONP_AVX512)
// The AVX-512 build's lane tile: two lanes' passes at a time (2 x MR independent FMA chains, the
// same operands in the same order), their lane values closed in registers by lanes_tree's adds
// in its order, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): no lane value is stored, only
// the lower half's sums wait in memory while the upper half runs (the registers are the
// accumulators'). Against storing the eight lane vectors and closing them in lanes_tree, on the
// AMD EPYC (Zen 4), one thread, hot weights, the builds alternated: K = 768 (chunks of 96, where
// the closure weighs most) 1.11x at 256 rows, 1.14-1.20x at 32; K = 2048 1.03-1.06x at 64-256.
// The same values (only a NaN's payload, which the contract leaves to the device, may differ).
// Code generation, no arithmetic: the row loops are unrolled by pragma, so GCC keeps every tile's
// accumulators in registers (it had zeroed and spilled the 4-7-row tiles' through the stack in
// every pass, `rep stos` included), and tiles of fewer than 4 rows pin the two weight vectors in
// registers (an empty asm), where GCC had re-read them from memory in each row's FMA. With
// LaneStarts, against the previous build in one process (AMD EPYC, Zen 4, one thread, hot
// weights): K = 2048 at 2 / 3 / 4-7 rows 1.29x / 1.74x / 1.10-1.27x, K = 768 1.29x / 1.53x /
// 1.22-1.52x, 9 and 12 rows 1.04-1.11x, 1, 8, 16 and 64 rows level; every output byte equal.
template <int MR>
static inline void lane_tile_packed(const float* xl, LaneWalk lw, float* part /* [MR, 16] */) {
  const int64_t kc = lw.kc, st = lw.step;
  alignas(64) float low[MR][kPanel];  // (l0 + l1) + (l2 + l3)
  __m512 s01[MR], s45[MR];
  // Lanes a and a + 1 (their k = a, a + 8, ... and a + 1, a + 9, ...; lane a may have one step
  // more): acc_a + acc_b per row, the tree's first level.
  auto pass = [&](int a, __m512* sum) {
    const int64_t na = (kc - a + 7) / 8, nb = (kc - a - 1 + 7) / 8;
    const float* xa = xl;
    const float* xb = xl + na * MR;
    const float* wa_ = lw.lane(a);
    const float* wb_ = lw.lane(a + 1);
    __m512 A[MR], B[MR];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) A[r] = B[r] = _mm512_setzero_ps();
    int64_t i = 0, nf = lw.phase;
    for (; i < nb; ++i, xa += MR, xb += MR) {
      if (lw.ahead && i == nf) {  // a group's run: GroupFetch's lines (integer addresses: a hint never faults)
        nf += lw.every;
        const uintptr_t q = reinterpret_cast<uintptr_t>(wa_) + sizeof(float) * uintptr_t(i * st + lw.ahead);
        prefetch_w(q);
        prefetch_w(q + 64);
      }
      __m512 wa = _mm512_loadu_ps(wa_ + i * st), wb = _mm512_loadu_ps(wb_ + i * st);
      if constexpr (MR < 4) __asm__("" : "+v"(wa), "+v"(wb));
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        A[r] = _mm512_fmadd_ps(_mm512_set1_ps(xa[r]), wa, A[r]);
        B[r] = _mm512_fmadd_ps(_mm512_set1_ps(xb[r]), wb, B[r]);
      }
    }
    if (i < na) {
      const __m512 wa = _mm512_loadu_ps(wa_ + i * st);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) A[r] = _mm512_fmadd_ps(_mm512_set1_ps(xa[r]), wa, A[r]);
    }
    xl += (na + nb) * MR;
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) sum[r] = _mm512_add_ps(A[r], B[r]);
  };
  pass(0, s01);
  {
    __m512 s23[MR];
    pass(2, s23);
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) _mm512_store_ps(low[r], _mm512_add_ps(s01[r], s23[r]));
  }
  pass(4, s45);
  __m512 s67[MR];
  pass(6, s67);
  _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r)
    _mm512_storeu_ps(part + r * kPanel, _mm512_add_ps(_mm512_load_ps(low[r]), _mm512_add_ps(s45[r], s67[r])));
}

// The two-panel lane tile (the AVX-512 table on Intel, kLaneTileRowsPair rows): lane_tile_packed's
// passes on two adjacent panels at once, lanes a and a + 1 of both (4 x MR chains), so each of
// x's broadcasts feeds two FMAs: per step 4 weight loads and 2 MR broadcasts for 4 MR FMAs, where
// the one-panel tile's 8 rows take 2 and 16 for 16. Every chain, lane value and tree is the one
// panel's: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), the pair sums closed in registers, the
// halves waiting in memory (the accumulators take the registers). w0, w1: the panels' walks (the
// same kc, step and lane starts).
template <int MR>
static inline void lane_tile2_packed(const float* xl, LaneWalk w0, LaneWalk w1, float* part0, float* part1) {
  const int64_t kc = w0.kc, st = w0.step;
  alignas(64) float low[2][MR][kPanel], high[2][MR][kPanel];
  // Lanes a and a + 1 on both panels; the tree's first level (acc_a + acc_b per row and panel),
  // then `close`: 0 stores it to dst, 1 adds it to dst, 2 stores dst + (high + it) to the parts.
  auto pass = [&](int a, float (*dst)[MR][kPanel], int close) {
    const int64_t na = (kc - a + 7) / 8, nb = (kc - a - 1 + 7) / 8;
    const float* xa = xl;
    const float* xb = xl + na * MR;
    const float* wa0 = w0.lane(a);
    const float* wb0 = w0.lane(a + 1);
    const float* wa1 = w1.lane(a);
    const float* wb1 = w1.lane(a + 1);
    __m512 A0[MR], B0[MR], A1[MR], B1[MR];
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) A0[r] = B0[r] = A1[r] = B1[r] = _mm512_setzero_ps();
    int64_t i = 0, nf = w0.phase;
    for (; i < nb; ++i, xa += MR, xb += MR) {
      if (w0.ahead && i == nf) {  // groups: both panels' GroupFetch lines (integer addresses: a hint never faults)
        nf += w0.every;
        const uintptr_t q0 = reinterpret_cast<uintptr_t>(wa0) + sizeof(float) * uintptr_t(i * st + w0.ahead);
        const uintptr_t q1 = reinterpret_cast<uintptr_t>(wa1) + sizeof(float) * uintptr_t(i * st + w1.ahead);
        prefetch_w(q0);
        prefetch_w(q0 + 64);
        prefetch_w(q1);
        prefetch_w(q1 + 64);
      }
      __m512 va0 = _mm512_loadu_ps(wa0 + i * st), vb0 = _mm512_loadu_ps(wb0 + i * st);
      __m512 va1 = _mm512_loadu_ps(wa1 + i * st), vb1 = _mm512_loadu_ps(wb1 + i * st);
      if constexpr (MR < 4) __asm__("" : "+v"(va0), "+v"(vb0), "+v"(va1), "+v"(vb1));
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const __m512 xr = _mm512_set1_ps(xa[r]), yr = _mm512_set1_ps(xb[r]);
        A0[r] = _mm512_fmadd_ps(xr, va0, A0[r]);
        A1[r] = _mm512_fmadd_ps(xr, va1, A1[r]);
        B0[r] = _mm512_fmadd_ps(yr, vb0, B0[r]);
        B1[r] = _mm512_fmadd_ps(yr, vb1, B1[r]);
      }
    }
    if (i < na) {
      const __m512 va0 = _mm512_loadu_ps(wa0 + i * st), va1 = _mm512_loadu_ps(wa1 + i * st);
      _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
        const __m512 xr = _mm512_set1_ps(xa[r]);
        A0[r] = _mm512_fmadd_ps(xr, va0, A0[r]);
        A1[r] = _mm512_fmadd_ps(xr, va1, A1[r]);
      }
    }
    xl += (na + nb) * MR;
    _Pragma("GCC unroll 8") for (int r = 0; r < MR; ++r) {
      const __m512 s0 = _mm512_add_ps(A0[r], B0[r]), s1 = _mm512_add_ps(A1[r], B1[r]);
      if (close == 0) {
        _mm512_store_ps(dst[0][r], s0);
        _mm512_store_ps(dst[1][r], s1);
      } else if (close == 1) {
        _mm512_store_ps(dst[0][r], _mm512_add_ps(_mm512_load_ps(dst[0][r]), s0));
        _mm512_store_ps(dst[1][r], _mm512_add_ps(_mm512_load_ps(dst[1][r]), s1));
      } else {
        _mm512_storeu_ps(part0 + r * kPanel,
                         _mm512_add_ps(_mm512_load_ps(low[0][r]), _mm512_add_ps(_mm512_load_ps(high[0][r]), s0)));
        _mm512_storeu_ps(part1 + r * kPanel,
                         _mm512_add_ps(_mm512_load_ps(low[1][r]), _mm512_add_ps(_mm512_load_ps(high[1][r]), s1)));
      }
    }
  };
  pass(0, low, 0);   // l0 + l1
  pass(2, low, 1);   // (l0 + l1) + (l2 + l3)
  pass(4, high, 0);  // l4 + l5
  pass(6, high, 2);  // low + ((l4 + l5) + (l6 + l7))
}
#else
// One lane's pass of an MR-row tile (the AVX2 and portable builds): its n steps, x at xl (MR
// floats a step), weights at wl (`step` floats apart), the MR x 16 lane values stored to `lane`.
// kFetch: the pass also prefetches `fetch_lines` cache lines from `fetch` on, one a step (a hint:
// integer addresses, no arithmetic).
template <int MR, bool kFetch = false>
static inline void lane_pass(const float* xl, const float* wl, int64_t n, int64_t step, float* lane,
                             uintptr_t fetch = 0, int64_t fetch_lines = 0) {
  V8 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = vzero();
  auto steps = [&](int64_t i, int64_t end, auto fetching) {
    for (; i < end; ++i, xl += MR, wl += step) {
      if constexpr (decltype(fetching)::value)
        __builtin_prefetch(reinterpret_cast<const void*>(fetch + 64 * uintptr_t(i)), 0, 1);
      const V8 w0 = vload(wl), w1 = vload(wl + 8);
      for (int r = 0; r < MR; ++r) {
        const V8 xb = vset1(xl[r]);
        acc[r][0] = vfma(xb, w0, acc[r][0]);
        acc[r][1] = vfma(xb, w1, acc[r][1]);
      }
    }
  };
  const int64_t fetched = kFetch ? std::min(n, fetch_lines) : 0;  // the first steps prefetch, the rest do not
  steps(int64_t(0), fetched, std::bool_constant<kFetch>());
  steps(fetched, n, std::false_type());
  for (int r = 0; r < MR; ++r) {
    vstore(lane + r * kPanel, acc[r][0]);
    vstore(lane + r * kPanel + 8, acc[r][1]);
  }
}

// The lane tile of the AVX2 and portable builds: xl = the tile's chunk (its lanes one after another).
template <int MR>
static inline void lane_tile_packed(const float* xl, LaneWalk lw, float* part /* [MR, 16] */) {
  float lanes[8][MR * kPanel];
  for (int l = 0; l < 8; ++l) {
    const int64_t n = tonp::lane_steps(lw.kc, l);
    lane_pass<MR>(xl, lw.lane(l), n, lw.step, lanes[l]);
    xl += n * MR;
  }
  lanes_tree(&lanes[0][0], MR * kPanel, MR * kPanel, part);
}
#endif

// wt[k, n] = W[n, k] for the panel's ncols <= 16 weight rows and k < kc (columns past ncols
// zero), widened to fp32: an exact copy, eight by eight through transpose8.
template <typename T>
static inline void transpose_chunk(const T* W, int64_t ldw, int ncols, int64_t kc, float* wt) {
  const int64_t k8 = kc / 8 * 8;
  for (int n0 = 0; n0 < kPanel; n0 += 8) {
    for (int64_t k = 0; k < k8; k += 8) {
      V8 r[8];
      for (int i = 0; i < 8; ++i) r[i] = n0 + i < ncols ? vload(W + (n0 + i) * ldw + k) : vzero();
      transpose8(r);
      for (int i = 0; i < 8; ++i) vstore(wt + (k + i) * kPanel + n0, r[i]);
    }
    for (int64_t k = k8; k < kc; ++k)
      for (int i = 0; i < 8; ++i) wt[k * kPanel + n0 + i] = n0 + i < ncols ? to_f32(W[(n0 + i) * ldw + k]) : 0.f;
  }
}

#if !defined(TONP_AVX512)
#include "linear_streamed.h"  // the AVX2 and portable builds' streamed blocks: StreamPlan, linear_panels_streamed2
#endif

// Chunk c of np adjacent panels of W in place (the last with ncols columns) transposed, panel p's
// to wt + p * kc * 16; then the next chunk's weights (after the last chunk, the first of the
// panels that follow) fetched while this one is computed: the transpose reads them in a pass of
// its own, with no arithmetic to hide a miss. A hint only: the addresses are integers (past the
// last panel they may lie outside W; a prefetch never faults, and no out-of-range pointer is
// formed).
template <typename T>
static void transpose_chunk_ahead(const T* W, int64_t ldw, int np, int ncols, int64_t kc, int c, int chunks, float* wt) {
  constexpr int64_t kLine = 64 / int64_t(sizeof(T));
  for (int p = 0; p < np; ++p)
    transpose_chunk(W + p * kPanel * ldw + c * kc, ldw, p + 1 < np ? kPanel : ncols, kc, wt + p * kc * kPanel);
  const uintptr_t next = reinterpret_cast<uintptr_t>(W) + sizeof(T) * (c + 1 < chunks ? (c + 1) * kc : np * kPanel * ldw);
  for (int n = 0; n < np * kPanel; ++n)
    for (int64_t k = 0; k < kc; k += kLine)
      prefetch_w(next + sizeof(T) * uintptr_t(n * ldw + k));
}

// Lane passes: chunk by chunk, the chunk's weights transposed once (16 x kc, in L1) for every
// row tile of the block, or read from the panel's fp32 weight group wg (non-null: already in the
// lane tiles' order, nothing transposed); the partials of each (row, column, chunk) are the
// values dot_tile computes, finished by the same chunk tree: only the loop order differs from
// the dot products. xl: x lane-packed (pack_lanes).
template <int TR, bool kSpread, typename T>
static void linear_rows_blocked(const float* x, int64_t ldx, const float* xl, int64_t rows, const T* W, int64_t ldw,
                                int64_t kc, int chunks, int ncols, float* pbuf /* [chunks, rows, 16] */,
                                float* wt /* [kc, 16] */, const float* wg, const float* bias, void* out, int64_t ldo,
                                Elem oelem) {
  const int64_t cstride = rows * kPanel, tiles = (rows + TR - 1) / TR, osz = oelem == Elem::F32 ? 4 : 2;
  const LaneStarts starts(kc);
#if !defined(TONP_AVX512)
  const StreamPlan streamed(wg, kc, rows);
  const bool by_tile = kc > 8 && !streamed.on;
#else
  const bool by_tile = kc > 8;
#endif
  // by_tile: the row tiles' passes (not the one-step chunks' or the streamed blocks'): each tile's
  // rows are finished right after its last chunk (finish_rows_at), their partials still near.
  for (int c = 0; c < chunks; ++c) {
    const float* xc = x + c * kc;
    float* pc = pbuf + c * cstride;
    const float* blk = wg ? wg + c * kc * kPanel : wt;  // the chunk's weights as the lane tiles read them
    if (!wg) transpose_chunk_ahead(W, ldw, 1, ncols, kc, c, chunks, wt);
    if (kc <= 8) {  // one product per lane: the eight lanes at once, their tree in registers (a
      for (int64_t r = 0; r < rows; ++r)  // group's chunk of at most 8 is in k order, as wt)
        for (int n0 = 0; n0 < kPanel; n0 += 8) {
          V8 p[8];
          for (int l = 0; l < 8; ++l) p[l] = l < kc ? vfma(vset1(xc[r * ldx + l]), vload(blk + l * kPanel + n0), vzero()) : vzero();
          vstore(pc + r * kPanel + n0, vadd(vadd(vadd(p[0], p[1]), vadd(p[2], p[3])), vadd(vadd(p[4], p[5]), vadd(p[6], p[7]))));
        }
      continue;
    }
#if !defined(TONP_AVX512)
    if (streamed.on) {
      const float* const b1[1] = {blk};
      float* const p1[1] = {pc};
      lane_block_streamed<1>(streamed, xl, rows, kc, chunks, c, b1, starts, p1);
      continue;
    }
#endif
    const bool last = by_tile && c + 1 == chunks;
    for_row_tiles<TR>(rows, [&](int64_t r, auto mr) {
      // a panel's chunks, then the next panel's, follow one another in the groups
      const GroupFetch f = group_fetch(kSpread, false, kc, kc * kPanel, tiles, r, mr(), TR);
      const LaneWalk lw = wg ? LaneWalk::grouped(blk, kc, f, starts) : LaneWalk::transposed(blk, kc, starts);
      if (last) prefetch_out_rows(static_cast<char*>(out) + r * ldo * osz, mr(), ldo * osz, ncols * osz);
      lane_tile_packed<mr()>(xl + r * kc * chunks + c * mr() * kc, lw, pc + r * kPanel);
      if (last)
        finish_rows_at(pbuf + r * kPanel, cstride, mr(), chunks, ncols, bias, static_cast<char*>(out) + r * ldo * osz, ldo,
                       oelem);
    });
  }
  if (!by_tile) finish_rows(pbuf, rows, chunks, ncols, bias, out, ldo, oelem);
}

#if defined(TONP_AVX512)
// The two-panel tiles' rows (lane_tile2_packed: 24 accumulators), x lane-packed in tiles of them.
constexpr int kLaneTileRowsPair = tonp::kPairTileRows;
// Two adjacent whole panels of fp32 weights by lane passes (the AVX-512 table on Intel): W in
// place, each chunk of both transposed once for every row tile, or their groups (wg: the first
// panel's; the second's follows it, K * 16 floats on), chunk by chunk, every row tile of TR rows
// on both panels at once (lane_tile2_packed). The same passes, lane values and trees as a call
// per panel (linear_rows_blocked): only which outputs share a tile differs. pbuf: [2][chunks,
// rows, 16]; wt: [2][kc, 16] (W in place).
template <int TR>
static void linear_panels2(const float* xl, int64_t rows, const float* W, int64_t ldw, int64_t kc, int chunks,
                           float* pbuf, float* wt, const float* wg, const float* bias, void* out, int64_t ldo,
                           Elem oelem) {
  const int64_t cstride = rows * kPanel, gsz = kc * chunks * kPanel;
  const LaneStarts starts(kc);
  float* const pb[2] = {pbuf, pbuf + chunks * cstride};
  const int64_t tiles = (rows + TR - 1) / TR;
  const int64_t osz = oelem == Elem::F32 ? 4 : 2;
  for (int c = 0; c < chunks; ++c) {
    if (!wg) transpose_chunk_ahead(W, ldw, 2, kPanel, kc, c, chunks, wt);
    const float* b0 = wg ? wg + c * kc * kPanel : wt;
    const float* b1 = wg ? wg + gsz + c * kc * kPanel : wt + kc * kPanel;
    const int64_t next = c + 1 < chunks ? kc * kPanel : 2 * gsz - c * kc * kPanel;  // after the last: the next two panels'
    const bool last = c + 1 == chunks;  // each tile's rows finished after its last chunk
    for_row_tiles<TR>(rows, [&](int64_t r, auto mr) {
      const GroupFetch f = group_fetch(true, true, kc, next, tiles, r, mr(), TR);
      const LaneWalk w0 = wg ? LaneWalk::grouped(b0, kc, f, starts) : LaneWalk::transposed(b0, kc, starts);
      const LaneWalk w1 = wg ? LaneWalk::grouped(b1, kc, f, starts) : LaneWalk::transposed(b1, kc, starts);
      if (last) prefetch_out_rows(static_cast<char*>(out) + r * ldo * osz, mr(), ldo * osz, 2 * kPanel * osz);
      lane_tile2_packed<mr()>(xl + r * kc * chunks + c * mr() * kc, w0, w1, pb[0] + c * cstride + r * kPanel,
                              pb[1] + c * cstride + r * kPanel);
      if (last)
        for (int p = 0; p < 2; ++p)
          finish_rows_at(pb[p] + r * kPanel, cstride, mr(), chunks, kPanel, bias ? bias + p * kPanel : nullptr,
                         static_cast<char*>(out) + (r * ldo + p * kPanel) * osz, ldo, oelem);
    });
  }
}
#endif
