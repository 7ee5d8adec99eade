// Draft-head drafter tests (drafters/head.h). They need SPECEDGE_TINY_BUNDLES/head_scatter, a tiny
// bundle with target features and a trained head, and scatter_self/ (tests/test_cpp.py makes them);
// without them they are skipped with a message. The hidden case [head_replay] replays a trace of
// the Python head drafter's proposals ($SPECEDGE_HEAD_TRACE, written by tests/test_cpp.py) and
// checks every proposal; [head_tree_replay] does the same with the Python head's trees
// ($SPECEDGE_HEAD_TREE_TRACE).
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "catch.h"
#include "engine.h"
#include "specedge.h"
#include "error.h"
#include "drafters/head.h"
#include "manifest.h"
#include "ort_backend.h"

namespace fs = std::filesystem;
using namespace specedge;

namespace {
std::string tiny_bundle(const char* name) {
  const char* root = std::getenv("SPECEDGE_TINY_BUNDLES");
  if (!root) return "";
  fs::path p = fs::path(root) / name;
  return fs::exists(p / "manifest.json") ? p.string() : "";
}
#define NEED_TINY(var, name)                                                                \
  std::string var = tiny_bundle(name);                                                      \
  if (var.empty()) {                                                                        \
    WARN("skipped: SPECEDGE_TINY_BUNDLES/" name " not set up (tests/test_cpp.py sets it)"); \
    return;                                                                                 \
  }

EngineOptions head_options() {
  EngineOptions o;
  o.draft = "head";
  o.backend.threads = 1;
  o.warmup = false;
  return o;
}

// The engine's own drafter, shown to a test: every proposal passes through here on its way to the
// loop, and a tree round may be given another size (a replay gives each round the size Python's
// had, since sizes follow measured costs). Nothing in the engine knows it is watched.
struct Watched : Drafter {
  std::unique_ptr<Drafter> inner;
  std::function<void(const std::vector<int32_t>&, const std::vector<int32_t>&, const std::vector<double>*)> on_chain;
  std::function<void(const std::vector<int32_t>&, const Tree*)> on_tree;
  std::function<int(int, int)> tree_nodes;  // (k, nodes) -> the nodes this tree gets instead
  std::function<void(const std::vector<int32_t>&, int, int)> on_observe;
  explicit Watched(std::unique_ptr<Drafter> d) : inner(std::move(d)) {}
  std::string kind() const override { return inner->kind(); }
  void reset() override { inner->reset(); }
  void start(const std::vector<int32_t>& prompt) override { inner->start(prompt); }
  int64_t calls() const override { return inner->calls(); }
  int64_t copied() const override { return inner->copied(); }
  void observe(const std::vector<int32_t>& h, int drafted, int accepted) override {
    if (on_observe) on_observe(h, drafted, accepted);
    inner->observe(h, drafted, accepted);
  }
  Proposal propose(const std::vector<int32_t>& h, int k, const SamplingParams& p, Rng& rng) override {
    Proposal out = inner->propose(h, k, p, rng);
    if (on_chain) on_chain(h, out.tokens, out.q);
    return out;
  }
  std::optional<Tree> propose_tree(const std::vector<int32_t>& h, int k, int nodes, const SamplingParams& p, Rng& rng,
                                   int depth) override {
    if (tree_nodes) nodes = tree_nodes(k, nodes);
    std::optional<Tree> t = inner->propose_tree(h, k, nodes, p, rng, depth);
    if (on_tree) on_tree(h, t ? &*t : nullptr);
    return t;
  }
};

Watched& watch(Engine& e) {
  auto w = std::make_unique<Watched>(nullptr);
  Watched& ref = *w;
  ref.inner = e.generator().replace_drafter(std::move(w));
  return ref;
}

HeadDrafter* head_of(Engine& e) { return dynamic_cast<HeadDrafter*>(e.generator().drafter()); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

const char* kPrompts[] = {"hello there", "def add(a, b):", "The quick brown fox", "for i in range(10):"};
}  // namespace

TEST_CASE("head drafter: the draft vocabulary map; no draft outside it, q rows zero outside it") {
  NEED_TINY(b, "head_scatter");
  Manifest m = load_manifest(b);
  REQUIRE(m.has_head);
  std::vector<int32_t> d2t = read_draft_vocab(m);
  std::set<int32_t> allowed(d2t.begin(), d2t.end());
  REQUIRE(int64_t(d2t.size()) == m.head.vocab_size);
  REQUIRE(allowed.size() == d2t.size());  // distinct
  Engine e(b, head_options());
  CHECK(e.drafter_kind() == "head");
  REQUIRE(head_of(e) != nullptr);
  CHECK(head_of(e)->d2t() == d2t);
  const int V = e.vocab();
  REQUIRE(int(allowed.size()) < V);  // a real reduction: ids outside the map exist and never appear
  CHECK(*allowed.rbegin() < V);
  int64_t seen = 0, rows = 0;
  watch(e).on_chain = [&](const std::vector<int32_t>&, const std::vector<int32_t>& drafts,
                          const std::vector<double>* q) {
    for (int32_t t : drafts) CHECK(allowed.count(t) == 1);
    seen += int64_t(drafts.size());
    if (!q) return;
    REQUIRE(q->size() == drafts.size() * size_t(V));
    for (size_t j = 0; j < drafts.size(); ++j) {
      double sum = 0;
      for (int i = 0; i < V; ++i) {
        double x = (*q)[j * size_t(V) + size_t(i)];
        if (!allowed.count(i)) CHECK(x == 0.0);
        sum += x;
      }
      CHECK(std::abs(sum - 1.0) < 1e-9);
      CHECK((*q)[j * size_t(V) + size_t(drafts[j])] > 0.0);  // a sampled draft had mass
      ++rows;
    }
  };
  for (const char* p : kPrompts) {
    GenConfig g;
    g.max_new_tokens = 24;
    g.guard = false;
    GenResult greedy = e.generate(e.encode(p), g, nullptr);
    CHECK(greedy.stats.drafter == "head");
    CHECK(greedy.stats.draft_calls > 0);
    g.sampling.temperature = 0.9;
    g.seed = 3;
    GenResult a = e.generate(e.encode(p), g, nullptr);
    GenResult again = e.generate(e.encode(p), g, nullptr);  // seeded sampling repeats run to run
    CHECK(a.token_ids == again.token_ids);
    CHECK(a.stats.drafted == again.stats.drafted);
    CHECK(a.stats.accepted == again.stats.accepted);
  }
  CHECK(seen > 0);
  CHECK(rows > 0);
}

TEST_CASE("the loop tells its drafter what each speculative round kept (Drafter::observe)") {
  NEED_TINY(b, "head_scatter");
  Engine e(b, head_options());
  Watched& w = watch(e);
  bool takes_trees = false;  // a bundle exported with --tree: tree rounds tell it too
  for (const auto& gr : e.manifest().target.graphs) takes_trees = takes_trees || gr.tree;
  for (bool tree : {false, takes_trees}) {
    int64_t rounds = 0, drafted = 0, accepted = 0;
    std::vector<int32_t> last;
    w.on_observe = [&](const std::vector<int32_t>& h, int d, int a) {
      CHECK(d >= 1);
      CHECK((a >= 0 && a <= d));
      ++rounds;
      drafted += d;
      accepted += a;
      last = h;
    };
    GenConfig g;
    g.max_new_tokens = 24;
    g.guard = false;
    g.tree = tree;
    std::vector<int32_t> prompt = e.encode("def add(a, b):");
    GenResult r = e.generate(prompt, g, nullptr);
    INFO("tree " << tree);
    CHECK(rounds > 0);
    CHECK(rounds == r.stats.target_calls);  // one call per round that verified drafts
    CHECK(drafted == r.stats.drafted);
    CHECK(accepted == r.stats.accepted);
    // the history it is given is the committed sequence: the prompt, then the ids generated
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), r.token_ids.begin(), r.token_ids.end());
    REQUIRE(last.size() <= all.size() + 1);  // the last round's target token may be an EOS
    CHECK(std::equal(last.begin(), last.begin() + long(std::min(last.size(), all.size())), all.begin()));
  }
}

