"""`specedge build-engines BUNDLE`: build TensorRT plans for this device into bundle/engines/<device-tag>/."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "build-engines",
        help="build TensorRT engines for this GPU",
        description="Build TensorRT plans (one per model, optimization profiles for T = 1, k + 1 and the "
        "prefill chunk) on the device that will run them, into BUNDLE/engines/<device-tag>/. "
        "Needs the tensorrt package (pip install 'specedge[tensorrt]'; JetPack ships it on a Jetson).",
    )
    p.add_argument("bundle", help="bundle folder")
    prec = p.add_mutually_exclusive_group()
    prec.add_argument(
        "--fp16",
        dest="precision",
        action="store_const",
        const="fp16",
        help="allow fp16 kernels (for an fp32 bundle; reduced-precision bundles keep their types)",
    )
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16", help="allow bf16 kernels")
    p.add_argument(
        "--workspace-gb",
        type=float,
        default=None,
        metavar="N",
        help="TensorRT builder workspace limit in GiB (default: TensorRT's own; use 1-2 on an 8 GB Jetson)",
    )
    p.add_argument(
        "--opt-level",
        type=int,
        default=None,
        metavar="L",
        help="builder optimization level 0-5 (lower builds faster, default 3)",
    )
    p.add_argument("--only", choices=("target", "draft"), default=None, help="build one model only")
    p.add_argument("--no-argmax", dest="argmax", action="store_false", help="do not add the on-device argmax output")
    p.add_argument("--device-id", type=int, default=0, help="CUDA device to build for (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if the engines are up to date")
    p.add_argument("--quiet", action="store_true", help="print errors only")
    p.set_defaults(func=run, precision=None)
    return p


def run(args) -> int:
    from ..engines.builder import BuildOptions, build_engines

    options = BuildOptions(
        precision=args.precision,
        workspace_gb=args.workspace_gb,
        optimization_level=args.opt_level,
        argmax_output=args.argmax,
        force=args.force,
        roles=(args.only,) if args.only else ("target", "draft"),
        device_id=args.device_id,
    )

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    infos = build_engines(args.bundle, options, log=log, quiet=args.quiet)
    for info in infos:
        log(
            f"{info.role}: {info.plan_file} for {info.gpu_name} sm_{info.compute_capability.replace('.', '')}, "
            f"TensorRT {info.tensorrt_version}"
        )
    return 0
