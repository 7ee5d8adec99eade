"""scripts/benchmarks_md.py writes the whole of BENCHMARKS.md from the committed result files: the
committed page is what it writes (so no figure is typed by hand), within 300 lines, and every
section it names carries its date, load and command."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_page_is_what_the_script_writes(load_script, tmp_path, capsys):
    out = tmp_path / "BENCHMARKS.md"
    assert load_script("benchmarks_md").main(["--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert text == (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8"), "run python scripts/benchmarks_md.py"
    assert len(text.splitlines()) <= 300
    for name in ("machine", "peers", "bench", "quality", "native", "serve", "gpu", "head", "trees"):
        assert f"<!-- {name}:begin -->" in text and f"<!-- {name}:end -->" in text
    assert text.count("## Machine") == 1


def test_every_file_it_reads_is_committed_and_every_result_file_is_read(load_script, tmp_path, capsys):
    """benchmarks/results/ keeps only what the page (or a test) reads: superseded runs live in git."""
    md = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    results = ROOT / "benchmarks" / "results"
    read_by_tests = {"gpu"}  # the GPU tests read h200_run3.json; gpu_md reads every run and its log
    for f in results.rglob("*.json"):
        rel = f.relative_to(ROOT).as_posix()
        assert rel in md or f.parent.name in read_by_tests, f"{rel}: not on the page; remove it (git keeps it)"


def test_a_missing_results_folder_is_one_error_line(load_script, tmp_path, capsys):
    assert (
        load_script("benchmarks_md").main(["--results", str(tmp_path / "none"), "--out", str(tmp_path / "B.md")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --results {tmp_path / 'none'}: not a folder"]
