// engine.h: the attention engine.
//
// Computes, for every kind of model, exactly what docs/api.md defines:
//
//   scores  s[b,i,j] = score(q[b,i], k[b,j])                 (model's kind)
//   allowed (i,j)    iff j < valid_len[b(,i)] and, if causal, j <= i
//   s[b,i,j] = -1e6 where not allowed (replaced, not added)
//   weights = softmax_j(s),  output = weights . values
//
// so a row with no allowed key gets uniform weights 1/n_k over all keys, and
// valid_len >= n_k masks nothing. multi_head projects queries, keys and values
// (y = x W^T + b), runs that rule per head with scale 1/sqrt(E/H) on columns
// [h E/H, (h+1) E/H), concatenates the heads and applies the output projection.
//
// Layout: every tensor is row-major float32; queries (B, n_q, d_q), keys
// (B, n_k, d_k), values (B, n_k, d_v); output (B, n_q, d_v), or (B, n_q, E)
// for multi_head; weights (B, n_q, n_k), or (B, H, n_q, n_k) for multi_head.
//
// Speed: a batch of requests with different B, n_q and n_k runs as ragged
// executions (Run): no padding, and the key loop of every query stops at its
// last allowed key, so masked work is never done. Unless weights are asked
// for, no (n_q x n_k) score matrix exists (fused kernel with online softmax).
//
//   attention::Engine engine;                     // pool sized to the cores
//   absl::StatusOr<AttentionResult> r = engine.Attend(model, request);
#pragma once

#include <functional>
#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "core/model/model.h"
#include "core/engine/request.h"
#include "core/tensor.h"

namespace attention {

class ThreadPool;
struct ValidatedStep;
namespace internal {
class ScratchPool;
}  // namespace internal

struct AttentionResult {
  Tensor output;             // (B, n_q, d_v) or (B, n_q, E)
  Tensor attention_weights;  // empty unless return_attention_weights
  // OK when output and weights are the answer. Otherwise they are empty and
  // this says why: the request's StopCheck stopped it (its status), or the
  // answer is not finite in float32 although the request is
  // (INVALID_ARGUMENT naming the scale and the inputs' magnitude).
  absl::Status status;
};

// Asked by the engine, from any of its threads, between blocks of a
// request's work (about kStopPollWork units apart, a millisecond of one
// core): a non-OK status stops the request, which then costs no more CPU
// while the rest of its batch goes on, and becomes its result's status.
// Requests of less work than that are never asked. Must be thread-safe.
using StopCheck = std::function<absl::Status()>;

// A request that passed Validate() for the model it runs with.
struct ValidatedRequest {
  const AttentionRequest* request = nullptr;  // not owned; outlives Run()
  AttentionDims dims;
  StopCheck stop = nullptr;  // empty: computed to the end
};

struct EngineOptions {
  // Worker threads; 0 = one per hardware thread.
  int num_threads = 0;
  // Run() computes a batch in consecutive groups of requests, one ragged
  // execution each, so that its scratch does not grow with the batch: a
  // group's requests hold together at most this many floats of token rows
  // (each request: B (n_q + n_k) times its widest row of d_q, d_k, d_v, the
  // output's last axis and additive's hidden size); a request over it is a
  // group of its own. 0 = the default (engine.cc, kGroupFloats).
  int64_t max_group_floats = 0;
  // A group (or RunSteps call) of less work than this, in RequestWork's
  // units, runs on the calling thread alone: waking workers for each phase
  // costs more CPU than a single-token step computes. 0 = the default
  // (engine.cc, kSerialWork); negative: every group uses the whole pool.
  double serial_work = 0;
  // A session step whose attention has fewer tasks than the pool's threads
  // can keep busy cuts each long problem's keys into ranges computed on
  // several threads and merged (split-K, attention_tasks.h), so one
  // session's long context is read by every thread. false: each problem's
  // keys in one task (for comparison).
  bool split_keys = true;
};

class Engine {
 public:
  explicit Engine(EngineOptions options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates, then computes one request; the result's status when it is
  // not OK.
  absl::StatusOr<AttentionResult> Attend(const Model& model, const AttentionRequest& request,
                                         const Limits& limits = {});

  // Computes a batch of validated requests of one model, consecutive requests
  // merged into ragged executions of at most a few MiB of tokens each, so its
  // scratch memory does not grow with the batch; results[r] answers
  // requests[r] and equals what Attend() returns for it alone (a request
  // that stopped or overflowed has only its status). Safe to call from
  // several threads at once (they share the pool).
  void Run(const Model& model, std::span<const ValidatedRequest> requests,
           std::span<AttentionResult> results);

  // Computes validated steps of decoding sessions opened on one model
  // (core/sessions/session.h, which says what results[s] holds). Each session that
  // answers OK has grown by its step; one that does not is as before it.
  void RunSteps(std::span<const ValidatedStep> steps, std::span<AttentionResult> results);

  int num_threads() const;
  // Bytes of scratch the engine keeps between Run calls (group_scratch.h),
  // counted while no call holds any.
  int64_t kept_scratch_bytes() const;

 private:
  // The pool for `work` units: serial_ (the caller alone) below serial_work_.
  ThreadPool& PoolFor(double work) const;

  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<ThreadPool> serial_;
  // Run's kept group buffers, lent to one call at a time (group_scratch.h).
  std::unique_ptr<internal::ScratchPool> scratch_;
  int64_t max_group_floats_;
  double serial_work_;
  bool split_keys_;
};

}  // namespace attention
