#include "tokenizer.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "error.h"

using json = nlohmann::json;

namespace specedge {

// ============================================================================ unicode

namespace {
struct CodeRange {
  uint32_t lo, hi;
};
#include "unicode_tables.inc"

template <size_t N>
bool in_table(const CodeRange (&t)[N], uint32_t cp) {
  size_t lo = 0, hi = N;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (cp < t[mid].lo)
      hi = mid;
    else if (cp > t[mid].hi)
      lo = mid + 1;
    else
      return true;
  }
  return false;
}
}  // namespace

namespace unicode {
bool is_letter(uint32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_table(kLetters, cp);
}
bool is_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_table(kNumbers, cp);
}
bool is_whitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}
}  // namespace unicode

// ============================================================================ utf8

namespace utf8 {
void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

// Length of the valid sequence at s[i] (1..4), or 0 when ill-formed; `sub` gets the length of
// the maximal subpart of an ill-formed sequence (>= 1).
static size_t seq_len(const unsigned char* s, size_t n, size_t i, uint32_t* cp, size_t* sub) {
  unsigned char c = s[i];
  *sub = 1;
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  size_t len;
  uint32_t v;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    v = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    v = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    v = c & 0x07;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= n) return 0;
    unsigned char d = s[i + k];
    unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (d < l || d > h) return 0;
    v = (v << 6) | (d & 0x3F);
    *sub = k + 1;
  }
  *cp = v;
  return len;
}

bool decode(const std::string& s, std::vector<uint32_t>& out) {
  out.clear();
  const unsigned char* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    uint32_t cp;
    size_t sub;
    size_t len = seq_len(p, n, i, &cp, &sub);
    if (!len) return false;
    out.push_back(cp);
    i += len;
  }
  return true;
}

bool valid(const std::string& s) {
  std::vector<uint32_t> tmp;
  return decode(s, tmp);
}

std::string lossy(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  const unsigned char* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    uint32_t cp;
    size_t sub;
    size_t len = seq_len(p, n, i, &cp, &sub);
    if (len) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += sub;
    }
  }
  return out;
}
}  // namespace utf8

// ============================================================================ implementation

