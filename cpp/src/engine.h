// The generation loop (mirrors specedge/runtime/generator.py, rounds.py, cache.py, text.py,
// drafters/model.py, drafters/ngram.py): chunked prefill, propose -> verify -> commit -> roll back,
// stop rules, streaming text, stats. How k is chosen (the speculation guard) is policy.h, the same
// rules as specedge/runtime/policy.py.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "manifest.h"
#include "backend.h"
#include "head_drafter.h"
#include "policy.h"
#include "sampling.h"
#include "tokenizer.h"
#include "tree.h"

namespace specedge {

// Which tokens occupy a backend's cache slots (generator.py's CacheTracker).
class CacheTracker {
 public:
  CacheTracker(Backend* b, int chunk) : backend_(b), chunk_(chunk) {}
  int position() const { return int(tokens_.size()); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  void reset() { tokens_.clear(); exact_ = 0; }
  void rollback(int position);
  int reuse(const std::vector<int32_t>& prompt, bool keep_last = true);
  const float* feed(const int32_t* ids, int n);            // one call: logits [n, V]
  const float* feed_chunked(const int32_t* ids, int n);    // last row's logits [V]
  // Record that slots [position, position + n) now hold `ids`, written by someone else (copied K/V).
  void adopt(const int32_t* ids, int n) { tokens_.insert(tokens_.end(), ids, ids + n); }
  Backend* backend() const { return backend_; }
  int chunk() const { return chunk_; }
  // Run single-token calls as two tokens (runtime/invariant.py, docs/design.md "Batch-invariant
  // target steps"), so a step rounds like a verification row.
  void set_invariant_steps(bool on) { invariant_ = on; }
  bool invariant_steps() const { return invariant_; }

 private:
  const float* call(const int32_t* ids, int n, int position);
  Backend* backend_;
  int chunk_;
  bool invariant_ = false;
  std::vector<int32_t> tokens_;
  int exact_ = 0;
};

// The default of runtime/invariant.py's wants_invariant_steps: on for int4/int8/fp16/bf16 targets.
bool wants_invariant_steps(const std::string& precision);
// The target's graph is marked batch_invariant and this machine's kernels confirm it (two calls).
bool batch_invariant_here(const GraphSpec& g, Backend& target);

// Earlier occurrences of an n-gram remembered for tree proposals (ngram.py MATCHES_KEPT).
constexpr size_t kMatchesKept = 8;

// Prompt lookup: propose what followed the latest earlier occurrence of the history's suffix.
class NgramDrafter {
 public:
  explicit NgramDrafter(std::vector<int> sizes = {3, 2, 1});
  void reset();
  std::vector<int32_t> propose(const std::vector<int32_t>& history, int k);
  // ngram.py NgramDrafter.propose_tree: the chain of k first, then the likeliest branches by the
  // history's own counts, best first, at most `nodes` nodes and `depth` deep, ids in [0, vocab)
  // (tree_round.cpp); nullopt when it makes no draft.
  std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes, int depth, int vocab);

 private:
  // What followed the latest kMatchesKept earlier occurrences of the context's longest matching
  // suffix, most frequent first, then most recent first; `total` the occurrences counted.
  std::vector<std::pair<int32_t, int>> followers(const std::vector<int32_t>& tail, size_t length, int& total) const;
  void sync(const std::vector<int32_t>& history);
  void extend_index(size_t end);
  std::vector<int> sizes_;
  std::vector<int32_t> tokens_;
  std::vector<std::unordered_map<std::string, size_t>> index_;
  std::vector<std::unordered_map<std::string, std::vector<size_t>>> starts_;  // latest kMatchesKept starts
  size_t covered_ = 0;
};

// The draft model: one T=1 call per proposed token, cache synced to the committed sequence.
class ModelDrafter {
 public:
  ModelDrafter(Backend* b, int chunk, int vocab) : cache_(b, chunk), vocab_(vocab) {}
  void reset() { cache_.reset(); base_ = 0; }
  // The target's cache, for a self-draft (same architecture and cache geometry): committed tokens
  // the target has already run are copied from its K/V instead of fed (drafts are proposals only).
  void set_kv_donor(const CacheTracker* target) { donor_ = target; }
  int64_t copied() const { return copied_; }
  int64_t calls() const { return calls_; }  // backend calls made by propose (stats: draft_calls)
  void start(const std::vector<int32_t>& prompt) { base_ = cache_.reuse(prompt, false); }
  // Tokens, and their q rows [k, vocab] when sampling.
  std::vector<int32_t> propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng,
                               std::vector<double>* q);
  // The chain of k drafts propose would make (greedy, or sampled with its q rows) plus ranked
  // runner-up siblings, at most `nodes` nodes (model.py propose_tree; tree_round.cpp); nullopt
  // when k < 1 or nodes < 2.
  std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes, const SamplingParams& p,
                                   Rng& rng);

 private:
  int sync(const std::vector<int32_t>& history);  // roll back to the common prefix; tokens kept
  CacheTracker cache_;
  int vocab_;
  int base_ = 0;
  const CacheTracker* donor_ = nullptr;
  int64_t copied_ = 0, calls_ = 0;
};

