// The per-ISA kernel table. ops.cpp and moe_ops.cpp (the torch-facing side: checks, allocation,
// threading) call these through `K()` (ops_common.h); isa_avx2.cpp and isa_portable.cpp each fill
// one table from the same source (kernels_impl.h), so both give identical bits.
//
// Threading never splits a reduction: every function below computes complete outputs (rows,
// panels of output columns, (query, head) pairs) and ops.cpp only distributes those.
#pragma once
#include <cstdint>

namespace tonp {

constexpr int kPanel = 16;  // output columns per weight panel (one micro tile wide)
constexpr int kRowBlock = 96;  // rows per linear task (a multiple of the 4-row lane tile)
constexpr int kMaxChunks = 64;  // the most reduction chunks C a linear may use
constexpr int kLaneRows = 8;  // fp32-weight linear tasks of this many rows or more run lane passes
constexpr int kLaneRowsBf16 = 20;  // the same for bf16 weights (kernels_impl.h)

enum class Elem : int { F32 = 0, BF16 = 1 };

struct AttnQuery {
  const float* q;      // [G, D] fp32: the G query heads that share one KV head
  float* out;          // [G, D] fp32
  const void* k_base;  // K of position 0 of the sequence (contiguous) or null (paged)
  const void* v_base;
  const int32_t* pages;  // paged: this sequence's page ids, else null
  int64_t page_stride;   // paged: elements per page
  int64_t pos_stride;    // elements between consecutive positions
  int64_t pos;           // the query's position t; keys 0..t are valid
};

// Whether a linear task of `rows` rows with chunks of kc runs lane passes (kernels_impl.h): from
// kLaneRows rows (fp32 weights) or kLaneRowsBf16 (bf16: the dot products widen each weight as
// they stream it, the lane passes only in their transpose, which few rows do not amortise), and
// from 3 rows when a chunk is one lane step (kc <= 8), where a dot product is mostly its
// horizontal sum. Measured on the project's CPU; the choice never changes a bit.
inline bool linear_lane_passes(int64_t rows, int64_t kc, Elem w) {
  return rows >= (w == Elem::BF16 ? kLaneRowsBf16 : kLaneRows) || (kc <= 8 && rows >= 3);
}

// Scratch floats a linear_panel call of at most `rows` rows needs: finished sums [rows, 16]; for
// lane passes also chunk partials [chunks, rows, 16] and the chunk's weights transposed [kc, 16].
// Sized by the call, so a one-row call on a large weight touches 64 bytes.
inline int64_t linear_scratch(int64_t chunks, int64_t K, int64_t rows, Elem w) {
  if (!linear_lane_passes(rows, K / chunks, w)) return rows * kPanel;
  return rows * kPanel * (1 + chunks) + kPanel * (K / chunks);
}

struct Kernels {
  const char* name;
  // Linear: rows [0, rows) of x (fp32, row stride ldx) times a panel of `ncols` <= 16 weight
  // rows (W [N, K] row-major from the panel's first row, fp32 or bf16, row stride ldw) -> ncols
  // outputs per row. K = chunks * kc; each chunk is a sequential FMA chain over its k from 0;
  // chunk partials are combined by the pairwise tree. scratch: linear_scratch(chunks, K, rows)
  // floats (uninitialised).
  void (*linear_panel)(const float* x, int64_t ldx, int64_t rows, const void* W, int64_t ldw,
                       Elem welem, int64_t kc, int chunks, const float* bias, int ncols, void* out,
                       int64_t ldo, Elem oelem, float* scratch);
  // Causal attention for one query position and one KV head (G query heads), online softmax
  // over key blocks of `block` positions aligned to position 0.
  void (*attention)(const AttnQuery& a, int G, int D, int block, Elem kv, float scale,
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
};

const Kernels* kernels_avx2();
const Kernels* kernels_portable();
bool cpu_has_avx2_fma();

}  // namespace tonp