namespace {

const std::string kMetaspace = "\xE2\x96\x81";  // U+2581 ▁

// GPT-2 byte <-> unicode map used by ByteLevel.
struct ByteMap {
  std::string byte_to_str[256];
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      uint32_t cp = keep ? uint32_t(b) : uint32_t(256 + n++);
      utf8::append(byte_to_str[b], cp);
      cp_to_byte[cp] = uint8_t(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// The pre-tokenizer regexes we implement by hand (tokenizers' own, byte for byte).
const char* kGpt2Regex = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const char* kLlama3Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const char* kQwen2Regex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

enum class RegexKind { Gpt2, Llama3 };

using Cps = std::vector<uint32_t>;
using Spans = std::vector<std::pair<size_t, size_t>>;  // [begin, end) in code points

bool is_ws(uint32_t c) { return unicode::is_whitespace(c); }
bool is_l(uint32_t c) { return unicode::is_letter(c); }
bool is_n(uint32_t c) { return unicode::is_number(c); }
bool is_other(uint32_t c) { return !is_ws(c) && !is_l(c) && !is_n(c); }
uint32_t lower_ascii(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

// Length of a contraction ('s 't 're 've 'm 'll 'd) at i, or 0.
size_t contraction(const Cps& s, size_t i, bool icase) {
  if (s[i] != '\'' || i + 1 >= s.size()) return 0;
  auto at = [&](size_t k) { return icase ? lower_ascii(s[k]) : s[k]; };
  uint32_t a = at(i + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 < s.size()) {
    uint32_t b = at(i + 2);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  }
  return 0;
}

// One match of the pattern at position i (always matches: every alternative set covers any cp).
size_t match_at(const Cps& s, size_t i, RegexKind kind) {
  size_t n = s.size();
  auto run = [&](size_t j, bool (*pred)(uint32_t)) {
    while (j < n && pred(s[j])) ++j;
    return j;
  };
  if (kind == RegexKind::Gpt2) {
    if (size_t c = contraction(s, i, false)) return i + c;
    size_t j = (s[i] == ' ' && i + 1 < n) ? i + 1 : i;
    if (is_l(s[j])) return run(j, is_l);
    if (is_n(s[j])) return run(j, is_n);
    if (is_other(s[j])) return run(j, is_other);
  } else {
    if (size_t c = contraction(s, i, true)) return i + c;
    if (s[i] != '\r' && s[i] != '\n' && !is_l(s[i]) && !is_n(s[i]) && i + 1 < n && is_l(s[i + 1]))
      return run(i + 1, is_l);
    if (is_l(s[i])) return run(i, is_l);
    if (is_n(s[i])) {
      size_t j = i;
      while (j < n && j < i + 3 && is_n(s[j])) ++j;  // \p{N}{1,3}; Qwen2's \p{N} is handled by caller
      return j;
    }
    size_t j = (s[i] == ' ' && i + 1 < n && is_other(s[i + 1])) ? i + 1 : i;
    if (is_other(s[j])) {
      j = run(j, is_other);
      while (j < n && (s[j] == '\r' || s[j] == '\n')) ++j;
      return j;
    }
    // \s*[\r\n]+
    size_t end = run(i, is_ws);
    for (size_t k = end; k > i; --k)
      if (s[k - 1] == '\r' || s[k - 1] == '\n') return k;
  }
  // \s+(?!\S) | \s+
  size_t end = run(i, is_ws);
  if (end == i) return i + 1;  // unreachable: s[i] is L, N, other or whitespace
  if (end == n) return end;
  if (end - i >= 2) return end - 1;
  return end;
}

Spans regex_split(const Cps& s, RegexKind kind, int max_digits) {
  Spans out;
  size_t i = 0;
  while (i < s.size()) {
    size_t e = match_at(s, i, kind);
    if (kind == RegexKind::Llama3 && max_digits == 1 && is_n(s[i]) && e > i + 1) e = i + 1;
    out.emplace_back(i, e);
    i = e;
  }
  return out;
}

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& b) {
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  fail_bundle("the tokenizer uses an unsupported split behaviour '" + b + "'");
}

// Apply a split behaviour to (span, is_match) pieces covering a string; returns kept spans.
std::vector<std::pair<size_t, size_t>> apply_behavior(const std::vector<std::tuple<size_t, size_t, bool>>& m,
                                                      Behavior b) {
  std::vector<std::pair<size_t, size_t>> acc;
  switch (b) {
    case Behavior::Isolated:
      for (auto& [s, e, is] : m) acc.emplace_back(s, e);
      break;
    case Behavior::Removed:
      for (auto& [s, e, is] : m)
        if (!is) acc.emplace_back(s, e);
      break;
    case Behavior::MergedWithPrevious: {
      bool prev_match = false;
      for (auto& [s, e, is] : m) {
        if (is && !prev_match && !acc.empty())
          acc.back().second = e;
        else
          acc.emplace_back(s, e);
        prev_match = is;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool prev_match = false;
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        auto& [s, e, is] = *it;
        if (is && !prev_match && !acc.empty())
          acc.back().first = s;
        else
          acc.emplace_back(s, e);
        prev_match = is;
      }
      std::reverse(acc.begin(), acc.end());
      break;
    }
    case Behavior::Contiguous: {
      bool prev_match = false;
      for (auto& [s, e, is] : m) {
        if (is && prev_match && !acc.empty())
          acc.back().second = e;
        else
          acc.emplace_back(s, e);
        prev_match = is;
      }
      break;
    }
  }
  acc.erase(std::remove_if(acc.begin(), acc.end(), [](auto& p) { return p.first == p.second; }), acc.end());
  return acc;
}

// Pieces of `s` (bytes) split on every occurrence of `pat` with behaviour b.
std::vector<std::string> split_string(const std::string& s, const std::string& pat, Behavior b) {
  std::vector<std::tuple<size_t, size_t, bool>> m;
  if (pat.empty()) return {s};
  size_t i = 0;
  while (i <= s.size()) {
    size_t f = s.find(pat, i);
    if (f == std::string::npos) {
      if (i < s.size()) m.emplace_back(i, s.size(), false);
      break;
    }
    if (f > i) m.emplace_back(i, f, false);
    m.emplace_back(f, f + pat.size(), true);
    i = f + pat.size();
  }
  std::vector<std::string> out;
  for (auto& [a, e] : apply_behavior(m, b)) out.push_back(s.substr(a, e - a));
  return out;
}

struct Piece {
  std::string text;  // UTF-8
  bool at_start;     // begins at offset 0 of the input (Metaspace prepend_scheme "first")
};

// --------------------------------------------------------------------- normalizers

struct Normalizer {
  std::string type;
  std::string pattern, content;  // Replace / Prepend
  std::vector<Normalizer> seq;
  std::string apply(const std::string& s) const {
    if (type == "Sequence") {
      std::string r = s;
      for (const auto& n : seq) r = n.apply(r);
      return r;
    }
    if (type == "Replace") {
      if (pattern.empty()) return s;
      std::string r;
      size_t i = 0;
      while (true) {
        size_t f = s.find(pattern, i);
        if (f == std::string::npos) break;
        r.append(s, i, f - i);
        r += content;
        i = f + pattern.size();
      }
      r.append(s, i, std::string::npos);
      return r;
    }
    if (type == "Prepend") return s.empty() ? s : content + s;
    return s;  // NFC: identity (see docs/cpp.md)
  }
};

Normalizer parse_normalizer(const json& j) {
  Normalizer n;
  n.type = j.value("type", "");
  if (n.type == "Sequence") {
    for (const auto& x : j.at("normalizers")) n.seq.push_back(parse_normalizer(x));
  } else if (n.type == "Replace") {
    const json& p = j.at("pattern");
    if (!p.contains("String")) fail_bundle("the tokenizer's Replace normalizer uses a regex, which is not supported");
    n.pattern = p["String"].get<std::string>();
    n.content = j.at("content").get<std::string>();
  } else if (n.type == "Prepend") {
    n.content = j.at("prepend").get<std::string>();
  } else if (n.type == "NFC") {
    // Text from applications is NFC in practice; composing would need the Unicode tables.
  } else {
    fail_bundle("the tokenizer uses an unsupported normalizer '" + n.type + "'");
  }
  return n;
}

// --------------------------------------------------------------------- pre-tokenizers

struct PreTokenizer {
  std::string type;
  // ByteLevel
  bool add_prefix_space = false, use_regex = true;
  // Split
  std::string split_string_pat;
  bool split_regex = false;
  RegexKind regex_kind = RegexKind::Gpt2;
  int max_digits = 3;
  Behavior behavior = Behavior::Isolated;
  // Metaspace
  std::string replacement = kMetaspace, prepend_scheme = "always";
  bool meta_split = true;
  std::vector<PreTokenizer> seq;

  void apply(std::vector<Piece>& pieces) const {
    if (type == "Sequence") {
      for (const auto& p : seq) p.apply(pieces);
      return;
    }
    std::vector<Piece> out;
    for (auto& pc : pieces) {
      if (type == "ByteLevel") {
        std::string t = pc.text;
        if (add_prefix_space && (t.empty() || t[0] != ' ')) t = " " + t;
        std::vector<std::string> parts;
        if (use_regex)
          parts = regex_pieces(t, RegexKind::Gpt2, 3);
        else
          parts = {t};
        const ByteMap& bm = byte_map();
        bool first = true;
        for (auto& p : parts) {
          std::string mapped;
          for (unsigned char c : p) mapped += bm.byte_to_str[c];
          out.push_back({mapped, pc.at_start && first});
          first = false;
        }
      } else if (type == "Split") {
        std::vector<std::string> parts;
        if (split_regex) {
          // Regex alternatives cover every character: the matches are the pieces (Isolated);
          // other behaviours over a full cover reduce to the same pieces except Removed.
          if (behavior == Behavior::Removed) {
            // nothing remains between matches
          } else {
            parts = regex_pieces(pc.text, regex_kind, max_digits);
          }
        } else {
          parts = split_string(pc.text, split_string_pat, behavior);
        }
        bool first = true;
        for (auto& p : parts) {
          out.push_back({p, pc.at_start && first});
          first = false;
        }
      } else if (type == "Metaspace") {
        std::string t;
        for (char c : pc.text) {
          if (c == ' ')
            t += replacement;
          else
            t.push_back(c);
        }
        bool starts = t.compare(0, replacement.size(), replacement) == 0;
        if (prepend_scheme == "always" && !starts) t = replacement + t;
        if (prepend_scheme == "first" && !starts && pc.at_start) t = replacement + t;
        std::vector<std::string> parts =
            meta_split ? split_string(t, replacement, Behavior::MergedWithNext) : std::vector<std::string>{t};
        bool first = true;
        for (auto& p : parts) {
          out.push_back({p, pc.at_start && first});
          first = false;
        }
      } else if (type == "Digits") {
        std::vector<uint32_t> cps;
        utf8::decode(pc.text, cps);
        std::vector<std::tuple<size_t, size_t, bool>> m;
        for (size_t i = 0; i < cps.size();) {
          size_t j = i + 1;
          bool dig = cps[i] < 0x80 ? (cps[i] >= '0' && cps[i] <= '9') : unicode::is_number(cps[i]);
          if (!meta_split)  // individual_digits == false: runs of digits
            while (j < cps.size() &&
                   dig == (cps[j] < 0x80 ? (cps[j] >= '0' && cps[j] <= '9') : unicode::is_number(cps[j])) &&
                   (!dig || true))
              ++j;
          m.emplace_back(i, j, dig);
          i = j;
        }
        bool first = true;
        for (auto& [a, b] : apply_behavior(m, Behavior::Isolated)) {
          std::string s;
          for (size_t k = a; k < b; ++k) utf8::append(s, cps[k]);
          out.push_back({s, pc.at_start && first});
          first = false;
        }
      }
    }
    pieces.swap(out);
  }

  static std::vector<std::string> regex_pieces(const std::string& t, RegexKind kind, int max_digits) {
    std::vector<uint32_t> cps;
    utf8::decode(t, cps);
    std::vector<std::string> parts;
    for (auto& [a, b] : regex_split(cps, kind, max_digits)) {
      std::string s;
      for (size_t k = a; k < b; ++k) utf8::append(s, cps[k]);
      parts.push_back(std::move(s));
    }
    return parts;
  }
};

PreTokenizer parse_pretokenizer(const json& j) {
  PreTokenizer p;
  p.type = j.value("type", "");
  if (p.type == "Sequence") {
    for (const auto& x : j.at("pretokenizers")) p.seq.push_back(parse_pretokenizer(x));
  } else if (p.type == "ByteLevel") {
    p.add_prefix_space = j.value("add_prefix_space", false);
    p.use_regex = j.value("use_regex", true);
  } else if (p.type == "Split") {
    const json& pat = j.at("pattern");
    p.behavior = parse_behavior(j.value("behavior", "Isolated"));
    if (j.value("invert", false))
      fail_bundle("the tokenizer uses an inverted Split pre-tokenizer, which is not supported");
    if (pat.contains("String")) {
      p.split_string_pat = pat["String"].get<std::string>();
    } else if (pat.contains("Regex")) {
      std::string re = pat["Regex"].get<std::string>();
      p.split_regex = true;
      if (re == kGpt2Regex) {
        p.regex_kind = RegexKind::Gpt2;
      } else if (re == kLlama3Regex) {
        p.regex_kind = RegexKind::Llama3;
      } else if (re == kQwen2Regex) {
        p.regex_kind = RegexKind::Llama3;
        p.max_digits = 1;
      } else {
        fail_bundle("the tokenizer's Split pre-tokenizer uses a regex this reader does not implement");
      }
      if (p.behavior != Behavior::Isolated && p.behavior != Behavior::Removed)
        p.behavior = Behavior::Isolated;  // the known regexes cover the text: same pieces
    } else {
      fail_bundle("the tokenizer's Split pre-tokenizer has no pattern");
    }
  } else if (p.type == "Metaspace") {
    p.replacement = j.value("replacement", kMetaspace);
    if (j.contains("prepend_scheme") && j["prepend_scheme"].is_string())
      p.prepend_scheme = j["prepend_scheme"].get<std::string>();
    else if (j.contains("add_prefix_space"))
      p.prepend_scheme = j.value("add_prefix_space", true) ? "always" : "never";
    p.meta_split = j.value("split", true);
  } else if (p.type == "Digits") {
    p.meta_split = j.value("individual_digits", false);
  } else {
    fail_bundle("the tokenizer uses an unsupported pre-tokenizer '" + p.type + "'");
  }
  return p;
}

// --------------------------------------------------------------------- decoders

struct Decoder {
  std::string type;
  std::string pattern, content;                                     // Replace
  std::string strip_content;                                        // Strip
  int start = 0, stop = 0;                                          // Strip
  std::string replacement = kMetaspace, prepend_scheme = "always";  // Metaspace
  std::vector<Decoder> seq;

  void apply(std::vector<std::string>& toks) const {
    if (type == "Sequence") {
      for (const auto& d : seq) d.apply(toks);
    } else if (type == "ByteLevel") {
      const ByteMap& bm = byte_map();
      std::string bytes;
      std::vector<uint32_t> cps;
      for (const auto& t : toks) {
        std::string tb;
        bool ok = utf8::decode(t, cps);
        for (uint32_t c : cps) {
          auto it = bm.cp_to_byte.find(c);
          if (it == bm.cp_to_byte.end()) {
            ok = false;
            break;
          }
          tb.push_back(char(it->second));
        }
        bytes += ok ? tb : t;
      }
      toks = {utf8::lossy(bytes)};
    } else if (type == "Replace") {
      Normalizer n;
      n.type = "Replace";
      n.pattern = pattern;
      n.content = content;
      for (auto& t : toks) t = n.apply(t);
    } else if (type == "ByteFallback") {
      std::vector<std::string> out;
      std::string pending;
      size_t npending = 0;
      auto flush = [&]() {
        if (!npending) return;
        if (utf8::valid(pending))
          out.push_back(pending);
        else
          for (size_t i = 0; i < npending; ++i) out.push_back("\xEF\xBF\xBD");
        pending.clear();
        npending = 0;
      };
      for (auto& t : toks) {
        int byte = -1;
        if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit((unsigned char)t[3]) &&
            std::isxdigit((unsigned char)t[4]))
          byte = std::stoi(t.substr(3, 2), nullptr, 16);
        if (byte >= 0) {
          pending.push_back(char(byte));
          ++npending;
        } else {
          flush();
          out.push_back(t);
        }
      }
      flush();
      toks.swap(out);
    } else if (type == "Fuse") {
      std::string all;
      for (auto& t : toks) all += t;
      toks = {all};
    } else if (type == "Strip") {
      std::vector<uint32_t> cps, want;
      utf8::decode(strip_content, want);
      uint32_t c = want.empty() ? 0 : want[0];
      for (auto& t : toks) {
        utf8::decode(t, cps);
        size_t a = 0, b = cps.size();
        while (a < b && int(a) < start && cps[a] == c) ++a;
        size_t cut = 0;
        while (b > a && int(cut) < stop && cps[b - 1] == c) {
          --b;
          ++cut;
        }
        std::string s;
        for (size_t k = a; k < b; ++k) utf8::append(s, cps[k]);
        t = s;
      }
    } else if (type == "Metaspace") {
      for (size_t i = 0; i < toks.size(); ++i) {
        std::string out;
        const std::string& t = toks[i];
        for (size_t k = 0; k < t.size();) {
          if (!replacement.empty() && t.compare(k, replacement.size(), replacement) == 0) {
            if (!(i == 0 && prepend_scheme != "never")) out.push_back(' ');
            k += replacement.size();
          } else {
            out.push_back(t[k++]);
          }
        }
        toks[i] = out;
      }
    }
  }
};

Decoder parse_decoder(const json& j) {
  Decoder d;
  d.type = j.value("type", "");
  if (d.type == "Sequence") {
    for (const auto& x : j.at("decoders")) d.seq.push_back(parse_decoder(x));
  } else if (d.type == "Replace") {
    const json& p = j.at("pattern");
    if (!p.contains("String")) fail_bundle("the tokenizer's Replace decoder uses a regex, which is not supported");
    d.pattern = p["String"].get<std::string>();
    d.content = j.at("content").get<std::string>();
  } else if (d.type == "Strip") {
    d.strip_content = j.value("content", " ");
    d.start = j.value("start", 0);
    d.stop = j.value("stop", 0);
  } else if (d.type == "Metaspace") {
    d.replacement = j.value("replacement", kMetaspace);
    if (j.contains("prepend_scheme") && j["prepend_scheme"].is_string())
      d.prepend_scheme = j["prepend_scheme"].get<std::string>();
    else if (j.contains("add_prefix_space"))
      d.prepend_scheme = j.value("add_prefix_space", true) ? "always" : "never";
  } else if (d.type == "ByteLevel" || d.type == "ByteFallback" || d.type == "Fuse") {
  } else {
    fail_bundle("the tokenizer uses an unsupported decoder '" + d.type + "'");
  }
  return d;
}

struct AddedToken {
  std::string content;
  int32_t id;
  bool special, lstrip, rstrip, single_word, normalized;
};

struct TrieNode {
  std::map<unsigned char, int> next;
  int token = -1;  // index into added tokens
};

}  // namespace

struct Tokenizer::Impl {
  // model
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_tok;                                // model tokens by id (may have holes: empty)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, new id)
  std::optional<int32_t> unk_id;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  int32_t byte_ids[256];
  bool have_byte_ids = false;
  // pipeline
  std::optional<Normalizer> normalizer;
  std::optional<PreTokenizer> pre;
  std::optional<Decoder> decoder;
  // added tokens
  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  std::vector<TrieNode> trie_raw, trie_norm;  // non-normalized / normalized added tokens
  int64_t vocab_size = 0;

