"""What a TensorRT version's ONNX parser imports, and which nodes of a bundle's graphs it would not.

The data is `tensorrt_ops.json` (one file, with the onnx-tensorrt commit each TensorRT release pins
and the source each line was read from); this module only reads it:

* `parse_tensorrt_version('10.3.0.30')` -> '10.3': the table line a version is checked against.
  A version between two lines maps to the older one and one newer than the newest line maps to the
  newest: TensorRT's parser only adds importers, so an older line's operators are a lower bound.
  Anything malformed, or older than the oldest line, is a UserError naming the supported lines.
* `graph_findings(model, version)`: every node that version does not import (ONNX operator, or a
  type of DequantizeLinear it refuses), every blocked DequantizeLinear its builder refuses (the
  parser imports any blocked form; IDequantizeLayer builds only some), and the graph's opset / IR
  version when outside the range the version documents. Weight files are never read.
* `check_bundle(bundle, version)`: the same for every graph `build-engines` would hand to the
  parser (`ModelSpec.graph_for("tensorrt")`), or the failure that the bundle offers it none.

A bundle's manifest records the version it was exported for under the key "tensorrt" (absent
for bundles exported without `export-models --tensorrt`).

For an exporter choosing what to write for a line: `ops_for(line)`, `line_info(line)["opset"]`
(documented range) and `["ir_max"]`, `dq_types(line)` and `dq_builder(line)` (which DequantizeLinear
inputs and blocked forms it takes), `op_added_in(op)`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError

TABLE_FILE = Path(__file__).with_name("tensorrt_ops.json")


def parse_version(s: str) -> tuple[int, ...]:
    """'10.3.0.30' -> (10, 3, 0, 30); trailing text such as '10.15.1.post1' is ignored."""
    parts = []
    for p in str(s).strip().split("."):
        m = re.match(r"^(\d+)", p)
        if not m:
            break
        parts.append(int(m.group(1)))
        if m.group(1) != p:
            break
    if not parts:
        raise ValueError(f"not a version string: {s!r}")
    return tuple(parts)


MANIFEST_KEY = "tensorrt"
ONNX_DOMAINS = ("", "ai.onnx")
_VERSION_TEXT = re.compile(r"^\d+\.\d+(\.\d+){0,2}$")


@functools.cache
def table() -> dict:
    with open(TABLE_FILE, encoding="utf-8") as f:
        return json.load(f)


def _key(line: str) -> tuple[int, ...]:
    return parse_version(line)


TENSORRT_VERSIONS: tuple[str, ...] = tuple(sorted(table()["versions"], key=_key))


def supported_text() -> str:
    return ", ".join(TENSORRT_VERSIONS)


def _line_for(v: tuple[int, ...], shown: str, flag: str | None) -> str:
    v2 = (v + (0,))[:2]
    if v2 < _key(TENSORRT_VERSIONS[0]):
        use = f"use {flag} with one of {supported_text()}" if flag else f"install one of {supported_text()} (or newer)"
        raise UserError(
            f"TensorRT {shown} is older than {TENSORRT_VERSIONS[0]}, the oldest TensorRT specedge supports: {use}"
        )
    return [line for line in TENSORRT_VERSIONS if _key(line) <= v2][-1]


def parse_tensorrt_version(text: str, flag: str = "--tensorrt") -> str:
    """'10.3', '10.3.0' or '10.3.0.30' -> '10.3' (the table line it is checked against)."""
    s = str(text).strip()
    if not _VERSION_TEXT.match(s):
        raise UserError(
            f"{flag} takes a TensorRT version such as 10.3 or 10.3.0.30, got {text!r}: "
            f"the supported versions are {supported_text()}"
        )
    return _line_for(parse_version(s), s, flag)


def installed_line(trt_version: str) -> str:
    """The table line for an installed tensorrt.__version__ (which may carry suffixes like .post1)."""
    return _line_for(parse_version(trt_version), str(trt_version), None)


def version_note(text: str) -> str | None:
    """A sentence when `text` is checked against another line than its own, else None."""
    line = parse_tensorrt_version(text)
    v = (parse_version(str(text).strip()) + (0,))[:2]
    if v == _key(line):
        return None
    newest = line == TENSORRT_VERSIONS[-1] and v > _key(line)
    why = "the newest line in specedge's table" if newest else "the newest line in specedge's table at or below it"
    return f"TensorRT {text} is checked against TensorRT {line}'s parser, {why}"


def line_info(line: str) -> dict:
    return table()["versions"][line]


@functools.cache
def ops_for(line: str) -> frozenset[str]:
    ops: set[str] = set()
    for since, names in table()["ops_added_in"].items():
        if _key(since) <= _key(line):
            ops.update(names)
    return frozenset(ops)


def op_added_in(op: str) -> str | None:
    """The first table line whose parser imports `op` (None: no line does)."""
    for line in TENSORRT_VERSIONS:
        if op in ops_for(line):
            return line
    return None


def opset_added_in(opset: int) -> str | None:
    for line in TENSORRT_VERSIONS:
        lo, hi = line_info(line)["opset"]
        if lo <= opset <= hi:
            return line
    return None


def ir_added_in(ir: int) -> str | None:
    for line in TENSORRT_VERSIONS:
        if ir <= line_info(line)["ir_max"]:
            return line
    return None


def dq_types(line: str) -> frozenset[str]:
    """Data types of DequantizeLinear's input x that the parser of `line` takes."""
    got: frozenset[str] = frozenset()
    for since, names in table()["restrictions"]["DequantizeLinear"]["types"].items():
        if _key(since) <= _key(line):
            got = frozenset(names)
    return got


