// Helpers shared by the torch-facing op files (ops.cpp, moe_ops.cpp): the kernel table of this
// CPU, dtype checks, thread grain and row blocks. Included only by files that use ATen.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "kernels.h"

namespace tonp {

inline const Kernels* K() {
  // Read at call time so tests can compare the builds in one process: TONP_FORCE_PORTABLE=1 (the
  // portable build), TONP_FORCE_AVX2=1 (AVX2, bf16 x bf16 linears emulated, on an AVX512-BF16 CPU),
  // TONP_FORCE_PAIR_TILES=1 (the AVX512-BF16 table with Intel's two-panel fp32 tiles on any CPU
  // that runs it), TONP_FORCE_BF16_FMA=1 / 0 (that table with the bf16 x bf16 linear's path of
  // Intel, on FMAs, or of other CPUs, on vdpbf16ps).
  const char* force = std::getenv("TONP_FORCE_PORTABLE");
  if (force && force[0] == '1') return kernels_portable();
  static const bool avx2 = cpu_has_avx2_fma();
  static const Kernels* bf16hw = kernels_avx512bf16();
  const char* force_avx2 = std::getenv("TONP_FORCE_AVX2");
  if (bf16hw && !(force_avx2 && force_avx2[0] == '1')) {
    const char* fma = std::getenv("TONP_FORCE_BF16_FMA");
    if (fma && (fma[0] == '0' || fma[0] == '1')) return kernels_avx512bf16_bf16(fma[0] == '1');
    const char* pairs = std::getenv("TONP_FORCE_PAIR_TILES");
    return pairs && pairs[0] == '1' ? kernels_avx512bf16_pairs() : bf16hw;
  }
  return avx2 ? kernels_avx2() : kernels_portable();
}

inline Elem elem_of(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "tonp.", op, ": ", what, " must be a CPU tensor, got ", t.device());
  if (t.scalar_type() == at::kFloat) return Elem::F32;
  if (t.scalar_type() == at::kBFloat16) return Elem::BF16;
  TORCH_CHECK_TYPE(false, "tonp.", op, ": ", what, " must be float32 or bfloat16, got ", t.scalar_type());
}

// The same check for an output dtype (no tensor to look at).
inline Elem elem_of(at::ScalarType t, const char* op, const char* what) {
  if (t == at::kFloat) return Elem::F32;
  if (t == at::kBFloat16) return Elem::BF16;
  TORCH_CHECK_TYPE(false, "tonp.", op, ": ", what, " must be float32 or bfloat16, got ", t);
}

// t as a contiguous fp32 tensor: t itself when it already is one; a contiguous bf16 tensor is
// widened by a plain loop (exact; a TensorIterator copy costs microseconds of set-up, which a
// one-row decode call feels); anything else goes through torch.
inline at::Tensor f32_contiguous(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t;
  if (t.scalar_type() != at::kBFloat16 || !t.is_contiguous() || t.numel() > (int64_t(1) << 16))
    return t.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
  const uint16_t* src = static_cast<const uint16_t*>(t.data_ptr());
  uint32_t* dst = static_cast<uint32_t*>(out.data_ptr());
  for (int64_t i = 0, n = t.numel(); i < n; ++i) dst[i] = uint32_t(src[i]) << 16;
  return out;
}

// A contiguous bf16 [R, K] as the bf16 x bf16 linear reads it: each of the `chunks` chunks of
// kc = K / chunks elements zero padded to bf16_chunk_stride(kc) (x itself when kc is a multiple
// of 16, the model's shapes; the padding only serves small test and toy shapes).
inline at::Tensor pad_bf16_chunks(const at::Tensor& x, int64_t chunks) {
  const at::Tensor xc = x.contiguous();
  const int64_t R = xc.size(0), kc = xc.size(1) / chunks, xkc = bf16_chunk_stride(kc);
  if (xkc == kc) return xc;
  at::Tensor out = at::zeros({R, chunks, xkc}, xc.options());
  out.narrow(2, 0, kc).copy_(xc.view({R, chunks, kc}));
  return out.view({R, chunks * xkc});
}

// Tasks per thread chunk so that each chunk carries at least ~256k multiply-adds: below that a
// thread hand-off costs more than it saves. Only the split across threads depends on this,
// never the arithmetic of an output.
inline int64_t grain_for(int64_t cost_per_task, int64_t min_work = int64_t(1) << 18) {
  return std::max<int64_t>(1, min_work / std::max<int64_t>(1, cost_per_task));
}

