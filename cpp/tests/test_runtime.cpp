// C API and end-to-end tests. The end-to-end cases need tiny exported bundles: set
// SPECEDGE_TINY_BUNDLES to a folder holding scatter_self/, delta_self/ and delta_ngram/
// (tests/test_cpp.py does); without it they are skipped with a message.
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <string>
#include <vector>

#include <onnxruntime_cxx_api.h>

#include "catch.h"
#include "manifest.h"
#include "ort_backend.h"
#include "specedge.h"
#include "specedge.hpp"

namespace fs = std::filesystem;

namespace {
std::string tiny(const char* name) {
  const char* root = std::getenv("SPECEDGE_TINY_BUNDLES");
  if (!root) return "";
  fs::path p = fs::path(root) / name;
  return fs::exists(p / "manifest.json") ? p.string() : "";
}
#define NEED_BUNDLE(var, name)                                                              \
  std::string var = tiny(name);                                                             \
  if (var.empty()) {                                                                        \
    WARN("skipped: SPECEDGE_TINY_BUNDLES/" name " not set up (tests/test_cpp.py sets it)"); \
    return;                                                                                 \
  }

specedge::Model open(const std::string& b, const char* draft = nullptr) {
  specedge::OpenOptions o;
  o.threads(1).warmup(false);
  if (draft) o.draft(draft);
  return specedge::Model(b, o);
}
}  // namespace

TEST_CASE("C API: errors are codes plus one sentence, never exceptions") {
  specedge_model* m = reinterpret_cast<specedge_model*>(0x1);
  CHECK(specedge_open("/nonexistent", nullptr, &m) == SPECEDGE_ERR_BUNDLE);
  CHECK(m == nullptr);
  CHECK(std::string(specedge_last_error()) == "bundle '/nonexistent' does not exist");
  CHECK(specedge_open(nullptr, nullptr, &m) == SPECEDGE_ERR_INVALID_ARGUMENT);
  specedge_result* r = nullptr;
  CHECK(specedge_generate(nullptr, "x", nullptr, nullptr, nullptr, &r) == SPECEDGE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(specedge_status_name(SPECEDGE_ERR_BUNDLE)) == "bad bundle");
  CHECK(std::string(specedge_version()) == SPECEDGE_VERSION);
  specedge_close(nullptr);
  specedge_result_free(nullptr);
  try {
    specedge::Model bad("/nonexistent");
    FAIL("opened");
  } catch (const specedge::Exception& e) {
    CHECK(e.status() == SPECEDGE_ERR_BUNDLE);
  }
}

TEST_CASE("end to end: speculative greedy equals target-only greedy; scatter equals delta") {
  NEED_BUNDLE(scatter, "scatter_self");
  NEED_BUNDLE(delta, "delta_self");
  NEED_BUNDLE(ngram, "delta_ngram");
  specedge::GenParams gp;
  gp.max_new_tokens = 40;
  std::vector<std::vector<int32_t>> outs;
  for (const auto& b : {scatter, delta, ngram}) {
    auto m = open(b);
    for (bool spec : {true, false}) {
      gp.speculative = spec;
      auto r = m.generate("def add(a, b):", gp);
      CHECK(r.token_ids.size() >= 1);
      CHECK(r.stats.speculative == int(spec));
      if (spec) CHECK(r.stats.target_calls >= 0);
      CHECK(r.text == m.detokenize(r.token_ids));
      outs.push_back(r.token_ids);
    }
  }
  for (const auto& o : outs) CHECK(o == outs[0]);
}

