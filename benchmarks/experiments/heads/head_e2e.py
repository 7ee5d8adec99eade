"""How long the README's head command takes end to end, as a user runs it (issue 14: <= 60 min
on a 2-core CPU for the default model with the default settings).

    python benchmarks/experiments/heads/head_e2e.py OUT_BUNDLE --out benchmarks/experiments/heads/results/e2e_fp32.json [-- EXPORT_ARGS...]

Runs `export-models --draft head --out OUT_BUNDLE --json [EXPORT_ARGS]` in a subprocess (export,
then train-draft with its defaults: answers, target labels, training) and records its wall time,
the load average before and after, the CPU, and the head's own record of train-draft's time
(`seconds`, of which `data_seconds` built the data; the rest of the wall time is the export
and the process's start). OUT_BUNDLE must not exist: the run is a
first run, with no saved data or checkpoint to resume (its `.NAME.train-draft` folder neither).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # more export-models options, after --
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    a.export_args = extra
    ck = a.bundle.resolve().parent / f".{a.bundle.resolve().name}.train-draft"
    if a.bundle.exists() or ck.exists():
        raise SystemExit(f"{a.bundle} or {ck} exists: the run must start from nothing")
    exe = shutil.which("export-models") or sys.exit("export-models is not on PATH (activate the venv)")
    cmd = [exe, "--draft", "head", "--out", str(a.bundle), "--json", *a.export_args]
    load_before, t0 = os.getloadavg(), time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"export-models exited {proc.returncode}")
    from specedge.bench.runner import machine_info
    from specedge.manifest import load_manifest

    m = load_manifest(a.bundle, verify="size")
    t = m.head.extra["training"]
    res = {
        "kind": "head_e2e",
        "command": " ".join(["export-models", *cmd[1:]]),
        "wall_seconds": round(wall, 1),
        "wall_minutes": round(wall / 60, 2),
        "train_draft_seconds": t["seconds"],
        "data_seconds": t.get("data_seconds"),
        "export_seconds": round(wall - t["seconds"], 1),
        "target_precision": m.target.precision,
        "head_training": t,
        "cpu": machine_info()["cpu"],
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in res.items() if k != "head_training"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
