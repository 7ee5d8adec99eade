#include "rounds.h"

#include <algorithm>
#include <chrono>

namespace specedge {

double now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

int32_t TargetView::pick(const float* row, const SamplingParams& p, Rng& rng) {
  if (p.greedy()) return argmax(row, vocab);
  probs_from_logits(row, vocab, p, p_row);
  return sample(p_row.data(), vocab, rng);
}

Round target_step(TargetView& target, const std::vector<int32_t>& tokens, const SamplingParams& p, Rng& rng) {
  double t0 = now();
  Round r;
  r.tokens = {target.pick(target.cache->feed(&tokens.back(), 1), p, rng)};
  r.verify_s = now() - t0;
  return r;
}

namespace {
// The accepted drafts plus the target's token, from the logits [drafts + 1, V] of the call that
// fed the pending token and the drafts.
std::vector<int32_t> verify(TargetView& target, const Proposal& draft, const float* logits, const SamplingParams& p,
                            Rng& rng) {
  const size_t rows = draft.tokens.size() + 1, vocab = size_t(target.vocab);
  const size_t V = size_t(target.cache->backend()->vocab_size());
  if (p.greedy()) {
    if (V == vocab) return verify_greedy(draft.tokens, logits, int(V));
    std::vector<float> cut(rows * vocab);  // padding rows beyond the vocabulary must not win an argmax
    for (size_t r = 0; r < rows; ++r) std::copy(logits + r * V, logits + r * V + vocab, cut.begin() + long(r * vocab));
    return verify_greedy(draft.tokens, cut.data(), int(vocab));
  }
  std::vector<double> prow, p_all(rows * vocab);
  for (size_t r = 0; r < rows; ++r) {
    probs_from_logits(logits + r * V, int(vocab), p, prow);
    std::copy(prow.begin(), prow.end(), p_all.begin() + long(r * vocab));
  }
  return verify_sampling(draft.tokens, draft.q, p_all, int(vocab), rng);
}
}  // namespace

Round speculative_round(TargetView& target, Drafter& drafter, const std::vector<int32_t>& tokens, int k,
                        const SamplingParams& p, Rng& rng) {
  double t0 = now();
  Proposal draft = drafter.propose(tokens, k, p, rng);
  double t1 = now();
  if (draft.tokens.empty()) {
    Round plain = target_step(target, tokens, p, rng);
    plain.draft_s = t1 - t0;
    plain.verify_s = now() - t1;
    plain.k = k;
    return plain;
  }
  CacheTracker& cache = *target.cache;
  const int position = cache.position();     // == tokens.size() - 1: the pending token is not in the cache
  std::vector<int32_t> feed{tokens.back()};  // row i of the target's output: the token after draft[:i]
  feed.insert(feed.end(), draft.tokens.begin(), draft.tokens.end());
  Round r;
  r.tokens = verify(target, draft, cache.feed(feed.data(), int(feed.size())), p, rng);
  cache.rollback(position + int(r.tokens.size()));  // the pending token + the accepted drafts
  r.drafted = int(draft.tokens.size());
  r.draft_s = t1 - t0;
  r.verify_s = now() - t1;
  r.k = k;
  return r;
}

}  // namespace specedge
