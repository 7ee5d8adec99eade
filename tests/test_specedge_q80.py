"""ai.specedge.MatMulQ80 (cpp/ops/specedge_ops.cpp, q80_kernel.cpp): MatMulNBits' 8-bit inputs (the
int4 graphs' lm_head) with rows that do not depend on how many rows a call has and one weight read
for all of them. Its arithmetic against a numpy reference, batch invariance on every path (T =
1..17, one thread or two), the paths' bits, the export swap and the twin's swap back. The aarch64
path: tests/test_ops_aarch64.py (under qemu)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_gguf_exact import rel_err
from test_specedge_ops import needs_lib, run_on_path, session

from specedge.export import specedge_kernel as sk
from specedge.export.int4_graphs import matmulnbits_twin
from specedge.export.quantize import describe


def random_q8(rng, n: int, k: int):
    codes = rng.integers(0, 256, size=(n, k // 32, 32), dtype=np.uint8)
    scales = rng.uniform(-0.02, 0.02, size=(n * k // 32,)).astype(np.float32)
    return codes, scales


def nbits_model(codes: np.ndarray, scales: np.ndarray, *, swap: bool, b_input: bool = False) -> onnx.ModelProto:
    """One MatMulNBits (bits 8, block 32, zero point 128) as the int4 export writes the lm_head,
    swapped for MatMulQ80 when `swap`; `b_input`: B a graph input instead of an initializer."""
    n, nb, _ = codes.shape
    k = nb * 32
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "T", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n])
    node = helper.make_node(
        "MatMulNBits",
        ["a", "b", "s"],
        ["y"],
        domain="com.microsoft",
        name="lm_head",
        K=k,
        N=n,
        bits=8,
        block_size=32,
        accuracy_level=4,
    )
    inits = [numpy_helper.from_array(scales, "s")]
    inputs = [a]
    if b_input:
        inputs.append(helper.make_tensor_value_info("b", TensorProto.UINT8, list(codes.shape)))
    else:
        inits.append(numpy_helper.from_array(codes, "b"))
    g = helper.make_graph([node], "g", inputs, [y], inits)
    proto = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    if swap and b_input:  # a graph the export would not write (it swaps only initializer weights)
        proto.graph.node[0].domain, proto.graph.node[0].op_type = sk.DOMAIN, sk.Q8_OP
        proto.opset_import.append(helper.make_opsetid(sk.DOMAIN, 1))
    elif swap:
        assert sk.use_specedge_q8(proto) == 1
    return proto


def reference(a: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The op's sum in float64: int8 activations per block of 32 (scale max|a|/127, nearest even)."""
    n, nb, _ = codes.shape
    x = a.reshape(-1, nb, 32).astype(np.float64)
    sa = np.abs(x).max(-1) / 127.0
    q = np.rint(np.divide(x, sa[..., None], out=np.zeros_like(x), where=sa[..., None] > 0))
    dot = np.einsum("rbj,nbj->rnb", q, codes.astype(np.float64) - 128)
    y = np.einsum("rnb,nb,rb->rn", dot, scales.reshape(n, nb).astype(np.float64), sa)
    return y.reshape(*a.shape[:-1], n)


@needs_lib
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (96, 576)])
@pytest.mark.parametrize("t", [1, 5])
def test_matmulq80_matches_the_reference_and_matmulnbits(n, k, t):
    rng = np.random.default_rng(80)
    codes, scales = random_q8(rng, n, k)
    a = rng.normal(size=(1, t, k)).astype(np.float32)
    if k > 32:
        a[0, 0, :32] = 0  # an all-zero activation block beside others: scale 0
    got = session(nbits_model(codes, scales, swap=True)).run(["y"], {"a": a})[0]
    assert got.shape == (1, t, n)
    assert rel_err(got, reference(a, codes, scales)) <= 1e-5
    # the op it replaces computes the same product (its own summation order)
    nbits = session(nbits_model(codes, scales, swap=False)).run(["y"], {"a": a})[0]
    assert rel_err(got, nbits.astype(np.float64)) <= 1e-5


