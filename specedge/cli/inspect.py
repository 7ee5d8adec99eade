"""`specedge inspect BUNDLE [--json] [--tensorrt VERSION]`: what a bundle holds — models, precision,
KV mode, graph I/O, sizes.

By default it reads the manifest and checks each file's size (no hashing and no torch), so it
is instant even on a multi-GB bundle, and says so; `--verify full` also checks every sha256.
`--tensorrt VERSION` also lists, per graph that build-engines would give TensorRT, every node that
version's ONNX parser does not import (tensorrt_support.py): exit 3 when one would not parse
or no graph is offered to TensorRT, 0 when all would.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

_INDEXED = re.compile(r"^(.*)\.(\d+)$")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect",
        help="show what a bundle holds",
        description="Print a bundle's models (family, precision, parameters, weight bytes), KV mode, "
        "max_seq, k, prefill chunk, eos ids, graph inputs/outputs and file sizes.",
    )
    p.add_argument("bundle", help="bundle folder")
    p.add_argument("--json", action="store_true", help="print the manifest plus computed sizes as JSON")
    p.add_argument(
        "--verify",
        choices=("size", "full"),
        default="size",
        help="file check: size (default, instant) or full (sha256 of every file)",
    )
    p.add_argument(
        "--tensorrt",
        metavar="VERSION",
        default=None,
        help="check every graph offered to TensorRT against that version's ONNX parser (e.g. 10.3 for "
        "JetPack 6): list what it does not import; exit 3 when a graph would not parse",
    )
    p.set_defaults(func=run)
    return p


# ----------------------------------------------------------------------------- formatting helpers


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def fmt_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _shape(shape) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 3] -> '0..3'; [0, 2, 3, 4, 7] -> '0,2..4,7'."""
    parts, start, prev = [], None, None
    for i in idx:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}..{prev}" if prev > start else str(start))
            start = prev = i
    if start is not None:
        parts.append(f"{start}..{prev}" if prev > start else str(start))
    return ",".join(parts)


def compress_tensors(tensors) -> list[tuple[str, str, str]]:
    """(name, dtype, shape) rows, with per-layer tensors that share dtype and shape folded into one
    row named like `past_key.{0..29}`. Rows keep the order of each group's first tensor."""
    groups: dict[tuple, list[int]] = {}
    order: list[tuple] = []
    for t in tensors:
        m = _INDEXED.match(t.name)
        key = (m.group(1), t.dtype, tuple(t.shape)) if m else (t.name, t.dtype, tuple(t.shape), "single")
        if key not in groups:
            groups[key] = []
            order.append(key)
        if m:
            groups[key].append(int(m.group(2)))
    rows = []
    for key in order:
        name, dtype, shape = key[0], key[1], key[2]
        idx = sorted(groups[key])
        if len(key) == 3:
            name = f"{name}.{idx[0]}" if len(idx) == 1 else f"{name}.{{{_ranges(idx)}}}"
        rows.append((name, dtype, _shape(shape)))
    return rows