def dq_type_added_in(dtype: str) -> str | None:
    for line in TENSORRT_VERSIONS:
        if dtype in dq_types(line):
            return line
    return None


def dq_builder(line: str) -> dict:
    """What TensorRT `line`'s IDequantizeLayer builds in blocked form: {"blocked_types", "blocked_rank"}."""
    got: dict = {}
    for since, facts in table()["restrictions"]["DequantizeLinear"]["builder"].items():
        if _key(since) <= _key(line):
            got = facts
    return got


def _blocked_added_in(dtype: str, rank: int) -> str | None:
    for line in TENSORRT_VERSIONS:
        b = dq_builder(line)
        if dtype in b["blocked_types"] and b["blocked_rank"] in (None, rank):
            return line
    return None


# ----------------------------------------------------------------------------- findings


@dataclass
class Finding:
    graph: str  # bundle-relative path (or the name given)
    node: str  # node name; '' for the graph-level opset / IR findings
    op: str  # ONNX operator, or 'opset' / 'ir_version'
    domain: str
    opset: int  # the graph's ai.onnx opset (the IR version for an 'ir_version' finding)
    added_in: str | None  # first table line that imports it; None: none does
    avoid_with: str | None  # the export flag that avoids it

    def what(self, line: str) -> str:
        """'RMSNormalization (opset 24; imported from TensorRT 10.15)', without the node name."""
        verb = "built" if "blocked" in self.op else "imported"  # a blocked DequantizeLinear: the builder refuses it
        since = f"{verb} from TensorRT {self.added_in}" if self.added_in else f"{verb} by no TensorRT in the table"
        if self.op == "opset":
            lo, hi = line_info(line)["opset"]
            where = (
                f"documented from TensorRT {self.added_in}"
                if self.added_in
                else "documented by no TensorRT in the table"
            )
            return f"opset {self.opset} (TensorRT {line} documents {lo}..{hi}; {where})"
        if self.op == "ir_version":
            return f"IR version {self.opset} (TensorRT {line}'s ONNX reads up to {line_info(line)['ir_max']})"
        dom = f"{self.domain}::" if self.domain not in ONNX_DOMAINS + ("ai.onnx",) else ""
        return f"{dom}{self.op} (opset {self.opset}; {since})"


