// Token trees (src/tree.h) against the rules of specedge/runtime/tree.py and drafters/base.py:
// greedy acceptance, the sampled sibling rule's exactness by enumeration (the emitted tokens'
// joint equals target-only sampling's to 1e-9) and by frequency, compaction, the drafting helpers.
// The hidden case [ngram_tree_replay] checks the n-gram trees of ngram.py on recorded cases
// ($SPECEDGE_NGRAM_TREE_CASES, written by tests/test_cpp.py).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "catch.h"
#include "engine.h"
#include "error.h"
#include "tree.h"

using namespace specedge;

TEST_CASE("tree: structure, depths and the ancestor mask") {
  Tree t({7, 10, 11, 12, 20, 21}, {-1, 0, 1, 2, 0, 1});
  CHECK(t.depths() == std::vector<int>{0, 1, 2, 3, 1, 2});
  CHECK(t.depth() == 3);
  CHECK(t.children(0) == std::vector<int>{1, 4});
  CHECK(t.children(1) == std::vector<int>{2, 5});
  auto m = t.ancestor_mask();
  // row 5: itself, its parent 1 and the root
  std::vector<uint8_t> row5(m.begin() + 30, m.begin() + 36);
  CHECK(row5 == std::vector<uint8_t>{1, 1, 0, 0, 0, 1});
  std::vector<uint8_t> row3(m.begin() + 18, m.begin() + 24);
  CHECK(row3 == std::vector<uint8_t>{1, 1, 1, 1, 0, 0});
  Tree p = Tree::from_paths(7, {{10, 11, 12}, {20}, {10, 21}, {10, 11}});
  CHECK(p.tokens == t.tokens);
  CHECK(p.parents == t.parents);
  CHECK(p.prefix(3).tokens == std::vector<int32_t>{7, 10, 11});
  CHECK(p.prefix(0).size() == 1);
  CHECK_THROWS_AS(Tree({1, 2}, {-1, 1}), Error);
  CHECK_THROWS_AS(Tree({1, 2}, {0, -1}), Error);
  CHECK_THROWS_AS(Tree({1, 2}, {-1}), Error);
}

TEST_CASE("tree: greedy keeps the longest matching root path, then the target's token") {
  Tree t({7, 10, 11, 12, 20, 21}, {-1, 0, 1, 2, 0, 1});
  auto [path, out] = verify_tree_greedy(t, {10, 21, 99, 99, 99, 99});
  CHECK(path == std::vector<int>{0, 1, 5});
  CHECK(out == std::vector<int32_t>{10, 21, 99});
  CHECK(chain_accepted(t, {10, 21, 99, 99, 99, 99}) == 1);
  auto all = verify_tree_greedy(t, {10, 11, 12, 13, 0, 0});
  CHECK(all.first == std::vector<int>{0, 1, 2, 3});
  CHECK(all.second == std::vector<int32_t>{10, 11, 12, 13});
  CHECK(chain_accepted(t, {10, 11, 12, 13, 0, 0}) == 3);
  CHECK(chain_accepted(t, {10, 11, 12, 13, 0, 0}, 2) == 2);  // a chain of 2 stops there
  auto side = verify_tree_greedy(t, {20, 0, 0, 0, 5, 0});
  CHECK(side.first == std::vector<int>{0, 4});
  CHECK(side.second == std::vector<int32_t>{20, 5});
  CHECK(chain_accepted(t, {20, 0, 0, 0, 5, 0}) == 0);
  auto none = verify_tree_greedy(t, {3, 0, 0, 0, 0, 0});
  CHECK(none.first == std::vector<int>{0});
  CHECK(none.second == std::vector<int32_t>{3});
  CHECK_THROWS_AS(verify_tree_greedy(t, {1, 2}), Error);
}