TEST_CASE("C API: adaptive k is off by default, and moves k without changing greedy output") {
  specedge_gen_params d;
  specedge_gen_params_init(&d);
  CHECK(d.adaptive_k == 0);
  NEED_BUNDLE(b, "delta_ngram");
  auto m = open(b);
  specedge::GenParams gp;
  gp.max_new_tokens = 48;
  gp.spec_tokens = 2;
  gp.guard = false;
  // the n-gram drafter proposes whole k-token drafts on a repeating prompt
  const std::string prompt = "1 2 3 1 2 3 1 2 3 1 2 3";
  auto fixed = m.generate(prompt, gp);
  gp.adaptive_k = true;
  auto adaptive = m.generate(prompt, gp);
  CHECK(adaptive.token_ids == fixed.token_ids);
  auto largest_k = [](const specedge_stats& s) {
    int k = 0;
    for (int i = 0; i <= SPECEDGE_MAX_SPEC_TOKENS; ++i)
      if (s.k_histogram[i]) k = i;
    return k;
  };
  CHECK(largest_k(fixed.stats) == 2);
  CHECK(adaptive.stats.accepted > 0);
  CHECK(largest_k(adaptive.stats) > 2);
}

TEST_CASE("end to end: streaming callback, cancellation, stop strings, errors") {
  NEED_BUNDLE(b, "scatter_self");
  auto m = open(b);
  specedge::GenParams gp;
  gp.max_new_tokens = 24;
  gp.guard = false;
  std::string streamed;
  std::vector<int32_t> seen;
  auto r = m.generate("The quick brown fox", gp, [&](int32_t tok, std::string_view text) {
    if (tok >= 0) seen.push_back(tok);
    streamed += text;
    return true;
  });
  CHECK(seen == r.token_ids);
  CHECK(streamed == r.text);

  int calls = 0;
  auto c = m.generate("The quick brown fox", gp, [&](int32_t, std::string_view) { return ++calls < 3; });
  CHECK(c.finish_reason == "cancelled");
  CHECK(c.token_ids.size() == 3);
  CHECK(c.token_ids == std::vector<int32_t>(r.token_ids.begin(), r.token_ids.begin() + 3));

  if (r.text.size() > 4) {  // a stop string taken from the output itself
    specedge::GenParams sp = gp;
    sp.stop = {r.text.substr(2, 2)};
    std::string s2;
    auto s = m.generate("The quick brown fox", sp, [&](int32_t, std::string_view t) {
      s2 += t;
      return true;
    });
    CHECK(s.finish_reason == "stop");
    CHECK(s.text == r.text.substr(0, r.text.find(sp.stop[0])));
    CHECK(s2 == s.text);
  }
  // an exception thrown by a C++ callback comes back as itself
  CHECK_THROWS_AS(m.generate("hi", gp, [](int32_t, std::string_view) -> bool { throw std::logic_error("x"); }),
                  std::logic_error);
  // bad input
  specedge::GenParams bad = gp;
  bad.max_new_tokens = 0;
  CHECK_THROWS_AS(m.generate("hi", bad), specedge::Exception);
  bad = gp;
  bad.temperature = -1;
  CHECK_THROWS_AS(m.generate("hi", bad), specedge::Exception);
  CHECK_THROWS_AS(m.generate(std::string(""), gp), specedge::Exception);
  CHECK_THROWS_AS(m.generate(std::vector<int32_t>{999999}, gp), specedge::Exception);
  std::vector<int32_t> too_long(size_t(m.max_seq()), 5);
  try {
    m.generate(too_long, gp);
    FAIL("accepted");
  } catch (const specedge::Exception& e) {
    CHECK(e.status() == SPECEDGE_ERR_INVALID_ARGUMENT);
    CHECK(std::string(e.what()).find("context holds") != std::string::npos);
  }
}

