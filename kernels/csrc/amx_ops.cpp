// AMX-BF16 (`tdpbf16ps`), measured rather than used: tools for the numerics study of
// docs/CONTRACT.md ("AMX and the pair chains"), not part of any model op's arithmetic.
//
//   amx_available()                  this CPU has AMX-TILE + AMX-BF16 and the kernel granted the
//                                    process its tile state (arch_prctl ARCH_REQ_XCOMP_PERM)
//   amx_tdpbf16ps(c, a, b)           one instruction: C [M, N] fp32 += A [M, K pairs] . B [K, N]
//                                    (M, N, K <= 16), returned as a new tensor
//   amx_linear_blocks(x, w, chunks[, packed])
//                                    x [M, K] bf16 . w [N, K]^T -> fp32 [M, N] in the "block
//                                    chains" order proposed there: per chunk, one C tile
//                                    accumulated by one tdpbf16ps per 32 elements, then the
//                                    chunk tree; the prototype behind its throughput figures
//   amx_pack_blocks(w, chunks)       w as that kernel's B tiles, to pack once and pass as packed
//   fma_linear_blocks(x, w, chunks[, packed])
//                                    the same order and bits on AVX-512F FMAs (no AMX): what the
//                                    proposal costs a CPU without it
//
// Only the functions marked TONP_AMX execute tile instructions, and only after amx_available();
// the rest of the file is compiled for the baseline ISA, so loading the library never needs AMX.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx_check.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#define TONP_AMX_BUILD 1
#define TONP_AMX __attribute__((target("amx-tile,amx-bf16")))
#else
#define TONP_AMX_BUILD 0
#endif

