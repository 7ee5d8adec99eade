// The speculation policy (src/policy.h) against the vectors recorded from specedge/runtime/policy.py
// (tests/data/policy_vectors.json, read from the source tree): same events in, same k decisions out.
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include <nlohmann/json.hpp>

#include "catch.h"
#include "policy.h"

using namespace specedge;
using json = nlohmann::json;

#ifndef SPECEDGE_POLICY_VECTORS
#error "SPECEDGE_POLICY_VECTORS must name tests/data/policy_vectors.json (set by CMakeLists.txt)"
#endif

namespace {
json load_vectors() {
  std::ifstream f(SPECEDGE_POLICY_VECTORS);
  REQUIRE(f.good());
  return json::parse(f);
}
}  // namespace

TEST_CASE("policy constants are the specified ones") {
  json c = load_vectors()["constants"];
  CHECK(c["EMA_WEIGHT"].get<double>() == policy::kEmaWeight);
  CHECK(c["SPIKE_CLAMP"].get<double>() == policy::kSpikeClamp);
  CHECK(c["PRIOR_ACCEPTED"].get<double>() == policy::kPriorAccepted);
  CHECK(c["PRIOR_REJECTED"].get<double>() == policy::kPriorRejected);
  CHECK(c["DECAY"].get<double>() == policy::kDecay);
  CHECK(c["WINDOW"].get<int>() == policy::kWindow);
  CHECK(c["MIN_ROUNDS"].get<int>() == policy::kMinRounds);
  CHECK(c["KEEP"].get<double>() == policy::kKeep);
  CHECK(c["SHRINK_MIN"].get<double>() == policy::kShrinkMin);
  CHECK(c["BACKOFF_START"].get<int>() == policy::kBackoffStart);
  CHECK(c["BACKOFF_MAX"].get<int>() == policy::kBackoffMax);
  CHECK(c["LOCAL_WEIGHT"].get<double>() == policy::kLocalWeight);
  CHECK(c["PROBE_ROUNDS"].get<int>() == policy::kProbeRounds);
  CHECK(c["TREE_RETRY_START"].get<int>() == policy::kTreeRetryStart);
  CHECK(c["TREE_RETRY_MAX"].get<int>() == policy::kTreeRetryMax);
}

