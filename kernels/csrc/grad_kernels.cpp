// Backward ops of linear and the row-wise tonp ops (tonp::*_backward; autograd.cpp calls them,
// and traced graphs see each as one opaque call with a fake implementation). Standard formulas
// in fp32, cast to the inputs' dtypes; every reduction runs in a fixed order inside one thread
// (rows over their own elements; column sums row by row), so gradients are deterministic for any
// thread count. Linear's GEMMs go through the backward GEMM over fixed tiles. Unwanted gradients
// come back as empty tensors.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
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

// f(T{}) with T the C++ type of a float32 / bfloat16 tensor; kernels read and write their
// tensors in place (no widened copies) and compute in fp32.
template <typename F>
void with_type(const Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat)
    f(float{});
  else
    f(at::BFloat16{});
}

// The eight partial sums of a fixed-order reduction (element j went to lane j % 8), combined.
float lanes_sum(const float* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// t contiguous in `like`'s dtype (the gradient arrives in the output's dtype, normally x's).
Tensor as_dtype_of(const Tensor& t, const Tensor& like) { return t.to(like.scalar_type()).contiguous(); }

// --- linear: y = x w^T + b: dx = g w, dw = g^T x, db = column sums of g ------------------------
// With bf16 x and weight, an fp32 output gradient (the LM head's fp32 logits) is rounded to bf16
// once for the two GEMMs (bf16 products, fp32 sums: the bf16 model's own precision), as a bf16
// output's gradient would be; the bias gradient sums it in fp32.
std::tuple<Tensor, Tensor, Tensor> linear_backward(const Tensor& g_, const Tensor& x, const Tensor& w,
                                                   std::array<bool, 3> want, std::optional<at::ScalarType> bias_dtype) {
  // The GEMMs read the operands by these sizes: a mismatched call would read past a tensor's end.
  TORCH_CHECK_VALUE(g_.dim() == 2 && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && g_.size(0) == x.size(0) &&
                        g_.size(1) == w.size(0),
                    "tonp.linear_backward: grad ", g_.sizes(), ", x ", x.sizes(), " and weight ", w.sizes(),
                    " do not match: expected grad [M, N], x [M, K] and weight [N, K]");
  const bool bf16 = x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16;
  const Tensor g = (bf16 && (want[0] || want[1]) ? g_.to(at::kBFloat16) : g_).contiguous();
  const int64_t M = g.size(0), N = g.size(1), Kd = w.size(1);
  return {want[0] ? mm_into(operand(g), operand(w), M, Kd, N, g.options(), x.scalar_type()) : none_like(x),
          want[1] ? mm_into(operand(g, true), operand(x), N, Kd, M, g.options(), w.scalar_type()) : none_like(w),
          want[2] ? column_sums(f32(g_)).to(bias_dtype.value_or(g_.scalar_type())) : none_like(g_)};
}

// --- rms_norm: y = w * (x r), r = 1 / sqrt(mean(x^2) + eps) ---------------------------------------
// dx = r (gw - xhat mean(gw xhat)) with gw = g w; dw = sum over rows of g xhat.
std::tuple<Tensor, Tensor> rms_norm_backward(const Tensor& g_, const Tensor& x_, const Tensor& w_, double eps,
                                             std::array<bool, 2> want) {
  const int64_t H = x_.size(-1), M = H ? x_.numel() / H : 0;
  const Tensor x = x_.contiguous(), g = as_dtype_of(g_, x), w = f32(w_);
  Tensor gx = want[0] ? empty_big(x.sizes(), x.options()) : none_like(x);
  Tensor gwr = want[1] ? empty_big({M, H}, x.options().dtype(at::kFloat)) : Tensor();
  const float* wp = w.data_ptr<float>();
  with_type(x, [&](auto tag) {
    using T = decltype(tag);
    const T *xp = x.data_ptr<T>(), *gp = g.data_ptr<T>();
    T* gxp = want[0] ? gx.data_ptr<T>() : nullptr;
    float* gwp = want[1] ? gwr.data_ptr<float>() : nullptr;
    const int64_t H8 = H / 8 * 8;
    at::parallel_for(0, M, grain_for(8 * H), [&](int64_t b, int64_t e) {
      std::vector<float> xh(H), gh(H);
      float* xv = xh.data();
      float* gv = gh.data();
      for (int64_t m = b; m < e; ++m) {
        const T *xr = xp + m * H, *gr = gp + m * H;
        // Element j goes to lane j % 8: blocks of eight independent lanes (the compiler's vectors).
        float ss[8] = {0}, dot[8] = {0};
        for (int64_t j = 0; j < H; ++j) xv[j] = float(xr[j]), gv[j] = float(gr[j]);
        for (int64_t j = 0; j < H8; j += 8)
          for (int l = 0; l < 8; ++l) ss[l] += xv[j + l] * xv[j + l];
        for (int64_t j = H8; j < H; ++j) ss[j - H8] += xv[j] * xv[j];
        const float r = 1.f / std::sqrt(lanes_sum(ss) / float(H) + float(eps));
        if (want[1]) {
          float* o = gwp + m * H;
          for (int64_t j = 0; j < H; ++j) xv[j] = xv[j] * r, o[j] = gv[j] * xv[j];
        } else {
          for (int64_t j = 0; j < H; ++j) xv[j] = xv[j] * r;
        }
        for (int64_t j = 0; j < H; ++j) gv[j] = gv[j] * wp[j];
        for (int64_t j = 0; j < H8; j += 8)
          for (int l = 0; l < 8; ++l) dot[l] += gv[j + l] * xv[j + l];
        for (int64_t j = H8; j < H; ++j) dot[j - H8] += gv[j] * xv[j];
        const float mean = lanes_sum(dot) / float(H);
        if (want[0])
          for (int64_t j = 0; j < H; ++j) gxp[m * H + j] = T(r * (gv[j] - xv[j] * mean));
      }
    });
  });
  return {gx, want[1] ? column_sums(gwr).to(w_.scalar_type()) : none_like(w_)};
}

// --- silu_mul: out = silu(g) u --------------------------------------------------------------------
std::tuple<Tensor, Tensor> silu_mul_backward(const Tensor& d_, const Tensor& gate_, const Tensor& up_) {
  const Tensor g = gate_.contiguous(), u = as_dtype_of(up_, g), d = as_dtype_of(d_, g);
  Tensor dg = empty_big(g.sizes(), g.options()), du = empty_big(g.sizes(), g.options());
  with_type(g, [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, g.numel(), 1 << 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float gv = float(g.data_ptr<T>()[i]), s = 1.f / (1.f + std::exp(-gv)), dv = float(d.data_ptr<T>()[i]);
        dg.data_ptr<T>()[i] = T(dv * float(u.data_ptr<T>()[i]) * (s * (1.f + gv * (1.f - s))));
        du.data_ptr<T>()[i] = T(dv * (gv * s));
      }
    });
  });
  return {dg.to(gate_.scalar_type()), du.to(up_.scalar_type())};
}

