// How fast one core streams weights while it computes: the question behind the batched-decode
// experts at ~8 rows an expert (docs/history/performance-decode.md). benchmarks/stream.py builds
// and runs it. Two parts, one line each result:
//   synthetic|S|pf|F|GB/s   a cold array read as S interleaved streams (one 64-byte line of each
//                           in turn), pf = 1: a prefetch 1 KB ahead in each stream, F fp32 FMAs
//                           (8-wide, eight chains) per line on its values; arith|F|seconds:
//                           the same FMAs on one hot line (the arithmetic alone).
//   panel|rows|state|GB/s|GFLOP/s   the kernel table's fp32 linear_panel (the table this CPU
//                           selects) over E experts' [1536, 2048] fp32 weights as moe_experts'
//                           gate_up stage runs it: (expert, 16-column panel) tasks over OpenMP
//                           threads, `rows` rows each; state cold (weights far beyond the
//                           caches) or hot (one expert's first 64 rows, 512 KiB, in L2).
// The synthetic and the hot panels run on one thread only (OMP_NUM_THREADS=1).
// Arguments: MiB of the cold array and of the expert weights, repeats (best of them is printed).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../kernels/csrc/kernels.h"

using namespace tonp;

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// F FMAs (8 wide) per 64-byte line on its values, four independent chains; returns a sink.
template <int F>
__attribute__((target("avx2,fma"))) float stream_pass(const float* a, size_t n, size_t S, bool pf) {
  __m256 s0 = _mm256_setzero_ps(), c0 = s0, c1 = s0, c2 = s0, c3 = s0, c4 = s0, c5 = s0, c6 = s0, c7 = s0;
  const __m256 b = _mm256_set1_ps(0.999f);
  const size_t len = n / S;
  for (size_t j = 0; j < len; j += 16)
    for (size_t r = 0; r < S; ++r) {
      const float* p = a + r * len + j;
      if (pf) __builtin_prefetch(p + 256, 0, 2);
      const __m256 v = _mm256_load_ps(p), w = _mm256_load_ps(p + 8);
      s0 = _mm256_add_ps(s0, _mm256_add_ps(v, w));
      for (int f = 0; f < F; f += 8) {  // eight chains: the FMA units' throughput, not their latency
        c0 = _mm256_fmadd_ps(c0, b, v), c1 = _mm256_fmadd_ps(c1, b, w);
        c2 = _mm256_fmadd_ps(c2, b, v), c3 = _mm256_fmadd_ps(c3, b, w);
        c4 = _mm256_fmadd_ps(c4, b, v), c5 = _mm256_fmadd_ps(c5, b, w);
        c6 = _mm256_fmadd_ps(c6, b, v), c7 = _mm256_fmadd_ps(c7, b, w);
      }
    }
  float t[8];
  const __m256 c = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                                 _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
  _mm256_storeu_ps(t, _mm256_add_ps(s0, c));
  return t[0];
}

template <int F>
void synthetic(const float* a, size_t n, const float* hot, int reps, float& sink) {
  for (size_t S : {2, 4, 8, 16})
    for (int pf = 0; pf < 2; ++pf) {
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        const double t0 = now();
        sink += stream_pass<F>(a, n, S, pf);
        best = std::min(best, now() - t0);
      }
      std::printf("synthetic|%zu|%d|%d|%.2f\n", S, pf, F, n * 4.0 / best / 1e9);
    }
  // The arithmetic alone: the same number of lines, all of them one hot line per stream.
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    for (size_t i = 0; i < n / 16 / 1024; ++i) {
      sink += stream_pass<F>(hot, 16 * 1024, 1024, false);
      __asm__ volatile("" ::: "memory");  // every pass runs (no hoisting of a pure-looking call)
    }
    best = std::min(best, now() - t0);
  }
  std::printf("arith|%d|%.6f\n", F, best);
}

void panels(const Kernels* k, const std::vector<float>& W, int64_t E, int64_t N, int64_t K, int rows, const char* state,
            int reps) {
  const int chunks = 8;
  const int64_t kc = K / chunks, np = N / kPanel;
  std::vector<float> x(int64_t(rows) * K, 0.5f);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
#pragma omp parallel
    {
      std::vector<float> scratch(linear_scratch(chunks, K, rows, Elem::F32, k->lane_rows_f32));
      std::vector<float> xl(linear_lane_passes(rows, kc, Elem::F32, k->lane_rows_f32) ? int64_t(rows) * K : 0);
      if (!xl.empty()) k->pack_lanes(x.data(), K, rows, kc, chunks, xl.data());
      std::vector<float> out(int64_t(rows) * kPanel);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < E * np; ++t) {
        const int64_t e = t / np, p = t % np;
        k->linear_panel(x.data(), K, rows, W.data() + (e * N + p * kPanel) * K, K, Elem::F32, kc, chunks, nullptr,
                        kPanel, out.data(), kPanel, Elem::F32, scratch.data(), xl.empty() ? nullptr : xl.data(), nullptr);
      }
    }
    best = std::min(best, now() - t0);
  }
  const double bytes = double(E) * N * K * 4;
  std::printf("panel|%d|%s|%.2f|%.1f\n", rows, state, bytes / best / 1e9, 2.0 * rows * E * N * K / best / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1024;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 3;
  const Kernels* k = kernels_avx512bf16() ? kernels_avx512bf16() : kernels_avx2() ? kernels_avx2() : kernels_portable();
  std::printf("table|%s|threads %d\n", k->name, omp_get_max_threads());
  const size_t n = mib * (size_t(1) << 20) / 4;
  float* a = static_cast<float*>(std::aligned_alloc(64, n * 4));
  float* hot = static_cast<float*>(std::aligned_alloc(64, 16 * 1024 * 4));
  for (size_t i = 0; i < n; ++i) a[i] = 1e-3f * float(i % 7);
  for (size_t i = 0; i < 16 * 1024; ++i) hot[i] = 1e-3f * float(i % 5);
  float sink = 0;
  const bool one = omp_get_max_threads() == 1;  // the synthetic and the hot panels: one core's
  if (one && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    synthetic<0>(a, n, hot, reps, sink);
    synthetic<8>(a, n, hot, reps, sink);
    synthetic<16>(a, n, hot, reps, sink);
  }
  std::free(a);
  const int64_t N = 1536, K = 2048, E = std::max<int64_t>(1, int64_t(mib) * (1 << 20) / (N * K * 4));
  std::vector<float> W(E * N * K);
  for (size_t i = 0; i < W.size(); ++i) W[i] = float((i * 2654435761u) % 1000) * 1e-3f;
  for (int rows : {1, 4, 8, 16}) panels(k, W, E, N, K, rows, "cold", reps);
  if (one)
    for (int rows : {1, 4, 8, 16}) panels(k, W, 1, 64, K, rows, "hot", reps * 200);
  std::printf("sink|%g\n", double(sink));
  std::free(hot);
}