def _table(rows: list[tuple], indent: str = "    ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        cells = [str(c).ljust(w) for c, w in zip(r, widths)] + [str(r[-1])]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


# ----------------------------------------------------------------------------- the report


def _model_files(spec) -> list[str]:
    rels: list[str] = []
    for g in spec.graphs:
        rels += [g.path, *g.external_data]
    return rels


def _models(m) -> list:
    return [m.target, m.draft] + ([m.head] if m.head is not None else [])


def compute_sizes(m) -> dict:
    """Sizes read from the files themselves (load_manifest(verify='size') has matched them to the
    manifest): per file, per model and in total, plus the KV cache each model needs at max_seq."""
    files = {rel: m.path(rel).stat().st_size for rel in sorted(m.files)}
    models = {}
    for spec in _models(m):
        if spec.is_model or spec.kind == "head":
            models[spec.role] = {
                "file_bytes": sum(files.get(r, 0) for r in _model_files(spec)),
                "kv_cache_bytes": spec.kv_bytes(m.max_seq, m.batch),
            }
    return {"files": files, "models": models, "total_bytes": sum(files.values())}


CHECKED = {
    "size": "file sizes and where the graphs read weights (sha256 not computed: --verify full)",
    "full": "file sizes, sha256 checksums and where the graphs read weights",
}


def format_report(m, bundle: str, verify: str = "size") -> str:
    from ..contract import FEATURES_OUTPUT, TREE_INPUT
    from ..runtime.invariant import wants_invariant_steps
    from ..tensorrt_support import bundle_tensorrt
    from .export_models import default_draft

    sizes = compute_sizes(m)
    lines = [f"bundle       {bundle}", f"checked      {CHECKED[verify]}"]
    if m.created_by:
        lines.append(f"created by   {m.created_by}")
    exported_for = bundle_tensorrt(m.root)
    if exported_for:
        lines.append(f"tensorrt     exported for TensorRT {exported_for} (export-models --tensorrt)")
    lines.append(
        f"kv mode      {m.kv_mode}"
        + (
            "  (in-place TensorScatter)"
            if m.kv_mode == "scatter"
            else "  (graphs output new entries; the runtime writes them)"
        )
    )
    lines.append(f"max_seq      {m.max_seq}    batch {m.batch}")
    lines.append(f"k            {m.spec_tokens}    prefill chunk {m.prefill_chunk}")
    eos = ", ".join(str(e) for e in m.eos_token_ids)
    bos = "none" if m.bos_token_id is None else str(m.bos_token_id)
    lines.append(
        f"tokenizer    vocab {m.tokenizer_vocab_size}    eos ids [{eos}]    bos {bos}"
        f"{' (added)' if m.add_bos else ''}    chat template {m.chat_template or 'none'}"
    )
    for spec in _models(m):
        lines.append("")
        if spec.kind == "ngram":
            ng = spec.extra.get("ngram_sizes")
            lines.append(
                f"{spec.role:<7}      n-gram (prompt lookup, no model"
                + (f"; n = {', '.join(str(n) for n in ng)}" if ng else "")
                + ")"
            )
            if default_draft(m.target.precision) == "ngram":
                lines.append(
                    f"  default    export-models' draft for an {m.target.precision} target: a draft model "
                    "would cost about a target step per token"
                )
            continue
        weights = spec.extra.get("weights", spec.precision)
        extra = ""
        if spec.extra.get("self_draft_of"):
            extra = f"  (self draft: the {spec.extra['self_draft_of']} re-exported)"
        lines.append(f"{spec.role:<7}      {spec.family}  {spec.kind}  {spec.precision}{extra}")
        lines.append(f"  weights    {weights}")
        lines += _int4_kernel_lines(spec)
        if spec.role == "target":
            if _runs_batch_invariant(spec):
                steps = (
                    "batch-invariant graph: single-token steps run as 1 token and give a verification row's "
                    "bits, so greedy speculation equals target-only exactly (checked when a pipeline loads)"
                )
            elif wants_invariant_steps(spec.precision):
                steps = (
                    "batch-invariant: single-token steps run as 2 tokens, so greedy speculation equals "
                    "target-only exactly"
                )
            else:
                steps = "plain single-token steps (fp32: verification rows agree to ~1e-5)"
            lines.append("  steps      " + steps)
        if spec.features:
            lines.append(
                f"  features   {FEATURES_OUTPUT} [B, T, {spec.features['dim']}]: the outputs of layers "
                f"{', '.join(str(i) for i in spec.features['layers'])}, for a draft head"
            )
        if spec.kind == "head":
            t = spec.extra.get("training", {})
            lines.append(
                f"  head       draft vocabulary {spec.vocab_size} ids (map {spec.extra.get('draft_vocab_file')}), "
                f"trained on {t.get('tokens', '?')} tokens, top-1 {t.get('top1', '?')}"
            )
        lines.append(
            f"  params     {fmt_count(spec.num_params)} ({spec.num_params:,})    "
            f"weight bytes/step {fmt_bytes(spec.weight_bytes)}    "
            f"files {fmt_bytes(sizes['models'][spec.role]['file_bytes'])}"
        )
        lines.append(
            f"  shape      {spec.num_layers} layers, {spec.num_kv_heads} kv heads x {spec.head_dim}, "
            f"hidden {spec.hidden_size}, vocab {spec.vocab_size}"
        )
        lines.append(
            f"  kv cache   {spec.kv_dtype}, {fmt_bytes(sizes['models'][spec.role]['kv_cache_bytes'])} "
            f"at max_seq {m.max_seq}"
        )
        for g in spec.graphs:
            lines.append(
                f"  graph      {g.path} ({g.flavour}; {', '.join(g.backends)})"
                + (f"; tree calls ({TREE_INPUT} input)" if g.tree else "")
            )
            if g.custom_ops:
                lines.append(f"  kernels    {', '.join(g.custom_ops)}: {_kernel_path()}")
        lines.append("  inputs")
        lines += _table(compress_tensors(spec.inputs))
        lines.append("  outputs")
        lines += _table(compress_tensors(spec.outputs))
    lines.append("")
    lines.append("files")
    rows = [(rel, fmt_bytes(n)) for rel, n in sizes["files"].items()]
    rows.append(("total", fmt_bytes(sizes["total_bytes"])))
    lines += _table(rows, indent="  ")
    return "\n".join(lines)


def run(args) -> int:
    from .. import tensorrt_support as ts
    from ..bundle_files import check_graph_files
    from ..manifest import load_manifest

    line = ts.parse_tensorrt_version(args.tensorrt) if args.tensorrt is not None else None
    m = load_manifest(Path(args.bundle), verify=args.verify)
    check_graph_files(m)
    check = ts.check_bundle(m.root, args.tensorrt, manifest=m) if line else None
    if args.json:
        obj = {
            "bundle": str(args.bundle),
            "verified": args.verify,
            "manifest": m.to_json(),
            "sizes": compute_sizes(m),
            "tensorrt": ts.bundle_tensorrt(m.root),
        }
        if check is not None:
            obj["tensorrt_check"] = check.to_json()
        print(json.dumps(obj, indent=2))
    else:
        print(format_report(m, str(args.bundle), args.verify))
        if check is not None:
            note = ts.version_note(args.tensorrt)
            print("\ntensorrt check" + (f" ({note})" if note else ""))
            print(ts.format_findings(check))
    return 0 if check is None or check.ok else 3


def _runs_batch_invariant(spec) -> bool:
    """Whether the graph ort-cpu runs here (of an int4 model's two, the chosen one) is batch-invariant."""
    from ..manifest import BundleError
    from ..runtime.int4_kernel import KernelChoiceError, choose

    try:
        return choose(spec, "ort-cpu", note=False).graph.batch_invariant
    except (KernelChoiceError, BundleError):
        return any(g.batch_invariant for g in spec.graphs)


def _int4_kernel_lines(spec) -> list[str]:
    """For an int4 model with a graph per kernel: which one ort-cpu runs here, and why
    (runtime/int4_kernel.py; steps on the MatMulNBits graph are padded to stay exact)."""
    from ..runtime.int4_kernel import KernelChoiceError, choose

    if spec.precision != "int4" or len(spec.graphs) < 2 or not any(g.custom_ops for g in spec.graphs):
        return []
    try:
        c = choose(spec, "ort-cpu", note=False)
    except KernelChoiceError as e:  # pragma: no cover - auto never refuses
        return [f"  int4       {e}"]
    graphs = ", ".join(
        f"{Path(g.path).name} ({'specedge' if g.custom_ops else 'MatMulNBits'})"
        for g in spec.graphs
        if "ort-cpu" in g.backends
    )
    return [f"  int4       {c.kernel} here ({c.reason}); graphs: {graphs}"]


def _kernel_path() -> str:
    """Where specedge's CPU kernels are and which path they take on this CPU."""
    from .. import custom_ops

    try:
        path = custom_ops.library_path()
    except custom_ops.CustomOpsError:
        return (
            f"libspecedge_ops.so not found here (reinstall specedge where a C++ compiler is present, or set "
            f"{custom_ops.ENV})"
        )
    try:
        isa = custom_ops.isa(path)
    except (OSError, AttributeError) as e:
        return f"{path} cannot be loaded here ({type(e).__name__})"
    slow = " (no AVX2: about 10x slower than the AVX2 and AVX-512 paths)" if isa == "portable" else ""
    return f"{path}, {isa} path on this CPU{slow}"
