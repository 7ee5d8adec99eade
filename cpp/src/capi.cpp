// The C boundary: status codes + a thread-local message; no exception crosses it.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <thread>

#include "engine.h"
#include "error.h"
#include "specedge.h"

using namespace specedge;

// The public header states k's bound for C callers (stats arrays, specedge_generate's check); it
// is the runtime's, not a second one.
static_assert(SPECEDGE_MAX_SPEC_TOKENS == kMaxSpecTokens, "specedge.h and manifest.h disagree on k's bound");

struct specedge_model {
  std::unique_ptr<Engine> engine;
  std::string drafter;
  // One generation at a time per handle (one KV cache): other threads wait their turn; the thread
  // running one (a token callback calling back in) is refused, since waiting would deadlock it.
  std::mutex busy;
  std::atomic<std::thread::id> owner{};
};

struct specedge_result {
  GenResult r;
};

namespace {
thread_local std::string g_error;
constexpr int kMaxThreads = 1024;  // as the Python API and both CLIs: more is a typo, not a machine

// Holds a handle's generation lock for one call.
class Turn {
 public:
  explicit Turn(specedge_model* m) : m_(m) {
    if (m_->owner.load() == std::this_thread::get_id())
      fail_arg(
          "the model is busy: a generation on this handle called back into it from its token callback "
          "(finish that generation first; open one handle per concurrent request)");
    m_->busy.lock();
    m_->owner.store(std::this_thread::get_id());
  }
  ~Turn() {
    m_->owner.store(std::thread::id());
    m_->busy.unlock();
  }
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;

