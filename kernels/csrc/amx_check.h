// Whether this process may run AMX-BF16: the CPU reports AMX-TILE and AMX-BF16, the OS enabled
// their state in XCR0, and the kernel granted this process the tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM), asked once per file that includes this (amx_ops.cpp's tools, the
// AVX512-BF16 table's backward GEMM, gemm_amx.h). Header-only, so the standalone benchmarks that
// link the ISA files need no other object. No tile instruction here.
#pragma once
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tonp_amx {

static inline bool amx_ready() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), bf16 = d & (1u << 22);
    if (!tile || !bf16) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA enabled by the OS
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // linux/arch/x86/include/uapi/asm/prctl.h
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace tonp_amx
