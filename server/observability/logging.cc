// logging.cc: the text and JSON log formats.
#include "server/observability/logging.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// Set by ScopedLogFields; spdlog formats on the logging thread.
thread_local const nlohmann::json* current_fields = nullptr;

// One JSON object per line; the message is escaped, whatever it holds.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto level = spdlog::level::to_string_view(msg.level);
    nlohmann::json line = {
        {"time", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", absl::FromChrono(msg.time),
                                  absl::UTCTimeZone())},
        {"level", std::string(level.data(), level.size())},
        {"message", std::string(msg.payload.data(), msg.payload.size())},
    };
    if (current_fields != nullptr && current_fields->is_object()) {
      for (const auto& [name, value] : current_fields->items()) line.emplace(name, value);
    }
    const std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    dest.append(text.data(), text.data() + text.size());
    dest.push_back('\n');
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

ScopedLogFields::ScopedLogFields(const nlohmann::json& fields) : previous_(current_fields) {
  current_fields = &fields;
}

ScopedLogFields::~ScopedLogFields() { current_fields = previous_; }

absl::Status ConfigureLogging(std::string_view level, std::string_view format) {
  const spdlog::level::level_enum parsed =
      spdlog::level::from_str(std::string(level));
  // from_str() answers "off" for any unknown name.
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log-level must be trace, debug, info, warn, error, critical or off; was '", std::string(level), "'"));
  }
  std::unique_ptr<spdlog::formatter> formatter;
  if (format == "text") {
    formatter = std::make_unique<spdlog::pattern_formatter>("%Y-%m-%d %H:%M:%S.%e [%l] %v");
  } else if (format == "json") {
    formatter = std::make_unique<JsonFormatter>();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--log-format must be text or json; was '", std::string(format), "'"));
  }
  auto logger = std::make_shared<spdlog::logger>(
      "attention-server", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  logger->set_formatter(std::move(formatter));
  logger->set_level(parsed);
  logger->flush_on(spdlog::level::trace);
  spdlog::set_default_logger(std::move(logger));
  return absl::OkStatus();
}

}  // namespace attention::server
