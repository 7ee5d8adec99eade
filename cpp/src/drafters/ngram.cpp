#include "drafters/ngram.h"

#include <algorithm>
#include <queue>
#include <set>

#include "error.h"

namespace specedge {

NgramDrafter::NgramDrafter(std::vector<int> sizes, int vocab) : sizes_(std::move(sizes)), vocab_(vocab) {
  if (sizes_.empty()) fail_arg("ngram_sizes must name at least one n-gram size");
  reset();
}

void NgramDrafter::reset() {
  tokens_.clear();
  index_.assign(sizes_.size(), {});
  starts_.assign(sizes_.size(), {});
  covered_ = 0;
}

void NgramDrafter::sync(const std::vector<int32_t>& h) {
  size_t m = tokens_.size();
  if (h.size() < m || !std::equal(tokens_.begin(), tokens_.end(), h.begin())) {
    reset();
    m = 0;
  }
  tokens_.insert(tokens_.end(), h.begin() + long(m), h.end());
}

void NgramDrafter::extend_index(size_t end) {
  for (size_t stop = covered_ + 1; stop <= end; ++stop)
    for (size_t si = 0; si < sizes_.size(); ++si) {
      size_t n = size_t(sizes_[si]);
      if (stop >= n) {
        std::string gram(reinterpret_cast<const char*>(tokens_.data() + stop - n), n * sizeof(int32_t));
        index_[si][gram] = stop - n;
        auto& starts = starts_[si][gram];  // tree proposals: the latest kMatchesKept starts
        starts.push_back(stop - n);
        if (starts.size() > kMatchesKept) starts.erase(starts.begin());
      }
    }
  covered_ = std::max(covered_, end);
}

std::vector<int32_t> NgramDrafter::propose(const std::vector<int32_t>& history, int k) {
  sync(history);
  size_t len = tokens_.size();
  if (k <= 0 || len < 2) return {};
  extend_index(len - 1);
  for (size_t si = 0; si < sizes_.size(); ++si) {
    size_t n = size_t(sizes_[si]);
    if (len <= n) continue;
    auto it =
        index_[si].find(std::string(reinterpret_cast<const char*>(tokens_.data() + len - n), n * sizeof(int32_t)));
    if (it != index_[si].end()) {
      size_t from = it->second + n, to = std::min(from + size_t(k), len);
      return std::vector<int32_t>(tokens_.begin() + long(from), tokens_.begin() + long(to));
    }
  }
  return {};
}

// An n-gram lookup is deterministic: its tokens are point masses for verify_sampling, so no
// [k, V] one-hot rows are built.
Proposal NgramDrafter::propose(const std::vector<int32_t>& history, int k, const SamplingParams&, Rng&) {
  Proposal out{propose(history, k)};
  auto& d = out.tokens;
  d.erase(std::remove_if(d.begin(), d.end(), [&](int32_t t) { return t < 0 || t >= vocab_; }), d.end());
  return out;
}

std::optional<Tree> NgramDrafter::propose_tree(const std::vector<int32_t>& history, int k, int nodes,
                                               const SamplingParams&, Rng&, int depth) {
  return propose_tree(history, k, nodes, depth, vocab_);
}

std::vector<std::pair<int32_t, int>> NgramDrafter::followers(const std::vector<int32_t>& tail, size_t length,
                                                             int& total) const {
  total = 0;
  for (size_t si = 0; si < sizes_.size(); ++si) {
    size_t n = size_t(sizes_[si]);
    if (length <= n) continue;
    auto it = starts_[si].find(
        std::string(reinterpret_cast<const char*>(tail.data() + tail.size() - n), n * sizeof(int32_t)));
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

}  // namespace specedge
