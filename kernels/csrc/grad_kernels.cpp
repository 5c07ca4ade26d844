// Backward ops of linear and the row-wise tonp ops (tonp::*_backward; autograd.cpp calls them,
// and traced graphs see each as one opaque call with a fake implementation). Standard formulas
// in fp32, cast to the inputs' dtypes; every reduction runs in a fixed order inside one thread
// (rows over their own elements; column sums row by row), so gradients are deterministic for any
// thread count. Linear's GEMMs go through the backward GEMM over fixed tiles. Unwanted gradients
// come back as empty tensors.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "grad_common.h"
#include <torch/library.h>

namespace tonp {

using at::Tensor;

namespace {
Tensor f32(const Tensor& t) { return t.to(at::kFloat).contiguous(); }
Tensor none_like(const Tensor& t) { return t.new_empty({0}); }

// --- linear: y = x w^T + b: dx = g w, dw = g^T x, db = column sums of g ------------------------
std::tuple<Tensor, Tensor, Tensor> linear_backward(const Tensor& g_, const Tensor& x, const Tensor& w,
                                                   std::array<bool, 3> want, std::optional<at::ScalarType> bias_dtype) {
  const Tensor g = g_.contiguous();
  const int64_t M = g.size(0), N = g.size(1), Kd = w.size(1);
  return {want[0] ? mm_into(operand(g), operand(w), M, Kd, N, g.options(), x.scalar_type()) : none_like(x),
          want[1] ? mm_into(operand(g, true), operand(x), N, Kd, M, g.options(), w.scalar_type()) : none_like(w),
          want[2] ? column_sums(f32(g)).to(bias_dtype.value_or(g.scalar_type())) : none_like(g)};
}

// --- rms_norm: y = w * (x r), r = 1 / sqrt(mean(x^2) + eps) ---------------------------------------
// dx = r (gw - xhat mean(gw xhat)) with gw = g w; dw = sum over rows of g xhat.
std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& g_, const Tensor& x_, const Tensor& w_, double eps,
                                             std::array<bool, 2> want) {
  const bool want_x = want[0], want_w = want[1];
  const int64_t H = x_.size(-1), M = H ? x_.numel() / H : 0;
  const Tensor g = f32(g_), x = f32(x_), w = f32(w_);
  Tensor gx = want_x ? at::empty({M, H}, x.options()) : Tensor(), gwr = want_w ? at::empty({M, H}, x.options()) : Tensor();
  const float *gp = g.data_ptr<float>(), *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  at::parallel_for(0, M, grain_for(8 * H), [&](int64_t b, int64_t e) {
    std::vector<float> xh(H), gh(H);
    for (int64_t m = b; m < e; ++m) {
      const float *xr = xp + m * H, *gr = gp + m * H;
      double ss = 0;
      for (int64_t j = 0; j < H; ++j) ss += double(xr[j]) * xr[j];
      const float r = float(1.0 / std::sqrt(ss / double(H) + eps));
      double dot = 0;
      for (int64_t j = 0; j < H; ++j) {
        xh[j] = xr[j] * r;
        gh[j] = gr[j] * wp[j];
        dot += double(gh[j]) * xh[j];
      }
      const float mean = float(dot / double(H));
      if (want_x)
        for (int64_t j = 0; j < H; ++j) gx.data_ptr<float>()[m * H + j] = r * (gh[j] - xh[j] * mean);
      if (want_w)
        for (int64_t j = 0; j < H; ++j) gwr.data_ptr<float>()[m * H + j] = gr[j] * xh[j];
    }
  });
  return {want_x ? gx.view(x_.sizes()).to(x_.scalar_type()) : none_like(x_),
          want_w ? column_sums(gwr).to(w_.scalar_type()) : none_like(w_)};
}

// --- silu_mul: out = silu(g) u --------------------------------------------------------------------
std::tuple<Tensor, Tensor> silu_mul_backward(const Tensor& d_, const Tensor& gate_, const Tensor& up_) {
  const Tensor d = f32(d_), g = f32(gate_), u = f32(up_);
  Tensor dg = at::empty_like(g), du = at::empty_like(g);
  const int64_t n = g.numel();
  at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float gv = g.data_ptr<float>()[i], s = 1.f / (1.f + std::exp(-gv)), dv = d.data_ptr<float>()[i];
      dg.data_ptr<float>()[i] = dv * u.data_ptr<float>()[i] * (s * (1.f + gv * (1.f - s)));
      du.data_ptr<float>()[i] = dv * (gv * s);
    }
  });
  return {dg.view(gate_.sizes()).to(gate_.scalar_type()), du.view(up_.sizes()).to(up_.scalar_type())};
}