TEST_CASE("end to end: context end, seeded sampling, n-gram drafter on a model bundle") {
  NEED_BUNDLE(b, "scatter_self");
  auto m = open(b);
  specedge::GenParams gp;
  gp.max_new_tokens = 100000;
  std::vector<int32_t> prompt(size_t(m.max_seq() - 8), 0);
  auto p = m.tokenize("hello there");
  std::copy(p.begin(), p.end(), prompt.begin());
  for (size_t i = p.size(); i < prompt.size(); ++i) prompt[i] = p[i % p.size()];
  auto r = m.generate(prompt, gp);
  CHECK((r.finish_reason == "context" || r.finish_reason == "eos"));
  // the cache holds every token but the last: prompt + output = max_seq + 1
  if (r.finish_reason == "context") CHECK(int(prompt.size() + r.token_ids.size()) == m.max_seq() + 1);

  specedge::GenParams s;
  s.max_new_tokens = 30;
  s.temperature = 0.8;
  s.top_k = 50;
  s.top_p = 0.95;
  s.seed = 1234;
  auto a = m.generate("The quick brown fox", s);
  auto a2 = m.generate("The quick brown fox", s);
  CHECK(a.token_ids == a2.token_ids);  // same seed, same output

  auto n = open(b, "ngram");
  CHECK(n.drafter_kind() == "ngram");
  specedge::GenParams g;
  g.max_new_tokens = 30;
  auto x = n.generate("a, b, c -> a; b; c", g);
  auto y = m.generate("a, b, c -> a; b; c", g);
  CHECK(x.token_ids == y.token_ids);
}

TEST_CASE("chat formats") {
  NEED_BUNDLE(b, "scatter_self");
  auto m = open(b);
  // the tiny bundles' template is neither ChatML nor Gemma: refused with one sentence
  CHECK_THROWS_AS(m.apply_chat({{"user", "hi"}}), specedge::Exception);
}

TEST_CASE("one handle per thread: concurrent generations agree") {
  NEED_BUNDLE(b, "scatter_self");
  specedge::GenParams gp;
  gp.max_new_tokens = 16;
  std::vector<int32_t> ref = open(b).generate("The quick brown fox", gp).token_ids;
  std::vector<std::vector<int32_t>> got(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i)
    threads.emplace_back([&, i] {
      auto m = open(b);
      got[size_t(i)] = m.generate("The quick brown fox", gp).token_ids;
    });
  for (auto& t : threads) t.join();
  CHECK(got[0] == ref);
  CHECK(got[1] == ref);
}

