// Microbenchmark of the bf16 x bf16 linear: vdpbf16ps pair chains against the fp32-FMA kernels
// (benchmarks/bf16dot.py builds and runs it). Links the torch-free kernel tables
// (kernels/csrc/isa_*.cpp) and calls them the way ops.cpp does: (row block, 16-column panel)
// tasks over OpenMP threads. Candidates, sampled in turn within every repeat:
//   fp32fma  linear_panel with fp32 x and bf16 weights (widened as loaded): the kernel that ran
//            bf16 linears before the pair chains;
//   hw       linear_panel_bf16 on vdpbf16ps (the AVX512-BF16 table);
//   emu      linear_panel_bf16 emulated by FMAs under MXCSR FTZ | DAZ (the AVX2 table).
// Output: one line per (shape, candidate) with the GFLOP/s of every repeat.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "../kernels/csrc/kernels.h"

using namespace tonp;

namespace {

struct Shape { const char* name; int64_t M, K, N; };

int64_t row_block(int64_t M) {  // as ops_common.h
  const int64_t nb = (M + kRowBlock - 1) / kRowBlock, rb = (M + nb - 1) / nb;
  return std::min<int64_t>(kRowBlock, (rb + 3) / 4 * 4);
}

uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// One linear y = x W^T of the shape with the candidate; returns seconds.
double run(const Kernels* k, bool pairs, const Shape& s, const std::vector<uint16_t>& xb, const std::vector<float>& xf,
           const std::vector<uint16_t>& w, std::vector<uint16_t>& out, int chunks) {
  const int64_t M = s.M, K = s.K, N = s.N, kc = K / chunks, rb = row_block(M), pw = pairs ? kPanelPairs : kPanel;
  const int64_t np = (N + pw - 1) / pw, nmb = (M + rb - 1) / rb;
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
  {
    const int64_t rmax = std::min(rb, M);
    std::unique_ptr<float[]> scratch(
        new float[pairs ? linear_scratch_bf16(chunks, K, rmax) : linear_scratch(chunks, K, rmax, Elem::BF16, k->lane_rows_f32)]);
    std::unique_ptr<float[]> xl(new float[rmax * K]);  // fp32 lane passes: x lane-packed (as ops.cpp)
    std::unique_ptr<float[]> xp(new float[pairs_floats(rmax, chunks, kc, k->pairs_widened)]);  // dot products: x in row pairs
    int64_t packed = -1, paired = -1;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < np * nmb; ++t) {
      const int64_t mb = t / np, p = t % np, r0 = mb * rb, rows = std::min(rb, M - r0);
      const bool lanes_packed = !pairs && k->pack_lanes && linear_lane_passes(rows, kc, Elem::BF16, k->lane_rows_f32);
      if (lanes_packed && packed != mb) k->pack_lanes(xf.data() + r0 * K, K, rows, kc, chunks, xl.get()), packed = mb;
      const bool in_pairs = pairs && k->pack_pairs && bf16_packs_pairs(rows, kc, k->lane_rows_bf16);
      uint16_t* xpp = reinterpret_cast<uint16_t*>(xp.get());
      if (in_pairs && paired != mb) k->pack_pairs(xb.data() + r0 * K, K, kc, rows, chunks, xpp), paired = mb;
      const int ncols = int(std::min<int64_t>(pw, N - p * pw));
      uint16_t* o = out.data() + r0 * N + p * pw;
      if (pairs)
        k->linear_panel_bf16(xb.data() + r0 * K, K, kc, rows, w.data() + p * pw * K, K, kc, chunks, nullptr, ncols, o,
                             N, Elem::BF16, scratch.get(), in_pairs ? xpp : nullptr, nullptr);
      else
        k->linear_panel(xf.data() + r0 * K, K, rows, w.data() + p * pw * K, K, Elem::BF16, kc, chunks, nullptr, ncols,
                        o, N, Elem::BF16, scratch.get(), lanes_packed ? xl.get() : nullptr, nullptr);
    }
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 7;
  const double min_s = argc > 2 ? std::atof(argv[2]) : 0.05;  // per sample: calls until this long
  const int chunks = 8;
  const Shape shapes[] = {
      {"q_proj M=256", 256, 2048, 4096},     {"o_proj M=256", 256, 4096, 2048},
      {"lm_head M=256", 256, 2048, 16384},   {"expert gate_up M=16", 16, 2048, 1536},
      {"expert down M=16", 16, 768, 2048},   {"expert gate_up M=4", 4, 2048, 1536},
      {"expert gate_up M=1", 1, 2048, 1536}, {"q_proj M=1", 1, 2048, 4096},
  };
  struct Cand { const char* name; const Kernels* k; bool pairs; };
  std::vector<Cand> cands = {{"fp32fma", kernels_avx2(), false}};
  if (kernels_avx512bf16()) cands.push_back({"hw", kernels_avx512bf16(), true});
  cands.push_back({"emu", kernels_avx2(), true});
  std::printf("threads %d, chunks %d, repeats %d, hw %s\n", omp_get_max_threads(), chunks, repeats,
              kernels_avx512bf16() ? "yes" : "no (this CPU has no AVX512-BF16)");
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  for (const Shape& s : shapes) {
    std::vector<uint16_t> xb(s.M * s.K), w(s.N * s.K), out(s.M * s.N);
    std::vector<float> xf(s.M * s.K);
    for (size_t i = 0; i < xb.size(); ++i) xb[i] = to_bf16(nd(rng)), xf[i] = 0;
    for (size_t i = 0; i < xb.size(); ++i) {
      const uint32_t b = uint32_t(xb[i]) << 16;
      std::memcpy(&xf[i], &b, 4);
    }
    for (auto& v : w) v = to_bf16(nd(rng) * 0.02f);
    std::vector<std::vector<double>> gf(cands.size());
    for (size_t c = 0; c < cands.size(); ++c) run(cands[c].k, cands[c].pairs, s, xb, xf, w, out, chunks);  // warm
    for (int r = 0; r < repeats; ++r)
      for (size_t c = 0; c < cands.size(); ++c) {
        int calls = 0;
        double t = 0;
        while (t < min_s) t += run(cands[c].k, cands[c].pairs, s, xb, xf, w, out, chunks), ++calls;
        gf[c].push_back(2.0 * s.M * s.K * s.N * calls / t / 1e9);
      }
    for (size_t c = 0; c < cands.size(); ++c) {
      std::printf("%s|%s", s.name, cands[c].name);
      for (double g : gf[c]) std::printf("|%.1f", g);
      std::printf("\n");
    }
    std::fflush(stdout);
  }
}