// --- moe_route: w = softmax(logits)[ids] (renormalised by their sum when normalize) ---------------
Tensor moe_route_backward(const Tensor& gw_, const Tensor& logits_, const Tensor& ids_, const Tensor& w_, bool normalize) {
  const Tensor gw = f32(gw_), x = f32(logits_), w = f32(w_), ids = ids_.contiguous();
  const int64_t M = x.size(0), E = x.size(1), Kk = ids.size(1);
  Tensor dl = at::empty({M, E}, x.options());
  at::parallel_for(0, M, grain_for(8 * E), [&](int64_t b, int64_t e) {
    std::vector<float> p(E), dp(E);
    for (int64_t m = b; m < e; ++m) {
      const float* xr = x.data_ptr<float>() + m * E;
      const float* gr = gw.data_ptr<float>() + m * Kk;
      const float* wr = w.data_ptr<float>() + m * Kk;
      const int64_t* ir = ids.data_ptr<int64_t>() + m * Kk;
      float mx = -INFINITY;
      for (int64_t i = 0; i < E; ++i) mx = std::max(mx, xr[i]);
      double z = 0;
      for (int64_t i = 0; i < E; ++i) z += (p[i] = std::exp(xr[i] - mx));
      for (int64_t i = 0; i < E; ++i) p[i] = float(p[i] / z), dp[i] = 0.f;
      double sgw = 0, S = 0;  // w_k = p_k / S: d p_k = (gw_k - sum_j gw_j w_j) / S
      for (int64_t k = 0; k < Kk; ++k) sgw += double(gr[k]) * wr[k], S += p[ir[k]];
      for (int64_t k = 0; k < Kk; ++k) dp[ir[k]] += normalize ? float((gr[k] - sgw) / S) : gr[k];
      double dot = 0;
      for (int64_t i = 0; i < E; ++i) dot += double(dp[i]) * p[i];
      float* dr = dl.data_ptr<float>() + m * E;
      for (int64_t i = 0; i < E; ++i) dr[i] = p[i] * (dp[i] - float(dot));
    }
  });
  return dl.to(logits_.scalar_type());
}

// --- moe_combine: out = sum_k w_k y_k --------------------------------------------------------------
std::tuple<Tensor, Tensor> moe_combine_backward(const Tensor& g_, const Tensor& w_, const Tensor& y_,
                                                std::array<bool, 2> want) {
  const bool want_w = want[0], want_y = want[1];
  const Tensor g = f32(g_), w = f32(w_), y = f32(y_);
  const int64_t M = y.size(0), Kk = y.size(1), H = y.size(2);
  Tensor gw = want_w ? at::empty({M, Kk}, w.options()) : Tensor(), gy = want_y ? at::empty({M, Kk, H}, y.options()) : Tensor();
  at::parallel_for(0, M, grain_for(4 * Kk * H), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* gr = g.data_ptr<float>() + m * H;
      for (int64_t k = 0; k < Kk; ++k) {
        const float* yr = y.data_ptr<float>() + (m * Kk + k) * H;
        const float wk = w.data_ptr<float>()[m * Kk + k];
        if (want_w) {
          double dot = 0;
          for (int64_t h = 0; h < H; ++h) dot += double(gr[h]) * yr[h];
          gw.data_ptr<float>()[m * Kk + k] = float(dot);
        }
        if (want_y)
          for (int64_t h = 0; h < H; ++h) gy.data_ptr<float>()[(m * Kk + k) * H + h] = wk * gr[h];
      }
    }
  });
  return {want_w ? gw.to(w_.scalar_type()) : none_like(w_), want_y ? gy.to(y_.scalar_type()) : none_like(y_)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tonp, m) {
  m.def("linear_backward(Tensor grad, Tensor x, Tensor weight, bool[3] output_mask, ScalarType? bias_dtype) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps, bool[2] output_mask) -> (Tensor, Tensor)");
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("moe_route_backward(Tensor grad_weights, Tensor router_logits, Tensor expert_ids, Tensor weights, "
        "bool normalize) -> Tensor");
  m.def("moe_combine_backward(Tensor grad, Tensor weights, Tensor expert_out, bool[2] output_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tonp, CPU, m) {
  m.impl("linear_backward", &linear_backward);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("silu_mul_backward", &silu_mul_backward);
  m.impl("moe_route_backward", &moe_route_backward);
  m.impl("moe_combine_backward", &moe_combine_backward);
}

}  // namespace tonp
