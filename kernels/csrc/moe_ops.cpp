// The torch-facing MoE ops: routing, the fused experts and the token-owned combine. Like
// ops.cpp, threads only receive whole outputs (rows, or (expert, row block, weight panel) tasks);
// every reduction runs inside one kernel call in an order fixed by the weights and the row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "kernels.h"
#include "moe_common.h"
#include "ops_common.h"

namespace tonp {
namespace {

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x_, int64_t top_k, bool normalize) {
  TORCH_CHECK_VALUE(x_.dim() == 2, "tonp.moe_route: router_logits must be [M, E], got shape ", x_.sizes());
  elem_of(x_, "moe_route", "router_logits");
  const at::Tensor x = f32_contiguous(x_);
  const int64_t M = x.size(0), E = x.size(1);
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= E, "tonp.moe_route: top_k=", top_k, " outside [1, ", E, "]");
  at::Tensor ids = at::empty({M, top_k}, x.options().dtype(at::kLong)), w = at::empty({M, top_k}, x.options());
  const Kernels* kern = K();
  at::parallel_for(0, M, grain_for(16 * E * top_k), [&](int64_t b, int64_t en) {
    std::vector<float> p(E);
    std::vector<char> taken(E);
    for (int64_t r = b; r < en; ++r) {
      const float* row = x.data_ptr<float>() + r * E;
      float mx = row[0];
      for (int64_t i = 1; i < E; ++i) mx = row[i] > mx ? row[i] : mx;
      float z = 0.f;
      for (int64_t i = 0; i < E; ++i) z = z + (p[i] = kern->exp(row[i] - mx));
      for (int64_t i = 0; i < E; ++i) p[i] = p[i] / z;
      std::fill(taken.begin(), taken.end(), 0);
      int64_t* idr = ids.data_ptr<int64_t>() + r * top_k;
      float* wr = w.data_ptr<float>() + r * top_k;
      for (int64_t k = 0; k < top_k; ++k) {  // stable: strictly greater wins, so ties go to the lower id
        int64_t best = -1;
        for (int64_t i = 0; i < E; ++i)
          if (!taken[i] && (best < 0 || p[i] > p[best])) best = i;
        taken[best] = 1;
        idr[k] = best;
        wr[k] = p[best];
      }
      if (normalize) {
        float s = 0.f;
        for (int64_t k = 0; k < top_k; ++k) s = s + wr[k];
        for (int64_t k = 0; k < top_k; ++k) wr[k] = wr[k] / s;
      }
    }
  });
  return {ids, w};
}

at::Tensor moe_combine(const at::Tensor& w_, const at::Tensor& y_) {
  TORCH_CHECK_VALUE(y_.dim() == 3 && w_.dim() == 2 && w_.size(0) == y_.size(0) && w_.size(1) == y_.size(1),
              "tonp.moe_combine: expected weights [M, K] and expert_out [M, K, H], got ", w_.sizes(), " and ", y_.sizes());
  TORCH_CHECK_TYPE(w_.scalar_type() == at::kFloat, "tonp.moe_combine: weights must be float32");
  const Elem e = elem_of(y_, "moe_combine", "expert_out");
  const at::Tensor w = w_.contiguous(), y = y_.contiguous();
  const int64_t M = y.size(0), Kk = y.size(1), H = y.size(2), esz = e == Elem::F32 ? 4 : 2;
  at::Tensor out = empty_big({M, H}, y.options());
  const char* yp = static_cast<const char*>(y.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const Kernels* kern = K();
  at::parallel_for(0, M, grain_for(Kk * H), [&](int64_t b, int64_t en) {
    for (int64_t r = b; r < en; ++r) kern->moe_combine(w.data_ptr<float>() + r * Kk, yp + r * Kk * H * esz, op + r * H * esz, Kk, H, e);
  });
  return out;
}

}  // namespace

