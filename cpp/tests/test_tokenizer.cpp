// Unit tests of the tokenizer on small hand-written tokenizer.json files (the parity with the
// Python `tokenizers` library on real tokenizers is tests/test_cpp.py).
#include <nlohmann/json.hpp>

#include "catch.h"
#include "error.h"
#include "tokenizer.h"

using namespace specedge;
using json = nlohmann::json;

namespace {
// A byte-level BPE over "hello world" with a few merges and two special tokens.
json byte_level() {
  json vocab = json::object();
  int id = 0;
  for (const char* t :
       {"h",     "e",           "l",   "o",     "w",         "r",           "d",  "\xC4\xA0",      "!",
        "he",    "ll",          "llo", "hello", "\xC4\xA0w", "\xC4\xA0wor", "or", "\xC4\xA0world", "<|s|>",
        "<|e|>", "\xC4\xA0worl"})
    vocab[t] = id++;
  return {
      {"version", "1.0"},
      {"added_tokens",
       {{{"id", 17}, {"content", "<|s|>"}, {"special", true}, {"normalized", false}},
        {{"id", 18}, {"content", "<|e|>"}, {"special", true}, {"normalized", false}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges",
         {"h e", "l l", "ll o", "he llo", "\xC4\xA0 w", "o r", "\xC4\xA0w or", "\xC4\xA0wor l", "\xC4\xA0worl d"}}}}};
}

// SentencePiece-style: metaspace, byte fallback.
json metaspace() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  int id = 259;
  for (const char* t : {"\xE2\x96\x81", "a", "b",
                        "\xE2\x96\x81"
                        "a",
                        "\xE2\x96\x81"
                        "ab",
                        "ab"})
    vocab[t] = id++;
  return {{"added_tokens",
           {{{"id", 0}, {"content", "<unk>"}, {"special", true}},
            {{"id", 1}, {"content", "<s>"}, {"special", true}},
            {{"id", 2}, {"content", "</s>"}, {"special", true}}}},
          {"pre_tokenizer",
           {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "always"}, {"split", true}}},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders",
             {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
              {{"type", "ByteFallback"}},
              {{"type", "Fuse"}},
              {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"model",
           {{"type", "BPE"},
            {"vocab", vocab},
            {"byte_fallback", true},
            {"unk_token", "<unk>"},
            {"merges", json::array({json::array({"\xE2\x96\x81", "a"}), json::array({"a", "b"}),
                                    json::array({"\xE2\x96\x81"
                                                 "a",
                                                 "b"})})}}}};
}
}  // namespace

TEST_CASE("byte-level BPE: merges by rank, added tokens, decoding") {
  Tokenizer t = Tokenizer::from_json(byte_level().dump());
  CHECK(t.encode("hello world") == std::vector<int32_t>{12, 16});
  CHECK(t.encode("hello") == std::vector<int32_t>{12});
  CHECK(t.encode("<|s|>hello<|e|>") == std::vector<int32_t>{17, 12, 18});
  CHECK(t.encode("hello world!") == std::vector<int32_t>{12, 16, 8});
  CHECK(t.decode({12, 16}) == "hello world");
  CHECK(t.decode({17, 12, 18}) == "hello");  // special tokens skipped
  CHECK(t.decode({17, 12, 18}, false) == "<|s|>hello<|e|>");
  CHECK(t.decode({12, 9999, -1}) == "hello");  // unknown ids are dropped
  CHECK(t.vocab_size() == 20);
  CHECK(t.is_special(17));
  CHECK(!t.is_special(12));
  CHECK(t.token_to_id("hello").value() == 12);
  CHECK(!t.token_to_id("nope").has_value());
  CHECK_THROWS_AS(t.encode("\xFF"), Error);  // invalid UTF-8
}

TEST_CASE("metaspace BPE with byte fallback") {
  Tokenizer t = Tokenizer::from_json(metaspace().dump());
  // "ab a" -> "▁ab", "▁a"
  CHECK(t.encode("ab a") == std::vector<int32_t>{263, 262});
  // 'c' is not in the vocabulary: bytes <0x63>
  CHECK(t.encode("c") == std::vector<int32_t>{259, 3 + 0x63});
  CHECK(t.decode({263, 262}) == "ab a");
  // é = C3 A9 as byte tokens; an incomplete sequence decodes to U+FFFD per byte
  CHECK(t.decode({259, 3 + 0xC3, 3 + 0xA9}) == "\xC3\xA9");
  CHECK(t.decode({259, 3 + 0xC3}) == "\xEF\xBF\xBD");
  CHECK(t.encode("<s>a") == std::vector<int32_t>{1, 262});
}

TEST_CASE("streaming decoder emits complete characters only") {
  Tokenizer t = Tokenizer::from_json(metaspace().dump());
  IncrementalDecoder d(&t);
  std::string all;
  all += d.push(263);  // "ab" (leading space stripped)
  CHECK(all == "ab");
  all += d.push(3 + 0xC3);  // first byte of é: nothing yet
  CHECK(all == "ab");
  all += d.push(3 + 0xA9);
  CHECK(all == "ab\xC3\xA9");
  all += d.push(262);
  all += d.flush();
  CHECK(all == t.decode({263, 3 + 0xC3, 3 + 0xA9, 262}));
}

TEST_CASE("utf8 helpers") {
  CHECK(utf8::lossy("a\xFF"
                    "b") ==
        "a\xEF\xBF\xBD"
        "b");
  CHECK(utf8::lossy("\xE2\x82") == "\xEF\xBF\xBD");                              // truncated sequence: one replacement
  CHECK(utf8::lossy("\xED\xA0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  CHECK(utf8::valid("\xF0\x9F\x99\x82"));
  CHECK(!utf8::valid("\xC0\xAF"));
  CHECK(unicode::is_letter(0x6771));  // 東
  CHECK(unicode::is_number(0x0663));  // Arabic-Indic three
  CHECK(unicode::is_whitespace(0x3000));
  CHECK(!unicode::is_letter(0x1F642));
}

TEST_CASE("unsupported tokenizers are refused with one sentence") {
  json j = byte_level();
  j["model"]["type"] = "Unigram";
  try {
    Tokenizer::from_json(j.dump());
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "the tokenizer's model type 'Unigram' is not supported (only BPE)");
  }
  j = byte_level();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "\\w+"}}}, {"behavior", "Isolated"}};
  CHECK_THROWS_AS(Tokenizer::from_json(j.dump()), Error);
  CHECK_THROWS_AS(Tokenizer::from_json("{"), Error);
  CHECK_THROWS_AS(Tokenizer::from_json("{}"), Error);
  j = byte_level();
  j["model"]["merges"] = {"h zz"};
  CHECK_THROWS_AS(Tokenizer::from_json(j.dump()), Error);
}
