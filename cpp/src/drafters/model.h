// The draft model (mirrors specedge/runtime/drafters/model.py): one T = 1 call per proposed
// token, its cache synced to the committed sequence before each proposal.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "cache.h"
#include "drafters/base.h"

namespace specedge {

class ModelDrafter : public Drafter {
 public:
  ModelDrafter(Backend* b, int chunk, int vocab) : cache_(b, chunk), vocab_(vocab) {}
  std::string kind() const override { return "model"; }
  void reset() override {
    cache_.reset();
    base_ = 0;
  }
  void start(const std::vector<int32_t>& prompt) override { base_ = cache_.reuse(prompt, false); }
  // The target's cache, for a self-draft (same architecture and cache geometry): committed tokens
  // the target has already run are copied from its K/V instead of fed (drafts are proposals only).
  void set_kv_donor(const CacheTracker* target) { donor_ = target; }
  int64_t copied() const override { return copied_; }
  int64_t calls() const override { return calls_; }
  Proposal propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng) override;
  // The model stays at depth k whatever `depth` allows: a level deeper is one more of its calls.
  std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes, const SamplingParams& p,
                                   Rng& rng, int depth) override {
    return propose_tree(history, k, nodes, p, rng);
  }
  // Tokens, and their q rows [k, vocab] in *q when sampling (q may be nullptr when greedy).
  std::vector<int32_t> propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng,
                               std::vector<double>* q);
  // The chain of k drafts propose would make (greedy, or sampled with its q rows) plus ranked
  // runner-up siblings, at most `nodes` nodes (model.py propose_tree); nullopt when k < 1 or nodes < 2.
  std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes, const SamplingParams& p,
                                   Rng& rng);

 private:
  int sync(const std::vector<int32_t>& history);  // roll back to the common prefix; tokens kept
  CacheTracker cache_;
  int vocab_;
  int base_ = 0;
  const CacheTracker* donor_ = nullptr;
  int64_t copied_ = 0, calls_ = 0;
  std::vector<double> q_;
};

}  // namespace specedge
