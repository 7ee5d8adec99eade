"""`specedge plan BUNDLE --device NAME | --memory-gb X`: will the bundle fit, and up to which max_seq.

Exit code 0 when it fits, 3 when it does not (with the reason on stderr), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_DOES_NOT_FIT = 3


def register(subparsers) -> argparse.ArgumentParser:
    from ..plan import DEVICES

    p = subparsers.add_parser(
        "plan",
        help="memory plan of a bundle on a device",
        description="Estimate the memory a bundle needs on a device (weights, KV caches at max_seq, "
        "activations, workspace, OS + CUDA context) and the largest max_seq that fits. "
        "Exit code 0 when it fits, 3 when it does not.",
    )
    p.add_argument("bundle", help="bundle folder (or its manifest.json)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--device", choices=sorted(DEVICES), help="a known device")
    g.add_argument("--memory-gb", type=float, metavar="X", help="device memory in GiB (a device not listed)")
    p.add_argument(
        "--reserve-gb",
        type=float,
        metavar="G",
        default=None,
        help="memory taken by the OS and the CUDA context, in GiB (default: typical figure for the device)",
    )
    p.add_argument("--max-seq", type=int, default=None, help="plan for this max_seq instead of the bundle's")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
    return p


def _load(bundle: str):
    from ..manifest import MANIFEST_NAME, BundleError, load_manifest, parse_manifest, read_manifest_json

    path = Path(bundle)
    if path.is_file():
        m = parse_manifest(read_manifest_json(path))
        m.root = path.parent
        return m
    if path.is_dir() and not (path / MANIFEST_NAME).is_file():
        raise BundleError(f"'{path}' is not a bundle: it has no {MANIFEST_NAME}")
    # Planning reads numbers only: no need to hash gigabytes of weights.
    return load_manifest(path, verify="none")


def run(args) -> int:
    from ..errors import UserError
    from ..plan import DEVICES, check_max_seq, custom_device, format_plan, plan_memory, with_reserve

    # every number is checked before the bundle is read: one sentence, exit 2
    try:
        if args.max_seq is not None:
            check_max_seq(args.max_seq)
        if args.device:
            device = DEVICES[args.device]
            if args.reserve_gb is not None:
                device = with_reserve(device, args.reserve_gb)
        else:
            device = custom_device(args.memory_gb, args.reserve_gb)
    except ValueError as e:
        raise UserError(str(e)) from None
    manifest = _load(args.bundle)
    plan = plan_memory(manifest, device, args.max_seq)
    if args.json:
        print(json.dumps({"bundle": str(args.bundle)} | plan.to_json(), indent=2))
    else:
        print(format_plan(plan, Path(args.bundle).name))
    if not plan.fits:
        print(f"error: the bundle does not fit {device.name}: {plan.reason}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0
