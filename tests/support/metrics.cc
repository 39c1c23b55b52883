// metrics.cc: a Prometheus text-format reader just large enough for tests.
#include "tests/support/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace attention::testing {
namespace {

// One sample line: "name{k="v",...} value".
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::optional<Sample> ParseSample(absl::string_view line) {
  Sample sample;
  const size_t name_end = line.find_first_of("{ ");
  if (name_end == absl::string_view::npos) return std::nullopt;
  sample.name = std::string(line.substr(0, name_end));
  line.remove_prefix(name_end);
  if (absl::ConsumePrefix(&line, "{")) {
    const size_t close = line.find('}');
    if (close == absl::string_view::npos) return std::nullopt;
    for (absl::string_view pair : absl::StrSplit(line.substr(0, close), ',', absl::SkipEmpty())) {
      std::pair<std::string, std::string> kv = absl::StrSplit(pair, absl::MaxSplits('=', 1));
      sample.labels[kv.first] =
          std::string(absl::StripSuffix(absl::StripPrefix(kv.second, "\""), "\""));
    }
    line.remove_prefix(close + 1);
  }
  if (!absl::ConsumePrefix(&line, " ") || !absl::SimpleAtod(line, &sample.value)) {
    return std::nullopt;
  }
  return sample;
}

// The names `name` can be declared under: itself, or the histogram or
// summary whose _sum, _count or _bucket series it is.
std::set<std::string> FamilyNames(const std::string& name) {
  std::set<std::string> names = {name};
  for (absl::string_view suffix : {"_sum", "_count", "_bucket"}) {
    absl::string_view family = name;
    if (absl::ConsumeSuffix(&family, suffix)) names.insert(std::string(family));
  }
  return names;
}

}  // namespace

std::string ScrapeMetrics(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) return "";
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &target.sin_addr);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&target), sizeof(target)) == 0) {
    const std::string request =
        absl::StrCat("GET /metrics HTTP/1.0\r\nHost: ", address, "\r\n\r\n");
    if (send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size())) {
      char buffer[8192];
      for (ssize_t n; (n = recv(fd, buffer, sizeof(buffer), 0)) > 0;) response.append(buffer, n);
    }
  }
  close(fd);
  if (!response.starts_with("HTTP/1.") || response.find(" 200 ") == std::string::npos) return "";
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

std::optional<double> MetricValue(const std::string& text, const std::string& name,
                                  const std::map<std::string, std::string>& labels) {
  const std::set<std::string> families = FamilyNames(name);
  bool declared = false;
  bool has_label_names = labels.empty();
  double sum = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&line, "# TYPE ")) {
      declared |= families.contains(std::string(line.substr(0, line.find(' '))));
      continue;
    }
    if (line.front() == '#') continue;
    const std::optional<Sample> sample = ParseSample(line);
    if (!sample.has_value() || sample->name != name) continue;
    bool names_match = true, values_match = true;
    for (const auto& [key, value] : labels) {
      auto it = sample->labels.find(key);
      names_match &= it != sample->labels.end();
      values_match &= it != sample->labels.end() && it->second == value;
    }
    has_label_names |= names_match;
    if (values_match) sum += sample->value;
  }
  if (!declared || !has_label_names) return std::nullopt;
  return sum;
}

bool WaitForMetrics(const std::string& address,
                    const std::function<bool(const std::string&)>& done,
                    std::chrono::seconds timeout) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const std::string text = ScrapeMetrics(address);
    if (!text.empty() && done(text)) return true;
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string WaitForMetricAtLeast(const std::string& address, const std::string& name,
                                 const std::map<std::string, std::string>& labels,
                                 double at_least, std::chrono::seconds timeout) {
  std::string seen;
  const bool reached = WaitForMetrics(
      address,
      [&](const std::string& text) {
        seen = text;
        return MetricValue(text, name, labels) >= at_least;
      },
      timeout);
  return reached ? seen : "";
}

}  // namespace attention::testing
