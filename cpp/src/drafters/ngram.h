// Prompt lookup (mirrors specedge/runtime/drafters/ngram.py): propose what followed the latest
// earlier occurrence of the history's suffix; trees add the history's other continuations.
#pragma once
#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "drafters/base.h"

namespace specedge {

// Earlier occurrences of an n-gram remembered for tree proposals (ngram.py MATCHES_KEPT).
constexpr size_t kMatchesKept = 8;

class NgramDrafter : public Drafter {
 public:
  // `vocab`: ids the target may emit; proposals drop any at or above it.
  explicit NgramDrafter(std::vector<int> sizes = {3, 2, 1}, int vocab = INT_MAX);
  std::string kind() const override { return "ngram"; }
  void reset() override;
  void start(const std::vector<int32_t>&) override { reset(); }
  Proposal propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng) override;
  std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes, const SamplingParams& p,
                                   Rng& rng, int depth) override;
  // The lookup itself: up to k tokens that followed the latest match (any ids).
  std::vector<int32_t> propose(const std::vector<int32_t>& history, int k);
  // ngram.py NgramDrafter.propose_tree: the chain of k first, then the likeliest branches by the
  // history's own counts, best first, at most `nodes` nodes and `depth` deep, ids in [0, vocab);
  // nullopt when it makes no draft.
  std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes, int depth, int vocab);

 private:
  // What followed the latest kMatchesKept earlier occurrences of the context's longest matching
  // suffix, most frequent first, then most recent first; `total` the occurrences counted.
  std::vector<std::pair<int32_t, int>> followers(const std::vector<int32_t>& tail, size_t length, int& total) const;
  void sync(const std::vector<int32_t>& history);
  void extend_index(size_t end);
  std::vector<int> sizes_;
  int vocab_;
  std::vector<int32_t> tokens_;
  std::vector<std::unordered_map<std::string, size_t>> index_;
  std::vector<std::unordered_map<std::string, std::vector<size_t>>> starts_;  // latest kMatchesKept starts
  size_t covered_ = 0;
};

}  // namespace specedge
