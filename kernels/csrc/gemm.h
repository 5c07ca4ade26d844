// The GEMM of the backward passes (gradients: correct, not order-locked; CONTRACT.md). Compiled
// per ISA after kernels_impl.h. One call computes a block C[m, n] (fp32) = (C if accumulate) +
// A[m, k] B[k, n], A and B fp32 or bf16 with any strides, in a fixed order (k blocks of kGemmKc
// in sequence, each a chain over its k per output): the same call gives the same bits, and the
// torch-facing side splits C into tasks that never depend on the thread count.
//
// Packed as BLIS does: a k block of B into [k][16] fp32 column strips, A rows into [k][MR] fp32;
// an MR x 16 micro tile of FMAs (V8 lanes). The AVX512-BF16 build replaces this with zmm tiles
// (gemm_hw.h).

// Element (i, j) of an operand as fp32.
static inline float gemm_at(const tonp::GemmOperand& o, int64_t i, int64_t j) {
  const int64_t off = i * o.rs + j * o.cs;
  return o.e == Elem::F32 ? static_cast<const float*>(o.p)[off] : bf16_to_f32(static_cast<const uint16_t*>(o.p)[off]);
}

constexpr int kGemmMr = 6;

// The packs copy (bf16 widened exactly): they change no sum. Whole strips and tiles whose
// elements lie contiguously along the packed dimension are copied by vector or by pointer;
// the rest goes element by element through gemm_at.
// bp[kk * 16 + j] = B[k0 + kk, j0 + j] (zero past n), kk < kc.
static inline void gemm_pack_b(const tonp::GemmOperand& b, int64_t k0, int64_t kc, int64_t j0, int64_t n, float* bp) {
  const int nj = int(std::min<int64_t>(16, n - j0));
  if (nj == 16 && b.cs == 1) {  // a strip's row: sixteen contiguous elements
    for (int64_t kk = 0; kk < kc; ++kk) {
      const int64_t off = (k0 + kk) * b.rs + j0;
      if (b.e == Elem::F32) {
        const float* src = static_cast<const float*>(b.p) + off;
        vstore(bp + kk * 16, vload(src)), vstore(bp + kk * 16 + 8, vload(src + 8));
      } else {
        const uint16_t* src = static_cast<const uint16_t*>(b.p) + off;
        vstore(bp + kk * 16, vload(src)), vstore(bp + kk * 16 + 8, vload(src + 8));
      }
    }
    return;
  }
  for (int64_t kk = 0; kk < kc; ++kk)
    for (int j = 0; j < 16; ++j) bp[kk * 16 + j] = j < nj ? gemm_at(b, k0 + kk, j0 + j) : 0.f;
}

// ap[kk * MR + r] = A[i0 + r, k0 + kk] (zero past m).
static inline void gemm_pack_a(const tonp::GemmOperand& a, int64_t i0, int64_t m, int64_t k0, int64_t kc, float* ap) {
  const int nr = int(std::min<int64_t>(kGemmMr, m - i0));
  if (nr == kGemmMr) {  // a whole tile: rows by pointer, no per-element dispatch
    const int64_t off = i0 * a.rs + k0 * a.cs;
    if (a.e == Elem::F32) {
      const float* src = static_cast<const float*>(a.p) + off;
      for (int64_t kk = 0; kk < kc; ++kk, src += a.cs)
        for (int r = 0; r < kGemmMr; ++r) ap[kk * kGemmMr + r] = src[r * a.rs];
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(a.p) + off;
      for (int64_t kk = 0; kk < kc; ++kk, src += a.cs)
        for (int r = 0; r < kGemmMr; ++r) ap[kk * kGemmMr + r] = bf16_to_f32(src[r * a.rs]);
    }
    return;
  }
  for (int64_t kk = 0; kk < kc; ++kk)
    for (int r = 0; r < kGemmMr; ++r) ap[kk * kGemmMr + r] = r < nr ? gemm_at(a, i0 + r, k0 + kk) : 0.f;
}

