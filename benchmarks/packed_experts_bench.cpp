// Microbenchmark: the fp32 expert weight groups against the weights in place, in the decode's
// experts stage (benchmarks/packed_experts.py builds and runs it; docs/performance.md).
// Each (expert, 16-column panel) is packed as pack_weight_groups packs an fp32 weight (kernels.h:
// per chunk, the k's in the AVX-512 table's lane pairs' order, sixteen columns per k), here by pack_w, and the
// AVX512-BF16 table's linear_panel is run on it (lane passes at every row count, the weights read
// as one run) and on the weights in place (as moe_experts runs each); the outputs are compared
// byte for byte in every sample.
// Candidates, alternated within every repeat over two cold copies of E experts:
//   inplace  linear_panel on [E, N, K];
//   groups   linear_panel given each panel's group.
// Each sample is bracketed by a read-bandwidth probe (this VM's bus moves between ~35 and ~65
// GB/s). Output: "sample|candidate|ms|probe_before|probe_after|same" lines, then "done".
// Args: rows K N [experts=128] [repeats=6]; threads: OMP_NUM_THREADS. AVX-512 machines only.
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>
#include <immintrin.h>

#include "../kernels/csrc/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")
namespace proto {
using tonp::kPanel;

// One chunk block: W's ncols <= 16 rows, columns [0, kc), in the lane tiles' order (kernels.h
// lane_group_pos in the AVX-512 table's lane pairs, as pack_weight_groups writes it there; columns
// past ncols zero). An exact copy.
static void pack_w(const float* W, int64_t ldw, int ncols, int64_t kc, float* out) {
  for (int64_t k = 0; k < kc; ++k)
    for (int j = 0; j < 16; ++j) out[tonp::lane_group_pos(kc, k, false) * 16 + j] = j < ncols ? W[j * ldw + k] : 0.f;
}
// The read probe: 256 MiB read by every thread, best of 3 (GB/s).
static double probe_bw() {
  const int64_t n = int64_t(64) << 20;
  static std::vector<float> pb(n, 1.f);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const float* a = pb.data();
    const auto t0 = std::chrono::steady_clock::now();
    float tot = 0;
#pragma omp parallel reduction(+ : tot)
    {
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for
      for (int64_t i = 0; i < n; i += 64) {
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(a + i));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(a + i + 16));
        s2 = _mm512_add_ps(s2, _mm512_loadu_ps(a + i + 32));
        s3 = _mm512_add_ps(s3, _mm512_loadu_ps(a + i + 48));
      }
      tot += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
    }
    const double d = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, n * 4.0 / d / 1e9 + 0.0 * tot);
  }
  return best;
}

static int run(int64_t R, int64_t K, int64_t N, int64_t E, int repeats) {
  using tonp::Elem;
  using tonp::kPanel;
  const int chunks = 8;
  const int64_t kc = K / chunks, np = (N + kPanel - 1) / kPanel, ntask = E * np;
  const tonp::Kernels* k = tonp::kernels_avx512bf16();
  const int copies = 2;
  const size_t wn = size_t(E) * N * K * copies;
  std::vector<float> w(wn), wpk(size_t(E) * np * kPanel * K * copies), x(E * R * K);
  std::vector<float> out0(E * R * N), out1(E * R * N);
  uint64_t s = 1;
  for (auto& v : x) { s = s * 6364136223846793005ull + 1; v = float(int64_t(s >> 40) % 2001 - 1000) / 1000.f; }
#pragma omp parallel for
  for (int64_t i = 0; i < int64_t(wn); ++i) w[i] = float((uint64_t(i % (E * N * K)) * 2654435761ull >> 7) % 2001) / 1000.f - 1.f;  // copies equal
#pragma omp parallel for
  for (int64_t t = 0; t < ntask * copies; ++t) {
    const int64_t cp = t / ntask, ex = (t % ntask) / np, p = t % np;
    const int ncols = int(std::min<int64_t>(kPanel, N - p * kPanel));
    const float* src = w.data() + cp * E * N * K + (ex * N + p * kPanel) * K;
    float* dst = wpk.data() + cp * E * np * kPanel * K + (ex * np + p) * kPanel * K;
    for (int c = 0; c < chunks; ++c) pack_w(src + c * kc, K, ncols, kc, dst + c * kc * kPanel);
  }
  const char* names[2] = {"inplace", "groups"};
  for (int rep = 0; rep < repeats; ++rep)
    for (int m = 0; m < 2; ++m) {
      const int cp = (rep * 2 + m) % copies;
      std::vector<float>& out = m == 0 ? out0 : out1;
      const double p0 = probe_bw();
      const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel
      {
        const int th = omp_get_num_threads(), tid = omp_get_thread_num();
        std::vector<float> scratch(tonp::linear_scratch(chunks, K, R, Elem::F32, k->lane_rows_f32, true) + 64);
        std::vector<float> xl(R * K + 64);
        const int64_t per = (ntask + th - 1) / th, b = tid * per, e = std::min(ntask, b + per);
        int64_t packed = -1;
        for (int64_t t = b; t < e; ++t) {  // tasks split as moe_experts' parallel_for splits them
          const int64_t ex = t / np, p = t % np;
          const int ncols = int(std::min<int64_t>(kPanel, N - p * kPanel));
          const float* xe = x.data() + ex * R * K;
          float* o = out.data() + ex * R * N + p * kPanel;
          const float* wg = m == 1 && ncols == kPanel ? wpk.data() + cp * E * np * kPanel * K + (ex * np + p) * kPanel * K : nullptr;
          const bool lanes = wg || tonp::linear_lane_passes(R, kc, Elem::F32, k->lane_rows_f32);
          if (lanes && packed != ex) { k->pack_lanes(xe, K, R, kc, chunks, xl.data()); packed = ex; }
          k->linear_panel(xe, K, R, w.data() + cp * E * N * K + (ex * N + p * kPanel) * K, K, Elem::F32, kc, chunks,
                          nullptr, ncols, o, N, Elem::F32, scratch.data(), lanes ? xl.data() : nullptr, wg);
        }
      }
      const double ms = 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double p1 = probe_bw();
      const bool same = m == 0 || std::memcmp(out0.data(), out1.data(), out0.size() * sizeof(float)) == 0;
      std::printf("sample|%s|%.3f|%.1f|%.1f|%d\n", names[m], ms, p0, p1, int(same));
      std::fflush(stdout);
    }
  std::printf("done\n");
  return 0;
}
}  // namespace proto
#pragma GCC pop_options

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s rows K N [experts] [repeats]\n", argv[0]);
    return 2;
  }
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl")) {
    std::printf("unsupported|this CPU has no AVX-512\n");
    return 0;
  }
  const int64_t R = std::atol(argv[1]), K = std::atol(argv[2]), N = std::atol(argv[3]);
  const int64_t E = argc > 4 ? std::atol(argv[4]) : 128;
  const int repeats = argc > 5 ? std::atoi(argv[5]) : 6;
  if (R < 1 || K < 8 || K % 8 || N < 1 || E < 1) {
    std::fprintf(stderr, "rows >= 1, K a multiple of 8 (8 chunks), N >= 1\n");
    return 2;
  }
  return proto::run(R, K, N, E, repeats);
}
