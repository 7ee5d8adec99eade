// One step of decoding, as functions that return what they did (mirrors
// specedge/runtime/rounds.py and tree_round.py). Each leaves the target's cache holding every
// committed token but the last, which the next step feeds.
#pragma once
#include <cstdint>
#include <vector>

#include "cache.h"
#include "drafters/base.h"
#include "sampling.h"

namespace specedge {

// The target's cache and how to read its next-token choices. vocab: ids that may be generated
// (the logits may have padding rows beyond).
struct TargetView {
  CacheTracker* cache;
  int vocab;
  std::vector<double> p_row;                                          // scratch for sampling a row
  int32_t pick(const float* row, const SamplingParams& p, Rng& rng);  // argmax, or a sample
};

// What one step did: the tokens to commit (at least one), the drafts the target verified (0: a
// target-only step), the seconds spent drafting and in the target, and the k asked for. A tree
// round also gives its call's tokens (root included), its depth and the drafts its first line
// alone would have kept; -1 for a chain (drafted + 1, drafted, none).
struct Round {
  std::vector<int32_t> tokens;
  int drafted = 0;
  double draft_s = 0, verify_s = 0;
  int k = 0, call = -1, depth = -1, chain_accepted = -1;
  int accepted() const { return drafted ? int(tokens.size()) - 1 : 0; }
};

double now();  // seconds on a monotonic clock

// Target-only decoding: feed the pending token, pick the next one.
Round target_step(TargetView& target, const std::vector<int32_t>& tokens, const SamplingParams& p, Rng& rng);
// Draft up to k tokens after `tokens` (the committed sequence), verify them in one target call,
// keep the accepted prefix plus one target token, roll the target back to what was kept. A
// drafter that proposes nothing makes this a target step.
Round speculative_round(TargetView& target, Drafter& drafter, const std::vector<int32_t>& tokens, int k,
                        const SamplingParams& p, Rng& rng);
// tree_round.cpp: like speculative_round with a tree of at most `nodes` nodes, at most `depth`
// (>= k) deep, verified in one masked call; the accepted path's K/V move into contiguous slots.
// A drafter that makes no tree gets the chain round.
Round tree_round(TargetView& target, Drafter& drafter, const std::vector<int32_t>& tokens, int k, int nodes,
                 const SamplingParams& p, Rng& rng, int depth);

}  // namespace specedge