TEST_CASE("head drafter: refusals, each one sentence") {
  NEED_TINY(plain, "scatter_self");
  NEED_TINY(b, "head_scatter");
  CHECK(error_of([&] { Engine e(plain, head_options()); }) ==
        "this bundle has no draft head: train one with `specedge train-draft BUNDLE`");
  // a TensorRT target is no head refusal (the head runs on ort-cpu beside it): a build without TensorRT says so
  EngineOptions trt = head_options();
  trt.backend.backend = "tensorrt";
  if (!tensorrt_compiled()) CHECK(error_of([&] { Engine e(b, trt); }) == no_tensorrt_message());
  // the bundle's other drafters still run, and the target keeps no features for them
  EngineOptions own = head_options();
  own.draft = "";
  Engine e(b, own);
  CHECK(e.drafter_kind() == "model");
  CHECK(head_of(e) == nullptr);

  Manifest m = load_manifest(b);
  BackendOptions bo;
  bo.threads = 1;
  OrtBackend head(m, m.head, bo), target(m, m.target, bo);
  CHECK(head.hidden_size() == m.head.hidden_size);
  CHECK(target.features() == nullptr);  // nothing kept until a head drafter asks
  std::vector<int32_t> d2t = read_draft_vocab(m);
  const int V = int(m.target.vocab_size);
  std::vector<int32_t> short_map(d2t.begin(), d2t.end() - 1), outside = d2t;
  outside.back() = V;
  CHECK(error_of([&] { HeadDrafter h(&head, nullptr, short_map, V, 16); }) ==
        "the draft vocabulary map has " + std::to_string(d2t.size() - 1) + " ids, the head's logits " +
            std::to_string(d2t.size()));
  CHECK(error_of([&] { HeadDrafter h(&head, nullptr, outside, V, 16); }) ==
        "the draft vocabulary map names ids outside the target's vocabulary");
  SamplingParams greedy;
  Rng rng(1);
  {
    HeadDrafter h(&head, nullptr, d2t, V, 16);
    CHECK(h.propose({5}, 4, greedy, rng, nullptr).empty());  // one token: no target features yet
    CHECK(h.propose({5, 6}, 0, greedy, rng, nullptr).empty());
    CHECK(error_of([&] { h.propose({5, 6, 7}, 2, greedy, rng, nullptr); }) ==
          "the head drafter was not given the target's cache");
  }
  CacheTracker tc(&target, m.prefill_chunk);
  const int32_t ids[] = {5, 6, 7};
  tc.feed(ids, 3);
  HeadDrafter h(&head, &tc, d2t, V, 16);
  CHECK(error_of([&] { h.propose({5, 6, 7, 8}, 2, greedy, rng, nullptr); }) ==
        "the target backend 'ort-cpu' does not return target features: head drafting needs a bundle exported with "
        "features");
  CHECK(error_of([&] { h.propose({5, 9, 7, 8}, 2, greedy, rng, nullptr); }) ==
        "the target's cache does not hold the committed sequence the head drafts after");
  REQUIRE(target.keep_features());
  REQUIRE(target.feature_dim() == m.head.feature_dim);
  tc.rollback(0);
  tc.feed(ids, 3);
  std::vector<int32_t> drafts = h.propose({5, 6, 7, 8}, 3, greedy, rng, nullptr);
  CHECK(drafts.size() == 3);
  CHECK(h.calls() == 3);  // one catch-up call (3 slots, one chunk) + 2 chained steps
}

