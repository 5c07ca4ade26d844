// One ISA build of the kernels and its table kTable. Included once, inside the build's own
// namespace (isa_avx2.cpp, isa_portable.cpp), after TONP_AVX2 and TONP_ISA_NAME are defined.
#include "kernels_impl.h"
#include "bf16dot.h"
#include "gemm.h"

static const tonp::Kernels kTable = {
    TONP_ISA_NAME, linear_panel, attention, rms_norm, silu_mul, lse_chunks, moe_combine, sexp,
    log_n, linear_panel_bf16, bf16_pair_step, gemm, gemm_bf16out, grad_to_bf16, swiglu_grad, pack_lanes,
    kLaneRowsBuild,
#if TONP_AVX2
    tonp::kRowBlockF32, 0, 0, nullptr, kGroupRowsBuild, kLaneRowsBuild, false,  // no row-block cap on fp32 groups, read from four rows (linear: eight); no bf16 ones
    kGroupLaneRuns, 2, 1, kLaneTileRows,  // their lanes one after another; two panels a call (linear_panels_streamed2); in place one
#else
    tonp::kRowBlock, 0, 0, nullptr, 0, 0, false,  // no groups; no row-block cap on them
    kGroupLaneRuns, 1, 1, kLaneTileRows,
#endif
    row_max_f, gumbel_argmax,
};
