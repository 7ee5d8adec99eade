// One speculative round with a token tree (specedge/runtime/tree_round.py; docs/design.md, "Tree
// calls"), and the drafters' tree proposals (drafters/ngram.py propose_paths / propose_tree,
// drafters/model.py propose_tree; the head's is HeadDrafter::propose_tree): the drafter proposes a Tree, the target scores all its nodes in
// ONE call with the ancestor mask, verification keeps one root path plus the target's token
// (tree.h), and the target's backend moves that path's K/V into contiguous slots (keep_path), so
// the next call sees an ordinary cache.
#include <algorithm>
#include <chrono>

#include "engine.h"
#include "error.h"

namespace specedge {

namespace {
double now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}
}  // namespace

// ---------------------------------------------------------------------------- drafters

std::vector<std::vector<int32_t>> NgramDrafter::propose_paths(const std::vector<int32_t>& history, int k, int width) {
  if (k < 0 || width < 0) fail_arg("k and width must be >= 0");
  sync(history);
  size_t len = tokens_.size();
  std::vector<std::vector<int32_t>> paths;
  if (k == 0 || width == 0 || len < 2) return paths;
  extend_index(len - 1);
  for (size_t si = 0; si < sizes_.size(); ++si) {
    size_t n = size_t(sizes_[si]);
    if (len <= n) continue;
    auto it = starts_[si].find(std::string(reinterpret_cast<const char*>(tokens_.data() + len - n), n * sizeof(int32_t)));
    if (it == starts_[si].end()) continue;
    for (auto s = it->second.rbegin(); s != it->second.rend(); ++s) {  // most recent first
      size_t from = *s + n, to = std::min(from + size_t(k), len);
      if (from >= to) continue;
      std::vector<int32_t> cont(tokens_.begin() + long(from), tokens_.begin() + long(to));
      if (std::find(paths.begin(), paths.end(), cont) == paths.end()) {
        paths.push_back(std::move(cont));
        if (int(paths.size()) == width) return paths;
      }
    }
  }
  return paths;
}

std::optional<Tree> ModelDrafter::propose_tree(const std::vector<int32_t>& history, int k, int nodes) {
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
  return chain_tree(history.back(), row, vocab_, step, k, nodes);
}

namespace {
// ngram.py NgramProposer.propose_tree: the prefix tree of several continuations, each cut at the
// first id the target may not emit, then to `nodes` nodes in path order (the chain comes first).
std::optional<Tree> ngram_tree(NgramDrafter& d, const std::vector<int32_t>& history, int k, int nodes, int vocab) {
  if (nodes < 2 || k < 1) return std::nullopt;
  std::vector<std::vector<int32_t>> paths;
  for (const auto& path : d.propose_paths(history, k, std::max(1, nodes - 1))) {
    std::vector<int32_t> ok;
    for (int32_t t : path) {
      if (t < 0 || t >= vocab) break;
      ok.push_back(t);
    }
    if (!ok.empty()) paths.push_back(std::move(ok));
  }
  if (paths.empty()) return std::nullopt;
  return Tree::from_paths(history.back(), paths).prefix(nodes);
}
}  // namespace

// ---------------------------------------------------------------------------- the round

std::optional<Engine::TreeRound> Engine::tree_round(const std::vector<int32_t>& tokens, int k, int nodes,
                                                    const SamplingParams& params, Rng& rng) {
  double t0 = now();
  std::optional<Tree> tree = drafter_ ? drafter_->propose_tree(tokens, k, nodes)
                             : head_  ? head_->propose_tree(tokens, k, nodes)
                                      : ngram_tree(*ngram_, tokens, k, nodes, vocab_);
  double t1 = now();
  if (!tree) return std::nullopt;  // no tree: the chain round runs
  TreeRound r;
  r.draft_s = t1 - t0;
  if (tree->size() < 2) {
    r.tokens = target_step(tokens, params, rng);
    r.verify_s = now() - t1;
    return r;
  }
  if (tree->tokens[0] != tokens.back()) fail_arg("the tree's root is not the pending token");
  CacheTracker& cache = *tcache_;
  const int position = cache.position();  // == tokens.size() - 1: the root is not in the cache
  const int T = tree->size();
  std::vector<uint8_t> mask = tree->ancestor_mask();
  const float* logits = target_->run_tree(tree->tokens.data(), T, position, mask.data());
  cache.adopt(tree->tokens.data(), T);  // the record holds the nodes until the commit says which stay
  const int V = target_->vocab_size();
  std::vector<int> path;
  if (params.greedy()) {
    std::vector<int32_t> best(static_cast<size_t>(T));
    for (int i = 0; i < T; ++i) best[size_t(i)] = argmax(logits + size_t(i) * size_t(V), vocab_);
    auto verdict = verify_tree_greedy(*tree, best);
    path = std::move(verdict.first);
    r.tokens = std::move(verdict.second);
    r.chain_accepted = chain_accepted(*tree, best);
  } else {
    std::vector<double> prow, p_all(size_t(T) * size_t(vocab_));
    for (int i = 0; i < T; ++i) {
      probs_from_logits(logits + size_t(i) * size_t(V), vocab_, params, prow);
      std::copy(prow.begin(), prow.end(), p_all.begin() + long(i) * vocab_);
    }
    auto verdict = verify_tree_sampling(*tree, p_all, vocab_, rng);
    path = std::move(verdict.first);
    r.tokens = std::move(verdict.second);
  }
  // the commit (cache.py keep_path): the root + the accepted nodes, == position + tokens emitted;
  // the backend moves their K/V and, kept for a head, their feature rows (the head's next catch-up
  // reads row j for committed token j)
  std::vector<int32_t> kept;
  for (int i : path) kept.push_back(tree->tokens[size_t(i)]);
  target_->keep_path(position, path);
  cache.rollback(position);
  cache.adopt(kept.data(), int(kept.size()));
  r.drafted = T - 1;
  r.call = T;
  r.depth = tree->depth();
  r.verify_s = now() - t1;
  return r;
}

}  // namespace specedge
