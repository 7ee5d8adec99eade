"""The bundle manifest: the contract between the export half and every runtime (Python, C++).

Pure Python on purpose: the runtime, the engine builder and the C++ loader all read this schema,
and none of them may need torch. `load_manifest` validates everything a runtime relies on before
anything is allocated from it; every failure is a `BundleError` whose message is one sentence.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .contract import MAX_SPEC_TOKENS, TensorSpec, reserved_call_size

# 2 added a target's optional `features` output and the optional `models.head` entry (a trained
# draft head); a version-1 manifest has neither and reads as before.
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
KV_MODES = ("scatter", "delta")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
# The dtype of the KV cache and of every floating tensor a graph exchanges, per precision.
# Weight-only int8/int4 keep fp32 activations on the CPU.
KV_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "float32", "int4": "float32"}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}
# Sanity bounds for numbers read from an untrusted manifest, checked before any allocation.
MAX_LAYERS = 512
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB = 4_000_000
MAX_MAX_SEQ = 1 << 20
# The ai.onnx opset export-models writes (export/onnx_graph.OPSET); a graph may declare an older one.
GRAPH_OPSET = 24


class BundleError(Exception):
    """A bundle that cannot be used; the message is one sentence meant for the user."""


@dataclass
class GraphSpec:
    """One ONNX file serving some backends; all flavours of a model share the I/O contract."""

    flavour: str  # "portable" (standard ops, TensorRT parses it) or "ort" (com.microsoft ops)
    path: str  # relative to the bundle root
    backends: list[str]
    external_data: list[str] = field(default_factory=list)
    # the graph takes tree calls (contract.TREE_INPUT, docs/design.md "Tree calls"); optional in
    # both schema versions, absent = chains only, so older bundles and readers are unaffected
    tree: bool = False
    # custom-op libraries the graph needs loaded into its session (custom_ops.py): optional,
    # absent = standard and com.microsoft ops only; today only "specedge_ops" (--int4-kernel specedge)
    custom_ops: list[str] = field(default_factory=list)
    # every output row is computed the same whatever the number of tokens T of the call
    # (specedge_kernel.batch_invariant), so single-token steps need no padding for exact
    # speculation (runtime/invariant.py); optional, absent = false
    batch_invariant: bool = False
    # the graph's ai.onnx opset when not GRAPH_OPSET (--tensorrt bundles): the onnxruntime it
    # needs follows it (runtime/ort_version.py); optional, absent = GRAPH_OPSET
    opset: int = 0

    def to_json(self) -> dict:
        return {
            "flavour": self.flavour,
            "path": self.path,
            "backends": list(self.backends),
            "external_data": list(self.external_data),
            **({"tree": True} if self.tree else {}),
            **({"custom_ops": list(self.custom_ops)} if self.custom_ops else {}),
            **({"batch_invariant": True} if self.batch_invariant else {}),
            **({"opset": self.opset} if self.opset and self.opset != GRAPH_OPSET else {}),
        }

    @property
    def onnx_opset(self) -> int:
        return self.opset or GRAPH_OPSET


@dataclass
class ModelSpec:
    role: str  # "target" or "draft"
    kind: str  # "model" or "ngram"
    family: str = ""
    source: str = ""
    precision: str = "fp32"
    kv_dtype: str = "float32"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    hidden_size: int = 0
    vocab_size: int = 0  # rows of the logits (may exceed the tokenizer's vocabulary: padding)
    num_params: int = 0
    weight_bytes: int = 0  # bytes of weights read per forward pass at this precision
    graphs: list[GraphSpec] = field(default_factory=list)
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    # int4/int8: how the weights were quantized, e.g. {"method": "gguf-exact" | "gguf-exact+requantized"
    # | "requantized", "exact_matmuls": n, "requantized_matmuls": m, ...}. Informational.
    quantization: dict = field(default_factory=dict)
    # A target graph that also returns hidden states for a draft head: {"layers": [i, ...], "dim": n}
    # (contract.FEATURES_OUTPUT); empty when it does not.
    features: dict = field(default_factory=dict)

    @property
    def is_model(self) -> bool:
        return self.kind == "model"

    def graph_for(self, backend: str) -> GraphSpec:
        for g in self.graphs:
            if backend in g.backends:
                return g
        for g in self.graphs:
            if g.flavour == "portable":
                return g
        raise BundleError(f"the {self.role} model has no graph for backend '{backend}'")

    def kv_bytes(self, max_seq: int, batch: int = 1) -> int:
        per = DTYPE_BYTES.get(self.kv_dtype, 4)
        return 2 * self.num_layers * batch * self.num_kv_heads * max_seq * self.head_dim * per

    def to_json(self) -> dict:
        if self.kind == "ngram":
            return {"kind": "ngram", **({"extra": self.extra} if self.extra else {})}
        return {
            "kind": self.kind,
            "family": self.family,
            "source": self.source,
            "precision": self.precision,
            "kv_dtype": self.kv_dtype,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_params": self.num_params,
            "weight_bytes": self.weight_bytes,
            "graphs": [g.to_json() for g in self.graphs],
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            **({"quantization": dict(self.quantization)} if self.quantization else {}),
            **({"features": dict(self.features)} if self.features else {}),
            "extra": dict(self.extra),
        }


@dataclass
class Manifest:
    schema_version: int
    created_by: str
    max_seq: int
    batch: int
    kv_mode: str
    spec_tokens: int  # default k
    prefill_chunk: int
    tokenizer_vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    add_bos: bool
    tokenizer_files: list[str]
    chat_template: str | None  # relative path of the jinja template, or None
    target: ModelSpec
    draft: ModelSpec
    files: dict[str, dict]  # relative path -> {"sha256": hex, "bytes": int}
    extra: dict = field(default_factory=dict)
    root: Path | None = None  # where it was loaded from; not serialized
    # A draft head trained for this target (`specedge train-draft`), kind "head"; None: no head.
    head: ModelSpec | None = None
    # The TensorRT version the bundle was exported for (`export-models --tensorrt`); None: any.
    tensorrt: str | None = None

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "created_by": self.created_by,
            "max_seq": self.max_seq,
            "batch": self.batch,
            "kv_mode": self.kv_mode,
            **({"tensorrt": self.tensorrt} if self.tensorrt else {}),
            "spec": {"k": self.spec_tokens, "prefill_chunk": self.prefill_chunk},
            "tokenizer": {
                "vocab_size": self.tokenizer_vocab_size,
                "eos_token_ids": list(self.eos_token_ids),
                "bos_token_id": self.bos_token_id,
                "add_bos": self.add_bos,
                "files": list(self.tokenizer_files),
                "chat_template": self.chat_template,
            },
            "models": {
                "target": self.target.to_json(),
                "draft": self.draft.to_json(),
                **({"head": self.head.to_json()} if self.head is not None else {}),
            },
            "files": {k: dict(v) for k, v in sorted(self.files.items())},
            "extra": dict(self.extra),
        }

    def path(self, rel: str) -> Path:
        assert self.root is not None
        return resolve_inside(self.root, rel)


# ----------------------------------------------------------------------------- io helpers


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def resolve_inside(root: Path, rel: str) -> Path:
    """The path `rel` names inside `root`; anything that would leave the bundle is refused."""
    if not isinstance(rel, str) or not rel:
        raise BundleError(f"the manifest names an empty or non-text file path: {rel!r}")
    p = Path(rel)
    if "\x00" in rel or p.is_absolute() or rel.startswith(("/", "\\")) or ".." in p.parts or ":" in p.parts[0]:
        raise BundleError(f"the manifest names a file outside the bundle: '{rel}'")
    root_r = root.resolve()
    full = (root / p).resolve()
    if full != root_r and root_r not in full.parents:
        raise BundleError(f"the manifest names a file outside the bundle: '{rel}' (through a link)")
    return full


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_regular(path: Path, rel: str) -> None:
    """Refuse a bundle file that exists but is not a regular file, by `stat` before anything opens
    it (a missing file is left to the checks that look for one)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise BundleError(f"cannot read the bundle's file '{rel}' ({e.strerror or type(e).__name__})") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a file")
        raise BundleError(f"the bundle's file '{rel}' is {kind}, not a regular file: refused before opening it")


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- parsing