namespace tonp {
namespace {

using tonp_amx::TileConfig;  // amx_check.h

bool amx_available() { return tonp_amx::amx_ready(); }  // amx_check.h

void require_amx(const char* op) {
  TORCH_CHECK(amx_available(), "tonp.", op, ": this CPU has no AMX-BF16 the process may use (it needs AMX-TILE "
              "and AMX-BF16 in CPUID, the tile state enabled in XCR0 and granted by arch_prctl); "
              "torch.ops.tonp.amx_available() says whether it has");
}

void check_bf16(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "tonp.", op, ": ", what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16, "tonp.", op, ": ", what, " must be bfloat16, got ", t.scalar_type());
}

#if TONP_AMX_BUILD
TONP_AMX void tile_dp_once(float* c, const uint16_t* a, const uint16_t* b, int M, int N, int K) {
  TileConfig cfg;
  cfg.set(0, M, 4 * N);
  cfg.set(1, M, 4 * K);
  cfg.set(2, K, 4 * N);
  _tile_loadconfig(&cfg);
  _tile_loadd(0, c, 4 * N);
  _tile_loadd(1, a, 4 * K);
  _tile_loadd(2, b, 4 * N);
  _tile_dpbf16ps(0, 1, 2);
  _tile_stored(0, c, 4 * N);
  _tile_release();
}
#endif

at::Tensor amx_tdpbf16ps(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b) {
  constexpr const char* op = "amx_tdpbf16ps";
  TORCH_CHECK_TYPE(c.scalar_type() == at::kFloat, "tonp.", op, ": c must be float32, got ", c.scalar_type());
  check_bf16(a, op, "a");
  check_bf16(b, op, "b");
  TORCH_CHECK_VALUE(c.dim() == 2 && a.dim() == 3 && b.dim() == 3 && a.size(2) == 2 && b.size(2) == 2 &&
                        a.size(0) == c.size(0) && b.size(1) == c.size(1) && a.size(1) == b.size(0),
                    "tonp.", op, ": expected c [M, N], a [M, K, 2], b [K, N, 2], got ", c.sizes(), ", ", a.sizes(),
                    ", ", b.sizes());
  const int64_t M = c.size(0), N = c.size(1), K = a.size(1);
  TORCH_CHECK_VALUE(M >= 1 && M <= 16 && N >= 1 && N <= 16 && K >= 1 && K <= 16, "tonp.", op,
                    ": one instruction takes 1 to 16 rows, columns and pairs, got M=", M, " N=", N, " K=", K);
  require_amx(op);
  at::Tensor out = c.contiguous().clone();
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
#if TONP_AMX_BUILD
  tile_dp_once(out.data_ptr<float>(), static_cast<const uint16_t*>(ac.data_ptr()),
               static_cast<const uint16_t*>(bc.data_ptr()), int(M), int(N), int(K));
#endif
  return out;
}

constexpr int64_t kBlock = 32;  // elements of K per instruction: 16 pairs, one 64-byte tile row

#if TONP_AMX_BUILD
// Row blocks 0 .. nrb of x (32 rows each, zero padded) against column groups g0 .. g0 + ng (16
// columns each) of every chunk: chunk c's C tiles start at zero and take one tdpbf16ps per block
// of 32 elements; part[c] (plane floats apart, ldp a row) receives the chunk partials. The
// chunks run outermost, so a chunk's row block of x (16 KB) stays in L1 while it meets every
// column block, and the tile's partials stay in L2. xt: [row block][chunks][nb][32 rows][32]
// (each block two 1 KB tiles read with a 64-byte stride; rows 4 KB apart in x would share L1
// sets), rbelems apart; wp: [groups][chunks][nb][16 pairs][16 columns][2]. The tiles are
// configured by the caller (all eight 16 rows x 64 bytes).
TONP_AMX void block_tiles(const uint16_t* xt, int64_t rbelems, int nrb, const uint16_t* wp, int64_t g0, int ng, int chunks,
                          int64_t nb, float* part, int64_t plane, int64_t ldp) {
  const int64_t wchunk = nb * 512, wgroup = int64_t(chunks) * wchunk;
  for (int c = 0; c < chunks; ++c)
    for (int i = 0; i < nrb; ++i)
      for (int g = 0; g < ng; g += 2) {
        const bool two = g + 1 < ng;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t* x0 = xt + i * rbelems + c * nb * 1024;
        const uint16_t* w0 = wp + (g0 + g) * wgroup + c * wchunk;
        for (int64_t j = 0; j < nb; ++j) {
          _tile_loadd(4, x0 + j * 1024, 64);
          _tile_loadd(6, w0 + j * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(5, x0 + j * 1024 + 512, 64);
          _tile_dpbf16ps(2, 5, 6);
          if (two) {
            _tile_loadd(7, w0 + wgroup + j * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        float* p = part + c * plane + i * 32 * ldp + g * 16;
        _tile_stored(0, p, ldp * 4);
        _tile_stored(2, p + 16 * ldp, ldp * 4);
        if (two) {
          _tile_stored(1, p + 16, ldp * 4);
          _tile_stored(3, p + 16 * ldp + 16, ldp * 4);
        }
      }
}

TONP_AMX void tiles_config() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.set(t, 16, 64);
    return c;
  }();
  _tile_loadconfig(&cfg);
}
TONP_AMX void tiles_release() { _tile_release(); }
#endif

// The geometry of a block-chains linear: chunks of kc, nb blocks of 32 per chunk.
struct BlockShape {
  int64_t K, chunks, kc, nb, groups;
  BlockShape(int64_t K_, int64_t chunks_, int64_t N)
      : K(K_), chunks(chunks_), kc(K_ / chunks_), nb((K_ / chunks_ + kBlock - 1) / kBlock), groups((N + 15) / 16) {}
  int64_t packed_elems() const { return groups * chunks * nb * 512; }
};

void check_block_args(const char* op, const at::Tensor& w, int64_t chunks) {
  check_bf16(w, op, "w");
  TORCH_CHECK_VALUE(w.dim() == 2, "tonp.", op, ": expected w [N, K], got ", w.sizes());
  TORCH_CHECK_VALUE(chunks >= 1 && chunks <= 64 && w.size(1) % chunks == 0, "tonp.", op,
                    ": chunks must be 1 to 64 and divide K, got chunks=", chunks, " K=", w.size(1));
}

// w as B tiles: wp[g][c][j][p][n][e] = w[16 g + n][c kc + 32 j + 2 p + e], zero past kc and N.
at::Tensor amx_pack_blocks(const at::Tensor& w, int64_t chunks) {
  check_block_args("amx_pack_blocks", w, chunks);
  const int64_t N = w.size(0);
  const BlockShape s(w.size(1), chunks, N);
  at::Tensor packed = at::zeros({s.packed_elems()}, w.options());
  const at::Tensor wc = w.contiguous();
  const uint16_t* ws = static_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* wp = static_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, s.groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t n = 0; n < 16 && 16 * g + n < N; ++n) {
        const uint16_t* wr = ws + (16 * g + n) * s.K;
        for (int64_t c = 0; c < chunks; ++c) {
          uint16_t* dst = wp + (g * chunks + c) * s.nb * 512 + n * 2;
          const uint16_t* src = wr + c * s.kc;
          int64_t i = 0;
          for (; i + 2 <= s.kc; i += 2) std::memcpy(dst + (i / kBlock) * 512 + (i % kBlock) / 2 * 32, src + i, 4);
          if (i < s.kc) dst[(i / kBlock) * 512 + (i % kBlock) / 2 * 32] = src[i];
        }
      }
  });
  return packed;
}

