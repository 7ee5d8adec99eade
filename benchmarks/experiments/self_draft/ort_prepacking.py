"""Should the runtimes turn off ONNX Runtime's weight prepacking to save memory? For each model
of a bundle, one session with prepacking (the default) and one with `session.disable_prepacking`:
resident memory after loading each and after its first call (in a fresh process, VmRSS minus the
interpreter's; weights ONNX Runtime leaves memory-mapped become resident on first use),
and the median call time for T = 1 (draft step / plain decode), k + 1 (verify) and the prefill
chunk, the two sessions alternating so machine noise hits both alike. Writes JSON.

    python benchmarks/experiments/self_draft/ort_prepacking.py [BUNDLE] [--repeats 5] [--out specedge-bench/ort_prepacking.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from specedge.manifest import load_manifest  # noqa: E402


def session(path: str, prepack: bool, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def feeds(s: ort.InferenceSession, t: int, position: int, kv_shape, kv_dtype) -> dict:
    kv = {i.name: np.zeros(kv_shape, kv_dtype) for i in s.get_inputs() if i.name.startswith("past_")}
    return {
        "input_ids": np.ones((kv_shape[0], t), np.int64),
        "position": np.full((kv_shape[0],), position, np.int64),
        **kv,
    }


def resident(path: str, prepack: bool, threads: int, kv_shape, kv_dtype: str) -> list[float]:
    """MiB resident beyond the interpreter after loading one session, then after one T=1 call
    (which maps in whatever weights loading left on disk); the KV arrays are counted in neither."""
    base = rss_mib()
    s = session(path, prepack, threads)
    loaded = rss_mib() - base
    f = feeds(s, 1, 0, kv_shape, np.dtype(kv_dtype))
    before_call = rss_mib()
    s.run(["logits"], f)
    return [loaded, loaded + rss_mib() - before_call]


def resident_in_child(path: str, prepack: bool, threads: int, kv_shape, kv_dtype) -> list[float]:
    """resident() in a fresh process, so nothing this one loaded is counted."""
    code = (
        "import sys, json; sys.path[:0] = [%r, %r]; import ort_prepacking as p; "
        "print(json.dumps(p.resident(%r, %r, %d, %r, %r)))"
    ) % (
        str(REPO),
        str(Path(__file__).resolve().parent),
        path,
        prepack,
        threads,
        tuple(kv_shape),
        np.dtype(kv_dtype).name,
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?", default=str(REPO / "bundles" / "smollm2-135m-instruct"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--position", type=int, default=100)
    ap.add_argument(
        "--out",
        default=str(REPO / "specedge-bench" / "ort_prepacking.json"),
        help="the committed figures: --out benchmarks/experiments/self_draft/results/ort_prepacking.json",
    )
    a = ap.parse_args()
    m = load_manifest(a.bundle)
    result = {
        "bundle": a.bundle,
        "threads": a.threads,
        "repeats": a.repeats,
        "position": a.position,
        "load_avg_start": os.getloadavg()[0],
        "models": {},
    }
    for spec in (m.target, m.draft):
        if spec.kind != "model":
            continue
        path = str(Path(a.bundle) / next(g.path for g in spec.graphs if "ort-cpu" in g.backends))
        sessions = {p: session(path, p, a.threads) for p in (True, False)}
        kv_shape = (m.batch, spec.num_kv_heads, m.max_seq, spec.head_dim)
        kv_dtype = np.float16 if spec.kv_dtype == "float16" else np.float32
        sizes = sorted({1, m.spec_tokens + 1, m.prefill_chunk})
        times = {(p, t): [] for p in sessions for t in sizes}
        for _ in range(a.repeats):
            for p, s in sessions.items():
                for t in sizes:
                    f = feeds(s, t, a.position, kv_shape, kv_dtype)
                    s.run(["logits"], f)  # warm this shape
                    t0 = time.perf_counter()
                    s.run(["logits"], f)
                    times[(p, t)].append((time.perf_counter() - t0) * 1000)
        entry = {"precision": spec.precision, "graph": path}
        for p in sessions:
            key = "prepacked" if p else "not_prepacked"
            loaded, after_call = resident_in_child(path, p, a.threads, kv_shape, kv_dtype)
            entry[key] = {
                "resident_after_load_mib": round(loaded, 1),
                "resident_after_one_call_mib": round(after_call, 1),
                "call_ms": {str(t): round(statistics.median(times[(p, t)]), 2) for t in sizes},
            }
        entry["slowdown_without_prepacking"] = {
            str(t): round(statistics.median(times[(False, t)]) / statistics.median(times[(True, t)]), 2) for t in sizes
        }
        result["models"][spec.role] = entry
        print(spec.role, json.dumps(entry), flush=True)
    result["load_avg_end"] = os.getloadavg()[0]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
