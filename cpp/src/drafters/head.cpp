#include "drafters/head.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "cache.h"
#include "error.h"
#include "ort_backend.h"

namespace specedge {

std::vector<int32_t> read_draft_vocab(const Manifest& m) {
  const std::string& rel = m.head.draft_vocab_file;
  nlohmann::json d;
  try {
    std::ifstream in(m.path(rel), std::ios::binary);
    if (!in) fail_bundle("cannot read the draft head's vocabulary map '" + rel + "': the file cannot be opened");
    std::stringstream ss;
    ss << in.rdbuf();
    d = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception&) {
    fail_bundle("cannot read the draft head's vocabulary map '" + rel + "': it is not valid JSON");
  }
  const std::string bad = "the draft head's vocabulary map '" + rel + "' must list " +
                          std::to_string(m.head.vocab_size) + " distinct target ids";
  if (!d.is_object() || !d.contains("d2t"))
    fail_bundle("cannot read the draft head's vocabulary map '" + rel + "': it has no 'd2t' list");
  const nlohmann::json& ids = d["d2t"];
  if (!ids.is_array() || int64_t(ids.size()) != m.head.vocab_size) fail_bundle(bad);
  std::vector<int32_t> out;
  std::set<int64_t> seen;
  for (const auto& i : ids) {
    if (!i.is_number_integer() || i.get<int64_t>() < 0 || i.get<int64_t>() >= m.target.vocab_size) fail_bundle(bad);
    if (!seen.insert(i.get<int64_t>()).second) fail_bundle(bad);
    out.push_back(int32_t(i.get<int64_t>()));
  }
  return out;
}

HeadDrafter::HeadDrafter(OrtBackend* head, const CacheTracker* target, std::vector<int32_t> d2t, int vocab, int chunk)
    : head_(head), target_(target), d2t_(std::move(d2t)), vocab_(vocab), chunk_(chunk), vd_(head->vocab_size()) {
  if (int(d2t_.size()) != vd_)
    fail_bundle("the draft vocabulary map has " + std::to_string(d2t_.size()) + " ids, the head's logits " +
                std::to_string(vd_));
  for (int32_t t : d2t_)
    if (t < 0 || t >= vocab_) fail_bundle("the draft vocabulary map names ids outside the target's vocabulary");
  if (chunk_ < 1) fail_arg("the prefill chunk must be >= 1");
  hidden_.assign(size_t(head_->hidden_size()), 0.f);
}

// Feed head slots up to n - 2; return the last slot's draft logits [Vd] (hidden_: its hidden_out).
const float* HeadDrafter::catch_up(const std::vector<int32_t>& history) {
  const int n = int(history.size()), last = n - 2;
  if (!target_) fail_arg("the head drafter was not given the target's cache");
  if (target_->position() < n - 1 || common_prefix(target_->tokens(), 0, history, 0, size_t(n - 1)) < n - 1)
    fail_arg("the target's cache does not hold the committed sequence the head drafts after");
  const Backend* tb = target_->backend();
  const float* feats = tb->features();
  if (!feats)
    fail_arg("the target backend '" + tb->name() +
             "' does not return target features: head drafting needs a bundle exported with features");
  const int F = tb->feature_dim();
  // always re-feed slot n - 2: its output is needed
  int start = common_prefix(fed_, 0, history, 1, size_t(last));
  const float* logits = nullptr;
  const float* hidden = nullptr;
  int rows = 0;
  for (int s = start; s <= last; s += chunk_) {
    int e = std::min(s + chunk_, last + 1);
    rows = e - s;
    logits = head_->run_head(history.data() + s + 1, rows, s, feats + size_t(s) * F, nullptr, &hidden);
    ++calls_;
  }
  fed_.assign(history.begin() + 1, history.end());
  const int H = int(hidden_.size());
  std::copy(hidden + size_t(rows - 1) * H, hidden + size_t(rows) * H, hidden_.begin());
  return logits + size_t(rows - 1) * vd_;
}

std::vector<int32_t> HeadDrafter::propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng,
                                          std::vector<double>* q) {
  std::vector<int32_t> out;
  const int n = int(history.size());
  if (k >= 1 && n >= 2) k = std::min(k, head_->max_seq() - (n - 1));
  if (k < 1 || n < 2) return out;  // no target features yet, or no head slots left: nothing to draft from
  const float* row = catch_up(history);
  std::vector<double> probs;
  if (!p.greedy()) {
    if (!q) fail_arg("sampled drafts need their q rows");
    q->assign(size_t(k) * size_t(vocab_), 0.0);
  }
  for (int j = 0; j < k; ++j) {
    int32_t tok;
    if (p.greedy()) {
      tok = d2t_[size_t(argmax(row, vd_))];
    } else {
      probs_from_logits(row, vd_, p, probs);
      double* qr = q->data() + size_t(j) * size_t(vocab_);
      for (int i = 0; i < vd_; ++i) qr[d2t_[size_t(i)]] = probs[size_t(i)];
      tok = d2t_[size_t(sample(probs.data(), vd_, rng))];
    }
    out.push_back(tok);
    if (j < k - 1) {
      const float* hidden = nullptr;
      row = head_->run_head(&tok, 1, n - 1 + j, nullptr, hidden_.data(), &hidden);
      std::copy(hidden, hidden + hidden_.size(), hidden_.begin());
      ++calls_;
    }
  }
  return out;
}

// Sampled drafts carry their q rows (over the target's vocabulary); greedy ones are point masses.
Proposal HeadDrafter::propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng) {
  std::vector<int32_t> tokens = propose(history, k, p, rng, p.greedy() ? nullptr : &q_);
  return {std::move(tokens), p.greedy() ? nullptr : &q_};
}

std::optional<Tree> HeadDrafter::propose_tree(const std::vector<int32_t>& history, int k, int nodes,
                                              const SamplingParams& p, Rng& rng) {
  const int n = int(history.size());
  if (k >= 1 && nodes >= 2 && n >= 2) k = std::min(k, head_->max_seq() - (n - 1));
  if (k < 1 || nodes < 2 || n < 2) return std::nullopt;  // no target features yet, or no head slots left
  const float* row = catch_up(history);
  int slot = n - 1;
  auto step = [&](int32_t tok) {
    const float* hidden = nullptr;
    const float* lg = head_->run_head(&tok, 1, slot, nullptr, hidden_.data(), &hidden);
    std::copy(hidden, hidden + hidden_.size(), hidden_.begin());
    ++slot;
    ++calls_;
    return lg;
  };
  return chain_tree(history.back(), row, vd_, step, k, nodes, d2t_.data(), &p, &rng, vocab_);
}

}  // namespace specedge
