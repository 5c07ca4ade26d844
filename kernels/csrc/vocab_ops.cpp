// The torch-facing vocabulary ops: the vocab chunk tree (lse_partial, lse_finish, the fused
// token_logprobs), the row maxima (argmax, max_with_index) and seeded sampling. As in ops.cpp,
// threads only receive whole rows; each row's reduction runs in one kernel call, and a row's
// problem (NaN, +inf max, no finite logit) is reported after the loop for the lowest such row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "ops_common.h"

namespace tonp {
namespace {

// (max, sum) pairs combined by the fixed pairwise tree, in place; the one combine used by the
// in-kernel chunk tree and by the cross-shard finish.
void lse_tree(float* m, float* s, int64_t n, const Kernels* kern) {
  for (int64_t step = 1; step < n; step *= 2)
    for (int64_t c = 0; c + step < n; c += 2 * step) {
      const float ma = m[c], mb = m[c + step], mx = ma > mb || ma != ma ? ma : mb;  // a NaN max stays NaN
      if (mx == -INFINITY) {
        s[c] = s[c] + s[c + step];  // 0 for masked chunks; a NaN chunk's sum stays NaN
      } else {
        const float a = s[c] * kern->exp(ma - mx), b = s[c + step] * kern->exp(mb - mx);
        s[c] = a + b;
      }
      m[c] = mx;
    }
}

// logsumexp from the finished (max, sum) pair: -inf for a masked row (sum 0), NaN for a NaN one.
inline float lse_value(float m, float s) { return m == -INFINITY && s == 0.f ? -INFINITY : m + std::log(s); }

std::tuple<at::Tensor, at::Tensor> lse_partial(const at::Tensor& x_, double temperature, int64_t chunks) {
  TORCH_CHECK_VALUE(x_.dim() == 2, "tonp.lse_partial: logits must be [M, V], got ", x_.sizes());
  const Elem e = elem_of(x_, "lse_partial", "logits");
  check_temperature(temperature, "lse_partial");
  const int64_t M = x_.size(0), V = x_.size(1);
  check_chunks(V, chunks, "lse_partial");
  TORCH_CHECK_VALUE(V > 0, "tonp.lse_partial: empty vocabulary (logits ", x_.sizes(), ")");
  const at::Tensor x = x_.contiguous();
  at::Tensor m = at::empty({M}, x.options().dtype(at::kFloat)), s = at::empty({M}, m.options());
  const int64_t esz = e == Elem::F32 ? 4 : 2;
  const char* xp = static_cast<const char*>(x.data_ptr());
  const Kernels* kern = K();
  at::parallel_for(0, M, grain_for(16 * V), [&](int64_t b, int64_t en) {
    std::vector<float> mc(chunks), sc(chunks);
    for (int64_t r = b; r < en; ++r) {
      kern->lse_chunks(xp + r * V * esz, V, e, float(temperature), int(chunks), mc.data(), sc.data());
      lse_tree(mc.data(), sc.data(), chunks, kern);
      m.data_ptr<float>()[r] = mc[0];
      s.data_ptr<float>()[r] = sc[0];
    }
  });
  return {m, s};
}

at::Tensor lse_finish(const at::Tensor& maxes_, const at::Tensor& sums_) {
  TORCH_CHECK_VALUE(maxes_.dim() == 2 && maxes_.sizes() == sums_.sizes() && maxes_.scalar_type() == at::kFloat &&
                        sums_.scalar_type() == at::kFloat, "tonp.lse_finish: expected fp32 [P, M] maxes and sums, got ",
                    maxes_.sizes(), " ", maxes_.scalar_type(), " and ", sums_.sizes(), " ", sums_.scalar_type());
  const int64_t P = maxes_.size(0), M = maxes_.size(1);
  TORCH_CHECK_VALUE(P >= 1 && (P & (P - 1)) == 0, "tonp.lse_finish: the number of partials must be a power of two, got ", P);
  const at::Tensor mt = maxes_.t().contiguous(), st = sums_.t().contiguous();  // [M, P]
  at::Tensor out = at::empty({M}, mt.options());
  const Kernels* kern = K();
  std::vector<float> mc(P), sc(P);
  for (int64_t r = 0; r < M; ++r) {
    std::copy_n(mt.data_ptr<float>() + r * P, P, mc.data());
    std::copy_n(st.data_ptr<float>() + r * P, P, sc.data());
    lse_tree(mc.data(), sc.data(), P, kern);
    out.data_ptr<float>()[r] = lse_value(mc[0], sc[0]);
  }
  return out;
}

// log p(target) of each row: the target's logit / T minus logsumexp(logits / T), in fp32, the
// same operations as lse_partial -> lse_finish (one partial) -> logit - lse: one call instead of
// a dozen on the rollout path, identical bits (tests/test_kernels_vocab.py).
at::Tensor token_logprobs(const at::Tensor& x_, const at::Tensor& t_, double temperature, int64_t chunks) {
  TORCH_CHECK_VALUE(x_.dim() == 2 && t_.dim() == 1 && t_.size(0) == x_.size(0), "tonp.token_logprobs: expected logits [M, V] "
                    "and targets [M], got ", x_.sizes(), " and ", t_.sizes());
  const Elem e = elem_of(x_, "token_logprobs", "logits");
  check_integer(t_, "token_logprobs", "targets");
  check_temperature(temperature, "token_logprobs");
  const int64_t M = x_.size(0), V = x_.size(1);
  check_chunks(V, chunks, "token_logprobs");
  TORCH_CHECK_VALUE(V > 0, "tonp.token_logprobs: empty vocabulary (logits ", x_.sizes(), ")");
  const at::Tensor x = x_.contiguous(), t = t_.to(at::kLong).contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r)
    TORCH_CHECK_INDEX(tp[r] >= 0 && tp[r] < V, "tonp.token_logprobs: target id out of range [0, ", V, "): ", tp[r]);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kFloat));
  const int64_t esz = e == Elem::F32 ? 4 : 2;
  const char* xp = static_cast<const char*>(x.data_ptr());
  float* op = out.data_ptr<float>();
  const float T = float(temperature);
  const Kernels* kern = K();
  std::vector<int8_t> issues(M, kRowOk);
  at::parallel_for(0, M, grain_for(16 * V), [&](int64_t b, int64_t en) {
    std::vector<float> mc(chunks), sc(chunks);
    for (int64_t r = b; r < en; ++r) {
      const char* row = xp + r * V * esz;
      kern->lse_chunks(row, V, e, T, int(chunks), mc.data(), sc.data());
      lse_tree(mc.data(), sc.data(), chunks, kern);
      issues[r] = row_issue(mc[0], sc[0]);
      const float logit = e == Elem::F32 ? reinterpret_cast<const float*>(row)[tp[r]]
                                         : float(c10::BFloat16(reinterpret_cast<const uint16_t*>(row)[tp[r]],
                                                               c10::BFloat16::from_bits()));
      const float scaled = temperature != 1.0 ? logit / T : logit;
      op[r] = scaled - lse_value(mc[0], sc[0]);
    }
  });
  check_rows(issues, "token_logprobs", temperature);
  return out;
}

