// Two builds of one kernel table in one process: "base" (kernels/csrc of a git ref, compiled
// with its names renamed: benchmarks/table_ab.py) and "new" (the working tree), the fp32 linear
// (Kernels::linear_panel with weight groups, pack_lanes) and the bf16 x bf16 one
// (Kernels::linear_panel_bf16, the pair chains) timed alternately, every output compared byte
// for byte between the builds. benchmarks/table_ab.py builds and runs it.
//   hot <table> <K> [rounds]          one thread, 4 panels (512 KB at K = 2048: in L2 on the Zen
//                                     4, half in L3 on the Zen 3), per row count, x lane-packed
//                                     by each build's own pack_lanes
//   hot_bf16 <table> <K> [rounds]     the same in bf16 x bf16: two 64-column panels (512 KB at K = 2048)
//   linear <table> <M> <K> <N> [rounds]   a whole linear, tasks (256-row block, panel) split as
//                                     tk.linear splits them, each thread packing its blocks
//   linear_bf16 <table> <M> <K> <N> [rounds]  the same in bf16 x bf16 (tasks of bf16_row_block
//                                     rows by 64 columns, weights in place)
//   experts <table> <mean rows> [rounds]  the fp32 experts' two stages (gate_up K 2048 N 1536,
//                                     down K 768 N 2048) over 128 cold experts (weights on 2 MB
//                                     pages, as a model's), rows an expert drawn from
//                                     Poisson(mean) (=R: exactly R rows every expert; its lines
//                                     print the mean as -R), a read probe around each sample
//   experts_bf16 <table> <mean rows> [rounds]  the same stages in bf16 x bf16 (64-column
//                                     panels, weights read in place)
// <table>: avx512bf16 or avx2. Output lines "hot|R|K|base_GFLOPs|new_GFLOPs|median_ratio|same"
// (hot and hot_bf16), "linear|M|K|N|base|new|median_ratio|same" (linear and linear_bf16),
// "experts|mean|base_ms|new_ms|probe0|probe1|same" (experts and experts_bf16, one per sample),
// then "done"; "unsupported|why" where this CPU has no such table.
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/csrc/kernels.h"

namespace tonp {
const Kernels* kernels_base_avx512bf16();  // the base build's tables (table_ab.py's renames)
const Kernels* kernels_base_avx2();
}  // namespace tonp

namespace {
using tonp::Elem;
using tonp::kPanel;
using Clock = std::chrono::steady_clock;
constexpr int kChunks = 8;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The fp32 groups' lane order of the tables compared (both read the same: main checks).
bool g_runs = false;

// W [N, K] copied into fp32 column groups (kernels.h: per panel and chunk, lane_group_pos order).
std::vector<float> groups_of(const std::vector<float>& w, int64_t N, int64_t K) {
  const int64_t kc = K / kChunks;
  std::vector<float> g(w.size());
  for (int64_t p = 0; p < N / kPanel; ++p)
    for (int c = 0; c < kChunks; ++c)
      for (int64_t k = 0; k < kc; ++k)
        for (int j = 0; j < kPanel; ++j)
          g[p * kPanel * K + c * kc * kPanel + tonp::lane_group_pos(kc, k, g_runs) * kPanel + j] = w[(p * kPanel + j) * K + c * kc + k];
  return g;
}

std::vector<float> filled(int64_t n, uint64_t mul) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = float((uint64_t(i) * mul >> 7) % 2001) / 1000.f - 1.f;
  return v;
}

