// The experts' backward as grouped work: all experts of a layer in one call, from the routing the
// forward used. The forward (moe_experts_train) hands back its gate_up rows so nothing is
// recomputed. Per expert e with rows G_e (output gradients), x_e, gate/up g, u and h = silu(g) u:
//   dH_e  = G_e Wdn_e           dWdn_e = G_e^T h_e
//   dgu_e = [dH u s (1 + g (1 - s)), dH g s]   (s = sigmoid(g); fp32, stored in x's dtype)
//   dWgu_e = dgu_e^T x_e        dX rows = dgu_e Wgu_e, summed per token in slot order
// Each GEMM tile is one call of the backward GEMM (gemm.h; vdpbf16ps for bf16 operands where the
// CPU has it), the tiles of a stage one parallel region: deterministic for any thread count.
// Weight gradients are written once, in the weights' dtype (experts without rows get zeros).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "grad_common.h"
#include "moe_common.h"

namespace tonp {
namespace {

using at::Tensor;

struct Tile {
  int kind;  // 0: dH, 1: dWdn, 2: dWgu, 3: dX rows
  int64_t e, i0, j0;
};

int64_t esize(const Tensor& t) { return t.scalar_type() == at::kFloat ? 4 : 2; }

// Rows r0.. of a contiguous tensor viewed as [rows, ld] (ld = its last dim), from element `base`
// (an expert's matrix inside [E, rows, ld]), as an operand; transposed: (i, j) reads row j, col i.
GemmOperand rows_of(const Tensor& t, int64_t r0, bool transposed = false, int64_t base = 0) {
  const int64_t ld = t.size(-1);
  return {static_cast<const char*>(t.data_ptr()) + (base + r0 * ld) * esize(t), transposed ? 1 : ld, transposed ? ld : 1,
          t.scalar_type() == at::kFloat ? Elem::F32 : Elem::BF16};
}

GemmOperand offset(GemmOperand o, int64_t i, int64_t j) {
  o.p = static_cast<const char*>(o.p) + (i * o.rs + j * o.cs) * (o.e == Elem::F32 ? 4 : 2);
  return o;
}

// C tile [m, n] of a weight gradient (fp32 or bf16 tensor, row stride ld): computed in fp32 and
// rounded once.
void weight_tile(const Kernels* kern, const GemmOperand& a, const GemmOperand& b, int64_t m, int64_t n, int64_t k,
                 Tensor& dst, int64_t off, int64_t ld, float* buf, float* scratch) {
  if (dst.scalar_type() == at::kFloat) {
    kern->gemm(a, b, m, n, k, dst.data_ptr<float>() + off, ld, false, scratch);
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst.data_ptr()) + off;
  if (k <= kGemmKc) {  // one k block (an expert's rows): rounded in registers
    kern->gemm_bf16out(a, b, m, n, k, d, ld, scratch);
    return;
  }
  kern->gemm(a, b, m, n, k, buf, n, false, scratch);
  for (int64_t i = 0; i < m; ++i) kern->grad_to_bf16(buf + i * n, d + i * ld, n);
}

// Tiles span whole rows of C (A packed once per tile); buf: a bf16 weight tile's fp32 sums.
void run_tiles(const std::vector<Tile>& tiles, int64_t max_cols,
               const std::function<void(const Tile&, float*, float*)>& fn) {
  at::parallel_for(0, int64_t(tiles.size()), 1, [&](int64_t b, int64_t e) {
    const auto scratch = scratch_floats(gemm_scratch() + kGradRows * max_cols);
    for (int64_t t = b; t < e; ++t) fn(tiles[t], scratch.get(), scratch.get() + gemm_scratch());
  });
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> moe_experts_grad(const Tensor& grad_, const Tensor& x_, const Tensor& ids,
                                                    const Tensor& gu_, const Tensor& dn_,
                                                    const std::optional<Tensor>& gub_, int64_t first, int64_t chunks,
                                                    std::array<bool, 3> want) {
  check_experts(x_, ids, gu_, dn_, chunks);
  const int64_t M = x_.size(0), Kk = ids.size(1), H = x_.size(1), E = gu_.size(0), I = dn_.size(2), R = M * Kk;
  TORCH_CHECK_VALUE(grad_.dim() == 3 && grad_.size(0) == M && grad_.size(1) == Kk && grad_.size(2) == H,
                    "tonp.moe_experts_grad: grad must be [", M, ", ", Kk, ", ", H, "], got ", grad_.sizes());
  elem_of(grad_, "moe_experts_grad", "grad");
  const Tensor x = x_.contiguous(), gu = gu_.contiguous(), dn = dn_.contiguous();
  Tensor gub;
  if (gub_.has_value() && gub_->defined()) {
    TORCH_CHECK_VALUE(gub_->dim() == 2 && gub_->size(0) == R && gub_->size(1) == 2 * I &&
                          gub_->scalar_type() == x.scalar_type(),
                      "tonp.moe_experts_grad: gate_up_out must be [", R, ", ", 2 * I, "] in x's dtype, got ",
                      gub_->sizes(), " ", gub_->scalar_type());
    gub = gub_->contiguous();
  } else {
    moe_experts_forward(x, ids, gu, dn, first, chunks, &gub);
  }
  Tensor gx = want[0] ? empty_big({M, H}, x.options()) : x.new_empty({0});
  Tensor ggu = want[1] ? empty_big(gu.sizes(), gu.options()) : gu.new_empty({0});
  Tensor gdn = want[2] ? empty_big(dn.sizes(), dn.options()) : dn.new_empty({0});
  const ExpertGroups groups = group_by_expert(ids, first, E);
  const std::vector<int64_t>&start = groups.start, &order = groups.order;
  const Kernels* kern = K();
  // Rows in group order: output gradients, inputs (for dWgu), h = silu(g) u as the forward had it.
  const Tensor g3 = grad_.contiguous();
  Tensor Gs = empty_big({R, H}, g3.options()), xs = want[1] ? empty_big({R, H}, x.options()) : Tensor();
  Tensor hs = want[2] ? empty_big({R, I}, x.options()) : Tensor();
  const Elem xe = elem_of(x, "moe_experts_grad", "x");
  at::parallel_for(0, R, grain_for(4 * H), [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      std::memcpy(static_cast<char*>(Gs.data_ptr()) + j * H * esize(Gs),
                  static_cast<const char*>(g3.data_ptr()) + order[j] * H * esize(g3), H * esize(g3));
      if (want[1])
        std::memcpy(static_cast<char*>(xs.data_ptr()) + j * H * esize(x),
                    static_cast<const char*>(x.data_ptr()) + order[j] / Kk * H * esize(x), H * esize(x));
      if (want[2]) {
        const char* row = static_cast<const char*>(gub.data_ptr()) + j * 2 * I * esize(x);
        kern->silu_mul(row, row + I * esize(x), static_cast<char*>(hs.data_ptr()) + j * I * esize(x), I, xe);
      }
    }
  });
  // Stage 1: dH (needed by every other gradient) and dWdn.
  std::vector<Tile> tiles;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i0 = start[e]; i0 < start[e + 1]; i0 += kGradRows)
      tiles.push_back({0, e, i0, 0});
    if (want[2])
      for (int64_t i0 = 0; i0 < H; i0 += kGradRows) tiles.push_back({1, e, i0, 0});
  }
  Tensor dH = empty_big({R, I}, x.options().dtype(at::kFloat));
  run_tiles(tiles, I, [&](const Tile& t, float* scratch, float* buf) {
    const int64_t n_e = start[t.e + 1] - start[t.e], nj = I;
    if (t.kind == 0) {
      const int64_t mi = std::min(kGradRows, start[t.e + 1] - t.i0);
      kern->gemm(rows_of(Gs, t.i0), offset(rows_of(dn, 0, false, t.e * H * I), 0, t.j0), mi, nj, H,
                 dH.data_ptr<float>() + t.i0 * I + t.j0, I, false, scratch);
    } else {
      const int64_t mi = std::min(kGradRows, H - t.i0);
      weight_tile(kern, offset(rows_of(Gs, start[t.e], true), t.i0, 0), offset(rows_of(hs, start[t.e]), 0, t.j0), mi, nj,
                  n_e, gdn, (t.e * H + t.i0) * I + t.j0, I, buf, scratch);
    }
  });
  // dgu in x's dtype (the operand of the last two GEMMs).
  Tensor dgu = empty_big({R, 2 * I}, x.options());
  at::parallel_for(0, R, grain_for(32 * I), [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      const char* row = static_cast<const char*>(gub.data_ptr()) + j * 2 * I * esize(x);
      char* drow = static_cast<char*>(dgu.data_ptr()) + j * 2 * I * esize(x);
      kern->swiglu_grad(row, row + I * esize(x), dH.data_ptr<float>() + j * I, drow, drow + I * esize(x), I, xe);
    }
  });
  // Stage 2: dWgu and the dX rows.
  tiles.clear();
  for (int64_t e = 0; e < E; ++e) {
    if (want[1])
      for (int64_t i0 = 0; i0 < 2 * I; i0 += kGradRows) tiles.push_back({2, e, i0, 0});
    if (want[0])
      for (int64_t i0 = start[e]; i0 < start[e + 1]; i0 += kGradRows) tiles.push_back({3, e, i0, 0});
  }
  Tensor dXs = want[0] ? empty_big({R, H}, x.options().dtype(at::kFloat)) : Tensor();
  run_tiles(tiles, H, [&](const Tile& t, float* scratch, float* buf) {
    const int64_t n_e = start[t.e + 1] - start[t.e], nj = H;
    if (t.kind == 2) {
      const int64_t mi = std::min(kGradRows, 2 * I - t.i0);
      weight_tile(kern, offset(rows_of(dgu, start[t.e], true), t.i0, 0), offset(rows_of(xs, start[t.e]), 0, t.j0), mi, nj,
                  n_e, ggu, (t.e * 2 * I + t.i0) * H + t.j0, H, buf, scratch);
    } else {
      const int64_t mi = std::min(kGradRows, start[t.e + 1] - t.i0);
      kern->gemm(rows_of(dgu, t.i0), offset(rows_of(gu, 0, false, t.e * 2 * I * H), 0, t.j0), mi, nj, 2 * I,
                 dXs.data_ptr<float>() + t.i0 * H + t.j0, H, false, scratch);
    }
  });
  if (want[0]) {  // token-owned: dx[m] = sum over slots k in order of its rows' dX
    std::vector<int64_t> pos(R);
    for (int64_t j = 0; j < R; ++j) pos[order[j]] = j;
    at::parallel_for(0, M, grain_for(2 * Kk * H), [&](int64_t b, int64_t e) {
      std::vector<float> acc(H);
      for (int64_t m = b; m < e; ++m) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k = 0; k < Kk; ++k) {
          const float* row = dXs.data_ptr<float>() + pos[m * Kk + k] * H;
          for (int64_t h = 0; h < H; ++h) acc[h] += row[h];
        }
        if (xe == Elem::F32)
          std::copy(acc.begin(), acc.end(), gx.data_ptr<float>() + m * H);
        else
          kern->grad_to_bf16(acc.data(), static_cast<uint16_t*>(gx.data_ptr()) + m * H, H);
      }
    });
  }
  return {gx, ggu, gdn};
}