def _req(d: dict, key: str, typ, where: str):
    if not isinstance(d, dict) or key not in d:
        raise BundleError(f"the manifest lacks '{key}' in {where}")
    v = d[key]
    if typ is int and isinstance(v, bool):
        raise BundleError(f"the manifest's '{key}' in {where} must be an integer")
    if not isinstance(v, typ):
        name = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise BundleError(f"the manifest's '{key}' in {where} must be of type {name}")
    return v


def _bounded(v: int, lo: int, hi: int, what: str) -> int:
    if not (lo <= v <= hi):
        raise BundleError(f"the manifest's {what} is {v}, outside {lo}..{hi}")
    return v


def _tensor(d: dict, where: str) -> TensorSpec:
    name = _req(d, "name", str, where)
    dtype = _req(d, "dtype", str, where)
    shape = _req(d, "shape", list, where)
    for s in shape:
        if not (s == "T" or (isinstance(s, int) and not isinstance(s, bool) and 0 < s <= MAX_MAX_SEQ * 4)):
            raise BundleError(f"the manifest gives tensor '{name}' an invalid dimension {s!r}")
    return TensorSpec(name, dtype, shape)


def _quantization(d: dict, where: str) -> dict:
    """The optional `quantization` object of a model entry (informational; its counts checked)."""
    q = d.get("quantization", {})
    if q is None:
        return {}
    if not isinstance(q, dict):
        raise BundleError(f"the manifest's 'quantization' in {where} must be an object")
    for key in ("exact_matmuls", "requantized_matmuls"):
        v = q.get(key, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise BundleError(f"the manifest's quantization.{key} in {where} must be a count")
    if "method" in q and not isinstance(q["method"], str):
        raise BundleError(f"the manifest's quantization.method in {where} must be text")
    return dict(q)


def _features(d: dict, where: str, num_layers: int) -> dict:
    """The optional `features` object of a model entry: tapped layers and the output width."""
    f = d.get("features")
    if f is None:
        return {}
    if not isinstance(f, dict):
        raise BundleError(f"the manifest's 'features' in {where} must be an object")
    layers = _req(f, "layers", list, where + ".features")
    if not layers or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers):
        raise BundleError(f"the manifest's features.layers in {where} must list layers of the model")
    dim = _bounded(
        _req(f, "dim", int, where + ".features"), 1, MAX_HEADS * MAX_HEAD_DIM * len(layers), f"{where} features.dim"
    )
    return {"layers": [int(i) for i in layers], "dim": dim}