 private:
  specedge_model* m_;
};

specedge_status set_error(specedge_status s, const std::string& msg) {
  g_error = msg;
  return s;
}

template <class F>
specedge_status guarded(F&& f) {
  g_error.clear();
  try {
    f();
    return SPECEDGE_OK;
  } catch (const Error& e) {
    return set_error(e.code(), e.what());
  } catch (const std::bad_alloc&) {
    return set_error(SPECEDGE_ERR_INTERNAL, "out of memory");
  } catch (const std::exception& e) {
    return set_error(SPECEDGE_ERR_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return set_error(SPECEDGE_ERR_INTERNAL, "internal error");
  }
}

void write_out(const std::string& s, char* buf, size_t cap, size_t* len) {
  if (len) *len = s.size();
  if (buf && cap) {
    size_t n = std::min(s.size(), cap - 1);
    std::memcpy(buf, s.data(), n);
    buf[n] = 0;
  }
}

// Strict UTF-8 (no overlong forms, surrogates or code points past U+10FFFF), as Python decodes it.
bool valid_utf8(const char* s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s);
  while (*p) {
    unsigned c = *p;
    int n = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
    if (n < 0) return false;
    uint32_t cp = n == 0 ? c : n == 1 ? (c & 0x1F) : n == 2 ? (c & 0x0F) : (c & 0x07);
    for (int i = 1; i <= n; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    static const uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    p += n + 1;
  }
  return true;
}

void check_text(const char* s, const char* what) {
  if (!valid_utf8(s)) fail_arg(std::string(what) + " is not valid UTF-8 text");
}

GenConfig to_config(const specedge_gen_params* p) {
  specedge_gen_params d;
  specedge_gen_params_init(&d);
  if (!p) p = &d;
  GenConfig c;
  c.max_new_tokens = p->max_new_tokens;
  c.sampling.temperature = p->temperature;
  c.sampling.top_k = p->top_k;
  c.sampling.top_p = p->top_p;
  if (p->has_seed) c.seed = p->seed;
  if (p->n_stop && !p->stop) fail_arg("stop is NULL but n_stop is not 0");
  for (size_t i = 0; i < p->n_stop; ++i) {
    if (!p->stop[i]) fail_arg("a stop string is NULL");
    check_text(p->stop[i], "a stop string");
    c.stop.emplace_back(p->stop[i]);
  }
  c.spec_tokens = p->spec_tokens;
  c.speculative = p->speculative != 0;
  c.guard = p->guard != 0;
  c.adaptive_k = p->adaptive_k != 0;
  c.tree = p->tree != 0;
  return c;
}

specedge_status run(specedge_model* model, const std::vector<int32_t>* ids, const char* prompt,
                    const specedge_gen_params* params, specedge_token_callback cb, void* user, specedge_result** out) {
  return guarded([&] {
    if (!model || !out) fail_arg("model and out must not be NULL");
    *out = nullptr;
    GenConfig cfg = to_config(params);
    std::vector<int32_t> prompt_ids;
    if (ids) {
      prompt_ids = *ids;
    } else {
      if (!prompt) fail_arg("the prompt is NULL");
      if (!*prompt) fail_arg("the prompt is empty");
      check_text(prompt, "the prompt");
      prompt_ids = model->engine->encode(prompt);
    }
    TokenCallback f;
    if (cb) f = [&](int32_t tok, const std::string& text) { return cb(user, tok, text.c_str(), text.size()) == 0; };
    auto r = std::make_unique<specedge_result>();
    Turn turn(model);
    r->r = model->engine->generate(prompt_ids, cfg, f);
    *out = r.release();
  });
}
}  // namespace

extern "C" {

void specedge_open_options_init(specedge_open_options* o) {
  if (!o) return;
  o->backend = nullptr;
  o->threads = 0;
  o->spec_tokens = 0;
  o->draft = nullptr;
  o->verify = nullptr;
  o->allow_spinning = -1;
  o->warmup = 1;
}

specedge_status specedge_open(const char* bundle, const specedge_open_options* opts, specedge_model** out) {
  return guarded([&] {
    if (!bundle || !out) fail_arg("bundle and out must not be NULL");
    *out = nullptr;
    specedge_open_options d;
    specedge_open_options_init(&d);
    if (!opts) opts = &d;
    if (opts->threads > kMaxThreads)
      fail_arg("threads must be <= " + std::to_string(kMaxThreads) + ", got " + std::to_string(opts->threads));
    EngineOptions eo;
    eo.backend.backend = opts->backend ? opts->backend : "ort-cpu";
    eo.backend.threads = opts->threads;
    eo.spec_tokens = opts->spec_tokens;
    eo.draft = opts->draft ? opts->draft : "";
    eo.verify = opts->verify ? opts->verify : "full";
    eo.allow_spinning = opts->allow_spinning;
    eo.warmup = opts->warmup != 0;
    auto m = std::make_unique<specedge_model>();
    m->engine = std::make_unique<Engine>(bundle, eo);
    m->drafter = m->engine->drafter_kind();
    *out = m.release();
  });
}

void specedge_close(specedge_model* model) { delete model; }

specedge_status specedge_tokenize(specedge_model* model, const char* text, int add_bos, int32_t* ids, size_t cap,
                                  size_t* n) {
  return guarded([&] {
    if (!model || !text || !n) fail_arg("model, text and n_ids must not be NULL");
    check_text(text, "the text");
    auto v = model->engine->encode(text, add_bos);
    *n = v.size();
    if (ids) std::memcpy(ids, v.data(), std::min(cap, v.size()) * sizeof(int32_t));
  });
}

specedge_status specedge_detokenize(specedge_model* model, const int32_t* ids, size_t n, char* buf, size_t cap,
                                    size_t* len) {
  return guarded([&] {
    if (!model || (!ids && n)) fail_arg("model and ids must not be NULL");
    std::vector<int32_t> v(ids, ids + n);
    write_out(model->engine->decode(v), buf, cap, len);
  });
}

specedge_status specedge_apply_chat(specedge_model* model, const char* const* roles, const char* const* contents,
                                    size_t n, int add_gen, char* buf, size_t cap, size_t* len) {
  return guarded([&] {
    if (!model || (n && (!roles || !contents))) fail_arg("model, roles and contents must not be NULL");
    std::vector<std::pair<std::string, std::string>> msgs;
    for (size_t i = 0; i < n; ++i) {
      if (!roles[i] || !contents[i]) fail_arg("each message must have a role and a content");
      check_text(roles[i], "a message's role");
      check_text(contents[i], "a message's content");
      msgs.emplace_back(roles[i], contents[i]);
    }
    write_out(model->engine->apply_chat(msgs, add_gen != 0), buf, cap, len);
  });
}

void specedge_gen_params_init(specedge_gen_params* p) {
  if (!p) return;
  p->max_new_tokens = 128;
  p->temperature = 0.0;
  p->top_k = 0;
  p->top_p = 1.0;
  p->seed = 0;
  p->has_seed = 0;
  p->stop = nullptr;
  p->n_stop = 0;
  p->spec_tokens = 0;
  p->speculative = 1;
  p->guard = 1;
  p->adaptive_k = 0;
  p->tree = 0;
}

specedge_status specedge_generate(specedge_model* model, const char* prompt, const specedge_gen_params* params,
                                  specedge_token_callback cb, void* user, specedge_result** out) {
  return run(model, nullptr, prompt, params, cb, user, out);
}

specedge_status specedge_generate_tokens(specedge_model* model, const int32_t* ids, size_t n,
                                         const specedge_gen_params* params, specedge_token_callback cb, void* user,
                                         specedge_result** out) {
  if (!ids && n) return set_error(SPECEDGE_ERR_INVALID_ARGUMENT, "ids must not be NULL");
  std::vector<int32_t> v(ids, ids + n);
  return run(model, &v, nullptr, params, cb, user, out);
}

const int32_t* specedge_result_tokens(const specedge_result* r, size_t* n) {
  if (n) *n = r ? r->r.token_ids.size() : 0;
  return r ? r->r.token_ids.data() : nullptr;
}

const char* specedge_result_text(const specedge_result* r, size_t* len) {
  if (len) *len = r ? r->r.text.size() : 0;
  return r ? r->r.text.c_str() : "";
}

const char* specedge_result_finish_reason(const specedge_result* r) { return r ? r->r.finish_reason.c_str() : ""; }

void specedge_result_stats(const specedge_result* r, specedge_stats* s) {
  if (!s) return;
  std::memset(s, 0, sizeof(*s));
  if (!r) return;
  const Stats& x = r->r.stats;
  s->tokens = x.tokens;
  s->prompt_tokens = x.prompt_tokens;
  s->tokens_per_s = x.tokens_per_s;
  s->e2e_tokens_per_s = x.e2e_tokens_per_s;
  s->ttft_s = x.ttft_s;
  s->decode_s = x.decode_s;
  s->total_s = x.total_s;
  s->time_draft_s = x.time_draft_s;
  s->time_verify_s = x.time_verify_s;
  s->time_other_s = x.time_other_s;
  s->speculative = x.speculative;
  s->acceptance_rate = x.acceptance_rate;
  s->mean_accepted = x.mean_accepted;
  s->target_calls = x.target_calls;
  s->drafted = x.drafted;
  s->accepted = x.accepted;
  s->k = x.k;
  s->k_final = x.k_final;
  s->fallbacks = x.fallbacks;
  s->fallback_tokens = x.fallback_tokens;
  s->k_shrinks = x.k_shrinks;
  s->prefix_reused_tokens = x.prefix_reused_tokens;
  size_t n = std::min(x.accepted_histogram.size(), size_t(SPECEDGE_MAX_SPEC_TOKENS + 1));
  for (size_t i = 0; i < n; ++i) s->accepted_histogram[i] = x.accepted_histogram[i];
  s->n_accepted_histogram = int(n);
  for (const auto& kv : x.k_histogram)
    if (kv.first >= 0 && kv.first <= SPECEDGE_MAX_SPEC_TOKENS) s->k_histogram[kv.first] = kv.second;
  s->alpha_estimate = x.alpha_estimate;
  s->draft_calls = x.draft_calls;
  s->draft_kv_copied = x.draft_kv_copied;
  s->tree_rounds = x.tree_rounds;
  s->trees_off = x.trees_off ? 1 : 0;
}

void specedge_result_free(specedge_result* r) { delete r; }

const char* specedge_last_error(void) { return g_error.c_str(); }

const char* specedge_status_name(specedge_status s) {
  switch (s) {
    case SPECEDGE_OK:
      return "ok";
    case SPECEDGE_ERR_INVALID_ARGUMENT:
      return "invalid argument";
    case SPECEDGE_ERR_BUNDLE:
      return "bad bundle";
    case SPECEDGE_ERR_BACKEND:
      return "backend error";
    case SPECEDGE_ERR_IO:
      return "I/O error";
    case SPECEDGE_ERR_INTERNAL:
      return "internal error";
  }
  return "unknown status";
}

const char* specedge_version(void) { return SPECEDGE_VERSION; }

int specedge_abi_version(void) { return SPECEDGE_ABI_VERSION; }

int specedge_max_seq(const specedge_model* m) { return m ? m->engine->manifest().max_seq : 0; }
int specedge_vocab_size(const specedge_model* m) { return m ? m->engine->vocab() : 0; }
const char* specedge_drafter_kind(const specedge_model* m) { return m ? m->drafter.c_str() : ""; }

}  // extern "C"
