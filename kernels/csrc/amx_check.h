// What every user of AMX-BF16 shares (amx_ops.cpp's tools, the AVX512-BF16 table's backward GEMM,
// gemm_amx.h): whether this process may run it (the CPU reports AMX-TILE and AMX-BF16, the OS
// enabled their state in XCR0, and the kernel granted this process the tile data: arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once per file that includes this), and the tile configuration
// ldtilecfg reads. Header-only, so the standalone benchmarks that link the ISA files need no
// other object. No tile instruction here.
#pragma once
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdint>

namespace tonp_amx {

// The tile configuration (palette 1): rows and bytes per row of each of the eight tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int t, int rows_, int colsb_) { rows[t] = uint8_t(rows_), colsb[t] = uint16_t(colsb_); }
};

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
