// The AVX512-BF16 build: the AVX2 table with the bf16 x bf16 linear on vdpbf16ps (bf16dot_hw.h),
// the fp32-FMA linear's lane passes on zmm (linear_lanes.h, TONP_AVX512), attention's inner loops
// on zmm (kernels_impl.h) and the backward GEMM on AVX-512 (gemm_hw.h). Every other entry is the
// AVX2 table's own function. The zmm lane passes and attention loops perform the AVX2 build's
// chains operand for operand; the pair chains run on the new instruction and give the
// emulation's bits (checked here once, on a table of edge cases, before the table is used; a CPU
// whose instruction disagrees keeps the AVX2 emulation).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <immintrin.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include "amx_check.h"
#include "kernels.h"
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")
#define TONP_AVX2 1
#define TONP_AVX512 1  // linear_lanes.h: the fp32-FMA linear's lane passes on zmm (same chains)
#define TONP_ISA_NAME "avx512bf16"

namespace tonp_avx512bf16 {
#include "kernels_impl.h"
#include "bf16dot.h"
#include "bf16dot_hw.h"
#include "gemm.h"
#include "gemm_hw.h"
#include "gemm_amx.h"

// Edge cases of one step: subnormal inputs and accumulators, products and sums near FLT_MIN
// (where tininess before and after rounding differ), cancellation, infinities, NaN.
static bool self_check(const tonp::Kernels* emu) {
  constexpr int n = 4096;
  static float acc[n], got[n], want[n];
  static uint16_t a[2 * n], b[2 * n];
  uint64_t s = 0x9e3779b97f4a7c15ull;
  auto next = [&]() { s ^= s << 13, s ^= s >> 7, s ^= s << 17; return s; };
  for (int i = 0; i < n; ++i) {
    const uint64_t r = next();
    const int kind = i % 4;
    auto small = [&](uint64_t v) { return uint16_t((v & 0x8000u) | ((40 + (v >> 16) % 60) << 7) | ((v >> 24) & 0x7f)); };
    for (int j = 0; j < 2; ++j) {
      const uint64_t v = next();
      a[2 * i + j] = kind == 0 ? uint16_t(v) : small(v);
      b[2 * i + j] = kind == 0 ? uint16_t(v >> 32) : small(v >> 32);
    }
    uint32_t cb = kind == 1 ? 0x00800000u + uint32_t(r % 64) - 32u : kind == 2 ? uint32_t(r % 0x01000000u) : uint32_t(r >> 32);
    cb |= uint32_t(r & 0x80000000u);
    std::memcpy(&acc[i], &cb, 4);
  }
  bf16_pair_step_hw(acc, a, b, got, n);
  emu->bf16_pair_step(acc, a, b, want, n);
  for (int i = 0; i < n; ++i)
    if (f32_bits(got[i]) != f32_bits(want[i]) && !(got[i] != got[i] && want[i] != want[i])) return false;
  return true;
}

// Whether this CPU's vendor (cpuid leaf 0) is the one named; whether it is an Intel CPU; whether
// it is an AMD Zen 5 or later (AuthenticAMD, family 0x1A or above), whose full-width zmm FMAs make
// the lane tiles the faster fp32 linear at every row count (kernels.h, kLinearGroupRowsZmm). Only
// which path runs, and which rows share a task, depend on them, never a bit.
static bool vendor_is(unsigned b0, unsigned d0, unsigned c0) {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  return __get_cpuid(0, &a, &b, &c, &d) && b == b0 && d == d0 && c == c0;
#else
  return false;
#endif
}
static bool intel_cpu() { return vendor_is(0x756e6547u, 0x49656e69u, 0x6c65746eu); }  // "GenuineIntel"
static bool amd_zen5_or_later() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!vendor_is(0x68747541u, 0x69746e65u, 0x444d4163u) || !__get_cpuid(1, &a, &b, &c, &d)) return false;  // "AuthenticAMD"
  const unsigned base = (a >> 8) & 0xf, ext = (a >> 20) & 0xff;
  return (base == 0xf ? base + ext : base) >= 0x1a;
#else
  return false;
#endif
}
}  // namespace tonp_avx512bf16