// A copy of v on 2 MB pages where the kernel grants them (madvise, as tk.on_huge_pages puts a
// model's weights): with 4 KB pages every 4 KB weight row of the experts is a TLB miss.
template <class T>
std::unique_ptr<T, decltype(&std::free)> on_huge_pages(const std::vector<T>& v) {
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t bytes = (v.size() * sizeof(T) + kHuge - 1) / kHuge * kHuge;
  T* p = static_cast<T*>(std::aligned_alloc(kHuge, bytes));
  if (!p) std::abort();
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  std::memcpy(p, v.data(), v.size() * sizeof(T));
  return {p, &std::free};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds of f(v) (v = 0: base, 1: new) over `rounds` rounds, both builds each round, base first
// or, with swap, the order swapped every other round.
template <class F>
std::vector<std::vector<double>> alternated(int rounds, bool swap, F&& f) {
  std::vector<std::vector<double>> s(2);
  for (int it = 0; it < rounds; ++it)
    for (int v0 = 0; v0 < 2; ++v0) {
      const int v = swap && it % 2 ? 1 - v0 : v0;
      const auto t0 = Clock::now();
      f(v);
      s[v].push_back(seconds_since(t0));
    }
  return s;
}

// "base_GFLOPs|new_GFLOPs|median_ratio" of `flop` per sample (best samples; the median of the
// rounds' base / new time ratios).
std::string rates(double flop, const std::vector<std::vector<double>>& s) {
  std::vector<double> ratio;
  for (size_t it = 0; it < s[0].size(); ++it) ratio.push_back(s[0][it] / s[1][it]);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.1f|%.1f|%.3f", flop / *std::min_element(s[0].begin(), s[0].end()) / 1e9,
                flop / *std::min_element(s[1].begin(), s[1].end()) / 1e9, median(ratio));
  return buf;
}

// rows [0, rows) of x times panels [p0, p1) of a grouped W, with table k, as tk.linear and
// moe_experts call it (up to its group_panels_f32 whole panels a call from group_rows_f32 rows);
// xl: x lane-packed; scratch: scratch_of(K, rows).
void panels(const tonp::Kernels* k, const float* x, int64_t rows, int64_t K, const float* w, const float* g, int64_t N,
            int64_t p0, int64_t p1, float* out, std::vector<float>& scratch, const float* xl) {
  const int64_t kc = K / kChunks, take = rows >= k->group_rows_f32 ? k->group_panels_f32 : 1;
  for (int64_t p = p0; p < p1;) {
    const int64_t n = std::min(take, p1 - p);
    k->linear_panel(x, K, rows, w + p * kPanel * K, K, Elem::F32, kc, kChunks, nullptr, int(n * kPanel),
                    out + p * kPanel, N, Elem::F32, scratch.data(), xl, g + p * kPanel * K);
    p += n;
  }
}

// Scratch for panels() of up to `rows` rows, for either table.
std::vector<float> scratch_of(int64_t K, int64_t rows) {
  return std::vector<float>(tonp::linear_scratch(kChunks, K, rows, Elem::F32, 32, true, 4) + 64);
}

int hot(const tonp::Kernels* const t[2], int64_t K, int rounds) {
  const int64_t N = 4 * kPanel, kc = K / kChunks;
  const std::vector<float> w = filled(N * K, 2654435761ull), g = groups_of(w, N, K);
  for (int64_t R : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 64, 256}) {
    const std::vector<float> x = filled(R * K, 40503ull);
    std::vector<float> out[2] = {std::vector<float>(R * N), std::vector<float>(R * N)};
    std::vector<float> xl[2] = {std::vector<float>(R * K + 64), std::vector<float>(R * K + 64)};
    std::vector<float> scratch = scratch_of(K, R);
    for (int v = 0; v < 2; ++v) t[v]->pack_lanes(x.data(), K, R, kc, kChunks, xl[v].data());  // each build's tile layout
    const int reps = int(std::max<int64_t>(1, 30000000 / (R * K * N)));
    const auto s = alternated(rounds, false, [&](int v) {
      for (int r = 0; r < reps; ++r) panels(t[v], x.data(), R, K, w.data(), g.data(), N, 0, N / kPanel, out[v].data(), scratch, xl[v].data());
    });
    std::printf("hot|%ld|%ld|%s|%d\n", long(R), long(K), rates(2.0 * R * K * N * reps, s).c_str(),
                int(out[0] == out[1]));
    std::fflush(stdout);
  }
  return 0;
}

