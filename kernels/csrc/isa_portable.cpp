// The portable build of the kernels: the same source as isa_avx2.cpp with an 8-lane array in
// place of __m256 and std::fma in place of vfmadd, so it computes identical bits (tests compare
// the two with TONP_FORCE_PORTABLE=1).
#include <cmath>
#include <cstdint>
#include <cstring>
#include "kernels.h"
#define TONP_AVX2 0
#define TONP_ISA_NAME "portable"

namespace tonp_portable {
#include "kernels_impl.h"
}

namespace tonp {
const Kernels* kernels_portable() { return &tonp_portable::kTable; }
}  // namespace tonp