// Rows per fp32-arithmetic linear task: the fewest blocks of at most `cap` rows (the table's
// Kernels::row_block_f32), made as even as the 4-row micro tile allows, so the threads' shares
// match. Only which rows share a task depends on this.
inline int64_t row_block(int64_t M, int64_t cap) {
  if (M <= 0) return cap;
  const int64_t nb = (M + cap - 1) / cap;
  const int64_t rb = (M + nb - 1) / nb;
  return std::min<int64_t>(cap, (rb + 3) / 4 * 4);
}

// at::empty for the large tensors of the ops (gradients, activations): from tonp's pool of
// blocks kept mapped between steps (big_alloc.cpp), so a training step does not fault its
// hundreds of MB in again. Contents uninitialised, as at::empty.
at::Tensor empty_big(at::IntArrayRef sizes, const at::TensorOptions& opts);

// at::empty for tensors that live long and are streamed whole, step after step (the weights,
// their column groups): a fresh mapping, 2 MB aligned, transparent huge pages requested before
// its first touch, unmapped with the tensor (never pooled). One TLB entry per 2 MB instead of
// 512. Below 4 MB, or TONP_HUGE_PAGES=0: at::empty.
at::Tensor empty_huge(at::IntArrayRef sizes, const at::TensorOptions& opts);

// Uninitialised scratch for one thread's share of a parallel region (the kernels write before
// they read; a zero-filled std::vector cost a memset per call on the decode path).
// Per-thread scratch, kept between calls: a buffer of a few hundred KB to a few MB, allocated
// fresh, is mapped anew by malloc and costs a page fault per 4 KB on first touch, on every call
// whose shape differs from the last. Each thread keeps its few most recent buffers (a task holds
// at most two at once: scratch and XPack) and hands out the smallest one large enough.
// Buffers start on a cache line: the kernels' 64-byte vector loads and stores of packed weights
// and partials would otherwise each straddle two lines (malloc aligns to 16 bytes; its large
// blocks, mmap'd, sit 16 bytes past a page). On the AMD Zen 5 the bf16 x bf16 linear's lane
// tiles, which read their packed weights from this scratch, ran 300-330 or 400-415 GFLOP/s a
// thread from one process to the next with new float[].
inline float* scratch_new(size_t n) {
  return static_cast<float*>(::operator new[](n * sizeof(float), std::align_val_t(64)));
}
inline void scratch_delete(float* p) { ::operator delete[](p, std::align_val_t(64)); }
struct ScratchCache {
  static constexpr int kKeep = 3;
  std::pair<size_t, float*> idle[kKeep] = {};
  ~ScratchCache() {
    for (auto& b : idle) scratch_delete(b.second);
  }
  float* take(size_t n, size_t* have) {
    int best = -1;
    for (int i = 0; i < kKeep; ++i)
      if (idle[i].second && idle[i].first >= n && (best < 0 || idle[i].first < idle[best].first)) best = i;
    if (best < 0) return *have = n, scratch_new(n);
    float* p = idle[best].second;
    *have = idle[best].first;
    idle[best] = {};
    return p;
  }
  void give(float* p, size_t n) {
    int slot = 0;  // an empty slot, else the smallest buffer makes room
    for (int i = 0; i < kKeep; ++i)
      if (!idle[i].second || (idle[slot].second && idle[i].first < idle[slot].first)) slot = i;
    if (idle[slot].second && idle[slot].first > n) return scratch_delete(p);
    scratch_delete(idle[slot].second);
    idle[slot] = {n, p};
  }
};
inline ScratchCache& scratch_cache() {
  static thread_local ScratchCache c;
  return c;
}
struct ScratchFree {
  size_t n = 0;
  void operator()(float* p) const { scratch_cache().give(p, n); }
};
using Scratch = std::unique_ptr<float[], ScratchFree>;
// n floats (uninitialised) from this thread's cache; returned, when the handle dies, to the cache
// of the thread it dies on (the tonp ops take and release scratch inside one parallel_for body).
// The caches are never trimmed: a thread holds at most kKeep buffers of its largest sizes.
// TONP_POISON=1 (read once; tests): scratch and pool blocks are handed out filled with NaN bits,
// so a kernel that read memory it had not written would change its outputs.
bool poison_memory();
inline Scratch scratch_floats(int64_t n) {
  size_t have = 0;
  float* p = scratch_cache().take(size_t(n > 0 ? n : 1), &have);
  if (poison_memory()) std::memset(p, 0xff, have * sizeof(float));
  return Scratch(p, ScratchFree{have});
}