int linear(const tonp::Kernels* const t[2], int64_t M, int64_t K, int64_t N, int rounds) {
  const int64_t kc = K / kChunks, np = N / kPanel, rb = 256, nb = (M + rb - 1) / rb;
  const std::vector<float> w = filled(N * K, 2654435761ull), g = groups_of(w, N, K), x = filled(M * K, 40503ull);
  std::vector<float> out[2] = {std::vector<float>(M * N), std::vector<float>(M * N)};
  const auto s = alternated(rounds, true, [&](int v) {
#pragma omp parallel
    {
      const int th = omp_get_num_threads(), tid = omp_get_thread_num();
      const int64_t ntask = nb * np, per = (ntask + th - 1) / th, b = tid * per, e = std::min(ntask, b + per);
      std::vector<float> scratch = scratch_of(K, rb), xl(rb * K + 64);
      int64_t packed = -1;
      for (int64_t task = b; task < e;) {  // the block's panels in this thread's tasks
        const int64_t blk = task / np, p = task % np, r0 = blk * rb, rows = std::min(rb, M - r0);
        const int64_t p1 = std::min(np, p + e - task);
        if (packed != blk) t[v]->pack_lanes(x.data() + r0 * K, K, rows, kc, kChunks, xl.data()), packed = blk;
        panels(t[v], x.data() + r0 * K, rows, K, w.data(), g.data(), N, p, p1, out[v].data() + r0 * N, scratch, xl.data());
        task += p1 - p;
      }
    }
  });
  std::printf("linear|%ld|%ld|%ld|%s|%d\n", long(M), long(K), long(N), rates(2.0 * M * K * N, s).c_str(),
              int(out[0] == out[1]));
  return 0;
}

// Read bandwidth (GB/s) of every thread reading its share of 256 MiB, best of 2.
double probe() {
  static std::vector<float> buf(int64_t(64) << 20, 1.f);
  double best = 0;
  for (int rep = 0; rep < 2; ++rep) {
    const auto t0 = Clock::now();
    double tot = 0;
#pragma omp parallel for reduction(+ : tot)
    for (int64_t i = 0; i < int64_t(buf.size()); i += 16) tot += buf[i] + buf[i + 4] + buf[i + 8] + buf[i + 12];
    best = std::max(best, buf.size() * 4.0 / seconds_since(t0) / 1e9 + 0.0 * tot);
  }
  return best;
}

// Rows an expert drawn from Poisson(mean) (seed 1), or, for a negative mean, exactly -mean rows
// every expert: each expert's rows and first sorted row, the experts with any, the most rows.
struct Routing {
  std::vector<int> rows, used;
  std::vector<int64_t> r0;
  int64_t maxr = 1;
};
Routing poisson_rows(int E, double mean) {
  std::mt19937 rng(1);
  std::poisson_distribution<int> draw(mean);
  Routing rt;
  rt.rows.resize(E), rt.r0.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    rt.rows[e] = mean < 0 ? int(-mean) : draw(rng), rt.r0[e + 1] = rt.r0[e] + rt.rows[e], rt.maxr = std::max<int64_t>(rt.maxr, rt.rows[e]);
    if (rt.rows[e]) rt.used.push_back(e);
  }
  return rt;
}

// `rounds` samples of run(v) for both builds (v = 0: base, 1: new), the order swapped every
// other round, a read probe before and after each: "experts|mean|base_ms|new_ms|probe0|probe1|
// same" (same(): the two builds' outputs equal).
template <class F, class S>
void expert_samples(double mean, int rounds, F&& run, S&& same) {
  for (int it = 0; it < rounds; ++it) {
    const double p0 = probe();
    double ms[2];
    for (int v0 = 0; v0 < 2; ++v0) {
      const int v = it % 2 ? 1 - v0 : v0;
      const auto t0 = Clock::now();
      run(v);
      ms[v] = 1e3 * seconds_since(t0);
    }
    const double p1 = probe();
    std::printf("experts|%.1f|%.3f|%.3f|%.1f|%.1f|%d\n", mean, ms[0], ms[1], p0, p1, int(same()));
    std::fflush(stdout);
  }
}

