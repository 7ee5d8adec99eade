"""The machine's memory read bandwidth: the ceiling a decode step's weight reads are measured against.

    python -m specedge.bench.read_bandwidth [--threads 2] [--mib 256] [--repeats 7] [--out FILE.json]

Each of N threads reduces its own buffer of --mib MiB (a bitwise OR over 64-bit words: one
vectorized instruction per load, so the loads, not the arithmetic, set the pace; NumPy releases
the GIL inside the reduction, so the threads read at once). The figure is the best of --repeats
passes of all threads together: total bytes / wall time, in GB/s (10^9 bytes). Buffers are far
larger than any CPU cache, and are written once before timing so every page is resident.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

SCHEMA = "specedge.bench.read_bandwidth/1"


def read_bandwidth_gb_s(threads: int = 2, mib: int = 256, repeats: int = 7) -> float:
    """Best-of-`repeats` read bandwidth of `threads` threads each reading its own `mib` MiB."""
    if threads < 1 or mib < 1 or repeats < 1:
        raise ValueError("threads, mib and repeats must be at least 1")
    words = mib * 2**20 // 8
    bufs = [np.full(words, i + 1, dtype=np.uint64) for i in range(threads)]
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            results = list(pool.map(np.bitwise_or.reduce, bufs))
            dt = time.perf_counter() - t0
            if results != [i + 1 for i in range(threads)]:  # the reads happened, and read what was written
                raise RuntimeError(f"the buffers read back {results}, not what was written")
            best = max(best, threads * words * 8 / dt / 1e9)
    return best


def main(argv=None) -> int:
    from specedge.bench.runner import load_average, machine_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="reading threads (default 2)")
    ap.add_argument("--mib", type=int, default=256, help="MiB each thread reads (default 256)")
    ap.add_argument("--repeats", type=int, default=7, help="passes; the best counts (default 7)")
    ap.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    a = ap.parse_args(argv)
    if min(a.threads, a.mib, a.repeats) < 1:
        print("error: --threads, --mib and --repeats must be at least 1", file=sys.stderr)
        return 2
    mach = machine_info(a.threads)
    gbs = read_bandwidth_gb_s(a.threads, a.mib, a.repeats)
    mach["load_avg_end"] = load_average()
    res = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m specedge.bench.read_bandwidth " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": mach,
        "threads": a.threads,
        "mib_per_thread": a.mib,
        "repeats": a.repeats,
        "read_gb_s": round(gbs, 2),
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        tmp.replace(a.out)
    print(f"read bandwidth, {a.threads} thread(s): {gbs:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