def _model(d: dict, role: str) -> ModelSpec:
    where = f"models.{role}"
    kind = _req(d, "kind", str, where)
    if kind == "ngram":
        if role != "draft":
            raise BundleError(f"the manifest's {role} model cannot be of kind 'ngram'")
        return ModelSpec(role=role, kind="ngram", extra=d.get("extra", {}) or {})
    if kind != ("head" if role == "head" else "model"):
        raise BundleError(f"the manifest's {role} model has unknown kind '{kind}'")
    precision = _req(d, "precision", str, where)
    if precision not in PRECISIONS:
        raise BundleError(f"the manifest's {role} precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    m = ModelSpec(
        role=role,
        kind=kind,
        family=_req(d, "family", str, where),
        source=str(d.get("source", "")),
        precision=precision,
        kv_dtype=_req(d, "kv_dtype", str, where),
        num_layers=_bounded(_req(d, "num_layers", int, where), 1, MAX_LAYERS, f"{role} num_layers"),
        num_kv_heads=_bounded(_req(d, "num_kv_heads", int, where), 1, MAX_HEADS, f"{role} num_kv_heads"),
        head_dim=_bounded(_req(d, "head_dim", int, where), 1, MAX_HEAD_DIM, f"{role} head_dim"),
        hidden_size=int(d.get("hidden_size", 0)),
        vocab_size=_bounded(_req(d, "vocab_size", int, where), 2, MAX_VOCAB, f"{role} vocab_size"),
        num_params=int(d.get("num_params", 0)),
        weight_bytes=int(d.get("weight_bytes", 0)),
        graphs=[],
        inputs=[_tensor(t, where + ".inputs") for t in _req(d, "inputs", list, where)],
        outputs=[_tensor(t, where + ".outputs") for t in _req(d, "outputs", list, where)],
        extra=d.get("extra", {}) or {},
        quantization=_quantization(d, where),
    )
    if m.kv_dtype not in DTYPE_BYTES:
        raise BundleError(f"the manifest's {role} kv_dtype '{m.kv_dtype}' is not supported")
    m.features = _features(d, where, m.num_layers)
    graphs = _req(d, "graphs", list, where)
    if not graphs:
        raise BundleError(f"the manifest's {role} model lists no graph")
    for g in graphs:
        m.graphs.append(
            GraphSpec(
                flavour=_req(g, "flavour", str, where + ".graphs"),
                path=_req(g, "path", str, where + ".graphs"),
                backends=[str(b) for b in _req(g, "backends", list, where + ".graphs")],
                external_data=[str(x) for x in g.get("external_data", [])],
                tree=_graph_tree_flag(g, where + ".graphs"),
                custom_ops=_graph_custom_ops(g, where + ".graphs"),
                batch_invariant=_graph_flag(g, "batch_invariant", where + ".graphs"),
                opset=_graph_opset(g, where + ".graphs"),
            )
        )
    return m