  void read_merges(const json& list);        // model.merges: ranks by position, first wins
  void read_added_tokens(const json& list);  // added_tokens, matched before the model (tries)
  static void trie_insert(std::vector<TrieNode>& trie, const std::string& s, int idx) {
    if (trie.empty()) trie.emplace_back();
    int node = 0;
    for (unsigned char c : s) {
      auto it = trie[node].next.find(c);
      if (it == trie[node].next.end()) {
        trie.emplace_back();
        int nn = int(trie.size()) - 1;
        trie[node].next[c] = nn;
        node = nn;
      } else {
        node = it->second;
      }
    }
    trie[node].token = idx;
  }

  // Segments of `s`: (text, added-token index or -1). Leftmost-longest matching.
  std::vector<std::pair<std::string, int>> split_added(const std::string& s, const std::vector<TrieNode>& trie) const {
    std::vector<std::pair<std::string, int>> out;
    if (trie.empty()) {
      out.emplace_back(s, -1);
      return out;
    }
    size_t seg = 0, i = 0;
    while (i < s.size()) {
      int node = 0, best = -1;
      size_t best_end = 0;
      for (size_t k = i; k < s.size(); ++k) {
        auto it = trie[node].next.find((unsigned char)s[k]);
        if (it == trie[node].next.end()) break;
        node = it->second;
        if (trie[node].token >= 0) {
          best = trie[node].token;
          best_end = k + 1;
        }
      }
      if (best >= 0) {
        const AddedToken& at = added[size_t(best)];
        size_t start = i, end = best_end;
        if (at.single_word) {
          auto word_char = [&](size_t pos_before, bool before) {
            // is the character adjacent (before start / at end) alphanumeric?
            std::vector<uint32_t> cps;
            if (before) {
              if (pos_before == 0) return false;
              size_t b = pos_before - 1;
              while (b > 0 && (((unsigned char)s[b]) & 0xC0) == 0x80) --b;
              utf8::decode(s.substr(b, pos_before - b), cps);
            } else {
              if (pos_before >= s.size()) return false;
              size_t e = pos_before + 1;
              while (e < s.size() && (((unsigned char)s[e]) & 0xC0) == 0x80) ++e;
              utf8::decode(s.substr(pos_before, e - pos_before), cps);
            }
            return !cps.empty() && (unicode::is_letter(cps[0]) || unicode::is_number(cps[0]) || cps[0] == '_');
          };
          if (word_char(start, true) || word_char(end, false)) {
            ++i;
            continue;
          }
        }
        if (at.lstrip)
          while (start > seg && std::isspace((unsigned char)s[start - 1])) --start;
        if (at.rstrip)
          while (end < s.size() && std::isspace((unsigned char)s[end])) ++end;
        if (start > seg) out.emplace_back(s.substr(seg, start - seg), -1);
        out.emplace_back(s.substr(start, end - start), best);
        seg = i = end;
      } else {
        ++i;
      }
    }
    if (seg < s.size()) out.emplace_back(s.substr(seg), -1);
    return out;
  }