// The lowest index of the row's maximum, NaN skipped (an all-NaN row: index 0); kRowNan when
// the row holds a NaN (argmax and sample refuse it, max_with_index skips it).
inline RowIssue row_argmax(const float* row, int64_t V, int64_t* index) {
  int64_t best = 0;
  bool nan = std::isnan(row[0]);
  for (int64_t i = 1; i < V; ++i) {
    if (row[i] > row[best] || (std::isnan(row[best]) && !std::isnan(row[i]))) best = i;  // strict: lowest index wins
    nan = nan || std::isnan(row[i]);
  }
  *index = best;
  return nan ? kRowNan : kRowOk;
}

// (max, lowest index of the max) of each row of fp32 [M, V]; argmax refuses NaN rows.
std::tuple<at::Tensor, at::Tensor> max_rows(const at::Tensor& x_, const char* op, bool want_values, bool refuse_nan) {
  TORCH_CHECK_VALUE(x_.dim() == 2 && x_.size(1) > 0, "tonp.", op, ": logits must be [M, V] with V > 0, got ", x_.sizes());
  elem_of(x_, op, "logits");
  const at::Tensor x = f32_contiguous(x_);
  const int64_t M = x.size(0), V = x.size(1);
  at::Tensor val = want_values ? at::empty({M}, x.options()) : at::Tensor(), idx = at::empty({M}, x.options().dtype(at::kLong));
  std::vector<int8_t> issues(M, kRowOk);
  at::parallel_for(0, M, grain_for(V), [&](int64_t b, int64_t en) {
    for (int64_t r = b; r < en; ++r) {
      const float* row = x.data_ptr<float>() + r * V;
      int64_t best;
      issues[r] = row_argmax(row, V, &best);
      if (want_values) val.data_ptr<float>()[r] = row[best];
      idx.data_ptr<int64_t>()[r] = best;
    }
  });
  if (refuse_nan) check_rows(issues, op, 1.0);
  return {val, idx};
}

std::tuple<at::Tensor, at::Tensor> max_with_index(const at::Tensor& x) { return max_rows(x, "max_with_index", true, false); }

