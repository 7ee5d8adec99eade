// The speculation policy: how many tokens to draft per round, and when not to speculate at all.
// Specified once in docs/design.md ("The speculation policy"); specedge/runtime/policy.py is the
// same rules with the same constants, and both are pinned by tests/data/policy_vectors.json
// (recorded rounds -> the k decisions), which cpp/tests/test_policy.cpp and tests/test_policy.py run.
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <utility>

#include "manifest.h"

namespace specedge {

namespace policy {
constexpr double kEmaWeight = 0.2;      // weight of a new cost measurement in the moving average
constexpr double kSpikeClamp = 2.0;     // a measurement counts at most this many times the estimate
constexpr double kPriorAccepted = 2.0;  // prior of the acceptance estimate: alpha = 2/3
constexpr double kPriorRejected = 1.0;
constexpr double kDecay = 0.9;         // per-round decay of acceptance counts and of the window
constexpr int kWindow = 48;            // rounds kept for the counterfactual E(k)
constexpr int kMinRounds = 4;          // rounds at a k before the guard judges it
constexpr double kKeep = 1.0;          // keep k while its expected speed-up is at least this
constexpr double kShrinkMin = 1.0;     // a smaller k is taken only if it pays at all
constexpr int kBackoffStart = 16;      // target-only tokens after a fallback, doubling ...
constexpr int kBackoffMax = 256;       // ... up to this
constexpr double kLocalWeight = 0.25;  // weight of a new measurement in the request's own step times
                                       // (unclamped: their mean, spikes included, is what it pays)
constexpr int kProbeRounds = 16;       // rounds without a 1-token step after which one is taken
constexpr int kTreeRetryStart = 32;    // chain rounds, across requests, before trees are tried again, doubling ...
constexpr int kTreeRetryMax = 512;     // ... up to this
}  // namespace policy

// Expected tokens per round with k drafts and per-token acceptance alpha (Leviathan et al.).
double expected_tokens(double alpha, int k);

// Step costs in seconds: target with T tokens, draft per proposed token.
struct CostModel {
  std::map<int, double> target;  // T -> seconds
  double draft = 0.0;
  double alpha = policy::kEmaWeight;
  // A draft that cannot pay even with every token accepted: its fallback goes on across requests as
  // if they were one long request: the target-only tokens left of it and the backoff after it.
  // Cleared by a request that finds speculation paying.
  int carry_fallback = 0, carry_backoff = 0;
  // Trees the guard turned off stay off across requests the same way: the chain rounds left before
  // trees are tried again, and the span after the next turn-off. Cleared by a request whose trees pay.
  int carry_chain = 0, tree_backoff = 0;
  double target_cost(int t) const;
  void observe_target(int t, double s);
  void observe_draft(double s);

 private:
  double ema(double old, double s) const;
};

// Chooses k per round; shrinks k or falls back to target-only decoding when speculation does not pay.
// Judges by this request's own step times (`local`), which follow the machine's load where the shared,
// spike-clamped CostModel cannot; c(1) is timed by a 1-token step after one, and after kProbeRounds rounds
// without such a timing 1-token steps are taken (a probe).
class SpecController {
 public:
  // trees: the request asked for trees; only its rounds count down a carried tree verdict
  // (policy.py SpecController.trees)
  SpecController(int k, CostModel* costs, bool guard, bool learn, bool adaptive = false, int k_max = kMaxSpecTokens,
                 bool trees = true);
  int next_k() const { return fallback_left_ > 0 || probe_due() ? 0 : k_; }
  void record_plain(int n_tokens, double seconds);
  // A tree round (policy.py record_round's call/depth/chain_accepted) also passes its call size
  // (nodes, root included), its depth (draft steps) and the drafts its first line
  // alone would have had accepted; -1 = a chain's (drafted + 1, drafted, none).
  void record_round(int k, int n_accepted, double draft_s, double verify_s, int drafted, int call = -1, int depth = -1,
                    int chain_accepted = -1);
  // Tokens in the target call of a round with k draft steps: the last tree's size while this
  // request verifies trees of that depth, else k + 1.
  int call_size(int k) const;
  // (tree, chain) expected speed-ups over this request's tree rounds (policy.py tree_vs_chain).
  std::pair<double, double> tree_vs_chain() const;
  double expected(int k) const;
  double load_scale() const;
  double step_cost(int t) const;
  double draft_cost() const;
  double speedup(int k) const;
  double ceiling(int k) const;  // speedup(k) if every draft were accepted
  double alpha() const { return acc_ / (acc_ + rej_); }
  int k_start, k_, fallbacks = 0, shrinks = 0, probes = 0;
  int64_t fallback_tokens = 0;
  std::map<int, int64_t> k_histogram;
  std::map<int, double> local;   // this request's own target step times, T -> seconds
  std::map<int, int> tree_call;  // k -> tokens in the last tree call with k draft steps
  bool use_tree = true;          // trees (when asked for) still pay at least what the chain would
  int tree_rounds = 0;           // tree rounds judged against their chain (greedy and sampled)
  double tree_gain = 0, chain_gain = 0, gain_weight = 0;  // decayed tokens per round, both ways
  double local_draft = -1.0;                              // its draft seconds per token; < 0 before one is measured

 private:
  CostModel* costs_;
  bool guard_, learn_, adaptive_, trees_;
  int k_max_;
  double acc_ = policy::kPriorAccepted, rej_ = policy::kPriorRejected;
  std::deque<int> recent_;  // accepted counts of the latest rounds, newest last
  int k_seen_;
  int rounds_since_ = 0, fallback_left_ = 0, backoff_ = policy::kBackoffStart;
  int since_plain_ = 0;       // rounds since this request last timed c(1) (two 1-token steps in a row)
  bool after_plain_ = false;  // the last event was a 1-token step
  bool carried_ = false;      // the fallback in progress is a hopeless draft's, shared with later requests
  bool probe_due() const { return guard_ && learn_ && since_plain_ >= policy::kProbeRounds; }
  void judge_tree(int n_accepted, int chain_accepted);
  void trees_off();  // chains for the rest of the request and, learning, the next requests' rounds
};

}  // namespace specedge
