"""scripts/bench_peers.py: a bad --int4-bundle is refused with one error line; the configurations
alternate prompt by prompt (or run one after another with --sequential)."""

from __future__ import annotations


def test_int4_bundle_must_be_an_int4_bundle(load_script, tiny_bundle_factory, tmp_path, capsys):
    bp = load_script("bench_peers")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fp32 = tiny_bundle_factory()
    args = [
        "--bundle",
        str(fp32),
        "--gguf",
        str(gguf),
        "--engines",
        "specedge",
        "--out",
        str(tmp_path / "o"),
        "--cache",
        str(tmp_path / "c"),
    ]
    capsys.readouterr()  # the tiny export's progress
    assert bp.main(args + ["--int4-bundle", str(fp32)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --int4-bundle") and "has a fp32 target, not int4" in err[0]
    assert bp.main(args + ["--int4-bundle", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --int4-bundle: ")


def test_peer_python_must_be_an_executable(load_script, tiny_bundle_factory, tmp_path, capsys):
    bp = load_script("bench_peers")
    fp32 = tiny_bundle_factory()
    capsys.readouterr()
    args = [
        "--bundle",
        str(fp32),
        "--engines",
        "ortgenai",
        "--out",
        str(tmp_path / "o"),
        "--cache",
        str(tmp_path / "c"),
        "--peer-python",
        str(tmp_path / "no-python"),
    ]
    assert bp.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --peer-python {tmp_path / 'no-python'}: not an executable"]


def test_peer_import_error_says_why(load_script, tmp_path):
    bp = load_script("bench_peers")
    import sys

    assert bp.peer_import_error(sys.executable, "json") is None
    msg = bp.peer_import_error(sys.executable, "no_such_module_here")
    assert msg.startswith(f"not installed for {sys.executable}") and "--peer-python" in msg


def _short_prompts(monkeypatch):
    """The suite with every message cut to its first 200 characters: a tiny bundle holds 512
    positions, less than the longest prompts."""
    from specedge.bench import runner

    full = runner.load_prompts

    def short(path=None):
        return [{**p, "messages": [{**m, "content": m["content"][:200]} for m in p["messages"]]} for p in full(path)]

    monkeypatch.setattr(runner, "load_prompts", short)


def _run_specedge_rows(bp, bundle, tmp_path, *extra):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "o"
    args = ["--bundle", str(bundle), "--gguf", str(gguf), "--engines", "specedge", "--out", str(out)]
    args += ["--cache", str(tmp_path / "c"), "--prompts-per-category", "1", "--max-new-tokens", "6", "--threads", "1"]
    assert bp.main(args + list(extra)) == 0
    import json

    return json.loads((out / "peers.json").read_text())


def test_configurations_alternate_prompt_by_prompt(load_script, tiny_bundle_factory, tmp_path, capsys, monkeypatch):
    """Every configuration is loaded once and decodes prompt i before any decodes prompt i + 1, the
    order rotated per prompt; each row records tokens per target call (1 for target-only)."""
    bp = load_script("bench_peers")
    _short_prompts(monkeypatch)
    res = _run_specedge_rows(bp, tiny_bundle_factory(max_seq=512), tmp_path)
    rows = [r for r in res["results"] if r["status"] == "ok"]
    names = {r["name"] for r in rows}
    assert names == {"specedge target-only", "specedge speculative (self-draft)", "specedge speculative (n-gram)"}
    n = len({r["prompt"] for r in rows[0]["records"]})
    assert n == 4 and all(len(r["records"]) == n and r["order"] == list(range(n)) for r in rows)
    schedule = res["schedule"]
    assert [i for i, _ in schedule] == sorted(i for i, _ in schedule)  # prompt i done everywhere before i + 1
    per_prompt = [[name for i, name in schedule if i == j] for j in range(n)]
    assert all(set(p) == names for p in per_prompt) and per_prompt[0] != per_prompt[1]  # rotated
    base = next(r for r in rows if r["name"] == "specedge target-only")
    assert base["tokens_per_call"] == 1.0
    assert all(r["tokens_per_call"] is not None and r["tokens_per_call"] >= 1.0 for r in rows)
    assert "configurations alternated prompt by prompt" in (tmp_path / "o" / "peers.md").read_text()


def test_sequential_runs_one_configuration_after_another(
    load_script, tiny_bundle_factory, tmp_path, capsys, monkeypatch
):
    bp = load_script("bench_peers")
    _short_prompts(monkeypatch)
    res = _run_specedge_rows(bp, tiny_bundle_factory(max_seq=512), tmp_path, "--only", "target-only", "--sequential")
    (row,) = [r for r in res["results"] if r["status"] == "ok"]
    assert res["schedule"] is None and "order" not in row and len(row["records"]) == 4
    assert "one configuration after another" in (tmp_path / "o" / "peers.md").read_text()


def _row(name, engine, weights, tps, drafter=None, **extra):
    return {
        "name": name,
        "engine": engine,
        "weights": weights,
        "drafter": drafter,
        "status": "ok",
        "tokens_per_s": tps,
        "per_category": {},
        **extra,
    }


def test_int4_figures_compare_each_engines_best(load_script):
    """Issue 37's int4 targets: the default int4 export's target-only against onnxruntime-genai's int4,
    specedge's best int4 configuration against its own target-only (met only when exact) and against
    onnxruntime-genai's best int4 configuration."""
    bp = load_script("bench_peers")
    same = {"int4_greedy": {"identical": 20, "prompts": 20, "diffs": {}}}
    rows = [
        _row("specedge int4 target-only", "specedge", "int4", 300.0),
        _row("specedge int4 + n-gram", "specedge", "int4", 450.0, "n-gram", **same),
        _row("onnxruntime-genai int4", "onnxruntime-genai", "int4", 250.0),
        _row("onnxruntime-genai int4 + n-gram", "onnxruntime-genai", "int4", 260.0, "n-gram"),
    ]
    f = bp.figures(rows)
    assert f["int4_target_vs_ortgenai"]["value"] == 300.0 / 250.0 and f["int4_target_vs_ortgenai"]["met"]
    best = f["int4_best_vs_target"]
    assert best["value"] == 1.5 and best["met"] and "specedge int4 + n-gram" in best["what"]
    vs = f["int4_best_vs_ortgenai_best"]
    assert vs["value"] == 450.0 / 260.0 and vs["met"] and "onnxruntime-genai int4 + n-gram" in vs["what"]
    rows[1]["int4_greedy"] = {"identical": 19, "prompts": 20, "diffs": {}}
    best = bp.figures(rows)["int4_best_vs_target"]
    assert best["value"] == 1.5 and best["met"] is False and "not exact" in best["note"]
    assert bp.figures(rows[:1])["int4_best_vs_target"]["met"] is None  # nothing to compare: not measured


def test_peer_weight_bytes_are_the_model_files_each_engine_reads(load_script, tmp_path):
    """A peer's target-only bandwidth counts its prepared weight files: onnxruntime-genai's graph and
    external data, transformers' safetensors, llama.cpp's GGUF."""
    bp = load_script("bench_peers")
    og = tmp_path / "og4"
    og.mkdir()
    (og / "model.onnx").write_bytes(b"x" * 10)
    (og / "model.onnx.data").write_bytes(b"x" * 100)
    (og / "tokenizer.json").write_bytes(b"x" * 1000)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"x" * 200)
    (hf / "config.json").write_bytes(b"x" * 5)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 300)
    paths = {"ortgenai_int4": str(og), "hf": str(hf), "gguf": str(gguf)}
    assert bp.peer_weight_bytes({"engine": "onnxruntime-genai", "options": {"model": "int4"}}, paths) == 110
    assert bp.peer_weight_bytes({"engine": "transformers", "options": {}}, paths) == 200
    assert bp.peer_weight_bytes({"engine": "llama.cpp", "options": {}}, paths) == 300