TEST_CASE("tree: compaction moves only the nodes out of place, in increasing order") {
  CHECK(compaction_moves({0, 1, 2}).empty());
  CHECK(compaction_moves({0, 2, 5}) == std::vector<std::pair<int, int>>{{2, 1}, {5, 2}});
  CHECK(compaction_moves({0, 1, 4, 6}) == std::vector<std::pair<int, int>>{{4, 2}, {6, 3}});
  CHECK_THROWS_AS(compaction_moves({0, 3, 2}), Error);
}

TEST_CASE("tree: top_ids breaks ties at the cut toward the lower ids") {
  std::vector<double> p{0.1, 0.3, 0.1, 0.3, 0.1, 0.1};
  CHECK(top_ids(p, 1) == std::vector<int>{1});
  CHECK(top_ids(p, 2) == std::vector<int>{1, 3});
  CHECK(top_ids(p, 3) == std::vector<int>{0, 1, 3});
  CHECK(top_ids(p, 5) == std::vector<int>{0, 1, 2, 3, 4});
  CHECK(top_ids(p, 9).size() == 6);
  CHECK(top_ids(p, 0).empty());
  std::vector<double> a{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  CHECK(pairwise_sum(a.data(), a.size()) == 66.0);
}

TEST_CASE("tree: chain_tree is the greedy chain plus ranked runner-ups, ties to the lower ids") {
  // as tests/test_tree.py: the chain 5 -> 7; every other id ties; the root's ties rank first
  std::vector<float> first(12, 0.f), second(12, 0.f);
  first[5] = 2.f;
  second[7] = 4.f;
  int steps = 0;
  auto step = [&](int32_t tok) -> const float* {
    ++steps;
    CHECK(tok == 5);
    return second.data();
  };
  Tree t = chain_tree(1, first.data(), 12, step, 2, 6);
  CHECK(steps == 1);
  CHECK(t.tokens == std::vector<int32_t>{1, 5, 7, 0, 1, 2});
  CHECK(t.parents == std::vector<int>{-1, 0, 1, 0, 0, 0});
  // no room for branches: the chain alone (and cut to `nodes`)
  Tree c = chain_tree(1, first.data(), 12, step, 2, 3);
  CHECK(c.tokens == std::vector<int32_t>{1, 5, 7});
  Tree cut = chain_tree(1, first.data(), 12, step, 2, 2);
  CHECK(cut.tokens == std::vector<int32_t>{1, 5});
}

TEST_CASE("tree: a sampled chain_tree's first line is the sampled chain with its q rows; siblings are point masses") {
  // as tests/test_tree.py: rows over 6 draft ids mapped to target ids 10..15 of a vocab of 16
  std::vector<float> first{1.f, 0.5f, 0.f, -1.f, 0.2f, 0.1f}, second{0.f, 2.f, 1.f, 0.5f, -2.f, 0.3f};
  const int32_t ids[] = {10, 11, 12, 13, 14, 15};
  SamplingParams warm;
  warm.temperature = 0.7;
  auto step = [&](int32_t) -> const float* { return second.data(); };
  Rng rng(3), same(3);
  Tree t = chain_tree(1, first.data(), 6, step, 2, 6, ids, &warm, &rng, 16);
  std::vector<double> q1, q2;
  probs_from_logits(first.data(), 6, warm, q1);
  probs_from_logits(second.data(), 6, warm, q2);
  const int x1 = sample(q1.data(), 6, same), x2 = sample(q2.data(), 6, same);
  CHECK(rng.uniform() == same.uniform());  // one draw per chain token, no more
  REQUIRE(t.size() == 6);
  CHECK(std::vector<int32_t>(t.tokens.begin(), t.tokens.begin() + 3) == std::vector<int32_t>{1, ids[x1], ids[x2]});
  REQUIRE(t.q.size() == 6);
  for (int v = 0; v < 16; ++v) {
    CHECK(t.q[1][size_t(v)] == (v >= 10 ? q1[size_t(v - 10)] : 0.0));
    CHECK(t.q[2][size_t(v)] == (v >= 10 ? q2[size_t(v - 10)] : 0.0));
  }
  for (int i = 3; i < 6; ++i) {
    CHECK(t.q[size_t(i)].empty());
    CHECK(t.tokens[size_t(i)] != t.tokens[size_t(t.parents[size_t(i)] + 1)]);
  }
  CHECK_THROWS(chain_tree(1, first.data(), 6, step, 2, 6, ids, &warm, nullptr, 16));
  // what the chain would have kept: the first-line nodes on the path, at most limit
  Tree b(std::vector<int32_t>{1, 5, 7, 8, 9}, std::vector<int>{-1, 0, 1, 0, 1});
  CHECK(first_line_kept(b, {0, 1, 2}) == 2);
  CHECK(first_line_kept(b, {0, 1, 2}, 1) == 1);
  CHECK(first_line_kept(b, {0, 1, 4}) == 1);  // a sibling of node 2 taken: the chain stopped there
  CHECK(first_line_kept(b, {0, 3}) == 0);
  CHECK(first_line_kept(b, {0}) == 0);
}

TEST_CASE("tree: tree_nodes grows with cheap calls only, capped past the largest measured size") {
  CostModel flat;
  flat.target = {{1, 1.0}, {5, 1.0}, {40, 1.0}};
  CHECK(tree_nodes(flat, 4) == max_tree_nodes());
  CostModel cpu;
  cpu.target = {{1, 1.0}, {5, 5.0}};
  CHECK(tree_nodes(cpu, 4) == 6);  // c(6) = 6 <= 1.25 * 5, c(7) = 7 > 6.25; and 5 + 2 is the cap
  CostModel unmeasured;
  unmeasured.target = {{1, 1.0}, {5, 1.0}};
  CHECK(tree_nodes(unmeasured, 4) == 7);  // at most TREE_GROWTH past the largest measured call
  CHECK_THROWS_AS(tree_nodes(flat, 0), Error);
}

TEST_CASE("tree: a refused tree request says whether exporting with --tree would help") {
  CHECK(tree_refusal(false, "ort-cpu") ==
        "tree verification needs a target graph that takes trees: export the bundle with --tree");
  // a bundle exported with --tree on a backend that runs no tree calls: re-exporting cannot help
  CHECK(tree_refusal(true, "tensorrt") ==
        "tree verification is not available on the tensorrt backend, although the bundle's target graph takes "
        "trees: use the ort-cpu backend, or leave tree off");
}

TEST_CASE("tree: the n-gram tree is the chain, then the likeliest branches (ngram.py's case)") {
  NgramDrafter d({2, 1});
  // "1 2" was followed by 3, 4 and 5 (latest last): the chain is the latest match's 5 6, the
  // root's other children score 1/3 each, ties go to the candidate found first
  std::vector<int32_t> h{1, 2, 3, 7, 2, 9, 1, 2, 4, 8, 1, 2, 5, 6, 1, 2};
  auto same = [](const std::optional<Tree>& t, std::vector<int32_t> tokens, std::vector<int> parents) {
    return t && t->tokens == tokens && t->parents == parents;
  };
  CHECK(same(d.propose_tree(h, 2, 8, 4, 16), {2, 5, 6, 4, 3, 1, 8, 7}, {-1, 0, 1, 0, 0, 2, 3, 4}));
  CHECK(same(d.propose_tree(h, 2, 8, 2, 16), {2, 5, 6, 4, 3, 8, 7}, {-1, 0, 1, 0, 0, 3, 4}));
  CHECK(same(d.propose_tree(h, 2, 4, 4, 16), {2, 5, 6, 4}, {-1, 0, 1, 0}));
  CHECK(same(d.propose_tree(h, 2, 8, 4, 6), {2, 5, 4, 3}, {-1, 0, 0, 0}));  // no id >= vocab
  CHECK(!d.propose_tree(h, 0, 8, 4, 16));
  CHECK(!d.propose_tree(h, 2, 1, 4, 16));
  NgramDrafter d3;
  std::vector<int32_t> h3{1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3, 4, 7, 1, 2, 3};
  CHECK(same(d3.propose_tree(h3, 3, 8, 3, 16), {3, 4, 7, 1, 5, 9, 6, 1}, {-1, 0, 1, 2, 0, 1, 4, 5}));
  CHECK(same(d3.propose_tree(h3, 3, 8, 6, 16), {3, 4, 7, 1, 5, 9, 2, 6}, {-1, 0, 1, 2, 0, 1, 3, 4}));
  CHECK(!d3.propose_tree({1, 2}, 3, 8, 3, 16));  // no match
}

TEST_CASE("tree: every n-gram tree of a recorded Python run", "[.][ngram_tree_replay]") {
  const char* path = std::getenv("SPECEDGE_NGRAM_TREE_CASES");
  REQUIRE(path != nullptr);
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json cases = nlohmann::json::parse(ss.str());
  size_t checked = 0;
  // one drafter per stream, called on a growing history as a request calls it (its index grows)
  for (const auto& stream : cases["streams"]) {
    NgramDrafter d(stream["sizes"].get<std::vector<int>>());
    for (const auto& c : stream["calls"]) {
      auto t = d.propose_tree(c["history"].get<std::vector<int32_t>>(), c["k"].get<int>(), c["nodes"].get<int>(),
                              c["depth"].get<int>(), c["vocab"].get<int>());
      auto want = c["tokens"].get<std::vector<int32_t>>();
      if (want.empty()) {
        CHECK(!t);
      } else {
        REQUIRE(t);
        CHECK(t->tokens == want);
        CHECK(t->parents == c["parents"].get<std::vector<int>>());
      }
      ++checked;
    }
  }
  std::cout << "ngram tree replay: " << checked << " trees checked\n";
}

// ---------------------------------------------------------------------------- sampled exactness

namespace {
constexpr int kV = 4;

// A deterministic distribution over kV ids for a context (a hash of it), with some zeros.
std::vector<double> row_for(const std::vector<int>& ctx, uint64_t salt, bool zeros) {
  uint64_t h = 1469598103934665603ull ^ salt;
  for (int t : ctx) h = (h ^ uint64_t(t + 1)) * 1099511628211ull;
  std::vector<double> r(kV);
  double total = 0;
  for (int v = 0; v < kV; ++v) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    r[size_t(v)] = double((h >> 33) % 1000 + 1);
    if (zeros && (h >> 20) % 4 == 0) r[size_t(v)] = 0;
    total += r[size_t(v)];
  }
  if (total == 0) r[0] = total = 1;
  for (double& x : r) x /= total;
  return r;
}

std::vector<double> p_of(const std::vector<int>& ctx, bool zeros) { return row_for(ctx, 11, zeros); }
// drafts keep full support (siblings without replacement need as many ids as siblings)
std::vector<double> q_of(const std::vector<int>& ctx, bool /*zeros*/) { return row_for(ctx, 29, false); }

enum class Mode { With, Without, Point };

// How siblings are drawn: each sibling's q given the earlier ones (`drawn`), and the probability of
// drawing x. Point mode enumerates distinct fixed choices, each weighted 1 (checked one by one).
std::vector<double> sibling_q(Mode mode, const std::vector<double>& q, const std::vector<int>& drawn) {
  std::vector<double> r = q;
  if (mode == Mode::Without) {
    for (int x : drawn) r[size_t(x)] = 0;
    double t = 0;
    for (double x : r) t += x;
    if (t > 0)
      for (double& x : r) x /= t;
  }
  return r;
}

// Every way to draw m siblings after `ctx`: (tokens, their q rows (empty = point mass), weight).
struct Draw {
  std::vector<int> tokens;
  std::vector<std::vector<double>> qs;
  double weight;
};
void draws(Mode mode, const std::vector<double>& q, int m, Draw cur, std::vector<Draw>& out) {
  if (int(cur.tokens.size()) == m) {
    out.push_back(cur);
    return;
  }
  std::vector<double> qi = sibling_q(mode, q, cur.tokens);
  for (int x = 0; x < kV; ++x) {
    double w = mode == Mode::Point ? 1.0 : qi[size_t(x)];
    if (w <= 0) continue;
    if (mode != Mode::With && std::find(cur.tokens.begin(), cur.tokens.end(), x) != cur.tokens.end()) continue;
    Draw next = cur;
    next.tokens.push_back(x);
    next.qs.push_back(mode == Mode::Point ? std::vector<double>{} : qi);
    next.weight *= w;
    draws(mode, q, m, next, out);
  }
}

// The first emitted token's distribution at a node (context ctx) whose children were drawn as d.
std::vector<double> first_token(const std::vector<int>& ctx, const Draw& d, bool zeros, std::vector<double>* accept,
                                std::vector<double>* resid) {
  std::vector<double> p = p_of(ctx, zeros);
  std::vector<int32_t> toks(d.tokens.begin(), d.tokens.end());
  std::vector<const double*> qs;
  for (const auto& q : d.qs) qs.push_back(q.empty() ? nullptr : q.data());
  std::vector<double> a, r;
  sibling_rule(p.data(), kV, toks, qs, a, r);
  std::vector<double> out(kV, 0.0);
  double none = 1.0;
  for (size_t i = 0; i < a.size(); ++i) {
    out[size_t(d.tokens[i])] += none * a[i];
    none *= 1.0 - a[i];
  }
  for (int v = 0; v < kV; ++v) out[size_t(v)] += none * r[size_t(v)];  // none == 0 after a sure acceptance
  if (accept) *accept = a;
  if (resid) *resid = r;
  return out;
}

// The joint of the first two emitted tokens for trees of shape: the root has `kids` children,
// child i has grand[i] children; a token emitted from a residual ends the round and the next one
// comes from the target (p of the longer context), as in target-only decoding.
double check_joint(Mode mode, int kids, const std::vector<int>& grand, bool zeros) {
  std::vector<double> got(kV * kV, 0.0);
  std::vector<Draw> level1;
  draws(mode, q_of({}, zeros), kids, Draw{{}, {}, 1.0}, level1);
  double worst = 0;
  double total_weight = 0;
  for (const Draw& d1 : level1) {
    // every draw of each child's children, independently: enumerate their product
    std::vector<std::vector<Draw>> sub(static_cast<size_t>(kids));
    for (int i = 0; i < kids; ++i)
      draws(mode, q_of({d1.tokens[size_t(i)]}, zeros), grand[size_t(i)], Draw{{}, {}, 1.0}, sub[size_t(i)]);
    std::vector<size_t> idx(static_cast<size_t>(kids), 0);
    while (true) {
      double w = d1.weight;
      for (int i = 0; i < kids; ++i) w *= sub[size_t(i)][idx[size_t(i)]].weight;
      std::vector<double> a, r;
      first_token({}, d1, zeros, &a, &r);
      std::vector<double> joint(kV * kV, 0.0);
      double none = 1.0;
      for (size_t i = 0; i < a.size(); ++i) {
        int x = d1.tokens[i];
        std::vector<double> second = first_token({x}, sub[i][idx[i]], zeros, nullptr, nullptr);
        for (int y = 0; y < kV; ++y) joint[size_t(x * kV + y)] += none * a[i] * second[size_t(y)];
        none *= 1.0 - a[i];
      }
      for (int x = 0; x < kV; ++x) {
        std::vector<double> next = p_of({x}, zeros);
        for (int y = 0; y < kV; ++y) joint[size_t(x * kV + y)] += none * r[size_t(x)] * next[size_t(y)];
      }
      if (mode == Mode::Point) {  // each fixed tree is exact by itself
        for (int x = 0; x < kV; ++x)
          for (int y = 0; y < kV; ++y)
            worst = std::max(
                worst, std::abs(joint[size_t(x * kV + y)] - p_of({}, zeros)[size_t(x)] * p_of({x}, zeros)[size_t(y)]));
      } else {
        for (size_t j = 0; j < joint.size(); ++j) got[j] += w * joint[j];
        total_weight += w;
      }
      size_t i = 0;
      while (i < idx.size() && ++idx[i] == sub[i].size()) idx[i++] = 0;
      if (i == idx.size()) break;
    }
  }
  if (mode != Mode::Point) {
    CHECK(std::abs(total_weight - 1.0) < 1e-9);
    for (int x = 0; x < kV; ++x)
      for (int y = 0; y < kV; ++y)
        worst = std::max(worst,
                         std::abs(got[size_t(x * kV + y)] - p_of({}, zeros)[size_t(x)] * p_of({x}, zeros)[size_t(y)]));
  }
  return worst;
}
}  // namespace