TEST_CASE("head drafter: a tree is its greedy chain plus ranked runner-ups in its vocabulary") {
  NEED_TINY(b, "head_scatter");
  Manifest m = load_manifest(b);
  BackendOptions bo;
  bo.threads = 1;
  OrtBackend head(m, m.head, bo), target(m, m.target, bo);
  REQUIRE(target.keep_features());
  std::vector<int32_t> d2t = read_draft_vocab(m);
  std::set<int32_t> allowed(d2t.begin(), d2t.end());
  const int V = int(m.target.vocab_size);
  CacheTracker tc(&target, m.prefill_chunk);
  const int32_t ids[] = {5, 6, 7, 9, 11};
  tc.feed(ids, 5);
  HeadDrafter h(&head, &tc, d2t, V, 16);
  const std::vector<int32_t> history{5, 6, 7, 9, 11, 8};
  SamplingParams greedy;
  Rng rng(1);
  std::vector<int32_t> chain = h.propose(history, 4, greedy, rng, nullptr);
  int64_t calls = h.calls();
  std::optional<Tree> t = h.propose_tree(history, 4, 10, greedy, rng);
  REQUIRE(t);
  CHECK(h.calls() - calls == 4);  // the chain's calls (a catch-up plus k - 1 steps), no more
  REQUIRE(t->size() == 10);
  CHECK(std::vector<int32_t>(t->tokens.begin(), t->tokens.begin() + 5) ==
        std::vector<int32_t>{history.back(), chain[0], chain[1], chain[2], chain[3]});
  CHECK(std::vector<int>(t->parents.begin(), t->parents.begin() + 5) == std::vector<int>{-1, 0, 1, 2, 3});
  for (int i = 1; i < t->size(); ++i) CHECK(allowed.count(t->tokens[size_t(i)]) == 1);  // mapped through d2t
  for (int i = 5; i < t->size(); ++i) {  // leaf siblings of chain nodes, each unlike the chain token at its depth
    CHECK(t->parents[size_t(i)] < 4);
    CHECK(t->children(i).empty());
    CHECK(t->tokens[size_t(i)] != t->tokens[size_t(t->parents[size_t(i)] + 1)]);
  }
  CHECK(t->q.empty());                                             // greedy: point masses
  CHECK(h.propose_tree(history, 4, 3, greedy, rng)->size() == 3);  // cut to the nodes asked for
  CHECK(!h.propose_tree(history, 4, 1, greedy, rng));
  CHECK(!h.propose_tree(history, 0, 8, greedy, rng));
  CHECK(!h.propose_tree({5}, 4, 8, greedy, rng));  // no target features yet
  // sampling: the first line is the chain propose samples with the same draws, with its q rows
  // (over the target's ids); the siblings are point masses
  SamplingParams warm;
  warm.temperature = 0.9;
  Rng ra(11), rb(11);
  std::vector<double> q;
  std::vector<int32_t> sampled = h.propose(history, 4, warm, ra, &q);
  std::optional<Tree> st = h.propose_tree(history, 4, 10, warm, rb);
  REQUIRE(st);
  REQUIRE(st->size() == 10);
  REQUIRE(st->q.size() == 10);
  CHECK(ra.uniform() == rb.uniform());  // the same number of draws
  for (int j = 0; j < 4; ++j) {
    CHECK(st->tokens[size_t(j) + 1] == sampled[size_t(j)]);
    CHECK(st->q[size_t(j) + 1] == std::vector<double>(q.begin() + long(j) * V, q.begin() + long(j + 1) * V));
  }
  for (int i = 5; i < st->size(); ++i) {
    CHECK(st->q[size_t(i)].empty());
    CHECK(st->tokens[size_t(i)] != st->tokens[size_t(st->parents[size_t(i)] + 1)]);
    CHECK(allowed.count(st->tokens[size_t(i)]) == 1);
  }
}

