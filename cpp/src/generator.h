// The generation loop (mirrors specedge/runtime/generator.py): prefill, then rounds (rounds.h)
// until a stop rule, committing what each returns; streaming (text.h) and stats around it. How k
// is chosen is policy.h; which drafter proposes is drafters/, and the loop never asks which.
//
// Invariant of the loop: `tokens` is the committed sequence (prompt + generated); the target's
// cache holds all of it but the last token, which the next step feeds.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache.h"
#include "drafters/base.h"
#include "manifest.h"
#include "policy.h"
#include "rounds.h"
#include "sampling.h"
#include "tokenizer.h"

namespace specedge {

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

// Refuse up front a k whose verification call (k + 1 tokens) the target's backend cannot run (a
// TensorRT engine's largest profile), rather than in the middle of a generation.
void check_call_size(const Backend& target, int k);

class Generator {
 public:
  // `target`: the target's cache (its backend the target); `drafter` may be null (target only);
  // `vocab`: ids that may be generated; `static_costs`: the costs a seeded sampling run decides
  // with, so the same seed gives the same output whatever the machine's timing noise.
  Generator(const Manifest& m, const Tokenizer& tok, CacheTracker& target, std::unique_ptr<Drafter> drafter, int vocab,
            int spec_tokens, CostModel static_costs);
  ~Generator();
  GenResult run(const std::vector<int32_t>& prompt, const GenConfig& cfg, const TokenCallback& cb);
  void reset();                          // forget every cache's content (after a warm-up)
  CostModel& costs() { return costs_; }  // measured at load, refined while generating
  Drafter* drafter() const { return drafter_.get(); }
  // Put another drafter in (a wrapper around the one taken out, say); returns the one it replaces.
  std::unique_ptr<Drafter> replace_drafter(std::unique_ptr<Drafter> d);

 private:
  struct Request;
  void check(const std::vector<int32_t>& prompt, const GenConfig& cfg) const;
  Round step(Request& req, bool speculative);
  Stats stats(const Request& req, int reused, double t_start, double t_first, double t_end) const;
  const Manifest& m_;
  const Tokenizer& tok_;
  CacheTracker& target_;
  TargetView view_;
  std::unique_ptr<Drafter> drafter_;
  std::vector<int64_t> eos_;
  int vocab_, spec_tokens_;
  CostModel costs_, static_costs_;
};

}  // namespace specedge