struct GenConfig {
  int max_new_tokens = 128;
  SamplingParams sampling;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  int spec_tokens = 0;  // 0 = the model's
  bool speculative = true;
  bool guard = true;
  bool adaptive_k = false;  // also move k by the last round (Python's adaptive_k / --adaptive-k)
  bool tree = false;        // verify a token tree per round (Python's tree / --tree; a tree bundle)
};

struct Stats {
  int64_t tokens = 0, prompt_tokens = 0, target_calls = 0, drafted = 0, accepted = 0, fallback_tokens = 0;
  double tokens_per_s = 0, e2e_tokens_per_s = 0, ttft_s = 0, decode_s = 0, total_s = 0;
  double time_draft_s = 0, time_verify_s = 0, time_other_s = 0, acceptance_rate = 0, mean_accepted = 0;
  bool speculative = false;
  std::string drafter;
  int k = 0, k_final = 0, fallbacks = 0, k_shrinks = 0;
  std::vector<int64_t> accepted_histogram;
  int64_t prefix_reused_tokens = 0;
  std::map<int, int64_t> k_histogram;
  double alpha_estimate = 0;
  int64_t draft_calls = 0, draft_kv_copied = 0;
  int64_t tree_rounds = 0;  // tree rounds the guard judged (Python's stats key, present only when > 0)
  bool trees_off = false;   // the guard turned trees off for the rest of the request
};

struct GenResult {
  std::vector<int32_t> token_ids;
  std::string text;
  std::string finish_reason;
  Stats stats;
};

// Called per committed token with the text that became printable; return false to cancel.
// A last call with token -1 carries text released at the end (held back or flushed), if any.
using TokenCallback = std::function<bool(int32_t token, const std::string& text)>;

struct EngineOptions {
  BackendOptions backend;
  int spec_tokens = 0;        // 0 = bundle's
  std::string draft;          // "", "model", "ngram", "head" (the bundle's trained draft head; on ort-cpu beside any target)
  std::string verify = "full";
  int allow_spinning = -1;    // -1 auto
  bool warmup = true;
};

class Engine {
 public:
  Engine(const std::string& bundle, const EngineOptions& opts);
  ~Engine();
  std::vector<int32_t> encode(const std::string& text, int add_bos = -1) const;
  std::string decode(const std::vector<int32_t>& ids) const { return tok_.decode(ids); }
  std::string apply_chat(const std::vector<std::pair<std::string, std::string>>& messages, bool add_gen) const;
  GenResult generate(const std::vector<int32_t>& prompt, const GenConfig& cfg, const TokenCallback& cb);
  const Manifest& manifest() const { return m_; }
  int vocab() const { return vocab_; }
  std::string drafter_kind() const { return ngram_ ? "ngram" : (drafter_ ? "model" : (head_ ? "head" : "none")); }
  HeadDrafter* head_drafter() const { return head_.get(); }  // draft "head" only (tests observe it)
  // Tests only: called with (k, nodes) before each tree round, returns the nodes to use instead.
  // A tree's size follows the measured cost model (timing noise), so a replay of a recorded Python
  // run gives each round the size Python's had.
  std::function<int(int, int)> tree_nodes_override;
  void calibrate(int repeats = 3);

 private:
  void check_call_size(int k) const;
  std::vector<int32_t> target_step(const std::vector<int32_t>& tokens, const SamplingParams& p, Rng& rng);
  struct TreeRound {  // what one tree round did (tree_round.py's Round)
    std::vector<int32_t> tokens;
    int drafted = 0, call = 0, depth = 0, chain_accepted = -1;
    double draft_s = 0, verify_s = 0;
  };
  // tree_round.cpp: draft a tree of at most `nodes` nodes in place of a chain of k, at most
  // `depth` (>= k) deep, verify it in one call, commit the accepted path; nullopt when the
  // drafter made no tree (the chain round runs).
  std::optional<TreeRound> tree_round(const std::vector<int32_t>& tokens, int k, int nodes, const SamplingParams& p,
                                      Rng& rng, int depth);
  Manifest m_;
  Tokenizer tok_;
  std::unique_ptr<Backend> target_, draft_backend_;
  std::unique_ptr<CacheTracker> tcache_;
  std::unique_ptr<ModelDrafter> drafter_;
  std::unique_ptr<NgramDrafter> ngram_;
  std::unique_ptr<HeadDrafter> head_;
  std::vector<int64_t> eos_;
  int vocab_ = 0, spec_tokens_ = 0;
  CostModel costs_, static_costs_;
  std::vector<double> p_rows_, q_rows_;
};

}  // namespace specedge
