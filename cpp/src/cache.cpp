#include "cache.h"

#include <algorithm>

#include "error.h"

namespace specedge {

int common_prefix(const std::vector<int32_t>& a, size_t a0, const std::vector<int32_t>& b, size_t b0, size_t limit) {
  size_t n = 0;
  while (a0 + n < a.size() && b0 + n < b.size() && n < limit && a[a0 + n] == b[b0 + n]) ++n;
  return int(n);
}

void CacheTracker::rollback(int position) {
  if (position < int(tokens_.size())) tokens_.resize(size_t(std::max(position, 0)));
  exact_ = std::min(exact_, position);
}

int CacheTracker::reuse(const std::vector<int32_t>& prompt, bool keep_last) {
  int limit = std::min(exact_, keep_last ? int(prompt.size()) - 1 : int(prompt.size()));
  int n = common_prefix(tokens_, 0, prompt, 0, size_t(std::max(limit, 0)));
  n = (n / chunk_) * chunk_;
  rollback(n);
  return n;
}

// ONNX Runtime rounds a T = 1 call differently from a row of a T >= 2 call, which on quantized
// targets changes greedy picks; T = 2 with a padding token (masked, then overwritten by the next
// call) gives row 0 a verification row's bits. The last slot has no room: both modes call T = 1 there.
const float* CacheTracker::call(const int32_t* ids, int n, int position) {
  if (invariant_ && n == 1 && position + 2 <= backend_->max_seq()) {
    const int32_t two[2] = {ids[0], 0};
    return backend_->run(two, 2, position);
  }
  return backend_->run(ids, n, position);
}

const float* CacheTracker::feed(const int32_t* ids, int n) {
  const float* logits = call(ids, n, position());
  tokens_.insert(tokens_.end(), ids, ids + n);
  return logits;
}

const float* CacheTracker::feed_chunked(const int32_t* ids, int n) {
  if (n < 1) fail_arg("nothing to feed");
  int start = position();
  bool aligned = start == exact_ && start % chunk_ == 0;
  const float* logits = nullptr;
  int last = 0;
  for (int s = 0; s < n; s += chunk_) {
    last = std::min(chunk_, n - s);
    logits = call(ids + s, last, start + s);
  }
  tokens_.insert(tokens_.end(), ids, ids + n);
  if (aligned) exact_ = start + (n / chunk_) * chunk_;
  return logits + size_t(last - 1) * size_t(backend_->vocab_size());
}

}  // namespace specedge
