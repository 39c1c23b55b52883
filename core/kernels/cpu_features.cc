// cpu_features.cc: CPUID detection and the active kernel path.
#include "core/kernels/cpu_features.h"

#include <cpuid.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attention {
namespace {

constexpr Isa kAllIsas[] = {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kPortable};

// XCR0: which register states the OS saves on a context switch. A CPU may
// have AVX-512 that the OS (or hypervisor) does not enable.
uint64_t EnabledRegisterStates() {
  uint32_t eax, edx;
  __asm__("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

// CPUID leaf 7 sub-leaf 1, EAX bit 5 (not named by GCC 12's cpuid.h).
bool HasAvx512Bf16() {
  constexpr unsigned kAvx512Bf16Bit = 1u << 5;
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & kAvx512Bf16Bit) != 0;
}

Isa DetectFromCpuid() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return Isa::kPortable;
  const bool fma = ecx & bit_FMA;
  const bool osxsave = ecx & bit_OSXSAVE;
  if (!osxsave || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return Isa::kPortable;
  const uint64_t states = EnabledRegisterStates();
  constexpr uint64_t kYmm = 0x6;          // SSE and AVX state
  constexpr uint64_t kZmm = 0xe0 | kYmm;  // plus opmask, ZMM0-15 upper halves, ZMM16-31
  if ((states & kYmm) != kYmm) return Isa::kPortable;
  // DQ is what Highway's AVX-512 target needs besides F/BW/VL; every CPU with
  // BW and VL has it.
  const bool avx512 = (ebx & bit_AVX512F) && (ebx & bit_AVX512BW) && (ebx & bit_AVX512VL) &&
                      (ebx & bit_AVX512DQ) && (states & kZmm) == kZmm;
  if (avx512 && fma) return HasAvx512Bf16() ? Isa::kAvx512Bf16 : Isa::kAvx512;
  if ((ebx & bit_AVX2) && fma) return Isa::kAvx2;
  return Isa::kPortable;
}

std::atomic<Isa>& Active() {
  static std::atomic<Isa> active{DetectedIsa()};
  return active;
}

// "avx2, portable": the paths this CPU can run.
std::string Supported() {
  std::vector<std::string> names;
  for (Isa isa : kAllIsas) {
    if (isa <= DetectedIsa()) names.emplace_back(IsaName(isa));
  }
  return absl::StrJoin(names, ", ");
}

}  // namespace

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "unknown";
}

absl::StatusOr<Isa> ParseIsa(std::string_view name) {
  for (Isa isa : kAllIsas) {
    if (name == IsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("isa: expected one of avx512_bf16, avx512, avx2, portable, got \"",
                   std::string(name), "\""));
}

Isa DetectedIsa() {
  static const Isa detected = DetectFromCpuid();
  return detected;
}

absl::Status SelectIsa(Isa isa) {
  if (isa > DetectedIsa()) {
    return absl::FailedPreconditionError(absl::StrCat("isa ", std::string(IsaName(isa)),
                                                      ": this CPU supports only ", Supported()));
  }
  Active().store(isa, std::memory_order_relaxed);
  return absl::OkStatus();
}

Isa ActiveIsa() { return Active().load(std::memory_order_relaxed); }

absl::Status SelectIsaFromEnvironment() {
  const char* value = std::getenv("ATTENTION_ISA");
  if (value == nullptr || *value == '\0') return absl::OkStatus();
  absl::StatusOr<Isa> isa = ParseIsa(value);
  absl::Status status = isa.ok() ? SelectIsa(*isa) : isa.status();
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("ATTENTION_ISA: ", status.message()));
}

}  // namespace attention
