// The torch-facing side of the tonp kernels (linear, norms, attention, RoPE; the vocabulary ops
// are in vocab_ops.cpp, MoE in moe_ops.cpp): argument checks, allocation and threading.
// Threads only ever receive whole outputs (row blocks x weight panels, a query's KV heads (one or all),
// rows); every reduction runs inside one call of a kernel from the ISA table, in an order fixed
// by the weight shape and the row's own sequence. So the bits of a row depend on neither M, nor
// the row's slot, nor the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"
#include "ops_common.h"

namespace tonp {
namespace {

// ---------------------------------------------------------------------------------------------
// Ops
// ---------------------------------------------------------------------------------------------
// An fp32 weight W [N, K] (row stride K) as pack_weight_groups lays it out for the table (whole
// panels of kPanel columns; runs: Kernels::group_lane_runs), into g: element k of chunk c of
// column 16p + j at ((p * chunks + c) * kc + lane_group_pos(k)) * 16 + j. An exact copy, panel by
// panel on the intra-op threads.
void pack_f32_groups(const float* W, int64_t N, int64_t K, int64_t chunks, bool runs, float* g) {
  const int64_t kc = K / chunks, panels = N / kPanel;
  std::vector<int64_t> pos(kc);
  for (int64_t k = 0; k < kc; ++k) pos[k] = lane_group_pos(kc, k, runs) * kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < chunks; ++c) {
        float* d = g + (p * chunks + c) * kc * kPanel;
        for (int j = 0; j < kPanel; ++j) {
          const float* src = W + (p * kPanel + j) * K + c * kc;
          for (int64_t k = 0; k < kc; ++k) d[pos[k] + j] = src[k];
        }
      }
  });
}

