"""The files an ONNX graph makes ONNX Runtime open: external-data `location`s, read from the graph.

A graph keeps large weights in other files and names them itself, in each tensor's
`external_data` entries; ONNX Runtime opens whatever they name, relative to the graph's folder.
A bundle is untrusted, so `check_graph_files` reads every such location before any session
exists and refuses one that is absolute, climbs out with `..`, leaves the bundle through a link,
or is not among the graph's `external_data` in the manifest (the files the manifest lists, and
so checksums).

The reader walks the protobuf wire format directly: the runtime install has no `onnx` package,
and only a handful of fields matter (tensors in initializers, node attributes, subgraphs and
functions). Field numbers are those of onnx/onnx.proto3, which the ONNX project never renumbers.
"""

from __future__ import annotations

import mmap
import posixpath
from pathlib import Path

from .manifest import BundleError, Manifest, ModelSpec, resolve_inside

MAX_NESTING = 64  # protobuf message levels (a subgraph adds 3: node, attribute, graph); real models use ~10

# message kind -> {field number: kind of the embedded message}
_CHILDREN = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "function": {7: "node", 11: "attribute"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},
    "entry": {},
}
_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION, _EXTERNAL = 13, 14, 1


class _Malformed(Exception):
    pass


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """(field number, wire type, value or (start, end) of a length-delimited payload)."""
    pos = start
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value
        elif wire == 2:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise _Malformed
            yield field, wire, (pos, pos + n)
            pos += n
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:  # groups (3, 4) and unknown types: not in ONNX
            raise _Malformed
        if pos > end:
            raise _Malformed


def _text(buf, span: tuple[int, int]) -> str:
    try:
        return bytes(buf[span[0] : span[1]]).decode("utf-8")
    except UnicodeDecodeError:
        raise _Malformed from None


def _tensor_location(buf, start: int, end: int) -> str | None:
    """The `location` of a tensor stored outside the graph file, else None."""
    external = False
    location = None
    for field, wire, value in _fields(buf, start, end):
        if field == _TENSOR_DATA_LOCATION and wire == 0:
            external = value == _EXTERNAL
        elif field == _TENSOR_EXTERNAL_DATA and wire == 2:
            key = val = None
            for f, w, v in _fields(buf, *value):
                if w == 2 and f == 1:
                    key = _text(buf, v)
                elif w == 2 and f == 2:
                    val = _text(buf, v)
            if key == "location":
                location = val if val is not None else ""
    return location if external or location is not None else None


def external_locations(data) -> list[str]:
    """Every external-data location an ONNX ModelProto (bytes or a buffer) names, in order,
    repeats removed. Raises ValueError when the bytes are not a well-formed protobuf."""
    buf = data if isinstance(data, memoryview) else memoryview(data)
    found: dict[str, None] = {}
    stack = [("model", 0, len(buf), 0)]
    try:
        while stack:
            kind, start, end, depth = stack.pop()
            if depth > MAX_NESTING:
                raise ValueError(f"it nests subgraphs more than {MAX_NESTING} protobuf levels deep")
            if kind == "tensor":
                loc = _tensor_location(buf, start, end)
                if loc is not None:
                    found.setdefault(loc)
                continue
            children = _CHILDREN[kind]
            for field, wire, value in _fields(buf, start, end):
                child = children.get(field)
                if child is not None and wire == 2:
                    stack.append((child, *value, depth + 1))
    except _Malformed:
        raise ValueError("it is not a valid ONNX protobuf") from None
    return list(found)


def graph_locations(path: Path) -> list[str]:
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            raise ValueError("it is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)  # multi-GB graphs with embedded weights: no copy
            try:
                return external_locations(view)
            finally:
                view.release()  # the map cannot close while a view of it is exported


def _shown(text: str) -> str:
    """`text` for a one-line message: control characters (a NUL, a newline) escaped."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)


def check_model_graphs(manifest: Manifest, spec: ModelSpec) -> None:
    """Refuse a graph of `spec` whose external data lies outside the files the manifest lists."""
    assert manifest.root is not None
    for g in spec.graphs:
        path = manifest.path(g.path)
        try:
            locations = graph_locations(path)
        except OSError as e:
            raise BundleError(f"cannot read the {spec.role} graph '{g.path}': {e.strerror or e}") from None
        except ValueError as e:
            raise BundleError(f"the {spec.role} graph '{g.path}' is not a usable ONNX file: {e}") from None
        listed = set(g.external_data)
        folder = posixpath.dirname(g.path)
        for loc in locations:
            # ONNX Runtime reads a C string: a NUL ends the path it opens, whatever follows
            bad = (
                not loc
                or loc.startswith(("/", "\\"))
                or "\\" in loc
                or ":" in loc
                or "\x00" in loc
                or ".." in loc.split("/")
            )
            rel = posixpath.normpath(posixpath.join(folder, loc)) if not bad else loc
            if bad:
                raise BundleError(
                    f"the {spec.role} graph '{g.path}' reads weights from '{_shown(loc)}', outside the bundle"
                )
            resolve_inside(manifest.root, rel)  # a link that leaves the bundle
            if rel not in listed:
                raise BundleError(
                    f"the {spec.role} graph '{g.path}' reads weights from '{_shown(loc)}', which the manifest does not "
                    "list as its external data"
                )


def check_graph_files(manifest: Manifest) -> None:
    for spec in (manifest.target, manifest.draft, manifest.head):
        if spec is not None and spec.kind in ("model", "head"):
            check_model_graphs(manifest, spec)