// C[0..nr, 0..nj) (+)= the tile's sums over kc.
static inline void gemm_micro(const float* ap, const float* bp, int64_t kc, float* c, int64_t ldc, int nr, int nj,
                              bool accumulate) {
  V8 acc[kGemmMr][2];
  for (int r = 0; r < kGemmMr; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t kk = 0; kk < kc; ++kk) {
    const V8 b0 = vload(bp + kk * 16), b1 = vload(bp + kk * 16 + 8);
    for (int r = 0; r < kGemmMr; ++r) {
      const V8 av = vset1(ap[kk * kGemmMr + r]);
      acc[r][0] = vfma(av, b0, acc[r][0]);
      acc[r][1] = vfma(av, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < nr; ++r) {
    float t[16];
    vstore(t, acc[r][0]);
    vstore(t + 8, acc[r][1]);
    float* cr = c + r * ldc;
    for (int j = 0; j < nj; ++j) cr[j] = accumulate ? cr[j] + t[j] : t[j];
  }
}

static void gemm(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k, float* c,
                 int64_t ldc, bool accumulate, float* scratch) {
  IeeeScope ieee;
  if (k == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.f);
    return;
  }
  float* bp = scratch;                          // [kGemmKc][16]
  float* ap = scratch + tonp::kGemmKc * 16;     // [row tiles][kGemmKc][MR]
  for (int64_t k0 = 0; k0 < k; k0 += tonp::kGemmKc) {
    const int64_t kc = std::min<int64_t>(tonp::kGemmKc, k - k0);
    const bool acc = accumulate || k0 > 0;
    for (int64_t i0 = 0; i0 < m; i0 += kGemmMr) gemm_pack_a(a, i0, m, k0, kc, ap + i0 * kc);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      gemm_pack_b(b, k0, kc, j0, n, bp);
      for (int64_t i0 = 0; i0 < m; i0 += kGemmMr)
        gemm_micro(ap + i0 * kc, bp, kc, c + i0 * ldc + j0, ldc, int(std::min<int64_t>(kGemmMr, m - i0)),
                   int(std::min<int64_t>(16, n - j0)), acc);
    }
  }
}

static void grad_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// C = A B rounded once to bf16 (k <= kGemmKc: one block, the sums never leave fp32 registers).
static void gemm_bf16out(const tonp::GemmOperand& a, const tonp::GemmOperand& b, int64_t m, int64_t n, int64_t k,
                         uint16_t* c, int64_t ldc, float* scratch) {
  float* buf = scratch + tonp::gemm_scratch();  // [m, n] after the packing scratch
  gemm(a, b, m, n, k, buf, n, false, scratch);
  for (int64_t i = 0; i < m; ++i) grad_to_bf16(buf + i * n, c + i * ldc, n);
}

// SwiGLU's backward for n elements: s = sigmoid(g) (the one exp), dg = dh u s (1 + g (1 - s)),
// du = dh g s, written in e (gate, up in e; dh fp32).
static void swiglu_grad(const void* gate, const void* up, const float* dh, void* dg, void* du, int64_t n, Elem e) {
  const V8 one = vset1(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const V8 g = loadv(gate, i, e), u = loadv(up, i, e), d = vload(dh + i);
    const V8 s = vdiv(one, vadd(one, vexp(vsub(vzero(), g))));
    float a[8], b[8];
    vstore(a, vmul(vmul(d, u), vmul(s, vadd(one, vmul(g, vsub(one, s))))));
    vstore(b, vmul(d, vmul(g, s)));
    for (int t = 0; t < 8; ++t) store1(dg, i + t, a[t], e), store1(du, i + t, b[t], e);
  }
  for (; i < n; ++i) {
    const float g = load1(gate, i, e), u = load1(up, i, e), s = 1.f / (1.f + sexp(0.f - g));
    store1(dg, i, dh[i] * u * (s * (1.f + g * (1.f - s))), e);
    store1(du, i, dh[i] * (g * s), e);
  }
}