TEST_CASE("one handle shared by threads: generations take turns and agree with one thread's") {
  NEED_BUNDLE(b, "scatter_self");
  NEED_BUNDLE(ng, "delta_ngram");
  for (const auto& bundle : {b, ng}) {
    auto m = open(bundle);
    specedge::GenParams gp;
    gp.max_new_tokens = 24;
    const std::vector<std::string> prompts = {"The quick brown fox", "def add(a, b):", "Once upon a time",
                                              "1, 2, 3, 4,"};
    std::vector<std::vector<int32_t>> ref;
    for (const auto& p : prompts) ref.push_back(m.generate(p, gp).token_ids);
    std::vector<std::vector<int32_t>> got(prompts.size() * 3);
    std::vector<std::string> errors(got.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < got.size(); ++i)
      threads.emplace_back([&, i] {
        try {
          got[i] = m.generate(prompts[i % prompts.size()], gp).token_ids;
        } catch (const specedge::Exception& e) {
          errors[i] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < got.size(); ++i) {
      CHECK(errors[i] == "");
      CHECK(got[i] == ref[i % prompts.size()]);
    }
  }
}

TEST_CASE("one handle: a generation started from its own token callback is refused, not deadlocked") {
  NEED_BUNDLE(b, "scatter_self");
  auto m = open(b);
  specedge::GenParams gp;
  gp.max_new_tokens = 6;
  std::string inner;
  auto outer = m.generate("The quick brown fox", gp, [&](int32_t, std::string_view) {
    if (inner.empty()) {
      try {
        m.generate("hello", gp);
        inner = "ran";
      } catch (const specedge::Exception& e) {
        inner = e.what();
        CHECK(e.status() == SPECEDGE_ERR_INVALID_ARGUMENT);
      }
    }
    return true;
  });
  CHECK(inner.find("the model is busy") == 0);
  CHECK(outer.token_ids.size() == 6);
  // the handle is free again afterwards
  CHECK(m.generate("hello", gp).token_ids.size() >= 1);
}

TEST_CASE("C API: invalid UTF-8 and too many threads are refused with one sentence") {
  specedge_open_options o;
  specedge_open_options_init(&o);
  o.threads = 100000;
  specedge_model* h = nullptr;
  CHECK(specedge_open("/nonexistent", &o, &h) == SPECEDGE_ERR_INVALID_ARGUMENT);
  CHECK(std::string(specedge_last_error()) == "threads must be <= 1024, got 100000");
  NEED_BUNDLE(b, "scatter_self");
  auto m = open(b);
  specedge::GenParams gp;
  gp.max_new_tokens = 2;
  for (const char* bad : {"\xff\xfe", "caf\xc3", "\xed\xa0\x80", "\xc0\xaf", "\xf4\x90\x80\x80"}) {
    try {
      m.generate(bad, gp);
      FAIL("accepted invalid UTF-8");
    } catch (const specedge::Exception& e) {
      CHECK(e.status() == SPECEDGE_ERR_INVALID_ARGUMENT);
      CHECK(std::string(e.what()) == "the prompt is not valid UTF-8 text");
    }
  }
  CHECK(m.generate("caf\xc3\xa9 \xf0\x9f\x99\x82", gp).token_ids.size() >= 1);
}

TEST_CASE("threads: a second session with the same options joins the process's pool") {
  NEED_BUNDLE(b, "scatter_self");
  specedge::Manifest m = specedge::load_manifest(b, "full");
  specedge::BackendOptions o;
  o.threads = 1;
  specedge::OrtBackend target(m, m.target, o);
  o.alternating = true;
  specedge::OrtBackend draft(m, m.draft, o);
  // whichever backend came first in this process sized the pool: both agree with it
  CHECK(draft.threading().shared_pool == target.threading().shared_pool);
  specedge::BackendOptions other = o;
  other.threads = 7;  // no test opens a 7-thread backend first
  specedge::OrtBackend own(m, m.target, other);
  CHECK_FALSE(own.threading().shared_pool);
  CHECK_FALSE(own.threading().spinning);  // alternating, auto: no spinning on its own pool
  std::vector<int32_t> ids{1, 2, 3};
  const float* a = target.run(ids.data(), 3, 0);
  std::vector<float> row(a, a + target.vocab_size());
  const float* c = own.run(ids.data(), 3, 0);  // the same graph on its own pool: the same logits
  for (int i = 0; i < target.vocab_size(); ++i) REQUIRE(std::abs(c[i] - row[size_t(i)]) < 1e-3f);
}

// Hidden: run alone in a fresh process (tests/test_cpp.py does), since it must make ONNX Runtime's
// environment before specedge does, as a host application would.
TEST_CASE("threads: a host application's ORT environment without global pools", "[.][hostenv]") {
  NEED_BUNDLE(b, "scatter_self");
  Ort::Env host(ORT_LOGGING_LEVEL_ERROR, "host app");  // ORT's one environment: no global pools
  specedge::Manifest m = specedge::load_manifest(b, "full");
  specedge::BackendOptions o;
  o.threads = 1;
  specedge::OrtBackend target(m, m.target, o);  // asks for the shared pool, gets its own
  CHECK_FALSE(target.threading().shared_pool);
  CHECK(target.threading().spinning);
  o.alternating = true;
  specedge::OrtBackend draft(m, m.target, o);
  CHECK_FALSE(draft.threading().shared_pool);
  CHECK_FALSE(draft.threading().spinning);  // auto: two pools of their own must not both spin
  std::vector<int32_t> ids{1, 2, 3};
  std::vector<float> a(target.run(ids.data(), 3, 0), target.run(ids.data(), 3, 0) + target.vocab_size());
  const float* c = draft.run(ids.data(), 3, 0);
  for (int i = 0; i < target.vocab_size(); ++i) REQUIRE(std::abs(c[i] - a[size_t(i)]) < 1e-3f);
}