// The arguments of both block-chains kernels: x [M, K] bf16 against w [N, K] bf16, and packed
// (when given) as amx_pack_blocks(w, chunks) returns it.
BlockShape check_linear_blocks(const char* op, const at::Tensor& x, const at::Tensor& w, int64_t chunks,
                               const c10::optional<at::Tensor>& packed) {
  check_bf16(x, op, "x");
  check_block_args(op, w, chunks);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == w.size(1), "tonp.", op, ": expected x [M, K] and w [N, K], got ",
                    x.sizes(), " and ", w.sizes());
  const BlockShape s(x.size(1), chunks, w.size(0));
  if (packed) {
    check_bf16(*packed, op, "packed");
    TORCH_CHECK_VALUE(packed->dim() == 1 && packed->numel() == s.packed_elems() && packed->is_contiguous(), "tonp.", op,
                      ": packed must be amx_pack_blocks(w, chunks) (", s.packed_elems(), " elements), got ",
                      packed->sizes());
  }
  return s;
}

// A task's chunk partials part[c] (plane floats apart; rows of ldp) closed by the chunk tree
// (linear_impl.h's chunk_tree order: neighbours at doubling strides, an odd last carried; IEEE
// adds, the caller's MXCSR), stored as rows m0 .. m0 + mr, columns n0 .. n0 + nc of y [M, N].
#if TONP_AMX_BUILD
__attribute__((target("avx512f")))
#endif
void finish_tiles(float* part, int64_t chunks, int64_t plane, int64_t ldp, int64_t mr, int64_t nc, int64_t m0, int64_t n0,
                  int64_t N, float* ys) {
  for (int64_t r = 0; r < mr; ++r)  // the outputs' own floats only (padding rows and columns are never written)
    for (int64_t st = 1; st < chunks; st *= 2)
      for (int64_t c = 0; c + st < chunks; c += 2 * st) {
        float* d = part + c * plane + r * ldp;
        const float* e = part + (c + st) * plane + r * ldp;
        for (int64_t i = 0; i < nc; ++i) d[i] = d[i] + e[i];
      }
  for (int64_t r = 0; r < mr; ++r) std::memcpy(ys + (m0 + r) * N + n0, part + r * ldp, size_t(nc) * 4);
}

