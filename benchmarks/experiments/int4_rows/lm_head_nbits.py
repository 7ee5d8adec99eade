"""ONNX Runtime's MatMulNBits alone at the default model's lm_head shape (8 bits, block 32,
49152 x 576, accuracy level 4), one thread, process CPU time: what a T = 5 call costs against
T = 1 (and that its rows are those of T = 1 calls). MatMulQ80's own timing: the kernels'
standalone test, `ops_kernels_test --bench`."""

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

N, K = 49152, 576
rng = np.random.default_rng(0)
B = rng.integers(0, 256, size=(N, K // 32, 32), dtype=np.uint8)
S = (rng.random(N * K // 32, dtype=np.float32) * 0.01).astype(np.float32)
node = helper.make_node(
    "MatMulNBits", ["a", "B", "S"], ["y"], domain="com.microsoft", K=K, N=N, bits=8, block_size=32, accuracy_level=4
)
g = helper.make_graph(
    [node],
    "g",
    [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, "T", K])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", N])],
    [numpy_helper.from_array(B, "B"), numpy_helper.from_array(S, "S")],
)
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
so = ort.SessionOptions()
so.intra_op_num_threads = 1
so.add_session_config_entry("session.intra_op.allow_spinning", "0")
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
a = rng.normal(size=(1, 5, K)).astype(np.float32)
ones = [s.run(None, {"a": a[:, i : i + 1]})[0][0, 0] for i in range(5)]
five = s.run(None, {"a": a})[0][0]
print("rows of T=5 equal to T=1:", all(np.array_equal(five[i], ones[i]) for i in range(5)))
for t in (1, 5, 1, 5):
    ts = []
    for _ in range(30):
        t0 = time.process_time()
        s.run(None, {"a": a[:, :t]})
        ts.append(time.process_time() - t0)
    print(f"T={t}: {1e3 * float(np.median(ts)):.3f} ms CPU")
