// seed_corpus.h: the seed inputs of each fuzz target, made from the
// conformance data in tests/conformance, so the corpus follows docs/api.md
// without thousands of committed files.
//
//   model_file     every conformance model file
//   request_json   the request of every case and of every errors.json entry,
//                  as proto3 JSON
//   request_proto  the same requests as binary protobuf
//
// write_seed_corpus (scripts/fuzz.sh) writes them to disk for libFuzzer;
// fuzz_regression_test runs them through the targets in every build.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace attention::fuzz {

struct SeedInput {
  std::string name;  // file name in the corpus directory
  std::vector<uint8_t> bytes;
};

// The fuzz targets, as named by their binaries (<target>_fuzzer) and their
// corpus and regression directories.
inline const std::vector<std::string>& TargetNames() {
  static const std::vector<std::string> names = {"model_file", "request_json", "request_proto"};
  return names;
}

// Seeds of `target` built from `conformance_dir` (tests/conformance).
std::vector<SeedInput> ConformanceSeeds(const std::string& target,
                                        const std::filesystem::path& conformance_dir);

// Every file of `directory` (none when it does not exist), by name.
std::vector<SeedInput> ReadDirectory(const std::filesystem::path& directory);

// Runs one input through the body of `target`.
void RunTarget(const std::string& target, const std::vector<uint8_t>& bytes);

}  // namespace attention::fuzz
