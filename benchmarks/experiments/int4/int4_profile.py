#!/usr/bin/env python
"""Our int4 target graph against onnxruntime-genai's int4 graph of the same model, one step at a
time, in one process and one onnxruntime (issue 18): where a decode step's time goes.

Both graphs run in this interpreter's onnxruntime with the same session settings (2 threads,
spinning on, full optimisation), their caches bound in place (ours: the runtime's static cache;
onnxruntime-genai's: its shared past/present buffer of --max-seq slots, fed an attention mask as
its own runtime does). For T = 1, 2 (a batch-invariant single-token step) and 5 (k + 1) at
position 100 the two graphs are alternated --rounds times, each round the median of 40 steps;
the JSON keeps every round's medians and their median. Then ONNX Runtime's profiler gives the
kernel milliseconds per op type for one step at T = 1, 2 and 5 (mean of 25 steps; the profiler
adds its own cost per node, so these sum to more than the timed step).

    flock /work/bench.lock python benchmarks/experiments/int4/int4_profile.py INT4_BUNDLE ORTGENAI_INT4_DIR \
        > benchmarks/experiments/int4/results/int4_profile.json

INT4_BUNDLE: `export-models --precision int4 --out DIR`; ORTGENAI_INT4_DIR: onnxruntime-genai's
builder output (`python -m onnxruntime_genai.models.builder -i HF -o DIR -p int4 -e cpu`, see
scripts/bench_peers.py), read only as an ONNX file here: onnxruntime-genai itself is not needed.
Without ORTGENAI_INT4_DIR only our graph is timed and profiled. "T5_over_T1" is what a k = 4
verification call costs against a single-token step (issue 37).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_levers import POS, median_step_ms  # noqa: E402

from specedge import custom_ops  # noqa: E402
from specedge.manifest import load_manifest  # noqa: E402

SCHEMA = "specedge.bench.int4_profile/1"
SIZES = (1, 2, 5)
# --cpu-clock: one thread without spinning, each step timed by this process's CPU time, so that other
# processes on a busy machine do not count (they still share its caches and memory bandwidth)
SETTINGS = {"threads": 2, "cpu_clock": False}
PROFILE_SIZES = (1, 2, 5)
# --cpu-clock: one thread without spinning, each step timed by this process's CPU time, so that other
# processes on a busy machine do not count (they still share its caches and memory bandwidth)
SETTINGS = {"threads": 2, "cpu_clock": False}


def session(path: str, profile: str | None = None, libs: list[str] = ()) -> ort.InferenceSession:
    so = ort.SessionOptions()
    custom_ops.register(so, list(libs))  # a --int4-kernel specedge graph needs libspecedge_ops
    so.intra_op_num_threads = SETTINGS["threads"]
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0" if SETTINGS["cpu_clock"] else "1")
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


class Graph(ABC):
    """One graph, its cache bound in place as both input and output."""

    def __init__(
        self, path: str, past: list[tuple[str, str]], shape: tuple, profile: str | None = None, libs: list[str] = ()
    ):
        self.path = path
        self.s = session(path, profile, libs)
        self.io = self.s.io_binding()
        self.io.bind_output("logits")
        self._kv = []
        for past_name, present_name in past:
            v = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
            self._kv.append(v)
            self.io.bind_ortvalue_input(past_name, v)
            self.io.bind_ortvalue_output(present_name, v)

    @abstractmethod
    def feed(self, t: int, pos: int) -> None:
        """Bind the inputs of a T-token step at position `pos` (each graph names them its own way)."""

    def step(self) -> None:
        self.s.run_with_iobinding(self.io)

    def median_ms(self, t: int, reps: int = 40) -> float:
        self.feed(t, POS)
        return median_step_ms(self.step, reps, clock=time.process_time if SETTINGS["cpu_clock"] else time.perf_counter)


def specedge_graph(manifest):
    """The target graph this script times: the specedge graph (the one with custom ops) of an
    --int4-kernel auto bundle, whose MatMulNBits twin is listed first, else the first CPU graph."""
    cpu = [g for g in manifest.target.graphs if "ort-cpu" in g.backends]
    return next((g for g in cpu if g.custom_ops), cpu[0])


class Ours(Graph):
    def __init__(self, bundle: str, profile: str | None = None):
        m = load_manifest(bundle, verify="size")
        g = specedge_graph(m)
        L = m.target.num_layers
        past = [(f"past_{kv}.{i}", f"present_{kv}.{i}") for kv in ("key", "value") for i in range(L)]
        super().__init__(
            str(Path(bundle) / g.path),
            past,
            (1, m.target.num_kv_heads, m.max_seq, m.target.head_dim),
            profile,
            g.custom_ops,
        )

    def feed(self, t: int, pos: int) -> None:
        self.io.bind_cpu_input("input_ids", np.ones((1, t), np.int64))
        self.io.bind_cpu_input("position", np.array([pos], np.int64))
        self.io.bind_output("logits")


class Genai(Graph):
    def __init__(self, folder: str, max_seq: int, profile: str | None = None):
        cfg = json.loads((Path(folder) / "genai_config.json").read_text())["model"]["decoder"]
        L, H, D = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_size"]
        past = [(f"past_key_values.{i}.{kv}", f"present.{i}.{kv}") for kv in ("key", "value") for i in range(L)]
        super().__init__(str(Path(folder) / cfg["filename"]), past, (1, H, max_seq, D), profile)

    def feed(self, t: int, pos: int) -> None:
        self.io.bind_cpu_input("input_ids", np.ones((1, t), np.int64))
        self.io.bind_cpu_input("attention_mask", np.ones((1, pos + t), np.int64))
        self.io.bind_output("logits")


def op_profile(make, t: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        g = make(os.path.join(tmp, "prof"))
        g.feed(t, POS)
        for _ in range(25):
            g.step()
        events = json.loads(Path(g.s.end_profiling()).read_text())
    runs = sum(1 for e in events if e.get("name") == "model_run")
    per: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            per[op] = per.get(op, 0.0) + e["dur"] / 1000.0
    ops = {op: round(v / runs, 3) for op, v in sorted(per.items(), key=lambda kv: -kv[1])}
    return {"kernel_ms_sum": round(sum(per.values()) / runs, 3), "per_op_ms": ops}


def node_counts(path: str) -> dict:
    m = onnx.load(path, load_external_data=False)
    return {"nodes": len(m.graph.node), "ops": dict(Counter(n.op_type for n in m.graph.node).most_common())}


def _ops_isa() -> str | None:
    try:
        return custom_ops.isa()
    except custom_ops.CustomOpsError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", help="an int4 bundle (export-models --precision int4)")
    ap.add_argument(
        "ortgenai",
        nargs="?",
        help="onnxruntime-genai's int4 model folder (genai_config.json + model.onnx); omit: ours only",
    )
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--cpu-clock",
        action="store_true",
        help="1 thread, no spinning, steps timed by CPU time (a busy machine); profiles as usual",
    )
    ap.add_argument("--max-seq", type=int, default=2048, help="onnxruntime-genai's cache slots (ours: the bundle's)")
    args = ap.parse_args()
    if args.cpu_clock:
        SETTINGS.update(threads=1, cpu_clock=True)
    isa = os.environ.get("SPECEDGE_OPS_ISA")
    out = {
        "schema": SCHEMA,
        "command": " ".join(["python", *sys.argv]),
        "onnxruntime": ort.__version__,
        # the path specedge's kernels took (SPECEDGE_OPS_ISA=avx2|portable forces a narrower one)
        "specedge_ops_isa": _ops_isa(),
        **({"SPECEDGE_OPS_ISA": isa} if isa else {}),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "threads": SETTINGS["threads"],
        "clock": "process CPU time" if args.cpu_clock else "wall",
        "position": POS,
        "load_avg_start": list(os.getloadavg()),
    }
    ours = Ours(args.bundle)
    genai = Genai(args.ortgenai, args.max_seq) if args.ortgenai else None
    out["graphs"] = {
        "specedge": node_counts(ours.path),
        **({"onnxruntime-genai": node_counts(genai.path)} if genai else {}),
    }
    out["steps"] = {}
    for t in SIZES:
        a, b = [], []
        for _ in range(args.rounds):
            a.append(ours.median_ms(t))
            if genai:
                b.append(genai.median_ms(t))
        ma = float(np.median(a))
        row = {"specedge_ms": round(ma, 3), "rounds_specedge_ms": [round(x, 3) for x in a]}
        if genai:
            mb = float(np.median(b))
            row.update(
                {
                    "ortgenai_ms": round(mb, 3),
                    "specedge_over_ortgenai": round(ma / mb, 3),
                    "rounds_ortgenai_ms": [round(x, 3) for x in b],
                }
            )
        out["steps"][f"T{t}"] = row
        print(
            f"T={t}: specedge {ma:.2f} ms" + (f", onnxruntime-genai {row['ortgenai_ms']:.2f} ms" if genai else ""),
            file=sys.stderr,
        )
    out["T5_over_T1"] = round(out["steps"]["T5"]["specedge_ms"] / out["steps"]["T1"]["specedge_ms"], 3)
    del ours, genai
    out["profiles"] = {}
    for t in PROFILE_SIZES:
        out["profiles"][f"specedge_T{t}"] = op_profile(lambda p: Ours(args.bundle, p), t)
        if args.ortgenai:
            out["profiles"][f"ortgenai_T{t}"] = op_profile(lambda p: Genai(args.ortgenai, args.max_seq, p), t)
    out["load_avg_end"] = list(os.getloadavg())
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
