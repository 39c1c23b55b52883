// dispatch_options.h: what an operator sets on the request pipeline
// (dispatcher.h), apart from the pipeline itself so that the server's
// configuration (config/server_config.h) can name its defaults.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/engine/request.h"
#include "server/dispatch/batcher.h"

namespace attention::server {

class TestGate;

// Defaults are the binary's: each is defined once, in the struct it belongs
// to (Limits, BatcherOptions).
struct DispatchOptions {
  // Per-request size caps, checked by validation.
  Limits limits;
  // Batching, per model.
  BatcherOptions batching;
  // Most bytes of request messages the server holds at once, from admission
  // to answer, over all models; beyond it RESOURCE_EXHAUSTED. 0: no cap.
  // 2^30 is the documented default of --max-queued-bytes (docs/api.md).
  int64_t max_queued_bytes = int64_t{1} << 30;
  // Work units of one piece of a long session step: a step over it is
  // computed in pieces of at most this much (and of at most
  // limits.max_request_work), one per batch of its model, so other steps and
  // requests take turns with a prompt's prefill (chunked prefill). 0: steps
  // are computed whole. 2^28 is the documented default of --chunk-work
  // (docs/api.md): about 10 ms of this host's two cores, the time a batch
  // of 16 decode steps of E=1024 takes.
  int64_t chunk_work = int64_t{1} << 28;
  // Work units of the largest plain request computed on the thread that
  // submitted it when its model's batcher is idle (dispatcher.h): waking the
  // batcher's thread and handing the answer back cost a trivial call a fifth
  // of its server CPU (10 of 50 us), more than a request of this much work
  // computes (about 4 us). 0: every request goes through the batcher's thread. 2^16 is
  // the documented default of --inline-work (docs/api.md).
  int64_t inline_work = int64_t{1} << 16;
  // A step refused only because the session pool was full (PoolWasFull:
  // no session could be preempted for it, all holding blocks being in a
  // step) waits in its batcher and begins with a later batch, once a session
  // ends or can be preempted, rather than being refused: at most
  // kLongestBlockWait (execution.cc: 60 s) and while its deadline allows. Set with
  // --session-preemption on.
  bool steps_wait_for_blocks = false;
  // Mutual TLS: client certificate names (SAN or CN) allowed to call;
  // empty: any certificate the CA signed.
  std::vector<std::string> allowed_client_identities;
  // Accepted bearer tokens; empty: no authentication. Never logged.
  // access().ReplaceTokens() swaps them while serving.
  std::vector<std::string> auth_tokens;
  // For tests only: holds each batch of the model named kTestGateModelName
  // (test_gate.h). Not owned; must outlive the dispatcher. nullptr: no gate.
  TestGate* test_gate = nullptr;
};

}  // namespace attention::server
