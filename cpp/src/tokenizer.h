// A reader of Hugging Face `tokenizer.json` files for the BPE tokenizers of specedge's families:
// byte-level BPE (GPT-2 / SmolLM / Llama 3 / Qwen2 style: ByteLevel or Split-regex pre-tokenizer)
// and SentencePiece-style BPE (Metaspace or Replace(" " -> "▁") with byte fallback: Llama 2,
// TinyLlama, Gemma 3, Phi-3). Encoding follows the `tokenizers` library step by step (added
// tokens, normalizer, pre-tokenizer, BPE merges by rank with its priority queue, byte fallback,
// unk fusing); decoding runs the decoder chain (ByteLevel, Metaspace, Replace, ByteFallback,
// Fuse, Strip). Anything else in a tokenizer.json is refused at load with one sentence.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace specedge {

class Tokenizer {
 public:
  Tokenizer();  // empty: encodes nothing; use from_file / from_json
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  // Throws specedge::Error (SPECEDGE_ERR_BUNDLE) when the file cannot be read or is unsupported.
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json(const std::string& json_text);

  // Ids of `text` without special tokens added (tokenizers' add_special_tokens=False); added
  // tokens written in the text are still recognised. Throws SPECEDGE_ERR_INVALID_ARGUMENT on
  // invalid UTF-8.
  std::vector<int32_t> encode(const std::string& text) const;
  // Text of `ids` (UTF-8; invalid byte sequences become U+FFFD like tokenizers' decode).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = true) const;

  int64_t vocab_size() const;  // model vocabulary + added tokens (highest id + 1)
  std::optional<int32_t> token_to_id(const std::string& token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Streaming text out of a growing token list (same rule as the Python IncrementalDecoder):
// decode a small window and emit only a stable prefix that does not end in U+FFFD.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer* tok) : tok_(tok) {}
  std::string push(int32_t id);
  std::string flush();

 private:
  const Tokenizer* tok_;
  std::vector<int32_t> ids_;
  size_t prefix_ = 0, read_ = 0;
};

namespace utf8 {
// Decode valid UTF-8 into code points; returns false on invalid input.
bool decode(const std::string& s, std::vector<uint32_t>& out);
void append(std::string& out, uint32_t cp);
// Replace ill-formed sequences by U+FFFD (one per maximal subpart, as Rust's from_utf8_lossy).
std::string lossy(const std::string& bytes);
bool valid(const std::string& s);
}  // namespace utf8

namespace unicode {
bool is_letter(uint32_t cp);
bool is_number(uint32_t cp);
bool is_whitespace(uint32_t cp);  // the White_Space property (what \s matches)
}  // namespace unicode

}  // namespace specedge