TEST_CASE("head drafter: every proposal of a recorded Python trace", "[.][head_replay]") {
  const char* path = std::getenv("SPECEDGE_HEAD_TRACE");
  REQUIRE(path != nullptr);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json trace = nlohmann::json::parse(ss.str());
  Engine e(trace["bundle"].get<std::string>(), head_options());
  Watched& w = watch(e);
  size_t checked = 0;
  for (const auto& run : trace["runs"]) {
    std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> got;
    w.on_chain = [&](const std::vector<int32_t>& h, const std::vector<int32_t>& d, const std::vector<double>*) {
      got.emplace_back(h, d);
    };
    GenConfig g;
    g.max_new_tokens = run["max_new_tokens"].get<int>();
    g.spec_tokens = run["spec_tokens"].get<int>();
    g.guard = false;
    GenResult r = e.generate(e.encode(run["prompt"].get<std::string>()), g, nullptr);
    const auto& want = run["proposals"];
    INFO("prompt: " << run["prompt"].get<std::string>());
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("proposal " << i);
      CHECK(got[i].first == want[i][0].get<std::vector<int32_t>>());
      CHECK(got[i].second == want[i][1].get<std::vector<int32_t>>());
      ++checked;
    }
    CHECK(r.token_ids == run["token_ids"].get<std::vector<int32_t>>());
    CHECK(r.stats.drafted == run["drafted"].get<int64_t>());
    CHECK(r.stats.accepted == run["accepted"].get<int64_t>());
    CHECK(r.stats.draft_calls == run["draft_calls"].get<int64_t>());
    CHECK(r.stats.prefix_reused_tokens == run["prefix_reused_tokens"].get<int64_t>());
  }
  std::cout << "head replay: " << checked << " proposals checked\n";
}

