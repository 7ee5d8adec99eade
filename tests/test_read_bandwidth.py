"""specedge.bench.read_bandwidth: the machine's read bandwidth, the ceiling BENCHMARKS.md sets the
target-only steps' achieved weight bandwidth against."""

from __future__ import annotations

import json

import pytest

from specedge.bench import read_bandwidth as rb


def test_measures_a_positive_bandwidth_with_each_thread_count():
    assert rb.read_bandwidth_gb_s(threads=1, mib=4, repeats=2) > 0
    assert rb.read_bandwidth_gb_s(threads=2, mib=4, repeats=2) > 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        rb.read_bandwidth_gb_s(threads=0)


def test_cli_writes_its_json(tmp_path, capsys):
    out = tmp_path / "m" / "rb.json"
    assert rb.main(["--threads", "2", "--mib", "4", "--repeats", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["schema"] == rb.SCHEMA and res["threads"] == 2 and res["read_gb_s"] > 0
    assert res["command"].startswith("python -m specedge.bench.read_bandwidth --threads 2")
    assert res["machine"]["load_avg_start"] is not None and not list(tmp_path.glob("m/*.tmp"))
    assert "GB/s" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--threads", "--mib", "--repeats"])
def test_cli_bad_input_is_one_error_line(flag, capsys):
    assert rb.main([flag, "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --threads, --mib and --repeats must be at least 1"]