at::Tensor amx_linear_blocks(const at::Tensor& x, const at::Tensor& w, int64_t chunks,
                             const c10::optional<at::Tensor>& packed) {
  constexpr const char* op = "amx_linear_blocks";
  const BlockShape s = check_linear_blocks(op, x, w, chunks, packed);
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  require_amx(op);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const int64_t nb = s.nb, kc = s.kc, groups = s.groups;
  const at::Tensor xc = x.contiguous();
  const at::Tensor wpt = packed ? *packed : amx_pack_blocks(w, chunks);
  const uint16_t* xs = static_cast<const uint16_t*>(xc.data_ptr());
  const uint16_t* wp = static_cast<const uint16_t*>(wpt.data_ptr());
  // x in tile order, a row block's chunks and blocks one after another (xt[rb][c][j][32][32]),
  // each chunk zero padded to whole blocks and the rows to 32 (the tiles' last rows).
  const int64_t Mp = (M + 31) / 32 * 32, mtiles = Mp / 32, rbelems = chunks * nb * 1024;
  std::vector<uint16_t> xt(size_t(mtiles * rbelems), 0);
  at::parallel_for(0, M, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m)
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t j = 0; j < nb; ++j)
          std::memcpy(&xt[size_t(m / 32 * rbelems + (c * nb + j) * 1024 + m % 32 * 32)], xs + m * K + c * kc + j * kBlock,
                      size_t(std::min<int64_t>(kBlock, kc - j * kBlock)) * 2);
  });
  float* ys = y.data_ptr<float>();
  // Tiles of up to 64 rows x 128 columns (their chunk partials, 256 KB at 8 chunks, in L2), the
  // row tiles of a column tile one after another (its weights stay in L2). In one process
  // against 128 x 128: 1.0-1.2x at 16-512 rows; prefetching the next chunk as the backward GEMM
  // does: 0.82-1.04x.
  constexpr int64_t kRows = 64, kGroups = 8;
  const int64_t rt = (M + kRows - 1) / kRows, ct = (groups + kGroups - 1) / kGroups, plane = kRows * kGroups * 16;
  at::parallel_for(0, rt * ct, 1, [&](int64_t t0, int64_t t1) {
    const std::unique_ptr<float[]> part(new float[size_t(chunks * plane)]);  // finish_tiles reads only what was written
#if TONP_AMX_BUILD
    const unsigned saved_csr = _mm_getcsr();
    _mm_setcsr(0x1f80u);  // the chunk tree in IEEE arithmetic, whatever the caller set
    tiles_config();
#endif
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t % rt * kRows, g0 = t / rt * kGroups;
      const int64_t mr = std::min(kRows, M - m0), ng = std::min(kGroups, groups - g0);
#if TONP_AMX_BUILD
      block_tiles(xt.data() + m0 / 32 * rbelems, rbelems, int((mr + 31) / 32), wp, g0, int(ng), int(chunks), nb,
                  part.get(), plane, kGroups * 16);
#endif
      finish_tiles(part.get(), chunks, plane, kGroups * 16, mr, std::min(ng * 16, N - g0 * 16), m0, g0 * 16, N, ys);
    }
#if TONP_AMX_BUILD
    tiles_release();
    _mm_setcsr(saved_csr);
#endif
  });
  return y;
}