at::Tensor linear(const at::Tensor& x_, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  int64_t chunks, std::optional<at::ScalarType> out_dtype, const std::optional<at::Tensor>& weight_groups) {
  TORCH_CHECK_VALUE(x_.dim() == 2 && w.dim() == 2 && x_.size(1) == w.size(1), "tonp.linear: x ", x_.sizes(), " and weight ",
                    w.sizes(), " do not match: expected x [M, K] and weight [N, K]");
  const Elem xelem = elem_of(x_, "linear", "x");
  const Elem welem = elem_of(w, "linear", "weight");
  const at::ScalarType odt = out_dtype.value_or(x_.scalar_type());
  const Elem oelem = elem_of(odt, "linear", "out_dtype");
  const int64_t M = x_.size(0), Kd = x_.size(1), N = w.size(0);
  check_chunks(Kd, chunks, "linear");
  TORCH_CHECK_VALUE(chunks <= kMaxChunks, "tonp.linear: at most ", kMaxChunks, " reduction chunks, got ", chunks);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "tonp.linear: bias must be [", N, "], got ", bias->sizes());
    elem_of(*bias, "linear", "bias");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = empty_big({M, N}, x_.options().dtype(odt));
  if (M == 0 || N == 0) return out;
  if (Kd == 0) {
    out.zero_();
    if (bias_f.defined()) out.add_(bias_f.to(odt));
    return out;
  }
  // bf16 activations and weights: the pair chains (bf16dot.h), x read as bf16; else fp32 FMAs.
  const bool pairs = xelem == Elem::BF16 && welem == Elem::BF16;
  const int64_t kc = Kd / chunks, xkc = pairs ? bf16_chunk_stride(kc) : kc;
  const at::Tensor x = pairs ? pad_bf16_chunks(x_, chunks) : f32_contiguous(x_);
  // The weight is read in place, or from the column groups a caller passes (pack_weight_groups
  // of this weight and chunks, a copy the caller keeps current): nothing is cached here, so a
  // weight rewritten in any way (optimizer step, .data copy, inference tensor) is always seen
  // when no groups are given. bf16 groups: the pair chains' one-row tiles read them, where the
  // table does. fp32 groups: a task reads them from the table's linear_group_rows_f32 rows, and
  // wherever it runs lane passes anyway (linear_lane_passes), which then transpose no weight
  // chunk; fewer rows stream the weight in place through the dot tiles (kernels.h has the
  // measurements behind each table's row count). fp32 x on bf16 weights reads none. The same
  // bits.
  const at::Tensor wc = w.contiguous();
  const Kernels* kern = K();
  const void* wg = weight_groups_of(weight_groups, w, chunks, "linear", "weight");
  at::Tensor packed;  // fp32 groups this call packs for itself (Kernels::linear_pack_rows_f32)
  if (!wg && !pairs && welem == Elem::F32 && kern->linear_pack_rows_f32 > 0 && M >= kern->linear_pack_rows_f32 &&
      N >= kPanel && N * Kd * 4 <= kPackInCallMaxBytes && reads_weight_groups(kern, welem) &&
      2 * group_row_block(kern, M, Kd, chunks) <= kern->row_block_f32 && !pair_tiles(kern, kc)) {
    packed = empty_big({N / kPanel * kPanel * Kd}, wc.options());
    pack_f32_groups(wc.data_ptr<float>(), N, Kd, chunks, kern->group_lane_runs, packed.data_ptr<float>());
    wg = packed.data_ptr();
  }
  const bool grouped = wg && !pairs && welem == Elem::F32;
  const int64_t gsz = weight_group_elems(Kd, chunks, welem), gc = weight_group_cols(welem);
  const int64_t pw = pairs ? kPanelPairs : kPanel;
  const int64_t rb = pairs ? bf16_row_block(M) : row_block(M, grouped ? group_row_block(kern, M, Kd, chunks) : kern->row_block_f32);
  const int64_t np = (N + pw - 1) / pw, nmb = (M + rb - 1) / rb;
  const int group_rows = grouped ? kern->linear_group_rows_f32 : 0;  // 0: no groups
  const int64_t esz = welem == Elem::F32 ? 4 : 2, osz = oelem == Elem::F32 ? 4 : 2, ldx = chunks * xkc;
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(wc.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  // A one-row call streams its weight: from 64k multiply-adds (a 256 KB fp32 weight) a second
  // thread's bandwidth pays for its wake-up.
  at::parallel_for(0, np * nmb, grain_for(std::min(rb, M) * Kd * pw, M == 1 ? int64_t(1) << 16 : int64_t(1) << 18),
                   [&](int64_t begin, int64_t end) {
    const int64_t rows_max = std::min(rb, M);
    // fp32 groups: a row block's adjacent whole panels in one call where the table takes several
    // (panels_a_call).
    const int gp = pairs ? 1 : grouped ? kern->group_panels_f32 : lane_call_panels(kern, false, pairs, welem, rows_max, kc);
    const auto scratch = scratch_floats(pairs ? linear_scratch_bf16(chunks, Kd, rows_max)
                                              : linear_scratch(chunks, Kd, rows_max, welem, kern->lane_rows_f32,
                                                             group_rows > 0 && rows_max >= group_rows, gp));
    XPack xpack(kern, pairs, rows_max, Kd, kc, welem, group_rows);  // a row block's x, for all its panels
    for (int64_t t = begin; t < end;) {
      // bf16 pairs: a panel's row blocks run one after another (its packed weights come from
      // L2 after the first); fp32: a row block's panels.
      const int64_t mb = pairs ? t % nmb : t / np, p = pairs ? t / nmb : t % np, r0 = mb * rb;
      const int64_t rows = std::min<int64_t>(rb, M - r0);
      const bool lanes = grouped && (rows >= group_rows || linear_lane_passes(rows, kc, welem, kern->lane_rows_f32));
      const int64_t take = panels_a_call(lane_call_panels(kern, lanes, pairs, welem, rows, kc), t, end, N, p, pw);
      const int ncols = int(std::min<int64_t>(pw * take, N - p * pw));
      t += take;
      if (pairs)
        kern->linear_panel_bf16(reinterpret_cast<const uint16_t*>(xp) + r0 * ldx, ldx, xkc, rows,
                                reinterpret_cast<const uint16_t*>(wp) + p * pw * Kd, Kd, kc, int(chunks),
                                bp ? bp + p * pw : nullptr, ncols, op + (r0 * N + p * pw) * osz, N, oelem,
                                scratch.get(),
                                static_cast<const uint16_t*>(
                                    xpack.of(mb, reinterpret_cast<const uint16_t*>(xp) + r0 * ldx, ldx, rows, int(chunks))),
                                pairs && wg ? static_cast<const uint16_t*>(wg) + p * pw / gc * gsz : nullptr);
      else
        kern->linear_panel(reinterpret_cast<const float*>(xp) + r0 * Kd, Kd, rows, wp + p * pw * Kd * esz, Kd, welem,
                           kc, int(chunks), bp ? bp + p * pw : nullptr, ncols, op + (r0 * N + p * pw) * osz, N,
                           oelem, scratch.get(),
                           static_cast<const float*>(
                               xpack.of(mb, reinterpret_cast<const float*>(xp) + r0 * Kd, Kd, rows, int(chunks))),
                           lanes && ncols % kPanel == 0 ? static_cast<const float*>(wg) + p * gsz : nullptr);
    }
  });
  return out;
}

