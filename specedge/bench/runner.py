"""`specedge bench`: sweep k over the built-in prompt suite and summarize what speculation buys.

What is measured
----------------
For every decoding mode (greedy; sampled at temperature 0.7 with fixed seeds) and every k of the
sweep (k = 0 is target-only decoding, then 1..8 by default), every prompt of the suite is generated
`repeats` times with `max_new_tokens` new tokens. k = 0 runs on a pipeline that has only the target
session (ONNX Runtime's default intra-op spinning on: the target alone at its best); k >= 1 runs on
a pipeline with the drafter. With `shared_pool` (the CLI's default) both pipelines' sessions run on
one process-wide spinning pool, as `specedge generate` does; without it spinning is off whenever a
draft session exists (see docs/design.md). Each
pipeline is warmed up on every call shape before anything is timed, and within a pipeline the
repeats are interleaved over k so that a change of machine load hits every k alike. By default the
runtime's speculation guard is off (`guard=False`), so that each k is measured as itself; `--guard`
measures what an application gets with the guard on.

Results (JSON, `schema` = "specedge.bench/1")
----------------------------------------------
    schema        "specedge.bench/1"
    created       ISO-8601 time (UTC)
    command       argv of the run (list of strings) or null
    machine       cpu, cores, logical_cpus, memory_gb, platform, python, onnxruntime,
                  load_avg_start / load_avg_end ([1, 5, 15] minutes)
    bundle        path, target {precision, weight_bytes, num_params}, draft {kind, precision,
                  weight_bytes}, max_seq, k_manifest
    config        ks, repeats, max_new_tokens, modes, temperature, seeds, draft, guard, threads,
                  backend, quick, prompts (ids), categories, shared_pool, draft_kv
    runs          one record per generation: mode, k, repeat, prompt, category, seed, prompt_tokens,
                  truncated, tokens, finish_reason, tokens_per_s, ttft_s, decode_s, drafted,
                  accepted, target_calls, histogram, time_draft_s, time_verify_s, time_other_s,
                  k_final, fallbacks, peak_rss_mb, matches_target_only, first_diff
    summary       one record per (mode, k, category), category in the suite's + "all":
                  tokens_per_s        summarize() of the per-repeat throughput of the group
                                      (decode tokens / decode seconds over its prompts):
                                      {median, q1, q3, iqr, min, max, n}
                  tokens_per_s_prompt summarize() of the per-run tokens/s
                  ttft_s              summarize() of the per-run time to first token
                  speedup             median tokens/s / the same mode and category's k = 0 median
                  acceptance_rate, mean_accepted, histogram, drafted, accepted, target_calls,
                  target_forward_passes, decode_tokens   pooled (see stats.pool_acceptance)
                  bytes_per_token     weight bytes read per generated token (stats.py)
                  bandwidth_gb_s      bytes_per_token * median tokens/s / 1e9
                  peak_rss_mb         largest per-run peak resident set size of the group
                  time_split          {draft, verify, other}: fractions of decode time
                  greedy_exact        greedy k >= 1 only: {prompts, identical, first_diff
                                      {prompt id: first differing token position}}
                  fallbacks           guard fallbacks to target-only, summed
    best          per mode: {k, tokens_per_s, speedup} of the fastest k on "all"
    tune          choose_k(): {k, score, scores {k: geometric mean speedup over modes}, reason}
                  (+ written, previous_k when --tune wrote the manifest)

A prompt longer than the bundle's context allows (prompt + max_new_tokens > max_seq, only on
tiny test bundles) is cut from the left and marked `truncated`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..progress import new_bar, ticking
from . import stats as S

SCHEMA = "specedge.bench/1"
PROMPTS_SCHEMA = "specedge.bench.prompts/1"
PROMPTS_PATH = Path(__file__).with_name("prompts.json")
CATEGORIES = ("code", "chat", "grounded", "summarization")
MODES = ("greedy", "sampled")
SAMPLED_TEMPERATURE = 0.7
DEFAULT_KS = (0, 1, 2, 3, 4, 5, 6, 7, 8)
QUICK_KS = (0, 1, 2, 4)

__all__ = [
    "SCHEMA",
    "BenchConfig",
    "load_prompts",
    "check_categories",
    "parse_categories",
    "select_prompts",
    "run_bench",
    "summarize_runs",
    "choose_k",
    "tune_manifest",
    "validate_results",
    "machine_info",
    "format_table",
]


# ----------------------------------------------------------------------------- prompts


def load_prompts(path: str | os.PathLike | None = None) -> list[dict]:
    """The prompt suite: a list of {id, category, messages}. Validated: unique ids, known
    categories, non-empty chat messages with string role and content."""
    p = Path(path) if path is not None else PROMPTS_PATH
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the prompt suite {p}: {e}") from None
    if not isinstance(obj, dict) or obj.get("schema") != PROMPTS_SCHEMA or not isinstance(obj.get("prompts"), list):
        raise ValueError(f"{p} is not a prompt suite of schema {PROMPTS_SCHEMA}")
    seen = set()
    out = []
    for item in obj["prompts"]:
        pid = item.get("id") if isinstance(item, dict) else None
        if not isinstance(pid, str) or pid in seen:
            raise ValueError(f"the prompt suite has a missing or repeated id: {pid!r}")
        seen.add(pid)
        if item.get("category") not in CATEGORIES:
            raise ValueError(f"prompt '{pid}' has unknown category {item.get('category')!r}")
        msgs = item.get("messages")
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                and m["content"]
                for m in msgs
            )
        ):
            raise ValueError(f"prompt '{pid}' must have non-empty chat messages")
        out.append({"id": pid, "category": item["category"], "messages": msgs})
    return out


def check_categories(categories: Sequence[str]) -> None:
    """ValueError naming the known categories for one that is not."""
    for c in categories:
        if c not in CATEGORIES:
            raise ValueError(f"unknown category {c!r}; categories: {', '.join(CATEGORIES)}")


def parse_categories(text: str | None) -> list[str] | None:
    """A comma-separated category list (scripts' --categories), checked: None for all."""
    cats = [c.strip() for c in (text or "").split(",") if c.strip()] or None
    check_categories(cats or ())
    return cats


def select_prompts(
    prompts: Sequence[dict], per_category: int | None = None, categories: Sequence[str] | None = None
) -> list[dict]:
    """The first `per_category` prompts of each category (all when None), in suite order."""
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        c = p["category"]
        if categories and c not in categories:
            continue
        if per_category is not None and counts.get(c, 0) >= per_category:
            continue
        counts[c] = counts.get(c, 0) + 1
        out.append(p)
    return out


# ----------------------------------------------------------------------------- config


@dataclass
class BenchConfig:
    ks: list[int] = field(default_factory=lambda: list(DEFAULT_KS))
    repeats: int = 3
    max_new_tokens: int = 128
    modes: list[str] = field(default_factory=lambda: list(MODES))
    temperature: float = SAMPLED_TEMPERATURE
    seed: int = 0
    draft: str | None = None  # "model" | "ngram" | None (the bundle's own kind)
    guard: bool = False
    tree: bool = False  # verify a tree of drafts per target call (generate(tree=True)) instead of a chain
    threads: int | None = None
    backend: str = "auto"
    quick: bool = False
    per_category: int | None = None
    categories: list[str] | None = None
    verify: str = "full"
    shared_pool: bool = False  # load(shared_pool=...): `specedge bench` turns it on, as generate does
    draft_kv: str = "auto"  # load(draft_kv=...): "own" measures a self-draft that prefills the prompt itself

    def validate(self) -> BenchConfig:
        if not self.ks:
            raise ValueError("give at least one k")
        for k in self.ks:
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 16:
                raise ValueError(f"k must be an integer in 0..16 (0 = target only), got {k!r}")
        self.ks = sorted(set(self.ks))
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.max_new_tokens < 2:
            raise ValueError(
                f"max-new-tokens must be >= 2 (tokens/s is measured after the first), got {self.max_new_tokens}"
            )
        for m in self.modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
        if not self.modes:
            raise ValueError("give at least one mode")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.draft_kv not in ("auto", "own"):
            raise ValueError(f"draft-kv must be auto or own, got {self.draft_kv!r}")
        if self.per_category is not None and self.per_category < 1:
            raise ValueError(f"prompts per category must be >= 1, got {self.per_category}")
        if self.categories:
            check_categories(self.categories)
        return self

    @classmethod
    def quick_defaults(cls, **kw) -> BenchConfig:
        base = dict(ks=list(QUICK_KS), repeats=1, max_new_tokens=64, per_category=2, quick=True)
        base.update({k: v for k, v in kw.items() if v is not None})
        return cls(**base)

    def seed_for(self, mode: str, repeat: int, prompt_index: int) -> int | None:
        """Fixed seeds: every (repeat, prompt) of the sampled mode has its own, the same for every k."""
        if mode == "greedy":
            return None
        return self.seed + 1000 * repeat + prompt_index


# ----------------------------------------------------------------------------- machine / memory


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info(threads: int | None = None) -> dict:
    info = {
        "cpu": _cpu_name(),
        "cores": None,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gb": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "threads": threads,
        "load_avg_start": load_average(),
    }
    try:
        import psutil

        info["cores"] = psutil.cpu_count(logical=False)
        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    for mod in ("onnxruntime", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info


class PeakRSS:
    """Peak resident set size of this process over an interval. On Linux the kernel's high-water
    mark (VmHWM) is reset by writing 5 to /proc/self/clear_refs, so each interval gets its own
    peak; elsewhere the process-lifetime peak of getrusage is reported."""

    def __init__(self):
        self._resettable = Path("/proc/self/clear_refs").exists() and Path("/proc/self/status").exists()

    def reset(self) -> None:
        if self._resettable:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self._resettable = False

    def peak_mb(self) -> float | None:
        if self._resettable:
            try:
                for line in Path("/proc/self/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024.0
            except (OSError, ValueError, IndexError):
                pass
        try:
            import resource

            r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return r / 1024.0 if sys.platform != "darwin" else r / 2**20
        except (ImportError, OSError):
            return None


# ----------------------------------------------------------------------------- running


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _load_pipeline(bundle, cfg: BenchConfig, draft: str | None, verify: str):
    from ..runtime.api import load

    return load(
        bundle,
        backend=cfg.backend,
        threads=cfg.threads,
        draft=draft,
        verify=verify,
        shared_pool=cfg.shared_pool,
        draft_kv=cfg.draft_kv,
    )


def _encode(pipe, prompt: dict, max_new_tokens: int) -> tuple[list[int], bool]:
    # the tokenizer directly: Pipeline.encode refuses prompts longer than the context, which the
    # bench cuts instead (tiny test bundles)
    ids = pipe.tokenizer.encode_chat(prompt["messages"])
    budget = int(pipe.manifest.max_seq) - max_new_tokens - 1
    if budget < 8:
        raise ValueError(
            f"max-new-tokens {max_new_tokens} leaves no room for a prompt in the bundle's context of "
            f"{pipe.manifest.max_seq} tokens"
        )
    if len(ids) > budget:
        return list(ids[-budget:]), True
    return list(ids), False


def _generate(pipe, ids: list[int], cfg: BenchConfig, mode: str, k: int, seed: int | None, max_new_tokens: int):
    kw = {
        "token_ids": ids,
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if mode == "greedy" else cfg.temperature,
        "seed": seed,
        "speculative": k > 0,
        "guard": cfg.guard,
    }
    if k > 0:
        kw["spec_tokens"] = k
        if cfg.tree:
            kw["tree"] = True
    return pipe.generate(**kw)


def _record(res, *, mode, k, repeat, prompt, seed, n_prompt, truncated, peak) -> dict:
    st = dict(res.stats or {})
    hist = st.get("accepted_histogram", st.get("histogram")) or []
    return {
        "mode": mode,
        "k": k,
        "repeat": repeat,
        "prompt": prompt["id"],
        "category": prompt["category"],
        "seed": seed,
        "prompt_tokens": n_prompt,
        "truncated": truncated,
        "tokens": int(st.get("tokens", len(res.token_ids))),
        "finish_reason": res.finish_reason,
        "tokens_per_s": float(st.get("tokens_per_s", 0.0) or 0.0),
        "ttft_s": float(st.get("ttft_s", 0.0) or 0.0),
        "decode_s": float(st.get("decode_s", 0.0) or 0.0),
        "drafted": int(st.get("drafted", 0) or 0),
        "accepted": int(st.get("accepted", 0) or 0),
        "target_calls": int(st.get("target_calls", 0) or 0),
        "histogram": [int(x) for x in hist],
        "time_draft_s": float(st.get("time_draft_s", 0.0) or 0.0),
        "time_verify_s": float(st.get("time_verify_s", 0.0) or 0.0),
        "time_other_s": float(st.get("time_other_s", 0.0) or 0.0),
        "k_final": st.get("k_final"),
        "fallbacks": int(st.get("fallbacks", 0) or 0),
        "peak_rss_mb": None if peak is None else round(peak, 1),
        "matches_target_only": None,
        "first_diff": None,
        "output_sha1": hashlib.sha1(json.dumps([int(t) for t in res.token_ids]).encode()).hexdigest()[:12],
    }


def run_bench(
    bundle: str | os.PathLike,
    cfg: BenchConfig,
    *,
    progress: bool = True,
    command: list[str] | None = None,
    prompts: Sequence[dict] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run the sweep and return the results dict (see the module docstring)."""
    from ..manifest import load_manifest

    cfg.validate()
    manifest = load_manifest(bundle, verify=cfg.verify)
    draft = cfg.draft or ("model" if manifest.draft.is_model else "ngram")
    if draft == "model" and not manifest.draft.is_model:
        raise ValueError("this bundle's draft is an n-gram drafter: it has no draft model (use --draft ngram)")
    suite = select_prompts(prompts if prompts is not None else load_prompts(), cfg.per_category, cfg.categories)
    if not suite:
        raise ValueError("no prompt selected")
    machine = machine_info(cfg.threads)
    rss = PeakRSS()
    ks_spec = [k for k in cfg.ks if k > 0]
    total = len(cfg.modes) * len(cfg.ks) * cfg.repeats * len(suite)
    bar = new_bar("bench", total, disable=not progress, unit="gen", dynamic_ncols=True)
    # Loading a pipeline, the warm-up and one long generation each hold the bar for seconds: keep
    # its timer moving and name the step.
    ticker = contextlib.ExitStack()
    if progress:
        ticker.enter_context(ticking(bar))
    runs: list[dict] = []
    reference: dict[str, list[int]] = {}  # greedy k=0 outputs, per prompt id

    def say(msg: str) -> None:
        if log is not None:
            log(msg)
        elif progress:
            bar.write(msg, file=sys.stderr)

    def phase(pipe, ks: list[int]) -> None:
        encoded = {p["id"]: _encode(pipe, p, cfg.max_new_tokens) for p in suite}
        # warm-up: every call shape (T = k + 1 for each k), untimed
        warm_ids = encoded[suite[0]["id"]][0]
        bar.set_postfix_str(f"warm-up, k = {', '.join(map(str, ks))}")
        for k in ks:
            for mode in cfg.modes:
                _generate(pipe, warm_ids, cfg, mode, k, cfg.seed, min(cfg.max_new_tokens, 2 * k + 4))
        for mode in cfg.modes:
            for rep in range(cfg.repeats):
                for k in ks:
                    bar.set_postfix_str(f"{mode} k={k} rep {rep + 1}/{cfg.repeats}")
                    for i, p in enumerate(suite):
                        ids, truncated = encoded[p["id"]]
                        seed = cfg.seed_for(mode, rep, i)
                        rss.reset()
                        res = _generate(pipe, ids, cfg, mode, k, seed, cfg.max_new_tokens)
                        rec = _record(
                            res,
                            mode=mode,
                            k=k,
                            repeat=rep,
                            prompt=p,
                            seed=seed,
                            n_prompt=len(ids),
                            truncated=truncated,
                            peak=rss.peak_mb(),
                        )
                        if mode == "greedy":
                            out = [int(t) for t in res.token_ids]
                            if k == 0 and rep == 0:
                                reference[p["id"]] = out
                            elif k > 0 and p["id"] in reference:
                                d = _first_diff(out, reference[p["id"]])
                                rec["matches_target_only"] = d is None
                                rec["first_diff"] = d
                        runs.append(rec)
                        bar.update(1)

    try:
        if 0 in cfg.ks:
            # target alone at its best: no draft session (so ONNX Runtime keeps its spinning default)
            say("bench: target-only pipeline (k = 0)")
            bar.set_postfix_str("loading the target-only pipeline")
            pipe = _load_pipeline(bundle, cfg, "ngram", "none")
            try:
                phase(pipe, [0])
            finally:
                pipe.close()
        if ks_spec:
            say(f"bench: speculative pipeline (drafter: {draft}), k = {', '.join(map(str, ks_spec))}")
            bar.set_postfix_str(f"loading the speculative pipeline ({draft} drafter)")
            pipe = _load_pipeline(bundle, cfg, draft, "none")
            try:
                describe = pipe.describe() if hasattr(pipe, "describe") else {}
                phase(pipe, ks_spec)
            finally:
                pipe.close()
        else:
            describe = {}
    finally:
        ticker.close()
        bar.close()
    machine["load_avg_end"] = load_average()

    t, d = manifest.target, manifest.draft
    w_draft = d.weight_bytes if (draft == "model" and d.is_model) else 0
    results = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": list(command) if command is not None else None,
        "machine": machine,
        "bundle": {
            "path": str(bundle),
            "target": {
                "precision": t.precision,
                "weight_bytes": t.weight_bytes,
                "num_params": t.num_params,
                "family": t.family,
            },
            "draft": {"kind": draft, "precision": d.precision if draft == "model" else None, "weight_bytes": w_draft},
            "max_seq": manifest.max_seq,
            "k_manifest": manifest.spec_tokens,
            "runtime": describe,
        },
        "config": {
            **_config_json(cfg),
            "draft": draft,
            "prompts": [p["id"] for p in suite],
            "categories": sorted({p["category"] for p in suite}, key=CATEGORIES.index),
        },
        "runs": runs,
    }
    results["summary"] = summarize_runs(runs, t.weight_bytes, w_draft)
    results["best"] = best_per_mode(results["summary"])
    results["tune"] = choose_k(results["summary"])
    return results


def _config_json(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["seeds"] = "seed + 1000 * repeat + prompt index (sampled mode); greedy uses none"
    return d


# ----------------------------------------------------------------------------- summaries


def _group_summary(runs: list[dict], k: int, w_t: float, w_d: float, base: float | None) -> dict:
    by_rep: dict[int, list[dict]] = {}
    for r in runs:
        by_rep.setdefault(r["repeat"], []).append(r)
    tps = S.summarize(S.throughput(rs) for rs in by_rep.values())
    acc = S.pool_acceptance(runs)
    if k == 0:
        acc["target_forward_passes"] = acc["decode_tokens"]
        bpt = float(w_t)
    else:
        bpt = S.bytes_per_token(w_t, w_d, acc["target_forward_passes"], acc["drafted"], acc["decode_tokens"])
    bw = S.bandwidth(bpt, tps["median"])
    dec = sum(r["decode_s"] for r in runs)
    split = None
    if dec > 0:
        dr, ve = sum(r["time_draft_s"] for r in runs), sum(r["time_verify_s"] for r in runs)
        split = {"draft": dr / dec, "verify": ve / dec, "other": max(dec - dr - ve, 0.0) / dec}
    peaks = [r["peak_rss_mb"] for r in runs if r.get("peak_rss_mb") is not None]
    out = {
        "runs": len(runs),
        "tokens_per_s": tps,
        "tokens_per_s_prompt": S.summarize(r["tokens_per_s"] for r in runs),
        "ttft_s": S.summarize(r["ttft_s"] for r in runs),
        "speedup": (tps["median"] / base) if (base and tps["median"] is not None) else None,
        "acceptance_rate": acc["acceptance_rate"],
        "mean_accepted": acc["mean_accepted"],
        "histogram": acc["histogram"],
        "drafted": acc["drafted"],
        "accepted": acc["accepted"],
        "target_calls": acc["target_calls"],
        "target_forward_passes": acc["target_forward_passes"],
        "decode_tokens": acc["decode_tokens"],
        "bytes_per_token": bpt,
        "bandwidth_gb_s": None if bw is None else bw / 1e9,
        "peak_rss_mb": max(peaks) if peaks else None,
        "time_split": split,
        "fallbacks": sum(r.get("fallbacks", 0) for r in runs),
        "greedy_exact": None,
    }
    checked = [r for r in runs if r.get("matches_target_only") is not None and r["repeat"] == 0]
    if checked:
        out["greedy_exact"] = {
            "prompts": len(checked),
            "identical": sum(1 for r in checked if r["matches_target_only"]),
            "first_diff": {r["prompt"]: r["first_diff"] for r in checked if not r["matches_target_only"]},
        }
    return out


def summarize_runs(runs: Sequence[dict], target_weight_bytes: float, draft_weight_bytes: float) -> list[dict]:
    """One summary record per (mode, k, category) plus category "all" (module docstring)."""
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    ks = sorted({r["k"] for r in runs})
    cats = [c for c in CATEGORIES if any(r["category"] == c for r in runs)] + ["all"]
    out = []
    for mode in modes:
        for cat in cats:
            base = None
            for k in ks:
                group = [
                    r for r in runs if r["mode"] == mode and r["k"] == k and (cat == "all" or r["category"] == cat)
                ]
                if not group:
                    continue
                rec = {"mode": mode, "k": k, "category": cat}
                rec.update(_group_summary(group, k, target_weight_bytes, draft_weight_bytes, base))
                if k == 0:
                    base = rec["tokens_per_s"]["median"]
                    rec["speedup"] = 1.0 if base else None
                out.append(rec)
    return out


def find(summary: Sequence[dict], mode: str, k: int, category: str = "all") -> dict | None:
    for r in summary:
        if r["mode"] == mode and r["k"] == k and r["category"] == category:
            return r
    return None


def best_per_mode(summary: Sequence[dict]) -> dict:
    out = {}
    for mode in MODES:
        rows = [r for r in summary if r["mode"] == mode and r["category"] == "all" and r["tokens_per_s"]["median"]]
        if rows:
            b = max(rows, key=lambda r: r["tokens_per_s"]["median"])
            out[mode] = {"k": b["k"], "tokens_per_s": b["tokens_per_s"]["median"], "speedup": b["speedup"]}
    return out


def choose_k(summary: Sequence[dict]) -> dict:
    """The k to ship: the largest geometric mean, over the measured modes, of the overall speed-up
    against target-only (median tokens/s on all prompts). None when no k >= 1 beats target-only
    (then the runtime's guard is what keeps speculation from costing speed)."""
    modes = [m for m in MODES if any(r["mode"] == m for r in summary)]
    ks = sorted({r["k"] for r in summary if r["k"] > 0})
    scores: dict[int, dict] = {}
    for k in ks:
        per = {}
        for m in modes:
            r = find(summary, m, k)
            if r is not None and r["speedup"] is not None:
                per[m] = r["speedup"]
        if per:
            scores[k] = {
                "score": S.geometric_mean(per.values()),
                "speedup": per,
                "acceptance_rate": {m: (find(summary, m, k) or {}).get("acceptance_rate") for m in per},
            }
    if not scores:
        return {
            "k": None,
            "score": None,
            "scores": {},
            "reason": "no speculative k with a target-only baseline was measured",
        }
    ranked = sorted(scores, key=lambda k: scores[k]["score"] or 0.0, reverse=True)
    best = ranked[0]
    sc = scores[best]
    parts = ", ".join(f"{m} {v:.2f}x" for m, v in sc["speedup"].items())
    acc = ", ".join(f"{m} {v:.0%}" for m, v in sc["acceptance_rate"].items() if v is not None)
    if (sc["score"] or 0.0) <= 1.0:
        reason = (
            f"no k beats target-only decoding (best: k={best} at {parts} of target-only speed); "
            "leave speculation to the runtime's guard or use a better draft"
        )
        return {"k": None, "best_k": best, "score": sc["score"], "scores": _jsonable(scores), "reason": reason}
    runner_up = ""
    if len(ranked) > 1:
        r2 = ranked[1]
        runner_up = f"; next best k={r2} at {scores[r2]['score']:.2f}x"
    reason = (
        f"k={best} is fastest overall: {parts} target-only tokens/s (geometric mean "
        f"{sc['score']:.2f}x), acceptance {acc}{runner_up}"
    )
    return {"k": best, "score": sc["score"], "scores": _jsonable(scores), "reason": reason}


def _jsonable(scores: dict) -> dict:
    return {str(k): v for k, v in scores.items()}


# ----------------------------------------------------------------------------- tuning


def tune_manifest(bundle: str | os.PathLike, k: int, why: dict | None = None) -> int:
    """Write spec.k = k into the bundle's manifest atomically (temp file + rename). The manifest
    is not in its own checksum list, so no other file changes. Returns the previous k."""
    from ..manifest import MANIFEST_NAME, MAX_SPEC_TOKENS, load_manifest, write_json_atomic

    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
        raise ValueError(f"k must be an integer in 1..{MAX_SPEC_TOKENS}, got {k!r}")
    m = load_manifest(bundle, verify="size")
    path = Path(bundle) / MANIFEST_NAME
    obj = json.loads(path.read_text(encoding="utf-8"))
    prev = int(obj["spec"]["k"])
    obj["spec"]["k"] = int(k)
    extra = obj.get("extra")
    if not isinstance(extra, dict):
        extra = obj["extra"] = {}
    extra["bench_tune"] = {
        "k": int(k),
        "previous_k": prev,
        "by": "specedge bench --tune",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **(why or {}),
    }
    assert m.root is not None
    write_json_atomic(path, obj)
    return prev


# ----------------------------------------------------------------------------- schema


def _need(obj, key, typ, where):
    if not isinstance(obj, dict) or key not in obj:
        raise ValueError(f"results: missing '{key}' in {where}")
    if typ is not None and not isinstance(obj[key], typ):
        raise ValueError(f"results: '{key}' in {where} must be {typ}")
    return obj[key]


_STAT_KEYS = ("median", "q1", "q3", "iqr", "min", "max", "n")
_RUN_KEYS = (
    "mode",
    "k",
    "repeat",
    "prompt",
    "category",
    "tokens",
    "tokens_per_s",
    "ttft_s",
    "decode_s",
    "drafted",
    "accepted",
    "target_calls",
    "histogram",
    "finish_reason",
    "peak_rss_mb",
)
_SUMMARY_KEYS = (
    "mode",
    "k",
    "category",
    "runs",
    "tokens_per_s",
    "tokens_per_s_prompt",
    "ttft_s",
    "speedup",
    "acceptance_rate",
    "mean_accepted",
    "histogram",
    "bytes_per_token",
    "bandwidth_gb_s",
    "peak_rss_mb",
    "time_split",
    "greedy_exact",
)


def validate_results(obj) -> None:
    """Raise ValueError when `obj` does not follow the results schema (module docstring)."""
    if _need(obj, "schema", str, "the results") != SCHEMA:
        raise ValueError(f"results: schema is {obj['schema']!r}, expected {SCHEMA!r}")
    for key, typ in (
        ("created", str),
        ("machine", dict),
        ("bundle", dict),
        ("config", dict),
        ("runs", list),
        ("summary", list),
        ("best", dict),
        ("tune", dict),
    ):
        _need(obj, key, typ, "the results")
    for key in ("ks", "repeats", "max_new_tokens", "modes", "prompts", "categories", "draft"):
        _need(obj["config"], key, None, "config")
    for key in ("target", "draft", "max_seq", "k_manifest"):
        _need(obj["bundle"], key, None, "bundle")
    for i, r in enumerate(obj["runs"]):
        for key in _RUN_KEYS:
            _need(r, key, None, f"runs[{i}]")
        if r["mode"] not in MODES:
            raise ValueError(f"results: runs[{i}] has unknown mode {r['mode']!r}")
        if r["accepted"] > r["drafted"]:
            raise ValueError(f"results: runs[{i}] accepted more than it drafted")
    cats = set(CATEGORIES) | {"all"}
    for i, r in enumerate(obj["summary"]):
        for key in _SUMMARY_KEYS:
            _need(r, key, None, f"summary[{i}]")
        if r["category"] not in cats:
            raise ValueError(f"results: summary[{i}] has unknown category {r['category']!r}")
        for key in ("tokens_per_s", "tokens_per_s_prompt", "ttft_s"):
            for sk in _STAT_KEYS:
                _need(r[key], sk, None, f"summary[{i}].{key}")
        if r["acceptance_rate"] is not None and not 0.0 <= r["acceptance_rate"] <= 1.0:
            raise ValueError(f"results: summary[{i}] acceptance_rate out of [0, 1]")
    if obj["runs"] and not any(r["category"] == "all" for r in obj["summary"]):
        raise ValueError("results: the summary has no 'all' category")
    json.dumps(obj, allow_nan=False)  # strict JSON: no NaN / inf


# ----------------------------------------------------------------------------- text table


_SHORT = {"summarization": "summ."}


def format_table(results: dict) -> str:
    """A plain-text table of the summary: one line per (mode, k) on all prompts, with per-category
    tokens/s."""
    summary = results["summary"]
    cats = [c for c in results["config"]["categories"]]
    head = (
        f"{'mode':<8} {'k':>2} {'tok/s':>8} {'IQR':>7} {'speedup':>7} {'accept':>7} {'tok/call':>8} {'TTFT s':>7} {'GB/s':>6} {'RSS MB':>7}  "
        + " ".join(f"{_SHORT.get(c, c)[:9]:>9}" for c in cats)
    )
    lines = [head, "-" * len(head)]
    for r in summary:
        if r["category"] != "all":
            continue
        t = r["tokens_per_s"]

        def f(x, spec):
            return format(x, spec) if x is not None else "-"

        per = []
        for c in cats:
            rc = find(summary, r["mode"], r["k"], c)
            per.append(f(rc["tokens_per_s"]["median"] if rc else None, "9.2f"))
        lines.append(
            f"{r['mode']:<8} {r['k']:>2} {f(t['median'], '8.2f')} {f(t['iqr'], '7.2f')} {f(r['speedup'], '6.2f')}x "
            f"{f(r['acceptance_rate'] if r['k'] else None, '7.1%')} {f(r['mean_accepted'] if r['k'] else 1.0, '8.2f')} "
            f"{f(r['ttft_s']['median'], '7.3f')} {f(r['bandwidth_gb_s'], '6.2f')} {f(r['peak_rss_mb'], '7.0f')}  "
            + " ".join(per)
        )
    return "\n".join(lines)
