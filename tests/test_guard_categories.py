"""scripts/guard_categories.py: the per-category guard check runs end to end on a tiny bundle and
refuses a repeat count below one."""

from __future__ import annotations

import json


def test_repeats_below_one_is_refused_with_one_line(load_script, tiny_bundle_factory, capsys):
    bundle = tiny_bundle_factory()
    capsys.readouterr()  # the tiny export's progress
    assert load_script("guard_categories").main([str(bundle), "--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --repeats must be at least 1"]


def test_every_configuration_is_compared_per_category(load_script, tiny_bundle_factory, capsys):
    bundle = tiny_bundle_factory()  # fp32 target with an int4 self-draft: three configurations
    capsys.readouterr()
    script = load_script("guard_categories")
    # The tiny tokenizer spells the suite's long prompts past a tiny context: short prompts, two categories.
    script.load_prompts = lambda: [
        {"id": f"{c}-{i}", "category": c, "messages": [{"role": "user", "content": f"{c} prompt {i}: say more"}]}
        for c in ("code", "chat") for i in range(2)]
    assert script.main([str(bundle), "--repeats", "1", "--prompts-per-category", "1",
                           "--max-new-tokens", "6", "--threads", "1"]) == 0
    res = json.loads(capsys.readouterr().out)
    (b,) = res["bundles"]
    assert b["repeats"] == 1 and b["prompts"] == 2
    names = set(b["configurations"])
    assert names == {"target-only", "speculative (ngram)", "speculative (model)"}
    for name, row in b["configurations"].items():
        cats = row["per_category"]
        assert set(cats) == {"chat", "code"}, name
        for cell in cats.values():
            assert cell["tokens_per_s"] and cell["tokens_per_s"] > 0
            if name == "target-only":
                assert cell["vs_target_only"] == 1.0
            else:
                assert cell["vs_target_only"] > 0 and "k_histogram" in cell
        assert row["min_vs_target_only"] == min(c["vs_target_only"] for c in cats.values())