TEST_CASE("tree: sampled verification emits exactly the target's distribution (enumeration)") {
  struct Shape {
    int kids;
    std::vector<int> grand;
  };
  std::vector<Shape> shapes{{1, {1}}, {2, {0, 0}}, {2, {2, 1}}, {3, {1, 0, 2}}, {1, {3}}};
  for (Mode mode : {Mode::With, Mode::Without, Mode::Point})
    for (bool zeros : {false, true})
      for (const auto& s : shapes) {
        INFO("mode " << int(mode) << " zeros " << zeros << " kids " << s.kids);
        CHECK(check_joint(mode, s.kids, s.grand, zeros) < 1e-9);
      }
}

TEST_CASE("tree: point-mass children leave the residual without them") {
  std::vector<double> p = p_of({}, false);
  std::vector<double> a, r;
  sibling_rule(p.data(), kV, {0, 1}, {nullptr, nullptr}, a, r);
  CHECK(r[0] == 0.0);
  CHECK(r[1] == 0.0);
  double emitted0 = a[0];  // token 0 only through its acceptance
  CHECK(std::abs(emitted0 - p[0]) < 1e-12);
}

TEST_CASE("tree: sampled verification draws as the rule says (frequencies)") {
  // root with three children (point masses and a q row) and a grandchild: the first token's
  // frequencies over many rounds match the rule's analytic distribution for this fixed tree
  Tree t({9, 1, 2, 3, 0}, {-1, 0, 0, 0, 1});
  std::vector<double> q1 = q_of({}, false);
  t.q = {{}, {}, q1, {}, {}};
  const int T = t.size();
  std::vector<double> p_rows;
  for (int i = 0; i < T; ++i) {
    std::vector<double> r = p_of({i}, false);
    p_rows.insert(p_rows.end(), r.begin(), r.end());
  }
  Rng rng(1234);
  const int n = 40000;
  std::vector<int> count(kV, 0);
  std::map<int, int> lengths;
  for (int i = 0; i < n; ++i) {
    auto [path, out] = verify_tree_sampling(t, p_rows, kV, rng);
    REQUIRE(out.size() == path.size());
    ++count[size_t(out[0])];
    ++lengths[int(out.size())];
  }
  Draw d{{1, 2, 3}, {{}, q1, {}}, 1.0};
  std::vector<double> p0 = first_token({0}, d, false, nullptr, nullptr);  // p_of({0}) is node 0's row
  for (int v = 0; v < kV; ++v) {
    double f = double(count[size_t(v)]) / n, sd = std::sqrt(p0[size_t(v)] * (1 - p0[size_t(v)]) / n);
    INFO("token " << v << " frequency " << f << " p " << p0[size_t(v)]);
    CHECK(std::abs(f - p0[size_t(v)]) < 5 * sd + 1e-12);
  }
  CHECK(lengths.count(2) == 1);  // some rounds accept a child
  CHECK_THROWS_AS(verify_tree_sampling(t, std::vector<double>(size_t(kV)), kV, rng), Error);
}
