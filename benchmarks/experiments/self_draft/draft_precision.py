"""Which precision for the `self` draft? Greedy top-1 agreement with the fp32 target (teacher-forced
on tests/test_default_model.py's ~117-token prompt) and T=1 step time at position 100, for several
weight-only quantizations of the default bundle's fp32 target graph: ONNX Runtime's quantizer
(re-quantizing the dequantized GGUF weights) and the export's GGUF-exact path (the file's own
blocks, specedge/export/gguf_exact.py). Writes JSON to stdout.

    python benchmarks/experiments/self_draft/draft_precision.py [BUNDLE] [--hqq]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, MatMulNBitsQuantizer
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_default_model import PROMPT  # noqa: E402

from specedge.export.quantize import quantize_weights, weight_bytes  # noqa: E402
from specedge.manifest import load_manifest  # noqa: E402


def session(path: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def caches(m):
    shape = (1, m.target.num_kv_heads, m.max_seq, m.target.head_dim)
    return {
        f"past_{kv}.{i}": np.zeros(shape, np.float32) for i in range(m.target.num_layers) for kv in ("key", "value")
    }


def prompt_logits(path, m, ids):
    feeds = {"input_ids": np.array([ids], np.int64), "position": np.array([0], np.int64), **caches(m)}
    return session(path).run(["logits"], feeds)[0][0]


def step_ms(path, m, reps=30):
    s = session(path)
    io = s.io_binding()
    vals = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in caches(m).items()}
    for k, v in vals.items():
        io.bind_ortvalue_input(k, v)
        io.bind_ortvalue_output(k.replace("past_", "present_"), v)
    io.bind_cpu_input("input_ids", np.ones((1, 1), np.int64))
    io.bind_cpu_input("position", np.array([100], np.int64))
    io.bind_output("logits")
    for _ in range(5):
        s.run_with_iobinding(io)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        s.run_with_iobinding(io)
        ts.append(time.perf_counter() - t)
    return 1000 * float(np.median(ts))


def main():
    bundle = next((a for a in sys.argv[1:] if not a.startswith("--")), "bundles/smollm2-135m-instruct")
    m = load_manifest(bundle, verify="none")
    target = str(m.path(m.target.graph_for("ort-cpu").path))
    ids = Tokenizer.from_file(str(m.path("tokenizer.json"))).encode(PROMPT).ids
    ref = prompt_logits(target, m, ids).argmax(-1)
    base = onnx.load(target)
    gguf = m.target.source
    variants = {
        "int4 GGUF-exact acc4 (export default)": dict(gguf=gguf, bits=4),
        "int8 GGUF-exact acc4": dict(gguf=gguf, bits=8),
        "int4 sym acc4": dict(bits=4, block_size=32, is_symmetric=True, accuracy_level=4),
        "int4 asym acc4": dict(bits=4, block_size=32, is_symmetric=False, accuracy_level=4),
        "int4 asym acc0": dict(bits=4, block_size=32, is_symmetric=False, accuracy_level=0),
        "int8 sym acc4": dict(bits=8, block_size=32, is_symmetric=True, accuracy_level=4),
    }
    if "--hqq" in sys.argv:  # two minutes of quantization
        variants["int4 HQQ block 32"] = dict(algo_config=HQQWeightOnlyQuantConfig(block_size=32, bits=4))
    out = {
        "bundle": bundle,
        "positions": len(ids),
        "load_avg": os.getloadavg()[0],
        "fp32_target_step_ms": step_ms(target, m),
        "fp32_target_nodes": len(base.graph.node),
        "fp32_target_weight_bytes": weight_bytes(base),
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in variants.items():
            work = onnx.ModelProto()
            work.CopyFrom(base)
            if "gguf" in kw:
                proto = quantize_weights(work, kw["bits"], gguf=kw["gguf"])
            else:
                q = MatMulNBitsQuantizer(work, **kw)
                q.process()
                proto = q.model.model
            # a folder per variant: onnx appends to an existing external-data file
            d = os.path.join(tmp, str(len(out["variants"])))
            os.mkdir(d)
            p = os.path.join(d, "q.onnx")
            onnx.save_model(proto, p, save_as_external_data=True, location="q.onnx.data")
            agree = float((prompt_logits(p, m, ids).argmax(-1) == ref).mean())
            files = sum(os.path.getsize(os.path.join(d, f)) for f in ("q.onnx", "q.onnx.data"))
            out["variants"][name] = {
                "agreement": round(agree, 3),
                "step_ms": round(step_ms(p, m), 1),
                "nodes": len(proto.graph.node),
                "files_mb": round(files / 1e6, 1),
                "weight_bytes_mb": round(weight_bytes(proto) / 1e6, 1),
            }
            print(name, out["variants"][name], file=sys.stderr, flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
