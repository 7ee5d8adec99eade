#include "engine.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "bundle_files.h"
#include "chat_template.h"
#include "error.h"
#include "ort_backend.h"
#include "rounds.h"

namespace specedge {

namespace {
void check_options(const EngineOptions& opts) {
  if (opts.draft != "" && opts.draft != "model" && opts.draft != "ngram" && opts.draft != "head")
    fail_arg("draft must be 'model', 'ngram', 'head' or empty, got '" + opts.draft + "'");
  if (opts.spec_tokens < 0 || opts.spec_tokens > kMaxSpecTokens)
    fail_arg("spec_tokens (k) must be in 1.." + std::to_string(kMaxSpecTokens) + " (0 = the bundle's), got " +
             std::to_string(opts.spec_tokens));
  if (opts.backend.threads < 0) fail_arg("threads must be >= 0, got " + std::to_string(opts.backend.threads));
}

Tokenizer load_tokenizer(const Manifest& m) {
  std::string rel;
  for (const auto& f : m.tokenizer_files) {
    std::string base = f.substr(f.find_last_of('/') == std::string::npos ? 0 : f.find_last_of('/') + 1);
    if (base == "tokenizer.json") rel = f;
  }
  if (rel.empty()) fail_bundle("the bundle lists no tokenizer.json");
  return Tokenizer::from_file(m.path(rel));
}

// The drafter the options name (default: the bundle's own kind), refused when the bundle lacks it.
std::string draft_kind(const Manifest& m, const std::string& asked) {
  std::string draft = asked.empty() ? (m.draft.is_model() ? "model" : "ngram") : asked;
  if (draft == "model" && !m.draft.is_model())
    fail_arg("this bundle's draft is an n-gram drafter: it has no draft model (use draft 'ngram')");
  if (draft == "head" && !m.has_head)
    fail_arg("this bundle has no draft head: train one with `specedge train-draft BUNDLE`");
  return draft;
}

// The fixed costs a seeded sampling run decides with: the target's calls nearly flat in T, a draft
// token priced by the draft's share of the target's weights (a lookup: almost free).
CostModel static_costs(const Manifest& m, const std::string& draft) {
  CostModel c;
  c.target = {{1, 1.0}, {kMaxSpecTokens + 1, 1.0 + 0.05 * kMaxSpecTokens}};
  const ModelSpec& d = draft == "head" ? m.head : m.draft;
  if (draft == "ngram")
    c.draft = 0.01;
  else if (d.weight_bytes > 0 && m.target.weight_bytes > 0)
    c.draft = std::max(double(d.weight_bytes) / double(m.target.weight_bytes), 0.02);
  else
    c.draft = 0.3;
  return c;
}
}  // namespace

Engine::Engine(const std::string& bundle, const EngineOptions& opts) {
  check_options(opts);
  check_backend_name(opts.backend.backend);  // before the bundle: a build without TensorRT says so first
  m_ = load_manifest(bundle, opts.verify);
  check_graph_files(m_);  // where the graphs make ONNX Runtime read weights from, whatever `verify` says
  tok_ = load_tokenizer(m_);
  const std::string draft = draft_kind(m_, opts.draft);
  BackendOptions bo = opts.backend;
  bo.backend = resolve_backend_name(bo.backend);
  bo.verify = opts.verify;
  bo.allow_spinning = opts.allow_spinning;
  bo.alternating = draft == "model" || draft == "head";
  target_ = make_backend(m_, m_.target, bo);
  vocab_ = int(std::min<int64_t>(m_.tokenizer_vocab_size, target_->vocab_size()));
  tcache_ = std::make_unique<CacheTracker>(target_.get(), m_.prefill_chunk);
  tcache_->set_invariant_steps(
      wants_invariant_steps(m_.target.precision) &&
      !batch_invariant_here(target_->graph() ? *target_->graph() : m_.target.graph_for(bo.backend), *target_));
  std::unique_ptr<Drafter> drafter = make_drafter(draft, bo);
  spec_tokens_ = opts.spec_tokens ? opts.spec_tokens : m_.spec_tokens;
  check_call_size(*target_, spec_tokens_);
  gen_ = std::make_unique<Generator>(m_, tok_, *tcache_, std::move(drafter), vocab_, spec_tokens_,
                                     static_costs(m_, draft));
  if (opts.warmup) calibrate();
}

Engine::~Engine() = default;

std::unique_ptr<Drafter> Engine::make_drafter(const std::string& draft, const BackendOptions& bo) {
  if (draft == "ngram")
    return std::make_unique<NgramDrafter>(m_.draft.kind == "ngram" ? m_.draft.ngram_sizes : std::vector<int>{3, 2, 1},
                                          vocab_);
  if (draft == "model") {
    draft_backend_ = make_backend(m_, m_.draft, bo);
    vocab_ = std::min(vocab_, draft_backend_->vocab_size());
    auto d = std::make_unique<ModelDrafter>(draft_backend_.get(), m_.prefill_chunk, vocab_);
    if (m_.draft.self_draft_of == "target") d->set_kv_donor(tcache_.get());
    return d;
  }
  // the head is a few MB: it runs on ONNX Runtime's CPU backend beside a target on any backend, which copies its
  // feature rows to the host (only now, for the head: no cost for other drafters)
  BackendOptions hbo = bo;
  hbo.backend = "ort-cpu";
  draft_backend_ = make_backend(m_, m_.head, hbo);
  auto* head = dynamic_cast<OrtBackend*>(draft_backend_.get());
  if (!head || !target_->keep_features())
    fail_bundle("the target graph returns no features: head drafting needs a bundle exported with features");
  if (target_->feature_dim() != m_.head.feature_dim)
    fail_bundle("the draft head reads " + std::to_string(m_.head.feature_dim) + " features, the target returns " +
                std::to_string(target_->feature_dim()));
  return std::make_unique<HeadDrafter>(head, tcache_.get(), read_draft_vocab(m_), vocab_, m_.prefill_chunk);
}

void Engine::calibrate(int repeats) {
  auto timeit = [&](Backend* b, int t) {
    std::vector<int32_t> ids(size_t(t), 0);
    b->run(ids.data(), t, 0);
    std::vector<double> ts;
    for (int i = 0; i < repeats; ++i) {
      double t0 = now();
      b->run(ids.data(), t, 0);
      ts.push_back(now() - t0);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  CostModel& costs = gen_->costs();
  costs.target[1] = timeit(target_.get(), 1);
  // every verification size, each timed after its warm-up call (a size first timed cold misleads the guard)
  if (gen_->drafter())
    for (int t = 2; t <= spec_tokens_ + 1; ++t) costs.target[t] = timeit(target_.get(), t);
  if (draft_backend_) {
    costs.draft = timeit(draft_backend_.get(), 1);
    std::vector<int32_t> two{0, 0};
    draft_backend_->run(two.data(), 2, 0);
  } else {
    costs.draft = 2e-5;
  }
  gen_->reset();
}

std::vector<int32_t> Engine::encode(const std::string& text, int add_bos) const {
  std::vector<int32_t> ids = tok_.encode(text);
  bool bos = add_bos < 0 ? m_.add_bos : add_bos != 0;
  if (bos && m_.bos_token_id && (ids.empty() || ids[0] != *m_.bos_token_id))
    ids.insert(ids.begin(), int32_t(*m_.bos_token_id));
  return ids;
}

std::string Engine::apply_chat(const std::vector<std::pair<std::string, std::string>>& msgs, bool add_gen) const {
  std::string tpl;
  if (m_.chat_template) {
    std::ifstream in(m_.path(*m_.chat_template), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    tpl = ss.str();
  }
  auto bos = m_.bos_token_id ? tok_.id_to_token(int32_t(*m_.bos_token_id)) : std::nullopt;
  return apply_chat_template(tpl, bos, msgs, add_gen);
}

}  // namespace specedge
