// attention_bench.cc: `attention-bench`, the engine's speed through its public
// API, next to the machine's GEMM peak so ratios come from one run.
//
//   multi_head/B:8/n:128/E:256/H:8/masked:0   self-attention of a multi_head
//       model (torch layout, random weights and biases): projections, H heads
//       of size E/H, output projection.
//   multi_head_bf16/B:8/n:128/E:256/H:8/masked:0  the same model with
//       precision bf16 (docs/api.md 5.5): its projections, QK^T and P V in
//       BF16 on the avx512_bf16 path; the FP32 path from BF16-held weights
//       on the others.
//   dot_product/B:8/n:128/E:256/H:8/masked:0  the attention core of the same
//       problem: B*H slices of head size d = E/H through the dot_product model.
//   dot_product_bf16/...  the same through a bf16 dot_product model (QK^T and
//       P V in BF16 on the avx512_bf16 path).
//   gemm/M:2048/N:2048/K:2048/threads:T       Eigen SGEMM C = A B (through
//       OpenBLAS, one thread per call, as the engine runs it), split by column
//       blocks over T threads: the peak the kernels are built from.
//   scaling/<kind>/vary:<x>/B:../n_q:../n_k:../d:../valid:..  cost against one
//       of d (E for multi_head), n_q, n_k, valid length, the others at a base
//       point; keys and values are a tensor of their own (cross-attention).
//       Driven by bench/cost_scaling.py.
//   memory/dot_product/B:8/n:16384/d:64  one call, no weights: peak resident
//       memory over the size of inputs + output (see MemoryPeak).
//   batch/multi_head/B:8/n:128/E:256/H:8/masked:0/requests:k  k copies of one request
//       (keys and values given, as attention-client bench sends them) through
//       one Engine::Run, as the server's batcher runs them: time and CPU per
//       request against requests:1, and the memory the calls add.
//   batch/self/multi_head/B:1/n:1/E:1024/H:16/masked:0/requests:k  the same
//       with queries only (self-attention: Q, K and V into one buffer): the
//       service benchmarks' single-token request, without the service around it;
//       .../threads:1 the same on an engine of one thread.
//   decode/session/E:512/H:8/steps:512  one self session (core/sessions/session.h)
//       decoding 512 single tokens, each step one RunSteps; against
//   decode/prefix/E:512/H:8/steps:512  the same 512 tokens, each step the
//       whole prefix through Attend (causal), as a client without sessions
//       does. ms_per_request is per token.
//   decode/sessions:S/E:1024/H:16/prompt:P/steps:64  S self sessions, each
//       after a P-token prompt (not timed, nor a first pass of the same
//       sessions that warms the engine), then 64 rounds of one RunSteps
//       over a single-token step of every session: tokens_per_s over all S
//       (continuous batching) against sessions:1. Every round reads every
//       session's keys and values (2 E floats a token), so the longer the
//       prompt, the more memory traffic bounds the rounds.
//   bandwidth/read/threads:T  a STREAM-like sum over 1 GiB of floats, on one
//       thread or on every thread of the engine's pool (T = 0): GBps, the
//       read bandwidth the long decodes below are held against.
//   decode/long/dot_product/B:1/H:h/H_kv:k/d:128/values:v/context:N  one
//       one-token step after another of a dot_product self session over
//       grouped heads (4-D rows) holding N tokens: H:32/H_kv:8/values:1 is a
//       Llama-like layer's attention (GQA 4:1, keys and values apart),
//       H:8/H_kv:8/values:0 rows that are their own keys and values. The
//       context is filled without computing its prefill
//       (internal::AppendUncomputed). bytes_per_step counts the keys and
//       values a step reads, read_GBps them over the step's time, of_probe
//       that over bandwidth/read/threads:0 measured in the same run; .../split:0
//       the same on an engine that keeps each problem's keys in one task
//       (EngineOptions::split_keys); .../kv:bfloat16 and .../kv:float16 the
//       same with the session's keys and values held in 16 bits
//       (SessionOpen::kv_dtype), bytes_per_step counting the bytes held.
//   decode/long/llama3_8b/context:N  the same for the Hugging Face layer of
//       layer/llama3_8b (multi_head, rotary, 32 heads over 8 kv heads):
//       bytes_per_step also counts its fp32 projection weights, read once.
//   decode/row_kernel/rows:R/d:128/keys:512  the decode steps' kernel alone
//       (FlashTilePath::row_kernel, core/kernels/flash_tile.h) on one thread:
//       R query rows (R = 4: a grouped-query group) over 512 keys whose rows
//       are also the values, 256 KiB in fp32, so they stay in L2: the
//       kernel's compute rate with no memory traffic behind it, as
//       ns_per_key. .../kv:bfloat16 and .../kv:float16 the same over rows
//       held in 16 bits.
//   projection/M:m/E:e/gemm:packed|packed_bf16|blas  one projection
//       out = in W^T + b of m rows, W e x e, on one thread: over the weights
//       packed at load (core/kernels/packed_gemm.h) in fp32 or bf16, or through Eigen
//       and the BLAS: the measurement behind the engine's choice between
//       them (Projection::UsesPackedWeights in core/engine/projection.h).
//
// masked:1 gives every example a valid length drawn uniformly from [n/4, n]
// (fixed seed). GFLOPS counts useful work per wall-clock second:
//   attention   sum_b n * L_b * 4E    (QK^T and PV over allowed keys only;
//                                      L_b = n when unmasked)
//   projections 8 B n E^2             (multi_head only: Q, K, V and output)
// so a masked run has the same GFLOPS as an unmasked one when it skips the
// masked work perfectly, and its Time shows the speedup. `allowed` is the
// fraction of score entries that are allowed. GFLOPS_per_core divides by the
// CPU time of all threads instead of wall-clock time (see Stopwatch);
// GFLOP_per_call is the useful work of one call.
#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/kernels/blas.h"
#include "core/kernels/cpu_features.h"
#include "core/kernels/flash_tile.h"
#include "core/kernels/float16.h"
#include "core/engine/engine.h"
#include "core/model/layer_config.h"
#include "core/model/model.h"
#include "core/kernels/packed_gemm.h"
#include "core/engine/request.h"
#include "core/sessions/session.h"
#include "core/sessions/session_state.h"
#include "core/thread_pool.h"

