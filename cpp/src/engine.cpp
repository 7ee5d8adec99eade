#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "bundle_files.h"
#include "error.h"
#include "ort_backend.h"

namespace specedge {

namespace {
double now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

int common_prefix(const std::vector<int32_t>& a, size_t a0, const std::vector<int32_t>& b, size_t b0, size_t limit) {
  size_t n = 0;
  while (a0 + n < a.size() && b0 + n < b.size() && n < limit && a[a0 + n] == b[b0 + n]) ++n;
  return int(n);
}

// Length of the longest suffix of `text` that is a proper prefix of a stop string.
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

// Earliest stop string in text (searching from `start`), or npos.
size_t find_stop(const std::string& text, const std::vector<std::string>& stops, size_t start) {
  size_t best = std::string::npos;
  for (const auto& s : stops) {
    size_t from = start > s.size() ? start - s.size() : 0;
    size_t i = text.find(s, from);
    if (i != std::string::npos && (best == std::string::npos || i < best)) best = i;
  }
  return best;
}
}  // namespace

// ---------------------------------------------------------------------------- CacheTracker

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

bool wants_invariant_steps(const std::string& precision) {
  return precision == "int4" || precision == "int8" || precision == "fp16" || precision == "bf16";
}

// A graph marked batch_invariant, confirmed on this machine: a T = 1 call gives row 0 of a T = 2
// call bit for bit (runtime/invariant.py rows_independent_of_t; slots 0 and 1 are overwritten by
// any prefill). The kernels a CPU dispatches to are only known at run time, hence the check.
bool batch_invariant_here(const GraphSpec& g, Backend& target) {
  if (!g.batch_invariant || target.max_seq() < 2) return false;
  const int32_t one = 0, two[2] = {0, 0};
  const size_t v = size_t(target.vocab_size());
  const float* single = target.run(&one, 1, 0);
  const std::vector<float> row(single, single + v);
  const float* pair = target.run(two, 2, 0);
  if (std::memcmp(row.data(), pair, v * sizeof(float)) == 0) return true;
  std::fprintf(stderr, "specedge: warning: the target graph is marked batch-invariant, but on this machine a "
                       "single-token call's row differs from a verification row: single-token steps run as 2 tokens\n");
  return false;
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

// ---------------------------------------------------------------------------- n-gram drafter

NgramDrafter::NgramDrafter(std::vector<int> sizes) : sizes_(std::move(sizes)) {
  if (sizes_.empty()) fail_arg("ngram_sizes must name at least one n-gram size");
  reset();
}

void NgramDrafter::reset() {
  tokens_.clear();
  index_.assign(sizes_.size(), {});
  starts_.assign(sizes_.size(), {});
  covered_ = 0;
}

void NgramDrafter::sync(const std::vector<int32_t>& h) {
  size_t m = tokens_.size();
  if (h.size() < m || !std::equal(tokens_.begin(), tokens_.end(), h.begin())) {
    reset();
    m = 0;
  }
  tokens_.insert(tokens_.end(), h.begin() + long(m), h.end());
}

void NgramDrafter::extend_index(size_t end) {
  for (size_t stop = covered_ + 1; stop <= end; ++stop)
    for (size_t si = 0; si < sizes_.size(); ++si) {
      size_t n = size_t(sizes_[si]);
      if (stop >= n) {
        std::string gram(reinterpret_cast<const char*>(tokens_.data() + stop - n), n * sizeof(int32_t));
        index_[si][gram] = stop - n;
        auto& starts = starts_[si][gram];  // tree proposals: the latest kMatchesKept starts
        starts.push_back(stop - n);
        if (starts.size() > kMatchesKept) starts.erase(starts.begin());
      }
    }
  covered_ = std::max(covered_, end);
}

std::vector<int32_t> NgramDrafter::propose(const std::vector<int32_t>& history, int k) {
  sync(history);
  size_t len = tokens_.size();
  if (k <= 0 || len < 2) return {};
  extend_index(len - 1);
  for (size_t si = 0; si < sizes_.size(); ++si) {
    size_t n = size_t(sizes_[si]);
    if (len <= n) continue;
    auto it = index_[si].find(std::string(reinterpret_cast<const char*>(tokens_.data() + len - n), n * sizeof(int32_t)));
    if (it != index_[si].end()) {
      size_t from = it->second + n, to = std::min(from + size_t(k), len);
      return std::vector<int32_t>(tokens_.begin() + long(from), tokens_.begin() + long(to));
    }
  }
  return {};
}

// ---------------------------------------------------------------------------- model drafter

int ModelDrafter::sync(const std::vector<int32_t>& history) {
  // roll back to the common prefix with history; the rest (at least the last token) is to feed
  size_t b = size_t(base_);
  int n = base_ + common_prefix(cache_.tokens(), b, history, b, SIZE_MAX);
  n = std::min(n, int(history.size()) - 1);
  cache_.rollback(n);
  // only when the target holds slots the draft lacks (the prompt, a catch-up), not every round
  if (donor_ && n < std::min(donor_->position(), int(history.size()) - 1)) {
    int m = std::min(common_prefix(donor_->tokens(), 0, history, 0, SIZE_MAX), int(history.size()) - 1);
    if (m > n && cache_.backend()->copy_kv_from(*donor_->backend(), n, m)) {
      cache_.adopt(history.data() + n, m - n);
      copied_ += m - n;
      n = m;
    }
  }
  return n;
}

std::vector<int32_t> ModelDrafter::propose(const std::vector<int32_t>& history, int k, const SamplingParams& p,
                                           Rng& rng, std::vector<double>* q) {
  if (k < 1) return {};
  if (history.empty()) fail_arg("cannot draft after an empty sequence");
  int n = sync(history);
  base_ = int(history.size());
  const float* row = cache_.feed_chunked(history.data() + n, int(history.size()) - n);
  calls_ += (int64_t(history.size()) - n + cache_.chunk() - 1) / cache_.chunk() + (k - 1);
  std::vector<int32_t> out;
  std::vector<double> probs;
  if (q) q->assign(size_t(k) * size_t(vocab_), 0.0);
  for (int j = 0; j < k; ++j) {
    int32_t tok;
    if (p.greedy()) {
      tok = argmax(row, vocab_);
    } else {
      probs_from_logits(row, vocab_, p, probs);
      std::copy(probs.begin(), probs.end(), q->begin() + long(j) * vocab_);
      tok = sample(probs.data(), vocab_, rng);
    }
    out.push_back(tok);
    if (j < k - 1) row = cache_.feed(&tok, 1);
  }
  return out;
}

// ---------------------------------------------------------------------------- engine

Engine::Engine(const std::string& bundle, const EngineOptions& opts) {
  if (opts.draft != "" && opts.draft != "model" && opts.draft != "ngram" && opts.draft != "head")
    fail_arg("draft must be 'model', 'ngram', 'head' or empty, got '" + opts.draft + "'");
  if (opts.spec_tokens < 0 || opts.spec_tokens > kMaxSpecTokens)
    fail_arg("spec_tokens (k) must be in 1.." + std::to_string(kMaxSpecTokens) + " (0 = the bundle's), got " +
             std::to_string(opts.spec_tokens));
  if (opts.backend.threads < 0) fail_arg("threads must be >= 0, got " + std::to_string(opts.backend.threads));
  check_backend_name(opts.backend.backend);  // before the bundle: a build without TensorRT says so first
  m_ = load_manifest(bundle, opts.verify);
  check_graph_files(m_);  // where the graphs make ONNX Runtime read weights from, whatever `verify` says
  std::string tok_rel;
  for (const auto& f : m_.tokenizer_files) {
    std::string base = f.substr(f.find_last_of('/') == std::string::npos ? 0 : f.find_last_of('/') + 1);
    if (base == "tokenizer.json") tok_rel = f;
  }
  if (tok_rel.empty()) fail_bundle("the bundle lists no tokenizer.json");
  tok_ = Tokenizer::from_file(m_.path(tok_rel));
  std::string draft = opts.draft.empty() ? (m_.draft.is_model() ? "model" : "ngram") : opts.draft;
  if (draft == "model" && !m_.draft.is_model())
    fail_arg("this bundle's draft is an n-gram drafter: it has no draft model (use draft 'ngram')");
  if (draft == "head" && !m_.has_head)
    fail_arg("this bundle has no draft head: train one with `specedge train-draft BUNDLE`");
  BackendOptions bo = opts.backend;
  bo.backend = resolve_backend_name(bo.backend);
  bo.verify = opts.verify;
  bool two = draft == "model" || draft == "head";
  bo.allow_spinning = opts.allow_spinning;
  bo.alternating = two;
  target_ = make_backend(m_, m_.target, bo);
  vocab_ = int(std::min<int64_t>(m_.tokenizer_vocab_size, target_->vocab_size()));
  OrtBackend* head_backend = nullptr;
  if (draft == "head") {
    // the head is a few MB: it runs on ONNX Runtime's CPU backend beside a target on any backend, which copies its
    // feature rows to the host (only now, for the head: no cost for other drafters)
    BackendOptions hbo = bo;
    hbo.backend = "ort-cpu";
    draft_backend_ = make_backend(m_, m_.head, hbo);
    head_backend = dynamic_cast<OrtBackend*>(draft_backend_.get());
    if (!head_backend || !target_->keep_features())
      fail_bundle("the target graph returns no features: head drafting needs a bundle exported with features");
    if (target_->feature_dim() != m_.head.feature_dim)
      fail_bundle("the draft head reads " + std::to_string(m_.head.feature_dim) + " features, the target returns " +
                  std::to_string(target_->feature_dim()));
  } else if (two) {
    draft_backend_ = make_backend(m_, m_.draft, bo);
    vocab_ = std::min(vocab_, draft_backend_->vocab_size());
    drafter_ = std::make_unique<ModelDrafter>(draft_backend_.get(), m_.prefill_chunk, vocab_);
  } else {
    ngram_ = std::make_unique<NgramDrafter>(m_.draft.kind == "ngram" ? m_.draft.ngram_sizes : std::vector<int>{3, 2, 1});
  }
  tcache_ = std::make_unique<CacheTracker>(target_.get(), m_.prefill_chunk);
  tcache_->set_invariant_steps(wants_invariant_steps(m_.target.precision) &&
                               !batch_invariant_here(target_->graph() ? *target_->graph() : m_.target.graph_for(bo.backend),
                                                     *target_));
  if (drafter_ && m_.draft.self_draft_of == "target") drafter_->set_kv_donor(tcache_.get());
  if (head_backend)
    head_ = std::make_unique<HeadDrafter>(head_backend, tcache_.get(), read_draft_vocab(m_), vocab_, m_.prefill_chunk);
  eos_ = m_.eos_token_ids;
  spec_tokens_ = opts.spec_tokens ? opts.spec_tokens : m_.spec_tokens;
  check_call_size(spec_tokens_);
  double r;
  if (ngram_)
    r = 0.01;
  else if (const ModelSpec& d = head_ ? m_.head : m_.draft; d.weight_bytes > 0 && m_.target.weight_bytes > 0)
    r = std::max(double(d.weight_bytes) / double(m_.target.weight_bytes), 0.02);
  else
    r = 0.3;
  static_costs_.target = {{1, 1.0}, {kMaxSpecTokens + 1, 1.0 + 0.05 * kMaxSpecTokens}};
  static_costs_.draft = r;
  if (opts.warmup) calibrate();
}

Engine::~Engine() = default;

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
  costs_.target[1] = timeit(target_.get(), 1);
  // every verification size, each timed after its warm-up call (a size first timed cold misleads the guard)
  if (drafter_ || ngram_ || head_)
    for (int t = 2; t <= spec_tokens_ + 1; ++t) costs_.target[t] = timeit(target_.get(), t);
  if (draft_backend_) {
    costs_.draft = timeit(draft_backend_.get(), 1);
    std::vector<int32_t> two{0, 0};
    draft_backend_->run(two.data(), 2, 0);
  } else {
    costs_.draft = 2e-5;
  }
  tcache_->reset();
  if (drafter_) drafter_->reset();
  if (head_) head_->reset();
}

void Engine::check_call_size(int k) const {
  // Verification feeds k + 1 tokens in one call: refuse up front what the target's backend cannot run (a TensorRT
  // engine is built for T up to its largest optimization profile), rather than in the middle of a generation.
  int cap = target_->max_call_tokens();
  if (k + 1 > cap)
    fail_arg("spec_tokens (k) " + std::to_string(k) + " needs " + std::to_string(k + 1) +
             " tokens per verification call, but the target's " + target_->name() + " engine takes at most " +
             std::to_string(cap) + " (use k <= " + std::to_string(cap - 1) + ", or rebuild the engines for a larger k)");
}

std::vector<int32_t> Engine::encode(const std::string& text, int add_bos) const {
  std::vector<int32_t> ids = tok_.encode(text);
  bool bos = add_bos < 0 ? m_.add_bos : add_bos != 0;
  if (bos && m_.bos_token_id && (ids.empty() || ids[0] != *m_.bos_token_id))
    ids.insert(ids.begin(), int32_t(*m_.bos_token_id));
  return ids;
}

std::string Engine::apply_chat(const std::vector<std::pair<std::string, std::string>>& msgs, bool add_gen) const {
  if (msgs.empty()) fail_arg("messages must be a non-empty list");
  std::string tpl;
  if (m_.chat_template) {
    std::ifstream in(m_.path(*m_.chat_template), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    tpl = ss.str();
  }
  std::string out;
  if (tpl.find("<|im_start|>") != std::string::npos) {
    // ChatML; a template that injects a default system message when none is given (SmolLM2)
    // has it as the literal after "messages[0]['role'] != 'system'".
    size_t cond = tpl.find("messages[0]['role'] != 'system'");
    std::string key = "<|im_start|>system\n";
    if (msgs[0].first != "system" && cond != std::string::npos) {
      size_t a = tpl.find(key, cond), b = a == std::string::npos ? a : tpl.find("<|im_end|>", a);
      if (a != std::string::npos && b != std::string::npos) out += tpl.substr(a, b - a) + "<|im_end|>\n";
    }
    for (const auto& [role, content] : msgs) out += "<|im_start|>" + role + "\n" + content + "<|im_end|>\n";
    if (add_gen) out += "<|im_start|>assistant\n";
    return out;
  }
  if (tpl.find("<start_of_turn>") != std::string::npos) {
    // Gemma: BOS, the system message folded into the first user turn, "assistant" is "model".
    auto bos = m_.bos_token_id ? tok_.id_to_token(int32_t(*m_.bos_token_id)) : std::nullopt;
    if (bos) out += *bos;
    std::string system;
    size_t i = 0;
    if (msgs[0].first == "system") {
      system = msgs[0].second + "\n\n";
      i = 1;
    }
    for (bool first = true; i < msgs.size(); ++i, first = false) {
      std::string role = msgs[i].first == "assistant" ? "model" : msgs[i].first;
      out += "<start_of_turn>" + role + "\n" + (first ? system : "") + msgs[i].second + "<end_of_turn>\n";
    }
    if (add_gen) out += "<start_of_turn>model\n";
    return out;
  }
  fail_arg("the bundle's chat template is not a format this runtime knows (ChatML or Gemma)");
}

std::vector<int32_t> Engine::target_step(const std::vector<int32_t>& tokens, const SamplingParams& p, Rng& rng) {
  const float* row = tcache_->feed(&tokens.back(), 1);
  if (p.greedy()) return {argmax(row, vocab_)};
  probs_from_logits(row, vocab_, p, p_rows_);
  return {sample(p_rows_.data(), vocab_, rng)};
}

GenResult Engine::generate(const std::vector<int32_t>& prompt, const GenConfig& cfg, const TokenCallback& cb) {
  if (cfg.max_new_tokens < 1)
    fail_arg("max_new_tokens must be an integer >= 1, got " + std::to_string(cfg.max_new_tokens));
  validate(cfg.sampling);
  if (cfg.spec_tokens < 0 || cfg.spec_tokens > kMaxSpecTokens)
    fail_arg("spec_tokens (k) must be an integer in 1.." + std::to_string(kMaxSpecTokens) + ", got " +
             std::to_string(cfg.spec_tokens));
  for (const auto& s : cfg.stop)
    if (s.empty()) fail_arg("stop strings must be non-empty strings");
  if (prompt.empty()) fail_arg("the prompt is empty");
  for (int32_t t : prompt) {
    if (t >= 0 && t < vocab_) continue;
    // a tokenizer may hold added tokens past the model's embedding rows (a checkpoint whose tokenizer grew),
    // which text can name: say which one, as the Python runtime does (api.py Pipeline._lacks)
    std::optional<std::string> name = t >= 0 ? tok_.id_to_token(t) : std::nullopt;
    fail_arg("token ids must be in [0, " + std::to_string(vocab_) + ")" +
             (name ? ": the prompt holds token " + std::to_string(t) + " ('" + *name +
                         "'), which the tokenizer has but the model does not"
                   : std::string()));
  }
  const int max_seq = m_.max_seq;
  if (int64_t(prompt.size()) >= max_seq)
    fail_arg("the prompt has " + std::to_string(prompt.size()) + " tokens but the bundle's context holds " +
             std::to_string(max_seq) + " (prompt + at least one new token must fit)");
  if (cfg.speculative && cfg.spec_tokens) check_call_size(cfg.spec_tokens);
  if (cfg.tree && cfg.speculative && (drafter_ || ngram_ || head_) && !target_->takes_trees()) {
    bool graph_takes = false;
    for (const auto& g : m_.target.graphs) graph_takes = graph_takes || g.tree;
    fail_arg(tree_refusal(graph_takes, target_->name()));
  }
  if (cfg.tree && cfg.speculative && (drafter_ || ngram_ || head_) && tcache_->invariant_steps())
    fail_arg(inexact_tree_refusal(m_.target.precision));
  const SamplingParams& params = cfg.sampling;
  uint64_t seed = cfg.seed ? *cfg.seed : (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  Rng rng(seed);
  bool speculative = cfg.speculative && (drafter_ || ngram_ || head_);
  int k = cfg.spec_tokens ? cfg.spec_tokens : spec_tokens_;
  bool deterministic = !params.greedy() && cfg.seed.has_value();
  CostModel local = static_costs_;
  CostModel* costs = deterministic ? &local : &costs_;
  SpecController ctl(k, costs, cfg.guard, !deterministic, cfg.adaptive_k, kMaxSpecTokens, cfg.tree);
  int64_t calls = 0, drafted_total = 0, accepted_total = 0;
  const int64_t draft_calls0 = drafter_ ? drafter_->calls() : (head_ ? head_->calls() : 0);
  const int64_t draft_copied0 = drafter_ ? drafter_->copied() : 0;
  std::vector<int64_t> hist;
  const auto& stops = cfg.stop;
  IncrementalDecoder dec(&tok_);
  GenResult res;
  std::vector<int32_t>& out = res.token_ids;
  std::string& text = res.text;
  size_t shown = 0;
  std::string finish;

  double t_start = now();
  int reused = tcache_->reuse(prompt);
  const float* row = tcache_->feed_chunked(prompt.data() + reused, int(prompt.size()) - reused);
  int32_t first;
  if (params.greedy()) {
    first = argmax(row, vocab_);
  } else {
    probs_from_logits(row, vocab_, params, p_rows_);
    first = sample(p_rows_.data(), vocab_, rng);
  }
  double t_first = now();
  if (speculative) {
    if (drafter_) drafter_->start(prompt);
    if (head_) head_->start(prompt);
    if (ngram_) ngram_->reset();
  }
  std::vector<int32_t> tokens = prompt;
  tokens.push_back(first);
  std::vector<int32_t> fresh{first};
  double t_draft = 0, t_verify = 0;
  while (true) {
    for (int32_t tok : fresh) {
      if (std::find(eos_.begin(), eos_.end(), int64_t(tok)) != eos_.end()) {
        finish = "eos";
        break;
      }
      out.push_back(tok);
      size_t before = text.size();
      text += dec.push(tok);
      if (!stops.empty() && text.size() > before) {
        size_t cut = find_stop(text, stops, before);
        if (cut != std::string::npos) {
          text.resize(cut);
          finish = "stop";
        }
      }
      if (finish.empty() && int(out.size()) >= cfg.max_new_tokens) finish = "length";
      // stream what is safe to show (held back: a suffix that may grow into a stop string)
      size_t hold = (finish.empty() && !stops.empty()) ? stop_holdback(text, stops) : 0;
      std::string piece;
      if (text.size() - hold > shown) {
        piece = text.substr(shown, text.size() - hold - shown);
        shown = text.size() - hold;
      }
      if (cb && !cb(tok, piece) && finish.empty()) finish = "cancelled";
      if (!finish.empty()) break;
    }
    if (finish.empty() && tcache_->position() >= max_seq) finish = "context";
    if (!finish.empty()) break;

    int room = max_seq - tcache_->position();
    int kk = std::min({speculative ? ctl.next_k() : 0, cfg.max_new_tokens - int(out.size()) - 1, room - 1});
    // a tree round (tree_round.cpp) when asked for and the guard still finds trees paying
    std::optional<TreeRound> tr;
    if (kk >= 1 && cfg.tree && ctl.use_tree) {
      int nodes = std::min({tree_nodes(*costs, kk), room, target_->max_call_tokens()});  // TensorRT: its largest profile
      if (tree_nodes_override) nodes = tree_nodes_override(kk, nodes);
      // a tree may go past k where its drafter's depth is free, within what is left to emit
      int depth = std::min({nodes - 1, cfg.max_new_tokens - int(out.size()) - 1, room - 1});
      tr = tree_round(tokens, kk, nodes, params, rng, depth);
    }
    if (tr) {
      fresh = tr->tokens;
      t_draft += tr->draft_s;
      t_verify += tr->verify_s;
      if (tr->drafted) {
        int n_acc = int(fresh.size()) - 1;
        ++calls;
        drafted_total += tr->drafted;
        accepted_total += n_acc;
        if (hist.size() <= size_t(tr->drafted)) hist.resize(size_t(tr->drafted) + 1, 0);
        ++hist[size_t(n_acc)];
        ctl.record_round(kk, n_acc, tr->draft_s, tr->verify_s, tr->drafted, tr->call, tr->depth, tr->chain_accepted);
      } else {
        ctl.record_plain(1, tr->verify_s);
      }
    } else if (kk >= 1) {
      double t0 = now();
      std::vector<int32_t> draft;
      // The model drafter's q rows when sampling; an n-gram lookup is deterministic and has none
      // (each token a point mass for verify_sampling), so no [k, V] one-hot rows are built.
      const std::vector<double>* q = nullptr;
      if (drafter_) {
        draft = drafter_->propose(tokens, kk, params, rng, params.greedy() ? nullptr : &q_rows_);
        q = &q_rows_;
      } else if (head_) {
        draft = head_->propose(tokens, kk, params, rng, params.greedy() ? nullptr : &q_rows_);
        q = &q_rows_;
      } else {
        draft = ngram_->propose(tokens, kk);
        draft.erase(std::remove_if(draft.begin(), draft.end(), [&](int32_t d) { return d < 0 || d >= vocab_; }),
                    draft.end());
      }
      double t1 = now();
      if (draft.empty()) {
        fresh = target_step(tokens, params, rng);
        double dt = now() - t1;
        t_draft += t1 - t0;
        t_verify += dt;
        ctl.record_plain(1, dt);
      } else {
        int position = tcache_->position();
        std::vector<int32_t> feed{tokens.back()};
        feed.insert(feed.end(), draft.begin(), draft.end());
        const float* logits = tcache_->feed(feed.data(), int(feed.size()));
        int V = target_->vocab_size();
        if (params.greedy()) {
          if (V == vocab_) {
            fresh = verify_greedy(draft, logits, V);
          } else {
            std::vector<float> rows(feed.size() * size_t(vocab_));
            for (size_t r = 0; r < feed.size(); ++r)
              std::copy(logits + r * size_t(V), logits + r * size_t(V) + vocab_, rows.begin() + long(r) * vocab_);
            fresh = verify_greedy(draft, rows.data(), vocab_);
          }
        } else {
          std::vector<double> prow, p_all(feed.size() * size_t(vocab_));
          for (size_t r = 0; r < feed.size(); ++r) {
            probs_from_logits(logits + r * size_t(V), vocab_, params, prow);
            std::copy(prow.begin(), prow.end(), p_all.begin() + long(r) * vocab_);
          }
          fresh = verify_sampling(draft, q, p_all, vocab_, rng);
        }
        tcache_->rollback(position + int(fresh.size()));
        double t2 = now();
        t_draft += t1 - t0;
        t_verify += t2 - t1;
        int n_acc = int(fresh.size()) - 1;
        ++calls;
        drafted_total += int64_t(draft.size());
        accepted_total += n_acc;
        if (hist.size() <= draft.size()) hist.resize(draft.size() + 1, 0);
        ++hist[size_t(n_acc)];
        ctl.record_round(kk, n_acc, t1 - t0, t2 - t1, int(draft.size()));
      }
    } else {
      double t0 = now();
      fresh = target_step(tokens, params, rng);
      double dt = now() - t0;
      t_verify += dt;
      if (speculative) ctl.record_plain(1, dt);
    }
    tokens.insert(tokens.end(), fresh.begin(), fresh.end());
  }

  if (finish != "stop" && finish != "cancelled") {
    text += dec.flush();
    if (!stops.empty()) {
      size_t cut = find_stop(text, stops, 0);
      if (cut != std::string::npos) {
        text.resize(cut);
        finish = "stop";
      }
    }
  }
  if (text.size() > shown && cb && finish != "cancelled") cb(-1, text.substr(shown));
  tcache_->rollback(std::min(tcache_->position(), int(tokens.size()) - 1));
  double t_end = now();
  Stats& s = res.stats;
  int64_t n = int64_t(out.size());
  double decode_s = t_end - t_first;
  s.tokens = n;
  s.prompt_tokens = int64_t(prompt.size());
  s.tokens_per_s = (n > 1 && decode_s > 0) ? double(n - 1) / decode_s : 0.0;
  s.e2e_tokens_per_s = t_end > t_start ? double(n) / (t_end - t_start) : 0.0;
  s.ttft_s = t_first - t_start;
  s.decode_s = decode_s;
  s.total_s = t_end - t_start;
  s.time_draft_s = t_draft;
  s.time_verify_s = t_verify;
  s.time_other_s = std::max(decode_s - t_draft - t_verify, 0.0);
  s.speculative = speculative;
  s.drafter = speculative ? drafter_kind() : "";
  s.target_calls = calls;
  s.drafted = drafted_total;
  s.accepted = accepted_total;
  s.acceptance_rate = drafted_total ? double(accepted_total) / double(drafted_total) : 0.0;
  s.mean_accepted = calls ? double(accepted_total + calls) / double(calls) : 0.0;
  s.accepted_histogram = hist;
  s.prefix_reused_tokens = reused;
  s.k = speculative ? ctl.k_start : 0;
  s.k_final = speculative ? ctl.k_ : 0;
  s.fallbacks = speculative ? ctl.fallbacks : 0;
  s.fallback_tokens = speculative ? ctl.fallback_tokens : 0;
  s.k_shrinks = speculative ? ctl.shrinks : 0;
  if (speculative) {
    s.k_histogram = ctl.k_histogram;
    s.alpha_estimate = ctl.alpha();
    s.draft_calls = drafter_ ? drafter_->calls() - draft_calls0 : (head_ ? head_->calls() - draft_calls0 : 0);
    s.draft_kv_copied = drafter_ ? drafter_->copied() - draft_copied0 : 0;
    s.tree_rounds = ctl.tree_rounds;
    s.trees_off = !ctl.use_tree;
  }
  res.finish_reason = finish;
  return res;
}

}  // namespace specedge