// --- rope: out = x c + R(x) s, R(x) = cat(-x2, x1); dx = g c + R^T(g s), R^T(y) = cat(y2, -y1) -----
// c, s: the table rows at each row's position, rounded to x's dtype as the forward uses them.
Tensor rope_backward(const Tensor& g_, const Tensor& cos_, const Tensor& sin_, const Tensor& pos_, at::ScalarType dt) {
  const Tensor g = g_.to(dt).contiguous(), c = f32(cos_), sn = f32(sin_), pos = pos_.to(at::kLong).contiguous();
  const int64_t T_ = g.size(0), Hh = g.size(1), D = g.size(2), half = D / 2;
  Tensor dx = empty_big(g.sizes(), g.options());
  with_type(g, [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, T_ * Hh, grain_for(4 * D), [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        const int64_t p = pos.data_ptr<int64_t>()[row / Hh];
        const float *cr = c.data_ptr<float>() + p * D, *sr = sn.data_ptr<float>() + p * D;
        const T* gr = g.data_ptr<T>() + row * D;
        T* o = dx.data_ptr<T>() + row * D;
        for (int64_t d = 0; d < D; ++d) {
          const int64_t dd = d < half ? d + half : d - half;
          const float rt = float(gr[dd]) * float(T(sr[dd]));  // (g s) at the partner element
          o[d] = T(float(gr[d]) * float(T(cr[d])) + (d < half ? rt : -rt));
        }
      }
    });
  });
  return dx;
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
  const Tensor y = y_.contiguous(), g = as_dtype_of(g_, y), w = f32(w_);
  const int64_t M = y.size(0), Kk = y.size(1), H = y.size(2);
  Tensor gw = want[0] ? at::empty({M, Kk}, w.options()) : none_like(w_);
  Tensor gy = want[1] ? empty_big(y.sizes(), y.options()) : none_like(y_);
  with_type(y, [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, M, grain_for(4 * Kk * H), [&](int64_t b, int64_t e) {
      for (int64_t m = b; m < e; ++m) {
        const T* gr = g.data_ptr<T>() + m * H;
        for (int64_t k = 0; k < Kk; ++k) {
          const T* yr = y.data_ptr<T>() + (m * Kk + k) * H;
          const float wk = w.data_ptr<float>()[m * Kk + k];
          if (want[0]) {
            float dot[8] = {0};
            for (int64_t h = 0; h < H; ++h) dot[h % 8] += float(gr[h]) * float(yr[h]);
            gw.data_ptr<float>()[m * Kk + k] = lanes_sum(dot);
          }
          if (want[1]) {
            T* o = gy.data_ptr<T>() + (m * Kk + k) * H;
            for (int64_t h = 0; h < H; ++h) o[h] = T(wk * float(gr[h]));
          }
        }
      }
    });
  });
  return {want[0] ? gw.to(w_.scalar_type()) : gw, want[1] ? gy.to(y_.scalar_type()) : gy};
}