// A weight [..., N, K]'s columns in groups (kernels.h): bf16, eight columns for
// linear_panel_bf16's one-row tiles, [..., N / 8, chunks, 8 * padded chunk] (each column's chunk
// zero padded to the pair chains' 16-element blocks); fp32, sixteen-column panels for
// linear_panel's lane passes, [..., N / 16, chunks, 16 * kc] (each chunk's k's as the table's lane
// pairs read them) or [..., N / 16, chunks, kc, 16] (as its lane runs do: Kernels::group_lane_runs),
// sixteen columns per k. The chunks are in the shape, so a copy made for other chunks is refused;
// an exact copy; columns past the last whole group are left out (the kernel reads them
// in place). Empty where this process's table reads no groups: nothing to gain, so no memory
// spent.
at::Tensor pack_weight_groups(const at::Tensor& w, int64_t chunks) {
  TORCH_CHECK_VALUE(w.dim() >= 2, "tonp.pack_weight_groups: weight must be [..., N, K], got shape ", w.sizes());
  const int64_t N = w.size(-2), Kd = w.size(-1);
  check_chunks(Kd, chunks, "pack_weight_groups");
  TORCH_CHECK_VALUE(chunks <= kMaxChunks, "tonp.pack_weight_groups: at most ", kMaxChunks, " reduction chunks, got ", chunks);
  const Elem we = elem_of(w, "pack_weight_groups", "weight");
  const int64_t gc = weight_group_cols(we), G = N / gc;
  if (!reads_weight_groups(K(), we) || G == 0 || Kd == 0) return at::empty({0}, w.options());
  const int64_t lead = w.numel() / (N * Kd), kc = Kd / chunks, xkc = group_chunk_stride(kc, we);
  const at::Tensor src = w.detach().contiguous();
  const bool runs = K()->group_lane_runs;
  const std::vector<int64_t> shape = weight_groups_shape(w, chunks, runs);
  if (we == Elem::F32) {  // each chunk's k's in the table's lane order (kernels.h lane_group_pos)
    // One copy, written in place by pack_f32_groups (the one tk.linear packs in the call), matrix
    // by matrix. It had been an ATen index_select of the permuted view; on the Intel Xeon, 2
    // threads, best of 4: 16384 x 2048 387 -> 30 ms, 32 experts' gate_up 1014 -> 84 ms and down
    // 274 -> 64 ms, 4096 x 2048 73 -> 45 ms (its fresh pages' faults dominate there).
    at::Tensor out = empty_huge({lead, G, chunks, kc, gc}, w.options());
    for (int64_t e = 0; e < lead; ++e)
      pack_f32_groups(src.data_ptr<float>() + e * N * Kd, G * gc, Kd, chunks, runs, out.data_ptr<float>() + e * G * gc * Kd);
    return out.view(shape);
  }
  at::Tensor v = src.reshape({lead, N, Kd}).narrow(1, 0, G * gc).reshape({lead, G, gc, chunks, kc});
  if (xkc != kc) v = at::constant_pad_nd(v, {0, xkc - kc});
  at::Tensor out = empty_huge(shape, w.options());
  out.view({lead, G, chunks, xkc / 16, gc, 16}).copy_(v.reshape({lead, G, gc, chunks, xkc / 16, 16}).permute({0, 1, 3, 4, 2, 5}));
  return out;
}

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  TORCH_CHECK_VALUE(x_.dim() >= 1, "tonp.rms_norm: x must be [..., H], got shape ", x_.sizes());
  TORCH_CHECK_VALUE(w_.dim() == 1 && w_.size(0) == x_.size(-1), "tonp.rms_norm: weight ", w_.sizes(), " does not match x ",
                    x_.sizes(), " (expected x [..., H] and weight [H])");
  const Elem e = elem_of(x_, "rms_norm", "x"), we = elem_of(w_, "rms_norm", "weight");
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  at::Tensor out = empty_big(x.sizes(), x.options());
  const int64_t H = x.size(-1), M = H ? x.numel() / H : 0;
  const int64_t esz = e == Elem::F32 ? 4 : 2;
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const Kernels* kern = K();
  at::parallel_for(0, M, grain_for(2 * H), [&](int64_t b, int64_t en) {
    for (int64_t r = b; r < en; ++r) kern->rms_norm(xp + r * H * esz, w.data_ptr(), op + r * H * esz, H, float(eps), e, we);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& g_, const at::Tensor& u_) {
  TORCH_CHECK_VALUE(g_.sizes() == u_.sizes() && g_.scalar_type() == u_.scalar_type(), "tonp.silu_mul: gate ", g_.sizes(), "/",
                    g_.scalar_type(), " and up ", u_.sizes(), "/", u_.scalar_type(), " must match");
  const Elem e = elem_of(g_, "silu_mul", "gate");
  const at::Tensor g = g_.contiguous(), u = u_.contiguous();
  at::Tensor out = empty_big(g.sizes(), g.options());
  const int64_t n = g.numel(), esz = e == Elem::F32 ? 4 : 2, blk = 4096;  // fixed blocks, not per-thread spans
  const char* gp = static_cast<const char*>(g.data_ptr());
  const char* up = static_cast<const char*>(u.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const Kernels* kern = K();
  at::parallel_for(0, (n + blk - 1) / blk, grain_for(16 * blk), [&](int64_t b, int64_t en) {
    for (int64_t i = b; i < en; ++i) {
      const int64_t s = i * blk, len = std::min(blk, n - s);
      kern->silu_mul(gp + s * esz, up + s * esz, op + s * esz, len, e);
    }
  });
  return out;
}

// q [T, Hq, D] and k, v of kv_layout (kv_dims dims, ..., Hkv, D), one float dtype: the rules of
// _op_checks._attention, in the same order.
void check_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* op, int64_t kv_dims,
                     const char* kv_layout) {
  elem_of(q, op, "q");
  TORCH_CHECK_VALUE(q.dim() == 3, "tonp.", op, ": q must be [T, Hq, D], got shape ", q.sizes());
  elem_of(k, op, "k");
  TORCH_CHECK_VALUE(k.dim() == kv_dims, "tonp.", op, ": k must be ", kv_layout, ", got shape ", k.sizes());
  elem_of(v, op, "v");
  TORCH_CHECK_VALUE(v.dim() == kv_dims, "tonp.", op, ": v must be ", kv_layout, ", got shape ", v.sizes());
  TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "tonp.", op,
                   ": q, k, v dtypes differ (", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type(), ")");
  const int64_t D = q.size(2);
  TORCH_CHECK_VALUE(k.size(-1) == D && v.sizes() == k.sizes(), "tonp.", op, ": head_dim mismatch: q ", q.sizes(), ", k ",
                    k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(D % 8 == 0 && D > 0, "tonp.", op, ": head_dim must be a positive multiple of 8, got ", D);
  const int64_t Hq = q.size(1), Hkv = k.size(-2);
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq >= 1 && Hq % Hkv == 0, "tonp.", op, ": ", Hq, " query heads are not a multiple of ", Hkv,
                    " key-value heads");
}