def avoid_flag(op: str, line: str) -> str:
    """The export flag that keeps `op` out of the graphs offered to TensorRT `line`."""
    if op == "TensorScatter":
        return "--kv-update delta"
    return f"--tensorrt {line}"


def _load(model) -> object:
    import onnx

    if isinstance(model, (str, os.PathLike)):
        return onnx.load(str(model), load_external_data=False)
    return model


def _ai_onnx_opset(proto) -> int:
    for o in proto.opset_import:
        if o.domain in ONNX_DOMAINS:
            return int(o.version)
    return 0


def _elem_types(graph, types: dict[str, tuple[int, tuple | None]]) -> None:
    """name -> (element type, shape or None) for initializers, constants and typed values."""
    for t in graph.initializer:
        types[t.name] = (t.data_type, tuple(t.dims))
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type") and vi.name not in types:
            tt = vi.type.tensor_type
            shape = (
                tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
                if tt.HasField("shape")
                else None
            )
            types[vi.name] = (tt.elem_type, shape)
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in ONNX_DOMAINS:
            for a in n.attribute:
                if a.name == "value" and n.output:
                    types[n.output[0]] = (a.t.data_type, tuple(a.t.dims))


def _dq_findings(n, types, line: str) -> list[tuple[str, str | None]]:
    """(what, first line that takes it) for a DequantizeLinear TensorRT `line` refuses: its input type
    (the parser), or its blocked form (the builder: IDequantizeLayer)."""
    from onnx import helper

    if not n.input or n.input[0] not in types:
        return []
    elem, xshape = types[n.input[0]]
    dtype = helper.tensor_dtype_to_string(elem).removeprefix("TensorProto.").lower()
    if dtype not in dq_types(line):
        return [(f"DequantizeLinear({dtype})", dq_type_added_in(dtype))]
    sshape = types.get(n.input[1], (0, None))[1] if len(n.input) > 1 else None
    blocked = (
        xshape is not None and sshape is not None and len(sshape) == len(xshape) >= 2 and any(d != 1 for d in sshape)
    )
    if not blocked:
        return []
    b = dq_builder(line)
    if dtype in b["blocked_types"] and b["blocked_rank"] in (None, len(xshape)):
        return []
    return [(f"DequantizeLinear(blocked {dtype}, rank {len(xshape)})", _blocked_added_in(dtype, len(xshape)))]


def _walk(graph, functions, types, seen_fn=()):
    """(node, types) for every node, inside subgraphs and model-local functions too (the parser
    imports a local function by importing its body)."""
    from onnx import AttributeProto

    _elem_types(graph, types)
    for n in graph.node:
        fn = functions.get((n.domain, n.op_type))
        if fn is not None and (n.domain, n.op_type) not in seen_fn:
            yield from fn.node
            continue
        yield n
        for a in n.attribute:
            subs = (
                [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs) if a.type == AttributeProto.GRAPHS else []
            )
            for g in subs:
                yield from _walk(g, functions, types, seen_fn)