  void bpe(const std::string& word, std::vector<int32_t>& out) const {
    if (ignore_merges) {
      auto it = vocab.find(word);
      if (it != vocab.end()) {
        out.push_back(it->second);
        return;
      }
    }
    struct Sym {
      int32_t id;
      int prev, next;
      bool alive;
    };
    std::vector<Sym> syms;
    int32_t pending_unk = -1;  // an unknown-character run not yet added
    auto add = [&](int32_t id) {
      int idx = int(syms.size());
      syms.push_back({id, idx - 1, -1, true});
      if (idx > 0) syms[size_t(idx) - 1].next = idx;
    };
    size_t i = 0;
    while (i < word.size()) {
      size_t len = 1;
      unsigned char c = (unsigned char)word[i];
      if (c >= 0xF0)
        len = 4;
      else if (c >= 0xE0)
        len = 3;
      else if (c >= 0xC0)
        len = 2;
      len = std::min(len, word.size() - i);
      std::string ch = word.substr(i, len);
      i += len;
      auto it = vocab.find(ch);
      if (it != vocab.end()) {
        if (pending_unk >= 0) {
          add(pending_unk);
          pending_unk = -1;
        }
        add(it->second);
        continue;
      }
      if (byte_fallback && have_byte_ids) {
        for (unsigned char b : ch) add(byte_ids[b]);
        continue;
      }
      if (unk_id) {
        if (pending_unk >= 0 && fuse_unk) {
          // extend the pending unk
        } else {
          if (pending_unk >= 0) add(pending_unk);
          pending_unk = *unk_id;
        }
      }
    }
    if (pending_unk >= 0) add(pending_unk);

    struct Merge {
      int32_t rank;
      int pos;
      int32_t new_id;
      bool operator<(const Merge& o) const {  // priority_queue: top = smallest rank, then pos
        if (rank != o.rank) return rank > o.rank;
        return pos > o.pos;
      }
    };
    auto key = [](int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); };
    std::priority_queue<Merge> q;
    for (size_t k = 0; k + 1 < syms.size(); ++k) {
      auto it = merges.find(key(syms[k].id, syms[k + 1].id));
      if (it != merges.end()) q.push({it->second.first, int(k), it->second.second});
    }
    while (!q.empty()) {
      Merge top = q.top();
      q.pop();
      Sym& cur = syms[size_t(top.pos)];
      if (!cur.alive || cur.next < 0) continue;
      Sym right = syms[size_t(cur.next)];
      auto it = merges.find(key(cur.id, right.id));
      if (it == merges.end() || it->second.second != top.new_id) continue;
      cur.id = top.new_id;
      syms[size_t(cur.next)].alive = false;
      cur.next = right.next;
      if (right.next >= 0) syms[size_t(right.next)].prev = top.pos;
      if (cur.prev >= 0) {
        auto m = merges.find(key(syms[size_t(cur.prev)].id, cur.id));
        if (m != merges.end()) q.push({m->second.first, cur.prev, m->second.second});
      }
      if (cur.next >= 0) {
        auto m = merges.find(key(cur.id, syms[size_t(cur.next)].id));
        if (m != merges.end()) q.push({m->second.first, top.pos, m->second.second});
      }
    }
    for (const auto& s : syms)
      if (s.alive) out.push_back(s.id);
  }

