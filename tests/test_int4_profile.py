"""benchmarks/experiments/int4/int4_profile.py times the graph a default (--int4-kernel auto) int4 bundle runs on the
fast kernel: its specedge graph, not the MatMulNBits twin listed first."""

from __future__ import annotations

from specedge.manifest import load_manifest


def test_the_specedge_graph_of_an_auto_bundle_is_the_one_timed(load_script, tiny_bundle_factory):
    prof = load_script("benchmarks/experiments/int4/int4_profile")
    auto = load_manifest(tiny_bundle_factory(precision="int4", draft="ngram"), verify="size")
    assert auto.target.graphs[0].path == "target/model.onnx"  # the twin comes first
    assert prof.specedge_graph(auto).path == "target/model.specedge.onnx"
    plain = load_manifest(
        tiny_bundle_factory(precision="int4", draft="ngram", int4_kernel="matmulnbits"), verify="size"
    )
    assert prof.specedge_graph(plain).path == "target/model.onnx"
