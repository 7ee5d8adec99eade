"""What the int4 target trades (specedge/bench/quality.py, scripts/bench_quality.py): perplexity
from logits, agreement counting and windowing by hand-checked cases; the script end to end on tiny
bundles; bad input refused with one error line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specedge.bench import quality

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_quality.py"


def test_score_rows_is_the_log_softmax_of_the_target_and_the_argmax():
    logits = np.array([[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0], [1e4, 1e4 + 1, 0.0, 0.0]], dtype=np.float32)
    nll, top = quality.score_rows(logits, [2, 0, 0])
    assert nll[0] == pytest.approx(math.log(4))
    assert nll[1] == pytest.approx(math.log(1 + 3 * math.exp(-10)))
    assert nll[2] == pytest.approx(1 + math.log(1 + math.exp(-1)))  # large logits: no overflow
    assert top.tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="do not match"):
        quality.score_rows(logits, [0, 1])


def test_perplexity_is_exp_of_the_mean_nll():
    assert quality.perplexity(4 * math.log(4), 4) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="no tokens"):
        quality.perplexity(0.0, 0)


def test_windows_are_whole_consecutive_and_capped():
    ids = list(range(10))
    assert quality.windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the tail of 2 is dropped
    assert quality.windows(ids, 3, limit=2) == [[0, 1, 2], [3, 4, 5]]
    assert quality.windows(ids, 11) == []
    with pytest.raises(ValueError, match="at least 2"):
        quality.windows(ids, 1)


def test_greedy_agreement_counts_equal_outputs_and_the_prefix_before_divergence():
    ref = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6], [7, 8, 9]]
    out = [[1, 2, 3, 4], [1, 2, 9, 4], [6, 6], [7, 8]]  # equal; diverges at 2; at 0; stops early
    g = quality.greedy_agreement(ref, out)
    assert g["same_output"] == 1 and g["prompts"] == 4
    assert g["tokens_before_divergence"] == [4, 2, 0, 2]
    assert g["mean_tokens_before_divergence"] == 2.0
    with pytest.raises(ValueError, match="3 outputs for 4"):
        quality.greedy_agreement(ref, out[:3])


class _Tracker:
    """A cache tracker whose logits put the mass on (token + 1) % V at every row: the model
    predicts 'the next id'. Records each call (ids, position)."""

    def __init__(self, vocab: int):
        self.vocab, self.calls = vocab, []

    def run(self, ids, position):
        ids = np.asarray(ids)
        self.calls.append((ids.tolist(), position))
        out = np.zeros((len(ids), self.vocab + 3), dtype=np.float32)  # padded past the vocabulary
        out[np.arange(len(ids)), (ids + 1) % self.vocab] = 5.0
        out[:, self.vocab :] = 100.0  # columns past the vocabulary must be ignored
        return out


class _Generator:
    def __init__(self, vocab: int):
        self.target, self.resets = _Tracker(vocab), 0

    def reset(self):
        self.resets += 1


class _Pipe:
    def __init__(self, vocab=8, chunk=3, max_seq=64, max_call=1 << 30):
        from types import SimpleNamespace

        self.vocab, self.max_seq = vocab, max_seq
        self.manifest = SimpleNamespace(prefill_chunk=chunk)
        self.target = SimpleNamespace(max_call_tokens=max_call)
        self.generator = _Generator(vocab)


def test_score_sequence_feeds_in_chunks_from_slot_0_and_scores_from_first():
    pipe = _Pipe(vocab=8, chunk=3)
    ids = [1, 2, 3, 5, 6, 7, 0]
    nll, top = quality.score_sequence(pipe, ids, 2)
    # every token but the last is fed, in calls of the chunk, at consecutive slots
    assert pipe.generator.target.calls == [([1, 2, 3], 0), ([5, 6, 7], 3)]
    assert pipe.generator.resets == 1  # the cache's record forgotten: nothing reuses the overwritten slots
    assert top.tolist() == [3, 4, 6, 7, 0]  # the rows before ids[2:]
    hit, miss = -math.log(math.exp(5) / (math.exp(5) + 7)), -math.log(1 / (math.exp(5) + 7))
    assert nll == pytest.approx([hit, miss, hit, hit, hit])  # 3 -> 5 was not 'the next id'
    assert quality.call_size(_Pipe(chunk=64, max_call=5)) == 5
    with pytest.raises(ValueError, match="do not fit"):
        quality.score_sequence(_Pipe(max_seq=4), ids, 1)


def test_teacher_forced_counts_argmax_hits_on_the_reference_continuation():
    pipe = _Pipe(vocab=8, chunk=4)
    tf = quality.teacher_forced(pipe, [[1, 2], [6]], [[3, 4, 0], [7, 1]])  # 4 -> 0 misses, 7 -> 0 not 1
    assert tf == {"positions": 5, "top1_agree": 3, "rate": 0.6}


def test_held_out_perplexity_scores_every_window_but_its_first_token():
    pipe = _Pipe(vocab=4, chunk=2)
    r = quality.held_out_perplexity(pipe, [[0, 1, 2], [3, 0, 1]])
    assert r["tokens"] == 4
    assert r["perplexity"] == pytest.approx(math.exp(-math.log(math.exp(5) / (math.exp(5) + 3))), rel=1e-4)


def test_a_request_after_scoring_decodes_as_before(tiny_bundle_factory):
    """Scoring overwrites the cache behind the pipeline's record of it: the next request must not
    reuse the prompt's slots it held before."""
    from specedge.runtime.api import load

    with load(tiny_bundle_factory(draft="ngram"), threads=1, verify="size") as pipe:
        prompt = list(range(5, 45))
        first = pipe.generate(token_ids=prompt, max_new_tokens=8, speculative=False).token_ids
        quality.score_sequence(pipe, list(range(60, 100)), 1)
        assert pipe.generate(token_ids=prompt, max_new_tokens=8, speculative=False).token_ids == first


