// The torch-facing vocabulary ops: the vocab chunk tree (lse_partial, lse_finish, the fused
// token_logprobs), the row maxima (argmax, max_with_index) and seeded sampling. As in ops.cpp,
// threads only receive whole rows; each row's reduction runs in one kernel call, and a row's
// problem (NaN, +inf max, no finite logit) is reported after the loop for the lowest such row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
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

// logsumexp from the finished (max, sum) pair: m + log(s) with tonp's log (simd.h vlog, the
// Triton kernels' numerics.log: the same bits on every device); -inf for a masked row (sum 0),
// NaN for a NaN one.
inline float lse_value(float m, float s, const Kernels* kern) {
  if (m == -INFINITY && s == 0.f) return -INFINITY;
  float log_s;
  kern->log_n(&s, &log_s, 1);
  return m + log_s;
}

// A row's (max, sum) of x / T: the chunk partials, each chunk max made +0 if it is -0 (so that no
// output depends on which of equal maxima a scan met first: any max order gives these bits),
// finished by the pairwise tree. mc, sc: `chunks` floats of scratch.
inline void row_partial(const char* row, int64_t V, Elem e, float T, int64_t chunks, float* mc, float* sc,
                        const Kernels* kern) {
  kern->lse_chunks(row, V, e, T, int(chunks), mc, sc);
  for (int64_t c = 0; c < chunks; ++c) mc[c] = mc[c] + 0.f;
  lse_tree(mc, sc, chunks, kern);
}

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
      row_partial(xp + r * V * esz, V, e, float(temperature), chunks, mc.data(), sc.data(), kern);
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
    out.data_ptr<float>()[r] = lse_value(mc[0], sc[0], kern);
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
      row_partial(row, V, e, T, chunks, mc.data(), sc.data(), kern);
      issues[r] = row_issue(mc[0], sc[0]);
      const float logit = e == Elem::F32 ? reinterpret_cast<const float*>(row)[tp[r]]
                                         : float(c10::BFloat16(reinterpret_cast<const uint16_t*>(row)[tp[r]],
                                                               c10::BFloat16::from_bits()));
      const float scaled = temperature != 1.0 ? logit / T : logit;
      op[r] = scaled - lse_value(mc[0], sc[0], kern);
    }
  });
  check_rows(issues, "token_logprobs", temperature);
  return out;
}

// The lowest index of the row's maximum, NaN skipped (an all-NaN row: index 0); kRowNan when
// the row holds a NaN (argmax and sample refuse it, max_with_index skips it). The maximum by the
// table's row_max (eight lanes), then the first index that compares equal to it: the index a
// strict > scan keeps, zeros of either sign included (an all-NaN row: none, so 0).
inline RowIssue row_argmax(const float* row, int64_t V, int64_t* index, const Kernels* kern) {
  bool nan = false;
  const float mx = kern->row_max(row, V, Elem::F32, 1.0f, nullptr, &nan);
  int64_t best = 0;
  while (best < V && !(row[best] == mx)) ++best;
  *index = best < V ? best : 0;
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
  const Kernels* kern = K();
  at::parallel_for(0, M, grain_for(V), [&](int64_t b, int64_t en) {
    for (int64_t r = b; r < en; ++r) {
      const float* row = x.data_ptr<float>() + r * V;
      int64_t best;
      issues[r] = row_argmax(row, V, &best, kern);
      if (want_values) val.data_ptr<float>()[r] = row[best];
      idx.data_ptr<int64_t>()[r] = best;
    }
  });
  if (refuse_nan) check_rows(issues, op, 1.0);
  return {val, idx};
}

std::tuple<at::Tensor, at::Tensor> max_with_index(const at::Tensor& x) { return max_rows(x, "max_with_index", true, false); }

at::Tensor argmax(const at::Tensor& x) { return std::get<1>(max_rows(x, "argmax", false, true)); }

// --- seeded sampling (CONTRACT.md "sample"; tonp_kernels/accel/sample.py is its Triton twin) ---
// The rank of a token: (y descending, id ascending) as one integer, larger = earlier. y's bits
// are mapped to an order-preserving integer (-0 read as +0).
inline uint64_t rank_key(float y, int64_t i) {
  const float z = y + 0.f;
  uint32_t b;
  std::memcpy(&b, &z, 4);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t(b) << 32) | uint64_t(0xffffffffu - uint32_t(i));
}

// The integer probability mass of a token for top-p: trunc(exp(y - ymax) * 2^32) (tonp's exp).
inline int64_t top_p_mass(float y, float ymax, const Kernels* kern) {
  return int64_t(kern->exp(y - ymax) * 4294967296.0f);
}