void check_experts(const at::Tensor& x_, const at::Tensor& ids_, const at::Tensor& gu_, const at::Tensor& dn_,
                   int64_t chunks) {
  TORCH_CHECK_VALUE(x_.dim() == 2, "tonp.moe_experts: x must be [M, H], got ", x_.sizes());
  TORCH_CHECK_VALUE(ids_.dim() == 2 && ids_.size(0) == x_.size(0), "tonp.moe_experts: expert ids must be [M, K] with M = ",
                    x_.size(0), ", got ", ids_.sizes());
  TORCH_CHECK_TYPE(ids_.scalar_type() == at::kLong, "tonp.moe_experts: expert ids must be int64, got ", ids_.scalar_type());
  TORCH_CHECK_VALUE(gu_.dim() == 3 && dn_.dim() == 3 && gu_.size(0) == dn_.size(0) && gu_.size(2) == x_.size(1) &&
                        gu_.size(1) % 2 == 0 && dn_.size(1) == x_.size(1) && 2 * dn_.size(2) == gu_.size(1),
                    "tonp.moe_experts: expected gate_up [E, 2I, H] and down [E, H, I] with H = ", x_.size(1), ", got ",
                    gu_.sizes(), " and ", dn_.sizes());
  elem_of(x_, "moe_experts", "x");
  elem_of(gu_, "moe_experts", "gate_up");
  TORCH_CHECK_TYPE(dn_.scalar_type() == gu_.scalar_type(), "tonp.moe_experts: gate_up and down dtypes differ");
  check_chunks(x_.size(1), chunks, "moe_experts");
  check_chunks(dn_.size(2), chunks, "moe_experts");
  TORCH_CHECK_VALUE(chunks <= kMaxChunks, "tonp.moe_experts: at most ", kMaxChunks, " reduction chunks, got ", chunks);
}

ExpertGroups group_by_expert(const at::Tensor& ids_, int64_t first_expert, int64_t E) {
  const at::Tensor ids = ids_.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t R = ids.numel();
  ExpertGroups g{std::vector<int64_t>(E + 1, 0), std::vector<int64_t>(R)};
  for (int64_t r = 0; r < R; ++r) {
    const int64_t e = idp[r] - first_expert;
    TORCH_CHECK_INDEX(e >= 0 && e < E, "tonp.moe_experts: expert id ", idp[r], " is not one of this call's experts [",
                      first_expert, ", ", first_expert + E, ")");
    ++g.start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) g.start[e + 1] += g.start[e];
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  for (int64_t r = 0; r < R; ++r) g.order[fill[idp[r] - first_expert]++] = r;  // stable counting sort
  return g;
}

