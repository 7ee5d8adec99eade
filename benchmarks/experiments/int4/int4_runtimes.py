#!/usr/bin/env python
"""int4 targets across runtimes in one run, configurations alternated prompt by prompt (issue 18).

    flock /work/bench.lock python benchmarks/experiments/int4/int4_runtimes.py INT4_BUNDLE \
        --peer-python OGVENV/bin/python --ortgenai-int4 CACHE/ortgenai-int4 \
        --out benchmarks/experiments/int4/results/int4_runtimes/int4_runtimes.json

Configurations (each a persistent worker process, loaded and warmed once; for every prompt the
driver asks each of them in turn, the order rotated by one per prompt, so load drift hits all of
them alike):

  py            specedge's Python runtime, target-only (the bundle's default steps: single-token
                steps run as T=2 on int4, unpadded on a graph marked batch_invariant and
                confirmed at load: --int4-kernel specedge)
  py+ngram      the same with the n-gram drafter (guard on)
  py-plain      Python, target-only, plain T=1 steps (invariant_steps=False; not exact)
  cpp           the C/C++ runtime (libspecedge through ctypes: specedge_generate_tokens, the loop
                entirely native), target-only (it pads single-token steps as Python does)
  cpp+ngram     the same with the n-gram drafter
  ortgenai      onnxruntime-genai's int4 build of the same model, target-only (--peer-python)
  ortgenai+ngram  its n-gram decoding (ngram_size 3, k draft tokens)

--configs picks a subset. Every engine gets the same chat-rendered token ids, decodes greedily
up to --max-new-tokens, stops at EOS. Decode tok/s per prompt = (new tokens − 1) / (last token
time − first token time); per configuration the JSON keeps every prompt, the median of the
per-prompt tok/s, the total (all decode tokens / all decode seconds) and the median per-prompt
ratio to every other configuration, and for target-only configurations the achieved weight
bandwidth (weight bytes per step x median tok/s). Greedy outputs are compared token for token with `py`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCHEMA = "specedge.bench.int4_runtimes/1"

CONFIGS = {
    "py": ("py", {"draft": "ngram", "speculative": False}),
    "py+ngram": ("py", {"draft": "ngram", "speculative": True}),
    "py-plain": ("py", {"draft": "ngram", "speculative": False, "invariant": False}),
    "cpp": ("cpp", {"draft": "ngram", "speculative": False}),
    "cpp+ngram": ("cpp", {"draft": "ngram", "speculative": True}),
    "ortgenai": ("ortgenai", {}),
    "ortgenai+ngram": ("ortgenai", {"ngram": True}),
}


# ============================================================================ workers
# A worker reads one JSON request per line on stdin ({"ids": [...], "n": N}) and answers one JSON
# line on stdout ({"tokens", "ttft_s", "decode_s", ...}); an empty line ends it.


def _serve(gen) -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write on the protocol channel
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        try:
            res = gen(req["ids"], req["n"])
        except Exception as e:  # reported, never dropped
            res = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(res) + "\n")
        out.flush()


def worker_py(spec: dict) -> None:
    sys.path.insert(0, str(REPO))
    from specedge.runtime.api import load

    opts = spec["options"]
    pipe = load(
        spec["bundle"],
        threads=spec["threads"],
        draft=opts["draft"],
        verify="size",
        shared_pool=True,
        invariant_steps=opts.get("invariant"),
    )

    def gen(ids, n):
        r = pipe.generate(token_ids=ids, max_new_tokens=n, speculative=opts["speculative"])
        st = r.stats
        return {
            "tokens": [int(t) for t in r.token_ids],
            "ttft_s": st["ttft_s"],
            "decode_s": st["decode_s"],
            "target_calls": st.get("target_calls"),
            "acceptance_rate": st.get("acceptance_rate"),
            "fallbacks": st.get("fallbacks"),
        }

    gen(spec["warmup_ids"], 16)
    _serve(gen)


# The C structs grow at their ends (specedge.h); every mirror here keeps room after the fields it
# names, so a library newer than this script never writes past a Python-owned struct.
class _OpenOptions(ctypes.Structure):
    _fields_ = [
        ("backend", ctypes.c_char_p),
        ("threads", ctypes.c_int),
        ("spec_tokens", ctypes.c_int),
        ("draft", ctypes.c_char_p),
        ("verify", ctypes.c_char_p),
        ("allow_spinning", ctypes.c_int),
        ("warmup", ctypes.c_int),
        ("_rest", ctypes.c_byte * 256),
    ]


class _GenParams(ctypes.Structure):
    _fields_ = [
        ("max_new_tokens", ctypes.c_int),
        ("temperature", ctypes.c_double),
        ("top_k", ctypes.c_int),
        ("top_p", ctypes.c_double),
        ("seed", ctypes.c_uint64),
        ("has_seed", ctypes.c_int),
        ("stop", ctypes.c_void_p),
        ("n_stop", ctypes.c_size_t),
        ("spec_tokens", ctypes.c_int),
        ("speculative", ctypes.c_int),
        ("guard", ctypes.c_int),
        ("adaptive_k", ctypes.c_int),
        ("tree", ctypes.c_int),
        ("_rest", ctypes.c_byte * 256),
    ]


class _Stats(ctypes.Structure):  # the leading fields of specedge_stats, then room for the rest
    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("prompt_tokens", ctypes.c_int64),
        ("tokens_per_s", ctypes.c_double),
        ("e2e_tokens_per_s", ctypes.c_double),
        ("ttft_s", ctypes.c_double),
        ("decode_s", ctypes.c_double),
        ("total_s", ctypes.c_double),
        ("time_draft_s", ctypes.c_double),
        ("time_verify_s", ctypes.c_double),
        ("time_other_s", ctypes.c_double),
        ("speculative", ctypes.c_int),
        ("acceptance_rate", ctypes.c_double),
        ("mean_accepted", ctypes.c_double),
        ("target_calls", ctypes.c_int64),
        ("drafted", ctypes.c_int64),
        ("accepted", ctypes.c_int64),
        ("k", ctypes.c_int),
        ("k_final", ctypes.c_int),
        ("fallbacks", ctypes.c_int),
        ("_rest", ctypes.c_byte * 1024),
    ]


ABI_VERSION = 1  # the specedge.h layouts these mirrors follow (SPECEDGE_ABI_VERSION)


TARGET_ONLY = ("py", "py-plain", "cpp")  # configurations that read every target weight once per token


def add_bandwidth(summary: dict, bundle: str) -> None:
    """Achieved weight bandwidth of the target-only configurations (gpt-fast's figure): the
    target's weight bytes per step (manifest `weight_bytes`) x median tok/s. Speculative and
    peer configurations get none: their bytes per token depend on the accepted drafts, and
    onnxruntime-genai's graph reads other bytes (4-bit lm_head) that its files do not state."""
    from specedge.manifest import load_manifest

    wb = load_manifest(bundle, verify="none").target.weight_bytes
    for c, r in summary.items():
        if c in TARGET_ONLY and wb:
            r["weight_bytes_per_token"] = wb
            r["bandwidth_gb_s"] = round(wb * r["median_tokens_per_s"] / 1e9, 2)


def worker_cpp(spec: dict) -> None:
    lib = ctypes.CDLL(spec["lib"])
    if not hasattr(lib, "specedge_abi_version") or lib.specedge_abi_version() != ABI_VERSION:
        got = lib.specedge_abi_version() if hasattr(lib, "specedge_abi_version") else "none (older than 1)"
        raise SystemExit(
            f"{spec['lib']} has ABI version {got}; this script's struct mirrors are version "
            f"{ABI_VERSION}: update them from cpp/include/specedge.h"
        )
    lib.specedge_last_error.restype = ctypes.c_char_p
    lib.specedge_result_tokens.restype = ctypes.POINTER(ctypes.c_int32)
    opts = spec["options"]
    oo = _OpenOptions()
    lib.specedge_open_options_init(ctypes.byref(oo))
    oo.threads = spec["threads"]
    oo.draft = opts["draft"].encode()
    oo.verify = b"size"
    model = ctypes.c_void_p()
    if lib.specedge_open(spec["bundle"].encode(), ctypes.byref(oo), ctypes.byref(model)) != 0:
        raise SystemExit(f"specedge_open: {lib.specedge_last_error().decode()}")

    def gen(ids, n):
        gp = _GenParams()
        lib.specedge_gen_params_init(ctypes.byref(gp))
        gp.max_new_tokens = n
        gp.speculative = int(opts["speculative"])
        arr = (ctypes.c_int32 * len(ids))(*ids)
        res = ctypes.c_void_p()
        if (
            lib.specedge_generate_tokens(
                model, arr, ctypes.c_size_t(len(ids)), ctypes.byref(gp), None, None, ctypes.byref(res)
            )
            != 0
        ):
            raise RuntimeError(lib.specedge_last_error().decode())
        nt = ctypes.c_size_t()
        ptr = lib.specedge_result_tokens(res, ctypes.byref(nt))
        toks = [int(ptr[i]) for i in range(nt.value)]
        st = _Stats()
        lib.specedge_result_stats(res, ctypes.byref(st))
        lib.specedge_result_free(res)
        return {
            "tokens": toks,
            "ttft_s": st.ttft_s,
            "decode_s": st.decode_s,
            "target_calls": st.target_calls,
            "acceptance_rate": st.acceptance_rate,
            "fallbacks": st.fallbacks,
        }

    gen(spec["warmup_ids"], 16)
    _serve(gen)


def worker_ortgenai(spec: dict) -> None:
    import onnxruntime_genai as og

    sys.path.insert(0, str(REPO / "scripts"))
    from bench_peers import _ortgenai_config, _strip_eos, ortgenai_generate

    opts = spec["options"]
    name = f"rt-int4-t{spec['threads']}"
    cfg_dir = _ortgenai_config(
        Path(spec["model"]), Path(spec["cache"]) / name, spec["threads"], spec["eos"], None, spec["k"], True
    )
    model = og.Model(str(cfg_dir))
    eos = set(spec["eos"])
    ngram = {"ngram_size": 3, "max_draft_tokens": spec["k"]} if opts.get("ngram") else None

    def gen(ids, n):
        seq, ttft, dec, _ = ortgenai_generate(og, model, ids, n, ngram)
        return {"tokens": _strip_eos(seq, eos)[:n], "ttft_s": ttft, "decode_s": dec}

    gen(spec["warmup_ids"], 16)
    _serve(gen)


WORKERS = {"py": worker_py, "cpp": worker_cpp, "ortgenai": worker_ortgenai}


# ============================================================================ driver


class Worker:
    def __init__(self, name: str, python: str, spec: dict, env: dict):
        self.name = name
        self.p = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        line = self.p.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise SystemExit(f"worker {name} did not start (exit {self.p.poll()})")

    def ask(self, ids: list[int], n: int) -> dict:
        self.p.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.name} died (exit {self.p.poll()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.p.stdin.write("\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        self.p.wait(timeout=60)


def tps(rec: dict) -> float | None:
    n = len(rec["tokens"]) - 1
    return n / rec["decode_s"] if n > 0 and rec.get("decode_s") else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("bundle", nargs="?", help="an int4 bundle (export-models --precision int4 --draft ngram --out DIR)")
    ap.add_argument(
        "--configs",
        default="py,py+ngram,cpp,cpp+ngram,ortgenai,ortgenai+ngram",
        help=f"comma-separated subset of {','.join(CONFIGS)}",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts-per-category", type=int, default=None, help="first N of each category (default all)")
    ap.add_argument("--categories", default=None, help="comma-separated prompt categories (default all)")
    ap.add_argument("--lib", default=str(REPO / "cpp" / "build" / "libspecedge.so"), help="the C library")
    ap.add_argument("--peer-python", default=sys.executable, help="interpreter with onnxruntime-genai")
    ap.add_argument(
        "--ortgenai-int4",
        default=str(REPO / "specedge-bench" / "peers-cache" / "ortgenai-int4"),
        help="onnxruntime-genai's int4 build of the model (scripts/bench_peers.py --prepare-only)",
    )
    ap.add_argument("--out", default=str(REPO / "bench_out" / "int4_runtimes.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        WORKERS[spec["kind"]](spec)
        return 0

    if not args.bundle:
        ap.error("the following arguments are required: bundle")
    sys.path.insert(0, str(REPO))
    from specedge.bench.runner import load_average, load_prompts, parse_categories, select_prompts
    from specedge.manifest import load_manifest
    from specedge.runtime.api import Tokenizer

    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r}")
    manifest = load_manifest(Path(args.bundle), verify="size")
    tok = Tokenizer(manifest)
    try:
        wanted = parse_categories(args.categories)
    except ValueError as e:
        ap.error(str(e))
    suite = select_prompts(load_prompts(), args.prompts_per_category, wanted)
    prompts = [{"id": p["id"], "category": p["category"], "ids": tok.encode_chat(p["messages"])} for p in suite]
    eos = list(manifest.eos_token_ids)
    k = manifest.spec_tokens
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    la0 = load_average()
    print(f"load average {la0}", file=sys.stderr, flush=True)
    workers = {}
    for c in names:
        kind, opts = CONFIGS[c]
        spec = {
            "kind": kind,
            "options": opts,
            "bundle": str(Path(args.bundle).resolve()),
            "threads": args.threads,
            "warmup_ids": prompts[0]["ids"],
            "lib": args.lib,
            "model": args.ortgenai_int4,
            "cache": str(REPO / "specedge-bench" / "ortgenai-configs"),
            "eos": eos,
            "k": k,
        }
        workers[c] = Worker(c, args.peer_python if kind == "ortgenai" else sys.executable, spec, env)
    la_loaded = load_average()
    recs = {c: [] for c in names}
    try:
        for i, p in enumerate(prompts):
            order = names[i % len(names) :] + names[: i % len(names)]
            for c in order:
                r = workers[c].ask(p["ids"], args.max_new_tokens)
                if "error" in r:
                    raise SystemExit(f"{c} on {p['id']}: {r['error']}")
                r.update(prompt=p["id"], category=p["category"], tokens_per_s=tps(r))
                recs[c].append(r)
            print(
                f"{p['id']}: " + ", ".join(f"{c} {recs[c][-1]['tokens_per_s'] or 0:.1f}" for c in names),
                file=sys.stderr,
                flush=True,
            )
    finally:
        for w in workers.values():
            w.close()
    la1 = load_average()

    def total(rs):
        n = sum(max(len(r["tokens"]) - 1, 0) for r in rs)
        s = sum(r["decode_s"] for r in rs)
        return n / s if s else None

    ref = {r["prompt"]: r["tokens"] for r in recs[names[0]]}
    summary = {}
    cats = sorted({p["category"] for p in prompts})
    for c in names:
        rs = recs[c]
        summary[c] = {
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs if r["tokens_per_s"]),
            "total_tokens_per_s": total(rs),
            "per_category_total": {cat: total([r for r in rs if r["category"] == cat]) for cat in cats},
            f"same_tokens_as_{names[0]}": sum(r["tokens"] == ref[r["prompt"]] for r in rs),
            "median_ratio_to": {
                o: statistics.median(
                    a["tokens_per_s"] / b["tokens_per_s"]
                    for a, b in zip(rs, recs[o])
                    if a["tokens_per_s"] and b["tokens_per_s"]
                )
                for o in names
                if o != c
            },
        }
    add_bandwidth(summary, args.bundle)
    result = {
        "schema": SCHEMA,
        "command": "python benchmarks/experiments/int4/int4_runtimes.py " + " ".join(argv or sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "greedy": True,
        "load_avg_start": la0,
        "load_avg_after_loading": la_loaded,
        "load_avg_end": la1,
        "bundle": Path(args.bundle).name,
        "summary": summary,
        "records": recs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"load": [la0, la1], "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
