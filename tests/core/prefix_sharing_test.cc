// prefix_sharing_test.cc: blocks shared between decoding sessions
// (KvBlockPool's prefix sharing, core/sessions/session.h).
//
// Sessions that open with the same prompt share its full blocks (the pool's
// bytes and its prefix stats say so) and answer bit for bit as with sharing
// off; a session ending leaves its shared blocks to the others, and the
// last one caches them for a later prompt; the outputs of a prompt's pieces
// are cached and copied by a later session's same pieces, and give way
// first; cached blocks give way, least recently freed first, before the pool
// asks its reclaim; a windowed
// session drops the blocks it shares; other parameters, other rows (a
// grouped step's own keys and values) and cross memory share nothing.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/sessions/session.h"
#include "core/sessions/session_state.h"
#include "tests/core/random_weights.h"

namespace attention {
namespace {

using testing::MultiHeadModel;
using testing::RandomData;

// A multi_head model of E = d (2 heads), its queries d wide.
std::shared_ptr<Model> MultiHead(std::mt19937& rng, int64_t d) {
  return MultiHeadModel(rng, 2, d / 2, d, d, d, /*packed=*/true);
}

SessionOpen SelfOpen(int64_t batch = 1) {
  SessionOpen open;
  open.batch = batch;
  return open;
}

// One step of (B, n, ...) rows: `rows` are the queries, of `shape`.
AttentionResult Step(Engine& engine, Session& session, const std::vector<float>& rows,
                     std::vector<int64_t> shape, int64_t piece = 0) {
  SessionStep step;
  step.queries = {std::move(shape), rows};
  absl::StatusOr<ValidatedStep> validated = ValidateStep(session, step);
  if (!validated.ok()) return {{}, {}, validated.status()};
  AttentionResult result;
  const int64_t n = validated->dims.num_queries;
  do {
    validated->chunk_rows = piece;
    engine.RunSteps({&*validated, 1}, {&result, 1});
    if (!result.status.ok()) break;
    validated->done_rows += piece > 0 ? std::min(piece, n - validated->done_rows) : n;
  } while (validated->done_rows < n);
  return result;
}

// Bit for bit.
void ExpectSame(const AttentionResult& got, const AttentionResult& want, const std::string& what) {
  ASSERT_TRUE(got.status.ok()) << what << ": " << got.status;
  ASSERT_TRUE(want.status.ok()) << what << ": " << want.status;
  ASSERT_EQ(got.output.shape, want.output.shape) << what;
  EXPECT_EQ(std::memcmp(got.output.data.data(), want.output.data.data(),
                        got.output.data.size() * sizeof(float)),
            0)
      << what;
}

int64_t BlockBytes(int64_t width) { return kKvBlockRows * width * 4; }

// A prompt, then one-token steps, through a session on `pool`; the outputs.
std::vector<AttentionResult> Decode(Engine& engine, KvBlockPool& pool,
                                    const std::shared_ptr<Model>& model,
                                    const std::vector<float>& prompt, int64_t n, int64_t d,
                                    const std::vector<std::vector<float>>& tokens,
                                    std::unique_ptr<Session>* kept = nullptr,
                                    int64_t piece = 0) {
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen());
  std::vector<AttentionResult> results;
  results.push_back(Step(engine, *session, prompt, {1, n, d}, piece));
  for (const std::vector<float>& token : tokens) {
    results.push_back(Step(engine, *session, token, {1, 1, d}));
  }
  if (kept != nullptr) *kept = std::move(session);
  return results;
}

TEST(PrefixSharing, SessionsWithOnePromptShareItsBlocksAndAnswerAsWithout) {
  std::mt19937 rng(3);
  const int64_t d = 16, n = 3 * kKvBlockRows + 5;
  const std::shared_ptr<Model> model = MultiHead(rng, d);
  Engine engine;
  KvBlockPool shared(int64_t{1} << 26), apart(int64_t{1} << 26, nullptr, false);
  const std::vector<float> prompt = RandomData(rng, n * d);
  // The second prompt begins as the first and goes on otherwise.
  std::vector<float> longer = prompt;
  const std::vector<float> tail = RandomData(rng, 40 * d);
  longer.resize((n - 5) * d);
  longer.insert(longer.end(), tail.begin(), tail.end());
  const int64_t n_longer = n - 5 + 40;
  std::vector<std::vector<float>> tokens;
  for (int i = 0; i < 3; ++i) tokens.push_back(RandomData(rng, d));

  std::unique_ptr<Session> first, second;
  const auto first_on = Decode(engine, shared, model, prompt, n, d, tokens, &first);
  EXPECT_EQ(shared.prefix_stats().hit_tokens, 0);
  EXPECT_EQ(shared.prefix_stats().query_tokens, n);
  const int64_t one = shared.used_bytes();
  EXPECT_EQ(one, first->held_bytes());
  // Chunked prefill shares as a whole step does.
  const auto second_on = Decode(engine, shared, model, longer, n_longer, d, tokens, &second, 50);
  const int64_t full_blocks = 3;
  EXPECT_EQ(shared.prefix_stats().hit_tokens, full_blocks * kKvBlockRows);
  EXPECT_EQ(shared.prefix_stats().query_tokens, n + n_longer);
  EXPECT_EQ(shared.prefix_stats().shared_bytes, 2 * full_blocks * BlockBytes(d));
  EXPECT_EQ(shared.used_bytes(), first->held_bytes() + second->held_bytes() -
                                     2 * full_blocks * BlockBytes(d));

  const auto first_off = Decode(engine, apart, model, prompt, n, d, tokens);
  const auto second_off = Decode(engine, apart, model, longer, n_longer, d, tokens);
  EXPECT_EQ(apart.prefix_stats().hit_tokens, 0);
  EXPECT_EQ(apart.prefix_stats().shared_bytes, 0);
  for (size_t s = 0; s < first_on.size(); ++s) {
    ExpectSame(first_on[s], first_off[s], "first session, step " + std::to_string(s));
    ExpectSame(second_on[s], second_off[s], "second session, step " + std::to_string(s));
  }

  // The first ending leaves the shared blocks to the second, which still
  // answers as with sharing off; the last one caches them.
  first.reset();
  EXPECT_EQ(shared.used_bytes(), second->held_bytes());
  EXPECT_EQ(shared.prefix_stats().shared_bytes, 0);
  const std::vector<float> token = RandomData(rng, d);
  std::unique_ptr<Session> second_apart;
  Decode(engine, apart, model, longer, n_longer, d, tokens, &second_apart);
  ExpectSame(Step(engine, *second, token, {1, 1, d}),
             Step(engine, *second_apart, token, {1, 1, d}), "after the first ended");
  const int64_t second_blocks = second->held_bytes() / BlockBytes(d);
  second.reset();
  EXPECT_EQ(shared.used_bytes(), 0);
  // The full blocks are cached, keys and values, and the partial ones are
  // not; the outputs of the second's five pieces (of at most 50 rows) were
  // cached as they were computed.
  EXPECT_EQ(shared.prefix_stats().cached_bytes, (2 * full_blocks + 5) * BlockBytes(d));
  EXPECT_LT(2 * full_blocks, second_blocks);

  // A later prompt finds them in the cache.
  const auto third_on = Decode(engine, shared, model, prompt, n, d, tokens);
  EXPECT_EQ(shared.prefix_stats().hit_tokens, 2 * full_blocks * kKvBlockRows);
  for (size_t s = 0; s < third_on.size(); ++s) {
    ExpectSame(third_on[s], first_off[s], "from the cache, step " + std::to_string(s));
  }
}

// The outputs of a prompt's pieces are cached: a later session's pieces of
// the same rows and bounds, in its shared blocks, copy them, answering the
// same bits; cached outputs give way before cached keys and values.
TEST(PrefixSharing, OutputsOfPiecesAreCachedAndGiveWayFirst) {
  std::mt19937 rng(9);
  const int64_t d = 16, n = 2 * kKvBlockRows + 5, piece = kKvBlockRows / 2;
  const int64_t block = BlockBytes(d);  // the output is E = d wide, as keys are
  const std::shared_ptr<Model> model = MultiHead(rng, d);
  Engine engine;
  KvBlockPool shared(12 * block), apart(int64_t{1} << 26, nullptr, false);
  const std::vector<float> prompt = RandomData(rng, n * d);
  std::unique_ptr<Session> reference = *Session::Open(model, apart, SelfOpen());
  const AttentionResult want = Step(engine, *reference, prompt, {1, n, d}, piece);
  std::unique_ptr<Session> a = *Session::Open(model, shared, SelfOpen());
  ExpectSame(Step(engine, *a, prompt, {1, n, d}, piece), want, "the first prompt");
  // a holds three blocks of keys and three of values; its five pieces'
  // outputs are cached.
  EXPECT_EQ(shared.used_bytes(), 6 * block);
  EXPECT_EQ(shared.prefix_stats().cached_bytes, 5 * block);
  // b's two partial blocks take the room of the first piece's outputs, and
  // b computes that piece and its last; it copies the three between.
  std::unique_ptr<Session> b = *Session::Open(model, shared, SelfOpen());
  ExpectSame(Step(engine, *b, prompt, {1, n, d}, piece), want, "outputs from the cache");
  EXPECT_EQ(shared.used_bytes(), 8 * block);
  EXPECT_EQ(shared.prefix_stats().cached_bytes, 4 * block);
  // Asking for weights computes every row.
  {
    SessionStep step;
    step.queries = {{1, n, d}, prompt};
    step.return_attention_weights = true;
    std::unique_ptr<Session> weighed = *Session::Open(model, apart, SelfOpen());
    std::unique_ptr<Session> c = *Session::Open(model, shared, SelfOpen());
    AttentionResult got, expected;
    ValidatedStep with_cache = *ValidateStep(*c, step), without = *ValidateStep(*weighed, step);
    engine.RunSteps({&with_cache, 1}, {&got, 1});
    engine.RunSteps({&without, 1}, {&expected, 1});
    ExpectSame(got, expected, "weights asked");
  }

  // c's partial blocks took the room of two more pieces' outputs. a and b
  // end: four blocks of keys and values are cached beside two of outputs.
  // Another prompt of eight blocks takes the room of two: the outputs.
  a.reset();
  b.reset();
  EXPECT_EQ(shared.prefix_stats().cached_bytes, 6 * block);
  std::unique_ptr<Session> other = *Session::Open(model, shared, SelfOpen());
  const int64_t other_n = 3 * kKvBlockRows + 1;
  ASSERT_TRUE(Step(engine, *other, RandomData(rng, other_n * d), {1, other_n, d}).status.ok());
  EXPECT_EQ(shared.prefix_stats().cached_bytes, 4 * block);
  other.reset();
  const int64_t hits = shared.prefix_stats().hit_tokens;
  std::unique_ptr<Session> again = *Session::Open(model, shared, SelfOpen());
  ExpectSame(Step(engine, *again, prompt, {1, n, d}, piece), want, "after the eviction");
  EXPECT_EQ(shared.prefix_stats().hit_tokens, hits + 2 * kKvBlockRows);
}

TEST(PrefixSharing, BatchedSessionsShareExampleByExample) {
  std::mt19937 rng(4);
  const int64_t d = 8, n = 2 * kKvBlockRows;
  const std::shared_ptr<Model> model = MultiHead(rng, d);
  Engine engine;
  KvBlockPool pool(int64_t{1} << 26);
  const std::vector<float> prompt = RandomData(rng, 2 * n * d);
  std::unique_ptr<Session> a = *Session::Open(model, pool, SelfOpen(2));
  std::unique_ptr<Session> b = *Session::Open(model, pool, SelfOpen(2));
  const AttentionResult from_a = Step(engine, *a, prompt, {2, n, d});
  const AttentionResult from_b = Step(engine, *b, prompt, {2, n, d});
  ExpectSame(from_b, from_a, "the same batch");
  EXPECT_EQ(pool.prefix_stats().hit_tokens, 2 * n);
  EXPECT_EQ(pool.used_bytes(), a->held_bytes());

  // The second example's rows alone, as a batch of one, are another example.
  std::unique_ptr<Session> c = *Session::Open(model, pool, SelfOpen());
  ASSERT_TRUE(Step(engine, *c, {prompt.begin() + n * d, prompt.end()}, {1, n, d}).status.ok());
  EXPECT_EQ(pool.prefix_stats().hit_tokens, 2 * n);
}

TEST(PrefixSharing, OtherParametersOrRowsShareNothing) {
  std::mt19937 rng(5);
  const int64_t d = 8, n = kKvBlockRows;
  const auto dot = std::make_shared<Model>(DotProductModel());
  Engine engine;
  KvBlockPool pool(int64_t{1} << 26);
  const std::vector<float> prompt = RandomData(rng, n * d);
  std::vector<std::unique_ptr<Session>> held;
  auto open = [&](SessionOpen o) {
    held.push_back(*Session::Open(dot, pool, o));
    return held.back().get();
  };
  ASSERT_TRUE(Step(engine, *open(SelfOpen()), prompt, {1, n, d}).status.ok());
  SessionOpen scaled = SelfOpen();
  scaled.scale = 0.5f;
  SessionOpen capped = SelfOpen();
  capped.softcap = 30.0f;
  for (const SessionOpen& other : {scaled, capped}) {
    ASSERT_TRUE(Step(engine, *open(other), prompt, {1, n, d}).status.ok());
  }
  // The same rows as grouped heads: other widths.
  ASSERT_TRUE(Step(engine, *open(SelfOpen()), prompt, {1, n, 2, d / 2}).status.ok());
  // Another model object with the same weights is another model.
  const auto again = std::make_shared<Model>(DotProductModel());
  held.push_back(*Session::Open(again, pool, SelfOpen()));
  ASSERT_TRUE(Step(engine, *held.back(), prompt, {1, n, d}).status.ok());
  EXPECT_EQ(pool.prefix_stats().hit_tokens, 0);
  EXPECT_EQ(pool.prefix_stats().shared_bytes, 0);
  ASSERT_TRUE(Step(engine, *open(SelfOpen()), prompt, {1, n, d}).status.ok());
  EXPECT_EQ(pool.prefix_stats().hit_tokens, n);

  // Cross memory keys nothing and shares nothing.
  SessionOpen cross;
  cross.memory = SessionMemory::kCross;
  const TensorView keys{{1, n, d}, prompt};
  cross.keys = keys;
  held.clear();
  const int64_t cached = pool.prefix_stats().cached_bytes;
  held.push_back(*Session::Open(dot, pool, cross));
  held.push_back(*Session::Open(dot, pool, cross));
  EXPECT_EQ(pool.prefix_stats().shared_bytes, 0);
  held.clear();
  EXPECT_EQ(pool.prefix_stats().cached_bytes, cached);
}

// A grouped dot_product step's own keys and values: what the blocks hold.
TEST(PrefixSharing, GroupedStepsShareOnlyTheSameKeysAndValues) {
  std::mt19937 rng(6);
  const int64_t n = kKvBlockRows + 3, heads = 4, kv_heads = 2, hd = 4;
  const auto dot = std::make_shared<Model>(DotProductModel());
  Engine engine;
  KvBlockPool shared(int64_t{1} << 26), apart(int64_t{1} << 26, nullptr, false);
  const std::vector<float> queries = RandomData(rng, n * heads * hd);
  const std::vector<float> keys = RandomData(rng, n * kv_heads * hd);
  const std::vector<float> values = RandomData(rng, n * kv_heads * hd);
  const std::vector<float> other_keys = RandomData(rng, n * kv_heads * hd);
  auto run = [&](KvBlockPool& pool, const std::vector<float>& k, std::unique_ptr<Session>& s) {
    s = *Session::Open(dot, pool, SelfOpen());
    SessionStep step;
    step.queries = {{1, n, heads, hd}, queries};
    step.keys = TensorView{{1, n, kv_heads, hd}, k};
    step.values = TensorView{{1, n, kv_heads, hd}, values};
    absl::StatusOr<ValidatedStep> validated = ValidateStep(*s, step);
    EXPECT_TRUE(validated.ok()) << validated.status();
    AttentionResult result;
    engine.RunSteps({&*validated, 1}, {&result, 1});
    return result;
  };
  std::unique_ptr<Session> a, b, c, reference;
  run(shared, keys, a);
  run(shared, other_keys, b);
  EXPECT_EQ(shared.prefix_stats().hit_tokens, 0);
  const AttentionResult same = run(shared, keys, c);
  EXPECT_EQ(shared.prefix_stats().hit_tokens, kKvBlockRows);
  // Keys and values apart: two blocks, each held by a and c.
  EXPECT_EQ(shared.prefix_stats().shared_bytes, 2 * BlockBytes(kv_heads * hd));
  ExpectSame(same, run(apart, keys, reference), "grouped, shared");
}

// A windowed session drops blocks behind its window; a block it shares
// stays with the other holder.
TEST(PrefixSharing, WindowedSessionsDropTheBlocksTheyShare) {
  std::mt19937 rng(7);
  const int64_t d = 8, n = 4 * kKvBlockRows;
  const auto dot = std::make_shared<Model>(DotProductModel());
  Engine engine;
  KvBlockPool shared(int64_t{1} << 26), apart(int64_t{1} << 26, nullptr, false);
  SessionOpen windowed = SelfOpen();
  windowed.sliding_window = kKvBlockRows;
  const std::vector<float> prompt = RandomData(rng, n * d);
  std::unique_ptr<Session> a = *Session::Open(dot, shared, windowed);
  ASSERT_TRUE(Step(engine, *a, prompt, {1, n, d}).status.ok());
  // a dropped the three blocks behind its window, which stay cached.
  EXPECT_EQ(a->held_bytes(), BlockBytes(d));
  EXPECT_EQ(shared.prefix_stats().cached_bytes, 3 * BlockBytes(d));
  std::unique_ptr<Session> b = *Session::Open(dot, shared, windowed);
  std::unique_ptr<Session> reference = *Session::Open(dot, apart, windowed);
  ExpectSame(Step(engine, *b, prompt, {1, n, d}), Step(engine, *reference, prompt, {1, n, d}),
             "windowed prompt");
  EXPECT_EQ(shared.prefix_stats().hit_tokens, n);
  EXPECT_EQ(shared.prefix_stats().shared_bytes, BlockBytes(d));
  EXPECT_EQ(shared.prefix_stats().cached_bytes, 3 * BlockBytes(d));
  for (int i = 0; i < 2 * kKvBlockRows; ++i) {
    const std::vector<float> token = RandomData(rng, d);
    ExpectSame(Step(engine, *b, token, {1, 1, d}), Step(engine, *reference, token, {1, 1, d}),
               "windowed step " + std::to_string(i));
  }
  // b moved on and dropped what it shared with a; a still holds its blocks.
  EXPECT_EQ(shared.prefix_stats().shared_bytes, 0);
  EXPECT_EQ(a->held_bytes(), BlockBytes(d));
  EXPECT_EQ(shared.used_bytes(), a->held_bytes() + b->held_bytes());
}

// Cached blocks give way, least recently freed first, before the pool asks
// its reclaim to end a session.
TEST(PrefixSharing, CachedBlocksGiveWayBeforeAnySessionIs) {
  std::mt19937 rng(8);
  const int64_t d = 8, block = BlockBytes(d);
  const auto dot = std::make_shared<Model>(DotProductModel());
  Engine engine;
  int reclaims = 0;
  KvBlockPool pool(4 * block, [&](const Session*, int64_t) {
    ++reclaims;
    return false;
  });
  const std::vector<float> older = RandomData(rng, 2 * kKvBlockRows * d);
  const std::vector<float> newer = RandomData(rng, 2 * kKvBlockRows * d);
  for (const std::vector<float>* prompt : {&older, &newer}) {
    std::unique_ptr<Session> s = *Session::Open(dot, pool, SelfOpen());
    ASSERT_TRUE(Step(engine, *s, *prompt, {1, 2 * kKvBlockRows, d}).status.ok());
  }
  EXPECT_EQ(pool.prefix_stats().cached_bytes, 4 * block);
  EXPECT_EQ(pool.used_bytes(), 0);
  // Two blocks of other rows take the older prompt's room.
  std::unique_ptr<Session> other = *Session::Open(dot, pool, SelfOpen());
  ASSERT_TRUE(
      Step(engine, *other, RandomData(rng, 2 * kKvBlockRows * d), {1, 2 * kKvBlockRows, d})
          .status.ok());
  EXPECT_EQ(reclaims, 0);
  EXPECT_EQ(pool.prefix_stats().cached_bytes, 2 * block);
  std::unique_ptr<Session> again = *Session::Open(dot, pool, SelfOpen());
  ASSERT_TRUE(Step(engine, *again, newer, {1, 2 * kKvBlockRows, d}).status.ok());
  EXPECT_EQ(pool.prefix_stats().hit_tokens, 2 * kKvBlockRows);
  std::unique_ptr<Session> gone = *Session::Open(dot, pool, SelfOpen());
  // The pool is full of held blocks now: the reclaim is asked.
  EXPECT_TRUE(PoolWasFull(Step(engine, *gone, older, {1, 2 * kKvBlockRows, d}).status));
  EXPECT_EQ(reclaims, 1);
  EXPECT_EQ(pool.prefix_stats().hit_tokens, 2 * kKvBlockRows);
}

}  // namespace
}  // namespace attention
