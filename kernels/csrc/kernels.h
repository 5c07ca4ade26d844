// The per-ISA kernel table. ops.cpp and moe_ops.cpp (the torch-facing side: checks, allocation,
// threading) call these through `K()` (ops_common.h); isa_avx2.cpp and isa_portable.cpp each fill
// one table from the same source (kernels_impl.h, bf16dot.h), so both give identical bits;
// isa_avx512bf16.cpp is the AVX2 table with the bf16 x bf16 linear on vdpbf16ps and the fp32
// linear's lane passes on zmm (same bits).
//
// Threading never splits a reduction: every function below computes complete outputs (rows,
// panels of output columns, (query, head) pairs) and ops.cpp only distributes those.
#pragma once
#include <cstdint>

namespace tonp {

constexpr int kPanel = 16;  // output columns per weight panel (one micro tile wide)
constexpr int kRowBlock = 96;  // rows per fp32 linear task in the portable build; the bf16 pair chains' row block
constexpr int kRowBlockF32 = 256;  // the same for fp32 arithmetic in the AVX2 and AVX-512 builds (Kernels::row_block_f32)
constexpr int kMaxChunks = 64;  // the most reduction chunks C a linear may use
constexpr int kLaneRows = 8;  // fp32-weight linear tasks of this many rows or more run lane passes
// The same in the AVX-512 build (4-row dot tiles in its 32 registers): 32. Measured cold on the
// AMD EPYC (Zen 4; the panel harness now in benchmarks/stream.py; gate_up [1536, 2048], down
// [2048, 768]): the dot tiles ran about 1.0-1.7x the lane passes at 10-32 rows, level or
// slower at 48 (docs/history/performance-decode.md).
constexpr int kLaneRowsZmm = 32;
// The row count from which tk.linear reads an fp32 weight group on the AVX-512 table, where the CPU
// is not an AMD Zen 5 (Kernels::linear_group_rows_f32): on the AMD EPYC (Zen 4), 2 threads, cold
// weights, N = 4096 and 16384, K = 2048, lane passes on the groups against the dot tiles in place
// ran 0.88-1.08x at 2-16 rows and 1.04-1.16x at 20-31 (64 rows 1.17-1.24x, 128 1.11x, 256 1.08x,
// 2048 1.05x). On the AMD EPYC Zen 5 (family 26), the same comparison: 1.17-1.20x at one row,
// 1.22-1.49x at 2-8, 1.47-1.74x at 12-28 (N = 2048-16384; the dot tiles' 4 x 4 tiles reach 94
// GFLOP/s a core hot there, the lane tiles 155-172), so its table reads them at every row count.
constexpr int kLinearGroupRowsZmm = 20;
// The same on an Intel CPU (GenuineIntel; the AVX-512 table runs only where AVX512-BF16 is:
// Cooper Lake, Sapphire Rapids and later). Measured on an Intel Xeon with AMX (family 6, model
// 167 as its VM reports it), 2 threads, cold weights (1.2 GB cycled), K = 2048 and 4096, N =
// 2048-16384, a run-time switch alternated in one process, every output equal: lane passes on
// the groups against the dot tiles in place 0.89-0.94x at one row, 1.15-1.26x at 2, 0.97-1.14x
// at 3, 0.77-1.06x at 4 (both at the bus's 24 GB/s there), 1.11-1.22x at 5-6, 1.23-1.32x at 8,
// 1.30-1.49x at 12-19 (the dot tiles 74-111 GFLOP/s, the lane tiles 110-161). Since a lone
// tile's fetch runs 1 KB on there (linear_lanes.h, kGroupAheadNear), one row too: the same
// comparison, 1.16-1.20x at K = 2048 (N = 5120 and 16384; 28-29 -> 33-34 GB/s), level at K = 4096
// (0.99x, N = 2048: its one-panel tiles), 0.94x on the 128-column router (a 1 MB weight).
constexpr int kLinearGroupRowsIntel = 1;
// The bytes of lane-packed x a row block on fp32 weight groups may take on Intel
// (Kernels::group_block_bytes_f32; elsewhere no cap): a quarter of its 2 MB L2, so that the x
// every panel of the block re-reads stays there (256 rows at K = 2048 had filled it). Same Xeon,
// whole fp32 linears on their groups, 2 threads, alternated in one process, every output equal.
// Fixed row blocks against 256 rows, M = 512-2048: at K = 2048 (N = 1536, 4096) 64 rows
// 1.14-1.26x, 128 rows 1.06-1.19x, 32 rows 1.13-1.18x; at K = 4096 32 and 64 rows 1.17-1.24x,
// 128 rows 1.01-1.05x; at K = 768 every block 0.96-1.03x. This cap against none (group_row_block),
// M = 192-2048: K = 2048 1.10-1.27x, K = 4096 1.17-1.31x, K = 768 1.00-1.08x; the 16384-column LM
// head 0.96-0.99x (its 128 MB weight read once more per block).
constexpr int64_t kGroupBlockBytesIntel = 512 << 10;
// The rows from which tk.linear on Intel packs the groups of an fp32 weight given without them
// (Kernels::linear_pack_rows_f32; elsewhere never), when group_row_block would cut its row blocks
// to half of row_block_f32 or less (K >= 2048 there): the 512 KB blocks then cost no transpose
// per block. Same Xeon, 2 threads, alternated in one process, every output equal, against the
// weight in place: K = 2048 (N = 512-4096) 1.07-1.14x at 512 rows, 1.16-1.27x at 2048; K = 4096
// 1.09x / 1.26x; the 16384-column LM head 0.98x / 1.06x; 128 rows 0.67-0.75x and 256 rows
// 0.88-1.07x (the pack, a pass over the weight, weighs more); K = 768, where the blocks are not
// cut, 0.85-0.97x at 256-2048 rows, so it is not packed. Nor where the two-panel tiles run
// (pair_tiles: chunks of at most kPairTileMaxKc, K = 2048 with 8 chunks): in place on two panels,
// packing in the call ran 0.84x / 0.98x at 512 / 2048 rows (N = 4096), 0.92x / 1.02x (N = 1536),
// 0.97x (512 x 2048 x 512); at K = 4096, on one-panel tiles, still 1.08x / 1.24x.
constexpr int kLinearPackRowsIntel = 512;
// Whole panels a call running fp32 lane passes takes on Intel, on groups or in place
// (Kernels::group_panels_f32, lane_panels_f32; elsewhere 1, the AVX2 table's groups 2): the
// AVX-512 build's two-panel tiles of kPairTileRows rows, 24 accumulators, each broadcast of x
// feeding two FMAs (per step 4 weight loads and 12 broadcasts for 24 FMAs; a panel at a time, 8
// rows: 2 and 16 for 16, bound by the loads). On the Intel Xeon (family 6, model 167), 2 threads,
// against a panel at a time in one process, alternated call by call, medians of 30-40 pairs,
// every output byte equal: tk.linear fp32 256 x 2048 x 1536 in place 1.13-1.23x, 512 x 768 x 2048
// 1.02-1.03x, 2048 x 768 x 2048 1.01-1.02x, 512 x 2048 x 4096 1.02-1.03x, 2048 x 2048 x 1536
// (packed in the call) 1.01-1.03x, on groups 64-128 rows 1.03-1.05x, 2-16 rows 0.94-1.09x
// (cold, noisy); moe_experts fp32 (128 experts of 30B-A3B, top-8) at 1, 4, 8, 32 and 256 rows an
// expert 1.03x, 1.05x, 1.05x, 1.04x, 1.06x; the fp32 decode of the 2-layer 30B-A3B-shaped model
// (64-token prompts, 32 new tokens) at batch 16 level (its decode steps 1.06x), 64 1.04x, 128
// 1.04x. In L1 alone the tile ran 1.05-1.09x the 8-row one (132 / 156 GFLOP/s against 126 / 146
// on one thread, chunks of 96 / 256).
constexpr int kLanePanelsIntel = 2;
// The two-panel tiles' rows, and the longest chunk they run on: longer chunks keep the one-panel
// tiles of 8 rows (lane_tile_rows). Same machine: at K = 4096 (chunks of 512, 64 KB of two
// panels' weights, more than the 48 KB L1) 6-row tiles ran 0.92-0.94x at 512-2048 rows.
constexpr int kPairTileRows = 6;
constexpr int64_t kPairTileMaxKc = 256;
constexpr int64_t kPackInCallMaxBytes = int64_t(256) << 20;  // the largest weight a call packs (a 256 MB copy)
constexpr int kLaneRowsBf16 = 20;  // the same for bf16 weights (linear_impl.h)
constexpr int kPanelPairs = 64;  // output columns per bf16 x bf16 linear task (bf16dot*.h)
constexpr int kLaneRowsPairs = 48;  // bf16 x bf16 linear on vdpbf16ps (bf16dot_hw.h): lane passes from here
constexpr int kLaneRowsPairsShort = 24;  // the same for chunks of at most kShortChunk elements
constexpr int kShortChunk = 96;  // K = 768 at C = 8: the experts' down projection
constexpr int kLaneRowsPairsEmu = 20;  // the same, emulated (bf16dot.h: AVX2, portable)
// The same for the AVX-512 table on Intel, at every chunk length: there both passes run on FMAs
// (bf16dot_fma.h), and the dot products over x in row pairs (two rows a zmm, the weights
// streamed once) ran ahead up to 64 rows. Measured on the Intel Xeon (family 6, model 167; 2
// threads, hot weights, the two alternated in one process): the dot products against the lane
// passes at 16 / 32 / 48 / 64 / 80 / 128 rows 1.59x / 1.25x / 1.15x / 1.05x / 0.94x / 0.64x at
// K = 2048, N = 4096; at K = 768 1.31x at 16, 1.09x at 48, 1.06x at 64, level at 72-88.
constexpr int kLaneRowsPairsIntel = 64;
// The same for the AVX-512 table on an AMD Zen 5 or later (family 0x1A; its vdpbf16ps full
// width), at every chunk length: there the dot products over x in row pairs (weights streamed
// once, eight columns' rows in L1 for every row tile) ran ahead of the lane passes (a panel's
// weights packed per task) up to about 100 rows. Measured on the AMD EPYC Zen 5 (family 26,
// model 2), 2 threads, cold weights, the two alternated in one process, every output equal,
// dot products against lane passes: tk.linear at K = 2048 (N = 512, 4096, 16384) and K = 4096
// (N = 2048) 1.33-1.53x at 48 rows, 1.29-1.50x at 64, 1.04-1.14x at 80-96, 0.97-0.99x at 112,
// 0.88-1.01x at 128, 0.75-0.91x at 160-384; at K = 768 (N = 2048, chunks of 96) 1.81x at 24,
// 1.54x at 32, 1.28-1.30x at 48-64, 1.10-1.16x at 80-112, 1.02x at 128, 0.84-0.96x at 160-384;
// moe_experts (128 cold experts of 30B-A3B, top-8 of random routing) at 24 / 48 / 96 rows an
// expert 1.17x / 1.25x / 1.11x, at 8-16 and 128 level.
constexpr int kLaneRowsPairsZen5 = 112;

enum class Elem : int { F32 = 0, BF16 = 1 };

// Scratch floats of one KV head's online softmax in Kernels::attention (kernels_impl.h): scores
// [block, G] with both rounded up to multiples of 8, running outputs [G, D], max, sum and rescale
// [G rounded up to 8] each.
inline int64_t attn_head_floats(int64_t G, int64_t D, int64_t block) {
  const int64_t Gp = (G + 7) / 8 * 8;
  return (block + 7) / 8 * 8 * Gp + G * D + 3 * Gp;
}
// ... and of a call on `heads` heads: theirs, and a block's keys as fp32 [block rounded up to 8, D].
inline int64_t attn_scratch(int64_t G, int64_t D, int64_t block, int64_t heads) {
  return heads * attn_head_floats(G, D, block) + (block + 7) / 8 * 8 * D;
}

struct AttnQuery {
  const float* q;      // [G, D] fp32: the G query heads that share one KV head
  float* out;          // [G, D] fp32
  const void* k_base;  // K of position 0 of the sequence (contiguous) or null (paged)
  const void* v_base;
  const int32_t* pages;  // paged: this sequence's page ids, else null
  int64_t page_stride;   // paged: elements per page
  int64_t pos_stride;    // elements between consecutive positions
  int64_t pos;           // the query's position t; keys 0..t are valid
  // The task the caller runs next, if any (paged; hints only): its first key block's K and V at
  // its first KV head (the same stride between positions and heads), next_n positions long. The
  // kernel fetches them while it computes its own last block, as it fetches each next block.
  const void* next_k = nullptr;
  const void* next_v = nullptr;
  int64_t next_n = 0;
};

// Whether a linear task of `rows` rows with chunks of kc runs lane passes (linear_impl.h): from
// lane_rows rows (fp32 weights: the table's Kernels::lane_rows_f32) or kLaneRowsBf16 (bf16: the
// dot products widen each weight as they stream it, the lane passes only in their transpose,
// which few rows do not amortise), and
// from 3 rows when a chunk is one lane step (kc <= 8), where a dot product is mostly its
// horizontal sum. Measured on the project's CPU; the choice never changes a bit.
inline bool linear_lane_passes(int64_t rows, int64_t kc, Elem w, int lane_rows) {
  return rows >= (w == Elem::BF16 ? kLaneRowsBf16 : lane_rows) || (kc <= 8 && rows >= 3);
}

// Scratch floats a linear_panel call of at most `rows` rows needs (lane_rows: the table's
// Kernels::lane_rows_f32): finished sums [rows, 16]; for lane passes also chunk partials
// [chunks, rows, 16] and the chunk's weights transposed [kc, 16].
// Sized by the call, so a one-row call on a large weight touches 64 bytes.
// grouped: the call is given an fp32 weight group (lane passes at any row count).
// panels: whole panels a call may take (Kernels::group_panels_f32 where it is given groups).
inline int64_t linear_scratch(int64_t chunks, int64_t K, int64_t rows, Elem w, int lane_rows, bool grouped = false,
                              int panels = 1) {
  if (!grouped && !linear_lane_passes(rows, K / chunks, w, lane_rows)) return rows * kPanel;
  return panels * (rows * kPanel * (1 + chunks) + kPanel * (K / chunks));
}

// Whether a bf16 x bf16 linear task (bf16dot.h) runs lane passes: on the instruction from 48 rows
// (its dot products run two rows per zmm and stream the weights once for every row, while the
// lane passes' packing pass costs what fewer rows do not amortise: measured on AMD Zen 5, 4-8 rows
// 4x faster as dot products), or from 24 when a chunk is at most 96 elements (a dot product's
// horizontal sum per chunk weighs more there: on Zen 4, K = 768, 2 threads, cold weights, the dot
// products over x in row pairs ran 1.2-1.3x the lane passes at 12-16 rows, 1.07x at 20, level at
// 24-28, 0.96x at 32); emulated from 20 (unpacking a chunk to fp32 costs the same). Measured on
// the project's CPU; the choice never changes a bit. lane_rows: the table's
// (Kernels::lane_rows_bf16), where it sets one, for every chunk length.
inline bool bf16_lane_passes(int64_t rows, int64_t kc, bool hw, int lane_rows = 0) {
  if (hw && lane_rows > 0) return rows >= lane_rows;
  return rows >= (!hw ? kLaneRowsPairsEmu : kc <= kShortChunk ? kLaneRowsPairsShort : kLaneRowsPairs);
}

// Elements of x a bf16 x bf16 linear reads per chunk: kc rounded up to the 16-element block (the
// op zero-pads x to this chunk stride when kc is not a multiple of 16).
inline int64_t bf16_chunk_stride(int64_t kc) { return (kc + 15) / 16 * 16; }

// Scratch floats of a bf16 x bf16 linear_panel_bf16 call of at most `rows` rows: sums and chunk
// partials of a row block, and the weights: one chunk unpacked ([pairs][odd, even][16] fp32,
// emulated) or the panel's chunks packed ([chunks][pairs][64] 32-bit pairs, vdpbf16ps; on Intel
// [chunks][slabs][pairs][odd, even][32] fp32, and a row block's chunk of x widened, FMAs).
constexpr int kRowBlockPairs = 384;  // rows per bf16 x bf16 linear task (the kernel blocks them by kRowBlock)

// Rows per bf16 x bf16 linear task: the fewest blocks of at most kRowBlockPairs, even. A task
// packs its panel's weights once for all its rows; only which rows share a task depends on this.
inline int64_t bf16_row_block(int64_t M) {
  const int64_t nb = M <= 0 ? 1 : (M + kRowBlockPairs - 1) / kRowBlockPairs;
  return M <= 0 ? kRowBlockPairs : (M + nb - 1) / nb;
}

// Whether a bf16 x bf16 linear task on the instruction runs dot products over x packed in row
// pairs (Kernels::pack_pairs): every task that runs no lane passes. pairs_floats: the floats of
// such a packing of `rows` rows (an odd last row is paired with zeros): the exact copy, one float
// a row pair and element, and with `widened` (Kernels::pairs_widened: the table on Intel) four
// more for the widened copy.
inline bool bf16_packs_pairs(int64_t rows, int64_t kc, int lane_rows) {
  return rows > 1 && !bf16_lane_passes(rows, kc, true, lane_rows);
}
inline int64_t pairs_floats(int64_t rows, int64_t chunks, int64_t xkc, bool widened) {
  return (rows + 1) / 2 * chunks * xkc * (widened ? 5 : 1);
}
// The most rows a table's linear_panel_bf16 takes as dot products (fewer than its lane passes).
inline int64_t bf16_pair_rows_max(int lane_rows) { return lane_rows > 0 ? lane_rows : kLaneRowsPairs; }

// A weight's columns in groups: a copy laid out the way the table's tiles read it (the caller
// owns it: Kernels::weight_groups; pack_weight_groups in ops.cpp). Only the layout differs from
// the weight in place: the same elements meet the same steps, so the bits are the in-place ones.
// Columns past the last whole group are read in place.
// - bf16 weights: groups of kGroupCols = 8 columns for the one-row dot tiles, as
//   [chunk c][block b][j][16] elements, block b of chunk c being column j's elements c * kc + 16 b
//   .. + 16 (zero past kc), one pair-chain step (bf16dot_hw.h). A one-row tile reads its eight
//   columns' blocks side by side: one stream of the group's bytes, where in place it reads eight
//   streams a weight row apart (AMD EPYC (Zen 4), 2 threads, 128 cold experts, one row each:
//   gate_up K = 2048 1.22-1.31x, down K = 768 1.26-1.41x; docs/history/performance-decode.md).
// - fp32 weights: panels of kPanel = 16 columns in the lane tiles' order (linear_impl.h), for
//   every row count: per chunk (kc * kPanel floats), each step holding the sixteen columns'
//   element k (lane l's step i: k = l + 8 i), in the order of the table's passes
//   (Kernels::group_lane_runs): the AVX-512 table's two-lane passes, lanes in pairs (0 and 1
//   step by step, then 2-3, 4-5, 6-7); the AVX2 table's one-lane passes, lanes one after another
//   (lane_group_start, lane_group_step). A pass then reads its lanes' weights front to back, with
//   no per-task transpose. (The AVX2 passes on the pairs' order read every other cache line, then
//   the ones between: on the AVX2-only AMD EPYC (Zen 3), 2 threads, plain reads in that order ran
//   26-27 GB/s where front to back ran 29-32.)
constexpr int kGroupCols = 8;  // columns of a bf16 weight group
// splitmix64: sampling's hash (CONTRACT.md "sample": the request key and every token's noise),
// shared by vocab_ops.cpp and the portable table's noise; the AVX2 tables compute it in 64-bit
// lanes (kernels_impl.h splitmix64x4), the same integers.
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline int64_t weight_group_cols(Elem w) { return w == Elem::F32 ? kPanel : kGroupCols; }
inline int64_t group_chunk_stride(int64_t kc, Elem w) { return w == Elem::F32 ? kc : bf16_chunk_stride(kc); }
inline int64_t group_block(Elem w) { return w == Elem::F32 ? 8 : 16; }  // a dot tile's step: one V8 of fp32, a pair-chain block of bf16
inline int64_t weight_group_elems(int64_t K, int64_t chunks, Elem w) {
  return chunks * group_chunk_stride(K / chunks, w) * weight_group_cols(w);
}
inline int64_t lane_steps(int64_t kc, int l) { return (kc - l + 7) / 8; }  // lane l's k's in a chunk: l, l + 8, ... < kc
// Where lane l's steps start in an fp32 group's chunk block (floats), and the floats between
// its steps: lanes one after another (runs: each lane's steps in one run) or in pairs.
inline int64_t lane_group_start(int64_t kc, int l, bool runs) {
  int64_t s = 0;
  for (int j = 0; j < (runs ? l : l & ~1); ++j) s += lane_steps(kc, j);
  return (s + (runs ? 0 : l & 1)) * kPanel;
}
constexpr int64_t lane_group_step(bool runs) { return runs ? kPanel : 2 * kPanel; }
// The position of a chunk's element k in an fp32 group's chunk block, in steps of kPanel floats
// (lane k % 8's step k / 8): what pack_weight_groups writes and the lane tiles read.
inline int64_t lane_group_pos(int64_t kc, int64_t k, bool runs) {
  return (lane_group_start(kc, int(k % 8), runs) + (k / 8) * lane_group_step(runs)) / kPanel;
}

// Where a dot tile finds its weights: column n's block b (its elements c * kc + block * b ..
// + block of chunk c) at c * lc + n * ln + b * lb. In place (a row of W per column): (kc, ldw,
// block). In a bf16 weight group: (kGroupCols * padded kc, 16, kGroupCols * 16): the eight
// columns' blocks side by side, one stream. Only addresses differ: every output meets the same
// blocks in the same steps.
struct WeightWalk {
  int64_t lc, ln, lb;
  static WeightWalk in_place(int64_t ldw, int64_t kc, Elem w) { return {kc, ldw, group_block(w)}; }
  static WeightWalk bf16_group(int64_t kc) { return {kGroupCols * bf16_chunk_stride(kc), 16, kGroupCols * 16}; }
};

// (Room for rows + 1 finished rows: the dot path's pair tile of an odd last row writes its zero row.)
inline int64_t linear_scratch_bf16(int64_t chunks, int64_t K, int64_t rows) {
  const int64_t r = rows < kRowBlock ? rows : kRowBlock, kp = bf16_chunk_stride(K / chunks);
  return r * kPanelPairs * (1 + chunks) + kPanelPairs * kp * (chunks > 2 ? chunks : 2) + r * kp;
}

// An operand of the backward GEMM: element (i, j) at p + i * rs + j * cs (in elements).
struct GemmOperand {
  const void* p;
  int64_t rs, cs;
  Elem e;
};
constexpr int64_t kGemmKc = 256;  // the backward GEMM's k block (gemm.h)
constexpr int64_t kGemmMaxM = 768;  // rows of C per gemm call at most (the caller splits)
constexpr int64_t kGemmStrips = 8;  // 64-column B strips the AVX-512 build packs at once (bf16 pairs; fp32: half)
// The backward GEMM on AMX (gemm_amx.h): lines (A's rows, B's columns) in blocks of 32, k in
// steps of 32; a tile of C at most kAmxTileRows x kAmxTileCols (its fp32 sums, 256 KB, stay in L2
// while k passes in blocks of kAmxSteps steps). Which tile holds an output never changes a bit.
// (2048^3 in one process: k blocks of 16 steps 0.88x, tiles of 512 x 256 or 256 x 512 level.)
constexpr int64_t kAmxSteps = 8;
constexpr int64_t kAmxTileRows = 256;
constexpr int64_t kAmxTileCols = 256;
inline int64_t amx_packed_elems(int64_t lines, int64_t k) { return (lines + 31) / 32 * 32 * ((k + 31) / 32 * 32); }
// Scratch floats of a gemm call of at most kGemmMaxM rows (packed A and B blocks, any build).
inline int64_t gemm_scratch() { return kGemmKc * 64 * kGemmStrips / 2 + (kGemmMaxM + 6) * kGemmKc; }
static_assert(kGemmMaxM * kAmxTileCols + kAmxTileCols * kAmxSteps * 16 <= kGemmKc * 64 * kGemmStrips / 2 + (kGemmMaxM + 6) * kGemmKc,
              "a gemm call's scratch holds an AMX column tile's fp32 C and a k block of its B");

struct Kernels {
  const char* name;
  // Linear: rows [0, rows) of x (fp32, row stride ldx) times a panel of `ncols` <= 16 weight
  // rows (W [N, K] row-major from the panel's first row, fp32 or bf16, row stride ldw) -> ncols
  // outputs per row. K = chunks * kc; each chunk is a sequential FMA chain over its k from 0;
  // chunk partials are combined by the pairwise tree. scratch: linear_scratch(chunks, K, rows,
  // welem, lane_rows_f32) floats (uninitialised). xl: where the call runs lane passes
  // (linear_lane_passes with lane_rows_f32), the same rows lane-packed by pack_lanes (required:
  // those lane passes read x there; the same operands in the same order); otherwise null.
  // wgroups: where the table reads fp32 groups (group_rows_f32), W is fp32 and the panel is whole
  // (ncols == kPanel), the panel's fp32 weight group (weight_group_elems(kc * chunks, chunks, F32)
  // floats): from group_rows_f32 rows the call then runs lane passes on it (xl required) and
  // reads no W. Null: W in place. The same bits either way. With groups, ncols may be up to
  // kPanel * group_panels_f32 (whole panels, their groups one after another from wgroups; the
  // scratch linear_scratch(..., true, group_panels_f32)), and in place, running fp32 lane passes,
  // up to kPanel * lane_panels_f32 (the scratch linear_scratch(..., lane_panels_f32)): the same
  // outputs as a call per panel.
  void (*linear_panel)(const float* x, int64_t ldx, int64_t rows, const void* W, int64_t ldw,
                       Elem welem, int64_t kc, int chunks, const float* bias, int ncols, void* out,
                       int64_t ldo, Elem oelem, float* scratch, const float* xl, const float* wgroups);
  // Causal attention for one query position and `heads` consecutive KV heads (G query heads
  // each; head h's queries and outputs h * G * D floats on from a's, its K and V h * D elements
  // on), online softmax over key blocks of `block` positions aligned to position 0, block by
  // block, every head of a block before the next block (a position's heads are one run of the
  // cache). scratch: attn_scratch(G, D, block, heads) floats. Each head's arithmetic is the
  // same whatever `heads` is.
  void (*attention)(const AttnQuery& a, int heads, int G, int D, int block, Elem kv, float scale,
                    float* scratch);
  // Row-wise ops.
  void (*rms_norm)(const void* x, const void* w, void* out, int64_t H, float eps, Elem e,
                   Elem we);
  void (*silu_mul)(const void* g, const void* u, void* out, int64_t n, Elem e);
  void (*lse_chunks)(const void* x, int64_t V, Elem e, float temperature, int chunks, float* m,
                     float* s);
  void (*moe_combine)(const float* w, const void* y, void* out, int64_t K, int64_t H, Elem e);
  float (*exp)(float x);
  // y[i] = log(x[i]) for n floats: tonp's one log (simd.h vlog; the tail through slog, the same
  // lane arithmetic), shared by logsumexp and the sampling noise.
  void (*log_n)(const float* x, float* y, int64_t n);
  // bf16 x bf16 linear (the pair chains of bf16dot.h): x bf16 rows (row stride ldx, chunk c at
  // x + c * xkc, zero padded to xkc = bf16_chunk_stride(kc)), W bf16, ncols <= kPanelPairs;
  // otherwise as linear_panel. wgroups: where the table has weight_groups_bf16, W's columns in groups
  // (the first column's group; weight_group_elems(kc * chunks, chunks, BF16) a group), or null: its
  // one-row tiles read whole groups there; the rest reads W. The same bits either way.
  // scratch: linear_scratch_bf16(chunks, K, rows) floats. xpairs: where the table has pack_pairs
  // and bf16_packs_pairs(rows, kc), the same rows packed by it (required: those dot products read
  // x there; made once, read by every panel of the rows); otherwise null.
  void (*linear_panel_bf16)(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, const uint16_t* W,
                            int64_t ldw, int64_t kc, int chunks, const float* bias, int ncols, void* out,
                            int64_t ldo, Elem oelem, float* scratch, const uint16_t* xpairs,
                            const uint16_t* wgroups);
  // One step of the pair chains on n lanes (acc fp32 [n], a, b bf16 [n, 2]): the unit the
  // equality tests compare across builds and with the instruction.
  void (*bf16_pair_step)(const float* acc, const uint16_t* a, const uint16_t* b, float* out, int64_t n);
  // The backward passes' GEMM (gemm.h): C[m, n] fp32 (row stride ldc) = (C if accumulate) + A B,
  // A [m, k], B [k, n], m <= kGemmMaxM; a fixed order per call (not the forward's arithmetic).
  // scratch: gemm_scratch() floats.
  void (*gemm)(const GemmOperand& a, const GemmOperand& b, int64_t m, int64_t n, int64_t k, float* c, int64_t ldc,
               bool accumulate, float* scratch);
  // gemm with C rounded once to bf16; k <= kGemmKc, no accumulation. scratch: gemm_scratch()
  // + m * n floats.
  void (*gemm_bf16out)(const GemmOperand& a, const GemmOperand& b, int64_t m, int64_t n, int64_t k, uint16_t* c,
                       int64_t ldc, float* scratch);
  // Gradients to bf16, round to nearest even (the backward passes' one rounding).
  void (*grad_to_bf16)(const float* src, uint16_t* dst, int64_t n);
  // SwiGLU's backward (gemm.h): dg, du of silu(gate) * up given dh (fp32), gate/up/dg/du in e.
  void (*swiglu_grad)(const void* gate, const void* up, const float* dh, void* dg, void* du, int64_t n, Elem e);
  // The rows [0, rows) of x (fp32, row stride ldx, K = chunks * kc) lane-packed for
  // linear_panel's lane passes: rows * K floats at xl, made once per row block and read by every
  // panel of it (in the order of the build's lane tiles: four rows, AVX-512 eight; its table on
  // Intel six for chunks of at most kPairTileMaxKc, tile_rows_for).
  void (*pack_lanes)(const float* x, int64_t ldx, int64_t rows, int64_t kc, int chunks, float* xl);
  // The row count from which linear_panel runs lane passes with fp32 weights (linear_lane_passes):
  // kLaneRows, the AVX-512 build kLaneRowsZmm. Which path runs never changes a bit.
  int lane_rows_f32;
  // Rows per task of an fp32-arithmetic linear (and per expert block of moe_experts): the AVX2
  // and AVX-512 builds kRowBlockF32 (their lane passes transpose each weight chunk once per task;
  // more rows amortise that), the portable build kRowBlock. Which rows share a task never
  // changes a bit.
  int row_block_f32;
  // On fp32 weight groups (tk.linear given them: lane passes, no weight chunk transposed per
  // task, so short row blocks cost no extra work), the row block is also capped so that its
  // lane-packed x, rows * K floats read once by every panel of the block, takes at most this
  // many bytes (group_row_block); 0: no cap (row_block_f32 alone). moe_experts keeps
  // row_block_f32 (on the Intel Xeon the cap measured level there: 256-512 rows an expert
  // 1.02-1.03x).
  int64_t group_block_bytes_f32;
  // tk.linear on an fp32 weight given without its groups: from this many rows (0: never) the call
  // packs the groups itself, once, for its lane passes (pack_weight_groups' layout; weights of at
  // most kPackInCallMaxBytes, where group_row_block cuts the blocks to half of row_block_f32 or
  // less, and not on chunks its two-panel tiles take: pair_tiles), where each row block's task
  // would transpose every weight chunk again. The same bits.
  int linear_pack_rows_f32;
  // x rows of a bf16 x bf16 linear (as linear_panel_bf16's x) packed in row pairs for its dot
  // products: an exact copy, and where pairs_widened (on Intel) a widened one after it
  // (bf16dot_fma.h), in pairs_floats(rows, chunks, xkc, pairs_widened) floats at xp. Null in the tables whose linear_panel_bf16
  // reads x in place (the emulated builds).
  void (*pack_pairs)(const uint16_t* x, int64_t ldx, int64_t xkc, int64_t rows, int chunks, uint16_t* xp);
  // Weight groups, where they were measured to pay; elsewhere a packed copy would be memory for
  // nothing. group_rows_f32: linear_panel (fp32 weights) reads the panel's group, when given it,
  // in tasks of at least this many rows: the AVX-512 table 1 (its lane tiles on zmm registers),
  // AVX2 4 (its dot tiles read W in place faster at 1-3 rows); 0: never (portable).
  // weight_groups_bf16: linear_panel_bf16 reads bf16 groups (the AVX-512 table's one-row tiles on
  // the instruction).
  int group_rows_f32;
  // The same for tk.linear (the dense linears and the LM head; ops.cpp): from this many rows a
  // task reads the fp32 group it is given through the lane passes, fewer rows read the weight in
  // place through the dot tiles. AVX2 kLaneRows (8); the AVX-512 table by CPU (isa_avx512bf16.cpp:
  // 1 on AMD Zen 5, kLinearGroupRowsIntel on Intel, kLinearGroupRowsZmm elsewhere); 0 where
  // group_rows_f32 is 0.
  int linear_group_rows_f32;
  bool weight_groups_bf16;
  // The lane order of the fp32 groups this table reads (lane_group_pos; pack_weight_groups writes
  // it): lanes one after another (true: the AVX2 and portable tables) or in pairs (AVX-512).
  bool group_lane_runs;
  // Adjacent whole panels one linear_panel call may take on fp32 groups: ncols up to
  // kPanel * group_panels_f32, wgroups the first panel's group and the others following it
  // (pack_weight_groups' layout). The AVX2 table 2: at group_rows_f32 to 12 rows it streams the
  // two panels' groups side by side, two streams, each lane's pass on the first then on the
  // second (the same passes; only their order differs), more rows a panel at a time. The AVX-512
  // table on Intel 2 (kLanePanelsIntel: its two-panel tiles). Others 1.
  int group_panels_f32;
  // The same where a call runs fp32 lane passes on W in place (linear_lane_passes; fp32 x and W):
  // ncols up to kPanel * lane_panels_f32, whole panels. The AVX-512 table on Intel 2, others 1.
  int lane_panels_f32;
  // The rows of the lane tiles (pack_lanes' tiles): 4 in the AVX2 and portable tables, 8 in the
  // AVX-512 one; where lane_panels_f32 > 1, chunks of at most kPairTileMaxKc take the two-panel
  // tiles' kPairTileRows instead (tile_rows_for).
  int lane_tile_rows;
  // The vocabulary ops' row passes (vocab_ops.cpp). row_max: the largest x[i] / T of a row of V
  // (T = 1: x[i]), NaN skipped, a zero maximum as +0 (-inf: no value but NaN or -inf); y (null:
  // none) receives the x[i] / T, *nan (null: none) whether one was NaN. gumbel_argmax: sample's
  // Gumbel-max draw over n tokens, ids[0..n) ascending (null: the tokens 0..n-1), of logits y
  // (indexed by token) whose logit is not -inf (at least one finite): the lowest token of the
  // largest y[t] - log(E_t), E_t the exponential variate of splitmix64(key ^ t) (CONTRACT.md
  // "sample"); score: n floats of scratch.
  float (*row_max)(const void* x, int64_t V, Elem e, float temperature, float* y, bool* nan);
  int64_t (*gumbel_argmax)(const float* y, const int64_t* ids, int64_t n, uint64_t key, float* score);
  // Whether gemm and gemm_bf16out run bf16 x bf16 operands on AMX now (the AVX512-BF16 table on
  // a CPU whose AMX this process may use, unless TONP_BACKWARD_AMX=0); null: never.
  bool (*gemm_on_amx)() = nullptr;
  // Where gemm_on_amx, its parts (gemm_amx.h), which gemm_parallel runs so that its tiles share
  // one packing of the operands: amx_pack_a packs A's rows [0, lines), amx_pack_b B's columns
  // [0, lines), steps [s0, s1) of k (32 elements a step), into tile order (the whole pack, all
  // steps: amx_packed_elems(lines, k) bf16 from dst, each task writing its own part); amx_tile
  // computes C[m, n] (m <= kAmxTileRows, n <= kAmxTileCols; fp32 row stride ldc, += when
  // accumulating, or bf16 rounded once) from the packs' blocks of its first row and column
  // (pack + amx_packed_elems(i0, k) for row i0, a multiple of 32). scratch: kAmxTileRows *
  // kAmxTileCols floats. The same bits as gemm and gemm_bf16out on AMX, whatever the tiles.
  void (*amx_pack_a)(const GemmOperand& a, int64_t lines, int64_t k, int64_t s0, int64_t s1, uint16_t* dst) = nullptr;
  void (*amx_pack_b)(const GemmOperand& b, int64_t lines, int64_t k, int64_t s0, int64_t s1, uint16_t* dst) = nullptr;
  void (*amx_tile)(const uint16_t* ap, const uint16_t* bp, int64_t m, int64_t n, int64_t k, void* c, Elem ce,
                   int64_t ldc, bool accumulate, float* scratch) = nullptr;
  // The row count from which linear_panel_bf16 runs lane passes at every chunk length
  // (bf16_lane_passes); 0: the instruction's rule (kLaneRowsPairs, kLaneRowsPairsShort). The
  // AVX-512 table on Intel kLaneRowsPairsIntel, on an AMD Zen 5 or later kLaneRowsPairsZen5.
  // Which path runs never changes a bit.
  int lane_rows_bf16 = 0;
  // pack_pairs writes the widened copy of x too (pairs_floats).
  bool pairs_widened = false;
};

// The row-block cap of a tk.linear call of `rows` rows and reduction length K
// on fp32 weight groups: row_block_f32, lowered to fit group_block_bytes_f32 (whole lane tiles,
// lane_tile_rows, and at least 32 rows, or 30 in tiles of 6) when there are more than kGroupBlockWholeRows
// rows; fewer stay one block (on the Intel Xeon, 128 rows cut in two ran 0.95-1.07x: the LM head
// and 128 rows an expert 0.95x). Which rows share a task never changes a bit.
constexpr int64_t kGroupBlockWholeRows = 128;
// Whether table k runs fp32 lane passes on chunks of kc in its two-panel tiles (kPairTileRows
// rows, two panels a call); the rows of its lane tiles there (Kernels::lane_tile_rows).
inline bool pair_tiles(const Kernels* k, int64_t kc) { return k->lane_panels_f32 > 1 && kc <= kPairTileMaxKc; }
inline int tile_rows_for(const Kernels* k, int64_t kc) { return pair_tiles(k, kc) ? kPairTileRows : k->lane_tile_rows; }
inline int64_t group_row_block(const Kernels* k, int64_t rows, int64_t K, int64_t chunks) {
  const int64_t cap = k->row_block_f32;
  if (k->group_block_bytes_f32 <= 0 || K <= 0 || rows <= kGroupBlockWholeRows) return cap;
  const int64_t tr = tile_rows_for(k, K / chunks), least = std::max<int64_t>(tr, 32 / tr * tr);
  const int64_t fit = k->group_block_bytes_f32 / (4 * K) / tr * tr;
  return fit >= cap ? cap : fit < least ? least : fit;
}

// Whether table k reads weight groups of a weight of dtype w (pack_weight_groups makes none where
// it does not).
inline bool reads_weight_groups(const Kernels* k, Elem w) {
  return w == Elem::F32 ? k->group_rows_f32 > 0 : k->weight_groups_bf16;
}

const Kernels* kernels_avx2();
const Kernels* kernels_portable();
bool cpu_has_avx2_fma();
// The AVX2 table with the bf16 x bf16 linear on vdpbf16ps; null unless this CPU has AVX512-BF16
// and the instruction passed a self-check against the emulation (isa_avx512bf16.cpp).
const Kernels* kernels_avx512bf16();
// That table with the fp32 lane passes' two-panel tiles (Kernels::lane_panels_f32; its own choice
// on Intel), on any CPU it runs on; null where it is null (TONP_FORCE_PAIR_TILES=1).
const Kernels* kernels_avx512bf16_pairs();
// That table with the bf16 x bf16 linear's path of Intel (fma: bf16dot_fma.h) or of other CPUs
// (vdpbf16ps), on any CPU it runs on; null where it is null (TONP_FORCE_BF16_FMA=1 / 0).
const Kernels* kernels_avx512bf16_bf16(bool fma);

}  // namespace tonp