namespace {

std::tuple<Tensor, Tensor> moe_experts_train(const Tensor& x, const Tensor& ids, const Tensor& gu, const Tensor& dn,
                                             int64_t first, int64_t chunks) {
  Tensor gub;
  Tensor y = moe_experts_forward(x, ids, gu, dn, first, chunks, &gub);
  return {y, gub};
}

// The op autograd called before gate_up_out was kept: recomputes it (with the default chunks).
std::tuple<Tensor, Tensor, Tensor> moe_experts_backward(const Tensor& grad, const Tensor& x, const Tensor& ids,
                                                        const Tensor& gu, const Tensor& dn, int64_t first,
                                                        std::array<bool, 3> want) {
  return moe_experts_grad(grad, x, ids, gu, dn, std::nullopt, first, 8, want);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tonp, m) {
  m.def("moe_experts_train(Tensor x, Tensor expert_ids, Tensor gate_up, Tensor down, int first_expert, int chunks) "
        "-> (Tensor, Tensor)");
  m.def("moe_experts_grad(Tensor grad, Tensor x, Tensor expert_ids, Tensor gate_up, Tensor down, "
        "Tensor? gate_up_out, int first_expert, int chunks, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tonp, CPU, m) {
  m.impl("moe_experts_train", &moe_experts_train);
  m.impl("moe_experts_grad", &moe_experts_grad);
  m.impl("moe_experts_backward", &moe_experts_backward);
}

}  // namespace tonp
