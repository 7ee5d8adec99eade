// Header-only C++17 wrapper over the specedge C API: RAII handles, exceptions on the C++ side
// only (specedge::Exception carries the status and the message), std::function callbacks.
//
//   specedge::Model model("bundles/smollm2-135m-instruct", specedge::OpenOptions().threads(2));
//   specedge::GenParams gp;
//   gp.max_new_tokens = 64;
//   auto r = model.generate("def fibonacci(n):", gp, [](int32_t tok, std::string_view text) {
//     std::cout << text << std::flush;
//     return true;  // false cancels
//   });
//   std::cout << r.stats.tokens_per_s << " tok/s\n";
#ifndef SPECEDGE_HPP
#define SPECEDGE_HPP

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "specedge.h"

namespace specedge {

class Exception : public std::runtime_error {
 public:
  Exception(specedge_status s, const std::string& msg) : std::runtime_error(msg), status_(s) {}
  specedge_status status() const noexcept { return status_; }

 private:
  specedge_status status_;
};

inline void check(specedge_status s) {
  if (s != SPECEDGE_OK) throw Exception(s, specedge_last_error());
}

class OpenOptions {
 public:
  OpenOptions() { specedge_open_options_init(&o_); }
  OpenOptions& backend(std::string b) {
    backend_ = std::move(b);
    return *this;
  }
  OpenOptions& threads(int n) {
    o_.threads = n;
    return *this;
  }
  OpenOptions& spec_tokens(int k) {
    o_.spec_tokens = k;
    return *this;
  }
  OpenOptions& draft(std::string d) {
    draft_ = std::move(d);
    return *this;
  }
  OpenOptions& verify(std::string v) {
    verify_ = std::move(v);
    return *this;
  }
  OpenOptions& allow_spinning(int v) {
    o_.allow_spinning = v;
    return *this;
  }
  OpenOptions& warmup(bool w) {
    o_.warmup = w ? 1 : 0;
    return *this;
  }
  const specedge_open_options* get() const {
    o_.backend = backend_.empty() ? nullptr : backend_.c_str();
    o_.draft = draft_.empty() ? nullptr : draft_.c_str();
    o_.verify = verify_.empty() ? nullptr : verify_.c_str();
    return &o_;
  }

 private:
  mutable specedge_open_options o_;
  std::string backend_, draft_, verify_;
};

struct GenParams {
  int max_new_tokens = 128;
  double temperature = 0.0;
  int top_k = 0;
  double top_p = 1.0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  int spec_tokens = 0;
  bool speculative = true;
  bool guard = true;
  bool adaptive_k = false;
  bool tree = false;  // verify a token tree per round (a bundle exported with --tree)
};

struct Result {
  std::vector<int32_t> token_ids;
  std::string text;
  std::string finish_reason;
  specedge_stats stats{};
};

// Return false to cancel.
using TokenCallback = std::function<bool(int32_t token, std::string_view text)>;

class Model {
 public:
  explicit Model(const std::string& bundle, const OpenOptions& opts = OpenOptions()) {
    specedge_model* m = nullptr;
    check(specedge_open(bundle.c_str(), opts.get(), &m));
    m_.reset(m);
  }

  std::vector<int32_t> tokenize(const std::string& text, int add_bos = -1) const {
    size_t n = 0;
    check(specedge_tokenize(m_.get(), text.c_str(), add_bos, nullptr, 0, &n));
    std::vector<int32_t> ids(n);
    check(specedge_tokenize(m_.get(), text.c_str(), add_bos, ids.data(), ids.size(), &n));
    return ids;
  }

  std::string detokenize(const std::vector<int32_t>& ids) const {
    size_t len = 0;
    check(specedge_detokenize(m_.get(), ids.data(), ids.size(), nullptr, 0, &len));
    std::string s(len + 1, '\0');
    check(specedge_detokenize(m_.get(), ids.data(), ids.size(), &s[0], s.size(), &len));
    s.resize(len);
    return s;
  }

