"""The speculation policy against the shared vectors (tests/data/policy_vectors.json), which the
C++ suite (cpp/tests/test_policy.cpp) replays too: one specification, two implementations."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from specedge.runtime import policy
from specedge.runtime.policy import CostModel, SpecController

ROOT = Path(__file__).resolve().parents[1]
VECTORS = json.loads((ROOT / "tests" / "data" / "policy_vectors.json").read_text(encoding="utf-8"))
CASES = {c["name"]: c for c in VECTORS["cases"]}


def replay(case: dict, **overrides) -> tuple[SpecController, list[int]]:
    costs = CostModel({int(t): c for t, c in case["costs"]["target"].items()}, case["costs"]["draft"])
    ctl = SpecController(case["k"], costs, adaptive=case["adaptive"], guard=case["guard"], learn=case["learn"],
                         **overrides)
    got = []
    for e in case["events"]:
        if "round" in e:
            ctl.record_round(*e["round"])
        else:
            ctl.record_plain(*e["plain"])
        got.append(ctl.next_k())
    return ctl, got


def test_constants_are_the_specified_ones():
    assert VECTORS["constants"] == {name: getattr(policy, name) for name in VECTORS["constants"]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_policy_vectors(name):
    case = CASES[name]
    ctl, got = replay(case)
    first_diff = next((i for i, (a, b) in enumerate(zip(got, case["next_k"])) if a != b), None)
    assert first_diff is None, f"event {first_diff}: k {got[first_diff]}, recorded {case['next_k'][first_diff]}"
    assert len(got) == len(case["next_k"])
    final = case["final"]
    d = ctl.to_dict()
    assert (d["k_final"], d["fallbacks"], d["fallback_tokens"], d["k_shrinks"], d["k_histogram"]) == (
        final["k_final"], final["fallbacks"], final["fallback_tokens"], final["k_shrinks"], final["k_histogram"])
    assert ctl.alpha == final["alpha"]
    assert {str(t): c for t, c in sorted(ctl.costs.target.items())} == final["target_costs"]
    assert ctl.costs.draft == final["draft_cost"]


def test_vectors_cover_every_rule():
    """The recorded cases exercise each rule of the specification, so an implementation that
    skips one cannot pass them all."""
    nk = {name: set(c["next_k"]) for name, c in CASES.items()}
    finals = {name: c["final"] for name, c in CASES.items()}
    assert any(f["fallbacks"] >= 2 for f in finals.values())  # backoff doubling
    assert any(f["k_shrinks"] >= 1 for f in finals.values())  # shrink to a smaller k
    assert max(max(s) for s in nk.values()) == policy.BACKOFF_START and any(len(s) > 8 for s in nk.values())  # adaptive k
    # k back to its start after a fallback: a 0 followed by the starting k after shrinking
    assert any(0 in s and c["k"] in s and finals[n]["k_shrinks"] for n, c in CASES.items() for s in [nk[n]])
    assert any("plain" in e for c in CASES.values() for e in c["events"] if c["next_k"])


@pytest.mark.parametrize("change", [{"SPIKE_CLAMP": math.inf}, {"BACKOFF_START": 8}, {"BACKOFF_MAX": 64}])
def test_vectors_detect_a_changed_constant(monkeypatch, change):
    for name, value in change.items():
        monkeypatch.setattr(policy, name, value)
    assert any(replay(c)[1] != c["next_k"] for c in CASES.values())


@pytest.mark.parametrize("override", [{"keep": 1.0}, {"min_rounds": 3}, {"decay": 0.8}])
def test_vectors_detect_a_changed_setting(override):
    """keep 1.0 is the threshold the C++ guard used before the policy was specified once."""
    assert any(replay(c, **override)[1] != c["next_k"] for c in CASES.values())


def test_vectors_detect_no_reset_of_k_after_a_fallback(monkeypatch):
    """The old C++ guard kept the shrunk k after a target-only stretch."""
    plain = SpecController.record_plain

    def keep_k(self, n, seconds):
        k = self.k
        plain(self, n, seconds)
        self.k = k

    monkeypatch.setattr(SpecController, "record_plain", keep_k)
    assert any(replay(c)[1] != c["next_k"] for c in CASES.values())


def test_vectors_detect_geometric_only_expectation(monkeypatch):
    """The old C++ policy used only the geometric E(k), not this request's counterfactual rounds."""
    monkeypatch.setattr(SpecController, "expected", lambda self, k: policy.expected_tokens(self.alpha, k))
    assert any(replay(c)[1] != c["next_k"] for c in CASES.values())


def test_vectors_are_what_the_script_records():
    spec = importlib.util.spec_from_file_location("make_policy_vectors", ROOT / "scripts" / "make_policy_vectors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert json.loads(mod.dumps(mod.build())) == VECTORS