int experts(const tonp::Kernels* const t[2], double mean, int rounds) {
  const int E = 128;
  const auto [rows, used, r0, maxr] = poisson_rows(E, mean);
  struct Stage { int64_t K, N; std::vector<float> w, g; };
  Stage st[2] = {{2048, 1536, {}, {}}, {768, 2048, {}, {}}};
  for (Stage& s : st) s.w = filled(E * s.N * s.K, 2654435761ull), s.g = groups_of(s.w, E * s.N, s.K);
  const auto w0 = on_huge_pages(st[0].w), g0 = on_huge_pages(st[0].g), w1 = on_huge_pages(st[1].w), g1 = on_huge_pages(st[1].g);
  const float* const wh[2] = {w0.get(), w1.get()};
  const float* const gh[2] = {g0.get(), g1.get()};
  const std::vector<float> x = filled(r0[E] * 2048, 40503ull);
  std::vector<float> out[2][2];
  for (int v = 0; v < 2; ++v)
    for (int s = 0; s < 2; ++s) out[v][s].assign(r0[E] * st[s].N, 0.f);
  expert_samples(mean, rounds, [&](int v) {
    for (int s = 0; s < 2; ++s) {
      const int64_t K = st[s].K, N = st[s].N, kc = K / kChunks, np = N / kPanel, ntask = int64_t(used.size()) * np;
#pragma omp parallel
      {  // (expert, panel) tasks split in contiguous halves, as moe_experts' parallel_for splits them
        const int th = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t per = (ntask + th - 1) / th, b = tid * per, e = std::min(ntask, b + per);
        std::vector<float> scratch = scratch_of(K, maxr), xl(maxr * K + 64);
        int packed = -1;
        for (int64_t task = b; task < e;) {  // the expert's panels in this thread's tasks
          const int ex = used[task / np];
          const int64_t p = task % np, p1 = std::min(np, p + e - task);
          const float* xe = x.data() + r0[ex] * K;
          if (packed != ex) t[v]->pack_lanes(xe, K, rows[ex], kc, kChunks, xl.data()), packed = ex;
          panels(t[v], xe, rows[ex], K, wh[s] + ex * N * K, gh[s] + ex * N * K, N, p, p1,
                 out[v][s].data() + r0[ex] * N, scratch, xl.data());
          task += p1 - p;
        }
      }
    }
  }, [&] { return out[0][0] == out[1][0] && out[0][1] == out[1][1]; });
  return 0;
}

// bf16 (round to nearest even) of the fp32 values v.
std::vector<uint16_t> bf16_of(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    b[i] = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return b;
}

