#!/usr/bin/env python
"""How close each int4 kernel stays to the GGUF's weights (issue 18): greedy top-1 agreement of the
int4 target graph with the fp32 graph (the GGUF dequantized in fp32, the export's reference),
teacher-forced over the 20 bench prompts (chat-rendered) followed by the fp32 target's own greedy
continuation (--new-tokens), every position of every sequence counted. Both int4 graphs are
built here from the bundle's fp32 target with the same GGUF-exact weights: `matmulnbits`
(MatMulNBits + the block-min correction, the export default) and `specedge` (MatMulQ41 + the
batch-invariant attention, `--int4-kernel specedge`).

    python benchmarks/experiments/int4/int4_agreement.py [FP32_BUNDLE] > benchmarks/experiments/int4/results/int4_agreement.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import onnx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from int4_levers import Stepper  # noqa: E402

from specedge.bench.runner import load_prompts  # noqa: E402
from specedge.export.quantize import quantize_weights  # noqa: E402
from specedge.manifest import load_manifest  # noqa: E402
from specedge.runtime.api import load  # noqa: E402

KERNELS = {"matmulnbits": {}, "specedge": {"kernel": "specedge"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "bundle",
        nargs="?",
        default=str(REPO / "bundles" / "smollm2-135m-instruct"),
        help="a bundle with an fp32 target exported from a GGUF (default: the default bundle)",
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    m = load_manifest(args.bundle, verify="none")
    if m.target.precision != "fp32" or not str(m.target.source).endswith(".gguf"):
        print("error: the bundle's target must be fp32 and exported from a .gguf file", file=sys.stderr)
        return 2
    la0 = os.getloadavg()
    with load(args.bundle, threads=2, draft="ngram") as pipe:
        seqs = []
        for p in load_prompts():
            ids = list(pipe.tokenizer.encode_chat(p["messages"]))
            seqs.append(
                ids + list(pipe.generate(token_ids=ids, max_new_tokens=args.new_tokens, speculative=False).token_ids)
            )
    target = str(m.path(m.target.graph_for("ort-cpu").path))
    ref = Stepper(target, m)
    top1 = [ref.run(s, 0).argmax(-1) for s in seqs]
    del ref
    base = onnx.load(target)
    out = {
        "schema": "specedge.bench.int4_agreement/1",
        "command": "python benchmarks/experiments/int4/int4_agreement.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "bundle": Path(args.bundle).name,
        "sequences": len(seqs),
        "new_tokens": args.new_tokens,
        "load_avg_start": la0,
        "kernels": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in KERNELS.items():
            work = onnx.ModelProto()
            work.CopyFrom(base)
            proto = quantize_weights(work, 4, gguf=m.target.source, accuracy_level=4, **kw)
            d = Path(tmp) / name
            d.mkdir()
            path = str(d / "q.onnx")
            onnx.save_model(proto, path, save_as_external_data=True, location="q.onnx.data")
            st = Stepper(path, m)
            agree = n = 0
            for s, r in zip(seqs, top1):
                agree += int((st.run(s, 0).argmax(-1) == r).sum())
                n += len(s)
            del st
            out["kernels"][name] = {"positions": n, "top1_equal": agree, "agreement_with_fp32": round(agree / n, 4)}
            print(name, out["kernels"][name], file=sys.stderr, flush=True)
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