#if TONP_AMX_BUILD
// The same order on AVX-512F FMAs (no AMX, no vdpbf16ps): what the proposal would cost a CPU
// without AMX. Rows [r0, r0 + 4) x column groups g, g + 1 of one chunk, over the same B tiles:
// per block, per pair p, the column pairs widened to even (<< 16) and odd (& 0xffff0000) fp32
// and one FMA each per row into E and O under MXCSR FTZ | DAZ (the step, as the AVX2 build's
// pair chains already compute it); then acc = acc + (E + O), flushed. xf: x widened to fp32,
// [rows][chunks][nb * 32]. out: [4][32] chunk partials.
__attribute__((target("avx512f,fma"))) void fma_block_tile(const float* xf, int64_t ldx, const uint16_t* wg0,
                                                            const uint16_t* wg1, int64_t nb, int mr, float* out) {
  constexpr int MR = 4;
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  for (int64_t j = 0; j < nb; ++j) {
    __m512 E[MR][2], O[MR][2];
    for (int r = 0; r < MR; ++r) E[r][0] = E[r][1] = O[r][0] = O[r][1] = _mm512_setzero_ps();
    const uint16_t* b0 = wg0 + j * 512;
    const uint16_t* b1 = wg1 + j * 512;
    for (int p = 0; p < 16; ++p) {
      const __m512i v0 = _mm512_loadu_si512(b0 + p * 32), v1 = _mm512_loadu_si512(b1 + p * 32);
      const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), o0 = _mm512_castsi512_ps(_mm512_and_si512(v0, hi));
      const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), o1 = _mm512_castsi512_ps(_mm512_and_si512(v1, hi));
      for (int r = 0; r < MR; ++r) {
        if (r >= mr) break;
        const float* xr = xf + r * ldx + j * kBlock + 2 * p;
        const __m512 xe = _mm512_set1_ps(xr[0]), xo = _mm512_set1_ps(xr[1]);
        E[r][0] = _mm512_fmadd_ps(xe, e0, E[r][0]);
        E[r][1] = _mm512_fmadd_ps(xe, e1, E[r][1]);
        O[r][0] = _mm512_fmadd_ps(xo, o0, O[r][0]);
        O[r][1] = _mm512_fmadd_ps(xo, o1, O[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < 2; ++q) acc[r][q] = _mm512_add_ps(acc[r][q], _mm512_add_ps(E[r][q], O[r][q]));
  }
  for (int r = 0; r < mr; ++r) {
    _mm512_storeu_ps(out + r * 32, acc[r][0]);
    _mm512_storeu_ps(out + r * 32 + 16, acc[r][1]);
  }
}
#endif

at::Tensor fma_linear_blocks(const at::Tensor& x, const at::Tensor& w, int64_t chunks,
                             const c10::optional<at::Tensor>& packed) {
  constexpr const char* op = "fma_linear_blocks";
  const BlockShape s = check_linear_blocks(op, x, w, chunks, packed);
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
#if TONP_AMX_BUILD
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"), "tonp.", op,
              ": this CPU has no AVX-512F");
#else
  TORCH_CHECK(false, "tonp.", op, ": x86-64 Linux only");
#endif
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const int64_t nb = s.nb, kc = s.kc, ldx = chunks * nb * kBlock, groups = s.groups;
  const at::Tensor wpt = packed ? *packed : amx_pack_blocks(w, chunks);
  const uint16_t* wp = static_cast<const uint16_t*>(wpt.data_ptr());
  const at::Tensor xc = x.contiguous();
  const uint16_t* xs = static_cast<const uint16_t*>(xc.data_ptr());
  std::vector<float> xf(size_t(M * ldx), 0.f);  // widened exactly; padding zeros
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t i = 0; i < kc; ++i) {
        const uint32_t b = uint32_t(xs[m * K + c * kc + i]) << 16;
        std::memcpy(&xf[size_t(m * ldx + c * nb * kBlock + i)], &b, 4);
      }
  float* ys = y.data_ptr<float>();
  const int64_t rtiles = (M + 3) / 4, gpairs = (groups + 1) / 2;
  std::vector<uint16_t> zero_group(size_t(nb) * 512, 0);
  at::parallel_for(0, rtiles * gpairs, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> part(size_t(chunks) * 4 * 32);
#if TONP_AMX_BUILD
    const unsigned saved_csr = _mm_getcsr();
#endif
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rt = t % rtiles, gp = t / rtiles, m0 = rt * 4, g0 = 2 * gp;
      const int mr = int(std::min<int64_t>(4, M - m0));
      const int64_t wgroup = chunks * nb * 512;
#if TONP_AMX_BUILD
      _mm_setcsr(0x9fc0u);  // the chains and the block adds: FTZ | DAZ
      for (int64_t c = 0; c < chunks; ++c)
        fma_block_tile(xf.data() + m0 * ldx + c * nb * kBlock, ldx, wp + g0 * wgroup + c * nb * 512,
                       g0 + 1 < groups ? wp + (g0 + 1) * wgroup + c * nb * 512 : zero_group.data(), nb, mr,
                       part.data() + c * 4 * 32);
      _mm_setcsr(0x1f80u);  // the chunk tree: IEEE
#endif
      finish_tiles(part.data(), chunks, 4 * 32, 32, mr, std::min<int64_t>(32, N - g0 * 16), m0, g0 * 16, N, ys);
    }
#if TONP_AMX_BUILD
    _mm_setcsr(saved_csr);
#endif
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tonp, m) {
  m.def("amx_available() -> bool", &amx_available);
  m.def("amx_tdpbf16ps(Tensor c, Tensor a, Tensor b) -> Tensor");
  m.def("amx_pack_blocks(Tensor w, int chunks) -> Tensor");
  m.def("amx_linear_blocks(Tensor x, Tensor w, int chunks, Tensor? packed=None) -> Tensor");
  m.def("fma_linear_blocks(Tensor x, Tensor w, int chunks, Tensor? packed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tonp, CPU, m) {
  m.impl("amx_tdpbf16ps", &amx_tdpbf16ps);
  m.impl("amx_pack_blocks", &amx_pack_blocks);
  m.impl("amx_linear_blocks", &amx_linear_blocks);
  m.impl("fma_linear_blocks", &fma_linear_blocks);
}

}  // namespace tonp
