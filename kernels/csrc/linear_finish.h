// How the fp32-FMA linear stores a panel's sums (compiled once per ISA: included by
// linear_impl.h inside the ISA's namespace, after chunk_tree, before the lane passes): the dot
// products' finished sums (store_rows), and the lane passes' chunk partials closed by the chunk
// tree and stored in one pass (finish_rows_c), each row tile's output lines fetched for writing
// before its last chunk (prefetch_out_rows).

// A panel's finished sums res [rows, 16] (ncols of them a row) plus the bias, rounded to out's
// dtype: the dot products' (the lane passes finish theirs in finish_rows_c, the same steps). Eight at a time with one vector store measured no faster: whole linears
// 0.98-1.00x, one row an expert 0.97-0.99x (AMD EPYC, Zen 4, one process). Kept out of line:
// inlined by GCC into the 6-row tiles' linear_rows_blocked, its copy took a quarter of the call
// (Intel Xeon, one thread, 2048 x 768 x 2048 in place: 76 GFLOP/s inlined, 96 out of line).
__attribute__((noinline)) static void store_rows(const float* res, int64_t rows, int ncols, const float* bias, void* out, int64_t ldo,
                       Elem oelem) {
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < ncols; ++j) {
      float v = res[r * kPanel + j];
      if (bias) v = v + bias[j];
      store1(out, r * ldo + j, v, oelem);
    }
}

// The chunk tree of C (a power of two) partials `stride` floats apart, eight outputs at a time, in
// registers: tree(0, C) = tree(0, C/2) + tree(C/2, C), the pairwise tree chunk_tree computes level
// by level in place, ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)) for C = 8: the same adds of the same values.
template <int C>
static inline V8 chunk_tree8(const float* p, int64_t stride) {
  if constexpr (C == 1)
    return vload(p);
  else
    return vadd(chunk_tree8<C / 2>(p, stride), chunk_tree8<C / 2>(p + (C / 2) * stride, stride));
}

// `rows` rows of a panel's partials (pb: the first row's chunk 0, chunk c at c * cstride) closed by
// the chunk tree, plus the bias, rounded to out's dtype and stored from out: chunk_tree and
// store_rows in one pass, a row's sixteen outputs finished in registers and stored as they are
// (fp32 out, a whole panel) or through store1. The same adds of the same values, the same bias
// add and rounding. Kept out of line, as store_rows. The lane passes call it for each row tile
// right after the tile's last chunk (linear_rows_blocked, linear_panels2), while its partials are
// near, where the two passes had run over the whole block's partials after its last chunk (a
// sixth of a 2048 x 768 x 2048 call in place, perf, one thread). On the Intel Xeon (family 6,
// model 167), 2 threads, against the two passes alternated in one process, every output byte
// equal: tk.linear fp32 in place 2048 x 768 x 2048 1.05-1.07x, 512 x 768 x 2048 1.02-1.07x,
// K = 2048 and 4096 (512-2048 rows) 1.02-1.06x, 9 x 4096 x 100 1.14x; the AVX2 table there
// 1.00-1.05x.
template <int C>
__attribute__((noinline)) static void finish_rows_c(const float* pb, int64_t cstride, int64_t rows, int ncols,
                                                    const float* bias, void* out, int64_t ldo, Elem oelem) {
  const bool vec = oelem == Elem::F32 && ncols == kPanel;
  for (int64_t r = 0; r < rows; ++r) {
    alignas(32) float t[kPanel];
    for (int n0 = 0; n0 < kPanel; n0 += 8) {
      V8 v = chunk_tree8<C>(pb + r * kPanel + n0, cstride);
      if (vec) {
        if (bias) v = vadd(v, vload(bias + n0));
        vstore(static_cast<float*>(out) + r * ldo + n0, v);
      } else {
        vstore(t + n0, v);
      }
    }
    if (!vec)
      for (int j = 0; j < ncols; ++j) store1(out, r * ldo + j, bias ? t[j] + bias[j] : t[j], oelem);
  }
}
// Before a row tile's last chunk: its rows' output lines fetched for writing (prefetchw; a hint, no
// arithmetic), so that finish_rows_c's stores after the chunk do not wait on a line from memory
// each (an output row's lines lie a row of out apart; perf had put half of finish_rows_c's time on
// the store after the first). Intel Xeon (family 6, model 167), against none, alternated in one
// process, every output byte equal: tk.linear fp32 2048 x 768 x 2048 (a 16 MB output) 1.06-1.11x
// on 2 threads, 1.08x on one; K = 2048-4096 and 48-512 rows 0.99-1.06x; the AVX2 table 1.01-1.02x.
static inline void prefetch_out_rows(char* out, int rows, int64_t ld_bytes, int64_t row_bytes) {
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(out + r * ld_bytes + b, 1, 3);
}
// chunks: a power of two up to kMaxChunks, as every op that runs a linear checks (check_chunks).
static void finish_rows_at(const float* pb, int64_t cstride, int64_t rows, int chunks, int ncols, const float* bias,
                           void* out, int64_t ldo, Elem oelem) {
  switch (chunks) {
    case 1: return finish_rows_c<1>(pb, cstride, rows, ncols, bias, out, ldo, oelem);
    case 2: return finish_rows_c<2>(pb, cstride, rows, ncols, bias, out, ldo, oelem);
    case 4: return finish_rows_c<4>(pb, cstride, rows, ncols, bias, out, ldo, oelem);
    case 8: return finish_rows_c<8>(pb, cstride, rows, ncols, bias, out, ldo, oelem);
    case 16: return finish_rows_c<16>(pb, cstride, rows, ncols, bias, out, ldo, oelem);
    case 32: return finish_rows_c<32>(pb, cstride, rows, ncols, bias, out, ldo, oelem);
    default: return finish_rows_c<64>(pb, cstride, rows, ncols, bias, out, ldo, oelem);
  }
}
// A block's partials pb [chunks, rows, 16] finished and stored (out: its first row).
static void finish_rows(const float* pb, int64_t rows, int chunks, int ncols, const float* bias, void* out, int64_t ldo,
                        Elem oelem) {
  finish_rows_at(pb, rows * kPanel, rows, chunks, ncols, bias, out, ldo, oelem);
}

// The np adjacent whole panels' partials pb[p] ([chunks, rows, 16] each) closed by the chunk tree
// and stored with the bias from out's panel p on: the last step of every multi-panel call.
static void finish_panels(const float* const* pb, int np, int64_t rows, int chunks, const float* bias, void* out,
                          int64_t ldo, Elem oelem) {
  const int64_t osz = oelem == Elem::F32 ? 4 : 2;
  for (int p = 0; p < np; ++p)
    finish_rows(pb[p], rows, chunks, kPanel, bias ? bias + p * kPanel : nullptr, static_cast<char*>(out) + p * kPanel * osz,
                ldo, oelem);
}
