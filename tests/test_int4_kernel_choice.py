"""One int4 bundle, two graphs over one weights file (export/int4_graphs.py), the kernel chosen at
load (runtime/int4_kernel.py): specedge's where its fast path exists here, MatMulNBits elsewhere
(one note), `--int4-kernel` overriding both at export and at load; exact on both graphs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest

from specedge import custom_ops
from specedge.runtime import int4_kernel


def _fast_here() -> bool:
    try:
        return custom_ops.isa() != "portable"
    except (custom_ops.CustomOpsError, OSError, AttributeError):
        return False


needs_fast = pytest.mark.skipif(
    not _fast_here(), reason="specedge's kernels have no fast path here (not built, or a CPU without AVX2)"
)
PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture
def hide_kernels(monkeypatch, tmp_path):
    """As on a machine where specedge was installed without a compiler."""
    monkeypatch.setenv(custom_ops.ENV, str(tmp_path / "absent" / "libspecedge_ops.so"))
    monkeypatch.setattr(int4_kernel, "_noted", False)


def _graphs(bundle):
    from specedge.manifest import load_manifest

    return load_manifest(bundle, verify="full").target.graphs


def test_auto_export_writes_two_graphs_over_one_weights_file(tiny_bundle_factory):
    auto = tiny_bundle_factory(precision="int4", draft="ngram")
    plain, fast = _graphs(auto)
    assert (plain.path, fast.path) == ("target/model.onnx", "target/model.specedge.onnx")
    assert plain.custom_ops == [] and fast.custom_ops == [custom_ops.LIBRARY]
    assert plain.external_data == fast.external_data == ["target/model.onnx.data"]
    assert fast.batch_invariant and not plain.batch_invariant and fast.backends == ["ort-cpu"]
    assert sorted(p.name for p in (auto / "target").iterdir()) == [
        "model.onnx",
        "model.onnx.data",
        "model.specedge.onnx",
    ]
    # one size: the weights of a specedge-only export, once; the twin graph adds no tensor of its
    # own above its decoding constants (int4_graphs.save_pair refuses one over 1 MiB)
    one = tiny_bundle_factory(precision="int4", draft="ngram", int4_kernel="specedge")
    assert (auto / plain.external_data[0]).stat().st_size == (one / "target/model.onnx.data").stat().st_size
    twin = onnx.load(str(auto / plain.path), load_external_data=False)
    assert not any(n.domain == "ai.specedge" for n in twin.graph.node)
    assert any(n.op_type == "MatMulNBits" for n in twin.graph.node)


def _logits(bundle, graph, ids):
    from specedge.manifest import load_manifest
    from specedge.runtime.backends.ort import OrtBackend

    m = load_manifest(bundle, verify="none")
    b = OrtBackend(m, m.target, threads=1, int4_kernel=graph)
    return np.array(b.run(ids, 0)), b


def test_the_twin_computes_what_a_matmulnbits_export_does(tiny_bundle_factory):
    """The twin decodes the shared Q4_1 tensors into MatMulNBits's inputs when ONNX Runtime
    folds its constants: its logits are those of --int4-kernel matmulnbits, bit for bit."""
    ids = np.random.default_rng(3).integers(3, 200, size=12).astype(np.int64)
    twin, b = _logits(tiny_bundle_factory(precision="int4", draft="ngram"), "matmulnbits", ids)
    assert b.graph_spec.path == "target/model.onnx"
    plain, _ = _logits(tiny_bundle_factory(precision="int4", draft="ngram", int4_kernel="matmulnbits"), "auto", ids)
    assert np.array_equal(twin.view(np.uint32), plain.view(np.uint32))


def _greedy(bundle, **kw):
    from specedge.runtime.api import load

    with load(bundle, threads=1, verify="none", **kw) as pipe:
        spec = pipe.generate(PROMPT, max_new_tokens=24, speculative=True)
        alone = pipe.generate(PROMPT, max_new_tokens=24, speculative=False)
        return spec, alone, pipe.describe()


@needs_fast
def test_load_runs_the_fast_kernel_where_it_exists_and_falls_back_with_one_note(
    tiny_bundle_factory, monkeypatch, tmp_path
):
    bundle = tiny_bundle_factory(precision="int4", draft="self", draft_precision="int4")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no note where the kernels run
        spec, alone, d = _greedy(bundle)
    assert spec.token_ids == alone.token_ids  # exact: unpadded steps on the batch-invariant graph
    assert d["target"]["graph"] == "model.specedge.onnx" and d["draft"]["graph"] == "model.specedge.onnx"
    assert d["target"]["int4_kernel"].startswith("specedge (specedge's kernels have their ")
    assert spec.stats["int4_kernels"]["target"] == d["target"]["int4_kernel"]

    monkeypatch.setenv(custom_ops.ENV, str(tmp_path / "absent" / "libspecedge_ops.so"))
    monkeypatch.setattr(int4_kernel, "_noted", False)
    with pytest.warns(RuntimeWarning) as notes:
        slow, slow_alone, d2 = _greedy(bundle)
    mine = [w for w in notes if "int4 graphs run on ONNX Runtime's MatMulNBits" in str(w.message)]
    assert len(mine) == 1  # one note for target and draft together
    assert "libspecedge_ops.so is not installed" in str(mine[0].message)
    assert d2["target"]["graph"] == "model.onnx" and d2["target"]["int4_kernel"].startswith("matmulnbits (")
    assert slow.token_ids == slow_alone.token_ids  # exact: padded steps on the MatMulNBits graph


def test_int4_kernel_overrides_and_their_errors(tiny_bundle_factory, hide_kernels):
    from specedge.runtime.backends.base import BackendError

    bundle = tiny_bundle_factory(precision="int4", draft="ngram")
    _, b = _logits(bundle, "matmulnbits", np.arange(3, 8, dtype=np.int64))
    assert b.kernel_choice.kernel == "matmulnbits"
    assert b.kernel_choice.reason == "asked for with --int4-kernel matmulnbits"
    with pytest.raises(BackendError, match=r"^--int4-kernel specedge: libspecedge_ops.so is not installed"):
        _logits(bundle, "specedge", np.arange(3, 8, dtype=np.int64))
    only = tiny_bundle_factory(precision="int4", draft="ngram", int4_kernel="matmulnbits")
    with pytest.raises(
        BackendError,
        match=r"--int4-kernel specedge: the target model has only a matmulnbits graph "
        r"\(exported with --int4-kernel matmulnbits\); re-export it without",
    ):
        _logits(only, "specedge", np.arange(3, 8, dtype=np.int64))
    with pytest.raises(ValueError, match="int4_kernel must be one of auto, specedge, matmulnbits, got 'fast'"):
        from specedge.runtime.api import load

        load(bundle, int4_kernel="fast")


def test_export_specedge_only_is_refused_where_its_kernels_do_not_run(
    tiny_checkpoint_factory, tmp_path, hide_kernels, capsys
):
    from specedge.cli.export_models import main

    rc = main(
        [
            "--target",
            str(tiny_checkpoint_factory()),
            "--out",
            str(tmp_path / "b"),
            "--precision",
            "int4",
            "--draft",
            "ngram",
            "--int4-kernel",
            "specedge",
            "--quiet",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(
        "error: --int4-kernel specedge: the graph uses specedge's CPU kernels, but libspecedge_ops.so was not found"
    )
    assert not (tmp_path / "b").exists()


def test_stats_line_names_the_kernel():
    from specedge.cli.generate import format_stats

    stats = {
        "tokens": 3,
        "tokens_per_s": 1.0,
        "ttft_s": 0.1,
        "speculative": False,
        "int4_kernels": {"draft": "matmulnbits (asked for with --int4-kernel matmulnbits)"},
    }
    assert format_stats(stats).endswith("| draft int4 kernel matmulnbits (asked for with --int4-kernel matmulnbits)")


def test_inspect_says_which_kernel_runs_here(tiny_bundle_factory, hide_kernels):
    from specedge.cli.inspect import format_report
    from specedge.manifest import load_manifest

    bundle = tiny_bundle_factory(precision="int4", draft="ngram")
    text = format_report(load_manifest(bundle, verify="none"), str(bundle))
    assert (
        "  int4       matmulnbits here (libspecedge_ops.so is not installed (specedge was installed without a C++ "
        "compiler)); graphs: model.onnx (MatMulNBits), model.specedge.onnx (specedge)"
    ) in text


def test_manifest_of_an_auto_bundle_reads_in_the_cpp_schema(tiny_bundle_factory):
    """Two graphs of one flavour, the first without custom ops: what an older reader takes."""
    data = json.loads((tiny_bundle_factory(precision="int4", draft="ngram") / "manifest.json").read_text())
    graphs = data["models"]["target"]["graphs"]
    assert [g.get("custom_ops", []) for g in graphs] == [[], ["specedge_ops"]]
    assert data["extra"]["export"]["options"]["int4_kernel"] == "auto"


CPP_GENERATE = __import__("pathlib").Path(__file__).resolve().parents[1] / "cpp" / "build" / "specedge_generate"


@needs_fast
@pytest.mark.skipif(not CPP_GENERATE.is_file(), reason=f"C++ runtime not built ({CPP_GENERATE})")
def test_cpp_runtime_chooses_as_python_does(tiny_bundle_factory, tmp_path):
    """The C++ runtime takes the specedge graph where libspecedge_ops.so has a fast path, the
    MatMulNBits twin elsewhere (one note) or when SPECEDGE_INT4_KERNEL says so; Python's tokens
    on every graph."""
    import os
    import subprocess

    from specedge.runtime.api import load

    bundle = tiny_bundle_factory(precision="int4", draft="self", draft_precision="int4")
    with load(bundle, threads=1, verify="none") as pipe:
        want = pipe.generate(PROMPT, max_new_tokens=24, speculative=False).token_ids

    def generate(**env):
        r = subprocess.run(
            [str(CPP_GENERATE), str(bundle), PROMPT, "--max-new-tokens", "24", "--threads", "1", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **env},
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["token_ids"] == want, env
        return r.stderr

    note = "specedge: note: int4 graphs run on ONNX Runtime's MatMulNBits"
    assert note not in generate()
    hidden = generate(SPECEDGE_OPS_LIB=str(tmp_path / "absent.so"))
    assert hidden.count(note) == 1 and "libspecedge_ops.so is not installed" in hidden
    assert note not in generate(SPECEDGE_INT4_KERNEL="matmulnbits")
    r = subprocess.run(
        [str(CPP_GENERATE), str(bundle), PROMPT, "--max-new-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SPECEDGE_INT4_KERNEL": "specedge", "SPECEDGE_OPS_LIB": str(tmp_path / "absent.so")},
    )
    assert r.returncode != 0 and "--int4-kernel specedge: libspecedge_ops.so is not installed" in r.stderr


def test_inspect_steps_follow_the_graph_that_runs_here(tiny_bundle_factory, hide_kernels):
    from specedge.cli.inspect import format_report
    from specedge.manifest import load_manifest

    text = format_report(load_manifest(tiny_bundle_factory(precision="int4", draft="ngram"), verify="none"), "b")
    assert "steps      batch-invariant: single-token steps run as 2 tokens" in text  # the MatMulNBits twin


def test_the_kernel_choice_bench_refuses_bad_input(load_script, tiny_bundle_factory, capsys):
    bench = load_script("benchmarks/experiments/int4/int4_kernel_choice")
    assert bench.main(["b", "--steps", "-1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --per-category, --threads must be >= 1, --max-new-tokens >= 2, --steps >= 0"
    )
    only = tiny_bundle_factory(int4_kernel="matmulnbits")  # fp32 target, int4 self-draft: one graph
    capsys.readouterr()  # the export's own progress
    assert bench.main([str(only), "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --int4-kernel specedge: the draft model has only a matmulnbits graph (exported with "
        "--int4-kernel matmulnbits); re-export it without --int4-kernel"
    ]


@needs_fast
def test_the_kernel_choice_bench_on_a_tiny_default_bundle(load_script, tiny_bundle_factory, tmp_path):
    bench = load_script("benchmarks/experiments/int4/int4_kernel_choice")
    out = tmp_path / "r.json"
    assert (
        bench.main(
            [
                str(tiny_bundle_factory(max_seq=512)),
                "--per-category",
                "2",
                "--max-new-tokens",
                "8",
                "--steps",
                "4",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["all_same_tokens"] and set(r["draft_step_ms_median"]) == {"matmulnbits", "specedge"}
    assert r["draft_kernels"]["specedge"].startswith("specedge (asked for")


@needs_fast
def test_trees_follow_the_graph_that_runs(tiny_bundle_factory, hide_kernels):
    """An auto bundle: the specedge graph (unpadded, exact trees) takes tree requests; with the
    kernels hidden the MatMulNBits twin runs padded and refuses them, as a matmulnbits export does."""
    from specedge.runtime.api import load
    from specedge.runtime.generator import inexact_tree_refusal

    bundle = tiny_bundle_factory(family="llama", precision="int4", draft="ngram", max_seq=128, tree=True)
    with pytest.warns(RuntimeWarning, match="int4 graphs run on ONNX Runtime's MatMulNBits"):
        pipe = load(bundle, threads=1, verify="size")
    with pipe, pytest.raises(ValueError) as refused:
        pipe.generate("hello", max_new_tokens=4, tree=True)
    assert str(refused.value) == inexact_tree_refusal("int4")
    with load(bundle, threads=1, verify="size", int4_kernel="auto") as fast:
        pass  # still hidden: the same choice
    assert fast.target.describe()["int4_kernel"].startswith("matmulnbits")


@needs_fast
def test_trees_run_on_the_specedge_graph_of_an_auto_bundle(tiny_bundle_factory):
    from specedge.runtime.api import load

    bundle = tiny_bundle_factory(family="llama", precision="int4", draft="ngram", max_seq=128, tree=True)
    with load(bundle, threads=1, verify="size") as pipe:
        assert "invariant_steps" not in pipe.describe()["target"]  # unpadded steps
        tree = pipe.generate(PROMPT, max_new_tokens=12, tree=True)
        alone = pipe.generate(PROMPT, max_new_tokens=12, speculative=False)
    assert tree.token_ids == alone.token_ids


def test_export_without_the_kernel_library_is_refused_first_and_says_how_to_get_it(tmp_path):
    """On a machine without libspecedge_ops.so, --int4-kernel specedge is refused before any model
    is even looked for (the target here does not exist), naming how to get the library."""
    absent = tmp_path / "absent" / "libspecedge_ops.so"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "specedge.cli.export_models",
            "--target",
            str(tmp_path / "no-such-model"),
            "--precision",
            "int4",
            "--int4-kernel",
            "specedge",
            "--out",
            str(tmp_path / "b"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, custom_ops.ENV: str(absent)},
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "error: --int4-kernel specedge: the graph uses specedge's CPU kernels, but libspecedge_ops.so was not "
        f"found (looked in {absent}): reinstall specedge where a C++ compiler is present (pip builds them), or "
        "build them in a checkout (cmake -S cpp/ops -B cpp/build && cmake --build cpp/build --target "
        "specedge_ops), or set SPECEDGE_OPS_LIB to its path, or leave --int4-kernel out (auto: both graphs)"
    ]
    assert not (tmp_path / "b").exists()
