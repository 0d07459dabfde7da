// Run-time ISA dispatch: CPUID + XGETBV are read once; SCATTER_ADD_CPU_ISA (scalar, avx2, avx512,
// avx512_bf16) caps the level so tests can force every compiled path; set_isa() does the same
// from code. A requested level above what the CPU and OS support is clamped down, never up, and
// so is one above SCATTER_ADD_MAX_ISA, the highest level whose kernels were compiled (CMake's
// option of that name; every level by default).
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "dispatch.h"
#include "scatter_add/scatter_add.h"

#ifndef SCATTER_ADD_MAX_ISA
#define SCATTER_ADD_MAX_ISA 3
#endif
#ifndef SCATTER_ADD_AMX
#define SCATTER_ADD_AMX 0
#endif

namespace scatter_add {
namespace {

uint64_t read_xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

Isa detect_isa() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Isa::scalar;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29), popcnt = c & (1u << 23);
  if (!(osxsave && avx && fma && f16c && popcnt)) return Isa::scalar;
  const uint64_t xcr0 = read_xcr0();
  if ((xcr0 & 0x6) != 0x6) return Isa::scalar;  // XMM and YMM state enabled by the OS
  if (__get_cpuid_max(0, nullptr) < 7) return Isa::scalar;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5);
  if (!avx2) return Isa::scalar;
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));
  if (!avx512 || (xcr0 & 0xE0) != 0xE0) return Isa::avx2;  // opmask + ZMM state
  __cpuid_count(7, 1, a, b, c, d);
  return (a & (1u << 5)) ? Isa::avx512_bf16 : Isa::avx512;
}

Isa parse_env(Isa fallback) {
  const char* env = std::getenv("SCATTER_ADD_CPU_ISA");
  if (env == nullptr || *env == '\0') return fallback;
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512_bf16})
    if (std::strcmp(env, isa_name(i)) == 0) return i;
  return fallback;  // unknown names leave the best level in place
}

Isa clamp(Isa want) {
  if (static_cast<int>(want) < 0) return Isa::scalar;
  return static_cast<int>(want) < static_cast<int>(supported_isa()) ? want : supported_isa();
}

// AMX: the CPU's AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24 and 22), the tile state enabled
// by the OS in XCR0 (bits 17 and 18), and the tile data granted to this process by Linux
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, from Linux 5.16; a process that
// already holds it, as after torch's oneDNN asked, is granted again).
bool detect_amx() {
#if SCATTER_ADD_AMX && SCATTER_ADD_MAX_ISA >= 3
  if (detect_isa() != Isa::avx512_bf16) return false;
  unsigned a, b, c, d;
  __cpuid_count(7, 0, a, b, c, d);
  if (!((d >> 24) & 1u) || !((d >> 22) & 1u)) return false;
  if ((read_xcr0() & (3ull << 17)) != (3ull << 17)) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
  return false;
#endif
}

bool amx_supported() {
  static const bool ok = detect_amx();
  return ok;
}

std::atomic<bool>& amx_wanted() {  // SCATTER_ADD_CPU_AMX=0 turns the tiles off; set_amx_tiles
  static std::atomic<bool> want{[] {
    const char* env = std::getenv("SCATTER_ADD_CPU_AMX");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }()};
  return want;
}

std::atomic<int>& active_level() {
  static std::atomic<int> level{static_cast<int>(clamp(parse_env(supported_isa())))};
  return level;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512_bf16: return "avx512_bf16";
  }
  return "unknown";
}

Isa supported_isa() {
  static const Isa best = std::min(detect_isa(), static_cast<Isa>(SCATTER_ADD_MAX_ISA));
  return best;
}

Isa active_isa() { return static_cast<Isa>(active_level().load(std::memory_order_relaxed)); }

Isa set_isa(Isa isa) {
  const Isa got = clamp(isa);
  active_level().store(static_cast<int>(got), std::memory_order_relaxed);
  return got;
}

bool amx_on() { return amx_supported() && amx_wanted().load(std::memory_order_relaxed); }

bool amx_tiles() { return active_isa() == Isa::avx512_bf16 && amx_on(); }

bool set_amx_tiles(bool on) {
  amx_wanted().store(on, std::memory_order_relaxed);
  return amx_tiles();
}

namespace cpu {
const KernelTable& active_kernels() {
  const Isa isa = active_isa();  // never above SCATTER_ADD_MAX_ISA (supported_isa)
#if SCATTER_ADD_MAX_ISA >= 3
#if SCATTER_ADD_AMX
  if (isa == Isa::avx512_bf16 && amx_on()) return kernels_avx512_amx();
#endif
  if (isa == Isa::avx512_bf16) return kernels_avx512_bf16();
#endif
#if SCATTER_ADD_MAX_ISA >= 2
  if (isa == Isa::avx512) return kernels_avx512();
#endif
#if SCATTER_ADD_MAX_ISA >= 1
  if (isa == Isa::avx2) return kernels_avx2();
#endif
  (void)isa;
  return kernels_scalar();
}
}  // namespace cpu

}  // namespace scatter_add
