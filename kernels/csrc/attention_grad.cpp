// The backward of causal attention over packed sequences (attention_varlen): the standard
// flash-attention backward in fp32, one task per (sequence, KV head), its G query heads and
// blocks of 64 queries in order:
//   S = Q K^T scale (keys 0..t of the query's own sequence), P = softmax(S),
//   dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = dS K scale, dK += dS^T Q scale.
// Every product is a call of the backward GEMM; a task owns its sequence's rows of dK and dV, so
// the result is the same bits for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "grad_common.h"

namespace tonp {
namespace {

using at::Tensor;

constexpr int64_t kQBlock = 64;

int64_t esz(const Tensor& t) { return t.scalar_type() == at::kFloat ? 4 : 2; }
Elem el(const Tensor& t) { return t.scalar_type() == at::kFloat ? Elem::F32 : Elem::BF16; }

// Rows t0.. of head h of a [T, heads, D] tensor as a [rows, D] operand (transposed: [D, rows]).
GemmOperand head_rows(const Tensor& t, int64_t t0, int64_t h, bool transposed = false) {
  const int64_t ld = t.size(1) * t.size(2);
  return {static_cast<const char*>(t.data_ptr()) + (t0 * ld + h * t.size(2)) * esz(t), transposed ? 1 : ld,
          transposed ? ld : 1, el(t)};
}

std::tuple<Tensor, Tensor, Tensor> attention_varlen_backward(const Tensor& dout_, const Tensor& q_, const Tensor& k_,
                                                             const Tensor& v_, const Tensor& out_, const Tensor& cu_,
                                                             double scale) {
  TORCH_CHECK_VALUE(q_.dim() == 3 && k_.dim() == 3 && k_.sizes() == v_.sizes() && dout_.sizes() == q_.sizes() &&
                        out_.sizes() == q_.sizes() && q_.size(0) == k_.size(0) && q_.size(2) == k_.size(2) &&
                        q_.size(1) % k_.size(1) == 0,
                    "tonp.attention_varlen_backward: expected q, out, grad [T, Hq, D] and k, v [T, Hkv, D], got ",
                    q_.sizes(), ", ", k_.sizes(), ", ", v_.sizes(), ", ", out_.sizes(), ", ", dout_.sizes());
  const Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous(), dout = dout_.contiguous(),
               out = out_.contiguous(), cu = cu_.to(at::kLong).contiguous();
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), G = Hq / Hkv, S = cu.numel() - 1;
  const int64_t* cp = cu.data_ptr<int64_t>();
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor dq = empty_big({T, Hq, D}, f32), dk = empty_big({T, Hkv, D}, f32), dv = empty_big({T, Hkv, D}, f32);
  const Kernels* kern = K();
  int64_t max_len = 0;
  for (int64_t s = 0; s < S; ++s) max_len = std::max(max_len, cp[s + 1] - cp[s]);
  at::parallel_for(0, S * Hkv, 1, [&](int64_t b, int64_t e) {
    const auto scratch = scratch_floats(gemm_scratch());
    std::vector<float> P(kQBlock * max_len), dP(kQBlock * max_len), delta(kQBlock);
    for (int64_t task = b; task < e; ++task) {
      const int64_t s = task / Hkv, h = task % Hkv, t0 = cp[s], L = cp[s + 1] - t0;
      for (int64_t t = 0; t < L; ++t) {
        std::fill_n(dk.data_ptr<float>() + ((t0 + t) * Hkv + h) * D, D, 0.f);
        std::fill_n(dv.data_ptr<float>() + ((t0 + t) * Hkv + h) * D, D, 0.f);
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        for (int64_t qb = 0; qb < L; qb += kQBlock) {
          const int64_t nq = std::min(kQBlock, L - qb), nk = qb + nq;  // keys 0..nk-1 of the sequence
          kern->gemm(head_rows(q, t0 + qb, hq), head_rows(k, t0, h, true), nq, nk, D, P.data(), nk, false, scratch.get());
          kern->gemm(head_rows(dout, t0 + qb, hq), head_rows(v, t0, h, true), nq, nk, D, dP.data(), nk, false,
                     scratch.get());
          for (int64_t i = 0; i < nq; ++i) {
            float* pr = P.data() + i * nk;
            float* dpr = dP.data() + i * nk;
            const int64_t valid = qb + i + 1;
            float mx = -INFINITY;
            for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, pr[j] * float(scale));
            double z = 0;
            for (int64_t j = 0; j < valid; ++j) z += (pr[j] = std::exp(pr[j] * float(scale) - mx));
            double dl = 0;  // rowsum(dO O) for this query
            const int64_t row = ((t0 + qb + i) * Hq + hq) * D;
            for (int64_t d = 0; d < D; ++d) {
              const float o = out.scalar_type() == at::kFloat ? out.data_ptr<float>()[row + d]
                                                              : float(out.data_ptr<at::BFloat16>()[row + d]);
              const float go = dout.scalar_type() == at::kFloat ? dout.data_ptr<float>()[row + d]
                                                                : float(dout.data_ptr<at::BFloat16>()[row + d]);
              dl += double(o) * go;
            }
            for (int64_t j = 0; j < valid; ++j) {
              pr[j] = float(pr[j] / z);
              dpr[j] = pr[j] * (dpr[j] - float(dl)) * float(scale);  // dS, scaled
            }
            for (int64_t j = valid; j < nk; ++j) pr[j] = dpr[j] = 0.f;
          }
          const GemmOperand Pt{P.data(), 1, nk, Elem::F32}, dSt{dP.data(), 1, nk, Elem::F32};
          const GemmOperand dS{dP.data(), nk, 1, Elem::F32};
          gemm_rows(kern, Pt, head_rows(dout, t0 + qb, hq), nk, D, nq, dv.data_ptr<float>() + (t0 * Hkv + h) * D, Hkv * D,
                    true, scratch.get());
          gemm_rows(kern, dSt, head_rows(q, t0 + qb, hq), nk, D, nq, dk.data_ptr<float>() + (t0 * Hkv + h) * D, Hkv * D,
                    true, scratch.get());
          kern->gemm(dS, head_rows(k, t0, h), nq, D, nk, dq.data_ptr<float>() + ((t0 + qb) * Hq + hq) * D, Hq * D, false,
                     scratch.get());
        }
      }
    }
  });
  return {dq.to(q_.scalar_type()), dk.to(k_.scalar_type()), dv.to(v_.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tonp, m) {
  m.def("attention_varlen_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor cu_seqlens, "
        "float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tonp, CPU, m) { m.impl("attention_varlen_backward", &attention_varlen_backward); }

}  // namespace tonp
