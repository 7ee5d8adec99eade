"""Load test of `specedge serve` on loopback, against the same pipeline in-process.

    python scripts/serve_load.py --bundle bundles/smollm2-135m-instruct --out benchmarks/results/serve/smollm2.json

1. Starts `specedge serve BUNDLE --threads T` as a subprocess on a free loopback port and loads
   the same bundle in this process the way `specedge generate` does (load(..., shared_pool=True)).
2. Single client: for each prompt of the bench suite (chat messages, the category as the task
   label), alternately in-process `Pipeline.generate` and one streamed HTTP request, so that both
   see the same machine state; end-to-end tokens/s of each (completion tokens / wall time of the
   whole request, prefill included) and the ratio per prompt; the texts must be equal (greedy).
3. 1, 2 and 4 concurrent clients, each sending the prompts in turn: p50 / p99 time to first
   token (first content chunk) and total latency seen by the client.
4. A soak of --soak requests from 4 clients: failures (errors, non-200) and wrong answers
   (text different from the single-client answer of that prompt).
The server's /metrics (acceptance per task) and the load average are saved with the figures.
Traffic goes to 127.0.0.1 only; every loop is bounded in count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return s[k]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_request(client, url: str, prompt: dict, max_tokens: int) -> dict:
    """One streamed chat request: text, completion tokens, TTFT and total time on the client."""
    body = {
        "messages": prompt["messages"],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "specedge": {"task": prompt["category"]},
    }
    t0 = time.perf_counter()
    ttft, pieces, usage = None, [], None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                text = c["delta"].get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    pieces.append(text)
    total = time.perf_counter() - t0
    return {"text": "".join(pieces), "tokens": usage["completion_tokens"], "ttft_s": ttft or total, "total_s": total}


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "specedge",
        "serve",
        args.bundle,
        "--port",
        str(port),
        "--threads",
        str(args.threads),
        "--queue",
        "64",
        "--verify",
        "size",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, stderr=open(args.server_log, "w"), env=env)
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"specedge serve exited with {proc.returncode}; see {args.server_log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("specedge serve did not start within 300 s")


def concurrent_level(
    url: str, prompts: list[dict], clients: int, per_client: int, max_tokens: int, expected: dict
) -> dict:
    import httpx

    results, failures = [], []
    lock = threading.Lock()

    def client_loop(ci: int):
        with httpx.Client(timeout=600) as c:
            for j in range(per_client):
                p = prompts[(ci * per_client + j) % len(prompts)]
                try:
                    r = stream_request(c, url, p, max_tokens)
                    with lock:
                        results.append({**r, "id": p["id"], "correct": r["text"] == expected[p["id"]]})
                except Exception as e:  # noqa: BLE001 - a failed request is a figure here
                    with lock:
                        failures.append(f"{p['id']}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] for r in results]
    total = [r["total_s"] for r in results]
    return {
        "clients": clients,
        "requests": clients * per_client,
        "completed": len(results),
        "failed": len(failures),
        "wrong": sum(not r["correct"] for r in results),
        "failures": failures[:10],
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "total_p50_s": percentile(total, 50) if total else None,
        "total_p99_s": percentile(total, 99) if total else None,
        "wall_s": wall,
        "aggregate_tokens_per_s": sum(r["tokens"] for r in results) / wall if wall > 0 else 0.0,
    }


def task_gauges(metrics_text: str, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        smp.labels["task"]: smp.value
        for fam in text_string_to_metric_families(metrics_text)
        for smp in fam.samples
        if smp.name == name
    }


def md_section(r: dict, json_path: str) -> str:
    """BENCHMARKS.md's `serve` section from one result file."""
    sc = r["single_client"]
    ratios = [p["ratio"] for p in sc["prompts"]]
    la0, la1 = r["loadavg_before"][0], r["loadavg_after"][0]
    # the server's log file is where this machine kept it: not part of the figures
    cmd = re.sub(r" --server-log \S+", "", r.get("command", "python scripts/serve_load.py"))
    lines = [
        f"`{cmd}`: bundle `{r['bundle']}`, threads {r['threads']}, "
        f"{r['max_tokens']} new tokens per request (soak: {r['soak_max_tokens']}), greedy, one replica, "
        f"{r['cpu_count']} CPUs; 1-minute load average at start / end {la0:.2f} / {la1:.2f}"
        + (
            " (**loaded machine**: other jobs ran; absolute tok/s are low, ratios come from the same run, "
            "alternating per prompt)"
            if la0 > 1.5
            else " (the load at the end is this run's own clients and server)"
        )
        + f". JSON: `{json_path}`.",
        "",
        f"Single client, {sc['of']} prompts, end-to-end tokens/s (completion tokens / request time, prefill "
        f"included), in-process `Pipeline.generate` as `specedge generate` runs it vs one streamed request to "
        f"`specedge serve`, alternating prompt by prompt:",
        "",
        "| in-process tok/s (median) | HTTP tok/s (median) | HTTP / in-process (median of per-prompt ratios) "
        "| min – max ratio | equal texts |",
        "| --- | --- | --- | --- | --- |",
        f"| {sc['median_inprocess_tokens_per_s']:.1f} | {sc['median_http_tokens_per_s']:.1f} | "
        f"**{sc['median_ratio']:.3f}×** | {min(ratios):.3f} – {max(ratios):.3f} | {sc['equal']}/{sc['of']} |",
        "",
        "Concurrent clients (each sends the prompts in turn; streamed; times seen by the client):",
        "",
        "| clients | requests | failed | wrong | TTFT p50 | TTFT p99 | total p50 | total p99 | aggregate tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for lv in r["levels"] + [dict(r["soak"], clients=f"{r['soak']['clients']} (soak)")]:
        lines.append(
            f"| {lv['clients']} | {lv['requests']} | {lv['failed']} | {lv['wrong']} | {lv['ttft_p50_s']:.3f} s "
            f"| {lv['ttft_p99_s']:.3f} s | {lv['total_p50_s']:.3f} s | {lv['total_p99_s']:.3f} s "
            f"| {lv['aggregate_tokens_per_s']:.1f} |"
        )
    acc = task_gauges(r["server_metrics"], "specedge_acceptance_rate")
    mean = task_gauges(r["server_metrics"], "specedge_mean_accepted_tokens")
    lines += [
        "",
        "Acceptance per task label on the server over the whole run (`/metrics`): "
        + ", ".join(f"{t} {acc[t]:.2f} ({mean.get(t, 0):.2f} tokens/target call)" for t in sorted(acc))
        + ".",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default=str(REPO / "bundles" / "smollm2-135m-instruct"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=20, help="prompts of the bench suite to use (default all 20)")
    ap.add_argument("--levels", default="1,2,4", help="concurrent clients per level")
    ap.add_argument("--per-client", type=int, default=8, help="requests each client sends per level")
    ap.add_argument("--soak", type=int, default=200, help="requests of the soak run (4 clients)")
    ap.add_argument("--soak-max-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--server-log", default="/tmp/specedge-serve-load.log")
    ap.add_argument(
        "--benchmarks-md", default=None, metavar="PATH", help="also write the `serve` section of this BENCHMARKS.md"
    )
    ap.add_argument("--md-only", action="store_true", help="only write the section from an existing --out JSON")
    args = ap.parse_args(argv)
    if args.md_only:
        write_md(args)
        return 0
    import httpx

    from specedge.bench.runner import load_prompts
    from specedge.runtime.api import load

    prompts = load_prompts()[: args.prompts]
    load_before = os.getloadavg()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    pipe = load(args.bundle, threads=args.threads, shared_pool=True)
    out: dict = {
        "command": "python scripts/serve_load.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "bundle": Path(args.bundle).name,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "soak_max_tokens": args.soak_max_tokens,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_before": load_before,
    }
    try:
        # warm both sides on every prompt once (first calls of a shape, the server's code paths)
        with httpx.Client(timeout=600) as c:
            for p in prompts[:4]:
                pipe.generate(messages=p["messages"], max_new_tokens=8)
                stream_request(c, url, p, 8)
            single, expected = [], {}
            for p in prompts:
                t0 = time.perf_counter()
                res = pipe.generate(messages=p["messages"], max_new_tokens=args.max_tokens)
                wall = time.perf_counter() - t0
                h = stream_request(c, url, p, args.max_tokens)
                expected[p["id"]] = res.text
                local_tps = len(res.token_ids) / wall
                http_tps = h["tokens"] / h["total_s"]
                single.append(
                    {
                        "id": p["id"],
                        "category": p["category"],
                        "tokens": len(res.token_ids),
                        "inprocess_tokens_per_s": local_tps,
                        "http_tokens_per_s": http_tps,
                        "ratio": http_tps / local_tps,
                        "inprocess_ttft_s": res.stats["ttft_s"],
                        "http_ttft_s": h["ttft_s"],
                        "equal": h["text"] == res.text,
                        "acceptance_rate": res.stats["acceptance_rate"],
                    }
                )
                print(
                    f"single {p['id']}: in-process {local_tps:.1f} tok/s, http {http_tps:.1f} tok/s "
                    f"({http_tps / local_tps:.3f}x) equal={h['text'] == res.text}",
                    file=sys.stderr,
                )
        out["single_client"] = {
            "prompts": single,
            "median_ratio": statistics.median(s["ratio"] for s in single),
            "median_inprocess_tokens_per_s": statistics.median(s["inprocess_tokens_per_s"] for s in single),
            "median_http_tokens_per_s": statistics.median(s["http_tokens_per_s"] for s in single),
            "equal": sum(s["equal"] for s in single),
            "of": len(single),
        }
        # the soak's shorter answers, in-process
        soak_expected = {
            p["id"]: pipe.generate(messages=p["messages"], max_new_tokens=args.soak_max_tokens).text for p in prompts
        }
        pipe.close()  # the rest measures the server alone
        pipe = None
        out["levels"] = []
        for n in (int(x) for x in args.levels.split(",")):
            lv = concurrent_level(url, prompts, n, args.per_client, args.max_tokens, expected)
            out["levels"].append(lv)
            print(
                f"level {n}: ttft p50 {lv['ttft_p50_s']:.3f}s p99 {lv['ttft_p99_s']:.3f}s, total p50 "
                f"{lv['total_p50_s']:.3f}s p99 {lv['total_p99_s']:.3f}s, failed {lv['failed']}, wrong {lv['wrong']}",
                file=sys.stderr,
            )
        per = -(-args.soak // 4)
        soak = concurrent_level(url, prompts, 4, per, args.soak_max_tokens, soak_expected)
        out["soak"] = soak
        print(
            f"soak: {soak['completed']}/{soak['requests']} completed, failed {soak['failed']}, wrong {soak['wrong']}",
            file=sys.stderr,
        )
        out["server_metrics"] = httpx.get(url + "/metrics").text
    finally:
        if pipe is not None:
            pipe.close()
        proc.terminate()
        proc.wait(60)
    out["loadavg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    if args.benchmarks_md:
        write_md(args)
    return 0


def write_md(args) -> None:
    from specedge.bench.report import replace_section

    r = json.loads(Path(args.out).read_text())
    rel = Path(args.out).resolve()
    rel = rel.relative_to(REPO).as_posix() if rel.is_relative_to(REPO) else args.out
    replace_section(
        args.benchmarks_md or REPO / "BENCHMARKS.md",
        "serve",
        md_section(r, rel),
        heading="## Serving (`specedge serve`, issue 16)",
    )


if __name__ == "__main__":
    sys.exit(main())
