// metrics.h: reading a running attention-server's /metrics in tests.
//
// A metric that is missing reads as nullopt, never as 0, so a check such as
// `EXPECT_EQ(MetricValue(text, "attention_inflight_requests"), 0)` fails when
// the metric is renamed, dropped, or the scrape failed.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>

namespace attention::testing {

// The body of GET http://<address>/metrics ("" when it cannot be read).
std::string ScrapeMetrics(const std::string& address);

// Sum of every sample of `name` (e.g. "attention_requests_total", or a
// histogram's "attention_batch_size_count") whose labels include all of
// `labels` (e.g. {{"code", "OK"}}).
//  - nullopt when `text` declares no such metric (no "# TYPE" line for `name`,
//    or for the histogram or summary it is part of), or when `labels` are
//    asked and no sample of the metric has all of those label names;
//  - 0 when the metric is there but no sample has these label values (a
//    labelled counter is exported only once it has counted something).
std::optional<double> MetricValue(const std::string& text, const std::string& name,
                                  const std::map<std::string, std::string>& labels = {});

// Scrapes `address` until `done` holds for the text of a successful scrape:
// true then, false once `timeout` has passed.
bool WaitForMetrics(const std::string& address,
                    const std::function<bool(const std::string&)>& done,
                    std::chrono::seconds timeout = std::chrono::seconds(120));

// The first scrape of `address` in which MetricValue(`name`, `labels`) is at
// least `at_least`, for checking the rest of that moment; "" once `timeout`
// has passed.
std::string WaitForMetricAtLeast(const std::string& address, const std::string& name,
                                 const std::map<std::string, std::string>& labels,
                                 double at_least,
                                 std::chrono::seconds timeout = std::chrono::seconds(30));

}  // namespace attention::testing
