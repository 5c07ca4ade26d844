// The AVX2 and portable builds' streamed lane passes over fp32 weight groups (blocks of up to
// kStreamBlockRows rows; one panel, or two side by side): included by linear_lanes.h, inside the
// ISA's namespace, after the lane tiles (lane_pass, lanes_tree), store_rows and finish_panels,
// and before linear_rows_blocked, which streams its blocks through lane_block_streamed. The same
// passes, lane values and trees as lane_tile_packed: only their order differs.

// A chunk of an fp32 weight group streamed by a block of rows (the AVX2 and portable builds, blocks
// of up to kStreamBlockRows rows): kStreamRows rows at a time, lane by lane, every row tile of those
// rows on the lane's run while it is in L1 (the run comes from memory once, in eight short waits,
// not once per tile), and all the block's passes share the prefetch of the chunk after this one
// (the group is one stream, panel after panel, expert after expert), each pass its own lines, one
// a step, into L2. The same passes as lane_tile_packed, in another order: every lane value and
// the tree over them are unchanged.
// Blocks of 17-128 rows (the dense linears at a decode batch of 32-128, an expert's
// rows in prefill) had run tile after tile, each tile prefetching 4 KB ahead, so the first tile
// of each chunk waited on memory while the others computed. Streamed in 16-row steps with the
// shared fetch, against that build (Zen 3, 2 threads, in one process, every output byte equal):
// whole linears at 64 rows with cold weights (K = 2048 and 4096, N = 2048-16384) 1.09-1.13x;
// 128 cold experts of exactly 24 rows 1.11-1.34x, 48 rows 0.98-1.30x, 128 rows 0.97-1.52x; a
// single weight warm in L3, 64 x 768 x 2048, 0.96x; hot in L2, one thread, 64 rows 0.97-0.99x at
// K = 2048 and 0.87-0.93x at K = 768. 256-row blocks stay tile by tile (kStreamBlockRows, below).
// Measured on the AVX2-only AMD EPYC (Zen 3), 2 threads, cold weights, in one process,
// alternated, every output byte equal. Against the build before (7e1a7c6: tile after tile, no
// prefetch; benchmarks/table_ab.py): the experts' decode stages, Poisson rows an expert, mean 4
// 1.08-1.11x, mean 8 1.24-1.29x, mean 1 level (1-3 rows read W in place); linear on its groups
// at 8-16 rows (N = 4096 and 16384, K = 2048) 1.30-1.44x. 128 experts of R rows each, on the way:
// each tile prefetching 4 KB ahead in its even lanes (the AVX-512 tile's way) 1.08-1.10x at R = 4
// and 8; the lanes interleaved over the tiles besides 1.03x / 1.11-1.14x / 1.08-1.15x at R = 4 /
// 8 / 12; the prefetch shared out as here besides 1.00-1.04x / 1.16-1.22x / 1.20-1.22x. A second,
// farther prefetch into L2 was slower (0.85-0.92x), and so were the AVX2 lane tiles of more rows
// with the 4 KB prefetch (whole linears of 64-128 rows 0.96-0.97x: they compute more than they
// wait). The cost: hot, one thread on four panels in L2, 5-16 rows run 0.77-0.93x at K = 768 and
// 0.90-0.98x at K = 2048, 4 rows 0.90-0.95x (short passes; the per-pass work weighs more when no
// wait hides it; inlined into linear_rows_blocked, 5-6 rows ran 0.64-0.68x). A real model's
// decode never reads them hot (one 30B-A3B expert is 19 MB in fp32).
constexpr int64_t kStreamRows = 16;
// Blocks of up to 128 rows stream; prefill's 256-row blocks compute more than they wait and ran
// tile by tile 1.02-1.10x as fast as streamed (4096 x 2048 x 4096 and x 512, 256 x 2048 x 1536,
// 256 x 768 x 2048, weights warm in L3 or re-read by 16 blocks; the 64-row LM head 1.06x streamed).
constexpr int64_t kStreamBlockRows = 128;
// What lane_block_streamed needs of a block's shape, worked out once per linear_rows_blocked call
// (kc and the rows are fixed across its panels and chunks; a few dozen integers): per lane its
// steps and where its x starts in a tile's chunk (pack_lanes: the lanes one after another); the
// block's row tiles; each pass's share of the next chunk's kc lines (64 bytes hold a k's sixteen
// weights), the passes numbered in the order they run.
struct StreamPlan {
  int64_t steps[8], xoff[8];
  int64_t tiles = 0, share = 0, kc = 0;
  bool on = false;  // the block is streamed (a group, at most kStreamBlockRows rows, chunks over one lane step)
  StreamPlan(const float* wg, int64_t kc_, int64_t rows) : kc(kc_) {
    if (!wg || rows > kStreamBlockRows || kc <= 8) return;
    on = true;
    for (int l = 0; l < 8; ++l) steps[l] = tonp::lane_steps(kc, l), xoff[l] = l ? xoff[l - 1] + steps[l - 1] : 0;
    for_row_tiles<kLaneTileRows>(rows, [&](int64_t, auto) { ++tiles; });
    share = (kc + 8 * tiles - 1) / (8 * tiles);
  }
  // Pass q's lines of the next chunk: the first, and how many (none past kc).
  int64_t first(int64_t q) const { return q * share; }
  int64_t lines(int64_t q) const { return std::max<int64_t>(0, std::min(share, kc - q * share)); }
};
// One sub-block of at most kStreamRows rows (its first tile the block's tile g0; xl at its first
// row's lane-packed x; pc[p] at its first row's sums in panel p), on NP panels' groups side by
// side: each lane's passes over panel 0, then panel 1 (two streams a pass apart).
template <int NP>
static void lane_sub_block(const StreamPlan& plan, const float* xl, int64_t rows, int64_t kc, int chunks, int c,
                           const float* const* blk, const uintptr_t* next, const LaneStarts& starts, int64_t g0,
                           float* const* pc) {
  int64_t tiles = 0;
  for_row_tiles<kLaneTileRows>(rows, [&](int64_t, auto) { ++tiles; });
  if (tiles == 1) {  // one tile (4 rows or fewer): lane_tile_packed's loop, prefetching (hot at
    // K = 768 against the build before: the general loop below 0.84-0.86x, this one 0.94-0.95x; cold level)
    for_row_tiles<kLaneTileRows>(rows, [&](int64_t, auto mr) {
      constexpr int MR = decltype(mr)::value;
      float lanes[NP][8][MR * kPanel];
      const float* x = xl + c * MR * kc;
      for (int l = 0; l < 8; ++l) {
        const int64_t q = 8 * g0 + l;
        for (int p = 0; p < NP; ++p)
          lane_pass<MR, true>(x, blk[p] + starts.grouped[l], plan.steps[l], starts.gstep, lanes[p][l],
                              next[p] + 64 * uintptr_t(plan.first(q)), plan.lines(q));
        x += plan.steps[l] * MR;
      }
      for (int p = 0; p < NP; ++p) lanes_tree(&lanes[p][0][0], MR * kPanel, MR * kPanel, pc[p]);
    });
    return;
  }
  alignas(32) float lanes[NP][kStreamRows * 8 * kPanel];  // tile at row r: lane l's values at (8 r + l MR) * 16
  for (int l = 0; l < 8; ++l)
    for (int p = 0; p < NP; ++p) {
      int64_t t = 0;
      for_row_tiles<kLaneTileRows>(rows, [&](int64_t r, auto mr) {
        constexpr int MR = decltype(mr)::value;
        const int64_t q = 8 * g0 + l * tiles + t;
        lane_pass<MR, true>(xl + r * kc * chunks + (c * kc + plan.xoff[l]) * MR, blk[p] + starts.grouped[l],
                            plan.steps[l], starts.gstep, lanes[p] + (8 * r + l * MR) * kPanel,
                            next[p] + 64 * uintptr_t(plan.first(q)), plan.lines(q));
        ++t;
      });
    }
  for (int p = 0; p < NP; ++p)
    for_row_tiles<kLaneTileRows>(rows, [&](int64_t r, auto mr) {
      lanes_tree(lanes[p] + 8 * r * kPanel, mr() * kPanel, mr() * kPanel, pc[p] + r * kPanel);
    });
}
// A block's chunk c on NP panels' groups (blk[p]: panel p's chunk c; pc[p]: its sums [rows, 16]):
// its rows kStreamRows at a time (whole tiles: kStreamRows is a multiple of kLaneTileRows), each
// panel's next chunk's lines shared out over every pass of the block on that panel.
template <int NP>
static void lane_block_streamed(const StreamPlan& plan, const float* xl, int64_t rows, int64_t kc, int chunks, int c,
                                const float* const* blk, const LaneStarts& starts, float* const* pc) {
  uintptr_t next[NP];
  for (int p = 0; p < NP; ++p)
    next[p] = reinterpret_cast<uintptr_t>(blk[p]) + sizeof(float) * uintptr_t(kc * kPanel);  // the next chunk
  for (int64_t r0 = 0; r0 < rows; r0 += kStreamRows) {
    float* q[NP];
    for (int p = 0; p < NP; ++p) q[p] = pc[p] + r0 * kPanel;
    lane_sub_block<NP>(plan, xl + r0 * kc * chunks, std::min(kStreamRows, rows - r0), kc, chunks, c, blk, next, starts,
                       r0 / kLaneTileRows, q);
  }
}

