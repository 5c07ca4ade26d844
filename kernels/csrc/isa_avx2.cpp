// The AVX2 + FMA build of the kernels. The target pragma applies to this file only, and this
// file includes no torch header, so no inline function compiled for AVX2 can be shared with
// generic code. ops.cpp picks this table at run time when the CPU has AVX2 and FMA.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <immintrin.h>
#include "kernels.h"
#pragma GCC target("avx2,fma")
#define TONP_AVX2 1
#define TONP_ISA_NAME "avx2"

namespace tonp_avx2 {
#include "isa_build.h"
}  // namespace tonp_avx2

namespace tonp {
const Kernels* kernels_avx2() { return &tonp_avx2::kTable; }
bool cpu_has_avx2_fma() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}
}  // namespace tonp
