"""Pure helpers shared by the GPU backends: which graph tensor binds which buffer, where.

Buffer layout (every GPU backend uses it, so the arithmetic is tested once, on the CPU):

* **cache arena**: one allocation holding all K and V caches, tensor j = kind * L + layer
  (kind 0 = key, 1 = value), each [B, kv_heads, S, head_dim] row-major, starting at j * stride where
  the stride is the tensor's size rounded up to a multiple of ARENA_ALIGN (256) bytes: TensorRT
  wants every bound address 256-byte aligned. Each tensor is a matrix of B·kv_heads rows of
  S·head_dim elements; when no padding is needed (the tensor size is already a multiple of 256
  bytes, as it usually is for the cache) the whole arena is one matrix of 2·L·B·kv_heads rows.
* **delta arena** (delta mode, one per call size T): the graph's `new_key.i` / `new_value.i`
  outputs, same order and same padding rule, each [B, kv_heads, T, head_dim]. Here padding is the
  common case (kv_heads 3, head_dim 64, fp16, T = 1: 384-byte tensors, stride 512).

Writing every layer's new entries at `position` is a 2-D copy (cudaMemcpy2DAsync) of rows of
`width` = T·head_dim·itemsize bytes, source pitch `width`, destination pitch S·head_dim·itemsize,
destination offset position·head_dim·itemsize: **one** copy of all 2·L·B·kv_heads rows when neither
arena is padded, else one per K/V tensor (B·kv_heads rows each, 2·L copies) — `delta_copy` returns
the list and the backends issue every copy in it. In scatter mode `present_*` bind to the same
addresses as `past_*` (in-place update).

Also here: the profile option strings of ONNX Runtime's TensorRT execution provider. The graph
names themselves, and the check that a session or engine follows them, are in specedge/contract.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...contract import ARGMAX_OUTPUT, FEATURES_OUTPUT, KEY, TREE_INPUT, VALUE, TensorSpec, graph_io, parse_kv_name
from ...manifest import DTYPE_BYTES, ModelSpec

# Every tensor in an arena starts on a multiple of this many bytes. TensorRT's
# IExecutionContext::setTensorAddress (Python: set_tensor_address) documents "The pointer must have
# at least 256-byte alignment" (NvInferRuntime.h), and tensors packed back to back break that as
# soon as one tensor's size is not a multiple of 256 bytes (e.g. a delta tensor with kv_heads 3,
# head_dim 64, fp16, T = 1 is 384 bytes). cudaMalloc and ONNX Runtime's CUDA allocator return
# 256-byte aligned bases, so aligned offsets give aligned addresses. Same value as kTensorAlign in
# cpp/src/trt_plan.h.
ARENA_ALIGN = 256


@dataclass(frozen=True)
class KVLayout:
    """2·L tensors of [B, kv_heads, seq, head_dim] in one allocation, each starting on a multiple of
    `align` bytes (tensor j at j * tensor_stride)."""

    num_layers: int
    batch: int
    kv_heads: int
    seq: int
    head_dim: int
    itemsize: int
    align: int = ARENA_ALIGN

    @classmethod
    def for_cache(cls, spec: ModelSpec, max_seq: int, batch: int = 1) -> KVLayout:
        return cls(spec.num_layers, batch, spec.num_kv_heads, max_seq, spec.head_dim, DTYPE_BYTES[spec.kv_dtype])

    @classmethod
    def for_delta(cls, spec: ModelSpec, t: int, batch: int = 1) -> KVLayout:
        return cls(spec.num_layers, batch, spec.num_kv_heads, t, spec.head_dim, DTYPE_BYTES[spec.kv_dtype])

    def __post_init__(self):
        if self.align < 1 or self.align % self.itemsize:
            raise ValueError(f"arena alignment {self.align} is not a multiple of the element size {self.itemsize}")

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.seq, self.head_dim)

    @property
    def tensor_elems(self) -> int:
        return self.batch * self.kv_heads * self.seq * self.head_dim

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one tensor's data (without padding)."""
        return self.tensor_elems * self.itemsize

    @property
    def tensor_stride(self) -> int:
        """Bytes from one tensor to the next: tensor_bytes rounded up to a multiple of `align`."""
        return -(-self.tensor_bytes // self.align) * self.align

    @property
    def dense(self) -> bool:
        """No padding between tensors: the arena is one matrix of `rows` rows of `row_bytes`."""
        return self.tensor_stride == self.tensor_bytes

    @property
    def num_tensors(self) -> int:
        return 2 * self.num_layers

    @property
    def total_bytes(self) -> int:
        """Bytes to allocate for the arena, padding included."""
        return self.num_tensors * self.tensor_stride

    @property
    def total_elems(self) -> int:
        """Elements to allocate for the arena, padding included (align is a multiple of itemsize)."""
        return self.total_bytes // self.itemsize

    @property
    def rows(self) -> int:
        return self.num_tensors * self.rows_per_tensor

    @property
    def rows_per_tensor(self) -> int:
        return self.batch * self.kv_heads

    @property
    def row_bytes(self) -> int:
        return self.seq * self.head_dim * self.itemsize

    def index(self, kind: int, layer: int) -> int:
        if kind not in (KEY, VALUE) or not 0 <= layer < self.num_layers:
            raise ValueError(f"no KV tensor kind={kind} layer={layer} in a {self.num_layers}-layer layout")
        return kind * self.num_layers + layer

    def offset(self, kind: int, layer: int) -> int:
        """Byte offset of one tensor in the arena (a multiple of `align`)."""
        return self.index(kind, layer) * self.tensor_stride

    def tensors(self, flat):
        """View a flat numpy array of `total_elems` elements (the arena) as [2·L, B, kv_heads, seq,
        head_dim], skipping the padding (a view, not a copy)."""
        n = self.tensor_stride // self.itemsize
        return flat.reshape(self.num_tensors, n)[:, : self.tensor_elems].reshape(
            (self.num_tensors,) + self.tensor_shape
        )


@dataclass(frozen=True)
class Copy2D:
    """Arguments of one cudaMemcpy2D(Async), offsets relative to the two arenas' base addresses."""

    dst_offset: int
    dpitch: int
    src_offset: int
    spitch: int
    width: int
    height: int


def _copies(dst: KVLayout, src: KVLayout, base: Copy2D) -> list[Copy2D]:
    """`base` (offsets within one tensor, for every row) as issued: a single copy of every row
    when neither arena is padded (each is one matrix), else one per K/V tensor."""
    if dst.dense and src.dense:
        return [replace(base, height=dst.rows)]
    return [
        replace(
            base,
            dst_offset=dst.offset(kind, layer) + base.dst_offset,
            src_offset=src.offset(kind, layer) + base.src_offset,
            height=dst.rows_per_tensor,
        )
        for kind in (KEY, VALUE)
        for layer in range(dst.num_layers)
    ]


def delta_copy(cache: KVLayout, t: int, position: int) -> list[Copy2D]:
    """The 2-D copies that write the delta arena for T = t (laid out as `replace(cache, seq=t)`, i.e.
    KVLayout.for_delta) into the cache arena at `position`, all layers, K and V, every batch row at
    the same position: one copy of every row when neither arena is padded, else one per K/V tensor.
    The caller must issue every copy in the list."""
    if t < 1:
        raise ValueError(f"T must be >= 1, got {t}")
    if position < 0 or position + t > cache.seq:
        raise ValueError(f"writing {t} entries at position {position} overflows the cache of {cache.seq} slots")
    delta = replace(cache, seq=t)
    width = delta.row_bytes  # T·head_dim elements
    base = Copy2D(
        dst_offset=position * cache.head_dim * cache.itemsize,
        dpitch=cache.row_bytes,
        src_offset=0,
        spitch=width,
        width=width,
        height=0,
    )
    return _copies(cache, delta, base)


def slot_copy(cache: KVLayout, start: int, end: int) -> list[Copy2D]:
    """The 2-D copies that copy cache slots [start, end) of every row from one arena to another of
    the same layout (a self-draft taking the target's K/V): one copy of every row when the arena
    is not padded, else one per K/V tensor. Offsets are the same in both arenas."""
    if not 0 <= start <= end <= cache.seq:
        raise ValueError(f"slots [{start}, {end}) are not inside a cache of {cache.seq} slots")
    if start == end:
        return []
    slot = cache.head_dim * cache.itemsize
    off = start * slot
    base = Copy2D(
        dst_offset=off,
        dpitch=cache.row_bytes,
        src_offset=off,
        spitch=cache.row_bytes,
        width=(end - start) * slot,
        height=0,
    )
    return _copies(cache, cache, base)


def path_copies(cache: KVLayout, position: int, moves) -> list[Copy2D]:
    """The 2-D copies, within one arena, that commit a tree's accepted path: for each (source,
    destination) of `runtime.tree.compaction_moves` (offsets from `position`, in that order), one
    slot of every row (per K/V tensor when padded). Issued in list order on one stream, no copy
    overwrites a later copy's source, and no copy overlaps itself (one slot each)."""
    slot = cache.head_dim * cache.itemsize
    out: list[Copy2D] = []
    for src, dst in moves:
        s, d = position + int(src), position + int(dst)
        if not (0 <= d < s < cache.seq):
            raise ValueError(f"a path move from slot {s} to {d} is not a move back inside a cache of {cache.seq} slots")
        base = Copy2D(
            dst_offset=d * slot,
            dpitch=cache.row_bytes,
            src_offset=s * slot,
            spitch=cache.row_bytes,
            width=slot,
            height=0,
        )
        out.extend(_copies(cache, cache, base))
    return out


@dataclass(frozen=True)
class Binding:
    """One graph tensor and the buffer it binds to."""

    name: str
    io: str  # "input" or "output"
    buffer: str  # "input_ids" | "position" | "tree_mask" | "cache" | "logits" | "delta" | "argmax" | "features"
    offset: int  # bytes into the buffer (the arenas); 0 otherwise
    shape: tuple[int, ...]
    dtype: str


def binding_plan(
    spec: ModelSpec, kv_mode: str, max_seq: int, t: int, batch: int = 1, argmax: bool = False, tree: bool = False
) -> list[Binding]:
    """Every tensor of the graph contract for a call with T = t, mapped to its buffer (tree: the
    graph takes tree calls, its `tree_mask` input binds the tree_mask buffer).

    Scatter mode binds `present_*` to the very addresses of `past_*` (the graph updates the cache
    in place); delta mode binds `new_*` into the delta arena for this T.
    """
    if kv_mode not in ("scatter", "delta"):
        raise ValueError(f"unknown kv mode '{kv_mode}'")
    inputs, outputs = graph_io(spec, kv_mode, max_seq, batch, tree)
    cache = KVLayout.for_cache(spec, max_seq, batch)
    delta = KVLayout.for_delta(spec, t, batch)
    out: list[Binding] = []

    def shape_of(ts: TensorSpec) -> tuple[int, ...]:
        return tuple(t if d == "T" else int(d) for d in ts.shape)

    for io, group in (("input", inputs), ("output", outputs)):
        for ts in group:
            kv = parse_kv_name(ts.name)
            if ts.name == "input_ids":
                out.append(Binding(ts.name, io, "input_ids", 0, shape_of(ts), ts.dtype))
            elif ts.name in ("position", TREE_INPUT):
                out.append(Binding(ts.name, io, ts.name, 0, shape_of(ts), ts.dtype))
            elif ts.name == "logits":
                out.append(Binding(ts.name, io, "logits", 0, shape_of(ts), ts.dtype))
            elif ts.name == FEATURES_OUTPUT:  # hidden states for a draft head (manifest `features`)
                out.append(Binding(ts.name, io, "features", 0, shape_of(ts), ts.dtype))
            elif kv is not None and kv[0] in ("past", "present"):
                out.append(Binding(ts.name, io, "cache", cache.offset(kv[1], kv[2]), shape_of(ts), ts.dtype))
            elif kv is not None and kv[0] == "new":
                out.append(Binding(ts.name, io, "delta", delta.offset(kv[1], kv[2]), shape_of(ts), ts.dtype))
            else:  # pragma: no cover - graph_io only yields the names above
                raise ValueError(f"unexpected tensor '{ts.name}' in the graph contract")
    if argmax:
        out.append(Binding(ARGMAX_OUTPUT, "output", "argmax", 0, (batch, t, 1), "int64"))
    return out


# ----------------------------------------------------------------------------- ONNX Runtime helpers


def shape_string(shape: tuple[int, ...]) -> str:
    return "x".join(str(int(d)) for d in shape)


def ort_trt_profile_options(profiles: list[dict[str, tuple]]) -> dict[str, str]:
    """`trt_profile_{min,opt,max}_shapes` for ONNX Runtime's TensorRT EP.

    `profiles` is a list (one entry per optimization profile) of {input name: (min, opt, max)}.
    The EP's format is "name:d0xd1,name2:d0xd1"; repeating a name adds a further profile.
    """
    mins, opts, maxs = [], [], []
    for shapes in profiles:
        for name, (lo, opt, hi) in shapes.items():
            mins.append(f"{name}:{shape_string(lo)}")
            opts.append(f"{name}:{shape_string(opt)}")
            maxs.append(f"{name}:{shape_string(hi)}")
    return {
        "trt_profile_min_shapes": ",".join(mins),
        "trt_profile_opt_shapes": ",".join(opts),
        "trt_profile_max_shapes": ",".join(maxs),
    }


# ONNX TensorProto element types, for dtypes numpy lacks (bfloat16).
ONNX_BFLOAT16 = 16


def numpy_dtype(dtype: str):
    """numpy dtype of a contract dtype name; None for bfloat16 (numpy has none)."""
    import numpy as np

    return {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}.get(dtype)


def ort_element_type(dtype: str):
    """What OrtValue / IOBinding accept as element type: a numpy type, or an ONNX type id."""
    if dtype == "bfloat16":
        return ONNX_BFLOAT16
    t = numpy_dtype(dtype)
    if t is None:
        raise ValueError(f"unsupported tensor dtype '{dtype}'")
    return t


def graph_id_for(sizes: list[int], t: int) -> int:
    """ONNX Runtime `gpu_graph_id` for a captured size (1, 2, … in size order); -1 = no capture."""
    if t in sizes:
        return sorted(sizes).index(t) + 1
    return -1