  void encode_segment(const std::string& seg, bool at_start, std::vector<int32_t>& out) const {
    std::string norm = normalizer ? normalizer->apply(seg) : seg;
    // normalized added tokens are found after normalization
    for (auto& [text, idx] : split_added(norm, trie_norm)) {
      if (idx >= 0) {
        out.push_back(added[size_t(idx)].id);
        at_start = false;
        continue;
      }
      std::vector<Piece> pieces{{text, at_start}};
      at_start = false;
      if (pre) pre->apply(pieces);
      for (const auto& p : pieces)
        if (!p.text.empty()) bpe(p.text, out);
    }
  }
};

Tokenizer::Tokenizer() : impl_(new Impl) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_bundle("cannot read the bundle's tokenizer.json ('" + path + "')");
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json(ss.str());
}

void Tokenizer::Impl::read_merges(const json& list) {
  int32_t rank = 0;
  for (const json& mg : list) {
    std::string a, b;
    if (mg.is_string()) {
      std::string s = mg.get<std::string>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail_bundle("the tokenizer has a malformed merge '" + s + "'");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (mg.is_array() && mg.size() == 2) {
      a = mg[0].get<std::string>();
      b = mg[1].get<std::string>();
    } else {
      fail_bundle("the tokenizer has a malformed merge");
    }
    auto ia = vocab.find(a), ib = vocab.find(b), ic = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || ic == vocab.end())
      fail_bundle("the tokenizer has a merge of tokens missing from its vocabulary ('" + a + "' '" + b + "')");
    uint64_t key = (uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second);
    merges.emplace(key, std::make_pair(rank, ic->second));  // first (lowest rank) wins
    ++rank;
  }
}