// One thread's packed x for a linear's panels: a row block packed once, in the layout the
// kernel reads for that block, and kept for the panels that follow it. fp32 arithmetic: lane-packed
// where linear_panel runs lane passes (Kernels::pack_lanes); bf16 x bf16 pair chains: in row pairs
// where linear_panel_bf16 runs dot products of two or more rows and the table packs them
// (Kernels::pack_pairs). of(block, ...) returns the packing the call takes (null where the kernel
// reads x in place), packing when the block differs from the last one packed. Built for blocks of
// at most max_rows rows. group_rows: fp32 arithmetic on fp32 weight groups, read in blocks of at
// least this many rows (moe_experts: the table's group_rows_f32, linear: linear_group_rows_f32),
// whose lane passes read x lane-packed; 0: no groups.
class XPack {
 public:
  XPack(const Kernels* kern, bool pairs, int64_t max_rows, int64_t K, int64_t kc, Elem welem, int group_rows = 0)
      : kern_(kern), pairs_(pairs), kc_(kc), xkc_(bf16_chunk_stride(kc)), welem_(welem),
        group_rows_(pairs ? 0 : group_rows),
        on_(pairs ? kern->pack_pairs && max_rows > 1
                  : (group_rows_ > 0 && max_rows >= group_rows_) || linear_lane_passes(max_rows, kc, welem, kern->lane_rows_f32)),
        buf_(scratch_floats(!on_ ? 0
                            : pairs ? pairs_floats(std::min<int64_t>(max_rows, bf16_pair_rows_max(kern->lane_rows_bf16)),
                                                   kc > 0 ? K / kc : 0, xkc_, kern->pairs_widened)
                                    : max_rows * K)) {}
  const void* of(int64_t block, const void* x, int64_t ldx, int64_t rows, int chunks) {
    if (!on_ || !(pairs_ ? bf16_packs_pairs(rows, kc_, kern_->lane_rows_bf16)
                         : (group_rows_ > 0 && rows >= group_rows_) || linear_lane_passes(rows, kc_, welem_, kern_->lane_rows_f32)))
      return nullptr;
    if (block != packed_) {
      if (pairs_)
        kern_->pack_pairs(static_cast<const uint16_t*>(x), ldx, xkc_, rows, chunks, reinterpret_cast<uint16_t*>(buf_.get()));
      else
        kern_->pack_lanes(static_cast<const float*>(x), ldx, rows, kc_, chunks, buf_.get());
      packed_ = block;
    }
    return buf_.get();
  }

 private:
  const Kernels* kern_;
  bool pairs_;
  int64_t kc_, xkc_;
  Elem welem_;
  int group_rows_;
  bool on_;
  Scratch buf_;
  int64_t packed_ = -1;
};

inline void check_chunks(int64_t K, int64_t chunks, const char* op) {
  TORCH_CHECK_VALUE(chunks >= 1 && (chunks & (chunks - 1)) == 0, "tonp.", op, ": chunks must be a power of two, got ", chunks);
  TORCH_CHECK_VALUE(K % chunks == 0, "tonp.", op, ": the reduction size K=", K, " is not divisible by chunks=", chunks,
                    " (the chunk tree needs C | K)");
}

// The shape of a weight [..., N, K]'s column groups (kernels.h) as pack_weight_groups (ops.cpp)
// makes them for `chunks` reduction chunks, with G = weight_group_cols(the weight's dtype):
// [..., N / G, chunks, G * group_chunk_stride(K / chunks, the dtype)].
// runs: fp32 groups in lane runs (Kernels::group_lane_runs), shaped [..., N / 16, chunks, kc, 16]
// where the lane pairs' are [..., N / 16, chunks, 16 * kc]: the shape says which order a copy
// holds, so a table never reads another's order (weight_groups_of).
inline std::vector<int64_t> weight_groups_shape(const at::Tensor& w, int64_t chunks, bool runs) {
  const Elem e = w.scalar_type() == at::kFloat ? Elem::F32 : Elem::BF16;
  const int64_t G = weight_group_cols(e), kc = w.size(-1) / chunks;
  std::vector<int64_t> s(w.sizes().begin(), w.sizes().end() - 2);
  s.insert(s.end(), {w.size(-2) / G, chunks});
  if (e == Elem::F32 && runs)
    s.insert(s.end(), {kc, G});
  else
    s.push_back(G * group_chunk_stride(kc, e));
  return s;
}

