// The head drafter (mirrors specedge/runtime/drafters/head.py): a trained draft head (`specedge
// train-draft`, models.head of the bundle) chains k drafts from the target's features.
//
// Slot j of the head's cache pairs the target's features of committed token j with the embedding
// of token j + 1, so after a verification that committed history[:n] (the target has run every
// token but the last) the head can hold slots 0..n-2. Each proposal:
//  1. catch up: feed the slots from the first one whose token changed to n - 2, in prefill chunks,
//     from the target backend's feature rows; the last fed row's output gives the first draft;
//  2. chain: each further draft is one T = 1 call at the next slot over the head's own hidden
//     state of the step before (zeros for the features input);
//  3. map every draft id to the target's id (the draft vocabulary's d2t map); sampled drafts carry
//     their q rows spread over the target vocabulary (zero outside the map).
// Drafts are only proposals: nothing here can change the tokens the target emits.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "drafters/base.h"
#include "manifest.h"

namespace specedge {

class CacheTracker;
class OrtBackend;

// The head's draft->target id map from its file in the bundle (drafters/head.py read_draft_vocab):
// head.vocab_size distinct ids of the target vocabulary, else SPECEDGE_ERR_BUNDLE.
std::vector<int32_t> read_draft_vocab(const Manifest& m);

class HeadDrafter : public Drafter {
 public:
  // `head`: the head's backend; `target`: the target's cache, whose backend keeps features
  // (OrtBackend::keep_features); `vocab`: the target vocabulary q rows cover.
  HeadDrafter(OrtBackend* head, const CacheTracker* target, std::vector<int32_t> d2t, int vocab, int chunk);
  std::string kind() const override { return "head"; }
  void reset() override { fed_.clear(); }
  void start(const std::vector<int32_t>& /*prompt*/) override { fed_.clear(); }
  int64_t calls() const override { return calls_; }
  Proposal propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng) override;
  // The head stays at depth k whatever `depth` allows: a level deeper is one more of its calls.
  std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes, const SamplingParams& p,
                                   Rng& rng, int depth) override {
    return propose_tree(history, k, nodes, p, rng);
  }
  const std::vector<int32_t>& d2t() const { return d2t_; }
  // Tokens (target ids), and their q rows [k, vocab] when sampling.
  std::vector<int32_t> propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng,
                               std::vector<double>* q);
  // A tree of at most `nodes` nodes (drafters/head.py propose_tree): the head's chain of k drafts
  // (greedy, or sampled with its q rows as propose draws it) plus its runner-up tokens, mapped
  // through d2t, as ranked point-mass leaf siblings (chain_tree, the same tree, order and tie rule
  // as Python's). nullopt (the round drafts a chain) when k < 1, nodes < 2, no target features yet
  // or no head slots left.
  std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes, const SamplingParams& p,
                                   Rng& rng);

 private:
  const float* catch_up(const std::vector<int32_t>& history);
  OrtBackend* head_;
  const CacheTracker* target_;
  std::vector<int32_t> d2t_;
  int vocab_, chunk_, vd_;
  std::vector<int32_t> fed_;   // fed_[j]: the token (history[j + 1]) whose embedding head slot j holds
  std::vector<float> hidden_;  // the last step's hidden_out row [hidden_size]
  int64_t calls_ = 0;
  std::vector<double> q_;
};

}  // namespace specedge