ROWS_SCRIPT = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from test_specedge_q80 import nbits_model, random_q8
from test_specedge_ops import rows_of_one_row_calls
from specedge import custom_ops
rng = np.random.default_rng(8)
codes, scales = random_q8(rng, 96, 576)
a = rng.normal(size=(1, 17, 576)).astype(np.float32)
np.save({out!r}, rows_of_one_row_calls(nbits_model(codes, scales, swap=True), a))
print(custom_ops.isa())
"""


@needs_lib
def test_rows_do_not_depend_on_the_batch_and_paths_agree(tmp_path):
    """Row i of a T-row call has the bits of the same row alone, T = 1..17, one thread or two, on
    every path this CPU has (AVX-512 VNNI, AVX2, portable), and every path gives the same bits."""
    outs = {}
    for isa in ("native", "avx2", "portable"):  # a path the CPU lacks falls back to the widest it has
        out = tmp_path / f"{isa}.npy"
        ran = run_on_path(ROWS_SCRIPT, isa, out=str(out))
        if isa == "portable":
            assert ran == "portable"
        outs[isa] = np.load(out)
    for isa in ("avx2", "portable"):
        assert np.array_equal(outs["native"], outs[isa]), isa


@needs_lib
def test_weights_that_are_not_initializers_are_refused():
    rng = np.random.default_rng(3)
    codes, scales = random_q8(rng, 16, 64)
    a = np.ones((1, 1, 64), np.float32)
    with pytest.raises(Exception, match="MatMulQ80: B and scales must be initializers"):
        session(nbits_model(codes, scales, swap=True, b_input=True)).run(["y"], {"a": a, "b": codes})


def test_the_swap_takes_only_8_bit_block_32_nodes_and_the_twin_swaps_back():
    rng = np.random.default_rng(5)
    codes, scales = random_q8(rng, 32, 64)
    proto = nbits_model(codes, scales, swap=False)
    for name, value in (("bits", 4), ("block_size", 64)):
        other = onnx.ModelProto()
        other.CopyFrom(proto)
        next(a for a in other.graph.node[0].attribute if a.name == name).i = value
        assert sk.use_specedge_q8(other) == 0, name
    zp = onnx.ModelProto()
    zp.CopyFrom(proto)
    zp.graph.node[0].input.append("s")  # a zero point
    assert sk.use_specedge_q8(zp) == 0
    odd = nbits_model(*random_q8(rng, 24, 64), swap=False)  # N not a multiple of 16
    assert sk.use_specedge_q8(odd) == 0
    assert sk.use_specedge_q8(proto) == 1
    node = proto.graph.node[0]
    assert (node.domain, node.op_type, list(node.input)) == (sk.DOMAIN, sk.Q8_OP, ["a", "b", "s"])
    assert sk.custom_op_libraries(proto) == [sk.LIBRARY] and sk.batch_invariant(proto)
    # the MatMulNBits twin of a specedge graph: the same node it was, on the same initializers
    twin = matmulnbits_twin(proto)
    back = twin.graph.node[0]
    assert (back.domain, back.op_type, list(back.input)) == ("com.microsoft", "MatMulNBits", ["a", "b", "s"])
    assert not sk.custom_op_libraries(twin)


def test_the_manifest_line_counts_the_swapped_nodes():
    info = {
        "method": "gguf-exact",
        "exact_matmuls": 3,
        "source_types": {"Q4_1": 2, "Q8_0": 1},
        "specedge_kernel_matmuls": 2,
        "specedge_q8_matmuls": 1,
    }
    assert "; 1 8-bit MatMulNBits as specedge's MatMulQ80 (one weight read per call))" in describe("int4", info)
    del info["specedge_q8_matmuls"]
    assert "MatMulQ80" not in describe("int4", info)
