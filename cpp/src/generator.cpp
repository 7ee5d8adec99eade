#include "generator.h"

#include <algorithm>
#include <random>

#include "error.h"
#include "text.h"
#include "tree.h"

namespace specedge {

void check_call_size(const Backend& target, int k) {
  int cap = target.max_call_tokens();
  if (k + 1 > cap)
    fail_arg("spec_tokens (k) " + std::to_string(k) + " needs " + std::to_string(k + 1) +
             " tokens per verification call, but the target's " + target.name() + " engine takes at most " +
             std::to_string(cap) + " (use k <= " + std::to_string(cap - 1) +
             ", or rebuild the engines for a larger k)");
}

// One request's running state: what was committed, its text, the policy, the counts and timings.
struct Generator::Request {
  Request(const GenConfig& c, const Tokenizer& tok, const std::vector<int32_t>& prompt, CostModel* shared,
          const CostModel& fixed, int k)
      : cfg(c),
        params(c.sampling),
        rng(c.seed ? *c.seed : (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}()),
        deterministic(!params.greedy() && c.seed.has_value()),
        local(fixed),
        costs(deterministic ? &local : shared),
        ctl(k, costs, c.guard, !deterministic, c.adaptive_k, kMaxSpecTokens, c.tree),
        text(&tok, c.stop),
        prompt(prompt),
        tokens(prompt) {}
  Request(const Request&) = delete;
  // Append a step's tokens up to the first stop rule (EOS, a stop string, the length, a cancel),
  // streaming each one's printable text.
  void commit(const std::vector<int32_t>& fresh, const std::vector<int64_t>& eos, const TokenCallback& cb);
  void record(const Round& r, bool speculative);
  const GenConfig& cfg;
  const SamplingParams& params;
  Rng rng;
  bool deterministic;
  CostModel local;  // a seeded sampling run's own copy of the fixed costs
  CostModel* costs;
  SpecController ctl;
  TextStreamer text;
  const std::vector<int32_t>& prompt;
  std::vector<int32_t> tokens, out;
  std::string finish;
  int64_t calls = 0, drafted = 0, accepted = 0;
  std::vector<int64_t> hist;  // [n]: rounds that accepted n drafts
  double t_draft = 0, t_verify = 0;
};

void Generator::Request::commit(const std::vector<int32_t>& fresh, const std::vector<int64_t>& eos,
                                const TokenCallback& cb) {
  for (int32_t tok : fresh) {
    if (std::find(eos.begin(), eos.end(), int64_t(tok)) != eos.end()) {
      finish = "eos";
      return;
    }
    out.push_back(tok);
    if (text.push(tok)) finish = "stop";
    if (finish.empty() && int(out.size()) >= cfg.max_new_tokens) finish = "length";
    std::string piece = text.release(!finish.empty());
    if (cb && !cb(tok, piece) && finish.empty()) finish = "cancelled";
    if (!finish.empty()) return;
  }
}

void Generator::Request::record(const Round& r, bool speculative) {
  t_draft += r.draft_s;
  t_verify += r.verify_s;
  if (r.drafted) {
    ++calls;
    drafted += r.drafted;
    accepted += r.accepted();
    if (hist.size() <= size_t(r.drafted)) hist.resize(size_t(r.drafted) + 1, 0);
    ++hist[size_t(r.accepted())];
    ctl.record_round(r.k, r.accepted(), r.draft_s, r.verify_s, r.drafted, r.call, r.depth, r.chain_accepted);
  } else if (speculative) {
    ctl.record_plain(1, r.verify_s);
  }
}

Generator::Generator(const Manifest& m, const Tokenizer& tok, CacheTracker& target, std::unique_ptr<Drafter> drafter,
                     int vocab, int spec_tokens, CostModel static_costs)
    : m_(m),
      tok_(tok),
      target_(target),
      view_{&target, vocab, {}},
      drafter_(std::move(drafter)),
      eos_(m.eos_token_ids),
      vocab_(vocab),
      spec_tokens_(spec_tokens),
      static_costs_(std::move(static_costs)) {}

Generator::~Generator() = default;

void Generator::reset() {
  target_.reset();
  if (drafter_) drafter_->reset();
}

std::unique_ptr<Drafter> Generator::replace_drafter(std::unique_ptr<Drafter> d) {
  std::swap(d, drafter_);
  return d;
}

GenResult Generator::run(const std::vector<int32_t>& prompt, const GenConfig& cfg, const TokenCallback& cb) {
  check(prompt, cfg);
  Request req(cfg, tok_, prompt, &costs_, static_costs_, cfg.spec_tokens ? cfg.spec_tokens : spec_tokens_);
  const bool speculative = cfg.speculative && drafter_;
  const double t_start = now();
  const int reused = target_.reuse(prompt);
  const float* row = target_.feed_chunked(prompt.data() + reused, int(prompt.size()) - reused);
  const int32_t first = view_.pick(row, req.params, req.rng);
  const double t_first = now();
  if (speculative) drafter_->start(prompt);
  const int64_t calls0 = drafter_ ? drafter_->calls() : 0, copied0 = drafter_ ? drafter_->copied() : 0;
  req.tokens.push_back(first);
  std::vector<int32_t> fresh{first};
  while (true) {
    req.commit(fresh, eos_, cb);
    if (req.finish.empty() && target_.position() >= m_.max_seq) req.finish = "context";
    if (!req.finish.empty()) break;
    Round r = step(req, speculative);
    req.record(r, speculative);
    fresh = r.tokens;
    req.tokens.insert(req.tokens.end(), fresh.begin(), fresh.end());
    if (r.drafted) drafter_->observe(req.tokens, r.drafted, r.accepted());
  }
  if (req.finish != "stop" && req.finish != "cancelled" && req.text.finish()) req.finish = "stop";
  std::string rest = req.text.rest();
  if (!rest.empty() && cb && req.finish != "cancelled") cb(-1, rest);
  // the target cache must hold only committed tokens for the next request's prefix reuse
  target_.rollback(std::min(target_.position(), int(req.tokens.size()) - 1));
  GenResult res{req.out, req.text.text, req.finish, stats(req, reused, t_start, t_first, now())};
  if (speculative) {
    res.stats.draft_calls = drafter_->calls() - calls0;
    res.stats.draft_kv_copied = drafter_->copied() - copied0;
  }
  return res;
}

// The next round: k limited by what is left to generate and by the context.
Round Generator::step(Request& req, bool speculative) {
  const int room = m_.max_seq - target_.position();  // free slots, >= 1 here
  const int left = req.cfg.max_new_tokens - int(req.out.size()) - 1;
  const int k = std::min({speculative ? req.ctl.next_k() : 0, left, room - 1});
  if (k < 1) return target_step(view_, req.tokens, req.params, req.rng);
  if (req.cfg.tree && req.ctl.use_tree) {
    // within the target's largest call (TensorRT: its largest optimization profile)
    const int nodes = std::min({tree_nodes(*req.costs, k), room, target_.backend()->max_call_tokens()});
    // a tree may go past k where its drafter's depth is free, within what is left to emit
    const int depth = std::min({nodes - 1, left, room - 1});
    return tree_round(view_, *drafter_, req.tokens, k, nodes, req.params, req.rng, depth);
  }
  return speculative_round(view_, *drafter_, req.tokens, k, req.params, req.rng);
}

void Generator::check(const std::vector<int32_t>& prompt, const GenConfig& cfg) const {
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
  if (int64_t(prompt.size()) >= m_.max_seq)
    fail_arg("the prompt has " + std::to_string(prompt.size()) + " tokens but the bundle's context holds " +
             std::to_string(m_.max_seq) + " (prompt + at least one new token must fit)");
  const Backend& target = *target_.backend();
  if (cfg.speculative && cfg.spec_tokens) check_call_size(target, cfg.spec_tokens);
  if (!cfg.tree || !cfg.speculative || !drafter_) return;
  // a tree this target cannot serve (a graph without tree calls) or not serve exactly (padded steps)
  if (!target.takes_trees()) {
    bool graph_takes = false;
    for (const auto& g : m_.target.graphs) graph_takes = graph_takes || g.tree;
    fail_arg(tree_refusal(graph_takes, target.name()));
  }
  if (target_.invariant_steps()) fail_arg(inexact_tree_refusal(m_.target.precision));
}

Stats Generator::stats(const Request& req, int reused, double t_start, double t_first, double t_end) const {
  Stats s;
  const int64_t n = int64_t(req.out.size());
  const bool speculative = req.cfg.speculative && drafter_;
  const SpecController& ctl = req.ctl;
  s.tokens = n;
  s.prompt_tokens = int64_t(req.prompt.size());
  s.decode_s = t_end - t_first;
  s.tokens_per_s = (n > 1 && s.decode_s > 0) ? double(n - 1) / s.decode_s : 0.0;
  s.e2e_tokens_per_s = t_end > t_start ? double(n) / (t_end - t_start) : 0.0;
  s.ttft_s = t_first - t_start;
  s.total_s = t_end - t_start;
  s.time_draft_s = req.t_draft;
  s.time_verify_s = req.t_verify;
  s.time_other_s = std::max(s.decode_s - req.t_draft - req.t_verify, 0.0);
  s.speculative = speculative;
  s.drafter = speculative ? drafter_->kind() : "";
  s.target_calls = req.calls;
  s.drafted = req.drafted;
  s.accepted = req.accepted;
  s.acceptance_rate = req.drafted ? double(req.accepted) / double(req.drafted) : 0.0;
  s.mean_accepted = req.calls ? double(req.accepted + req.calls) / double(req.calls) : 0.0;
  s.accepted_histogram = req.hist;
  s.prefix_reused_tokens = reused;
  if (!speculative) return s;
  s.k = ctl.k_start;
  s.k_final = ctl.k_;
  s.fallbacks = ctl.fallbacks;
  s.fallback_tokens = ctl.fallback_tokens;
  s.k_shrinks = ctl.shrinks;
  s.k_histogram = ctl.k_histogram;
  s.alpha_estimate = ctl.alpha();
  s.tree_rounds = ctl.tree_rounds;
  s.trees_off = !ctl.use_tree;
  return s;
}

}  // namespace specedge
