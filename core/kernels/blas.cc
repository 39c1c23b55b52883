// blas.cc: OpenBLAS made to run kernels for this CPU (see blas.h).
#include "core/kernels/blas.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string_view>
#include <vector>

extern "C" {
char* openblas_get_corename(void);
void openblas_set_num_threads(int num_threads);
}

namespace attention {
namespace {

// Set with OPENBLAS_CORETYPE by the re-exec, so the variable can be told
// apart from one the caller set.
constexpr char kChosenMarker[] = "ATTENTION_BLAS_CORETYPE";

// The path whose kernels the BLAS should run: the CPU's, or lower if
// ATTENTION_ISA asks for a lower one (a comparison of paths should compare
// whole hosts). A bad ATTENTION_ISA is reported later, by whoever applies it.
Isa WantedIsa() {
  Isa isa = DetectedIsa();
  if (const char* value = std::getenv("ATTENTION_ISA")) {
    absl::StatusOr<Isa> forced = ParseIsa(value);
    if (forced.ok() && *forced < isa) isa = *forced;
  }
  return isa;
}

const char* CoreTypeFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      return "SKYLAKEX";
    case Isa::kAvx2:
      return "HASWELL";
    case Isa::kPortable:
      return nullptr;
  }
  return nullptr;
}

// Runs before main in every binary that links this file (anything that
// constructs an Engine does). Shared libraries are initialised before the
// executable's own objects, so OpenBLAS has chosen its core by now.
bool ReexecWithMatchingBlasCore() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return false;
  const Isa isa = WantedIsa();
  const char* core_type = CoreTypeFor(isa);
  if (core_type == nullptr || BlasCoreMatches(isa, BlasCoreName())) return false;
  std::ifstream file("/proc/self/cmdline", std::ios::binary);
  const std::string cmdline{std::istreambuf_iterator<char>(file), {}};
  std::vector<char*> argv;
  for (size_t begin = 0; begin < cmdline.size();) {
    argv.push_back(const_cast<char*>(cmdline.data()) + begin);
    begin = cmdline.find('\0', begin);
    if (begin == std::string::npos) break;
    ++begin;
  }
  if (argv.empty()) return false;
  argv.push_back(nullptr);
  setenv("OPENBLAS_CORETYPE", core_type, /*overwrite=*/1);
  setenv(kChosenMarker, core_type, /*overwrite=*/1);
  execv("/proc/self/exe", argv.data());
  // exec failed (no /proc?): results are the same, only the projections are
  // slower. Undo the variables so children do not inherit a half-applied fix.
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kChosenMarker);
  return false;
}

[[maybe_unused]] const bool reexecuted = ReexecWithMatchingBlasCore();

}  // namespace

void RunBlasOnCallingThread() { openblas_set_num_threads(1); }

bool BlasCoreForcedByCaller() {
  const char* core_type = std::getenv("OPENBLAS_CORETYPE");
  const char* chosen = std::getenv(kChosenMarker);
  return core_type != nullptr && (chosen == nullptr || std::string_view(core_type) != chosen);
}

std::string BlasCoreName() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "none";
}

bool BlasCoreMatches(Isa isa, std::string_view core) {
  switch (isa) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      return core == "SkylakeX" || core == "Cooperlake" || core == "SapphireRapids";
    case Isa::kAvx2:
      return core == "Haswell" || core == "Zen";
    case Isa::kPortable:
      return true;
  }
  return false;
}

}  // namespace attention