  std::string apply_chat(const std::vector<std::pair<std::string, std::string>>& messages,
                         bool add_generation_prompt = true) const {
    std::vector<const char*> roles, contents;
    for (const auto& m : messages) {
      roles.push_back(m.first.c_str());
      contents.push_back(m.second.c_str());
    }
    size_t len = 0;
    check(specedge_apply_chat(m_.get(), roles.data(), contents.data(), messages.size(), add_generation_prompt, nullptr,
                              0, &len));
    std::string s(len + 1, '\0');
    check(specedge_apply_chat(m_.get(), roles.data(), contents.data(), messages.size(), add_generation_prompt, &s[0],
                              s.size(), &len));
    s.resize(len);
    return s;
  }

  Result generate(const std::string& prompt, const GenParams& p = GenParams(), TokenCallback cb = nullptr) {
    return run(&prompt, nullptr, p, std::move(cb));
  }
  Result generate(const std::vector<int32_t>& ids, const GenParams& p = GenParams(), TokenCallback cb = nullptr) {
    return run(nullptr, &ids, p, std::move(cb));
  }

  int max_seq() const { return specedge_max_seq(m_.get()); }
  int vocab_size() const { return specedge_vocab_size(m_.get()); }
  std::string drafter_kind() const { return specedge_drafter_kind(m_.get()); }
  specedge_model* handle() const { return m_.get(); }

 private:
  struct Deleter {
    void operator()(specedge_model* m) const { specedge_close(m); }
  };
  struct ResultDeleter {
    void operator()(specedge_result* r) const { specedge_result_free(r); }
  };
  struct Trampoline {
    TokenCallback* cb;
    std::exception_ptr error;
    static int call(void* user, int32_t token, const char* text, size_t len) {
      auto* t = static_cast<Trampoline*>(user);
      try {  // an exception must not cross the C boundary: keep it, cancel, rethrow after
        return (*t->cb)(token, std::string_view(text, len)) ? 0 : 1;
      } catch (...) {
        t->error = std::current_exception();
        return 1;
      }
    }
  };

  Result run(const std::string* prompt, const std::vector<int32_t>* ids, const GenParams& p, TokenCallback cb) {
    specedge_gen_params gp;
    specedge_gen_params_init(&gp);
    gp.max_new_tokens = p.max_new_tokens;
    gp.temperature = p.temperature;
    gp.top_k = p.top_k;
    gp.top_p = p.top_p;
    gp.has_seed = p.seed.has_value();
    gp.seed = p.seed.value_or(0);
    std::vector<const char*> stops;
    for (const auto& s : p.stop) stops.push_back(s.c_str());
    gp.stop = stops.data();
    gp.n_stop = stops.size();
    gp.spec_tokens = p.spec_tokens;
    gp.speculative = p.speculative;
    gp.guard = p.guard;
    gp.adaptive_k = p.adaptive_k;
    gp.tree = p.tree;
    Trampoline tr{&cb, nullptr};
    specedge_result* raw = nullptr;
    specedge_status s;
    if (prompt)
      s = specedge_generate(m_.get(), prompt->c_str(), &gp, cb ? &Trampoline::call : nullptr, &tr, &raw);
    else
      s = specedge_generate_tokens(m_.get(), ids->data(), ids->size(), &gp, cb ? &Trampoline::call : nullptr, &tr,
                                   &raw);
    std::unique_ptr<specedge_result, ResultDeleter> r(raw);
    if (tr.error) std::rethrow_exception(tr.error);
    check(s);
    Result out;
    size_t n = 0, len = 0;
    const int32_t* t = specedge_result_tokens(r.get(), &n);
    out.token_ids.assign(t, t + n);
    const char* text = specedge_result_text(r.get(), &len);
    out.text.assign(text, len);
    out.finish_reason = specedge_result_finish_reason(r.get());
    specedge_result_stats(r.get(), &out.stats);
    return out;
  }

  std::unique_ptr<specedge_model, Deleter> m_;
};

}  // namespace specedge

#endif  // SPECEDGE_HPP
