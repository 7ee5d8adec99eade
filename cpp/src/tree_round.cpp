// One speculative round with a token tree (specedge/runtime/tree_round.py; docs/design.md, "Tree
// calls"), and the drafters' tree proposals (drafters/ngram.py propose_tree,
// drafters/model.py propose_tree; the head's is HeadDrafter::propose_tree): the drafter proposes a Tree, the target scores all its nodes in
// ONE call with the ancestor mask, verification keeps one root path plus the target's token
// (tree.h), and the target's backend moves that path's K/V into contiguous slots (keep_path), so
// the next call sees an ordinary cache.
#include <algorithm>
#include <chrono>
#include <queue>
#include <set>

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

std::vector<std::pair<int32_t, int>> NgramDrafter::followers(const std::vector<int32_t>& tail, size_t length,
                                                             int& total) const {
  total = 0;
  for (size_t si = 0; si < sizes_.size(); ++si) {
    size_t n = size_t(sizes_[si]);
    if (length <= n) continue;
    auto it = starts_[si].find(std::string(reinterpret_cast<const char*>(tail.data() + tail.size() - n),
                                           n * sizeof(int32_t)));
    if (it == starts_[si].end() || it->second.empty()) continue;
    std::vector<std::pair<int32_t, int>> counts;  // in order of first sight, most recent first
    for (auto s = it->second.rbegin(); s != it->second.rend(); ++s) {
      int32_t tok = tokens_[*s + n];
      auto c = std::find_if(counts.begin(), counts.end(), [&](const auto& tc) { return tc.first == tok; });
      if (c == counts.end())
        counts.emplace_back(tok, 1);
      else
        ++c->second;
    }
    std::stable_sort(counts.begin(), counts.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    total = int(it->second.size());
    return counts;
  }
  return {};
}

std::optional<Tree> NgramDrafter::propose_tree(const std::vector<int32_t>& history, int k, int nodes, int depth,
                                               int vocab) {
  if (k < 1 || nodes < 2 || depth < 1) return std::nullopt;
  sync(history);
  const size_t length = tokens_.size();
  if (length < 2) return std::nullopt;
  extend_index(length - 1);
  size_t wide = size_t(*std::max_element(sizes_.begin(), sizes_.end()));
  std::vector<int32_t> base(tokens_.end() - long(std::min(wide, length)), tokens_.end());
  std::vector<std::vector<int32_t>> paths{{}};
  std::vector<double> scores{1.0};
  struct {
    std::vector<int32_t> tokens;
    std::vector<int> parents;
  } tree{{tokens_.back()}, {-1}};
  // the context's last `wide` tokens: the history's tail, then the node's path
  auto tail = [&](const std::vector<int32_t>& path) {
    std::vector<int32_t> t(base);
    t.insert(t.end(), path.begin(), path.end());
    if (t.size() > wide) t.erase(t.begin(), t.end() - long(wide));
    return t;
  };
  std::vector<int32_t> chain = propose(tokens_, std::min({k, depth, nodes - 1}));
  for (int32_t tok : chain) {
    if (tok < 0 || tok >= vocab) break;
    int total = 0;
    auto options = followers(tail(paths.back()), length + paths.back().size(), total);
    int count = 0;
    for (const auto& tc : options)
      if (tc.first == tok) count = tc.second;
    double share = total ? double(count) / double(total) : 0.0;
    tree.tokens.push_back(tok);
    tree.parents.push_back(int(tree.tokens.size()) - 2);
    std::vector<int32_t> path = paths.back();
    path.push_back(tok);
    paths.push_back(std::move(path));
    scores.push_back(scores.back() * share);
  }
  struct Candidate {
    double score;
    int64_t order;
    int parent;
    int32_t token;
  };
  // ngram.py's heap: highest score first, then the candidate found first
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.score < b.score || (a.score == b.score && a.order > b.order);
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> heap(later);
  std::set<std::pair<int, int32_t>> children;
  for (size_t i = 1; i < tree.tokens.size(); ++i) children.emplace(tree.parents[i], tree.tokens[i]);
  int64_t order = 0;
  auto offer = [&](int node) {
    const auto& path = paths[size_t(node)];
    if (int(path.size()) >= depth) return;
    int total = 0;
    for (const auto& [tok, count] : followers(tail(path), length + path.size(), total))
      if (tok >= 0 && tok < vocab && !children.count({node, tok}))
        heap.push({scores[size_t(node)] * count / total, order++, node, tok});
  };
  for (int node = 0; node < int(tree.tokens.size()); ++node) offer(node);
  while (!heap.empty() && int(tree.tokens.size()) < nodes) {
    Candidate c = heap.top();
    heap.pop();
    children.emplace(c.parent, c.token);
    tree.tokens.push_back(c.token);
    tree.parents.push_back(c.parent);
    std::vector<int32_t> path = paths[size_t(c.parent)];
    path.push_back(c.token);
    paths.push_back(std::move(path));
    scores.push_back(c.score);
    offer(int(tree.tokens.size()) - 1);
  }
  if (tree.tokens.size() < 2) return std::nullopt;
  return Tree(std::move(tree.tokens), std::move(tree.parents));
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


// ---------------------------------------------------------------------------- the round

std::optional<Engine::TreeRound> Engine::tree_round(const std::vector<int32_t>& tokens, int k, int nodes,
                                                    const SamplingParams& params, Rng& rng, int depth) {
  double t0 = now();
  // the model drafter and the head stay at depth k (a level deeper is one more of their calls)
  std::optional<Tree> tree = drafter_ ? drafter_->propose_tree(tokens, k, nodes, params, rng)
                             : head_  ? head_->propose_tree(tokens, k, nodes, params, rng)
                                      : ngram_->propose_tree(tokens, k, nodes, std::max(k, depth), vocab_);
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
    r.chain_accepted = chain_accepted(*tree, best, k);
  } else {
    std::vector<double> prow, p_all(size_t(T) * size_t(vocab_));
    for (int i = 0; i < T; ++i) {
      probs_from_logits(logits + size_t(i) * size_t(V), vocab_, params, prow);
      std::copy(prow.begin(), prow.end(), p_all.begin() + long(i) * vocab_);
    }
    auto verdict = verify_tree_sampling(*tree, p_all, vocab_, rng);
    path = std::move(verdict.first);
    r.tokens = std::move(verdict.second);
    r.chain_accepted = first_line_kept(*tree, path, k);
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