// The attention's fp32 result in q's dtype, rounded as every kernel output is: nearest even,
// NaN -> 0x7fc0 (simd.h f32_to_bf16; torch's .to() keeps a NaN's sign and payload, 0xffc0 for
// the x86 default NaN, and a GPU's conversion makes 0x7fff). Threaded: 128 decode queries of 32
// heads are half a million outputs.
at::Tensor round_out(const at::Tensor& out, at::ScalarType dtype) {
  if (dtype == at::kFloat) return out;
  at::Tensor r = empty_big(out.sizes(), out.options().dtype(at::kBFloat16));
  const uint32_t* src = static_cast<const uint32_t*>(out.data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(r.data_ptr());
  at::parallel_for(0, out.numel(), int64_t(1) << 16, [&](int64_t b0, int64_t en) {
    for (int64_t i = b0; i < en; ++i) {
      const uint32_t b = src[i];
      dst[i] = (b & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
  });
  return r;
}

// The KV heads an attention task takes: all of its query's where the queries alone give every
// thread several tasks (a position's heads are one run of the cache, which the hardware
// prefetchers stream; a task of one head reads a D-element slice of each position, a cache row
// apart), else one. Each head computes the same either way. Intel Xeon (family 6, model 167),
// 2 threads, attention_paged with 32 query and 4 KV heads of 128 on huge pages, against one head
// a task, alternated in one process, outputs equal: fp32 at batch 4-64 (context 1024-4096)
// 1.16-1.21x, bf16 0.99-1.11x (there the arithmetic binds).
int64_t attn_task_heads(int64_t queries, int64_t Hkv) {
  return queries >= 2 * int64_t(at::get_num_threads()) ? Hkv : 1;
}

at::Tensor attention_varlen(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& cu_,
                            double scale, int64_t block) {
  check_attention(q_, k_, v_, "attention_varlen", 3, "[T, Hkv, D]");
  TORCH_CHECK_VALUE(k_.size(0) == q_.size(0), "tonp.attention_varlen: q has ", q_.size(0), " tokens, k has ", k_.size(0));
  TORCH_CHECK_VALUE(block > 0, "tonp.attention_varlen: block must be positive, got ", block);
  check_integer(cu_, "attention_varlen", "cu_seqlens");
  TORCH_CHECK_VALUE(cu_.dim() == 1, "tonp.attention_varlen: cu_seqlens must be [S+1], got shape ", cu_.sizes());
  const at::Tensor cu = cu_.to(at::kLong).contiguous();
  const int64_t T = q_.size(0), Hq = q_.size(1), Hkv = k_.size(1), D = q_.size(2), G = Hq / Hkv;
  const int64_t S = cu.numel() - 1;
  const int64_t* cp = cu.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(S >= 0 && cp[0] == 0 && cp[S] == T, "tonp.attention_varlen: cu_seqlens must run from 0 to T=", T,
                    S >= 0 ? ", got cu_seqlens[0]=" + std::to_string(cp[0]) + ", cu_seqlens[-1]=" + std::to_string(cp[S])
                           : std::string(", got no entries"));
  std::vector<int64_t> seq_of(T);
  int64_t longest = 1;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK_VALUE(cp[s + 1] >= cp[s], "tonp.attention_varlen: cu_seqlens must not decrease");
    for (int64_t t = cp[s]; t < cp[s + 1]; ++t) seq_of[t] = s;
    longest = std::max(longest, cp[s + 1] - cp[s]);
  }
  // A block longer than every sequence is one block per query, whatever its size: the same
  // arithmetic with a scratch sized by the data, not by the argument.
  block = std::min(block, longest);
  const at::Tensor q = q_.to(at::kFloat).contiguous(), k = k_.contiguous(), v = v_.contiguous();
  at::Tensor out = empty_big({T, Hq, D}, q.options());
  const Elem kv = k.scalar_type() == at::kFloat ? Elem::F32 : Elem::BF16;
  const int64_t esz = kv == Elem::F32 ? 4 : 2;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const float* qp = q.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const Kernels* kern = K();
  const int64_t th = attn_task_heads(T, Hkv), nt = Hkv / th;
  at::parallel_for(0, T * nt, grain_for(2 * th * G * D * (T / std::max<int64_t>(1, S) + 1)), [&](int64_t b, int64_t en) {
    const auto scratch = scratch_floats(attn_scratch(G, D, block, th));
    for (int64_t task = b; task < en; ++task) {
      const int64_t t = task / nt, h = task % nt * th, s = seq_of[t];
      AttnQuery a{qp + (t * Hq + h * G) * D, outp + (t * Hq + h * G) * D, kp + (cp[s] * Hkv + h) * D * esz,
                  vp + (cp[s] * Hkv + h) * D * esz, nullptr, 0, Hkv * D, t - cp[s]};
      kern->attention(a, int(th), int(G), int(D), int(block), kv, float(scale), scratch.get());
    }
  });
  return round_out(out, q_.scalar_type());
}

at::Tensor attention_paged(const at::Tensor& q_, const at::Tensor& kc_, const at::Tensor& vc_, const at::Tensor& pt_,
                           const at::Tensor& qs_, const at::Tensor& qpos_, double scale) {
  check_attention(q_, kc_, vc_, "attention_paged", 4, "[pages, block, kv_heads, head_dim]");
  TORCH_CHECK_VALUE(kc_.size(1) >= 1, "tonp.attention_paged: caches need a block size >= 1, got ", kc_.sizes());
  TORCH_CHECK_VALUE(kc_.is_contiguous() && vc_.is_contiguous(), "tonp.attention_paged: the CPU kernel needs contiguous caches");
  check_integer(pt_, "attention_paged", "page_table");
  check_integer(qs_, "attention_paged", "q_seq");
  check_integer(qpos_, "attention_paged", "q_pos");
  TORCH_CHECK_VALUE(pt_.dim() == 2, "tonp.attention_paged: page_table must be [S, max_pages], got shape ", pt_.sizes());
  if (pt_.scalar_type() != at::kInt && pt_.numel()) {  // narrowed to int32 below: no entry may wrap
    const auto [lo, hi] = at::aminmax(pt_.to(at::kLong));
    TORCH_CHECK_INDEX(lo.item<int64_t>() >= INT32_MIN && hi.item<int64_t>() <= INT32_MAX,
                      "tonp.attention_paged: page_table entries must fit in int32, got [", lo.item<int64_t>(), ", ",
                      hi.item<int64_t>(), "]");
  }
  const at::Tensor pt = pt_.to(at::kInt).contiguous(), qs = qs_.to(at::kLong).contiguous(), qpos = qpos_.to(at::kLong).contiguous();
  const int64_t Tq = q_.size(0), Hq = q_.size(1), D = q_.size(2), P = kc_.size(0), B = kc_.size(1), Hkv = kc_.size(2);
  const int64_t G = Hq / Hkv, S = pt.size(0), maxp = pt.size(1);
  TORCH_CHECK_VALUE(qs.dim() == 1 && qpos.dim() == 1 && qs.numel() == Tq && qpos.numel() == Tq,
                    "tonp.attention_paged: q_seq/q_pos must be [", Tq, "], got ", qs.sizes(), " and ", qpos.sizes());
  const int32_t* ptp = pt.data_ptr<int32_t>();
  const int64_t* qsp = qs.data_ptr<int64_t>();
  const int64_t* qpp = qpos.data_ptr<int64_t>();
  for (int64_t i = 0; i < Tq; ++i) {
    TORCH_CHECK_INDEX(qsp[i] >= 0 && qsp[i] < S, "tonp.attention_paged: q_seq[", i, "]=", qsp[i],
                      " out of the page table's range [0, ", S, ")");
    TORCH_CHECK_INDEX(qpp[i] >= 0 && qpp[i] / B < maxp, "tonp.attention_paged: position ", qpp[i], " needs ", qpp[i] / B + 1,
                      " pages but the page table holds ", maxp, " (cache capacity exceeded)");
    for (int64_t b = 0; b <= qpp[i] / B; ++b) {
      const int32_t page = ptp[qsp[i] * maxp + b];
      TORCH_CHECK_INDEX(page >= 0 && page < P, "tonp.attention_paged: page id ", page, " outside [0, ", P, ")");
    }
  }
  const at::Tensor q = q_.to(at::kFloat).contiguous();
  at::Tensor out = empty_big({Tq, Hq, D}, q.options());
  const Elem kv = kc_.scalar_type() == at::kFloat ? Elem::F32 : Elem::BF16;
  const int64_t esz = kv == Elem::F32 ? 4 : 2;
  const char* kp = static_cast<const char*>(kc_.data_ptr());
  const char* vp = static_cast<const char*>(vc_.data_ptr());
  const float* qp = q.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const Kernels* kern = K();
  // A task costs more than its multiply-adds (an exp per score, a rescale per block): from 64k of
  // them the second thread pays (tiny model, 16 decode queries: 26 -> 18-20 us).
  const int64_t th = attn_task_heads(Tq, Hkv), nt = Hkv / th;
  at::parallel_for(0, Tq * nt, grain_for(2 * th * G * D * (Tq ? qpp[Tq - 1] + 1 : 1), int64_t(1) << 16), [&](int64_t b, int64_t en) {
    const auto scratch = scratch_floats(attn_scratch(G, D, B, th));
    for (int64_t task = b; task < en; ++task) {
      const int64_t i = task / nt, h = task % nt * th;
      AttnQuery a{qp + (i * Hq + h * G) * D, outp + (i * Hq + h * G) * D, kp + h * D * esz, vp + h * D * esz,
                  ptp + qsp[i] * maxp, B * Hkv * D, Hkv * D, qpp[i]};
      if (task + 1 < en) {  // the next task's first block, fetched during this one's last (hints)
        const int64_t i1 = (task + 1) / nt, h1 = (task + 1) % nt * th;
        const int64_t first = (int64_t(ptp[qsp[i1] * maxp]) * B * Hkv + h1) * D * esz;
        a.next_k = kp + first, a.next_v = vp + first, a.next_n = std::min<int64_t>(qpp[i1] + 1, B);
      }
      kern->attention(a, int(th), int(G), int(D), int(B), kv, float(scale), scratch.get());
    }
  });
  return round_out(out, q_.scalar_type());
}

// RoPE (rotate-half, HF's default): out = x * cos + rotate_half(x) * sin at each row's position,
// with cos/sin looked up in fp32 tables and rounded to x's dtype, and each product and the sum
// rounded to x's dtype: the roundings of the same expression in torch ops. Elementwise, so a
// row's bits depend only on the row and its position.
template <typename T>
void rope_rows(const T* x, T* out, const float* cos, const float* sin, const int64_t* pos, int64_t T_, int64_t Hh,
               int64_t D, int64_t b, int64_t en) {
  const int64_t half = D / 2;
  auto r = [](float v) { return float(T(v)); };  // one rounding to T (identity for float)
  for (int64_t row = b; row < en; ++row) {
    const int64_t t = row / Hh;
    const float* c = cos + pos[t] * D;
    const float* s = sin + pos[t] * D;
    const T* xr = x + row * D;
    T* o = out + row * D;
    for (int64_t d = 0; d < D; ++d) {
      const float xv = float(xr[d]);
      const float rv = d < half ? -float(xr[d + half]) : float(xr[d - half]);
      o[d] = T(r(xv * r(c[d])) + r(rv * r(s[d])));
    }
  }
}

at::Tensor rope(const at::Tensor& x_, const at::Tensor& cos_, const at::Tensor& sin_, const at::Tensor& pos_) {
  TORCH_CHECK_VALUE(x_.dim() == 3 && x_.size(2) % 2 == 0, "tonp.rope: x must be [T, heads, head_dim] with an even head_dim, got ",
                    x_.sizes());
  elem_of(x_, "rope", "x");
  TORCH_CHECK_TYPE(cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat, "tonp.rope: cos/sin tables must be float32");
  TORCH_CHECK_VALUE(cos_.dim() == 2 && cos_.sizes() == sin_.sizes() && cos_.size(1) == x_.size(2),
                    "tonp.rope: cos/sin tables must be [positions, ", x_.size(2), "], got ", cos_.sizes(), " and ", sin_.sizes());
  TORCH_CHECK_VALUE(pos_.dim() == 1 && pos_.size(0) == x_.size(0), "tonp.rope: positions must be [", x_.size(0), "], got ",
                    pos_.sizes());
  check_integer(pos_, "rope", "positions");
  const at::Tensor x = x_.contiguous(), c = cos_.contiguous(), s = sin_.contiguous(), pos = pos_.to(at::kLong).contiguous();
  const int64_t T = x.size(0), Hh = x.size(1), D = x.size(2), P = c.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_INDEX(pp[t] >= 0 && pp[t] < P, "tonp.rope: position ", pp[t], " outside the table's [0, ", P, ")");
  at::Tensor out = empty_big(x.sizes(), x.options());
  at::parallel_for(0, T * Hh, grain_for(8 * D), [&](int64_t b, int64_t en) {
    if (x.scalar_type() == at::kFloat)
      rope_rows(x.data_ptr<float>(), out.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), pp, T, Hh, D, b, en);
    else
      rope_rows(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), c.data_ptr<float>(), s.data_ptr<float>(), pp, T, Hh,
                D, b, en);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tonp, CPU, m) {
  m.impl("linear", &linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("attention_varlen", &attention_varlen);
  m.impl("attention_paged", &attention_paged);
  m.impl("rope", &rope);
  m.impl("pack_weight_groups", &pack_weight_groups);
}

}  // namespace tonp