def _graph_flag(g: dict, name: str, where: str) -> bool:
    v = g.get(name, False)
    if not isinstance(v, bool):
        raise BundleError(f"the manifest's '{name}' in {where} must be true or false, got {v!r}")
    return v


def _graph_custom_ops(g: dict, where: str) -> list[str]:
    """A graph entry's optional `custom_ops`: names of libraries specedge knows (custom_ops.py)."""
    from .custom_ops import LIBRARY

    ops = g.get("custom_ops", [])
    if not isinstance(ops, list) or not all(isinstance(x, str) for x in ops):
        raise BundleError(f"the manifest's 'custom_ops' in {where} must be a list of library names, got {ops!r}")
    unknown = [x for x in ops if x != LIBRARY]
    if unknown:
        raise BundleError(
            f"the manifest's 'custom_ops' in {where} names '{unknown[0]}', which this specedge "
            f"does not provide (it has '{LIBRARY}'): the bundle needs a newer specedge"
        )
    return list(ops)


def _graph_opset(g: dict, where: str) -> int:
    v = g.get("opset", GRAPH_OPSET)
    if not isinstance(v, int) or isinstance(v, bool):
        raise BundleError(f"the manifest's 'opset' in {where} must be a number, got {v!r}")
    return _bounded(v, 7, GRAPH_OPSET, where + ".opset")


def _graph_tree_flag(g: dict, where: str) -> bool:
    """A graph entry's optional `tree` flag (absent: the graph takes chains only)."""
    return _graph_flag(g, "tree", where)


