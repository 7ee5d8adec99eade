"""Levers on the int4 target's step (issue 18): for variants of the default bundle's fp32 target
graph quantized to int4 (GGUF-exact with the block-min correction nodes at several
accuracy levels, re-quantized int4 as the speed floor) and ONNX Runtime session options, measure

- T=1 and T=5 step time at position 100 (median, 2 threads, io-bound static cache),
- greedy agreement with the fp32 graph (the GGUF dequantized in fp32: the reference the
  export's exactness is judged against) and the largest logit gap to it, teacher-forced,
- batch invariance: the logits of 5 tokens verified in one T=5 call against the same 5 tokens
  fed one T=1 step at a time (what exact greedy speculation needs),
- nodes, weight bytes read per step, and an ONNX Runtime profile per op type.

    python benchmarks/experiments/int4/int4_levers.py [BUNDLE] > benchmarks/experiments/int4/results/int4_levers.json
    python benchmarks/experiments/int4/int4_levers.py [BUNDLE] --only "export default,specedge" > ...   (those variants only;
        no session-option or profile runs)
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_default_model import PROMPT  # noqa: E402

from specedge import custom_ops  # noqa: E402
from specedge.export.quantize import quantize_weights, weight_bytes  # noqa: E402
from specedge.export.specedge_kernel import custom_op_libraries  # noqa: E402
from specedge.manifest import load_manifest  # noqa: E402

POS = 100  # step position, as benchmarks/experiments/self_draft/draft_precision.py
VERIFY_T = 5  # k + 1 at the default k = 4


def session(path: str, opt: str = "all", spin: bool = True, profile: str | None = None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    so.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    }[opt]
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    # a graph on specedge's kernels (--int4-kernel specedge) needs libspecedge_ops in its session
    custom_ops.register(so, custom_op_libraries(onnx.load(path, load_external_data=False)))
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


class Stepper:
    """One session with its static KV cache bound in place (the runtime's own layout)."""

    def __init__(self, path: str, m, **kw):
        self.s = session(path, **kw)
        shape = (1, m.target.num_kv_heads, m.max_seq, m.target.head_dim)
        self.io = self.s.io_binding()
        self.io.bind_output("logits")  # first: copy_outputs_to_cpu keeps the binding order
        for i in range(m.target.num_layers):
            for kv in ("key", "value"):
                v = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
                self.io.bind_ortvalue_input(f"past_{kv}.{i}", v)
                self.io.bind_ortvalue_output(f"present_{kv}.{i}", v)

    def run(self, ids, pos: int) -> np.ndarray:
        self.io.bind_cpu_input("input_ids", np.array([ids], np.int64))
        self.io.bind_cpu_input("position", np.array([pos], np.int64))
        self.io.bind_output("logits")  # unallocated again: its shape follows T
        self.s.run_with_iobinding(self.io)
        # logits only (copy_outputs_to_cpu would copy the 60 bound cache tensors too)
        return self.io.get_outputs()[0].numpy()[0].copy()

    def step(self) -> None:
        self.s.run_with_iobinding(self.io)

    def time_ms(self, t: int, reps: int = 30) -> float:
        self.run([1] * t, POS)  # binds the inputs of this shape
        return median_step_ms(self.step, reps)


def median_step_ms(step, reps: int = 30, warmup: int = 5, clock=time.perf_counter) -> float:
    """Median milliseconds (wall, or `clock`'s) of one `step()` over `reps` timed calls, after `warmup`
    untimed ones."""
    for _ in range(warmup):
        step()
    ts = []
    for _ in range(reps):
        t0 = clock()
        step()
        ts.append(clock() - t0)
    return 1000 * float(np.median(ts))


def batch_invariance(path: str, m, ids: list[int]) -> dict:
    """T=VERIFY_T logits against VERIFY_T single steps over the same tokens, at several offsets."""
    st = Stepper(path, m)
    gaps, argmax_equal, bit_equal, n = [], 0, 0, 0
    for p in range(40, len(ids) - VERIFY_T, 15):
        st.run(ids[:p], 0)
        big = st.run(ids[p : p + VERIFY_T], p)
        for j in range(VERIFY_T):
            one = st.run([ids[p + j]], p + j)[0]
            gaps.append(float(np.abs(one - big[j]).max()))
            argmax_equal += int(one.argmax() == big[j].argmax())
            bit_equal += int(np.array_equal(one, big[j]))
            n += 1
    return {"positions": n, "bit_equal": bit_equal, "argmax_equal": argmax_equal, "max_logit_gap": max(gaps)}


def op_profile(path: str, m, prefix: str) -> dict:
    """Milliseconds per op type for one T=1 step (mean of 20), from ONNX Runtime's profiler."""
    st = Stepper(path, m, profile=prefix)
    for _ in range(25):
        st.run([1], POS)
    out = st.s.end_profiling()
    events = json.load(open(out))
    os.remove(out)
    per: dict[str, float] = {}
    runs = sum(1 for e in events if e.get("name") == "model_run")
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            per[op] = per.get(op, 0.0) + e["dur"] / 1000.0
    return {op: round(v / runs, 3) for op, v in sorted(per.items(), key=lambda kv: -kv[1])}


def main():
    args = [a for i, a in enumerate(sys.argv[1:]) if not a.startswith("--") and sys.argv[i] != "--only"]
    bundle = args[0] if args else "bundles/smollm2-135m-instruct"
    m = load_manifest(bundle, verify="none")
    target = str(m.path(m.target.graph_for("ort-cpu").path))
    ids = Tokenizer.from_file(str(m.path("tokenizer.json"))).encode(PROMPT).ids
    ref_st = Stepper(target, m)
    ref = ref_st.run(ids, 0)
    base = onnx.load(target)
    gguf = m.target.source
    variants = {
        "exact, correction nodes, acc 4 (export default)": dict(gguf=gguf, accuracy_level=4),
        "exact, correction nodes, acc 1": dict(gguf=gguf, accuracy_level=1),
        "exact, correction nodes, acc 0": dict(gguf=gguf, accuracy_level=0),
        "re-quantized symmetric int4, acc 4 (not exact: speed floor)": dict(accuracy_level=4),
        "exact, specedge kernels (MatMulQ41 + batch-invariant attention), acc 4": dict(
            gguf=gguf, accuracy_level=4, kernel="specedge"
        ),
    }
    only = next((sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--only"), None)
    if only:
        keys = [k.strip() for k in only.split(",")]
        variants = {n: kw for n, kw in variants.items() if any(k in n for k in keys)}
    out = {
        "bundle": bundle,
        "load_avg_start": os.getloadavg()[0],
        "positions": len(ids),
        "step_position": POS,
        "verify_tokens": VERIFY_T,
        "fp32": {
            "t1_ms": round(ref_st.time_ms(1), 2),
            "t5_ms": round(ref_st.time_ms(VERIFY_T), 2),
            "nodes": len(base.graph.node),
            "weight_bytes_mb": round(weight_bytes(base) / 1e6, 1),
            "batch_invariance": batch_invariance(target, m, ids),
        },
        "variants": {},
        "session_options": {},
        "profiles": {},
    }
    del ref_st
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, kw in variants.items():
            work = onnx.ModelProto()
            work.CopyFrom(base)
            if "gguf" in kw:
                proto = quantize_weights(work, 4, **kw)
            else:
                q = MatMulNBitsQuantizer(work, bits=4, block_size=32, is_symmetric=True, **kw)
                q.process()
                proto = q.model.model
            d = os.path.join(tmp, str(len(paths)))  # a folder each: onnx appends to existing data files
            os.mkdir(d)
            p = paths[name] = os.path.join(d, "q.onnx")
            onnx.save_model(proto, p, save_as_external_data=True, location="q.onnx.data")
            st = Stepper(p, m)
            lg = st.run(ids, 0)
            out["variants"][name] = {
                "agreement_with_fp32": round(float((lg.argmax(-1) == ref.argmax(-1)).mean()), 4),
                "max_logit_gap_to_fp32": round(float(np.abs(lg - ref).max()), 4),
                "t1_ms": round(st.time_ms(1), 2),
                "t5_ms": round(st.time_ms(VERIFY_T), 2),
                "nodes": len(proto.graph.node),
                "weight_bytes_mb": round(weight_bytes(proto) / 1e6, 1),
                "batch_invariance": batch_invariance(p, m, ids),
            }
            del st
            print(name, out["variants"][name], file=sys.stderr, flush=True)
        if only:
            out["only"] = only
            out["load_avg_end"] = os.getloadavg()[0]
            print(json.dumps(out, indent=2))
            return
        default = paths["exact, correction nodes, acc 4 (export default)"]
        for opt in ("all", "extended", "basic"):
            for spin in (True, False):
                key = f"optimization {opt}, spinning {'on' if spin else 'off'}"
                out["session_options"][key] = {"t1_ms": round(Stepper(default, m, opt=opt, spin=spin).time_ms(1), 2)}
                print(key, out["session_options"][key], file=sys.stderr, flush=True)
        for name in (
            "exact, correction nodes, acc 4 (export default)",
            "re-quantized symmetric int4, acc 4 (not exact: speed floor)",
        ):
            out["profiles"][name] = op_profile(paths[name], m, os.path.join(tmp, "prof"))
        for f in glob.glob(os.path.join(tmp, "prof*")):
            os.remove(f)
    out["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