TEST_CASE("policy vectors: the same k decisions as the Python policy") {
  json v = load_vectors();
  REQUIRE(v["cases"].size() >= 8);
  for (const auto& c : v["cases"]) {
    std::string name = c["name"];
    INFO("case " << name);
    CostModel costs;
    for (const auto& [t, s] : c["costs"]["target"].items()) costs.target[std::stoi(t)] = s.get<double>();
    costs.draft = c["costs"]["draft"].get<double>();
    costs.carry_chain = c["costs"]["carry_chain"].get<int>();
    costs.tree_backoff = c["costs"]["tree_backoff"].get<int>();
    auto make = [&] {
      return SpecController(c["k"].get<int>(), &costs, c["guard"].get<bool>(), c["learn"].get<bool>(),
                            c["adaptive"].get<bool>());
    };
    SpecController ctl = make();
    const auto& events = c["events"];
    const auto& want = c["next_k"];
    REQUIRE(events.size() == want.size());
    for (size_t i = 0; i < events.size(); ++i) {
      const auto& e = events[i];
      if (e.contains("request")) {  // a new request: a fresh controller on the same shared costs
        ctl = make();
      } else if (e.contains("round")) {
        const auto& r = e["round"];
        if (r.size() == 8)  // a tree round: call, depth, chain_accepted (null: a sampled tree)
          ctl.record_round(r[0].get<int>(), r[1].get<int>(), r[2].get<double>(), r[3].get<double>(), r[4].get<int>(),
                           r[5].get<int>(), r[6].get<int>(), r[7].is_null() ? -1 : r[7].get<int>());
        else
          ctl.record_round(r[0].get<int>(), r[1].get<int>(), r[2].get<double>(), r[3].get<double>(), r[4].get<int>());
      } else {
        const auto& p = e["plain"];
        ctl.record_plain(p[0].get<int>(), p[1].get<double>());
      }
      INFO("event " << i);
      REQUIRE(ctl.next_k() == want[i].get<int>());
    }
    const auto& f = c["final"];
    CHECK(ctl.k_ == f["k_final"].get<int>());
    CHECK(ctl.fallbacks == f["fallbacks"].get<int>());
    CHECK(ctl.fallback_tokens == f["fallback_tokens"].get<int64_t>());
    CHECK(ctl.shrinks == f["k_shrinks"].get<int>());
    CHECK(ctl.probes == f["probes"].get<int>());
    std::map<int, int64_t> hist;
    for (const auto& [k, n] : f["k_histogram"].items()) hist[std::stoi(k)] = n.get<int64_t>();
    CHECK(ctl.k_histogram == hist);
    // same operations in the same order: the estimates agree to the last bit or nearly
    CHECK(ctl.alpha() == Approx(f["alpha"].get<double>()).epsilon(1e-12));
    CHECK(costs.draft == Approx(f["draft_cost"].get<double>()).epsilon(1e-12));
    CHECK(costs.carry_fallback == f["carry_fallback"].get<int>());
    CHECK(costs.carry_backoff == f["carry_backoff"].get<int>());
    CHECK(costs.carry_chain == f["carry_chain"].get<int>());
    CHECK(costs.tree_backoff == f["tree_backoff"].get<int>());
    REQUIRE(costs.target.size() == f["target_costs"].size());
    for (const auto& [t, s] : f["target_costs"].items())
      CHECK(costs.target.at(std::stoi(t)) == Approx(s.get<double>()).epsilon(1e-12));
    REQUIRE(ctl.local.size() == f["local_costs"].size());
    for (const auto& [t, s] : f["local_costs"].items())
      CHECK(ctl.local.at(std::stoi(t)) == Approx(s.get<double>()).epsilon(1e-12));
    CHECK(ctl.tree_rounds == f["tree_rounds"].get<int>());
    CHECK(ctl.use_tree == f["use_tree"].get<bool>());
    std::map<int, int> tree_call;
    for (const auto& [k, n] : f["tree_call"].items()) tree_call[std::stoi(k)] = n.get<int>();
    CHECK(ctl.tree_call == tree_call);
    if (f["local_draft"].is_null())
      CHECK(ctl.local_draft < 0);
    else
      CHECK(ctl.local_draft == Approx(f["local_draft"].get<double>()).epsilon(1e-12));
  }
}

TEST_CASE("policy: only tree requests count down a carried tree verdict (test_policy.py)") {
  CostModel costs;
  costs.target = {{1, 0.010}, {5, 0.012}};
  costs.draft = 0.001;
  costs.carry_chain = 10;
  costs.tree_backoff = 32;
  SpecController chain(4, &costs, true, true, false, kMaxSpecTokens, false);
  for (int i = 0; i < 6; ++i) chain.record_round(4, 4, 0.004, 0.012, 4);
  CHECK(costs.carry_chain == 10);
  SpecController tree(4, &costs, true, true);
  CHECK(!tree.use_tree);  // carried off
  for (int i = 0; i < 6; ++i) tree.record_round(4, 4, 0.004, 0.012, 4);
  CHECK(costs.carry_chain == 4);
}

TEST_CASE("policy: trees go before k; k shrinks when the chain does not pay either (test_policy.py)") {
  auto run = [](std::vector<int> chain_rounds) {
    auto costs = std::make_unique<CostModel>();
    costs->target = {{1, 0.017}, {2, 0.018}, {5, 0.020}, {8, 0.026}};
    costs->draft = 0.0088;
    auto ctl = std::make_unique<SpecController>(4, costs.get(), true, true);
    for (int n : {4, 4, 1, 1}) ctl->record_round(4, n, 4 * 0.0088, 0.026, 7, 8, 4);
    CHECK(ctl->next_k() == 4);
    CHECK(!ctl->use_tree);
    CHECK(ctl->shrinks == 0);
    for (int n : chain_rounds) ctl->record_round(4, n, 4 * 0.0088, 0.020, 4);
    return std::make_pair(std::move(costs), std::move(ctl));
  };
  auto kept = run({4, 4, 4, 4});
  CHECK(kept.second->next_k() == 4);
  CHECK(kept.second->shrinks == 0);
  auto poor = run({0, 1, 0, 0});
  CHECK(poor.second->next_k() < 4);
}
