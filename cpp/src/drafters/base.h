// The drafter role (mirrors specedge/runtime/drafters/base.py): what the generation loop asks of
// anything that proposes tokens. The model (model.h), n-gram (ngram.h) and head (head.h) drafters
// implement it; the loop never asks which one it has.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sampling.h"
#include "tree.h"

namespace specedge {

// Drafted tokens, and their q rows [tokens, vocab] when they were sampled. nullptr: each token a
// point mass, exact for any deterministic choice (a greedy draft, a prompt lookup). The rows
// belong to the drafter and stay valid until its next proposal.
struct Proposal {
  std::vector<int32_t> tokens;
  const std::vector<double>* q = nullptr;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string kind() const = 0;  // "model", "ngram", "head": the stats' drafter
  // Forget every cached state (after a warm-up wrote into the caches).
  virtual void reset() {}
  // A request begins with `prompt`; called after the target's first token.
  virtual void start(const std::vector<int32_t>& prompt) {}
  // Up to k tokens after `history` (the committed sequence); fewer, or none, is allowed.
  virtual Proposal propose(const std::vector<int32_t>& history, int k, const SamplingParams& p, Rng& rng) = 0;
  // A tree of at most `nodes` nodes whose root is history's last token, at most `depth` (>= k)
  // deep where the drafter's levels cost nothing, else k; nullopt when this drafter makes no tree
  // here (the round then verifies propose's chain).
  virtual std::optional<Tree> propose_tree(const std::vector<int32_t>& history, int k, int nodes,
                                           const SamplingParams& p, Rng& rng, int depth) {
    return std::nullopt;
  }
  // What the target kept of the last proposal: `accepted` of `drafted` drafts, the tokens now
  // committed being `history`. The built-in drafters resynchronise from the history they are
  // given, so they ignore it; a drafter that learns from its acceptances overrides it.
  virtual void observe(const std::vector<int32_t>& history, int drafted, int accepted) {}
  virtual int64_t calls() const { return 0; }   // backend calls made while proposing (stats)
  virtual int64_t copied() const { return 0; }  // cache slots taken from the target's K/V (stats)
};

}  // namespace specedge