def graph_findings(model, version: str, graph_name: str = "") -> list[Finding]:
    """Every node of `model` (a ModelProto or a path; external weights are not read) that TensorRT
    `version`'s parser does not import, plus its opset / IR version when outside that version's range."""
    line = parse_tensorrt_version(version)
    proto = _load(model)
    name = graph_name or (str(model) if isinstance(model, (str, os.PathLike)) else proto.graph.name)
    info = line_info(line)
    opset = _ai_onnx_opset(proto)
    out: list[Finding] = []
    lo, hi = info["opset"]
    if not lo <= opset <= hi:
        out.append(Finding(name, "", "opset", "ai.onnx", opset, opset_added_in(opset), f"--tensorrt {line}"))
    if proto.ir_version > info["ir_max"]:
        out.append(
            Finding(
                name, "", "ir_version", "", int(proto.ir_version), ir_added_in(proto.ir_version), f"--tensorrt {line}"
            )
        )
    ops = ops_for(line)
    functions = {(f.domain, f.name): f for f in proto.functions}
    types: dict[str, tuple] = {}
    for n in _walk(proto.graph, functions, types):
        if n.domain not in ONNX_DOMAINS:
            out.append(Finding(name, n.name, n.op_type, n.domain, opset, None, avoid_flag(n.op_type, line)))
        elif n.op_type not in ops:
            out.append(
                Finding(
                    name,
                    n.name,
                    n.op_type,
                    n.domain or "ai.onnx",
                    opset,
                    op_added_in(n.op_type),
                    avoid_flag(n.op_type, line),
                )
            )
        elif n.op_type == "DequantizeLinear":
            for what, since in _dq_findings(n, types, line):
                out.append(
                    Finding(
                        name, n.name, what, n.domain or "ai.onnx", opset, since, avoid_flag("DequantizeLinear", line)
                    )
                )
    return out


# ----------------------------------------------------------------------------- bundles


@dataclass
class GraphCheck:
    role: str
    path: str  # bundle-relative
    findings: list[Finding] = field(default_factory=list)


@dataclass
class BundleCheck:
    bundle: Path
    requested: str  # the version asked for, as given
    line: str  # the table line it is checked against
    exported_for: str | None  # the manifest's "tensorrt" (None: exported without --tensorrt)
    graphs: list[GraphCheck] = field(default_factory=list)
    not_offered: list[str] = field(default_factory=list)  # roles with a model but no graph for TensorRT

    @property
    def ok(self) -> bool:
        return bool(self.graphs) and not self.not_offered and not any(g.findings for g in self.graphs)

    def to_json(self) -> dict:
        return {
            "version": self.requested,
            "checked_against": self.line,
            "exported_for": self.exported_for,
            "ok": self.ok,
            "not_offered": list(self.not_offered),
            "graphs": [
                {
                    "role": g.role,
                    "path": g.path,
                    "parses": not g.findings,
                    "findings": [
                        {k: getattr(f, k) for k in ("node", "op", "domain", "opset", "added_in", "avoid_with")}
                        for f in g.findings
                    ],
                }
                for g in self.graphs
            ],
        }