// The kept set of top-k / top-p as a rank cut: token i is kept iff rank_key(y_i, i) >= the cut.
// top-k: the k highest ranks. top-p: of those, the shortest prefix in rank order whose integer
// mass reaches ceil(p24 * Q / 2^24), Q the mass of the top-k set, p24 = ceil(top_p * 2^24).
// Integer sums are associative: any device and any order find the same cut. The prefix is found
// without sorting the vocabulary: the masses are summed per bucket of the rank key's top 16 bits
// (every key of a bucket ranks above every key of the buckets below it), the buckets walked from
// the top to the one where the prefix reaches the need, and only that bucket's tokens sorted.
struct CutScratch {
  std::vector<uint64_t> key, sel;
  std::vector<int64_t> mass, bucket;
  std::vector<std::pair<uint64_t, int64_t>> ranked;
};
constexpr int kCutShift = 48;  // a bucket: the rank key's top 64 - 48 = 16 bits

uint64_t kept_cut(const float* y, int64_t V, float ymax, int64_t top_k, double top_p, const Kernels* kern,
                  CutScratch& t) {
  t.key.resize(V);
  uint64_t* key = t.key.data();
  for (int64_t i = 0; i < V; ++i) key[i] = rank_key(y[i], i);
  uint64_t cut = 0;
  if (top_k > 0 && top_k < V) {
    t.sel.assign(key, key + V);
    std::nth_element(t.sel.begin(), t.sel.begin() + (top_k - 1), t.sel.end(), std::greater<>());
    cut = t.sel[top_k - 1];
  }
  if (top_p < 1.0) {
    t.mass.resize(V);
    t.bucket.assign(size_t(1) << (64 - kCutShift), 0);
    int64_t Q = 0;  // the top-k set's mass (zero-mass tokens rank after every positive one)
    for (int64_t i = 0; i < V; ++i) {
      const int64_t q = key[i] >= cut ? top_p_mass(y[i], ymax, kern) : 0;
      t.mass[i] = q;
      t.bucket[key[i] >> kCutShift] += q;
      Q += q;
    }
    const int64_t p24 = int64_t(std::ceil(top_p * 16777216.0));
    const int64_t need = p24 * (Q >> 24) + ((p24 * (Q & 0xffffff) + 0xffffff) >> 24);  // in [1, Q]
    int64_t S = 0, B = int64_t(t.bucket.size()) - 1;
    while (S + t.bucket[B] < need) S += t.bucket[B--];  // stops: the buckets sum to Q >= need
    t.ranked.clear();
    for (int64_t i = 0; i < V; ++i)
      if (t.mass[i] > 0 && int64_t(key[i] >> kCutShift) == B) t.ranked.emplace_back(key[i], t.mass[i]);
    std::sort(t.ranked.begin(), t.ranked.end(), std::greater<>());
    for (const auto& [k, q] : t.ranked)
      if ((S += q) >= need) {
        cut = k;
        break;
      }
  }
  return cut;
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
  TORCH_CHECK_VALUE(V < (int64_t(1) << 31), "tonp.sample: the vocabulary must be below 2**31 tokens, got ", V);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  const float T = float(temperature);
  const Kernels* kern = K();
  std::vector<int8_t> issues(M, kRowOk);
  at::parallel_for(0, M, grain_for(64 * V), [&](int64_t b, int64_t en) {
    const int64_t n = temperature == 0.0 ? 0 : V;
    std::vector<float> y(n), score(n);
    std::vector<int64_t> ids;
    CutScratch cs;
    for (int64_t r = b; r < en; ++r) {
      const float* row = x.data_ptr<float>() + r * V;
      if (temperature == 0.0) {
        issues[r] = row_argmax(row, V, out.data_ptr<int64_t>() + r, kern);
        continue;
      }
      bool nan = false;
      const float ymax = kern->row_max(row, V, Elem::F32, T, y.data(), &nan);  // y = row / T
      issues[r] = nan ? kRowNan : row_issue(ymax, 0.f);
      if (issues[r] != kRowOk) continue;
      const uint64_t base = splitmix64(splitmix64(uint64_t(seed)) ^ splitmix64(uint64_t(req.data_ptr<int64_t>()[r]) + 0x5851f42d4c957f2dull));
      const uint64_t rkey = splitmix64(base ^ splitmix64(uint64_t(pos.data_ptr<int64_t>()[r]) * 0x2545f4914f6cdd1dull));
      // A kept finite token exists (the row's max is one): every token of the row, or the kept
      // set's finite ones in id order.
      int64_t* kept = nullptr;
      int64_t nk = V;
      if ((top_k > 0 && top_k < V) || top_p < 1.0) {
        const uint64_t cut = kept_cut(y.data(), V, ymax, top_k, top_p, kern, cs);
        ids.clear();
        for (int64_t i = 0; i < V; ++i)
          if (y[i] != -INFINITY && cs.key[i] >= cut) ids.push_back(i);
        kept = ids.data(), nk = int64_t(ids.size());
      }
      out.data_ptr<int64_t>()[r] = kern->gumbel_argmax(y.data(), kept, nk, rkey, score.data());
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
