// write_seed_corpus: writes the seed corpus of every fuzz target.
//
//   write_seed_corpus OUT_DIR    ->  OUT_DIR/<target>/<seed files>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "tests/fuzz/seed_corpus.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::filesystem::path out(argv[1]);
  const std::filesystem::path conformance =
      std::filesystem::path(ATTENTION_SOURCE_DIR) / "tests" / "conformance";
  for (const std::string& target : attention::fuzz::TargetNames()) {
    std::filesystem::create_directories(out / target);
    const auto seeds = attention::fuzz::ConformanceSeeds(target, conformance);
    for (const auto& seed : seeds) {
      std::ofstream file(out / target / seed.name, std::ios::binary);
      file.write(reinterpret_cast<const char*>(seed.bytes.data()),
                 static_cast<std::streamsize>(seed.bytes.size()));
      if (!file) {
        std::fprintf(stderr, "cannot write %s\n", (out / target / seed.name).c_str());
        return 1;
      }
    }
    std::printf("%s: %zu seeds\n", target.c_str(), seeds.size());
  }
  return 0;
}
