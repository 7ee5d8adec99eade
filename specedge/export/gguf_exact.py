"""GGUF-exact weight quantization: MatMul weights that came from a block-quantized GGUF tensor are
stored in MatMulNBits exactly as the GGUF holds them, instead of being re-quantized from their
dequantized fp32 values (a second rounding that costs a 4-bit draft most of its agreement).

Every block type handled here has blocks of 32 along the input dimension and the form
w = d·c (+ m) with integer codes c:

  Q4_0  w = d·(q − 8)               → 4-bit q, scales d, default zero point 8
  Q8_0  w = d·q, q int8              → 8-bit q + 128, default zero point 128
  Q4_1  w = d·q + m                  → 4-bit q, default zero point 8, plus m' = m + 8·d (below)
  Q4_K  w = (d·sc)·q − dmin·mn       → the same as Q4_1 per sub-block of 32

A uint8 zero point cannot hold −m/d, and float zero points take a much slower ORT CPU path, so an
affine weight is split: A·Wᵀ = MatMulNBits(A; q, d) + blocksum(A)·M'ᵀ, where blocksum(A) sums A
over each block of 32 inputs (Reshape + ReduceSum, shared by the MatMuls reading the same tensor)
and M' [N, K/32] holds the block offsets m' in fp32 (checked to be exact; see to_nbits). At int8
precision every weight is stored in 8 bits the same way, and a Q8_0 weight stays 8-bit at int4.

Graph weights are matched to GGUF tensors per output row, by the bytes of the dequantized row: the
exported graph names its weights arbitrarily, stores Wᵀ, may concatenate projections along N, and
transformers permutes llama's q/k rows when it reads a GGUF. A MatMul is taken exactly only when
every one of its columns is a GGUF row and the assembled codes dequantize to its weight bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .specedge_kernel import DOMAIN as Q41_DOMAIN
from .specedge_kernel import KERNELS, pack_q41
from .specedge_kernel import OP as Q41_OP

QK = 32  # values per block (Q4_K: per sub-block)
_Q4_0, _Q4_1, _Q8_0, _Q4_K = 2, 3, 8, 12  # GGMLQuantizationType values
TYPE_NAMES = {_Q4_0: "Q4_0", _Q4_1: "Q4_1", _Q8_0: "Q8_0", _Q4_K: "Q4_K"}
# bytes per block and values per block
_LAYOUT = {_Q4_0: (18, 32), _Q4_1: (20, 32), _Q8_0: (34, 32), _Q4_K: (144, 256)}


# ----------------------------------------------------------------------------- block decoding


@dataclass
class BlockRows:
    """Rows of a weight [R, K] in block form: w[r, 32b + j] = d[r, b]·c[r, 32b + j] (+ m[r, b]).
    `mins` is None for a symmetric weight (signed codes); otherwise codes are unsigned."""

    codes: np.ndarray  # int16 [R, K]
    scales: np.ndarray  # float32 [R, K // 32]
    mins: np.ndarray | None  # float32 [R, K // 32]
    bits: np.ndarray  # uint8 [R]: the source's bit width per row (4 or 8)

    def __getitem__(self, sl: slice) -> BlockRows:
        return BlockRows(self.codes[sl], self.scales[sl], None if self.mins is None else self.mins[sl], self.bits[sl])

    def dequantize(self) -> np.ndarray:
        """fp32 [R, K], computed in the order gguf's dequantizers (and so transformers) use."""
        r, k = self.codes.shape
        c = self.codes.astype(np.float32).reshape(r, k // QK, QK)
        w = self.scales[:, :, None] * c
        if self.mins is not None:
            w = w + self.mins[:, :, None]
        return w.reshape(r, k)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes → [n, 32] codes: the low nibbles are values 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_rows(qtype: int, raw: np.ndarray) -> BlockRows:
    """Decode raw GGUF rows (uint8 [R, bytes per row]) of a Q4_0/Q4_1/Q8_0/Q4_K tensor."""
    tsize, bvals = _LAYOUT[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    r = raw.shape[0]
    nb = raw.shape[1] // tsize
    k = nb * bvals
    blk = raw.reshape(r * nb, tsize)
    mins = None
    if qtype == _Q4_0:
        d = _f16(blk[:, 0:2])
        codes = _nibbles(blk[:, 2:18]).astype(np.int16) - 8
    elif qtype == _Q4_1:
        d, m = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
        codes = _nibbles(blk[:, 4:20]).astype(np.int16)
        mins = m
    elif qtype == _Q8_0:
        d = _f16(blk[:, 0:2])
        codes = blk[:, 2:34].view(np.int8).astype(np.int16)
    elif qtype == _Q4_K:
        dd, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
        s = blk[:, 4:16]
        lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
        sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
        mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
        # 128 bytes = 4 groups of 32: sub-block 2i is the low nibbles of group i, 2i+1 the high.
        qs = blk[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(-1, 8 * 32).astype(np.int16)
        d = (dd[:, None] * sc.astype(np.float32)).reshape(-1)
        mins = -(dmin[:, None] * mn.astype(np.float32)).reshape(-1)
    else:
        raise ValueError(f"GGML type {qtype} is not handled exactly")
    nsub = k // QK
    return BlockRows(
        codes=codes.reshape(r, k),
        scales=d.reshape(r, nsub).astype(np.float32),
        mins=None if mins is None else mins.reshape(r, nsub).astype(np.float32),
        bits=np.full(r, 8 if qtype == _Q8_0 else 4, dtype=np.uint8),
    )


def _to_affine(rows: BlockRows) -> BlockRows:
    """The same values with unsigned codes and block mins (a symmetric row: c + 2^(b−1), −2^(b−1)·d;
    both terms and their sum are exact in fp32, so the dequantized row is unchanged)."""
    if rows.mins is not None:
        return rows
    off = (1 << (rows.bits.astype(np.int16) - 1))[:, None]
    return BlockRows(rows.codes + off, rows.scales, -off.astype(np.float32) * rows.scales, rows.bits)


def concat_rows(parts: list[BlockRows]) -> BlockRows:
    if all(p.mins is None for p in parts):
        return BlockRows(
            np.concatenate([p.codes for p in parts]),
            np.concatenate([p.scales for p in parts]),
            None,
            np.concatenate([p.bits for p in parts]),
        )
    parts = [_to_affine(p) for p in parts]
    return BlockRows(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins", "bits")))


# ----------------------------------------------------------------------------- row index


_MULT_SEED = 0x5EED6A


@lru_cache(maxsize=8)
def _multipliers(k: int) -> np.ndarray:
    rng = np.random.default_rng(_MULT_SEED + k)
    return rng.integers(1, 2**63, size=k, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def row_keys(w: np.ndarray) -> np.ndarray:
    """A 64-bit key per row of fp32 [R, K], from the row's bytes. Only a filter: a match is
    confirmed bit for bit afterwards, so a collision can cost a fallback, never a wrong weight."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    r, k = w.shape
    out = np.empty(r, dtype=np.uint64)
    mult = _multipliers(k)
    step = max(1, (1 << 22) // max(k, 1))
    with np.errstate(over="ignore"):
        for s in range(0, r, step):
            x = w[s : s + step].view(np.uint32).astype(np.uint64)
            h = (x * mult).sum(axis=1, dtype=np.uint64)
            h ^= h >> np.uint64(31)
            h *= np.uint64(0x9E3779B97F4A7C15)
            h ^= h >> np.uint64(29)
            out[s : s + step] = h
    return out


@dataclass
class _Tensor:
    name: str
    qtype: int
    raw: np.ndarray  # uint8 [R, bytes per row] (memory-mapped)
    start: int  # global id of its first row


class GGUFRowIndex:
    """Every row of a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K 2-D tensors, findable by its dequantized
    fp32 bytes. Other types (Q5_0, Q6_K, F16, ...) are listed in `skipped` and never match."""

    def __init__(self, path: str | os.PathLike, say=None):
        from gguf import GGUFReader

        say = say or (lambda msg: None)
        self.path = str(path)
        reader = GGUFReader(self.path)
        self.tensors: list[_Tensor] = []
        self.skipped: dict[str, int] = {}
        keys: dict[int, list[np.ndarray]] = {}
        ids: dict[int, list[np.ndarray]] = {}
        start = 0
        quantized = [t for t in reader.tensors if len(t.data.shape) == 2]
        for i, t in enumerate(quantized):
            qtype = int(t.tensor_type)
            raw = t.data
            if qtype not in _LAYOUT or raw.dtype != np.uint8 or raw.shape[1] % _LAYOUT[qtype][0]:
                name = getattr(t.tensor_type, "name", str(qtype))
                self.skipped[name] = self.skipped.get(name, 0) + 1
                continue
            self.tensors.append(_Tensor(t.name, qtype, raw, start))
            k = raw.shape[1] // _LAYOUT[qtype][0] * _LAYOUT[qtype][1]
            say(f"indexing GGUF rows ({i + 1}/{len(quantized)})")
            step = max(1, (1 << 22) // k)
            for s in range(0, raw.shape[0], step):
                w = decode_rows(qtype, raw[s : s + step]).dequantize()
                keys.setdefault(k, []).append(row_keys(w))
                ids.setdefault(k, []).append(np.arange(start + s, start + s + w.shape[0], dtype=np.int64))
            start += raw.shape[0]
        self._starts = np.array([t.start for t in self.tensors], dtype=np.int64)
        self._by_k: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for k in keys:
            kk, ii = np.concatenate(keys[k]), np.concatenate(ids[k])
            order = np.argsort(kk, kind="stable")
            self._by_k[k] = (kk[order], ii[order])
        self.num_rows = start

    def find(self, rows: np.ndarray) -> np.ndarray:
        """Global row ids for fp32 rows [N, K]; −1 where no GGUF row has those bytes."""
        n, k = rows.shape
        out = np.full(n, -1, dtype=np.int64)
        if k not in self._by_k:
            return out
        kk, ii = self._by_k[k]
        want = row_keys(rows)
        pos = np.minimum(np.searchsorted(kk, want), len(kk) - 1)
        hit = kk[pos] == want
        out[hit] = ii[pos[hit]]
        return out

    def rows(self, ids: np.ndarray) -> tuple[BlockRows, list[str]]:
        """The block form of the given global rows, in order, and the source types involved."""
        t_of = np.searchsorted(self._starts, ids, side="right") - 1
        parts, where, types = [], [], []
        for ti in np.unique(t_of):
            sel = np.nonzero(t_of == ti)[0]
            t = self.tensors[int(ti)]
            parts.append(decode_rows(t.qtype, np.asarray(t.raw[ids[sel] - t.start])))
            where.append(sel)
            types.append(TYPE_NAMES[t.qtype])
        allrows = concat_rows(parts)
        order = np.argsort(np.concatenate(where), kind="stable")
        return BlockRows(
            allrows.codes[order],
            allrows.scales[order],
            None if allrows.mins is None else allrows.mins[order],
            allrows.bits[order],
        ), types

    def match(self, weight_t: np.ndarray) -> tuple[BlockRows | None, list[str], int]:
        """Block form of a weight given as Wᵀ [K, N] (one GGUF row per column), or None.
        Returns (rows, source types, columns matched)."""
        w = np.ascontiguousarray(np.asarray(weight_t, dtype=np.float32).T)
        ids = self.find(w)
        found = int((ids >= 0).sum())
        if found < w.shape[0]:
            return None, [], found
        rows, types = self.rows(ids)
        step = max(1, (1 << 22) // w.shape[1])
        for s in range(0, w.shape[0], step):  # bit for bit, in slices (lm_head can be large)
            if not np.array_equal(rows[s : s + step].dequantize().view(np.uint32), w[s : s + step].view(np.uint32)):
                return None, types, 0
        return rows, types, found


_INDEX: tuple | None = None


def row_index(path: str | os.PathLike, say=None) -> GGUFRowIndex:
    """The row index of a GGUF file, built once and kept for the next model of the same file."""
    global _INDEX
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if _INDEX is None or _INDEX[0] != key:
        _INDEX = None  # one file at a time
        _INDEX = (key, GGUFRowIndex(path, say=say))
    return _INDEX[1]


# ----------------------------------------------------------------------------- MatMulNBits form


@dataclass
class NBitsWeight:
    """MatMulNBits inputs for one weight [N, K]: B uint8 [N, K/32, 32·bits/8], scales fp32
    [N, K/32], zero points (None: the default 2^(bits−1)) and the block mins fp32 [N, K/32]
    (None: no correction)."""

    bits: int
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    mins: np.ndarray | None


def to_nbits(rows: BlockRows, bits: int) -> NBitsWeight:
    """Store block rows in `bits` (4 or 8) bits, exactly.

    Symmetric rows (w = d·s) store s + 2^(bits−1) under the default zero point. Affine rows
    (w = d·c + m, c unsigned with source width b) are centred the same way: s = c − 2^(b−1) and
    the correction carries m' = m + 2^(b−1)·d, so w = d·s + m'. That needs no zero-point input
    (ORT's CPU kernel is measurably faster without one) and keeps the quantized part zero-mean,
    which is what accuracy_level 4's int8 activations like. When some m' is not exact in fp32
    (never seen in real files), the affine rows keep c with zero points 0 and the mins m."""
    n, k = rows.codes.shape
    nb = k // QK
    zero = 1 << (bits - 1)
    mins = rows.mins
    zp = None
    if mins is None:
        u = rows.codes + zero
    else:
        half = (1 << (rows.bits.astype(np.int64) - 1))[:, None]
        centred = mins.astype(np.float64) + half * rows.scales.astype(np.float64)
        m2 = centred.astype(np.float32)
        if np.array_equal(m2.astype(np.float64), centred):
            u = rows.codes - half + zero
            mins = m2
        else:
            u = rows.codes
            zp = np.zeros((n, (nb + 1) // 2) if bits == 4 else (n, nb), dtype=np.uint8)
    if u.min(initial=0) < 0 or u.max(initial=0) >= (1 << bits):
        raise ValueError(f"codes do not fit in {bits} bits")
    u = u.astype(np.uint8).reshape(n, nb, QK)
    if bits == 4:
        packed = u[..., 0::2] | (u[..., 1::2] << 4)
    elif bits == 8:
        packed = u
    else:
        raise ValueError("bits must be 4 or 8")
    return NBitsWeight(
        bits,
        np.ascontiguousarray(packed, dtype=np.uint8),
        rows.scales.astype(np.float32),
        zp,
        None if mins is None else np.ascontiguousarray(mins, dtype=np.float32),
    )


def storage_bits(rows: BlockRows, precision_bits: int) -> int:
    """The MatMulNBits width: 4 when the precision is int4 and every source row is 4-bit (a
    weight is never stored below its source's width), 8 otherwise."""
    return 4 if precision_bits == 4 and int(rows.bits.max()) <= 4 else 8


# ----------------------------------------------------------------------------- graph rewrite


@dataclass
class ExactReport:
    exact: int = 0  # MatMuls now exact MatMulNBits
    candidates: int = 0  # MatMuls with a constant 2-D fp32 weight
    source_types: dict = field(default_factory=dict)  # GGUF type -> MatMuls using it
    storage: dict = field(default_factory=dict)  # "4-bit" / "4-bit+mins" / "8-bit" ... -> MatMuls
    unmatched: list = field(default_factory=list)  # node names left for re-quantization
    helper_nodes: set = field(default_factory=set)  # fp32 MatMuls we added (not to quantize)
    skipped_types: dict = field(default_factory=dict)
    kernel_matmuls: int = 0  # of them, run by ai.specedge.MatMulQ41

    def to_json(self) -> dict:
        return {
            "exact_matmuls": self.exact,
            "exact_block_size": QK,
            **({"specedge_kernel_matmuls": self.kernel_matmuls} if self.kernel_matmuls else {}),
            "source_types": dict(sorted(self.source_types.items())),
            "exact_storage": dict(sorted(self.storage.items())),
            "gguf_types_not_exact": dict(sorted(self.skipped_types.items())),
        }


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    out = {}
    for v in list(graph.value_info) + list(graph.input) + list(graph.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            out[v.name] = len(v.type.tensor_type.shape.dim)
    return out


def rewrite_exact(
    proto: onnx.ModelProto,
    index: GGUFRowIndex,
    precision_bits: int,
    accuracy_level: int,
    say=None,
    kernel: str = "matmulnbits",
) -> ExactReport:
    """Replace every MatMul whose constant weight is a (permuted, concatenated) set of GGUF rows by
    an exact MatMulNBits (+ the block-min correction for affine types). In place.

    kernel "specedge": 4-bit affine
    weights (Q4_1, and Q4_K where its scales fit fp16) become one ai.specedge.MatMulQ41 node each
    (specedge_kernel.py), which needs libspecedge_ops at run time; the others stay as above."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    say = say or (lambda msg: None)
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    ranks = _ranks(g)
    rep = ExactReport(skipped_types=dict(index.skipped))
    todo = [
        (i, n)
        for i, n in enumerate(g.node)
        if n.op_type == "MatMul"
        and len(n.input) == 2
        and n.input[1] in inits
        and len(inits[n.input[1]].dims) == 2
        and inits[n.input[1]].data_type == TensorProto.FLOAT
        and inits[n.input[1]].dims[0] % QK == 0
    ]
    rep.candidates = len(todo)
    new_inits: list[TensorProto] = []
    blocksums: dict[str, str] = {}  # input name -> its blocksum
    done: dict[str, tuple] = {}  # weight name -> (MatMulNBits inputs, mins name, bits, source types)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # node index -> its replacement
    taken: set[str] = set()
    names = {n.name for n in g.node}
    q41_weights: set[str] = set()

    def uniq(base: str) -> str:
        name, i = base, 1
        while name in names or name in inits or name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        return name

    for j, (idx, node) in enumerate(todo):
        say(f"GGUF-exact weights ({j + 1}/{len(todo)})")
        a, bname = node.input
        k, n = inits[bname].dims
        if bname not in done:
            rows, types, _ = index.match(numpy_helper.to_array(inits[bname]))
            try:
                w = None if rows is None else to_nbits(rows, storage_bits(rows, precision_bits))
            except ValueError:  # codes that do not fit (cannot happen for the types above)
                w = None
            q41 = None
            if (
                w is not None
                and kernel == "specedge"
                and w.bits == 4
                and rows.mins is not None
                and int(rows.bits.max()) <= 4
            ):
                q41 = pack_q41(rows.codes, rows.scales, rows.mins)
            if w is None:
                done[bname] = None
            elif q41 is not None:
                pn = uniq(f"{bname}_gguf_q41")
                new_inits.append(numpy_helper.from_array(q41, pn))
                done[bname] = ([pn], None, 4, sorted(set(types)), "4-bit+mins (specedge MatMulQ41)")
                q41_weights.add(pn)
            else:
                qn, sn = uniq(f"{bname}_gguf_q{w.bits}"), uniq(f"{bname}_gguf_scales")
                new_inits += [numpy_helper.from_array(w.packed, qn), numpy_helper.from_array(w.scales, sn)]
                ins = [qn, sn]
                if w.zero_points is not None:
                    ins.append(uniq(f"{bname}_gguf_zp"))
                    new_inits.append(numpy_helper.from_array(w.zero_points, ins[-1]))
                mn = None
                if w.mins is not None:
                    mn = uniq(f"{bname}_gguf_mins")
                    new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w.mins.T), mn))
                kind = f"{w.bits}-bit" + ("+zp" if w.zero_points is not None else "") + ("+mins" if mn else "")
                done[bname] = (ins, mn, w.bits, sorted(set(types)), kind)
        if done[bname] is None:
            rep.unmatched.append(node.name)
            continue
        ins, mn, bits, types, kind = done[bname]
        base = (node.name or bname).replace("/", "_")
        y = node.output[0]
        mm_out = y if mn is None else uniq(f"{y}_gguf_nbits")
        if ins[0] in q41_weights:
            nodes = [helper.make_node(Q41_OP, [a, ins[0]], [y], name=uniq(f"{base}_gguf_q41"), domain=Q41_DOMAIN)]
        else:
            nodes = [
                helper.make_node(
                    "MatMulNBits",
                    [a, *ins],
                    [mm_out],
                    name=uniq(f"{base}_gguf_exact"),
                    domain="com.microsoft",
                    K=k,
                    N=n,
                    bits=bits,
                    block_size=QK,
                    accuracy_level=accuracy_level,
                )
            ]
        if mn is not None:
            if a not in blocksums:
                bs = _blocksum_nodes(a, k, ranks.get(a), uniq, new_inits)
                nodes[:0] = bs
                blocksums[a] = bs[-1].output[0]
            corr, cname = uniq(f"{y}_gguf_min_corr"), uniq(f"{base}_gguf_mins")
            nodes += [
                helper.make_node("MatMul", [blocksums[a], mn], [corr], name=cname),
                helper.make_node("Add", [mm_out, corr], [y], name=uniq(f"{base}_gguf_add")),
            ]
            rep.helper_nodes.add(cname)
        replaced[idx] = nodes
        rep.exact += 1
        for t in types:
            rep.source_types[t] = rep.source_types.get(t, 0) + 1
        rep.storage[kind] = rep.storage.get(kind, 0) + 1
    if not replaced:
        return rep
    out_nodes = []
    for i, node in enumerate(g.node):
        out_nodes.extend(replaced.get(i, [node]))
    del g.node[:]
    g.node.extend(out_nodes)
    g.initializer.extend(new_inits)
    used = {x for nd in g.node for x in nd.input} | {o.name for o in g.output}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    for domain in {nd.domain for nd in g.node} & {"com.microsoft", Q41_DOMAIN}:
        if not any(o.domain == domain for o in proto.opset_import):
            proto.opset_import.append(helper.make_opsetid(domain, 1))
    rep.kernel_matmuls = sum(nd.op_type == Q41_OP and nd.domain == Q41_DOMAIN for nd in g.node)
    return rep


def _blocksum_nodes(a: str, k: int, rank: int | None, uniq, new_inits: list) -> list[onnx.NodeProto]:
    """blocksum(a) [..., K/32]: a [..., K] reshaped to [..., K/32, 32] and summed over the last axis."""
    nodes = []
    tail = np.array([k // QK, QK], dtype=np.int64)
    if rank is not None and rank >= 1:
        shape = uniq(f"{a}_gguf_blocks_shape")
        new_inits.append(numpy_helper.from_array(np.concatenate([np.zeros(rank - 1, np.int64), tail]), shape))
    else:
        lead, tail_n, shape = uniq(f"{a}_gguf_lead"), uniq(f"{a}_gguf_tail"), uniq(f"{a}_gguf_blocks_shape")
        new_inits.append(numpy_helper.from_array(tail, tail_n))
        nodes += [
            helper.make_node("Shape", [a], [lead], end=-1, name=uniq(f"{a}_gguf_shape")),
            helper.make_node("Concat", [lead, tail_n], [shape], axis=0, name=uniq(f"{a}_gguf_concat")),
        ]
    blocks, axes, s = uniq(f"{a}_gguf_blocks"), uniq(f"{a}_gguf_axes"), uniq(f"{a}_gguf_blocksum")
    new_inits.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), axes))
    nodes += [
        helper.make_node("Reshape", [a, shape], [blocks], name=uniq(f"{a}_gguf_reshape")),
        helper.make_node("ReduceSum", [blocks, axes], [s], keepdims=0, name=uniq(f"{a}_gguf_blocksum")),
    ]
    return nodes