// --- embedding: y = weight[ids]; dweight[v] = sum of the gradient rows whose id is v -------------
// Each row of the [num_rows, H] gradient is written once, by one thread: zeros where no id points,
// else the fp32 sum of its gradient rows in their order, rounded once (no zero-filled buffer, no
// scatter). ids are grouped per row by a stable counting sort first.
Tensor embedding_backward(const Tensor& g_, const Tensor& ids_, int64_t num_rows) {
  TORCH_CHECK(g_.dim() >= 1 && ids_.numel() * (g_.dim() ? g_.size(-1) : 0) == g_.numel(),
              "tonp::embedding_backward: grad ", g_.sizes(), " does not match ids ", ids_.sizes());
  const Tensor ids = ids_.to(at::kLong).contiguous().view(-1);
  const int64_t N = ids.numel(), H = g_.size(-1);
  const Tensor g = g_.contiguous().view({N, H});
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(num_rows + 1, 0), order(N);
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < num_rows, "tonp::embedding_backward: id ", ip[i], " at ", i,
                " is outside [0, ", num_rows, ")");
    ++start[ip[i] + 1];
  }
  for (int64_t v = 0; v < num_rows; ++v) start[v + 1] += start[v];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < N; ++i) order[next[ip[i]]++] = i;
  }
  Tensor out = empty_big({num_rows, H}, g.options());
  with_type(g, [&](auto tag) {
    using T = decltype(tag);
    const T* gp = g.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, num_rows, grain_for(H), [&](int64_t b, int64_t e) {
      std::vector<float> acc(H);
      for (int64_t v = b; v < e; ++v) {
        T* o = op + v * H;
        const int64_t s0 = start[v], s1 = start[v + 1];
        if (s0 == s1) {
          std::memset(static_cast<void*>(o), 0, sizeof(T) * H);
        } else if (s1 - s0 == 1) {
          std::memcpy(static_cast<void*>(o), gp + order[s0] * H, sizeof(T) * H);
        } else {
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t s = s0; s < s1; ++s) {
            const T* r = gp + order[s] * H;
            for (int64_t j = 0; j < H; ++j) acc[j] += float(r[j]);
          }
          for (int64_t j = 0; j < H; ++j) o[j] = T(acc[j]);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tonp, m) {
  m.def("linear_backward(Tensor grad, Tensor x, Tensor weight, bool[3] output_mask, ScalarType? bias_dtype) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps, bool[2] output_mask) -> (Tensor, Tensor)");
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("rope_backward(Tensor grad, Tensor cos, Tensor sin, Tensor positions, ScalarType dtype) -> Tensor");
  m.def("moe_route_backward(Tensor grad_weights, Tensor router_logits, Tensor expert_ids, Tensor weights, "
        "bool normalize) -> Tensor");
  m.def("moe_combine_backward(Tensor grad, Tensor weights, Tensor expert_out, bool[2] output_mask) -> (Tensor, Tensor)");
  m.def("embedding_backward(Tensor grad, Tensor ids, int num_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tonp, CPU, m) {
  m.impl("linear_backward", &linear_backward);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("silu_mul_backward", &silu_mul_backward);
  m.impl("rope_backward", &rope_backward);
  m.impl("moe_route_backward", &moe_route_backward);
  m.impl("moe_combine_backward", &moe_combine_backward);
  m.impl("embedding_backward", &embedding_backward);
}

}  // namespace tonp