def parse_manifest(obj: Any) -> Manifest:
    if not isinstance(obj, dict):
        raise BundleError("the manifest is not a JSON object")
    version = obj.get("schema_version")
    if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
        raise BundleError(
            f"the bundle's manifest has schema version {version!r}; this specedge reads versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))} (re-export the bundle with this version)"
        )
    max_seq = _bounded(_req(obj, "max_seq", int, "the manifest"), 16, MAX_MAX_SEQ, "max_seq")
    batch = _bounded(_req(obj, "batch", int, "the manifest"), 1, 64, "batch")
    kv_mode = _req(obj, "kv_mode", str, "the manifest")
    if kv_mode not in KV_MODES:
        raise BundleError(f"the manifest's kv_mode '{kv_mode}' is not one of {', '.join(KV_MODES)}")
    spec = _req(obj, "spec", dict, "the manifest")
    k = _bounded(_req(spec, "k", int, "spec"), 1, MAX_SPEC_TOKENS, "spec.k")
    chunk = _bounded(_req(spec, "prefill_chunk", int, "spec"), 1, max_seq, "spec.prefill_chunk")
    tok = _req(obj, "tokenizer", dict, "the manifest")
    eos = _req(tok, "eos_token_ids", list, "tokenizer")
    if not eos or not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos):
        raise BundleError("the manifest's tokenizer.eos_token_ids must be a non-empty list of token ids")
    bos = tok.get("bos_token_id")
    if bos is not None and (not isinstance(bos, int) or bos < 0):
        raise BundleError("the manifest's tokenizer.bos_token_id must be a token id or null")
    models = _req(obj, "models", dict, "the manifest")
    target = _model(_req(models, "target", dict, "models"), "target")
    draft = _model(_req(models, "draft", dict, "models"), "draft")
    head = _model(_req(models, "head", dict, "models"), "head") if "head" in models else None
    if version < 2 and (head is not None or target.features):
        raise BundleError("the manifest has schema version 1 but uses version 2 fields (features, a draft head)")
    if head is not None and not target.features:
        raise BundleError("the manifest has a draft head but its target graph returns no features")
    files = _req(obj, "files", dict, "the manifest")
    for rel, info in files.items():
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("sha256"), str)
            or not isinstance(info.get("bytes"), int)
        ):
            raise BundleError(f"the manifest's checksum entry for '{rel}' is malformed")
    tvocab = _bounded(_req(tok, "vocab_size", int, "tokenizer"), 2, MAX_VOCAB, "tokenizer.vocab_size")
    trt = obj.get("tensorrt")
    if trt is not None and not (isinstance(trt, str) and re.fullmatch(r"\d+(\.\d+){1,2}", trt)):
        raise BundleError('the manifest\'s tensorrt must be a TensorRT version such as "10.3"')
    return Manifest(
        schema_version=version,
        created_by=str(obj.get("created_by", "")),
        max_seq=max_seq,
        batch=batch,
        kv_mode=kv_mode,
        spec_tokens=k,
        prefill_chunk=chunk,
        tokenizer_vocab_size=tvocab,
        eos_token_ids=[int(e) for e in eos],
        bos_token_id=bos,
        add_bos=bool(tok.get("add_bos", False)),
        tokenizer_files=[str(f) for f in _req(tok, "files", list, "tokenizer")],
        chat_template=tok.get("chat_template"),
        target=target,
        draft=draft,
        files=files,
        extra=obj.get("extra", {}) or {},
        head=head,
        tensorrt=trt,
    )


def load_manifest(bundle: str | os.PathLike, verify: str = "full") -> Manifest:
    """Read and validate a bundle's manifest.

    verify: "full" checks every file's size and sha256, "size" only sizes (fast start-up for
    large bundles), "none" skips file checks (the caller vouches for the bundle).
    """
    root = Path(bundle)
    if not root.exists():
        raise BundleError(f"bundle '{root}' does not exist")
    if not root.is_dir():
        raise BundleError(f"bundle '{root}' is not a folder")
    mpath = root / MANIFEST_NAME
    if not mpath.is_file():
        raise BundleError(f"'{root}' is not a bundle: it has no {MANIFEST_NAME}")
    resolve_inside(root, MANIFEST_NAME)  # a manifest.json that links out of the bundle
    m = parse_manifest(read_manifest_json(mpath))
    m.root = root
    # Every referenced path must be listed (and so checksummed) and stay inside the bundle.
    referenced: list[str] = list(m.tokenizer_files)
    if m.chat_template:
        referenced.append(m.chat_template)
    for spec in (m.target, m.draft, m.head):
        for g in spec.graphs if spec is not None else ():
            referenced.append(g.path)
            referenced.extend(g.external_data)
    if m.head is not None:
        referenced.extend(head_files(m.head))
    for rel in list(m.files) + referenced:
        resolve_inside(root, rel)
    for rel in referenced:
        if rel not in m.files:
            raise BundleError(f"the manifest references '{rel}' but lists no checksum for it")
    for rel in m.files:  # whatever `verify` says: opening a named pipe or a device could block forever
        check_regular(resolve_inside(root, rel), rel)
    if verify != "none":
        for rel, info in m.files.items():
            p = resolve_inside(root, rel)
            if not p.is_file():
                raise BundleError(f"the bundle is incomplete: '{rel}' is missing")
            size = p.stat().st_size
            if size != info["bytes"]:
                raise BundleError(f"checksum mismatch: '{rel}' has {size} bytes, the manifest says {info['bytes']}")
            if verify == "full" and sha256_file(p) != info["sha256"]:
                raise BundleError(f"checksum mismatch: '{rel}' does not match its sha256 in the manifest")
    # The runtime generates ids below min(tokenizer, target) only (prompts outside are refused), so
    # the draft must embed those; a tokenizer may be longer than both models (Gemma 3's
    # <image_soft_token>, id 262144 of the 1B text model's 262144 rows), which is no reason to refuse.
    usable = min(m.tokenizer_vocab_size, m.target.vocab_size)
    if m.draft.is_model and m.draft.vocab_size < usable:
        raise BundleError(
            f"the draft's vocabulary ({m.draft.vocab_size} ids) does not cover the {usable} ids "
            "the target and the tokenizer share"
        )
    check_head_matches(m)
    return m