// The experts' two stages in bf16 x bf16, as moe_experts runs them: (expert, 64-column panel)
// tasks split in contiguous halves, each expert's rows packed in row pairs where the table
// reads them so (Kernels::pack_pairs), weights in place (no bf16 weight groups).
int experts_bf16(const tonp::Kernels* const t[2], double mean, int rounds) {
  constexpr int64_t PW = tonp::kPanelPairs;
  const int E = 128;
  const auto [rows, used, r0, maxr] = poisson_rows(E, mean);
  struct Stage { int64_t K, N; std::vector<uint16_t> w; };
  Stage st[2] = {{2048, 1536, {}}, {768, 2048, {}}};  // chunks of 256 and 96: multiples of 16, no padding
  for (Stage& s : st) s.w = bf16_of(filled(E * s.N * s.K, 2654435761ull));
  const auto w0 = on_huge_pages(st[0].w), w1 = on_huge_pages(st[1].w);
  const uint16_t* const wh[2] = {w0.get(), w1.get()};
  const std::vector<uint16_t> x = bf16_of(filled(r0[E] * 2048, 40503ull));
  std::vector<uint16_t> out[2][2];
  for (int v = 0; v < 2; ++v)
    for (int s = 0; s < 2; ++s) out[v][s].assign(r0[E] * st[s].N, 0);
  expert_samples(mean, rounds, [&](int v) {
    for (int s = 0; s < 2; ++s) {
      const int64_t K = st[s].K, N = st[s].N, kc = K / kChunks, np = N / PW, ntask = int64_t(used.size()) * np;
#pragma omp parallel
      {
        const int th = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t per = (ntask + th - 1) / th, b = tid * per, e = std::min(ntask, b + per);
        std::vector<float> scratch(tonp::linear_scratch_bf16(kChunks, K, maxr) + 64);
        std::vector<uint16_t> xp(2 * tonp::pairs_floats(maxr, kChunks, kc, true) + 64);
        int packed = -1;
        for (int64_t task = b; task < e; ++task) {
          const int ex = used[task / np];
          const int64_t p = task % np;
          const uint16_t* xe = x.data() + r0[ex] * K;
          const bool pairs = t[v]->pack_pairs && tonp::bf16_packs_pairs(rows[ex], kc, t[v]->lane_rows_bf16);
          if (pairs && packed != ex) t[v]->pack_pairs(xe, K, kc, rows[ex], kChunks, xp.data()), packed = ex;
          t[v]->linear_panel_bf16(xe, K, kc, rows[ex], wh[s] + (ex * N + p * PW) * K, K, kc, kChunks, nullptr,
                                  int(PW), out[v][s].data() + r0[ex] * N + p * PW, N, Elem::BF16, scratch.data(),
                                  pairs ? xp.data() : nullptr, nullptr);
        }
      }
    }
  }, [&] { return out[0][0] == out[1][0] && out[0][1] == out[1][1]; });
  return 0;
}
// hot in bf16 x bf16: one thread, two 64-column panels (512 KB at K = 2048, in L2), per row count.
int hot_bf16(const tonp::Kernels* const t[2], int64_t K, int rounds) {
  constexpr int64_t PW = tonp::kPanelPairs;
  const int64_t N = 2 * PW, kc = K / kChunks;
  const std::vector<uint16_t> w = bf16_of(filled(N * K, 2654435761ull));
  for (int64_t R : {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 64, 256}) {
    const std::vector<uint16_t> x = bf16_of(filled(R * K, 40503ull));
    std::vector<uint16_t> out[2] = {std::vector<uint16_t>(R * N), std::vector<uint16_t>(R * N)};
    std::vector<uint16_t> xp(2 * tonp::pairs_floats(R, kChunks, kc, true) + 64);
    std::vector<float> scratch(tonp::linear_scratch_bf16(kChunks, K, R) + 64);
    const int reps = int(std::max<int64_t>(1, 30000000 / (R * K * N)));
    const auto s = alternated(rounds, false, [&](int v) {
      const bool pairs = t[v]->pack_pairs && tonp::bf16_packs_pairs(R, kc, t[v]->lane_rows_bf16);
      for (int r = 0; r < reps; ++r) {
        if (pairs) t[v]->pack_pairs(x.data(), K, kc, R, kChunks, xp.data());
        for (int64_t p = 0; p < N / PW; ++p)
          t[v]->linear_panel_bf16(x.data(), K, kc, R, w.data() + p * PW * K, K, kc, kChunks, nullptr, int(PW),
                                  out[v].data() + p * PW, N, Elem::BF16, scratch.data(), pairs ? xp.data() : nullptr,
                                  nullptr);
      }
    });
    std::printf("hot|%ld|%ld|%s|%d\n", long(R), long(K), rates(2.0 * R * K * N * reps, s).c_str(),
                int(out[0] == out[1]));
    std::fflush(stdout);
  }
  return 0;
}
// A whole bf16 x bf16 linear, (row block of bf16_row_block(M) rows, 64-column panel) tasks split
// over the threads in contiguous shares as tk.linear splits them; weights read in place.
int linear_bf16(const tonp::Kernels* const t[2], int64_t M, int64_t K, int64_t N, int rounds) {
  constexpr int64_t PW = tonp::kPanelPairs;
  const int64_t kc = K / kChunks, np = (N + PW - 1) / PW, rb = tonp::bf16_row_block(M), nb = (M + rb - 1) / rb;
  const std::vector<uint16_t> w = bf16_of(filled(N * K, 2654435761ull)), x = bf16_of(filled(M * K, 40503ull));
  std::vector<uint16_t> out[2] = {std::vector<uint16_t>(M * N), std::vector<uint16_t>(M * N)};
  const auto s = alternated(rounds, true, [&](int v) {
#pragma omp parallel
    {
      const int th = omp_get_num_threads(), tid = omp_get_thread_num();
      const int64_t ntask = nb * np, per = (ntask + th - 1) / th, b = tid * per, e = std::min(ntask, b + per);
      std::vector<float> scratch(tonp::linear_scratch_bf16(kChunks, K, rb) + 64);
      std::vector<uint16_t> xp(2 * tonp::pairs_floats(rb, kChunks, kc, true) + 64);
      int64_t packed = -1;
      for (int64_t task = b; task < e; ++task) {
        const int64_t blk = task / np, p = task % np, r0 = blk * rb, rows = std::min(rb, M - r0);
        const bool pairs = t[v]->pack_pairs && tonp::bf16_packs_pairs(rows, kc, t[v]->lane_rows_bf16);
        if (pairs && packed != blk) t[v]->pack_pairs(x.data() + r0 * K, K, kc, rows, kChunks, xp.data()), packed = blk;
        t[v]->linear_panel_bf16(x.data() + r0 * K, K, kc, rows, w.data() + p * PW * K, K, kc, kChunks, nullptr,
                                int(std::min(PW, N - p * PW)), out[v].data() + r0 * N + p * PW, N, Elem::BF16,
                                scratch.data(), pairs ? xp.data() : nullptr, nullptr);
      }
    }
  });
  std::printf("linear|%ld|%ld|%ld|%s|%d\n", long(M), long(K), long(N), rates(2.0 * M * K * N, s).c_str(),
              int(out[0] == out[1]));
  return 0;
}
}  // namespace