// All experts of one MoE layer in one call: row (m, k) of the output is expert ids[m, k] applied
// to x[m]: down_e(silu(gate_e(x)) * up_e(x)), with the same roundings as three separate calls
// (gate_up in x's dtype, silu_mul in x's dtype, down in x's dtype) and the same linear kernel, so
// each row's bits are those of running its expert alone on it. Rows are grouped by expert
// (stable), then every (expert, row block, weight panel) of a stage is one thread task: two
// parallel regions per layer instead of two per expert. gate_up_out, when given, receives the
// gate_up rows [R, 2I] (x's dtype, in group order) for the backward.
at::Tensor moe_experts_forward(const at::Tensor& x_, const at::Tensor& ids_, const at::Tensor& gu_, const at::Tensor& dn_,
                               int64_t first_expert, int64_t chunks, at::Tensor* gate_up_out,
                               const std::optional<at::Tensor>& gu_groups, const std::optional<at::Tensor>& dn_groups) {
  check_experts(x_, ids_, gu_, dn_, chunks);
  const void* gug = weight_groups_of(gu_groups, gu_, chunks, "moe_experts", "gate_up");
  const void* dng = weight_groups_of(dn_groups, dn_, chunks, "moe_experts", "down");
  const Elem xe = elem_of(x_, "moe_experts", "x"), we = elem_of(gu_, "moe_experts", "gate_up");
  const int64_t M = x_.size(0), Kk = ids_.size(1), H = x_.size(1), E = gu_.size(0), I = dn_.size(2), R = M * Kk;
  at::Tensor y = empty_big({M, Kk, H}, x_.options());
  if (gate_up_out) *gate_up_out = empty_big({R, 2 * I}, x_.options());
  if (R == 0 || H == 0) return y;
  const ExpertGroups groups = group_by_expert(ids_, first_expert, E);
  const std::vector<int64_t>& start = groups.start;
  const std::vector<int64_t>& order = groups.order;
  // bf16 activations and weights: the pair chains (bf16dot.h) on bf16 rows, as linear runs them;
  // otherwise fp32 FMAs on rows widened to fp32. Rows are stored with each chunk zero padded to
  // the pair chains' 16-element blocks (a no-op stride when kc is a multiple of 16).
  const bool pairs = xe == Elem::BF16 && we == Elem::BF16;
  // Work items: (expert, first sorted row, rows) blocks, even per expert, as linear's tasks: of
  // at most the table's row_block_f32 rows, or for the pair chains kRowBlockPairs (one weight
  // packing serves all of a task's rows; the kernel runs them kRowBlock at a time).
  const Kernels* kern = K();
  struct Blk { int64_t e, r0, rows; };
  std::vector<Blk> blks;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = start[e + 1] - start[e], rb = pairs ? bf16_row_block(n) : row_block(n, kern->row_block_f32), r0 = start[e];
         r0 < start[e + 1]; r0 += rb)
      blks.push_back({e, r0, std::min<int64_t>(rb, start[e + 1] - r0)});
  int64_t max_rows = 0;
  for (const Blk& k : blks) max_rows = std::max(max_rows, k.rows);
  const at::Tensor x = x_.contiguous(), gu = gu_.contiguous(), dn = dn_.contiguous();
  const int64_t xsz = xe == Elem::F32 ? 4 : 2, wsz = we == Elem::F32 ? 4 : 2, isz = pairs ? 2 : 4;
  const int64_t xkH = pairs ? bf16_chunk_stride(H / chunks) : H / chunks, xkI = pairs ? bf16_chunk_stride(I / chunks) : I / chunks;
  const int64_t ldH = chunks * xkH, ldI = chunks * xkI;
  const auto in_opts = x.options().dtype(pairs ? at::kBFloat16 : at::kFloat);
  at::Tensor xg = (ldH == H ? empty_big({R, ldH}, in_opts) : at::zeros({R, ldH}, in_opts));
  at::Tensor hg = (ldI == I ? empty_big({R, ldI}, in_opts) : at::zeros({R, ldI}, in_opts));
  at::Tensor gub = gate_up_out ? *gate_up_out : empty_big({R, 2 * I}, x.options()), ys = empty_big({R, H}, x.options());
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* xgp = static_cast<char*>(xg.data_ptr());
  char* gup = static_cast<char*>(gub.data_ptr());
  char* hgp = static_cast<char*>(hg.data_ptr());
  char* ysp = static_cast<char*>(ys.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  // A row of n elements (dtype `from`) into a gathered row with chunks of kc at stride xk.
  auto put_row = [&](const char* src, Elem from, int64_t n, int64_t xk, char* dst) {
    const int64_t kc = n / chunks;
    for (int64_t c = 0; c < chunks; ++c) {
      if (pairs || from == Elem::F32) {
        std::memcpy(dst + c * xk * isz, src + c * kc * isz, kc * isz);
      } else {
        const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src) + c * kc;
        uint32_t* d32 = reinterpret_cast<uint32_t*>(dst) + c * xk;
        for (int64_t h = 0; h < kc; ++h) d32[h] = uint32_t(s16[h]) << 16;  // exact widening
      }
    }
  };
  // Gather the rows.
  at::parallel_for(0, R, grain_for(4 * H), [&](int64_t b, int64_t en) {
    for (int64_t j = b; j < en; ++j) put_row(xp + (order[j] / Kk) * H * xsz, xe, H, xkH, xgp + j * ldH * isz);
  });
  // One stage: for every block, rows x (weight[e] [N, Kd] -> out [rows, N] in x's dtype).
  // wg: the weight's column groups (null: in place), weight_group_elems(Kd, chunks, we) elements
  // a group, N / weight_group_cols(we) groups an expert (bf16: eight columns, four to a 32-column
  // panel, the kernel reading the panel's whole ones; fp32: a 16-column panel, read at every row
  // count, so its x rows are lane-packed).
  auto stage = [&](const char* in, int64_t ld, int64_t xk, int64_t Kd, const char* w, const void* wg, int64_t N,
                   char* out) {
    const int64_t gc = weight_group_cols(we), gsz = weight_group_elems(Kd, chunks, we), gexp = N / gc * gsz;
    const int64_t pw = pairs ? kPanelPairs : kPanel, np = (N + pw - 1) / pw, ntask = int64_t(blks.size()) * np, kc = Kd / chunks;
    at::parallel_for(0, ntask, grain_for(std::min<int64_t>(R, kRowBlock) * Kd * pw), [&](int64_t b, int64_t en) {
      const bool grouped = wg && we == Elem::F32;
      // fp32 groups: a block's adjacent whole panels in one call where the table takes several
      // (panels_a_call; the AVX2 table streams two side by side).
      const int gp = pairs ? 1 : grouped ? kern->group_panels_f32 : lane_call_panels(kern, false, pairs, we, max_rows, kc);
      const auto scratch = scratch_floats(pairs ? linear_scratch_bf16(chunks, Kd, max_rows)
                                                : linear_scratch(chunks, Kd, max_rows, we, kern->lane_rows_f32, grouped, gp));
      XPack xpack(kern, pairs, max_rows, Kd, kc, we, grouped ? kern->group_rows_f32 : 0);  // a block's rows, for all its panels
      for (int64_t t = b; t < en;) {
        const int64_t bi = t / np, p = t % np;
        const Blk& k = blks[bi];
        const int64_t take =
            panels_a_call(lane_call_panels(kern, grouped && k.rows >= kern->group_rows_f32, pairs, we, k.rows, kc), t, en, N,
                          p, pw);
        const int ncols = int(std::min<int64_t>(pw * take, N - p * pw));
        t += take;
        const char* wt = w + (k.e * N + p * pw) * Kd * wsz;
        char* o = out + (k.r0 * N + p * pw) * xsz;
        if (pairs)
          kern->linear_panel_bf16(reinterpret_cast<const uint16_t*>(in) + k.r0 * ld, ld, xk, k.rows,
                                  reinterpret_cast<const uint16_t*>(wt), Kd, kc, int(chunks), nullptr, ncols, o, N, xe,
                                  scratch.get(),
                                  static_cast<const uint16_t*>(xpack.of(bi, in + k.r0 * ld * isz, ld, k.rows, int(chunks))),
                                  wg ? static_cast<const uint16_t*>(wg) + k.e * gexp + p * pw / gc * gsz : nullptr);
        else
          kern->linear_panel(reinterpret_cast<const float*>(in) + k.r0 * ld, ld, k.rows, wt, Kd, we, kc, int(chunks),
                             nullptr, ncols, o, N, xe, scratch.get(),
                             static_cast<const float*>(xpack.of(bi, in + k.r0 * ld * isz, ld, k.rows, int(chunks))),
                             grouped && ncols % pw == 0 ? static_cast<const float*>(wg) + k.e * gexp + p * gsz : nullptr);
      }
    });
  };
  stage(xgp, ldH, xkH, H, static_cast<const char*>(gu.data_ptr()), gug, 2 * I, gup);
  // silu(gate) * up in x's dtype, then into the down projection's input rows.
  at::parallel_for(0, R, grain_for(16 * I), [&](int64_t b, int64_t en) {
    std::vector<char> hb(I * xsz);
    for (int64_t j = b; j < en; ++j) {
      const char* row = gup + j * 2 * I * xsz;
      kern->silu_mul(row, row + I * xsz, hb.data(), I, xe);
      put_row(hb.data(), xe, I, xkI, hgp + j * ldI * isz);
    }
  });
  stage(hgp, ldI, xkI, I, static_cast<const char*>(dn.data_ptr()), dng, H, ysp);
  // Back to (token, slot) order.
  at::parallel_for(0, R, grain_for(4 * H), [&](int64_t b, int64_t en) {
    for (int64_t j = b; j < en; ++j) std::memcpy(yp + order[j] * H * xsz, ysp + j * H * xsz, H * xsz);
  });
  return y;
}

namespace {
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gu, const at::Tensor& dn,
                       int64_t first_expert, int64_t chunks, const std::optional<at::Tensor>& gu_groups,
                       const std::optional<at::Tensor>& dn_groups) {
  return moe_experts_forward(x, ids, gu, dn, first_expert, chunks, nullptr, gu_groups, dn_groups);
}
}  // namespace

TORCH_LIBRARY_IMPL(tonp, CPU, m) {
  m.impl("moe_route", &moe_route);
  m.impl("moe_combine", &moe_combine);
  m.impl("moe_experts", &moe_experts);
}

}  // namespace tonp
