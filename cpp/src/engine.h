// A loaded bundle (mirrors the assembly in specedge/runtime/api.py's load): the manifest, the
// tokenizer, the target's backend and cache, the drafter the options name, and the generation
// loop (generator.h) over them.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "cache.h"
#include "drafters/head.h"
#include "drafters/model.h"
#include "drafters/ngram.h"
#include "generator.h"
#include "invariant.h"
#include "manifest.h"
#include "tokenizer.h"

namespace specedge {

struct EngineOptions {
  BackendOptions backend;
  int spec_tokens = 0;  // 0 = bundle's
  std::string draft;    // "", "model", "ngram", "head" (the bundle's trained draft head; on ort-cpu beside any target)
  std::string verify = "full";
  int allow_spinning = -1;  // -1 auto
  bool warmup = true;
};

class Engine {
 public:
  Engine(const std::string& bundle, const EngineOptions& opts);
  ~Engine();
  std::vector<int32_t> encode(const std::string& text, int add_bos = -1) const;
  std::string decode(const std::vector<int32_t>& ids) const { return tok_.decode(ids); }
  std::string apply_chat(const std::vector<std::pair<std::string, std::string>>& messages, bool add_gen) const;
  GenResult generate(const std::vector<int32_t>& prompt, const GenConfig& cfg, const TokenCallback& cb) {
    return gen_->run(prompt, cfg, cb);
  }
  const Manifest& manifest() const { return m_; }
  int vocab() const { return vocab_; }
  std::string drafter_kind() const { return gen_->drafter() ? gen_->drafter()->kind() : "none"; }
  Generator& generator() { return *gen_; }
  // Time each call shape (median of `repeats`) into the generator's cost model.
  void calibrate(int repeats = 3);

 private:
  // The drafter `draft` names, with its backend when it has one (kept in draft_backend_).
  std::unique_ptr<Drafter> make_drafter(const std::string& draft, const BackendOptions& bo);
  Manifest m_;
  Tokenizer tok_;
  std::unique_ptr<Backend> target_, draft_backend_;
  std::unique_ptr<CacheTracker> tcache_;
  std::unique_ptr<Generator> gen_;
  int vocab_ = 0, spec_tokens_ = 0;
};

}  // namespace specedge