# ----------------------------------------------------------------------------- the script


def test_the_script_measures_each_int4_kernel_against_fp32(load_script, tiny_bundle_factory, tmp_path, capsys):
    fp32 = tiny_bundle_factory(draft="ngram")
    int4 = tiny_bundle_factory(precision="int4", draft="ngram")  # --int4-kernel auto: two graphs
    text = tmp_path / "held.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 40, encoding="utf-8")
    out = tmp_path / "q.json"
    args = [str(fp32), str(int4), "--out", str(out), "--text", str(text), "--max-new-tokens", "8"]
    args += ["--prompts-per-category", "1", "--window", "32", "--max-windows", "3", "--threads", "1"]
    # a process of its own: the script puts every session on one process-wide thread pool
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    r = json.loads(out.read_text())
    assert r["schema"] == "specedge.bench.quality/1" and r["command"].startswith("python scripts/bench_quality.py")
    assert (
        r["schedule"] == "alternated"
        and r["prompts"] == 4
        and len(r["machine"]["load_avg_end"]) == 3
        and r["text"]["sha256"]
    )
    rows = r["results"]
    from specedge.runtime.int4_kernel import kernels_here

    kernels = ["specedge", "matmulnbits"] if kernels_here()[0] else ["matmulnbits"]
    assert [(x["precision"], x["kernel"]) for x in rows] == [("fp32", None)] + [("int4", k) for k in kernels]
    assert "greedy" not in rows[0]
    for x in rows:
        assert x["perplexity"]["tokens"] == 3 * 31 and x["perplexity"]["window"] == 32
        assert x["perplexity"]["perplexity"] == pytest.approx(math.exp(x["perplexity"]["nll_mean"]), rel=1e-3)
        assert x["teacher_forced"]["positions"] > 0 and x["tokens_per_s"] > 0
    for x in rows[1:]:
        g = x["greedy"]
        assert g["prompts"] == 4 and 0 <= g["same_output"] <= 4 and len(g["tokens_before_divergence"]) == 4
    # the fp32 perplexity differs from int4's: each row scored its own bundle
    assert rows[0]["perplexity"]["nll_mean"] != rows[1]["perplexity"]["nll_mean"]
    md = load_script("bench_quality").markdown(r, "q.json")
    assert md.count("\n| int4 |") == len(kernels) and "| fp32 | – |" in md and "reference" in md


def test_bad_bundles_are_one_error_line(load_script, tiny_bundle_factory, tmp_path, capsys):
    fp32 = tiny_bundle_factory(draft="ngram")
    int4 = tiny_bundle_factory(precision="int4", draft="ngram")
    bq = load_script("bench_quality")
    capsys.readouterr()
    out = ["--out", str(tmp_path / "q.json")]
    cases = [
        ([str(fp32), str(fp32)], "its target is fp32, like the reference: nothing to compare"),
        ([str(int4), str(int4)], "the reference's target must be fp32, this one is int4"),
        ([str(fp32), str(tmp_path / "missing")], str(tmp_path / "missing")),
        ([str(fp32), str(int4), "--text", str(tmp_path / "none.txt")], "--text"),
    ]
    for args, words in cases:
        assert bq.main(args + out) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    # an int4 bundle of a shorter context cuts the prompts elsewhere: its answers would not compare
    short = tiny_bundle_factory(precision="int4", draft="ngram", max_seq=64)
    args = [str(fp32), str(short), "--max-new-tokens", "8", "--prompts-per-category", "1", "--threads", "1"]
    assert bq.main(args + out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {short}: its prompts are not the reference's tokens (another max_seq?)"
    assert not (tmp_path / "q.json").exists()


def test_an_int4_bundle_is_measured_on_the_kernels_this_machine_runs(
    load_script, tiny_bundle_factory, monkeypatch, tmp_path
):
    from specedge import custom_ops
    from specedge.runtime import int4_kernel

    bq = load_script("bench_quality")
    auto = tiny_bundle_factory(precision="int4", draft="ngram")
    one = tiny_bundle_factory(precision="int4", draft="ngram", int4_kernel="matmulnbits")
    assert bq.kernels(tiny_bundle_factory(draft="ngram"), True) == ["auto"]  # fp32: no choice
    assert bq.kernels(one, False) == ["matmulnbits"]
    if int4_kernel.kernels_here()[0]:
        assert bq.kernels(auto, False) == ["specedge", "matmulnbits"]
    # as on a machine where specedge was installed without a compiler: the twin graph only
    monkeypatch.setenv(custom_ops.ENV, str(tmp_path / "absent" / "libspecedge_ops.so"))
    assert bq.kernels(auto, False) == ["matmulnbits"]
