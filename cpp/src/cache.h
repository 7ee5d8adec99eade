// Which tokens occupy a backend's cache slots (mirrors specedge/runtime/cache.py): the one owner
// of a cache's position, used for the target and for a model drafter's own cache.
#pragma once
#include <cstdint>
#include <vector>

#include "backend.h"

namespace specedge {

// Tokens a[a0:] and b[b0:] share at their start, at most `limit`.
int common_prefix(const std::vector<int32_t>& a, size_t a0, const std::vector<int32_t>& b, size_t b0, size_t limit);

class CacheTracker {
 public:
  CacheTracker(Backend* b, int chunk) : backend_(b), chunk_(chunk) {}
  int position() const { return int(tokens_.size()); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  void reset() {
    tokens_.clear();
    exact_ = 0;
  }
  void rollback(int position);
  // Keep the longest whole-chunk prefix shared with `prompt` (all of it but its last token when
  // keep_last): a chunk's slots are only reused when a prefill wrote them in that same chunking.
  int reuse(const std::vector<int32_t>& prompt, bool keep_last = true);
  const float* feed(const int32_t* ids, int n);          // one call: logits [n, V]
  const float* feed_chunked(const int32_t* ids, int n);  // last row's logits [V]
  // Record that slots [position, position + n) now hold `ids`, written by someone else (copied K/V).
  void adopt(const int32_t* ids, int n) { tokens_.insert(tokens_.end(), ids, ids + n); }
  Backend* backend() const { return backend_; }
  int chunk() const { return chunk_; }
  // Run single-token calls as two tokens (invariant.h), so a step rounds like a verification row.
  void set_invariant_steps(bool on) { invariant_ = on; }
  bool invariant_steps() const { return invariant_; }

 private:
  const float* call(const int32_t* ids, int n, int position);
  Backend* backend_;
  int chunk_;
  bool invariant_ = false;
  std::vector<int32_t> tokens_;
  int exact_ = 0;  // slots up to here were written by whole-chunk prefills (reusable as they are)
};

}  // namespace specedge
