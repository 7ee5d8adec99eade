#include "policy.h"

#include <algorithm>
#include <cmath>
#include <iterator>

namespace specedge {

double expected_tokens(double alpha, int k) {
  if (alpha >= 1.0) return k + 1.0;
  return (1.0 - std::pow(alpha, k + 1)) / (1.0 - alpha);
}

double CostModel::target_cost(int t) const {
  auto it = target.find(t);
  if (it != target.end()) return it->second;
  if (target.empty()) return double(t);  // nothing measured: pretend compute-bound (conservative)
  if (t < target.begin()->first) return target.begin()->second;
  auto last = std::prev(target.end());
  if (t > last->first) {
    if (target.size() == 1) return last->second * t / last->first;
    auto prev = std::prev(last);
    double slope = std::max((last->second - prev->second) / (last->first - prev->first), 0.0);
    return last->second + slope * (t - last->first);
  }
  auto hi = target.upper_bound(t);
  auto lo = std::prev(hi);
  double w = double(t - lo->first) / double(hi->first - lo->first);
  return lo->second * (1 - w) + hi->second * w;
}

double CostModel::ema(double old, double s) const {
  if (old == 0.0) return s;
  // a spike (another process took the CPU) moves the estimate by at most alpha * old
  return (1 - alpha) * old + alpha * std::min(s, policy::kSpikeClamp * old);
}

void CostModel::observe_target(int t, double s) {
  auto it = target.find(t);
  target[t] = ema(it == target.end() ? 0.0 : it->second, s);
}

void CostModel::observe_draft(double s) { draft = ema(draft, s); }

SpecController::SpecController(int k, CostModel* costs, bool guard, bool learn, bool adaptive, int k_max, bool trees)
    : k_start(k),
      k_(k),
      costs_(costs),
      guard_(guard),
      learn_(learn),
      adaptive_(adaptive),
      trees_(trees),
      k_max_(std::max(k_max, k)),
      k_seen_(k) {
  if (guard_ && learn_) {
    // an earlier request found this draft cannot pay: go on with its fallback
    if (costs_->carry_backoff > 0) backoff_ = costs_->carry_backoff;
    if (costs_->carry_fallback > 0) {
      ++fallbacks;
      fallback_left_ = costs_->carry_fallback;
      carried_ = true;
    }
    if (costs_->carry_chain > 0) use_tree = false;  // an earlier request found trees slower than the chain
  }
}

double SpecController::expected(int k) const {
  // E(k') up to the smallest k in the window: a round that accepted n drafts would have accepted
  // min(n, k') with k' drafts, since the first k' drafts are the same
  if (!recent_.empty() && k <= k_seen_) {
    double w = 0.0, wsum = 0.0, weight = 1.0;
    for (auto it = recent_.rbegin(); it != recent_.rend(); ++it) {
      w += weight * std::min(*it, k);
      wsum += weight;
      weight *= policy::kDecay;
    }
    return 1.0 + w / wsum;
  }
  return expected_tokens(alpha(), k);
}

namespace {
double local_ema(double old, double s, bool has_old) {
  return has_old ? (1 - policy::kLocalWeight) * old + policy::kLocalWeight * s : s;
}
void observe_local(std::map<int, double>& local, int t, double s) {
  auto it = local.find(t);
  local[t] = local_ema(it == local.end() ? 0.0 : it->second, s, it != local.end());
}
}  // namespace

double SpecController::load_scale() const {
  // the sum of this request's own times over the shared model's costs for the same sizes
  double own = 0.0, shared = 0.0;
  for (const auto& [t, s] : local) {
    own += s;
    shared += costs_->target_cost(t);
  }
  return !local.empty() && shared > 0 ? own / shared : 1.0;
}

double SpecController::step_cost(int t) const {
  auto it = local.find(t);
  if (it != local.end()) return it->second;
  return costs_->target_cost(t) * load_scale();
}

double SpecController::draft_cost() const { return local_draft >= 0 ? local_draft : costs_->draft * load_scale(); }

int SpecController::call_size(int k) const {
  if (!use_tree) return k + 1;
  auto it = tree_call.find(k);
  return it == tree_call.end() ? k + 1 : it->second;
}

double SpecController::speedup(int k) const {
  double t1 = step_cost(1);
  double cost = k * draft_cost() + step_cost(call_size(k));
  return cost > 0 ? expected(k) * t1 / cost : INFINITY;
}

double SpecController::ceiling(int k) const {
  double cost = k * draft_cost() + step_cost(call_size(k));
  return cost > 0 ? (k + 1) * step_cost(1) / cost : INFINITY;
}

void SpecController::record_plain(int n, double seconds) {
  if (probe_due() && fallback_left_ <= 0) ++probes;
  // only a step after a step times what target-only decoding pays: the first 1-token call after a
  // round pays for the shape change (and a draft model's evicted caches)
  if (learn_ && after_plain_) {
    costs_->observe_target(1, seconds);
    observe_local(local, 1, seconds);
    since_plain_ = 0;
  }
  after_plain_ = true;
  if (fallback_left_ > 0) {
    fallback_left_ -= n;
    fallback_tokens += n;
    if (carried_ && learn_) costs_->carry_fallback = std::max(fallback_left_, 0);
    if (fallback_left_ <= 0) {
      carried_ = false;  // try speculating again with the full k, judging afresh
      acc_ = policy::kPriorAccepted;
      rej_ = policy::kPriorRejected;
      rounds_since_ = 0;
      recent_.clear();
      k_ = k_start;
      // round times from before the fallback are stale; c(1) was just measured
      auto one = local.find(1);
      std::map<int, double> kept;
      if (one != local.end()) kept[1] = one->second;
      local = kept;
      local_draft = -1.0;
    }
  }
}

std::pair<double, double> SpecController::tree_vs_chain() const {
  if (gain_weight <= 0) return {1.0, 1.0};
  double t1 = step_cost(1), d = draft_cost();
  auto it = tree_call.find(k_);
  double tree_cost = k_ * d + step_cost(it == tree_call.end() ? k_ + 1 : it->second);
  double chain_cost = k_ * d + step_cost(k_ + 1);
  double tree = tree_cost > 0 ? tree_gain / gain_weight * t1 / tree_cost : INFINITY;
  double chain = chain_cost > 0 ? chain_gain / gain_weight * t1 / chain_cost : INFINITY;
  return {tree, chain};
}

void SpecController::trees_off() {
  use_tree = false;
  if (learn_) {
    int doubled = std::min(2 * costs_->tree_backoff, policy::kTreeRetryMax);
    costs_->tree_backoff = doubled ? doubled : policy::kTreeRetryStart;
    costs_->carry_chain = costs_->tree_backoff;
  }
}

void SpecController::judge_tree(int n_accepted, int chain_accepted) {
  ++tree_rounds;
  tree_gain = tree_gain * policy::kDecay + n_accepted + 1;
  chain_gain = chain_gain * policy::kDecay + chain_accepted + 1;
  gain_weight = gain_weight * policy::kDecay + 1;
  if (guard_ && use_tree && tree_rounds >= policy::kMinRounds) {
    auto [tree, chain] = tree_vs_chain();
    if (tree < chain) {
      trees_off();
    } else if (learn_ && tree_rounds == policy::kMinRounds) {
      costs_->tree_backoff = 0;  // trees pay again: the next turn-off starts afresh
    }
  }
}

void SpecController::record_round(int k, int n_accepted, double draft_s, double verify_s, int drafted, int call,
                                  int depth, int chain_accepted) {
  // a tree's call and depth differ from its node count; a chain's are drafted + 1 and drafted
  if (call < 0) call = drafted + 1;
  if (depth < 0) depth = drafted;
  if (call > depth + 1) tree_call[std::min(depth, k)] = call;  // the call that stood in for the chain of k
  ++k_histogram[k];
  if (learn_) {
    if (depth) {
      costs_->observe_draft(draft_s / depth);
      local_draft = local_ema(local_draft, draft_s / depth, local_draft >= 0);
    }
    costs_->observe_target(call, verify_s);
    observe_local(local, call, verify_s);
  }
  ++since_plain_;
  after_plain_ = false;
  if (guard_ && learn_ && trees_ && !use_tree && costs_->carry_chain > 0) --costs_->carry_chain;
  acc_ = acc_ * policy::kDecay + n_accepted;
  rej_ = rej_ * policy::kDecay + (n_accepted < std::min(depth, k) ? 1 : 0);
  if (recent_.empty()) k_seen_ = k;
  k_seen_ = std::min(k_seen_, k);  // counterfactuals hold up to the smallest k in the window
  recent_.push_back(n_accepted);
  if (int(recent_.size()) > policy::kWindow) recent_.pop_front();
  ++rounds_since_;
  if (chain_accepted >= 0) judge_tree(n_accepted, chain_accepted);
  if (adaptive_ && depth == k) {
    if (n_accepted == k && k_ < k_max_)
      ++k_;
    else if (2 * n_accepted < k && k_ > 1)
      --k_;
  }
  if (!guard_) return;
  // a draft too slow to pay even if every token were accepted is dropped without waiting for
  // kMinRounds of acceptance evidence (an int4 target's own int4 self-draft)
  double top = -INFINITY;
  for (int kk = 1; kk <= k_; ++kk) top = std::max(top, ceiling(kk));
  bool hopeless = top < policy::kShrinkMin;
  if (!hopeless) {
    if (rounds_since_ < policy::kMinRounds) return;
    if (speedup(k_) >= policy::kKeep) {
      backoff_ = policy::kBackoffStart;
      if (learn_) costs_->carry_fallback = costs_->carry_backoff = 0;
      return;
    }
    if (use_tree && !tree_call.empty()) {
      // k does not pay with trees: drop the trees and judge k afresh as a chain, on kMinRounds
      // chain rounds of its own (policy.py record_round)
      trees_off();
      rounds_since_ = 0;
      return;
    }
    int best = 0;
    double best_s = -INFINITY;
    for (int kk = 1; kk < k_; ++kk) {
      double s = speedup(kk);
      if (s > best_s) {  // the first of equal maxima, as Python's max()
        best_s = s;
        best = kk;
      }
    }
    if (best > 0 && best_s >= policy::kShrinkMin) {
      k_ = best;
      ++shrinks;
      return;
    }
  }
  ++fallbacks;
  fallback_left_ = backoff_;
  backoff_ = std::min(backoff_ * 2, policy::kBackoffMax);
  carried_ = hopeless;
  if (learn_) {
    costs_->carry_fallback = hopeless ? fallback_left_ : 0;
    if (hopeless) costs_->carry_backoff = backoff_;
  }
}

}  // namespace specedge
