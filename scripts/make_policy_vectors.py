"""Record the speculation policy's decisions as shared test vectors: tests/data/policy_vectors.json.

Each case drives specedge.runtime.policy.SpecController through a simulated request (acceptance
drawn from the case's rate, step costs with noise and spikes, n-gram misses) and records every
event it was given and the k it chose next. tests/test_policy.py and cpp/tests/test_policy.cpp
replay the events and must make the same choices: one policy, two implementations.

Run it after changing the policy on purpose (and docs/design.md's specification with it):
    python scripts/make_policy_vectors.py
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specedge.runtime import policy  # noqa: E402
from specedge.runtime.policy import CostModel, SpecController  # noqa: E402

OUT = ROOT / "tests" / "data" / "policy_vectors.json"
CONSTANTS = (
    "EMA_WEIGHT",
    "SPIKE_CLAMP",
    "PRIOR_ACCEPTED",
    "PRIOR_REJECTED",
    "DECAY",
    "WINDOW",
    "MIN_ROUNDS",
    "KEEP",
    "SHRINK_MIN",
    "BACKOFF_START",
    "BACKOFF_MAX",
    "LOCAL_WEIGHT",
    "PROBE_ROUNDS",
    "TREE_RETRY_START",
    "TREE_RETRY_MAX",
)

# name, seed, controller settings, initial costs, the simulated request
CASES = [
    (
        "steady_high_acceptance",
        1,
        dict(k=4),
        ({1: 0.010, 5: 0.012}, 0.002),
        dict(phases=[(120, 0.85)], target=(0.010, 0.0005), draft=0.002),
    ),
    (
        "useless_draft_falls_back_and_retries",
        2,
        dict(k=4),
        ({1: 0.010, 5: 0.012}, 0.006),
        dict(phases=[(260, 0.05)], target=(0.010, 0.0005), draft=0.006),
    ),
    (
        "moderate_acceptance_shrinks_k",
        3,
        dict(k=8),
        ({1: 0.010, 9: 0.016}, 0.003),
        dict(phases=[(150, 0.5)], target=(0.010, 0.00075), draft=0.003),
    ),
    (
        "request_changes_character",
        4,
        dict(k=6),
        ({1: 0.010, 7: 0.013}, 0.002),
        dict(phases=[(60, 0.9), (120, 0.1), (120, 0.9)], target=(0.010, 0.0005), draft=0.002),
    ),
    (
        "adaptive_k",
        5,
        dict(k=3, adaptive=True),
        ({1: 0.010, 4: 0.011}, 0.001),
        dict(phases=[(80, 0.95), (80, 0.3), (60, 0.8)], target=(0.010, 0.0003), draft=0.001),
    ),
    (
        "adaptive_k_without_guard",
        6,
        dict(k=4, adaptive=True, guard=False),
        ({1: 0.010, 5: 0.012}, 0.004),
        dict(phases=[(60, 0.98), (60, 0.05)], target=(0.010, 0.0005), draft=0.004),
    ),
    (
        "cost_spikes",
        7,
        dict(k=4),
        ({1: 0.010, 5: 0.012}, 0.002),
        dict(phases=[(150, 0.7)], target=(0.010, 0.0005), draft=0.002, spike=(0.08, 12.0)),
    ),
    (
        "static_costs_no_learning",
        8,
        dict(k=5, learn=False),
        ({1: 1.0, 17: 1.8}, 0.1),
        dict(phases=[(100, 0.6), (100, 0.15)], target=(0.010, 0.0005), draft=0.002),
    ),
    (
        "ngram_misses_and_short_drafts",
        9,
        dict(k=4),
        ({1: 0.010, 5: 0.011}, 2e-5),
        dict(phases=[(160, 0.6)], target=(0.010, 0.0004), draft=2e-5, miss=0.3, short=0.3),
    ),
    (
        "k1_nothing_smaller_to_try",
        10,
        dict(k=1),
        ({1: 0.010, 2: 0.0125}, 0.004),
        dict(phases=[(120, 0.2)], target=(0.010, 0.0005), draft=0.004),
    ),
    ("empty_cost_model", 11, dict(k=4), ({}, 0.0), dict(phases=[(80, 0.7)], target=(0.010, 0.0005), draft=0.002)),
    # the guard_categories failure: low acceptance while frequent load spikes make the real calls far
    # slower than the costs calibrated on a quiet machine
    (
        "low_acceptance_under_load_spikes",
        12,
        dict(k=4),
        ({1: 0.010, 5: 0.0105}, 2e-5),
        dict(phases=[(200, 0.16)], target=(0.010, 0.0008), draft=2e-5, miss=0.2, spike=(0.3, 5.0)),
    ),
    # a model draft that always proposes: 1-token steps come only from probes
    (
        "probes_time_c1_while_speculating",
        13,
        dict(k=4),
        ({1: 0.010, 5: 0.012}, 0.002),
        dict(phases=[(120, 0.8), (60, 0.8, 3.0)], target=(0.010, 0.0005), draft=0.002),
    ),
    # a self-draft as slow per token as its (int4) target: no acceptance can make it pay
    (
        "draft_as_slow_as_the_target",
        14,
        dict(k=4),
        ({1: 0.010, 2: 0.0104, 5: 0.016}, 0.009),
        dict(phases=[(200, 0.95)], target=(0.0102, 0.0015), draft=0.0092),
    ),
    # the same draft over several requests sharing one cost model: after the first request found it
    # cannot pay, the next ones start target-only (carry_backoff) instead of losing a round each
    (
        "hopeless_draft_carried_across_requests",
        15,
        dict(k=4),
        ({1: 0.010, 2: 0.0104, 5: 0.016}, 0.009),
        dict(phases=[(530, 0.95)], target=(0.0102, 0.0015), draft=0.0092, request_events=100),
    ),
    # a carried fallback is cleared by a request whose draft pays again (the load that made it
    # hopeless is gone: the draft got 4x cheaper)
    (
        "carried_fallback_cleared_when_the_draft_pays",
        16,
        dict(k=4),
        ({1: 0.010, 2: 0.0104, 5: 0.016}, 0.009),
        dict(phases=[(150, 0.95), (380, 0.95, 1.0, 0.25)], target=(0.0102, 0.0015), draft=0.0092, request_events=100),
    ),
    # tree rounds (docs/design.md "Tree calls"): a round verifies `nodes` nodes of depth k in one call,
    # timed as c(nodes); trees also report what their first line alone would have kept
    # (chain_accepted: the tree's accepted count, or with probability `branch` fewer), and the guard
    # turns trees off when the chain would have been faster. "boost": the tree's extra acceptance.
    (
        "tree_rounds_that_pay_stay_on",
        17,
        dict(k=4),
        ({1: 0.010, 5: 0.011, 9: 0.012}, 0.001),
        dict(phases=[(150, 0.5)], target=(0.010, 0.0003), draft=0.001, tree=dict(nodes=9, boost=0.3, branch=0.9)),
    ),
    (
        "trees_costing_more_than_they_gain_are_turned_off",
        18,
        dict(k=4),
        ({1: 0.010, 5: 0.012, 20: 0.030}, 0.0005),
        dict(phases=[(150, 0.7)], target=(0.010, 0.001), draft=0.0005, tree=dict(nodes=20, boost=0.0, branch=0.05)),
    ),
    # sampled trees report the first-line nodes their verification kept, so they are judged too
    (
        "sampled_trees_are_compared_with_their_chain",
        19,
        dict(k=4),
        ({1: 0.010, 5: 0.012, 12: 0.016}, 0.001),
        dict(
            phases=[(150, 0.5)],
            target=(0.010, 0.0005),
            draft=0.001,
            miss=0.2,
            tree=dict(nodes=12, boost=0.1, branch=0.5),
        ),
    ),
    (
        "trees_without_guard_stay_on",
        20,
        dict(k=3, guard=False),
        ({1: 0.010, 4: 0.012, 16: 0.03}, 0.001),
        dict(phases=[(120, 0.4)], target=(0.010, 0.0012), draft=0.001, tree=dict(nodes=16, boost=0.0, branch=0.0)),
    ),
    # short requests sharing one cost model: trees the guard turned off stay off in the next requests
    # (carry_chain) for a span of chain rounds that doubles with each turn-off in a row
    (
        "trees_turned_off_stay_off_across_requests",
        21,
        dict(k=4),
        ({1: 0.010, 5: 0.012, 20: 0.030}, 0.0005),
        dict(
            phases=[(600, 0.7)],
            target=(0.010, 0.001),
            draft=0.0005,
            request_events=15,
            tree=dict(nodes=20, boost=0.0, branch=0.05),
        ),
    ),
    # ... and a request whose trees pay again (the tree call got cheap) clears the carried verdict
    (
        "carried_tree_verdict_cleared_when_trees_pay",
        22,
        dict(k=4),
        ({1: 0.010, 5: 0.012, 9: 0.013}, 0.0005),
        dict(
            phases=[(200, 0.5)],
            target=(0.010, 0.0003),
            draft=0.0005,
            request_events=15,
            tree=dict(nodes=9, boost=0.3, branch=0.9),
            start_carry=(40, 64),
        ),
    ),
    # trees that beat their chain but leave k not paying at the tree's call: the trees go first and
    # k is judged afresh as a chain on MIN_ROUNDS rounds of its own (docs/design.md, step 6a)
    (
        "trees_go_before_k",
        40,
        dict(k=4),
        ({1: 0.010, 5: 0.012, 12: 0.018}, 0.001),
        dict(phases=[(150, 0.5)], target=(0.010, 0.0008), draft=0.001, tree=dict(nodes=12, boost=0.2, branch=0.6)),
    ),
]


def q(x: float) -> float:
    """Recorded values are rounded so the file stays readable; both replays read these exact values."""
    return float(f"{x:.6g}")


def simulate(seed: int, settings: dict, costs: tuple, req: dict) -> dict:
    rng = random.Random(seed)
    target_costs, draft_cost = costs
    carry_chain, tree_backoff = req.get("start_carry", (0, 0))
    ctl = SpecController(
        costs=CostModel(dict(target_costs), draft_cost, carry_chain=carry_chain, tree_backoff=tree_backoff), **settings
    )
    t1, per_token = req["target"]
    events, next_k = [], []

    load = 1.0
    every = req.get("request_events")  # a new request (a fresh controller, same costs) every so many events
    n_seen = 0

    def noisy(x: float) -> float:
        x *= load * rng.uniform(0.9, 1.1)
        spike = req.get("spike")
        if spike and rng.random() < spike[0]:
            x *= spike[1]
        return q(x)

    draft_scale = 1.0
    for n_events, alpha, *rest in req["phases"]:
        load = rest[0] if rest else 1.0  # the machine's load in this phase: every step slower by this
        draft_scale = rest[1] if len(rest) > 1 else 1.0  # the draft's cost in this phase, relative
        for _ in range(n_events):
            n_seen += 1
            if every and n_seen % every == 0:
                ctl = SpecController(costs=ctl.costs, **settings)
                events.append({"request": []})
                next_k.append(ctl.next_k())
                continue
            k = ctl.next_k()
            drafted = k
            if k and rng.random() < req.get("miss", 0.0):
                drafted = 0  # the n-gram drafter found no match: the round is a plain target step
            elif k > 1 and rng.random() < req.get("short", 0.0):
                drafted = rng.randint(1, k - 1)  # a match near the end of the history: fewer drafts
            tree = req.get("tree")
            if drafted == 0:
                seconds = noisy(t1)
                ctl.record_plain(1, seconds)
                events.append({"plain": [1, seconds]})
            elif tree and ctl.use_tree:
                nodes, depth = tree["nodes"], drafted
                accepted = 0
                while accepted < depth and rng.random() < min(alpha + tree["boost"], 1.0):
                    accepted += 1
                chain = rng.randint(0, accepted - 1) if accepted and rng.random() < tree["branch"] else accepted
                draft_s = noisy(req["draft"] * draft_scale * depth)
                verify_s = noisy(t1 + per_token * (nodes - 1))
                ctl.record_round(k, accepted, draft_s, verify_s, nodes - 1, nodes, depth, chain)
                events.append({"round": [k, accepted, draft_s, verify_s, nodes - 1, nodes, depth, chain]})
            else:
                accepted = 0
                while accepted < drafted and rng.random() < alpha:
                    accepted += 1
                draft_s = noisy(req["draft"] * draft_scale * drafted)
                verify_s = noisy(t1 + per_token * drafted)
                ctl.record_round(k, accepted, draft_s, verify_s, drafted)
                events.append({"round": [k, accepted, draft_s, verify_s, drafted]})
            next_k.append(ctl.next_k())
    d = ctl.to_dict()
    return {
        "events": events,
        "next_k": next_k,
        "final": {
            "k_final": d["k_final"],
            "fallbacks": d["fallbacks"],
            "fallback_tokens": d["fallback_tokens"],
            "k_shrinks": d["k_shrinks"],
            "probes": ctl.probes,
            "k_histogram": d["k_histogram"],
            "alpha": ctl.alpha,
            "target_costs": {str(t): c for t, c in sorted(ctl.costs.target.items())},
            "draft_cost": ctl.costs.draft,
            "carry_fallback": ctl.costs.carry_fallback,
            "carry_backoff": ctl.costs.carry_backoff,
            "carry_chain": ctl.costs.carry_chain,
            "tree_backoff": ctl.costs.tree_backoff,
            "local_costs": {str(t): c for t, c in sorted(ctl.local.items())},
            "local_draft": ctl.local_draft,
            "tree_rounds": ctl.tree_rounds,
            "use_tree": ctl.use_tree,
            "tree_call": {str(k): c for k, c in sorted(ctl.tree_call.items())},
        },
    }


def build() -> dict:
    cases = []
    for name, seed, settings, costs, req in CASES:
        s = {
            "k": settings["k"],
            "adaptive": settings.get("adaptive", False),
            "guard": settings.get("guard", True),
            "learn": settings.get("learn", True),
        }
        cases.append(
            {
                "name": name,
                **s,
                "costs": {
                    "target": {str(t): c for t, c in costs[0].items()},
                    "draft": costs[1],
                    "carry_chain": req.get("start_carry", (0, 0))[0],
                    "tree_backoff": req.get("start_carry", (0, 0))[1],
                },
                **simulate(seed, settings, costs, req),
            }
        )
    return {
        "about": "Speculation policy vectors (docs/design.md, 'The speculation policy'): replay each case's events "
        "on a fresh SpecController with the case's settings and costs; a 'request' event starts a new "
        "SpecController on the same CostModel; a 'round' is [k, accepted, draft_s, verify_s, drafted] "
        "or, for a tree round, [..., call, depth, chain_accepted] (null: a sampled tree); after event i, "
        "next_k must equal next_k[i]. Generated by scripts/make_policy_vectors.py from specedge/runtime/policy.py.",
        "constants": {c: getattr(policy, c) for c in CONSTANTS},
        "cases": cases,
    }


def dumps(obj) -> str:
    """Indented JSON with every list of numbers on one line (one event per line)."""
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[\s+([^\[\]{}\"]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def main() -> None:
    OUT.write_text(dumps(build()) + "\n", encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