namespace attention {
namespace {

struct Shape {
  int64_t batch, length, width, heads;  // B, n, E, H
};

constexpr Shape kShapes[] = {{8, 128, 256, 8}, {4, 512, 512, 8}, {1, 2048, 512, 8}, {32, 32, 256, 8}};
constexpr int64_t kGemmSize = 2048;
constexpr uint32_t kSeed = 42;

Engine& SharedEngine() {
  static Engine engine;
  return engine;
}

// An engine of one thread, the other side of SharedEngine's for the batch/
// cases' threads:1: what the engine's parallelism over its threads gives.
Engine& OneThreadEngine() {
  static Engine engine(EngineOptions{.num_threads = 1});
  return engine;
}

// An engine that computes every attention problem's keys in one task (no
// split-K), the other side of SharedEngine's for the decode/long/ cases.
Engine& UnsplitEngine() {
  static Engine engine(EngineOptions{.split_keys = false});
  return engine;
}

std::vector<float> RandomData(int64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> data(count);
  for (float& x : data) x = dist(rng);
  return data;
}

// A multi_head model of width E with H heads, weights like PyTorch's init scale.
Model MultiHeadModel(int64_t width, int64_t heads, std::mt19937& rng,
                     Precision precision = Precision::kFp32) {
  Model model;
  model.name = "bench_multi_head";
  model.kind = Kind::kMultiHead;
  model.precision = precision;
  model.num_heads = heads;
  model.query_size = model.key_size = model.value_size = model.output_size = width;
  const float bound = 1.0f / std::sqrt(static_cast<float>(width));
  for (RowMatrix* w : {&model.w_q, &model.w_k, &model.w_v, &model.w_o}) {
    std::vector<float> data = RandomData(width * width, rng);
    *w = Eigen::Map<RowMatrix>(data.data(), width, width) * bound;
  }
  for (Vector* b : {&model.b_q, &model.b_k, &model.b_v, &model.b_o}) {
    std::vector<float> data = RandomData(width, rng);
    *b = Eigen::Map<Vector>(data.data(), width) * bound;
  }
  PackProjections(model);  // as LoadModel does
  return model;
}

// SplitMix64: simple enough that bench/compare_torch.py draws the same lengths.
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Valid lengths uniform in [n/4, n], one per example; the same for every
// benchmark of a shape.
std::vector<int32_t> ValidLengths(int64_t batch, int64_t length) {
  uint64_t state = kSeed;
  const uint64_t lowest = static_cast<uint64_t>(length / 4);
  const uint64_t choices = static_cast<uint64_t>(length) - lowest + 1;
  std::vector<int32_t> lens(batch);
  for (int32_t& l : lens) l = static_cast<int32_t>(lowest + SplitMix64(state) % choices);
  return lens;
}

// Wall-clock and process CPU time (all threads) over a benchmark loop.
class Stopwatch {
 public:
  Stopwatch() : wall_start_(std::chrono::steady_clock::now()), cpu_start_(ProcessCpuSeconds()) {}

  // GFLOPS: `flops` per iteration over wall-clock time. GFLOPS_per_core: over
  // the CPU time all threads used, which other load on the machine disturbs
  // far less; unloaded, it is GFLOPS / threads.
  void Report(benchmark::State& state, double flops) const {
    const double total = flops * static_cast<double>(state.iterations()) * 1e-9;
    state.counters["GFLOPS"] = total / WallSeconds();
    state.counters["GFLOPS_per_core"] = total / CpuSeconds();
    state.counters["GFLOP_per_call"] = flops * 1e-9;
  }

  // Report() for calls that each answer `requests` requests, plus the
  // wall-clock and CPU milliseconds per request.
  void ReportPerRequest(benchmark::State& state, double flops, int64_t requests) const {
    Report(state, flops);
    const double answered = static_cast<double>(state.iterations() * requests);
    state.counters["ms_per_request"] = 1e3 * WallSeconds() / answered;
    state.counters["cpu_ms_per_request"] = 1e3 * CpuSeconds() / answered;
  }

 private:
  double WallSeconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start_).count();
  }
  double CpuSeconds() const { return ProcessCpuSeconds() - cpu_start_; }

  static double ProcessCpuSeconds() {
    timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
  }

  std::chrono::steady_clock::time_point wall_start_;
  double cpu_start_;
};