TEST_CASE("head drafter: every tree of a recorded Python trace", "[.][head_tree_replay]") {
  const char* path = std::getenv("SPECEDGE_HEAD_TREE_TRACE");
  REQUIRE(path != nullptr);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json trace = nlohmann::json::parse(ss.str());
  Engine e(trace["bundle"].get<std::string>(), head_options());
  Watched& w = watch(e);
  size_t checked = 0;
  for (const auto& run : trace["runs"]) {
    // (history, tokens, parents; empty tokens: no tree)
    std::vector<std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<int>>> got;
    // each round gets the tree size Python's had (sizes follow measured costs: timing noise)
    const auto& want = run["trees"];
    size_t round = 0;
    w.tree_nodes = [&](int k, int nodes) {
      REQUIRE(round < want.size());
      CHECK(k == want[round][2].get<int>());
      CHECK(nodes >= k + 1);
      return want[round++][3].get<int>();
    };
    w.on_tree = [&](const std::vector<int32_t>& h, const Tree* t) {
      if (t)
        got.emplace_back(h, t->tokens, t->parents);
      else
        got.emplace_back(h, std::vector<int32_t>{}, std::vector<int>{});
    };
    GenConfig g;
    g.max_new_tokens = run["max_new_tokens"].get<int>();
    g.spec_tokens = run["spec_tokens"].get<int>();
    g.guard = false;
    g.tree = true;
    GenResult r = e.generate(e.encode(run["prompt"].get<std::string>()), g, nullptr);
    w.on_tree = nullptr;
    w.tree_nodes = nullptr;
    INFO("prompt: " << run["prompt"].get<std::string>());
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("tree " << i);
      CHECK(std::get<0>(got[i]) == want[i][0].get<std::vector<int32_t>>());
      if (want[i][1].is_null()) {
        CHECK(std::get<1>(got[i]).empty());
        continue;
      }
      CHECK(std::get<1>(got[i]) == want[i][1][0].get<std::vector<int32_t>>());
      CHECK(std::get<2>(got[i]) == want[i][1][1].get<std::vector<int>>());
      ++checked;
    }
    CHECK(r.token_ids == run["token_ids"].get<std::vector<int32_t>>());
    CHECK(r.stats.drafted == run["drafted"].get<int64_t>());
    CHECK(r.stats.accepted == run["accepted"].get<int64_t>());
    CHECK(r.stats.draft_calls == run["draft_calls"].get<int64_t>());
    CHECK(r.stats.tree_rounds == run["tree_rounds"].get<int64_t>());
    CHECK(round == want.size());
  }
  std::cout << "head tree replay: " << checked << " trees checked\n";
}

TEST_CASE("head drafter: through the C API (draft \"head\")") {
  NEED_TINY(b, "head_scatter");
  NEED_TINY(plain, "scatter_self");
  specedge_open_options co;
  specedge_open_options_init(&co);
  co.threads = 1;
  co.warmup = 0;
  co.draft = "head";
  specedge_model* m = nullptr;
  REQUIRE(specedge_open(b.c_str(), &co, &m) == SPECEDGE_OK);
  CHECK(std::string(specedge_drafter_kind(m)) == "head");
  specedge_gen_params gp;
  specedge_gen_params_init(&gp);
  gp.max_new_tokens = 24;
  gp.guard = 0;
  specedge_result* r = nullptr;
  REQUIRE(specedge_generate(m, "def add(a, b):", &gp, nullptr, nullptr, &r) == SPECEDGE_OK);
  size_t n = 0;
  const int32_t* ids = specedge_result_tokens(r, &n);
  std::vector<int32_t> got(ids, ids + n);
  specedge_stats st;
  specedge_result_stats(r, &st);
  CHECK(st.speculative == 1);
  CHECK(st.drafted > 0);
  CHECK(st.draft_calls > 0);
  specedge_result_free(r);
  specedge_close(m);
  Engine e(b, head_options());
  GenConfig g;
  g.max_new_tokens = 24;
  g.guard = false;
  CHECK(e.generate(e.encode("def add(a, b):"), g, nullptr).token_ids == got);
  // a bundle without a head: the status and the sentence
  m = nullptr;
  CHECK(specedge_open(plain.c_str(), &co, &m) == SPECEDGE_ERR_INVALID_ARGUMENT);
  CHECK(m == nullptr);
  CHECK(std::string(specedge_last_error()) ==
        "this bundle has no draft head: train one with `specedge train-draft BUNDLE`");
}
