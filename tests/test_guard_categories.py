"""scripts/guard_categories.py refuses a repeat count below one (its end-to-end run loads pipelines on a
process-wide ORT thread pool, which breaks later sessions in the same pytest process)."""

from __future__ import annotations

import json


def test_repeats_below_one_is_refused_with_one_line(load_script, tiny_bundle_factory, capsys):
    bundle = tiny_bundle_factory()
    capsys.readouterr()  # the tiny export's progress
    assert load_script("guard_categories").main([str(bundle), "--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --repeats must be at least 1"]

