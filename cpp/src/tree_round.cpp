// One speculative round with a token tree (mirrors specedge/runtime/tree_round.py; docs/design.md,
// "Tree calls"): the drafter proposes a Tree, the target scores all its nodes in ONE call with the
// ancestor mask, verification keeps one root path plus the target's token (tree.h), and the
// target's backend moves that path's K/V into contiguous slots (keep_path), so the next call sees
// an ordinary cache.
#include <algorithm>

#include "error.h"
#include "rounds.h"

namespace specedge {

namespace {
// The verdict on a scored tree: the accepted path (node ids from the root) into `path`, the tokens
// to emit and the first line's count into `r`.
std::vector<int> judge(TargetView& target, const Tree& tree, const float* logits, int k, const SamplingParams& p,
                       Rng& rng, Round& r) {
  const int T = tree.size(), vocab = target.vocab;
  const size_t V = size_t(target.cache->backend()->vocab_size());
  std::pair<std::vector<int>, std::vector<int32_t>> verdict;
  if (p.greedy()) {
    std::vector<int32_t> best(static_cast<size_t>(T));
    for (int i = 0; i < T; ++i) best[size_t(i)] = argmax(logits + size_t(i) * V, vocab);
    verdict = verify_tree_greedy(tree, best);
    r.chain_accepted = chain_accepted(tree, best, k);
  } else {
    std::vector<double> prow, p_all(size_t(T) * size_t(vocab));
    for (int i = 0; i < T; ++i) {
      probs_from_logits(logits + size_t(i) * V, vocab, p, prow);
      std::copy(prow.begin(), prow.end(), p_all.begin() + long(i) * vocab);
    }
    verdict = verify_tree_sampling(tree, p_all, vocab, rng);
    r.chain_accepted = first_line_kept(tree, verdict.first, k);
  }
  r.tokens = std::move(verdict.second);
  return std::move(verdict.first);
}
}  // namespace

Round tree_round(TargetView& target, Drafter& drafter, const std::vector<int32_t>& tokens, int k, int nodes,
                 const SamplingParams& p, Rng& rng, int depth) {
  double t0 = now();
  std::optional<Tree> tree = drafter.propose_tree(tokens, k, nodes, p, rng, std::max(k, depth));
  double t1 = now();
  if (!tree) return speculative_round(target, drafter, tokens, k, p, rng);
  if (tree->size() < 2) {
    Round plain = target_step(target, tokens, p, rng);
    plain.draft_s = t1 - t0;
    plain.verify_s = now() - t1;
    plain.k = k;
    return plain;
  }
  if (tree->tokens[0] != tokens.back()) fail_arg("the tree's root is not the pending token");
  CacheTracker& cache = *target.cache;
  Backend& backend = *cache.backend();
  const int position = cache.position();  // == tokens.size() - 1: the root is not in the cache
  const int T = tree->size();
  std::vector<uint8_t> mask = tree->ancestor_mask();
  const float* logits = backend.run_tree(tree->tokens.data(), T, position, mask.data());
  cache.adopt(tree->tokens.data(), T);  // the record holds the nodes until the commit says which stay
  Round r;
  std::vector<int> path = judge(target, *tree, logits, k, p, rng, r);
  // the commit (cache.py keep_path): the root + the accepted nodes, == position + tokens emitted;
  // the backend moves their K/V and, kept for a head, their feature rows (the head's next catch-up
  // reads row j for committed token j)
  std::vector<int32_t> kept;
  for (int i : path) kept.push_back(tree->tokens[size_t(i)]);
  backend.keep_path(position, path);
  cache.rollback(position);
  cache.adopt(kept.data(), int(kept.size()));
  r.drafted = T - 1;
  r.call = T;
  r.depth = tree->depth();
  r.draft_s = t1 - t0;
  r.verify_s = now() - t1;
  r.k = k;
  return r;
}

}  // namespace specedge
