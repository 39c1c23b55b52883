// commands.h: the subcommands of attention-client, each a function from its
// options to the process exit code (0 success, 1 the server said no or is
// not serving, 2 bad input). Errors go to stderr; results to stdout.
#pragma once

#include <string>

#include "client/cpp/attention_client.h"
#include "client/cli/load_generator.h"
#include "client/cli/request_generator.h"
#include "client/cli/session_bench.h"

namespace attention::client {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitBadInput = 2;

// Prints the models as a table, or as a ListModelsResponse in proto JSON.
int RunModels(AttentionClient& client, bool json);

// Prints every model version the server knows and its state (READY,
// LOADING, UNLOADING, UNAVAILABLE with the reason), or the
// RepositoryIndexResponse in proto JSON.
int RunRepository(AttentionClient& client, bool json);

// RepositoryModelLoad / RepositoryModelUnload of `model`; prints what was
// done. 1 when the server refused (control off, no token, no such model).
int RunLoad(AttentionClient& client, const std::string& model);
int RunUnload(AttentionClient& client, const std::string& model);

// Prints the serving status of `service` ("" = the server); 0 only if SERVING.
int RunHealth(AttentionClient& client, const std::string& service);

// Sends the AttendRequest read (proto JSON) from `input` ("-" = stdin);
// prints the AttendResponse as proto JSON.
int RunAttend(AttentionClient& client, const std::string& input, bool pretty);

// Sends the AttendRequests read from `input` ("-" = stdin), one per line in
// proto JSON (JSON lines; blank lines skipped), over one AttendStream call.
// Prints one AttendResponse per line, in request order; a request that failed
// gets one with only `error`, `request_id` and `model`, as the stream carries
// it. 1 when the call or any request failed; 2 names the line that is not a
// request.
int RunAttendStream(AttentionClient& client, const std::string& input);

struct BenchCommand {
  std::string target;  // for the report
  LoadOptions load;
  // The request file (proto JSON); empty: one generated from `shape`.
  std::string request_file;
  GeneratedRequestShape shape;
  // "attention": Attend calls; "inference": the same request as Open
  // Inference Protocol ModelInfer calls (raw contents).
  std::string api = "attention";
  bool json = false;
  // Above 0: session mode (session_bench.h), this many sessions of
  // shape.model with shape.dim; the load and request options are unused.
  int sessions = 0;
  int steps_per_session = 512;
  int tokens_per_step = 1;
};

// Runs the load; prints the report (or only the JSON object with `json`),
// and a progress line on stderr when stderr is a terminal. 1 when no call
// succeeded.
int RunBench(AttentionClient& client, const BenchCommand& command);

}  // namespace attention::client