void Tokenizer::Impl::read_added_tokens(const json& list) {
  for (const json& a : list) {
    AddedToken at{a.at("content").get<std::string>(),
                  int32_t(a.at("id").get<int64_t>()),
                  a.value("special", false),
                  a.value("lstrip", false),
                  a.value("rstrip", false),
                  a.value("single_word", false),
                  a.value("normalized", !a.value("special", false))};
    if (at.id < 0 || at.id >= 50000000) fail_bundle("the tokenizer has an added token with an invalid id");
    if (at.content.empty()) continue;
    size_t idx = added.size();
    added.push_back(at);
    added_by_id[at.id] = idx;
    vocab_size = std::max<int64_t>(vocab_size, int64_t(at.id) + 1);
  }
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& at = added[i];
    // tokenizers: special tokens are never normalized
    if (at.normalized && !at.special)
      trie_insert(trie_norm, normalizer ? normalizer->apply(at.content) : at.content, int(i));
    else
      trie_insert(trie_raw, at.content, int(i));
  }
}

Tokenizer Tokenizer::from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    fail_bundle("the bundle's tokenizer.json is not valid JSON (at byte " + std::to_string(e.byte) + ")");
  }
  Tokenizer t;
  Impl& m = *t.impl_;
  try {
    if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
      fail_bundle("the bundle's tokenizer.json has no model");
    const json& model = j["model"];
    std::string type = model.value("type", "BPE");
    if (type != "BPE") fail_bundle("the tokenizer's model type '" + type + "' is not supported (only BPE)");
    if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
      fail_bundle("the tokenizer uses BPE dropout, which is not supported");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(k) && model[k].is_string() && !model[k].get<std::string>().empty())
        fail_bundle(std::string("the tokenizer's BPE uses ") + k + ", which is not supported");
    m.byte_fallback = model.value("byte_fallback", false);
    m.fuse_unk = model.value("fuse_unk", false);
    m.ignore_merges = model.value("ignore_merges", false);
    int64_t max_id = -1;
    for (auto it = model.at("vocab").begin(); it != model.at("vocab").end(); ++it) {
      int64_t id = it.value().get<int64_t>();
      if (id < 0 || id >= (int64_t(1) << 31)) fail_bundle("the tokenizer's vocabulary has an invalid id");
      m.vocab[it.key()] = int32_t(id);
      max_id = std::max(max_id, id);
    }
    if (max_id >= 50000000) fail_bundle("the tokenizer's vocabulary ids are too large");
    m.id_to_tok.assign(size_t(max_id + 1), std::string());
    for (auto& kv : m.vocab) m.id_to_tok[size_t(kv.second)] = kv.first;
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      auto it = m.vocab.find(model["unk_token"].get<std::string>());
      if (it != m.vocab.end()) m.unk_id = it->second;
    }
    m.have_byte_ids = true;
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      auto it = m.vocab.find(name);
      if (it == m.vocab.end()) {
        m.have_byte_ids = false;
        break;
      }
      m.byte_ids[b] = it->second;
    }
    m.read_merges(model.at("merges"));
    if (j.contains("normalizer") && !j["normalizer"].is_null()) m.normalizer = parse_normalizer(j["normalizer"]);
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) m.pre = parse_pretokenizer(j["pre_tokenizer"]);
    if (j.contains("decoder") && !j["decoder"].is_null()) m.decoder = parse_decoder(j["decoder"]);
    m.vocab_size = max_id + 1;
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) m.read_added_tokens(j["added_tokens"]);
  } catch (const json::exception& e) {
    fail_bundle(std::string("the bundle's tokenizer.json is malformed: ") + e.what());
  }
  return t;
}