def bundle_tensorrt(bundle_dir) -> str | None:
    """The TensorRT version the bundle was exported for (manifest key "tensorrt"), or None."""
    try:
        with open(Path(bundle_dir) / "manifest.json", encoding="utf-8") as f:
            value = json.load(f).get(MANIFEST_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return str(value) if value else None


def check_bundle(bundle_dir, version: str, roles: tuple[str, ...] = ("target", "draft"), manifest=None) -> BundleCheck:
    """Check every graph of the bundle that build-engines would give TensorRT `version`'s parser."""
    from .manifest import BundleError, load_manifest

    line = parse_tensorrt_version(version)
    m = manifest if manifest is not None else load_manifest(bundle_dir, verify="none")
    check = BundleCheck(Path(bundle_dir), str(version), line, bundle_tensorrt(bundle_dir))
    for spec in (m.target, m.draft):
        if not spec.is_model or spec.role not in roles:
            continue
        try:
            g = spec.graph_for("tensorrt")
        except BundleError:
            check.not_offered.append(spec.role)
            continue
        check.graphs.append(GraphCheck(spec.role, g.path, graph_findings(m.path(g.path), line, g.path)))
    return check


def _names(findings: list[Finding]) -> str:
    seen: dict[str, Finding] = {}
    for f in findings:
        seen.setdefault(f.op, f)
    parts = []
    for op, f in seen.items():
        what = f"opset {f.opset}" if op == "opset" else f"IR {f.opset}" if op == "ir_version" else op
        parts.append(f"{what} (from {f.added_in})" if f.added_in else f"{what} (none)")
    return ", ".join(parts)


def _fix(check: BundleCheck) -> str:
    flags = {f.avoid_with for g in check.graphs for f in g.findings if f.avoid_with}
    if flags == {"--kv-update delta"}:
        return "export with `export-models --kv-update delta`"
    return f"export the bundle with `export-models --tensorrt {check.line}`"


def refusal(check: BundleCheck) -> str:
    """One sentence saying why TensorRT `check.line` cannot parse the bundle (check.ok is False)."""
    if not check.graphs:
        return (
            f"this bundle offers TensorRT no graph (its graphs are for ONNX Runtime only): "
            f"export it with `export-models --tensorrt {check.line}`"
        )
    if check.not_offered:
        return (
            f"the {' and '.join(check.not_offered)} of this bundle has no graph for TensorRT: "
            f"export it with `export-models --tensorrt {check.line}`"
        )
    bad = [g for g in check.graphs if g.findings]
    what = "; ".join(f"{g.path} uses {_names(g.findings)}" for g in bad)
    return f"TensorRT {check.line}'s ONNX parser cannot import this bundle ({what}): {_fix(check)}"


def format_findings(check: BundleCheck) -> str:
    """Human lines: one per graph, then one per finding."""
    lines = [
        f"TensorRT {check.line}"
        + (f" (asked for {check.requested})" if check.requested != check.line else "")
        + f": opsets {line_info(check.line)['opset'][0]}..{line_info(check.line)['opset'][1]}"
        + (f"; bundle exported for TensorRT {check.exported_for}" if check.exported_for else "")
    ]
    for role in check.not_offered:
        lines.append(f"  {role}: no graph offered to TensorRT")
    for g in check.graphs:
        if not g.findings:
            lines.append(f"  {g.role} {g.path}: parses")
            continue
        lines.append(
            f"  {g.role} {g.path}: {len(g.findings)} finding(s), TensorRT {check.line}'s parser would refuse it"
        )
        groups: dict[tuple, list[Finding]] = {}
        for f in g.findings:
            groups.setdefault((f.op, f.domain, f.avoid_with), []).append(f)
        for fs in groups.values():
            f = fs[0]
            fix = f"; avoid with export-models {f.avoid_with}" if f.avoid_with else ""
            nodes = [x.node or "(unnamed)" for x in fs if x.op not in ("opset", "ir_version")]
            at = f" x{len(nodes)}: {', '.join(nodes)}" if nodes else ""
            lines.append(f"    {f.what(check.line)}{fix}{at}")
    lines.append("  all graphs parse" if check.ok else f"  would not parse: {refusal(check)}")
    return "\n".join(lines)


def check_bundle_target(bundle_dir, installed: str) -> None:
    """A bundle exported for a newer TensorRT than the installed one: UserError naming both."""
    wanted = bundle_tensorrt(bundle_dir)
    if not wanted:
        return
    have = installed_line(installed)
    try:
        target = parse_tensorrt_version(wanted)
    except UserError:
        target = wanted
    if _key(str(target)) > _key(have):
        raise UserError(
            f"this bundle was exported for TensorRT {wanted} and this machine has TensorRT "
            f"{'.'.join(str(x) for x in parse_version(installed)[:2])}: export it again with "
            f"`export-models --tensorrt {have}`"
        )


def parse_error_hint(onnx_path, installed: str) -> str:
    """What the parser of the installed TensorRT cannot import in a graph it refused (for its error)."""
    try:
        line = installed_line(installed)
        findings = graph_findings(onnx_path, line)
    except Exception:  # the hint must never hide the parser's own error
        return ""
    if not findings:
        return ""
    flags = {f.avoid_with for f in findings}
    fix = (
        "`export-models --kv-update delta`" if flags == {"--kv-update delta"} else f"`export-models --tensorrt {line}`"
    )
    return f" (TensorRT {line} does not import {_names(findings)}: export with {fix})"
