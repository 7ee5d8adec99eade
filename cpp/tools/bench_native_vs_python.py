"""Native vs Python runtime on one bundle: decode tokens/s, time from process start to the first
streamed text, peak RSS. Same prompt, same threads, greedy, speculative (the bundle's drafter).

    python cpp/tools/bench_native_vs_python.py [BUNDLE] [--threads 2] [--max-new-tokens 64]
        [--repeats 2] [--out bench_out/native_vs_python.json]

Each repeat runs both CLIs alternately; the JSON keeps every run and the median of each figure,
and `--benchmarks-md` writes the medians into that file's `native` section.
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

REPO = Path(__file__).resolve().parents[2]


def run(cmd: list[str]) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    first = None
    out = b""
    while True:
        b = p.stdout.read(1)
        if not b:
            break
        if first is None and b.strip():
            first = time.perf_counter() - t0
        out += b
    err = p.stderr.read().decode(errors="replace")
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[0]} failed: {err}")
    stats = {}
    for line in err.splitlines():  # the --stats line
        if line.startswith("stats:"):
            for part in line.split("|"):
                part = part.strip()
                if part.endswith("tok/s"):
                    stats["tokens_per_s"] = float(part.split()[0])
    return {"first_text_s": first, "wall_s": wall, "peak_rss_mib": ru.ru_maxrss / 1024, **stats}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?", default=str(REPO / "bundles" / "smollm2-135m-instruct"))
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--benchmarks-md", default="", help="write the table into this file's `native` section")
    ap.add_argument("--out", default=str(REPO / "bench_out" / "native_vs_python.json"))
    a = ap.parse_args()
    common = [a.bundle, a.prompt, "--max-new-tokens", str(a.max_new_tokens), "--threads", str(a.threads), "--stats"]
    cmds = {
        "native": [str(REPO / "cpp" / "build" / "specedge_generate"), *common],
        "python": [sys.executable, "-m", "specedge", "generate", *common],
    }
    runs = {k: [] for k in cmds}
    load0 = os.getloadavg()[0]
    for _ in range(a.repeats):
        for k, c in cmds.items():
            runs[k].append(run(c))
            print(k, runs[k][-1], flush=True)
    load1 = os.getloadavg()[0]
    median = {
        k: {f: statistics.median(r.get(f) or 0.0 for r in v) for f in ("tokens_per_s", "first_text_s", "peak_rss_mib")}
        for k, v in runs.items()
    }
    result = {
        "bundle": a.bundle,
        "prompt": a.prompt,
        "threads": a.threads,
        "max_new_tokens": a.max_new_tokens,
        "greedy": True,
        "speculative": True,
        "load_avg_start": load0,
        "load_avg_end": load1,
        "median": median,
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(median, indent=2))
    if a.benchmarks_md:
        sys.path.insert(0, str(REPO))
        from specedge.bench.report import replace_section

        n, py = median["native"], median["python"]
        rows = [
            "| figure (median of %d runs each) | native `specedge_generate` | Python `specedge generate` | native ÷ Python |"
            % a.repeats,
            "|---|---:|---:|---:|",
            f"| decode tokens/s | {n['tokens_per_s']:.1f} | {py['tokens_per_s']:.1f} | {n['tokens_per_s'] / py['tokens_per_s']:.2f}× |",
            f"| process start → first text (s) | {n['first_text_s']:.2f} | {py['first_text_s']:.2f} | {n['first_text_s'] / py['first_text_s']:.2f}× |",
            f"| peak RSS (MiB) | {n['peak_rss_mib']:.0f} | {py['peak_rss_mib']:.0f} | {n['peak_rss_mib'] / py['peak_rss_mib']:.2f}× |",
        ]
        cmd = "python cpp/tools/bench_native_vs_python.py " + " ".join(sys.argv[1:])
        body = (
            f"Prompt `{a.prompt}`, greedy, speculative (the bundle's drafter), {a.max_new_tokens} new tokens, "
            f"{a.threads} threads, bundle `{Path(a.bundle).name}`; load average {load0:.2f} → {load1:.2f}. "
            f"Command: `{cmd}` (JSON: `{Path(a.out).relative_to(REPO) if Path(a.out).is_relative_to(REPO) else a.out}`).\n\n"
            + "\n".join(rows)
        )
        replace_section(a.benchmarks_md, "native", body, heading="## Native (C++) vs Python runtime (issue 6)")


if __name__ == "__main__":
    main()
