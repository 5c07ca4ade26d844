// Helpers of the torch-facing backward passes (autograd.cpp, moe_backward.cpp, attention_grad.cpp):
// the backward GEMM over fixed tiles, deterministic column sums. Gradients need not follow the
// forward's arithmetic (CONTRACT.md), but they are deterministic: every output is computed by one
// call whose shape and operands never depend on the thread count, so the same inputs give the
// same bits run to run, with any number of threads.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"
#include "ops_common.h"

namespace tonp {

// A 2-D fp32 or bf16 tensor (any strides) as a GEMM operand; transposed: (i, j) reads t[j, i].
inline GemmOperand operand(const at::Tensor& t, bool transposed = false) {
  TORCH_CHECK(t.dim() == 2 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              "tonp backward: expected a 2-D float32 or bfloat16 operand, got ", t.sizes(), " ", t.scalar_type());
  return {t.data_ptr(), transposed ? t.stride(1) : t.stride(0), transposed ? t.stride(0) : t.stride(1),
          t.scalar_type() == at::kFloat ? Elem::F32 : Elem::BF16};
}

// One thread's gemm of any m (split into calls of at most kGemmMaxM rows).
inline void gemm_rows(const Kernels* kern, const GemmOperand& a, const GemmOperand& b, int64_t m, int64_t n, int64_t k,
                      float* c, int64_t ldc, bool accumulate, float* scratch) {
  for (int64_t i0 = 0; i0 < m; i0 += kGemmMaxM) {
    const GemmOperand ai{static_cast<const char*>(a.p) + i0 * a.rs * (a.e == Elem::F32 ? 4 : 2), a.rs, a.cs, a.e};
    kern->gemm(ai, b, std::min(kGemmMaxM, m - i0), n, k, c + i0 * ldc, ldc, accumulate, scratch);
  }
}

// Rows of C per tile of the parallel GEMM (a gemm call packs its A rows once, its B columns once
// per row tile). An output's sum runs over k blocks of kGemmKc in order whatever tile holds it,
// so the tiles may follow the thread count without changing a bit.
constexpr int64_t kGradRows = 384;

// Columns per tile: as wide as a few tasks per thread allow (A is packed once per tile).
inline int64_t grad_cols(int64_t m, int64_t n) {
  const int64_t tm = (m + kGradRows - 1) / kGradRows, want = 3 * int64_t(at::get_num_threads());
  const int64_t tn = std::max<int64_t>(1, (want + tm - 1) / tm);
  return std::max<int64_t>(64, ((n + tn - 1) / tn + 63) / 64 * 64);
}

// gemm_parallel on AMX (bf16 x bf16 where Kernels::gemm_on_amx): A and B packed once, in
// parallel, into buffers every tile reads (tiles that each packed their own operands packed B
// again for every row tile: 2048^3 spent a third of its time packing), then tiles of C of
// kAmxTileRows x kAmxTileCols over threads.
inline void gemm_parallel_amx(const Kernels* kern, const GemmOperand& a, const GemmOperand& b, int64_t m, int64_t n,
                              int64_t k, void* c, Elem ce, int64_t ldc, bool accumulate) {
  const int64_t na = amx_packed_elems(m, k), kp = (k + 31) / 32 * 32;  // kp: a line's packed elements
  at::Tensor packs = empty_big({na + amx_packed_elems(n, k)}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* ap = static_cast<uint16_t*>(packs.data_ptr());
  uint16_t* bp = ap + na;
  // Tasks over 32-line blocks (all of k each) where an operand's lines run along its rows (A
  // row-major, B column-major); otherwise over steps of k (all lines each), so that every read
  // is a run along the operand's contiguous dimension. A's tasks, then B's, each over all
  // threads (in one loop, a thread could get all of the smaller operand's).
  const int64_t steps = kp / 32;
  auto pack = [&](const GemmOperand& o, int64_t lines, bool lines_along_rows, uint16_t* dst,
                  void (*fn)(const GemmOperand&, int64_t, int64_t, int64_t, int64_t, uint16_t*)) {
    const bool by_steps = (lines_along_rows ? o.cs : o.rs) != 1;
    at::parallel_for(0, by_steps ? steps : (lines + 31) / 32, 1, [&](int64_t b0, int64_t e0) {
      if (by_steps) {  // a step at a time: the 32 rows of storage it spans, each read whole
        for (int64_t u = b0; u < e0; ++u) fn(o, lines, k, u, u + 1, dst);
        return;
      }
      for (int64_t l0 = b0 * 32; l0 < std::min(lines, e0 * 32); l0 += 32)
        fn({static_cast<const uint16_t*>(o.p) + l0 * (lines_along_rows ? o.rs : o.cs), o.rs, o.cs, o.e},
           std::min<int64_t>(32, lines - l0), k, 0, steps, dst + l0 * kp);
    });
  };
  pack(a, m, true, ap, kern->amx_pack_a);
  pack(b, n, false, bp, kern->amx_pack_b);
  const int64_t tm = (m + kAmxTileRows - 1) / kAmxTileRows, tn = (n + kAmxTileCols - 1) / kAmxTileCols;
  const int64_t eb = ce == Elem::F32 ? 4 : 2;
  at::parallel_for(0, tm * tn, 1, [&](int64_t b0, int64_t e0) {
    const auto scratch = scratch_floats(kAmxTileRows * kAmxTileCols);
    for (int64_t t = b0; t < e0; ++t) {
      const int64_t i0 = t / tn * kAmxTileRows, j0 = t % tn * kAmxTileCols;
      kern->amx_tile(ap + i0 * kp, bp + j0 * kp, std::min(kAmxTileRows, m - i0), std::min(kAmxTileCols, n - j0), k,
                     static_cast<char*>(c) + (i0 * ldc + j0) * eb, ce, ldc, accumulate, scratch.get());
    }
  });
}

// C[m, n] (fp32, or bf16 rounded once; row stride ldc) = (C if accumulate, fp32 only) + A[m, k]
// B[k, n], in tiles over threads.
inline void gemm_parallel(const GemmOperand& a, const GemmOperand& b, int64_t m, int64_t n, int64_t k, void* c, Elem ce,
                          int64_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return;
  const Kernels* kern = K();
  if (k > 0 && a.e == Elem::BF16 && b.e == Elem::BF16 && kern->amx_tile && kern->gemm_on_amx()) {
    gemm_parallel_amx(kern, a, b, m, n, k, c, ce, ldc, accumulate);
    return;
  }
  const int64_t cols = grad_cols(m, n);
  const int64_t tm = (m + kGradRows - 1) / kGradRows, tn = (n + cols - 1) / cols;
  at::parallel_for(0, tm * tn, 1, [&](int64_t b0, int64_t e0) {
    const auto scratch = scratch_floats(gemm_scratch() + (ce == Elem::BF16 ? kGradRows * cols : 0));
    float* buf = scratch.get() + gemm_scratch();
    for (int64_t t = b0; t < e0; ++t) {
      const int64_t i0 = t / tn * kGradRows, j0 = t % tn * cols;
      const int64_t mi = std::min(kGradRows, m - i0), nj = std::min(cols, n - j0);
      const GemmOperand ai{static_cast<const char*>(a.p) + i0 * a.rs * (a.e == Elem::F32 ? 4 : 2), a.rs, a.cs, a.e};
      const GemmOperand bj{static_cast<const char*>(b.p) + j0 * b.cs * (b.e == Elem::F32 ? 4 : 2), b.rs, b.cs, b.e};
      if (ce == Elem::F32) {
        kern->gemm(ai, bj, mi, nj, k, static_cast<float*>(c) + i0 * ldc + j0, ldc, accumulate, scratch.get());
      } else if (k <= kGemmKc) {  // one k block: rounded in registers
        kern->gemm_bf16out(ai, bj, mi, nj, k, static_cast<uint16_t*>(c) + i0 * ldc + j0, ldc, scratch.get());
      } else {
        kern->gemm(ai, bj, mi, nj, k, buf, nj, false, scratch.get());
        for (int64_t i = 0; i < mi; ++i)
          kern->grad_to_bf16(buf + i * nj, static_cast<uint16_t*>(c) + (i0 + i) * ldc + j0, nj);
      }
    }
  });
}

// A @ B as a new [m, n] tensor of `dtype` (fp32 or bf16; a [m, k], b [k, n]; pass transposed
// operands for A^T, B^T).
inline at::Tensor mm_into(const GemmOperand& a, const GemmOperand& b, int64_t m, int64_t n, int64_t k,
                          const at::TensorOptions& like, at::ScalarType dtype) {
  at::Tensor c = empty_big({m, n}, like.dtype(dtype));
  gemm_parallel(a, b, m, n, k, c.data_ptr(), dtype == at::kFloat ? Elem::F32 : Elem::BF16, n, false);
  return c;
}

// out[j] = sum over rows i of x[i, j] (x [R, C] 2-D fp32 contiguous), rows in order per column.
inline at::Tensor column_sums(const at::Tensor& x) {
  const int64_t R = x.size(0), C = x.size(1);
  at::Tensor out = at::empty({C}, x.options().dtype(at::kFloat));
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (C + 63) / 64, grain_for(64 * R), [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t j0 = blk * 64, nj = std::min<int64_t>(64, C - j0);
      float acc[64] = {0};
      for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < nj; ++j) acc[j] += xp[i * C + j0 + j];
      std::copy_n(acc, nj, op + j0);
    }
  });
  return out;
}

}  // namespace tonp