MAX_MANIFEST_BYTES = 64 << 20  # real manifests are a few KB; a bigger one is not a manifest


def read_manifest_json(path: Path) -> Any:
    """The JSON value in a manifest file; every failure (unreadable, too big, not UTF-8, not
    JSON, nested too deeply for the parser) is one BundleError sentence."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise BundleError(f"cannot read {path}: {e.strerror or e}") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: not a bundle manifest")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BundleError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise BundleError(f"{path} nests its values too deeply to be a bundle manifest") from None


def implied_memory_bytes(m: Manifest, draft: bool = True) -> int:
    """The host memory a pipeline of this bundle allocates up front on a CPU backend: the KV
    caches of the target (and draft) at max_seq, and the logits rows of the widest call."""
    rows = reserved_call_size(m.prefill_chunk) * m.batch
    total = 0
    for spec in (m.target, m.draft) if draft else (m.target,):
        if spec.is_model:
            total += spec.kv_bytes(m.max_seq, m.batch) + rows * spec.vocab_size * 4
    return total


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return None


def check_fits_memory(m: Manifest, draft: bool = True) -> None:
    """Refuse geometry whose buffers alone exceed this machine's memory, before allocating any."""
    need = implied_memory_bytes(m, draft)
    have = physical_memory_bytes()
    if have is not None and need > have:
        raise BundleError(
            f"the bundle's sizes imply {need / (1 << 30):.1f} GiB of KV cache and logits buffers at max_seq "
            f"{m.max_seq}, more than this machine's {have / (1 << 30):.1f} GiB of memory"
        )


# ----------------------------------------------------------------------------- draft heads


def head_files(head: ModelSpec) -> list[str]:
    """The files a draft head needs besides its graphs: the draft->target id map."""
    rel = head.extra.get("draft_vocab_file")
    if not isinstance(rel, str):
        raise BundleError("the manifest's draft head names no draft_vocab_file")
    return [rel]


def target_fingerprint(m: Manifest) -> str:
    """One sha256 over the target's graph files' checksums: what a draft head was trained on.
    A head whose recorded fingerprint differs was trained for another target."""
    h = hashlib.sha256()
    for g in m.target.graphs:
        for rel in (g.path, *g.external_data):
            info = m.files.get(rel)
            if info is None:
                raise BundleError(f"the manifest lists no checksum for the target's '{rel}'")
            h.update(f"{rel}:{info['sha256']}\n".encode())
    return h.hexdigest()


def check_head_matches(m: Manifest) -> None:
    """Refuse a draft head trained for another target (its fingerprint differs)."""
    if m.head is None:
        return
    want = target_fingerprint(m)
    got = m.head.extra.get("target_fingerprint")
    if got != want:
        raise BundleError(
            "the bundle's draft head was trained for another target (its target checksum "
            "differs): train it again with `specedge train-draft`"
        )
