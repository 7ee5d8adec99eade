// A request's text (mirrors specedge/runtime/text.py): committed tokens become text, stop strings
// cut it, and streaming releases only what no stop string could still claim.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer.h"

namespace specedge {

// Length of the longest suffix of `text` that is a proper prefix of a stop string.
size_t stop_holdback(const std::string& text, const std::vector<std::string>& stops);
// Earliest stop string in text (searching from `start`), or npos.
size_t find_stop(const std::string& text, const std::vector<std::string>& stops, size_t start);

class TextStreamer {
 public:
  TextStreamer(const Tokenizer* tok, std::vector<std::string> stops) : dec_(tok), stops_(std::move(stops)) {}
  // Append one committed token; true when its text completed a stop string (the text is then cut
  // before it).
  bool push(int32_t token);
  // New text that is safe to show; `final` (no more tokens will come): all of it.
  std::string release(bool final);
  // The request ended: decode what is left and look for a stop string in the whole text once
  // more; true when one was found now.
  bool finish();
  std::string rest();  // what is still unshown
  std::string text;    // decoded so far, cut before a stop string once one is found

 private:
  IncrementalDecoder dec_;
  std::vector<std::string> stops_;
  size_t shown_ = 0;
};

}  // namespace specedge
