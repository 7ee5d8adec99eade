#include "text.h"

#include <algorithm>

namespace specedge {

size_t stop_holdback(const std::string& text, const std::vector<std::string>& stops) {
  size_t best = 0;
  for (const auto& s : stops) {
    for (size_t n = std::min(s.size() - 1, text.size()); n > best; --n) {
      if (text.compare(text.size() - n, n, s, 0, n) == 0) {
        best = n;
        break;
      }
    }
  }
  return best;
}

size_t find_stop(const std::string& text, const std::vector<std::string>& stops, size_t start) {
  size_t best = std::string::npos;
  for (const auto& s : stops) {
    size_t from = start > s.size() ? start - s.size() : 0;
    size_t i = text.find(s, from);
    if (i != std::string::npos && (best == std::string::npos || i < best)) best = i;
  }
  return best;
}

bool TextStreamer::push(int32_t token) {
  size_t before = text.size();
  text += dec_.push(token);
  if (stops_.empty() || text.size() <= before) return false;
  size_t cut = find_stop(text, stops_, before);
  if (cut == std::string::npos) return false;
  text.resize(cut);
  return true;
}

std::string TextStreamer::release(bool final) {
  size_t hold = (!final && !stops_.empty()) ? stop_holdback(text, stops_) : 0;
  if (text.size() - hold <= shown_) return {};
  std::string piece = text.substr(shown_, text.size() - hold - shown_);
  shown_ = text.size() - hold;
  return piece;
}

bool TextStreamer::finish() {
  text += dec_.flush();
  if (stops_.empty()) return false;
  size_t cut = find_stop(text, stops_, 0);
  if (cut == std::string::npos) return false;
  text.resize(cut);
  return true;
}

std::string TextStreamer::rest() {
  std::string piece = text.size() > shown_ ? text.substr(shown_) : std::string();
  shown_ = text.size();
  return piece;
}

}  // namespace specedge