// An experts mode's rows argument: a Poisson mean, or "=R" (exactly R rows an expert: -R); a
// mean or R that is not positive exits with the reason.
double rows_arg(const char* a) {
  const double v = std::atof(a[0] == '=' ? a + 1 : a);
  if (!(v > 0)) {
    std::fprintf(stderr, "table_ab_bench: rows %s: a positive Poisson mean or =R with R >= 1\n", a);
    std::exit(2);
  }
  return a[0] == '=' ? -std::max(1.0, std::floor(v)) : v;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s hot|hot_bf16|linear|linear_bf16|experts|experts_bf16 <table> args...\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1], table = argv[2];
  const tonp::Kernels* t[2] = {nullptr, nullptr};
  if (table == "avx512bf16") {
    t[0] = tonp::kernels_base_avx512bf16(), t[1] = tonp::kernels_avx512bf16();
  } else if (table == "avx2") {
    if (tonp::cpu_has_avx2_fma()) t[0] = tonp::kernels_base_avx2(), t[1] = tonp::kernels_avx2();
  } else {
    std::fprintf(stderr, "unknown table %s\n", table.c_str());
    return 2;
  }
  if (!t[0] || !t[1]) {
    std::printf("unsupported|this CPU runs no %s table\n", table.c_str());
    return 0;
  }
  if (t[0]->group_lane_runs != t[1]->group_lane_runs) {
    std::printf("unsupported|the two %s tables read fp32 groups in different lane orders\n", table.c_str());
    return 0;
  }
  g_runs = t[1]->group_lane_runs;
  const int last = argc - 1;
  int rc = 2;
  if (mode == "hot") rc = hot(t, std::atol(argv[3]), argc > 4 ? std::atoi(argv[last]) : 9);
  if (mode == "hot_bf16") rc = hot_bf16(t, std::atol(argv[3]), argc > 4 ? std::atoi(argv[last]) : 9);
  if (mode == "linear" && argc >= 6)
    rc = linear(t, std::atol(argv[3]), std::atol(argv[4]), std::atol(argv[5]), argc > 6 ? std::atoi(argv[6]) : 7);
  if (mode == "linear_bf16" && argc >= 6)
    rc = linear_bf16(t, std::atol(argv[3]), std::atol(argv[4]), std::atol(argv[5]), argc > 6 ? std::atoi(argv[6]) : 7);
  if (mode == "experts") rc = experts(t, rows_arg(argv[3]), argc > 4 ? std::atoi(argv[4]) : 10);
  if (mode == "experts_bf16") rc = experts_bf16(t, rows_arg(argv[3]), argc > 4 ? std::atoi(argv[4]) : 10);
  std::printf("done\n");
  return rc;
}