at::Tensor argmax(const at::Tensor& x) { return std::get<1>(max_rows(x, "argmax", false, true)); }

inline uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Seeded sampling: Gumbel-max over the kept tokens, noise = hash(seed, request, position, token);
// temperature 0 is greedy (the lowest index of the max). seed: all 64 bits (as int64).
at::Tensor sample(const at::Tensor& x_, double temperature, int64_t top_k, double top_p, int64_t seed,
                  const at::Tensor& req_, const at::Tensor& pos_) {
  TORCH_CHECK_VALUE(x_.dim() == 2 && x_.size(1) > 0, "tonp.sample: logits must be [M, V] with V > 0, got ", x_.sizes());
  elem_of(x_, "sample", "logits");
  if (temperature != 0.0) check_temperature(temperature, "sample");
  check_integer(req_, "sample", "request_ids");
  check_integer(pos_, "sample", "positions");
  const at::Tensor x = x_.to(at::kFloat).contiguous(), req = req_.to(at::kLong).contiguous(), pos = pos_.to(at::kLong).contiguous();
  const int64_t M = x.size(0), V = x.size(1);
  TORCH_CHECK_VALUE(req.dim() == 1 && pos.dim() == 1 && req.numel() == M && pos.numel() == M,
                    "tonp.sample: request_ids and positions must be [", M, "], got ", req.sizes(), " and ", pos.sizes());
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const float T = float(temperature);
  const Kernels* kern = K();
  std::vector<int8_t> issues(M, kRowOk);
  at::parallel_for(0, M, grain_for(64 * V), [&](int64_t b, int64_t en) {
    std::vector<float> y(temperature == 0.0 ? 0 : V);
    std::vector<int64_t> order(V);
    std::vector<char> keep(V);
    for (int64_t r = b; r < en; ++r) {
      const float* row = x.data_ptr<float>() + r * V;
      if (temperature == 0.0) {
        issues[r] = row_argmax(row, V, out.data_ptr<int64_t>() + r);
        continue;
      }
      bool nan = false;
      float ymax = -INFINITY;
      for (int64_t i = 0; i < V; ++i) {
        y[i] = row[i] / T;
        nan = nan || std::isnan(y[i]);
        ymax = y[i] > ymax ? y[i] : ymax;
      }
      issues[r] = nan ? kRowNan : row_issue(ymax, 0.f);
      if (issues[r] != kRowOk) continue;
      std::fill(keep.begin(), keep.end(), 1);
      const bool use_k = top_k > 0 && top_k < V, use_p = top_p < 1.0;
      if (use_k || use_p) {
        for (int64_t i = 0; i < V; ++i) order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return y[a] > y[c]; });
        int64_t kept = use_k ? top_k : V;
        if (use_p) {  // smallest prefix (of the top-k) whose probability mass reaches top_p
          const float mx = y[order[0]];
          float z = 0.f;
          for (int64_t i = 0; i < kept; ++i) z = z + kern->exp(y[order[i]] - mx);
          float cum = 0.f;
          int64_t n = 0;
          while (n < kept) {
            cum = cum + kern->exp(y[order[n]] - mx) / z;
            ++n;
            if (cum >= float(top_p)) break;
          }
          kept = n;
        }
        std::fill(keep.begin(), keep.end(), 0);
        for (int64_t i = 0; i < kept; ++i) keep[order[i]] = 1;
      }
      const uint64_t base = splitmix64(splitmix64(uint64_t(seed)) ^ splitmix64(uint64_t(req.data_ptr<int64_t>()[r]) + 0x5851f42d4c957f2dull));
      const uint64_t key = splitmix64(base ^ splitmix64(uint64_t(pos.data_ptr<int64_t>()[r]) * 0x2545f4914f6cdd1dull));
      int64_t best = -1;
      double best_score = -INFINITY;
      for (int64_t i = 0; i < V; ++i) {
        if (!keep[i] || y[i] == -INFINITY) continue;
        const uint64_t h = splitmix64(key ^ uint64_t(i));
        const double u = (double(h >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // (0, 1)
        const double score = double(y[i]) - std::log(-std::log(u));
        if (best < 0 || score > best_score) best = i, best_score = score;
      }
      out.data_ptr<int64_t>()[r] = best;  // a kept finite token exists: the row's max is one
    }
  });
  check_rows(issues, "sample", temperature);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tonp, CPU, m) {
  m.impl("lse_partial", &lse_partial);
  m.impl("lse_finish", &lse_finish);
  m.impl("token_logprobs", &token_logprobs);
  m.impl("max_with_index", &max_with_index);
  m.impl("argmax", &argmax);
  m.impl("sample", &sample);
}

}  // namespace tonp
