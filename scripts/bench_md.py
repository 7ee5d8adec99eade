"""Write `specedge bench` results (bench.json files) into BENCHMARKS.md's `bench` section: the
command, the machine and load, the table `specedge bench` prints, the k it would choose and why,
and the plot's path. Nothing is typed by hand.

    python scripts/bench_md.py benchmarks/results/smollm2-135m-instruct_model/bench.json [more bench.json ...]
        [--benchmarks-md BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specedge.bench.report import replace_section
from specedge.bench.runner import format_table, validate_results


def section(path: Path) -> str:
    r = json.loads(path.read_text(encoding="utf-8"))
    validate_results(r)
    m, c, tune = r["machine"], r["config"], r.get("tune") or {}
    la0, la1 = (m.get("load_avg_start") or ["?"])[0], (m.get("load_avg_end") or ["?"])[0]
    lines = [
        f"### `{shlex.join(r['command'])}`",
        "",
        f"Measured {r['created']} on {m['cpu']} ({m['logical_cpus']} logical CPUs), {c['threads']} threads, "
        f"drafter `{c['draft']}`, k ∈ {c['ks']}, {len(c['prompts'])} prompts ({c['per_category']} per category), "
        f"{c['repeats']} repeat(s), {c['max_new_tokens']} new tokens, guard {'on' if c['guard'] else 'off'}; "
        f"load average at start / end {la0} / {la1}. JSON: `{path.as_posix()}`, plot: "
        f"`{path.with_name('bench.png').as_posix()}`.",
        "",
        "```",
        format_table(r),
        "```",
    ]
    if tune.get("k") is not None:
        lines += [
            "",
            f"`--tune` choice: k = {tune['k']} ({tune.get('reason', '')})"
            + (" — written into the manifest." if tune.get("written") else "."),
        ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench.json files")
    ap.add_argument("--benchmarks-md", type=Path, default=Path("BENCHMARKS.md"))
    a = ap.parse_args(argv)
    body = "\n\n".join(section(p) for p in a.results)
    replace_section(a.benchmarks_md, "bench", body, heading="## `specedge bench` (k sweep on the default bundle)")
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
