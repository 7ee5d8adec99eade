#include "drafters/model.h"

#include <algorithm>
#include <cstdint>

#include "error.h"

namespace specedge {

int ModelDrafter::sync(const std::vector<int32_t>& history) {
  // roll back to the common prefix with history; the rest (at least the last token) is to feed
  size_t b = size_t(base_);
  int n = base_ + common_prefix(cache_.tokens(), b, history, b, SIZE_MAX);
  n = std::min(n, int(history.size()) - 1);
  cache_.rollback(n);
  // only when the target holds slots the draft lacks (the prompt, a catch-up), not every round
  if (donor_ && n < std::min(donor_->position(), int(history.size()) - 1)) {
    int m = std::min(common_prefix(donor_->tokens(), 0, history, 0, SIZE_MAX), int(history.size()) - 1);
    if (m > n && cache_.backend()->copy_kv_from(*donor_->backend(), n, m)) {
      cache_.adopt(history.data() + n, m - n);
      copied_ += m - n;
      n = m;
    }
  }
  return n;
}

std::vector<int32_t> ModelDrafter::propose(const std::vector<int32_t>& history, int k, const SamplingParams& p,
                                           Rng& rng, std::vector<double>* q) {
  if (k < 1) return {};
  if (history.empty()) fail_arg("cannot draft after an empty sequence");
  int n = sync(history);
  base_ = int(history.size());
  const float* row = cache_.feed_chunked(history.data() + n, int(history.size()) - n);
  calls_ += (int64_t(history.size()) - n + cache_.chunk() - 1) / cache_.chunk() + (k - 1);
  std::vector<int32_t> out;
  std::vector<double> probs;
  if (q) q->assign(size_t(k) * size_t(vocab_), 0.0);
  for (int j = 0; j < k; ++j) {
    int32_t tok;
    if (p.greedy()) {
      tok = argmax(row, vocab_);
    } else {
      probs_from_logits(row, vocab_, p, probs);
      std::copy(probs.begin(), probs.end(), q->begin() + long(j) * vocab_);
      tok = sample(probs.data(), vocab_, rng);
    }
    out.push_back(tok);
    if (j < k - 1) row = cache_.feed(&tok, 1);
  }
  return out;
}

// Sampled drafts carry their q rows; greedy ones are point masses (no rows).
Proposal ModelDrafter::propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng) {
  std::vector<int32_t> tokens = propose(history, k, p, rng, p.greedy() ? nullptr : &q_);
  return {std::move(tokens), p.greedy() ? nullptr : &q_};
}

std::optional<Tree> ModelDrafter::propose_tree(const std::vector<int32_t>& history, int k, int nodes,
                                               const SamplingParams& p, Rng& rng) {
  if (k < 1 || nodes < 2) return std::nullopt;
  if (history.empty()) fail_arg("cannot draft after an empty sequence");
  int n = sync(history);
  base_ = int(history.size());
  const float* row = cache_.feed_chunked(history.data() + n, int(history.size()) - n);
  calls_ += (int64_t(history.size()) - n + cache_.chunk() - 1) / cache_.chunk();
  auto step = [&](int32_t tok) {
    ++calls_;
    return cache_.feed(&tok, 1);
  };
  return chain_tree(history.back(), row, vocab_, step, k, nodes, nullptr, &p, &rng, vocab_);
}

}  // namespace specedge