namespace tonp_avx512bf16 {
// The fp32 lane passes' layout: two panels a call where they run, on groups or in place, in tiles
// of 6 rows (kernels.h, kLanePanelsIntel), or a panel at a time in tiles of 8. Chosen on Intel;
// TONP_FORCE_PAIR_TILES=1 (kernels_avx512bf16_pairs) runs it on any AVX512-BF16 CPU, so the
// tests compare it with the portable build there too. Only the layout: the same bits.
// The bf16 x bf16 linear's path: on Intel (kLaneRowsPairsIntel, bf16dot_fma.h) the pair tiles of
// two row pairs or more and the lane passes on FMAs, x packed in both copies, group fetches;
// elsewhere vdpbf16ps. TONP_FORCE_BF16_FMA=1 / 0 (kernels_avx512bf16_bf16) runs either on any
// AVX512-BF16 CPU, so the tests compare both with the portable build there. The same bits.
// The lane passes' row count (lane_rows_bf16) goes with the path on Intel, by the CPU elsewhere:
// from kLaneRowsPairsZen5 rows on an AMD Zen 5 or later, the instruction's rule on others.
static void set_bf16_path(tonp::Kernels& t, bool intel) {
  const bool zen5 = !intel && amd_zen5_or_later();
  t.linear_panel_bf16 = intel  ? linear_panel_bf16_hw<true, tonp::kLaneRowsPairsIntel>
                        : zen5 ? linear_panel_bf16_hw<false, tonp::kLaneRowsPairsZen5>
                               : linear_panel_bf16_hw<false, 0>;
  t.pack_pairs = intel ? fma_pack_pairs : hw_pack_pairs;
  t.lane_rows_bf16 = intel ? tonp::kLaneRowsPairsIntel : zen5 ? tonp::kLaneRowsPairsZen5 : 0;
  t.pairs_widened = intel;
}
static void set_pair_tiles(tonp::Kernels& t, bool on) {
  t.linear_panel = on ? linear_panel_pairs : linear_panel;
  t.pack_lanes = on ? pack_lanes_pairs : pack_lanes;  // for its zmm lane tiles
  t.group_panels_f32 = t.lane_panels_f32 = on ? tonp::kLanePanelsIntel : 1;
  t.lane_tile_rows = kLaneTileRows;
}
}  // namespace tonp_avx512bf16

namespace tonp {
const Kernels* kernels_avx512bf16() {
  static const Kernels* table = []() -> const Kernels* {
#if defined(__x86_64__) || defined(__i386__)
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") && cpu_has_avx2_fma()))
      return nullptr;
    if (!tonp_avx512bf16::self_check(kernels_avx2())) return nullptr;
    static Kernels t = *kernels_avx2();
    t.name = TONP_ISA_NAME;
    t.attention = tonp_avx512bf16::attention;  // its zmm inner loops (kernels_impl.h), the AVX2 build's chains
    tonp_avx512bf16::set_pair_tiles(t, tonp_avx512bf16::intel_cpu());
    t.lane_rows_f32 = tonp_avx512bf16::kLaneRowsBuild;
    t.row_block_f32 = tonp::kRowBlockF32;
    tonp_avx512bf16::set_bf16_path(t, tonp_avx512bf16::intel_cpu());
    t.group_rows_f32 = tonp_avx512bf16::kGroupRowsBuild;  // its lane tiles read fp32 groups at every row count
    t.linear_group_rows_f32 = tonp_avx512bf16::amd_zen5_or_later() ? 1
                              : tonp_avx512bf16::intel_cpu()     ? tonp::kLinearGroupRowsIntel
                                                                 : tonp::kLinearGroupRowsZmm;  // kernels.h
    // On Intel, row blocks on fp32 groups whose lane-packed x fits in a quarter of the 2 MB L2
    // (kernels.h, kGroupBlockBytesIntel).
    t.group_block_bytes_f32 = tonp_avx512bf16::intel_cpu() ? tonp::kGroupBlockBytesIntel : 0;
    t.linear_pack_rows_f32 = tonp_avx512bf16::intel_cpu() ? tonp::kLinearPackRowsIntel : 0;
    t.weight_groups_bf16 = true;  // its one-row tiles read bf16 groups (kGroupCols)
    t.group_lane_runs = tonp_avx512bf16::kGroupLaneRuns;  // its two-lane passes read fp32 groups' lanes in pairs
    t.bf16_pair_step = tonp_avx512bf16::bf16_pair_step_hw;
    t.gemm = tonp_avx512bf16::gemm_amx_hw;  // bf16 x bf16 on AMX where it runs (gemm_amx.h)
    t.gemm_bf16out = tonp_avx512bf16::gemm_bf16out_amx_hw;
    t.gemm_on_amx = tonp_avx512bf16::gemm_on_amx;
    t.amx_pack_a = tonp_avx512bf16::amx_pack_a;
    t.amx_pack_b = tonp_avx512bf16::amx_pack_b;
    t.amx_tile = tonp_avx512bf16::amx_tile;
    t.grad_to_bf16 = tonp_avx512bf16::grad_to_bf16_hw;
    return &t;
#else
    return nullptr;
#endif
  }();
  return table;
}

// The same table with the bf16 x bf16 linear's path of Intel (fma) or of other CPUs, on any CPU
// that runs it (TONP_FORCE_BF16_FMA=1 / 0).
const Kernels* kernels_avx512bf16_bf16(bool fma) {
  static const Kernels* tables = []() -> const Kernels* {
    const Kernels* base = kernels_avx512bf16();
    if (!base) return nullptr;
    static Kernels t[2] = {*base, *base};
    tonp_avx512bf16::set_bf16_path(t[0], false);
    tonp_avx512bf16::set_bf16_path(t[1], true);
    return t;
  }();
  return tables ? tables + (fma ? 1 : 0) : nullptr;
}

// The same table with the two-panel tiles, on any CPU that runs it (TONP_FORCE_PAIR_TILES=1).
const Kernels* kernels_avx512bf16_pairs() {
  static const Kernels* table = []() -> const Kernels* {
    const Kernels* base = kernels_avx512bf16();
    if (!base) return nullptr;
    static Kernels t = *base;
    tonp_avx512bf16::set_pair_tiles(t, true);
    return &t;
  }();
  return table;
}
}  // namespace tonp

