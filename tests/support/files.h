// files.h: whole-file reading and writing for tests (header-only, so the core
// tests can use it without linking gRPC).
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <nlohmann/json.hpp>

namespace attention::testing {

// The bytes of `path`; "" when it cannot be read.
inline std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void WriteFile(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Writes `bytes` beside `path` and renames the copy over it, as rotation
// tools do, so a reader sees the old file or the new one, never half of one.
inline void ReplaceFile(const std::filesystem::path& path, const std::string& bytes) {
  const std::filesystem::path temporary = path.string() + ".tmp";
  WriteFile(temporary, bytes);
  std::filesystem::rename(temporary, path);
}

// `path` parsed as JSON; a discarded value when it is missing or malformed, so
// a test fails on its first lookup instead of aborting the binary.
inline nlohmann::json ReadJson(const std::filesystem::path& path) {
  return nlohmann::json::parse(ReadFile(path), nullptr, /*allow_exceptions=*/false);
}

}  // namespace attention::testing