// The whole panels one linear_panel call of `rows` rows may take: the table's group_panels_f32
// where it reads fp32 groups (`grouped`: given them, at a row count that reads them),
// lane_panels_f32 where it runs fp32 lane passes on W in place; otherwise one.
inline int lane_call_panels(const Kernels* kern, bool grouped, bool pairs, Elem welem, int64_t rows, int64_t kc) {
  if (grouped) return kern->group_panels_f32;
  return !pairs && welem == Elem::F32 && linear_lane_passes(rows, kc, welem, kern->lane_rows_f32) ? kern->lane_panels_f32 : 1;
}
// How many whole panels (pw columns each) from panel p one linear_panel call takes: up to
// `panels` (lane_call_panels), within the thread's tasks [t, end) and N's whole panels. tk.linear
// and moe_experts both split this way.
inline int64_t panels_a_call(int panels, int64_t t, int64_t end, int64_t N, int64_t p, int64_t pw) {
  if (panels <= 1) return 1;
  return std::max<int64_t>(1, std::min<int64_t>({int64_t(panels), end - t, (N - p * pw) / pw}));
}

// The column groups a caller passes beside weight w (a copy it owns, made by pack_weight_groups
// from these weights and chunks), checked; null where there are none (not given, or empty: what
// pack_weight_groups returns where the table reads none), the table reads none, or they hold
// fp32 lanes in the other order (made by another table: W is then read in place, the same bits).
// The copy's contents are the caller's: a group stale against w would give another weight's outputs.
inline const void* weight_groups_of(const std::optional<at::Tensor>& g, const at::Tensor& w, int64_t chunks,
                                    const char* op, const char* what) {
  if (!g || !g->defined() || g->numel() == 0) return nullptr;
  TORCH_CHECK_TYPE(g->scalar_type() == w.scalar_type() && g->is_contiguous() && g->is_cpu(), "tonp.", op, ": ", what,
                   "_groups must be a contiguous CPU tensor of the weight's dtype ", w.scalar_type(),
                   " (pack_weight_groups' result), got ", g->scalar_type(), " on ", g->device(),
                   g->is_contiguous() ? "" : ", not contiguous");
  const Kernels* kern = K();
  const std::vector<int64_t> want = weight_groups_shape(w, chunks, kern->group_lane_runs);
  if (w.scalar_type() == at::kFloat && g->sizes() == at::IntArrayRef(weight_groups_shape(w, chunks, !kern->group_lane_runs)))
    return nullptr;  // another table's lane order
  TORCH_CHECK_VALUE(g->sizes() == at::IntArrayRef(want), "tonp.", op, ": ", what, "_groups has shape ", g->sizes(),
                    ", but pack_weight_groups of ", what, " ", w.sizes(), " with chunks=", chunks, " has ",
                    at::IntArrayRef(want), " (packed from another weight, or for other chunks?)");
  if (!reads_weight_groups(kern, w.scalar_type() == at::kFloat ? Elem::F32 : Elem::BF16)) return nullptr;
  return g->data_ptr();
}

// Index tensors (ids, positions, offsets, page tables) must hold integers: a float or bool one
// would be truncated silently by a conversion.
inline void check_integer(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK_TYPE(at::isIntegralType(t.scalar_type(), /*includeBool=*/false), "tonp.", op, ": ", what,
                   " must be an integer tensor, got ", t.scalar_type());
}

// The temperature rule of tonp_kernels.check_temperature: its fp32 value (what the kernels divide
// by) is a positive normal number (a smaller one is 0 or a denormal, a larger one inf).
inline void check_temperature(double t, const char* op) {
  const float f = float(t);
  TORCH_CHECK_VALUE(f > 0.f && std::isnormal(f), "tonp.", op, ": temperature must be a number whose fp32 value is a normal ",
                    "float, in [", FLT_MIN, ", ", FLT_MAX, "], got ", t);
}

// Per-row verdicts of the vocabulary ops, reported after the parallel loop for the lowest bad row
// (so the message does not depend on which thread saw what first).
enum RowIssue : int8_t { kRowOk = 0, kRowNan, kRowInf, kRowMasked };

// From a row's (max, sum) of logits / T: +inf max, or masked (max -inf, sum 0; a NaN row has
// max -inf and sum NaN, and gives NaN).
inline RowIssue row_issue(float mx, float sum) {
  return mx == INFINITY ? kRowInf : mx == -INFINITY && sum == 0.f ? kRowMasked : kRowOk;
}

inline void check_rows(const std::vector<int8_t>& issues, const char* op, double temperature) {
  for (size_t r = 0; r < issues.size(); ++r) {
    TORCH_CHECK_VALUE(issues[r] != kRowNan, "tonp.", op, ": row ", r, " holds a NaN logit");
    TORCH_CHECK_VALUE(issues[r] != kRowInf, "tonp.", op, ": row ", r, ": logits / temperature reach +inf (an infinite logit, or "
                      "fp32 overflow at temperature=", temperature, "); its softmax is undefined");
    TORCH_CHECK_VALUE(issues[r] != kRowMasked, "tonp.", op, ": row ", r, ": every logit is -inf; its softmax is undefined");
  }
}

}  // namespace tonp
