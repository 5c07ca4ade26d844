// The portable build of the kernels: the same source as isa_avx2.cpp with an 8-lane array in
// place of __m256 and std::fma in place of vfmadd, so it computes identical bits (tests compare
// the two with TONP_FORCE_PORTABLE=1).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // MXCSR (bf16dot.h)
#endif
#include "kernels.h"
#define TONP_AVX2 0
#define TONP_ISA_NAME "portable"

namespace tonp_portable {
#include "isa_build.h"
}  // namespace tonp_portable

namespace tonp {
const Kernels* kernels_portable() { return &tonp_portable::kTable; }
}  // namespace tonp