// Runs `model` on queries (examples, n_q, size) against `num_keys` keys
// (0: self-attention, keys = queries; otherwise a tensor of their own that
// also serves as values) with per-example valid lengths `lens` (empty: none)
// and reports GFLOPS for `flops` per call.
void RunEngine(benchmark::State& state, const Model& model, int64_t examples, int64_t length,
               int64_t size, const std::vector<int32_t>& lens, double flops,
               double allowed_fraction, int64_t num_keys = 0) {
  std::mt19937 rng(kSeed);
  const std::vector<float> queries = RandomData(examples * length * size, rng);
  const std::vector<float> keys = RandomData(examples * num_keys * size, rng);
  AttentionRequest request;
  request.queries = {{examples, length, size}, queries};
  if (num_keys > 0) request.keys = TensorView{{examples, num_keys, size}, keys};
  request.valid_lens = lens;
  const Stopwatch stopwatch;
  for (auto _ : state) {
    absl::StatusOr<AttentionResult> result = SharedEngine().Attend(model, request);
    if (!result.ok()) {
      state.SkipWithError(std::string(result.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(result->output.data.data());
  }
  stopwatch.Report(state, flops);
  state.counters["allowed"] = allowed_fraction;
}

// Attention FLOPs of the shape over allowed keys: sum_b n * L_b * 4E.
double AttentionFlops(const Shape& s, const std::vector<int32_t>& lens) {
  double flops = 0.0;
  for (int64_t b = 0; b < s.batch; ++b) {
    const double keys = lens.empty() ? static_cast<double>(s.length) : lens[b];
    flops += static_cast<double>(s.length) * keys * 4.0 * static_cast<double>(s.width);
  }
  return flops;
}

double AllowedFraction(const Shape& s, const std::vector<int32_t>& lens) {
  return AttentionFlops(s, lens) / AttentionFlops(s, {});
}

// A Llama-3-8B-shaped attention layer (hidden 4096, 32 heads over 8 kv
// heads of 128, rope_theta 500000 with llama3 scaling), read from its
// config as a file's would be, with random weights of PyTorch's init scale.
constexpr char kLlama3Config[] = R"({"model_type": "llama", "hidden_size": 4096,
  "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
  "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
  "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})";

Model LayerModel(Precision precision, std::mt19937& rng) {
  const absl::StatusOr<HfLayerConfig> layer = ReadHfLayerConfig({{"config", kLlama3Config}});
  if (!layer.ok()) std::abort();
  Model model;
  model.name = "bench_llama3_8b_layer";
  model.kind = Kind::kMultiHead;
  model.precision = precision;
  model.num_heads = layer->num_heads;
  model.num_kv_heads = layer->num_kv_heads;
  model.head_size = layer->head_size;
  model.terms = layer->terms;
  const int64_t hidden = layer->hidden_size;
  model.query_size = model.key_size = model.value_size = model.output_size = hidden;
  const float bound = 1.0f / std::sqrt(static_cast<float>(hidden));
  const auto random = [&](int64_t rows, int64_t cols) {
    std::vector<float> data = RandomData(rows * cols, rng);
    return RowMatrix(Eigen::Map<RowMatrix>(data.data(), rows, cols) * bound);
  };
  model.w_q = random(QueryWidth(model), hidden);
  model.w_k = random(KvWidth(model), hidden);
  model.w_v = random(KvWidth(model), hidden);
  model.w_o = random(hidden, QueryWidth(model));
  PackProjections(model);
  return model;
}

// FLOPs of a causal prefill of n tokens on `model`: the four projections,
// and QK^T and P V over the allowed half of the scores.
double LayerPrefillFlops(const Model& model, int64_t n) {
  const double tokens = static_cast<double>(n), hidden = static_cast<double>(model.output_size);
  const double projections =
      2 * tokens * hidden * (2.0 * QueryWidth(model) + 2.0 * KvWidth(model));
  const double attention = 4 * (tokens * (tokens + 1) / 2) * QueryWidth(model);
  return projections + attention;
}

void LayerPrefill(benchmark::State& state, int64_t n, Precision precision) {
  std::mt19937 rng(kSeed);
  const Model model = LayerModel(precision, rng);
  const std::vector<float> tokens = RandomData(n * model.output_size, rng);
  AttentionRequest request;
  request.queries = {{1, n, model.output_size}, tokens};
  request.causal = true;
  const Stopwatch stopwatch;
  for (auto _ : state) {
    // No work limit: a whole prompt of this layer is more than a server's
    // default --max-request-work, which sessions meet by prefilling in pieces.
    absl::StatusOr<AttentionResult> result = SharedEngine().Attend(model, request, Limits{0, 0, 0});
    if (!result.ok()) {
      state.SkipWithError(std::string(result.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(result->output.data.data());
  }
  stopwatch.Report(state, LayerPrefillFlops(model, n));
}

// One-token steps of a session of the layer at a context of `context`
// tokens (prefilled before the timing; each step adds one, so the steps are
// counted, kLayerDecodeSteps): the projections of one token and the
// attention over every key held.
constexpr int64_t kLayerDecodeSteps = 64;
void LayerDecode(benchmark::State& state, int64_t context, Precision precision) {
  std::mt19937 rng(kSeed);
  const Model layer = LayerModel(precision, rng);
  auto model = std::make_shared<const Model>(layer);
  const int64_t hidden = model->output_size;
  const std::vector<float> prompt = RandomData(context * hidden, rng);
  const std::vector<float> token = RandomData(hidden, rng);
  KvBlockPool pool(int64_t{1} << 34);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(model, pool, {.memory = SessionMemory::kSelf});
  // The prompt in pieces, as a server prefills it.
  for (int64_t first = 0; first < context && session.ok(); first += 2048) {
    const int64_t rows = std::min<int64_t>(2048, context - first);
    SessionStep step{.queries = {{1, rows, hidden},
                                 std::span<const float>(prompt).subspan(first * hidden, rows * hidden)}};
    absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step, Limits{0, 0, 0});
    AttentionResult result;
    if (validated.ok()) SharedEngine().RunSteps({&*validated, 1}, {&result, 1});
  }
  if (!session.ok() || (*session)->length() != context) {
    state.SkipWithError("the prompt did not fill the session");
    return;
  }
  const Stopwatch stopwatch;
  for (auto _ : state) {
    SessionStep step{.queries = {{1, 1, hidden}, token}};
    absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step, Limits{0, 0, 0});
    AttentionResult result;
    SharedEngine().RunSteps({&*validated, 1}, {&result, 1});
    benchmark::DoNotOptimize(result.output.data.data());
  }
  // A step reads the projection weights once and every key and value held.
  const double weights = static_cast<double>(model->output_size) *
                         (2.0 * QueryWidth(*model) + 2.0 * KvWidth(*model));
  const double bytes =
      (2.0 * context * KvWidth(*model)) * sizeof(float) +
      weights * (precision == Precision::kBf16 ? 2.0 : 4.0);
  stopwatch.Report(state, 4.0 * context * QueryWidth(*model) + 2.0 * weights);
  state.counters["read_GBps"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The read-bandwidth probe: one sum over kProbeFloats floats (1 GiB), cut
// into pieces summed over a pool's threads, and its GB/s.
constexpr int64_t kProbeFloats = int64_t{1} << 28;
constexpr int64_t kProbePieces = 64;

const std::vector<float>& ProbeData() {
  static const std::vector<float> data(kProbeFloats, 1.0f);
  return data;
}

double SumOnce(ThreadPool& pool) {
  const std::vector<float>& data = ProbeData();
  std::vector<double> sums(kProbePieces);
  const int64_t piece = kProbeFloats / kProbePieces;
  pool.ParallelFor(kProbePieces, [&](int64_t i) {
    sums[i] = Eigen::Map<const Eigen::ArrayXf>(data.data() + i * piece, piece).sum();
  });
  double total = 0;
  for (double sum : sums) total += sum;
  return total;
}

// The best of five sums' GB/s on `threads` threads (0: one per hardware
// thread, as the engine's pool), measured once per run.
double ProbeGBps(int threads) {
  static std::map<int, double> measured;
  if (const auto it = measured.find(threads); it != measured.end()) return it->second;
  ThreadPool pool(threads);
  benchmark::DoNotOptimize(SumOnce(pool));  // the pages touched, the threads awake
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto start = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(SumOnce(pool));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, kProbeFloats * sizeof(float) * 1e-9 / seconds);
  }
  return measured[threads] = best;
}

void ReadBandwidth(benchmark::State& state, int threads) {
  ThreadPool pool(threads);
  benchmark::DoNotOptimize(SumOnce(pool));
  for (auto _ : state) benchmark::DoNotOptimize(SumOnce(pool));
  state.counters["GBps"] = benchmark::Counter(kProbeFloats * sizeof(float) * 1e-9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = pool.num_threads();
}

// One-token steps of `session` on `engine` (the first `warm` untimed), with
// bytes_per_step, read_GBps and of_probe as the decode/long/ cases report them.
void TimeLongSteps(benchmark::State& state, Engine& engine, Session& session,
                   const std::function<SessionStep()>& next, double bytes) {
  const double probe = ProbeGBps(0);
  for (int i = 0; i < 2; ++i) {
    const SessionStep step = next();
    absl::StatusOr<ValidatedStep> validated = ValidateStep(session, step, Limits{0, 0, 0});
    AttentionResult result;
    if (validated.ok()) engine.RunSteps({&*validated, 1}, {&result, 1});
  }
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    const SessionStep step = next();
    absl::StatusOr<ValidatedStep> validated = ValidateStep(session, step, Limits{0, 0, 0});
    AttentionResult result;
    if (validated.ok()) engine.RunSteps({&*validated, 1}, {&result, 1});
    if (!validated.ok() || !result.status.ok()) {
      state.SkipWithError(std::string((validated.ok() ? result.status : validated.status()).message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(result.output.data.data());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double read_gbps = bytes * static_cast<double>(state.iterations()) * 1e-9 / seconds;
  state.counters["bytes_per_step"] = bytes;
  state.counters["read_GBps"] = read_gbps;
  state.counters["probe_GBps"] = probe;
  state.counters["of_probe"] = read_gbps / probe;
}

// Steps timed per decode/long/ case; each adds a token, negligible beside N.
constexpr int64_t kLongDecodeSteps = 32;

// What the decode/long/ sessions hold keys and values in: each case once
// per dtype, the float32 ones under their names without a suffix.
constexpr KvDtype kLongDecodeDtypes[] = {KvDtype::kFloat32, KvDtype::kBfloat16,
                                         KvDtype::kFloat16};
std::string KvSuffix(KvDtype dtype) {
  return dtype == KvDtype::kFloat32 ? "" : "/kv:" + std::string(KvDtypeName(dtype));
}

void RowKernel(benchmark::State& state, int64_t rows, KvDtype dtype) {
  constexpr int64_t kKeys = 512, kHead = 128;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> held(kKeys * kHead), queries(rows * kHead);
  for (float& x : held) x = uniform(rng);
  for (float& x : queries) x = uniform(rng) / std::sqrt(static_cast<float>(kHead));
  std::vector<uint16_t> held16(held.size());
  if (dtype != KvDtype::kFloat32) {
    for (size_t i = 0; i < held.size(); ++i) held16[i] = RoundKv(dtype, held[i]);
  }
  std::vector<float> accumulator(rows * kHead), row_max(rows), row_sum(rows);
  std::vector<float> scores(kFlashKeyTile * kFlashQueryTile), rescale(kFlashQueryTile);
  std::vector<float> bounds(kFlashQueryTile, static_cast<float>(kKeys));
  FlashTile tile;
  tile.queries_t = queries.data();
  tile.keys = tile.values = held.data();
  tile.kv_dtype = dtype;
  tile.keys16 = tile.values16 = held16.data();
  tile.key_stride = tile.value_stride = tile.head_size = tile.value_size = kHead;
  tile.rows = rows;
  tile.key_end = tile.min_bound = kKeys;
  tile.bounds = bounds.data();
  tile.accumulator_t = accumulator.data();
  tile.row_max = row_max.data();
  tile.row_sum = row_sum.data();
  tile.scores = scores.data();
  tile.rescale = rescale.data();
  const FlashTilePath path = FlashTilePathFor(ActiveIsa());
  path.row_kernel(tile);  // the rows into L2
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    path.row_kernel(tile);
    benchmark::DoNotOptimize(accumulator.data());
    benchmark::ClobberMemory();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  state.counters["ns_per_key"] = seconds * 1e9 / (static_cast<double>(state.iterations()) * kKeys);
}

void LongDecodeDotProduct(benchmark::State& state, int64_t heads, int64_t kv_heads,
                          bool separate_values, int64_t context, bool split, KvDtype dtype) {
  constexpr int64_t kHeadSize = 128;
  std::mt19937 rng(kSeed);
  const auto model = std::make_shared<const Model>(DotProductModel());
  const std::vector<float> queries = RandomData(heads * kHeadSize, rng);
  const std::vector<float> keys = RandomData(kv_heads * kHeadSize, rng);
  KvBlockPool pool(int64_t{1} << 34);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(model, pool, {.memory = SessionMemory::kSelf, .kv_dtype = dtype});
  const auto next = [&] {
    SessionStep step{.queries = {{1, 1, heads, kHeadSize}, queries},
                     .keys = TensorView{{1, 1, kv_heads, kHeadSize}, keys}};
    if (separate_values) step.values = TensorView{{1, 1, kv_heads, kHeadSize}, keys};
    return step;
  };
  Engine& engine = split ? SharedEngine() : UnsplitEngine();
  absl::Status status = session.status();
  if (status.ok()) {
    const SessionStep first = next();
    absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, first, Limits{0, 0, 0});
    AttentionResult result;
    if (validated.ok()) engine.RunSteps({&*validated, 1}, {&result, 1});
    status = validated.ok() ? result.status : validated.status();
  }
  if (status.ok()) status = internal::AppendUncomputed(**session, context - 1, kSeed);
  if (!status.ok()) {
    state.SkipWithError(std::string(status.message()).c_str());
    return;
  }
  const double bytes = static_cast<double>(context) * kv_heads * kHeadSize *
                       static_cast<double>(KvDtypeBytes(dtype)) * (separate_values ? 2.0 : 1.0);
  TimeLongSteps(state, engine, **session, next, bytes);
}

void LongDecodeLayer(benchmark::State& state, int64_t context, bool split, KvDtype dtype) {
  std::mt19937 rng(kSeed);
  const auto model = std::make_shared<const Model>(LayerModel(Precision::kFp32, rng));
  const int64_t hidden = model->output_size;
  const std::vector<float> token = RandomData(hidden, rng);
  KvBlockPool pool(int64_t{1} << 34);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(model, pool, {.memory = SessionMemory::kSelf, .kv_dtype = dtype});
  const auto next = [&] { return SessionStep{.queries = {{1, 1, hidden}, token}}; };
  Engine& engine = split ? SharedEngine() : UnsplitEngine();
  absl::Status status = session.status();
  if (status.ok()) status = internal::AppendUncomputed(**session, context, kSeed);
  if (!status.ok()) {
    state.SkipWithError(std::string(status.message()).c_str());
    return;
  }
  const double weights = static_cast<double>(hidden) *
                         (2.0 * QueryWidth(*model) + 2.0 * KvWidth(*model));
  const double bytes = 2.0 * context * KvWidth(*model) * static_cast<double>(KvDtypeBytes(dtype)) +
                       weights * sizeof(float);
  TimeLongSteps(state, engine, **session, next, bytes);
}

void MultiHead(benchmark::State& state, Shape s, bool masked, Precision precision) {
  std::mt19937 rng(kSeed);
  const Model model = MultiHeadModel(s.width, s.heads, rng, precision);
  const std::vector<int32_t> lens = masked ? ValidLengths(s.batch, s.length) : std::vector<int32_t>{};
  const double projections = 8.0 * s.batch * s.length * static_cast<double>(s.width) * s.width;
  RunEngine(state, model, s.batch, s.length, s.width, lens, AttentionFlops(s, lens) + projections,
            AllowedFraction(s, lens));
}

void DotProduct(benchmark::State& state, Shape s, bool masked, Precision precision) {
  const std::vector<int32_t> lens = masked ? ValidLengths(s.batch, s.length) : std::vector<int32_t>{};
  // Slice b*H + h has example b's valid length.
  std::vector<int32_t> slice_lens;
  for (int32_t l : lens) slice_lens.insert(slice_lens.end(), s.heads, l);
  Model model = DotProductModel();
  model.precision = precision;
  RunEngine(state, model, s.batch * s.heads, s.length, s.width / s.heads, slice_lens,
            AttentionFlops(s, lens), AllowedFraction(s, lens));
}

// C (M x N) = A (M x K) B (K x N), column blocks of C spread over a pool.
void Gemm(benchmark::State& state, int threads) {
  constexpr int64_t kColumnBlock = 256;
  const Eigen::MatrixXf a = Eigen::MatrixXf::Random(kGemmSize, kGemmSize);
  const Eigen::MatrixXf b = Eigen::MatrixXf::Random(kGemmSize, kGemmSize);
  Eigen::MatrixXf c(kGemmSize, kGemmSize);
  SharedEngine();  // its constructor keeps OpenBLAS to one thread per call
  ThreadPool pool(threads);
  const Stopwatch stopwatch;
  for (auto _ : state) {
    pool.ParallelFor(kGemmSize / kColumnBlock, [&](int64_t block) {
      c.middleCols(block * kColumnBlock, kColumnBlock).noalias() =
          a * b.middleCols(block * kColumnBlock, kColumnBlock);
    });
    benchmark::DoNotOptimize(c.data());
  }
  stopwatch.Report(state, 2.0 * kGemmSize * kGemmSize * static_cast<double>(kGemmSize));
}

// One projection of `rows` rows through E x E weights and bias on the calling
// thread, packed (in `precision`) or through the BLAS (row-major weights
// rebuilt from the packs); inputs fixed, so the weights are as warm as a
// server's that projects every batch with them.
void ProjectionProduct(benchmark::State& state, int64_t rows, int64_t width, bool packed,
                       Precision precision) {
  std::mt19937 rng(kSeed);
  Model model = MultiHeadModel(width, 1, rng, precision);
  if (!packed) UnpackProjections(model);
  const std::vector<float> in = RandomData(rows * width, rng);
  RowMatrix out(rows, width);
  SharedEngine();  // its constructor keeps OpenBLAS to one thread per call
  const PackedKernel kernel = PackedKernelFor(ActiveIsa(), precision);
  const Eigen::Map<const RowMatrix> in_rows(in.data(), rows, width);
  const Stopwatch stopwatch;
  for (auto _ : state) {
    if (packed) {
      kernel({in.data(), width, out.data(), width, &model.packed_q}, 0, rows, 0,
             model.packed_q.panels());
    } else {
      out.rowwise() = model.b_q.transpose();
      out.noalias() += in_rows * model.w_q.transpose();
    }
    benchmark::DoNotOptimize(out.data());
  }
  stopwatch.Report(state, 2.0 * rows * static_cast<double>(width) * width);
}

// One point of a cost-scaling sweep: B examples, n_q queries, n_k keys (and
// values), size d (E for multi_head), every example valid up to `valid` keys.
struct ScalingPoint {
  int64_t batch, num_queries, num_keys, size, valid;
};

// The base points; each sweep changes one coordinate of its kind's base.
constexpr ScalingPoint kDotProductBase = {16, 512, 512, 64, 512};
constexpr ScalingPoint kMultiHeadBase = {4, 512, 512, 512, 512};
constexpr int64_t kScalingHeads = 8;
constexpr int64_t kScalingLengths[] = {128, 256, 512, 1024, 2048};
constexpr int64_t kScalingValid[] = {64, 128, 256, 384, 512};

// Useful FLOPs: attention B n_q L 4d over the valid keys L, plus, for
// multi_head, the projections of queries and output (4 B n_q E^2) and of keys
// and values (4 B n_k E^2).
void Scaling(benchmark::State& state, ScalingPoint p, bool multi_head) {
  const std::vector<int32_t> lens =
      p.valid < p.num_keys ? std::vector<int32_t>(p.batch, static_cast<int32_t>(p.valid))
                           : std::vector<int32_t>{};
  const double batch = static_cast<double>(p.batch);
  const double attention =
      batch * p.num_queries * static_cast<double>(std::min(p.valid, p.num_keys)) * 4.0 * p.size;
  const double allowed = static_cast<double>(std::min(p.valid, p.num_keys)) / p.num_keys;
  if (!multi_head) {
    RunEngine(state, DotProductModel(), p.batch, p.num_queries, p.size, lens, attention, allowed,
              p.num_keys);
    return;
  }
  std::mt19937 rng(kSeed);
  const Model model = MultiHeadModel(p.size, kScalingHeads, rng);
  const double square = static_cast<double>(p.size) * p.size;
  const double projections = 4.0 * batch * (p.num_queries + p.num_keys) * square;
  RunEngine(state, model, p.batch, p.num_queries, p.size, lens, attention + projections, allowed,
            p.num_keys);
}

std::string ScalingName(const char* kind, const char* varied, const ScalingPoint& p) {
  return std::string("scaling/") + kind + "/vary:" + varied + "/B:" + std::to_string(p.batch) +
         "/n_q:" + std::to_string(p.num_queries) + "/n_k:" + std::to_string(p.num_keys) +
         "/d:" + std::to_string(p.size) + "/valid:" + std::to_string(p.valid);
}

// Whole-process memory in KiB from /proc/self/status ("VmRSS", "VmHWM").
int64_t StatusKib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::strtoll(line.c_str() + field.size() + 1, nullptr, 10);
  }
  return -1;
}

// Peak resident memory of one dot-product call without weights. Method: the
// resident set (VmRSS) is read before the inputs exist; after they are filled,
// writing 5 to /proc/self/clear_refs resets the peak (VmHWM) to the current
// resident set, the call runs, and VmHWM is its peak. `ratio` = (peak -
// resident set before the inputs) / (bytes of queries, keys, values and
// output): inputs, output and every scratch buffer of the call together.
// An n x n score matrix would be n / (4 d) = 64 times the inputs + output.
// Run it alone (--benchmark_filter=memory/) so that no memory freed by an
// earlier benchmark is reused unseen.
void MemoryPeak(benchmark::State& state, int64_t batch, int64_t length, int64_t size) {
  const int64_t before_inputs = StatusKib("VmRSS");
  Engine engine;
  std::mt19937 rng(kSeed);
  const int64_t elements = batch * length * size;
  const std::vector<float> queries = RandomData(elements, rng);
  const std::vector<float> keys = RandomData(elements, rng);
  const std::vector<float> values = RandomData(elements, rng);
  AttentionRequest request;
  request.queries = {{batch, length, size}, queries};
  request.keys = TensorView{{batch, length, size}, keys};
  request.values = TensorView{{batch, length, size}, values};
  int64_t before_call = 0, peak = 0;
  for (auto _ : state) {
    std::ofstream("/proc/self/clear_refs") << "5";
    before_call = StatusKib("VmRSS");
    absl::StatusOr<AttentionResult> result = engine.Attend(DotProductModel(), request);
    peak = StatusKib("VmHWM");
    if (!result.ok()) {
      state.SkipWithError(std::string(result.status().message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(result->output.data.data());
  }
  if (before_inputs < 0 || peak < before_call) {
    state.SkipWithError("no VmRSS/VmHWM in /proc/self/status, or clear_refs did not reset VmHWM");
    return;
  }
  const double mib = 1.0 / 1024.0;  // KiB to MiB
  const double io_mib = 4.0 * elements * 4.0 / (1024.0 * 1024.0);
  state.counters["io_MiB"] = io_mib;
  state.counters["peak_MiB"] = (peak - before_inputs) * mib;
  state.counters["call_growth_MiB"] = (peak - before_call) * mib;
  state.counters["ratio"] = (peak - before_inputs) * mib / io_mib;
}

// Distinct requests a batch/ benchmark cycles through, the most it batches.
constexpr int64_t kBatchCopies = 64;

// `requests` copies of one multi_head request of shape s (keys and values
// given) through one Engine::Run per iteration, the way the server's batcher
// runs a batch: results fresh every call, and each copy in memory of its own.
// Every k cycles through the same kBatchCopies copies, so requests:1 reads
// inputs as cold as requests:64 does (192 MiB of large ones) rather than one
// request's 3 MiB left in cache by the last iteration. call_growth_MiB is the
// resident memory the calls add over the inputs (VmHWM after clear_refs, as
// in MemoryPeak); run each alone to read it.
// With `self_attention`, keys and values are left out, as in a single-token
// decoding step. `one_thread`: on OneThreadEngine instead of SharedEngine.
void Batch(benchmark::State& state, Shape s, int64_t requests, bool self_attention,
           bool one_thread) {
  Engine& engine = one_thread ? OneThreadEngine() : SharedEngine();
  std::mt19937 rng(kSeed);
  const Model model = MultiHeadModel(s.width, s.heads, rng);
  const int64_t elements = s.batch * s.length * s.width;
  const std::vector<float> queries = RandomData(elements, rng);
  const std::vector<float> keys = RandomData(elements, rng);
  const std::vector<float> values = RandomData(elements, rng);
  std::vector<std::vector<float>> copies;
  copies.reserve(3 * kBatchCopies);  // the requests view these buffers
  std::vector<AttentionRequest> batch_requests(kBatchCopies);
  std::vector<ValidatedRequest> batch;
  const std::vector<int64_t> shape = {s.batch, s.length, s.width};
  for (AttentionRequest& request : batch_requests) {
    request.queries = {shape, copies.emplace_back(queries)};
    if (!self_attention) {
      request.keys = TensorView{shape, copies.emplace_back(keys)};
      request.values = TensorView{shape, copies.emplace_back(values)};
    }
    absl::StatusOr<AttentionDims> dims = Validate(model, request);
    if (!dims.ok()) {
      state.SkipWithError(std::string(dims.status().message()).c_str());
      return;
    }
    batch.push_back({&request, *dims});
  }
  std::ofstream("/proc/self/clear_refs") << "5";
  const int64_t before_calls = StatusKib("VmRSS");
  const Stopwatch stopwatch;
  int64_t first = 0;
  for (auto _ : state) {
    std::vector<AttentionResult> results(requests);
    engine.Run(model, std::span(batch).subspan(first, requests), results);
    benchmark::DoNotOptimize(results.back().output.data.data());
    first = (first + requests) % kBatchCopies;
  }
  const double projections = 8.0 * s.batch * s.length * static_cast<double>(s.width) * s.width;
  stopwatch.ReportPerRequest(state, static_cast<double>(requests) * (AttentionFlops(s, {}) + projections),
                             requests);
  state.counters["call_growth_MiB"] = static_cast<double>(StatusKib("VmHWM") - before_calls) / 1024.0;
}

// One single-token step of `session` per row of `tokens` (tokens x width),
// each through its own RunSteps.
absl::Status DecodeTokens(Session& session, const std::vector<float>& tokens, int64_t width) {
  const int64_t steps = static_cast<int64_t>(tokens.size()) / width;
  for (int64_t t = 0; t < steps; ++t) {
    SessionStep step;
    step.queries = {{1, 1, width}, std::span(tokens).subspan(t * width, width)};
    absl::StatusOr<ValidatedStep> validated = ValidateStep(session, step);
    if (!validated.ok()) return validated.status();
    AttentionResult result;
    SharedEngine().RunSteps({&*validated, 1}, {&result, 1});
    if (!result.status.ok()) return result.status;
    benchmark::DoNotOptimize(result.output.data.data());
  }
  return absl::OkStatus();
}

// Useful work of decoding `steps` tokens one at a time: a token's four
// projections, and its attention over the t tokens so far.
double DecodeFlops(int64_t width, int64_t steps) {
  const double e = static_cast<double>(width), n = static_cast<double>(steps);
  return 8.0 * e * e * n + 4.0 * e * n * (n + 1) / 2;
}

void DecodeSession(benchmark::State& state, int64_t width, int64_t heads, int64_t steps) {
  std::mt19937 rng(kSeed);
  const auto model = std::make_shared<const Model>(MultiHeadModel(width, heads, rng));
  const std::vector<float> tokens = RandomData(steps * width, rng);
  KvBlockPool pool(int64_t{1} << 30);
  const Stopwatch stopwatch;
  for (auto _ : state) {
    absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(model, pool, {});
    absl::Status status = session.ok() ? DecodeTokens(**session, tokens, width) : session.status();
    if (!status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      return;
    }
  }
  stopwatch.ReportPerRequest(state, DecodeFlops(width, steps), steps);
}

void DecodePrefix(benchmark::State& state, int64_t width, int64_t heads, int64_t steps) {
  std::mt19937 rng(kSeed);
  const Model model = MultiHeadModel(width, heads, rng);
  const std::vector<float> tokens = RandomData(steps * width, rng);
  const Stopwatch stopwatch;
  for (auto _ : state) {
    for (int64_t t = 1; t <= steps; ++t) {
      AttentionRequest request;
      request.queries = {{1, t, width}, std::span(tokens).first(t * width)};
      request.causal = true;
      absl::StatusOr<AttentionResult> result = SharedEngine().Attend(model, request);
      if (!result.ok()) {
        state.SkipWithError(std::string(result.status().message()).c_str());
        return;
      }
      benchmark::DoNotOptimize(result->output.data.data());
    }
  }
  stopwatch.ReportPerRequest(state, DecodeFlops(width, steps), steps);
}

// `sessions` sessions after a `prompt`-token prefill each, then `steps`
// rounds of one RunSteps over a single-token step of every session.
void DecodeConcurrent(benchmark::State& state, int64_t sessions, int64_t width, int64_t heads,
                      int64_t prompt, int64_t steps) {
  std::mt19937 rng(kSeed);
  const auto model = std::make_shared<const Model>(MultiHeadModel(width, heads, rng));
  const std::vector<float> prompts = RandomData(sessions * prompt * width, rng);
  const std::vector<float> tokens = RandomData(sessions * steps * width, rng);
  KvBlockPool pool(int64_t{1} << 32);
  std::vector<std::unique_ptr<Session>> open;
  std::vector<SessionStep> step(sessions);
  auto run_round = [&](int64_t rows, const std::vector<float>& data, int64_t round) {
    std::vector<ValidatedStep> validated;
    for (int64_t s = 0; s < sessions; ++s) {
      const int64_t first = ((round * sessions) + s) * rows * width;
      step[s].queries = {{1, rows, width}, std::span(data).subspan(first, rows * width)};
      validated.push_back(*ValidateStep(*open[s], step[s]));
    }
    std::vector<AttentionResult> results(sessions);
    SharedEngine().RunSteps(validated, results);
    for (const AttentionResult& r : results) benchmark::DoNotOptimize(r.output.data.data());
  };
  const auto open_and_prefill = [&] {
    open.clear();
    for (int64_t s = 0; s < sessions; ++s) open.push_back(*Session::Open(model, pool, {}));
    run_round(prompt, prompts, 0);
  };
  // A first pass of the same sessions, not measured, as a server decoding
  // steadily has had: the engine's buffers for a batch of these steps are
  // sized, and their memory touched, once.
  open_and_prefill();
  for (int64_t round = 0; round < steps; ++round) run_round(1, tokens, round);
  open_and_prefill();
  const Stopwatch stopwatch;
  for (auto _ : state) {
    for (int64_t round = 0; round < steps; ++round) run_round(1, tokens, round);
  }
  const double e = static_cast<double>(width);
  const double flops =
      static_cast<double>(sessions * steps) * (8.0 * e * e + 4.0 * e * (prompt + steps / 2.0));
  stopwatch.ReportPerRequest(state, flops, sessions * steps);
  state.counters["tokens_per_s"] = benchmark::Counter(
      static_cast<double>(sessions * steps), benchmark::Counter::kIsIterationInvariantRate);
}

std::string ShapeName(const char* kind, const Shape& s, bool masked) {
  return std::string(kind) + "/B:" + std::to_string(s.batch) + "/n:" + std::to_string(s.length) +
         "/E:" + std::to_string(s.width) + "/H:" + std::to_string(s.heads) +
         "/masked:" + (masked ? "1" : "0");
}

// With --benchmark_repetitions, the best repetition (min time, max GFLOPS):
// on a shared machine the fastest run is the one least disturbed by others.
double Min(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }
double Max(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

template <class Function, class... Args>
void Register(const std::string& name, Function function, Args... args) {
  benchmark::RegisterBenchmark(name.c_str(), function, args...)
      ->Unit(benchmark::kMillisecond)
      ->ComputeStatistics("min", Min)
      ->ComputeStatistics("max", Max);
}

void RegisterAll() {
  for (const Shape& s : kShapes) {
    for (bool masked : {false, true}) {
      Register(ShapeName("multi_head", s, masked), MultiHead, s, masked, Precision::kFp32);
      Register(ShapeName("multi_head_bf16", s, masked), MultiHead, s, masked, Precision::kBf16);
    }
  }
  for (const Shape& s : kShapes) {
    for (bool masked : {false, true}) {
      Register(ShapeName("dot_product", s, masked), DotProduct, s, masked, Precision::kFp32);
      Register(ShapeName("dot_product_bf16", s, masked), DotProduct, s, masked, Precision::kBf16);
    }
  }
  const std::string gemm = "gemm/M:" + std::to_string(kGemmSize) + "/N:" + std::to_string(kGemmSize) +
                           "/K:" + std::to_string(kGemmSize) + "/threads:";
  for (int threads : {1, 2}) Register(gemm + std::to_string(threads), Gemm, threads);

  for (bool multi_head : {false, true}) {
    const char* kind = multi_head ? "multi_head" : "dot_product";
    const ScalingPoint base = multi_head ? kMultiHeadBase : kDotProductBase;
    const std::vector<int64_t> sizes =
        multi_head ? std::vector<int64_t>{128, 256, 512, 1024} : std::vector<int64_t>{16, 32, 64, 128, 256};
    for (int64_t d : sizes) {
      ScalingPoint p = base;
      p.size = d;
      Register(ScalingName(kind, "d", p), Scaling, p, multi_head);
    }
    for (int64_t n : kScalingLengths) {
      ScalingPoint p = base;
      p.num_queries = n;
      Register(ScalingName(kind, "n_q", p), Scaling, p, multi_head);
    }
    for (int64_t n : kScalingLengths) {
      ScalingPoint p = base;
      p.num_keys = p.valid = n;
      Register(ScalingName(kind, "n_k", p), Scaling, p, multi_head);
    }
    for (int64_t valid : kScalingValid) {
      ScalingPoint p = base;
      p.valid = valid;
      Register(ScalingName(kind, "valid", p), Scaling, p, multi_head);
    }
  }

  for (const Shape& s : {Shape{1, 32, 256, 8}, Shape{8, 128, 256, 8}}) {
    for (int64_t requests : {1, 8, 32, 64}) {
      Register("batch/" + ShapeName("multi_head", s, false) + "/requests:" + std::to_string(requests),
               Batch, s, requests, false, false);
    }
  }
  const Shape token{1, 1, 1024, 16};
  for (int64_t requests : {1, 8, 32, 64}) {
    const std::string name = "batch/self/" + ShapeName("multi_head", token, false) +
                             "/requests:" + std::to_string(requests);
    Register(name, Batch, token, requests, true, false);
    Register(name + "/threads:1", Batch, token, requests, true, true);
  }

  for (int64_t width : {256, 512, 1024}) {
    for (int64_t rows : {1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048}) {
      const std::string name = "projection/M:" + std::to_string(rows) + "/E:" +
                               std::to_string(width) + "/gemm:";
      Register(name + "packed", ProjectionProduct, rows, width, true, Precision::kFp32);
      Register(name + "packed_bf16", ProjectionProduct, rows, width, true, Precision::kBf16);
      Register(name + "blas", ProjectionProduct, rows, width, false, Precision::kFp32);
    }
  }

  // Decoding: each iteration is a whole decode, so one each;
  // with --benchmark_repetitions, the min and max as for the others.
  const auto decode = [](const std::string& name, auto function, auto... args) {
    benchmark::RegisterBenchmark(name.c_str(), function, args...)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(1)
        ->UseRealTime()
        ->ComputeStatistics("min", Min)
        ->ComputeStatistics("max", Max);
  };
  decode("decode/session/E:512/H:8/steps:512", DecodeSession, 512, 8, 512);
  decode("decode/prefix/E:512/H:8/steps:512", DecodePrefix, 512, 8, 512);
  for (int64_t prompt : {16, 128}) {
    for (int64_t sessions : {1, 64}) {
      decode("decode/sessions:" + std::to_string(sessions) + "/E:1024/H:16/prompt:" +
                 std::to_string(prompt) + "/steps:64",
             DecodeConcurrent, sessions, 1024, 16, prompt, 64);
    }
  }

  for (int64_t n : {512, 2048}) {
    Register("layer/llama3_8b/prefill/n:" + std::to_string(n), LayerPrefill, n, Precision::kFp32);
    Register("layer/llama3_8b_bf16/prefill/n:" + std::to_string(n), LayerPrefill, n,
             Precision::kBf16);
  }
  for (int64_t context : {4096, 16384}) {
    benchmark::RegisterBenchmark(
        ("layer/llama3_8b/decode/context:" + std::to_string(context)).c_str(), LayerDecode,
        context, Precision::kFp32)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(kLayerDecodeSteps)
        ->ComputeStatistics("min", Min)
        ->ComputeStatistics("max", Max);
  }

  for (int threads : {1, 0}) {
    // Wall-clock time: the rate of a sum over several threads.
    benchmark::RegisterBenchmark(("bandwidth/read/threads:" + std::to_string(threads)).c_str(),
                                 ReadBandwidth, threads)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
  for (int64_t rows : {1, 4}) {
    for (KvDtype dtype : kLongDecodeDtypes) {
      benchmark::RegisterBenchmark(("decode/row_kernel/rows:" + std::to_string(rows) +
                                    "/d:128/keys:512" + KvSuffix(dtype))
                                       .c_str(),
                                   RowKernel, rows, dtype)
          ->Unit(benchmark::kMicrosecond);
    }
  }
  struct LongShape {
    int64_t heads, kv_heads;
    bool values;
  };
  for (const LongShape& shape : {LongShape{32, 8, true}, LongShape{8, 8, false}}) {
    for (int64_t context : {4096, 16384, 65536}) {
      for (KvDtype dtype : kLongDecodeDtypes) {
        for (bool split : {true, false}) {
          const std::string name =
              "decode/long/dot_product/B:1/H:" + std::to_string(shape.heads) +
              "/H_kv:" + std::to_string(shape.kv_heads) + "/d:128/values:" +
              (shape.values ? "1" : "0") + "/context:" + std::to_string(context) +
              (split ? "" : "/split:0") + KvSuffix(dtype);
          benchmark::RegisterBenchmark(name.c_str(), LongDecodeDotProduct, shape.heads,
                                       shape.kv_heads, shape.values, context, split, dtype)
              ->Unit(benchmark::kMillisecond)
              ->Iterations(kLongDecodeSteps)
              ->ComputeStatistics("min", Min)
              ->ComputeStatistics("max", Max);
        }
      }
    }
  }
  for (int64_t context : {4096, 16384, 65536}) {
    for (KvDtype dtype : kLongDecodeDtypes) {
      for (bool split : {true, false}) {
        const std::string name = "decode/long/llama3_8b/context:" + std::to_string(context) +
                                 (split ? "" : "/split:0") + KvSuffix(dtype);
        benchmark::RegisterBenchmark(name.c_str(), LongDecodeLayer, context, split, dtype)
            ->Unit(benchmark::kMillisecond)
            ->Iterations(kLongDecodeSteps)
            ->ComputeStatistics("min", Min)
            ->ComputeStatistics("max", Max);
      }
    }
  }

  constexpr int64_t kMemoryBatch = 8, kMemoryLength = 16384, kMemorySize = 64;
  benchmark::RegisterBenchmark(("memory/dot_product/B:" + std::to_string(kMemoryBatch) +
                                "/n:" + std::to_string(kMemoryLength) + "/d:" + std::to_string(kMemorySize))
                                   .c_str(),
                               MemoryPeak, kMemoryBatch, kMemoryLength, kMemorySize)
      ->Unit(benchmark::kMillisecond)
      ->Iterations(1)
      ->Repetitions(1);
}

}  // namespace
}  // namespace attention

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  // ATTENTION_ISA forces a lower kernel path; the context names what ran.
  if (const absl::Status status = attention::SelectIsaFromEnvironment(); !status.ok()) {
    std::fprintf(stderr, "attention-bench: %s\n", std::string(status.message()).c_str());
    return 2;
  }
  benchmark::AddCustomContext("isa", std::string(attention::IsaName(attention::ActiveIsa())));
  benchmark::AddCustomContext("cpu_isa", std::string(attention::IsaName(attention::DetectedIsa())));
  benchmark::AddCustomContext("blas_core", attention::BlasCoreName());
  attention::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