std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
  if (!utf8::valid(text)) fail_arg("the text is not valid UTF-8");
  std::vector<int32_t> out;
  bool at_start = true;
  for (auto& [seg, idx] : impl_->split_added(text, impl_->trie_raw)) {
    if (idx >= 0)
      out.push_back(impl_->added[size_t(idx)].id);
    else
      impl_->encode_segment(seg, at_start, out);
    at_start = false;
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int32_t id : ids) {
    auto it = impl_->added_by_id.find(id);
    if (it != impl_->added_by_id.end()) {
      const AddedToken& at = impl_->added[it->second];
      if (skip_special && at.special) continue;
      toks.push_back(at.content);
      continue;
    }
    if (id < 0 || size_t(id) >= impl_->id_to_tok.size() || impl_->id_to_tok[size_t(id)].empty()) continue;
    toks.push_back(impl_->id_to_tok[size_t(id)]);
  }
  if (impl_->decoder) {
    impl_->decoder->apply(toks);
    std::string out;
    for (auto& t : toks) out += t;
    return out;
  }
  std::string out;
  for (size_t i = 0; i < toks.size(); ++i) out += (i ? " " : "") + toks[i];
  return out;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(const std::string& token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
  auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  if (it != impl_->added_by_id.end()) return impl_->added[it->second].content;
  if (id < 0 || size_t(id) >= impl_->id_to_tok.size() || impl_->id_to_tok[size_t(id)].empty()) return std::nullopt;
  return impl_->id_to_tok[size_t(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

// ============================================================================ streaming

static bool ends_with_replacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

std::string IncrementalDecoder::push(int32_t id) {
  ids_.push_back(id);
  std::vector<int32_t> head(ids_.begin() + long(prefix_), ids_.begin() + long(read_));
  std::vector<int32_t> window(ids_.begin() + long(prefix_), ids_.end());
  std::string h = tok_->decode(head), t = tok_->decode(window);
  if (t.size() > h.size() && !ends_with_replacement(t)) {
    std::string piece = t.substr(h.size());
    prefix_ = read_;
    read_ = ids_.size();
    return piece;
  }
  return "";
}

std::string IncrementalDecoder::flush() {
  std::vector<int32_t> head(ids_.begin() + long(prefix_), ids_.begin() + long(read_));
  std::vector<int32_t> window(ids_.begin() + long(prefix_), ids_.end());
  std::string h = tok_->decode(head), t = tok_->decode(window);
  prefix_ = read_ = ids_.size();
  return t.size() > h.size() ? t.substr(h.size()) : "";
}

}  // namespace specedge