// Two adjacent whole panels on their fp32 groups (wg: the first's; the second's follows it, K *
// kPanel floats on), a block of rows the plan streams: chunk by chunk, each lane's passes on the
// first panel's run and then on the second's (lane_block_streamed<2>), so the thread reads two
// streams a panel apart, alternating every pass, where a panel at a time it reads one. The same
// passes, lane values and trees as a call per panel (linear_rows_blocked): only their order
// differs. pbuf: [2][chunks, rows, 16].
// Measured on the AVX2-only AMD EPYC (Zen 3), 2 threads, cold weights, in one process,
// alternated, every output byte equal. moe_experts fp32 at 30B-A3B shapes, 128 experts, a build
// switching at run time: against a panel at a time, exactly 4 rows an expert 1.17-1.18x, 8 rows
// 1.12x, 5 rows 1.01x, 6 rows 0.96x, 64 tokens routed at random 1.02x; with the lane runs
// (kernels.h) together, against the lane pairs a panel at a time, 4 rows 1.23x, 8 rows 1.19x,
// 64 tokens 1.03x (vLLM's cpu_fused_moe beside them, which reads two streams a thread: tonp /
// vLLM 0.78 -> 0.97 at 4 rows, 0.91 -> 0.94 at 64 tokens). benchmarks/table_ab.py's experts
// mode, against a panel at a time: 4 / 5 / 6 / 8 / 12 rows an expert 1.03x / 1.14x / 1.06x /
// 1.13x / 1.03x, Poisson means 4 and 8 1.04x / 1.07x; a whole 8 x 2048 x 4096 linear 1.16x.
// Plain reads there ran 1.1-1.3x as fast as two streams a thread as one.
// Blocks of more rows run their panels one at a time: side by side, the two panels' chunks (32 KB
// at K = 2048) no longer stay in L1 for a block's later tiles and 16-row steps (against a panel at
// a time, same machine: 16 rows an expert 0.98x, whole linears of 16-128 rows 0.90-1.01x).
constexpr int64_t kTwoPanelRows = 12;
static void linear_panels_streamed2(const StreamPlan& plan, const float* xl, int64_t rows, int64_t kc, int chunks,
                                    float* pbuf, const float* wg, const float* bias, void* out, int64_t ldo, Elem oelem) {
  const int64_t cstride = rows * kPanel, gsz = kc * chunks * kPanel;
  const LaneStarts starts(kc);
  float* const pb[2] = {pbuf, pbuf + chunks * cstride};
  for (int c = 0; c < chunks; ++c) {
    const float* const blk[2] = {wg + c * kc * kPanel, wg + gsz + c * kc * kPanel};
    float* const pc[2] = {pb[0] + c * cstride, pb[1] + c * cstride};
    lane_block_streamed<2>(plan, xl, rows, kc, chunks, c, blk, starts, pc);
  }
  finish_panels(pb, 2, rows, chunks, bias, out, ldo, oelem);
}
