"""TensorRT engine logic that needs no GPU: profiles, plan.json validation and refusal messages,
binding-name mapping, the TensorRT version gate, and the build flow against a fake tensorrt module."""

from __future__ import annotations

import hashlib
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import specedge.engines
from specedge.cli.main import main
from specedge.contract import check_graph_names, graph_io, parse_kv_name
from specedge.engines.builder import BuildOptions, build_engines, typing_mode
from specedge.engines.plan_json import (
    EngineError,
    PlanInfo,
    check_against_manifest,
    check_compatible,
    check_kv_mode_supported,
    device_tag,
    load_plan_info,
    no_engine_message,
    parse_plan_info,
    parse_version,
    same_trt_version,
    verify_plan_bytes,
)
from specedge.engines.profiles import Profile, build_profiles, input_shapes, range_profile, select_profile
from specedge.errors import UserError
from specedge.manifest import ModelSpec, load_manifest
from specedge.runtime.backends.base import BackendError
from specedge.runtime.backends.binding import (
    ARENA_ALIGN,
    KVLayout,
    binding_plan,
    delta_copy,
    graph_id_for,
    ort_trt_profile_options,
    slot_copy,
)

L, KVH, HD, S, V = 3, 2, 4, 32, 17


def spec(kv_dtype="float16"):
    return ModelSpec(
        role="target",
        kind="model",
        precision="fp16",
        kv_dtype=kv_dtype,
        num_layers=L,
        num_kv_heads=KVH,
        head_dim=HD,
        vocab_size=V,
    )


# ----------------------------------------------------------------------------- profiles


def test_profiles_exact_for_decode_and_verify_range_for_prefill():
    ps = build_profiles(4, 64)
    assert [(p.name, p.t_min, p.t_opt, p.t_max) for p in ps] == [
        ("decode", 1, 1, 1),
        ("verify", 5, 5, 5),
        ("prefill", 1, 64, 64),
    ]
    assert [p.exact for p in ps] == [True, True, False]
    assert select_profile(ps, 1) == 0 and select_profile(ps, 5) == 1
    assert select_profile(ps, 3) == 2 and select_profile(ps, 64) == 2  # a short last chunk, a short draft
    with pytest.raises(ValueError, match="no optimization profile covers T = 65"):
        select_profile(ps, 65)


def test_profiles_when_sizes_coincide():
    assert [(p.name, p.t_min, p.t_opt, p.t_max) for p in build_profiles(4, 5)] == [
        ("decode", 1, 1, 1),
        ("verify+prefill", 1, 5, 5),
    ]
    assert [(p.name, p.t_min, p.t_max) for p in build_profiles(1, 1)] == [("decode+prefill", 1, 1), ("verify", 1, 2)]
    assert [(p.name, p.t_min, p.t_opt, p.t_max) for p in build_profiles(8, 4)] == [
        ("decode", 1, 1, 1),
        ("prefill", 4, 4, 4),
        ("verify", 1, 9, 9),
    ]
    assert range_profile(4, 64) == Profile("all", 1, 5, 64)
    with pytest.raises(ValueError):
        Profile("bad", 2, 1, 3)
    assert Profile.from_json(Profile("x", 1, 2, 3).to_json()) == Profile("x", 1, 2, 3)


def test_input_shapes_per_profile():
    ps = build_profiles(4, 64)
    assert input_shapes(spec(), "scatter", S, 1, ps[0]) == {"input_ids": ((1, 1), (1, 1), (1, 1))}
    assert input_shapes(spec(), "delta", S, 2, ps[2]) == {"input_ids": ((2, 1), (2, 64), (2, 64))}
    full = input_shapes(spec(), "scatter", S, 1, ps[1], dynamic_only=False)
    assert full["position"] == ((1,), (1,), (1,))
    assert full[f"past_value.{L - 1}"] == ((1, KVH, S, HD),) * 3
    assert len(full) == 2 + 2 * L


def test_ort_trt_profile_strings_repeat_names_per_profile():
    shapes = [input_shapes(spec(), "scatter", S, 1, p) for p in build_profiles(4, 64)]
    o = ort_trt_profile_options(shapes)
    assert o == {
        "trt_profile_min_shapes": "input_ids:1x1,input_ids:1x5,input_ids:1x1",
        "trt_profile_opt_shapes": "input_ids:1x1,input_ids:1x5,input_ids:1x64",
        "trt_profile_max_shapes": "input_ids:1x1,input_ids:1x5,input_ids:1x64",
    }


# ----------------------------------------------------------------------------- binding


def test_parse_kv_name():
    assert parse_kv_name("past_value.3") == ("past", 1, 3)
    assert parse_kv_name("new_key.12") == ("new", 0, 12)
    assert parse_kv_name("logits") is None and parse_kv_name("past_key.x") is None


def test_binding_plan_scatter_aliases_present_to_past():
    b = {x.name: x for x in binding_plan(spec(), "scatter", S, 5)}
    tb = 1 * KVH * S * HD * 2  # one fp16 cache tensor
    for i in range(L):
        assert b[f"past_key.{i}"].buffer == b[f"present_key.{i}"].buffer == "cache"
        assert b[f"past_key.{i}"].offset == b[f"present_key.{i}"].offset == i * tb
        assert b[f"past_value.{i}"].offset == b[f"present_value.{i}"].offset == (L + i) * tb
        assert b[f"present_key.{i}"].io == "output" and b[f"past_key.{i}"].io == "input"
    assert b["input_ids"].shape == (1, 5) and b["logits"].shape == (1, 5, V) and b["position"].shape == (1,)
    assert len(b) == 3 + 4 * L


def test_binding_plan_delta_maps_new_entries_into_the_delta_arena():
    b = {x.name: x for x in binding_plan(spec(), "delta", S, 5, batch=2, argmax=True)}
    assert 2 * KVH * 5 * HD * 2 == 160  # one fp16 delta tensor: padded to a 256-byte stride
    tb = ARENA_ALIGN
    assert b["new_key.1"].buffer == "delta" and b["new_key.1"].offset == 1 * tb
    assert b["new_value.0"].offset == L * tb and b["new_value.0"].shape == (2, KVH, 5, HD)
    assert b["past_value.2"].offset == (L + 2) * 2 * KVH * S * HD * 2
    assert b["argmax"].shape == (2, 5, 1)


def test_binding_plan_of_a_tree_graph_binds_its_mask():
    plain = binding_plan(spec(), "delta", S, 5, batch=2)
    b = binding_plan(spec(), "delta", S, 5, batch=2, tree=True)
    assert [x.name for x in b] == ["input_ids", "position", "tree_mask"] + [x.name for x in plain][2:]
    m = b[2]
    assert (m.io, m.buffer, m.offset, m.shape, m.dtype) == ("input", "tree_mask", 0, (2, 5, 5), "bool")


def _spec(layers, kv_heads, head_dim, kv_dtype="float16"):
    return ModelSpec(
        role="target",
        kind="model",
        precision="fp16",
        kv_dtype=kv_dtype,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=V,
    )


# (spec, max_seq): kv_heads 3 x head_dim 64 fp16 gives 384-byte delta tensors at T = 1 (misaligned
# every other tensor when packed); max_seq 33 pads the cache too; the toy spec() is dense at S = 32.
LAYOUT_CASES = [
    (spec(), S),
    (_spec(2, 3, 64), 32),
    (_spec(2, 3, 64), 33),
    (_spec(3, 1, 8, "float32"), 7),
    (_spec(2, 5, 24, "bfloat16"), 19),
]


def _assert_padding_is(layout: KVLayout, buf: np.ndarray, sentinel: int) -> None:
    """Every byte of the arena `buf` outside its tensors still holds `sentinel` (no stray copy)."""
    pad = np.ones(layout.total_bytes, bool)
    for j in range(layout.num_tensors):
        pad[j * layout.tensor_stride : j * layout.tensor_stride + layout.tensor_bytes] = False
    assert (buf[pad] == sentinel).all()


def _simulate(copies, dst: np.ndarray, src: np.ndarray) -> None:
    """cudaMemcpy2D on byte arrays: `height` rows of `width` bytes, each side with its own pitch."""
    for c in copies:
        assert c.width <= c.dpitch and c.width <= c.spitch
        for r in range(c.height):
            d0, s0 = c.dst_offset + r * c.dpitch, c.src_offset + r * c.spitch
            assert d0 + c.width <= dst.size and s0 + c.width <= src.size
            dst[d0 : d0 + c.width] = src[s0 : s0 + c.width]


@pytest.mark.parametrize("sp,max_seq", LAYOUT_CASES)
@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
def test_every_bound_arena_offset_is_256_byte_aligned(sp, max_seq, kv_mode):
    """TensorRT's setTensorAddress wants 256-byte aligned pointers; the arena bases are (cudaMalloc),
    so every offset into an arena must be a multiple of 256, for every T and batch."""
    assert ARENA_ALIGN == 256
    for batch in (1, 2):
        cache = KVLayout.for_cache(sp, max_seq, batch)
        for t in (1, 2, 3, 5, max_seq):
            delta = KVLayout.for_delta(sp, t, batch)
            plan = binding_plan(sp, kv_mode, max_seq, t, batch, argmax=True)
            arena = [b for b in plan if b.buffer in ("cache", "delta")]
            assert len(arena) == 4 * sp.num_layers  # past_* and present_* (scatter) or new_* (delta)
            for b in arena:
                assert b.offset % 256 == 0, (b.name, b.offset)
                layout = cache if b.buffer == "cache" else delta
                nbytes = int(np.prod(b.shape)) * layout.itemsize
                assert nbytes == layout.tensor_bytes and b.offset + nbytes <= layout.total_bytes
            for layout in (cache, delta):  # padded strides, no overlap, allocation holds every tensor
                assert layout.tensor_stride % 256 == 0 and layout.total_bytes % 256 == 0
                assert 0 <= layout.tensor_stride - layout.tensor_bytes < 256
                assert layout.total_elems * layout.itemsize == layout.total_bytes
            # a delta arena allocated for the profile's t_max holds the layout of any smaller T
            assert delta.total_bytes <= KVLayout.for_delta(sp, max_seq, batch).total_bytes


def test_padding_where_expected():
    d = KVLayout.for_delta(_spec(2, 3, 64), 1)
    assert (d.tensor_bytes, d.tensor_stride, d.dense) == (384, 512, False)
    assert [d.offset(k, i) for k in (0, 1) for i in (0, 1)] == [0, 512, 1024, 1536]
    assert KVLayout.for_cache(_spec(2, 3, 64), 32).dense  # 3 * 32 * 64 * 2 = 12288 = 48 * 256
    c = KVLayout.for_cache(_spec(2, 3, 64), 33)
    assert (c.tensor_bytes, c.tensor_stride) == (12672, 12800) and not c.dense


@pytest.mark.parametrize(
    "sp,max_seq,batch,t,pos,n_copies",
    [
        (_spec(2, 3, 64), 32, 1, 1, 0, 4),  # padded delta (384 -> 512), dense cache
        (_spec(2, 3, 64), 32, 1, 5, 7, 4),  # padded delta (1920 -> 2048)
        (_spec(2, 3, 64), 32, 2, 5, 27, 1),  # batch 2: 2 * 3 * 5 * 64 * 2 = 3840 = 15 * 256, dense
        (_spec(2, 3, 40), 32, 2, 5, 27, 4),  # batch 2, last slots, 2400-byte delta tensors
        (_spec(2, 3, 64), 33, 1, 1, 32, 4),  # padded cache too
        (_spec(2, 4, 64), 32, 1, 1, 3, 1),  # unpadded: 512-byte delta tensors, 16 KiB cache tensors
        (_spec(2, 4, 64), 32, 2, 5, 9, 1),
        (spec(), S, 2, 8, 3, 1),  # toy spec: 2 * 2 * 8 * 4 * 2 = 256-byte delta tensors, dense
        (spec(), S, 1, 5, 7, 2 * L),  # 80-byte delta tensors, padded
        (spec(), S, 2, 3, S - 3, 2 * L),
        (_spec(3, 1, 8, "float32"), 7, 1, 2, 5, 6),  # both arenas padded (224-byte cache tensors)
    ],
)
def test_delta_copies_write_the_same_cache_as_a_direct_numpy_write(sp, max_seq, batch, t, pos, n_copies):
    """Simulate the 2-D copies on byte arrays (delta arena -> cache arena at `position`) and compare
    with writing the new entries straight into an unpadded numpy cache; padding stays untouched."""
    cache = KVLayout.for_cache(sp, max_seq, batch)
    delta = KVLayout.for_delta(sp, t, batch)
    dt = {"float16": np.float16, "float32": np.float32}[sp.kv_dtype]
    rng = np.random.default_rng(t * 100 + pos)
    old = rng.standard_normal((cache.num_tensors,) + cache.tensor_shape).astype(dt)
    new = rng.standard_normal((delta.num_tensors,) + delta.tensor_shape).astype(dt)
    want = old.copy()
    want[:, :, :, pos : pos + t] = new  # the reference: unpadded, direct write

    # the arenas as the backends allocate them, padding filled with a sentinel (0xAB) to catch strays
    dst = np.full(cache.total_bytes, 0xAB, np.uint8)
    src = np.full(delta.total_bytes, 0xAB, np.uint8)
    cache.tensors(dst.view(dt))[...] = old
    delta.tensors(src.view(dt))[...] = new
    for layout, buf, tensors in ((cache, dst, old), (delta, src, new)):  # offset() agrees with tensors()
        for j in range(layout.num_tensors):
            kind, layer = divmod(j, sp.num_layers)
            o = layout.offset(kind, layer)
            np.testing.assert_array_equal(
                buf[o : o + layout.tensor_bytes].view(dt).reshape(layout.tensor_shape), tensors[j]
            )

    copies = delta_copy(cache, t, pos)
    assert len(copies) == n_copies == (1 if cache.dense and delta.dense else 2 * sp.num_layers)
    rows = sum(c.height for c in copies)
    assert rows == 2 * sp.num_layers * batch * sp.num_kv_heads
    assert all(
        c.width == t * sp.head_dim * cache.itemsize and c.dpitch == max_seq * sp.head_dim * cache.itemsize
        for c in copies
    )
    _simulate(copies, dst, src)
    np.testing.assert_array_equal(cache.tensors(dst.view(dt)), want)
    _assert_padding_is(cache, dst, 0xAB)


@pytest.mark.parametrize(
    "sp,max_seq,batch,start,end",
    [
        (_spec(2, 3, 64), 32, 1, 0, 17),  # dense cache: one copy
        (_spec(2, 3, 64), 33, 1, 5, 33),  # padded cache: one copy per tensor, up to the last slot
        (_spec(3, 1, 8, "float32"), 7, 2, 2, 3),  # padded, batch 2, one slot
        (spec(), S, 2, 3, 20),
    ],
)
def test_slot_copies_copy_the_same_slots_as_numpy(sp, max_seq, batch, start, end):
    """A self-draft taking the target's K/V: slots [start, end) of every row copied between two
    arenas of one layout, nothing else touched (padding included)."""
    cache = KVLayout.for_cache(sp, max_seq, batch)
    dt = {"float16": np.float16, "float32": np.float32}[sp.kv_dtype]
    rng = np.random.default_rng(start * 10 + end)
    a = rng.standard_normal((cache.num_tensors,) + cache.tensor_shape).astype(dt)
    b = rng.standard_normal((cache.num_tensors,) + cache.tensor_shape).astype(dt)
    want = b.copy()
    want[:, :, :, start:end] = a[:, :, :, start:end]
    src = np.full(cache.total_bytes, 0xAB, np.uint8)
    dst = np.full(cache.total_bytes, 0xCD, np.uint8)
    cache.tensors(src.view(dt))[...] = a
    cache.tensors(dst.view(dt))[...] = b
    copies = slot_copy(cache, start, end)
    assert len(copies) == (1 if cache.dense else 2 * sp.num_layers)
    _simulate(copies, dst, src)
    np.testing.assert_array_equal(cache.tensors(dst.view(dt)), want)
    _assert_padding_is(cache, dst, 0xCD)
    assert slot_copy(cache, 4, 4) == []
    with pytest.raises(ValueError, match=r"slots \[3, 99\) are not inside a cache of"):
        slot_copy(cache, 3, 99)


def test_delta_copy_refuses_overflow_and_empty_calls():
    with pytest.raises(ValueError, match="overflows"):
        delta_copy(KVLayout.for_cache(spec(), S), 4, S - 3)
    with pytest.raises(ValueError, match="T must be >= 1"):
        delta_copy(KVLayout.for_cache(spec(), S), 0, 0)


def test_check_graph_names():
    ins, outs = [t.name for t in graph_io(spec(), "scatter", S)[0]], [t.name for t in graph_io(spec(), "scatter", S)[1]]
    check_graph_names("target", ins, outs, ins, outs + ["argmax", "hidden_states"])
    with pytest.raises(
        ValueError, match=r"target graph does not follow.*missing input\(s\) 'past_key.2'.*missing output"
    ):
        check_graph_names("target", ins, outs, [n for n in ins if n != "past_key.2"], outs[:-1])
    with pytest.raises(ValueError, match="unexpected input"):
        check_graph_names("draft", ins, outs, ins + ["attention_mask"], outs)


def test_graph_ids_per_size():
    assert [graph_id_for([1, 5], t) for t in (1, 5, 3, 64)] == [1, 2, -1, -1]


# ----------------------------------------------------------------------------- plan.json


def info(**kw) -> PlanInfo:
    base = dict(
        role="target",
        plan_file="target.plan",
        plan_sha256=hashlib.sha256(b"PLAN").hexdigest(),
        plan_bytes=4,
        tensorrt_version="10.15.1.29",
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        kv_mode="scatter",
        max_seq=S,
        batch=1,
        precision="fp16",
        profiles=build_profiles(4, 64),
        onnx_path="target/model.onnx",
        onnx_sha256="ab" * 32,
        build_options={"requested": {}},
        extra_outputs=["argmax"],
    )
    base.update(kw)
    return PlanInfo(**base)


def test_plan_info_round_trip_and_tag():
    i = info()
    j = json.loads(json.dumps(i.to_json()))
    assert j["device_tag"] == "nvidia-h200-sm90"
    back = parse_plan_info(j)
    assert back.to_json() == i.to_json()
    assert device_tag("Orin", (8, 7)) == "orin-sm87"
    assert device_tag("NVIDIA Thor", "11.0") == "nvidia-thor-sm110"


def test_refusal_message_for_another_gpu_and_tensorrt():
    with pytest.raises(EngineError) as e:
        check_compatible(info(), "Orin", "8.7", "10.3.0.30", "bundles/default")
    assert str(e.value) == (
        "engine built for NVIDIA H200 sm_90 with TensorRT 10.15; this device is Orin sm_87 with TensorRT 10.3 "
        "— rebuild with `specedge build-engines bundles/default`"
    )
    assert isinstance(e.value, BackendError)


def test_refusal_cases_and_acceptance():
    check_compatible(info(), "NVIDIA H200", "9.0", "10.15.1.30")  # another build number: same plan format
    with pytest.raises(EngineError, match="TensorRT 10.15.1; this device is NVIDIA H200 sm_90 with TensorRT 10.15.2"):
        check_compatible(info(), "NVIDIA H200", (9, 0), "10.15.2")
    with pytest.raises(EngineError, match="this device is NVIDIA H100 80GB HBM3 sm_90"):
        check_compatible(info(), "NVIDIA H100 80GB HBM3", "9.0", "10.15.1")  # same SM, another GPU
    assert parse_version("10.15.1.post1") == (10, 15, 1) and parse_version("10.3.0.30") == (10, 3, 0, 30)
    assert same_trt_version("10.3", "10.3.0.26") and not same_trt_version("10.3.0", "10.3.1")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda j: j.update(schema_version=2), "schema version 2"),
        (lambda j: j.pop("plan_sha256"), "lacks 'plan_sha256'"),
        (lambda j: j.update(plan_sha256="xyz"), "malformed plan_sha256"),
        (lambda j: j.update(plan_file="../x.plan"), "outside its folder"),
        (lambda j: j.update(profiles=[]), "no optimization profile"),
        (lambda j: j.update(profiles=[{"name": "a"}]), "malformed"),
        (lambda j: j.update(max_seq="32"), "malformed 'max_seq'"),
        (lambda j: j.update(tensorrt_version="ten"), "malformed"),
    ],
)
def test_plan_json_validation(mutate, match):
    j = info().to_json()
    mutate(j)
    with pytest.raises(EngineError, match=match):
        parse_plan_info(j)


def test_plan_bytes_and_manifest_checks(tmp_path):
    i = info()
    verify_plan_bytes(i, b"PLAN", "target.plan")
    with pytest.raises(EngineError, match="does not match its plan.json checksum"):
        verify_plan_bytes(i, b"PLAn", "target.plan")
    m = types.SimpleNamespace(kv_mode="scatter", max_seq=S, batch=1, files={"target/model.onnx": {"sha256": "ab" * 32}})
    sp = types.SimpleNamespace(role="target")
    check_against_manifest(i, m, sp, "target/model.onnx")
    with pytest.raises(EngineError, match="built for kv mode scatter, max_seq 32.*delta"):
        check_against_manifest(i, types.SimpleNamespace(**{**vars(m), "kv_mode": "delta"}), sp, "target/model.onnx")
    with pytest.raises(EngineError, match="another target/model.onnx"):
        check_against_manifest(
            i,
            types.SimpleNamespace(**{**vars(m), "files": {"target/model.onnx": {"sha256": "cd" * 32}}}),
            sp,
            "target/model.onnx",
        )
    with pytest.raises(EngineError, match="describes the target model"):
        check_against_manifest(i, m, types.SimpleNamespace(role="draft"), "target/model.onnx")
    with pytest.raises(EngineError, match="missing"):
        load_plan_info(tmp_path / "nope.plan.json")


def test_no_engine_message_points_at_what_exists(tmp_path):
    assert "has no TensorRT engine for this device (Orin sm_87 with TensorRT 10.3)" in no_engine_message(
        tmp_path, "target", "Orin", "8.7", "10.3.0"
    )
    d = tmp_path / "engines" / "nvidia-h200-sm90"
    d.mkdir(parents=True)
    (d / "target.plan.json").write_text(json.dumps(info().to_json()))
    assert no_engine_message(tmp_path, "target", "Orin", "8.7", "10.3.0").startswith(
        "engine built for NVIDIA H200 sm_90 with TensorRT 10.15; this device is Orin sm_87"
    )


# ----------------------------------------------------------------------------- the TensorRT version gate


def test_scatter_needs_tensorrt_10_15():
    check_kv_mode_supported("scatter", "10.15.1.29")
    check_kv_mode_supported("scatter", "11.0.0")
    check_kv_mode_supported("delta", "10.3.0.30")
    for old in ("10.3.0.30", "10.14.1"):
        with pytest.raises(UserError) as e:
            check_kv_mode_supported("scatter", old)
        msg = str(e.value)
        assert "from 10.15" in msg and f"TensorRT {old[:5].rstrip('.')}" in msg
        assert "`export-models --kv-update delta`" in msg
    with pytest.raises(UserError, match="needs TensorRT 10"):
        check_kv_mode_supported("delta", "8.6.1")


def test_typing_mode():
    assert typing_mode("fp16", None, True) == (True, [])
    assert typing_mode("int4", None, True) == (True, [])
    assert typing_mode("fp16", None, False) == (False, ["FP16"])
    assert typing_mode("bf16", None, False) == (False, ["BF16"])
    assert typing_mode("fp32", None, True) == (False, [])
    assert typing_mode("fp32", "fp16", True) == (False, ["FP16"])
    assert typing_mode("fp16", "bf16", True) == (False, ["BF16"])


# ----------------------------------------------------------------------------- the build flow with a fake tensorrt


class _T:
    def __init__(self, name, shape):
        self.name, self.shape = name, tuple(shape)


def _trt_table_ops(version: str) -> set[str]:
    """The ONNX operators tensorrt_ops.json lists for the newest table line at or below `version`,
    read here independently of tensorrt_support.py."""
    table = json.loads((Path(specedge.__file__).parent / "tensorrt_ops.json").read_text())
    key = lambda v: tuple(int(x) for x in v.split(".")[:2])  # noqa: E731
    have = key(version)
    ops: set[str] = set()
    for since, names in table["ops_added_in"].items():
        if key(since) <= have:
            ops.update(names)
    return ops


class FakeTRT(types.ModuleType):
    """Just enough of the tensorrt module for builder.build_engines; records what it was asked.

    Its parser reads the graph (not its weights) and, like TensorRT's, fails on the first node whose
    operator the ONNX parser of the version it reports does not import (the table in
    tensorrt_ops.json); it only warns about the opset, as TensorRT's does."""

    def __init__(self, version, manifest_spec, kv_mode, max_seq):
        super().__init__("tensorrt")
        self.__version__ = version
        fake = self
        self.calls = {
            "builds": 0,
            "parsed": [],
            "shapes": [],
            "flags": [],
            "net_flags": [],
            "workspace": [],
            "cache_in": [],
        }
        self.Logger = type("Logger", (), {"WARNING": 2, "ERROR": 1, "__init__": lambda s, lvl: None})
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)
        self.BuilderFlag = types.SimpleNamespace(FP16="FP16", BF16="BF16")
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
        self.TopKOperation = types.SimpleNamespace(MAX="MAX")
        self.int64 = "int64"

        class IProgressMonitor:
            def __init__(self):
                pass

        self.IProgressMonitor = IProgressMonitor
        ins, outs = graph_io(manifest_spec, kv_mode, max_seq)

        class Layer:
            def __init__(self, *outputs):
                self.outputs = outputs

            def get_output(self, i):
                return self.outputs[i]

        class Network:
            def __init__(self):
                self.inputs, self.outputs = [], []

            num_inputs = property(lambda s: len(s.inputs))
            num_outputs = property(lambda s: len(s.outputs))
            get_input = lambda s, i: s.inputs[i]  # noqa: E731
            get_output = lambda s, i: s.outputs[i]  # noqa: E731

            def add_topk(self, t, op, k, axes):
                assert op == "MAX" and k == 1 and axes == 1 << 2
                return Layer(_T("values", t.shape[:-1] + (1,)), _T("indices", t.shape[:-1] + (1,)))

            def add_cast(self, t, to):
                return Layer(_T("cast", t.shape))

            def mark_output(self, t):
                self.outputs.append(t)

        known_ops = _trt_table_ops(version)

        class Parser:
            def __init__(self, network, logger):
                self.network = network
                self.errors = []

            num_errors = property(lambda s: len(s.errors))
            get_error = lambda s, i: s.errors[i]  # noqa: E731

            def parse_from_file(self, path):
                import onnx

                assert path.endswith(".onnx")  # model.onnx, or model.portable.onnx beside an ort flavour
                fake.calls["parsed"].append(path)
                graph = onnx.load(path, load_external_data=False).graph
                for i, n in enumerate(graph.node):
                    if n.domain not in ("", "ai.onnx") or n.op_type not in known_ops:
                        self.errors.append(
                            f"In node {i} with name: {n.name} and operator: {n.op_type} "
                            '(checkFallbackPluginImporter): INVALID_NODE: creator && "Plugin not '
                            'found, are the plugin name, version, and namespace correct?"'
                        )
                        return False
                self.network.inputs = [_T(t.name, [-1 if d == "T" else d for d in t.shape]) for t in ins]
                self.network.outputs = [_T(t.name, [-1 if d == "T" else d for d in t.shape]) for t in outs]
                return True

        class Cache:
            def __init__(self, data):
                self.data = data

            def serialize(self):
                return self.data + b"+"

        class Profile:
            def set_shape(self, name, lo, opt, hi):
                fake.calls["shapes"].append((name, lo, opt, hi))

        class Config:
            def __init__(self):
                self.progress_monitor = None
                self.builder_optimization_level = 3

            def set_memory_pool_limit(self, pool, n):
                fake.calls["workspace"].append((pool, n))

            def set_flag(self, f):
                fake.calls["flags"].append(f)

            def create_timing_cache(self, data):
                fake.calls["cache_in"].append(bytes(data))
                self.cache = Cache(bytes(data))
                return self.cache

            def set_timing_cache(self, cache, ignore_mismatch):
                assert ignore_mismatch is False

            def get_timing_cache(self):
                return self.cache

            def add_optimization_profile(self, p):
                pass

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                fake.calls["net_flags"].append(flags)
                return Network()

            create_builder_config = lambda s: Config()  # noqa: E731
            create_optimization_profile = lambda s: Profile()  # noqa: E731

            def build_serialized_network(self, network, config):
                fake.calls["builds"] += 1
                assert isinstance(config.progress_monitor, IProgressMonitor)
                assert network.outputs[-1].name == "argmax"
                return b"PLAN-" + str(fake.calls["builds"]).encode()

        self.Builder, self.OnnxParser = Builder, Parser


def _onnx_bytes(weights_at: str | None = None, opset: int = 24) -> bytes:
    """A graph file the bundle check can read (the fake parser ignores its content); with
    `weights_at`, one initializer whose external data lies there."""
    from onnx import TensorProto, helper

    inits = []
    if weights_at is not None:
        t = helper.make_tensor("w", TensorProto.FLOAT, [1], [0.0])
        t.ClearField("float_data")
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", weights_at), ("offset", "0"), ("length", "4")):
            t.external_data.add(key=key, value=value)
        inits.append(t)
    graph = helper.make_graph([], "g", [], [], initializer=inits)
    # IR 10, as export-models writes (onnx's newest IR is past what TensorRT's parsers were built with)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10).SerializeToString()


def _bundle(
    tmp_path,
    kv_mode="scatter",
    precision="fp16",
    weights_at=None,
    opset=24,
    flavour="portable",
    backends=("tensorrt",),
    exported_for=None,
):
    d = tmp_path / "bundle"
    (d / "target").mkdir(parents=True)
    data = _onnx_bytes(weights_at, opset)
    (d / "target" / "model.onnx").write_bytes(data)
    ins, outs = graph_io(spec(), kv_mode, S)
    m = {
        "schema_version": 1,
        "created_by": "test",
        "max_seq": S,
        "batch": 1,
        "kv_mode": kv_mode,
        "spec": {"k": 4, "prefill_chunk": 16},
        "tokenizer": {"vocab_size": V, "eos_token_ids": [0], "bos_token_id": None, "add_bos": False, "files": []},
        "models": {
            "target": {
                "kind": "model",
                "family": "toy",
                "source": "",
                "precision": precision,
                "kv_dtype": "float16",
                "num_layers": L,
                "num_kv_heads": KVH,
                "head_dim": HD,
                "hidden_size": 8,
                "vocab_size": V,
                "graphs": [{"flavour": flavour, "path": "target/model.onnx", "backends": list(backends)}],
                "inputs": [t.to_json() for t in ins],
                "outputs": [t.to_json() for t in outs],
            },
            "draft": {"kind": "ngram"},
        },
        "files": {"target/model.onnx": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}},
    }
    if exported_for is not None:
        m["tensorrt"] = exported_for
    (d / "manifest.json").write_text(json.dumps(m))
    return d


@pytest.fixture
def fake_trt(monkeypatch):
    def install(version="10.15.1.29", kv_mode="scatter", manifest=None):
        if manifest is None:
            fake = FakeTRT(version, spec(), kv_mode, S)
        else:  # a real bundle: the network has that bundle's target I/O
            fake = FakeTRT(version, manifest.target, manifest.kv_mode, manifest.max_seq)
        monkeypatch.setitem(sys.modules, "tensorrt", fake)
        monkeypatch.setattr("specedge.engines.builder.current_gpu", lambda device_id=0: ("NVIDIA H200", "9.0"))
        return fake

    return install


def test_build_engines_writes_plan_and_plan_json_atomically(tmp_path, fake_trt):
    fake = fake_trt()
    b = _bundle(tmp_path)
    logs = []
    infos = build_engines(b, BuildOptions(workspace_gb=1.5), log=logs.append)
    out = b / "engines" / "nvidia-h200-sm90"
    assert sorted(p.name for p in out.iterdir()) == ["target.plan", "target.plan.json", "timing.cache"]
    assert [p.name for p in (b / "engines").iterdir()] == ["nvidia-h200-sm90"]  # no temporary folder left
    assert (out / "target.plan").read_bytes() == b"PLAN-1"
    i = load_plan_info(out / "target.plan.json")
    assert i.to_json() == infos[0].to_json()
    assert (i.gpu_name, i.compute_capability, i.tensorrt_version, i.kv_mode) == (
        "NVIDIA H200",
        "9.0",
        "10.15.1.29",
        "scatter",
    )
    assert [p.to_json() for p in i.profiles] == [p.to_json() for p in build_profiles(4, 16)]
    assert i.extra_outputs == ["argmax"] and i.build_options["strongly_typed"] is True
    assert i.onnx_sha256 == json.loads((b / "manifest.json").read_text())["files"]["target/model.onnx"]["sha256"]
    verify_plan_bytes(i, b"PLAN-1", "target.plan")
    assert fake.calls["shapes"] == [
        ("input_ids", (1, 1), (1, 1), (1, 1)),
        ("input_ids", (1, 5), (1, 5), (1, 5)),
        ("input_ids", (1, 1), (1, 16), (1, 16)),
    ]
    assert fake.calls["net_flags"] == [1 << 5] and fake.calls["flags"] == []
    assert fake.calls["workspace"] == [("WORKSPACE", int(1.5 * (1 << 30)))]
    assert (out / "timing.cache").read_bytes() == b"+"
    assert any("parsing target/model.onnx" in s for s in logs)

    # Up to date: nothing rebuilt. Other options or --force: rebuilt, reusing the timing cache.
    build_engines(b, BuildOptions(workspace_gb=1.5), log=logs.append)
    assert fake.calls["builds"] == 1 and "up to date" in logs[-1]
    build_engines(b, BuildOptions(workspace_gb=1.5, force=True), log=logs.append)
    assert fake.calls["builds"] == 2 and fake.calls["cache_in"][-1] == b"+"
    build_engines(b, BuildOptions(precision="fp16"), log=logs.append)
    assert fake.calls["builds"] == 3 and fake.calls["flags"] == ["FP16"] and fake.calls["net_flags"][-1] == 0
    assert (out / "target.plan").read_bytes() == b"PLAN-3"


def test_build_engines_refuses_scatter_on_tensorrt_10_3(tmp_path, fake_trt, capsys):
    fake_trt(version="10.3.0.30")
    b = _bundle(tmp_path)
    assert main(["build-engines", str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this bundle updates the KV cache in place") and "--kv-update delta" in err
    assert not (b / "engines").exists()


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_build_engines_refuses_matmulnbits_graphs(tmp_path, fake_trt, capsys, precision):
    fake = fake_trt()
    b = _bundle(tmp_path, precision=precision)
    assert main(["build-engines", str(b)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: the target is {precision} (ONNX Runtime's MatMulNBits)") and "--precision fp16" in err
    )
    assert fake.calls["builds"] == 0 and not (b / "engines").exists()


@pytest.mark.parametrize("location", ["/etc/passwd", "../../secret.bin", "model.onnx.data"])
def test_build_engines_refuses_graph_weights_the_manifest_does_not_hold(tmp_path, fake_trt, capsys, location):
    # TensorRT's parser would open these files itself: absolute, escaping, or simply not listed
    fake = fake_trt()
    b = _bundle(tmp_path, weights_at=location)
    assert main(["build-engines", str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the target graph 'target/model.onnx'") and err.count("\n") == 1
    assert fake.calls["builds"] == 0 and not (b / "engines").exists()


def test_build_engines_delta_bundle_on_tensorrt_10_3(tmp_path, fake_trt):
    fake = fake_trt(version="10.3.0.30", kv_mode="delta")
    b = _bundle(tmp_path, "delta", opset=20)  # TensorRT 10.3 documents opsets 9..20
    build_engines(b, BuildOptions(), log=lambda s: None)
    assert fake.calls["builds"] == 1
    assert load_plan_info(b / "engines" / "nvidia-h200-sm90" / "target.plan.json").kv_mode == "delta"


def test_build_engines_cli_names_tensorrt_when_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    b = _bundle(tmp_path)
    assert main(["build-engines", str(b), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "needs the tensorrt package: pip install 'specedge[tensorrt]'" in err and "python3-libnvinfer" in err


def test_build_engines_rejects_bad_options(tmp_path, fake_trt):
    fake_trt()
    b = _bundle(tmp_path)
    with pytest.raises(UserError, match="--workspace-gb must be positive"):
        build_engines(b, BuildOptions(workspace_gb=0))
    with pytest.raises(UserError, match="nothing to build"):
        build_engines(b, BuildOptions(roles=("draft",)))
    with pytest.raises(UserError, match="--opt-level"):
        build_engines(b, BuildOptions(optimization_level=7))


def test_loaded_manifest_plan_checks_work_with_real_manifest(tmp_path):
    b = _bundle(tmp_path)
    m = load_manifest(b)
    sha = m.files["target/model.onnx"]["sha256"]
    check_against_manifest(info(onnx_sha256=sha, max_seq=S), m, m.target, "target/model.onnx")


# ----------------------------------------------------------------------------- the TensorRT table in the build


def _tiny_copy(tiny_bundle_factory, tmp_path, kv_mode):
    """A copy (build-engines writes into it) of a tiny fp32 bundle with a portable target graph, as
    today's export writes it (opset 24, RMSNormalization; TensorScatter in scatter mode)."""
    import shutil

    kw = {"graphs": "portable"} if kv_mode == "scatter" else {}
    src = tiny_bundle_factory("llama", kv_mode=kv_mode, draft="ngram", features=True, **kw)
    return Path(shutil.copytree(src, tmp_path / f"fp32-{kv_mode}"))


def _stand_in_parse(fake, onnx_path):
    parser = fake.OnnxParser(fake.Builder(None).create_network(0), None)
    return parser.parse_from_file(str(onnx_path)), [parser.get_error(i) for i in range(parser.num_errors)]


def test_fp32_scatter_bundle_fails_on_the_10_3_stand_in_and_builds_on_10_16(
    tiny_bundle_factory, tmp_path, fake_trt, capsys
):
    b = _tiny_copy(tiny_bundle_factory, tmp_path, "scatter")
    m = load_manifest(b)
    graph = m.path(m.target.graph_for("tensorrt").path)

    # The stand-in's parser itself refuses what TensorRT 10.3's parser does not import ...
    fake = fake_trt("10.3.0.30", manifest=m)
    ok, errors = _stand_in_parse(fake, graph)
    assert not ok and len(errors) == 1
    assert "operator: RMSNormalization" in errors[0] or "operator: TensorScatter" in errors[0]
    # ... and build-engines stops before it, with the sentence naming the export flag.
    capsys.readouterr()  # the export's progress
    assert main(["build-engines", str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this bundle updates the KV cache in place") and err.count("\n") == 1
    assert not (b / "engines").exists()

    fake = fake_trt("10.16.0.31", manifest=m)
    assert _stand_in_parse(fake, graph) == (True, [])
    infos = build_engines(b, BuildOptions(), log=lambda s: None)
    assert fake.calls["builds"] == 1 and [i.role for i in infos] == ["target"]
    assert fake.calls["parsed"] == [str(graph)] * 2  # the direct parse above, then the build's


def test_fp32_delta_bundle_is_refused_on_10_3_with_the_table_sentence(tiny_bundle_factory, tmp_path, fake_trt, capsys):
    b = _tiny_copy(tiny_bundle_factory, tmp_path, "delta")
    m = load_manifest(b)
    fake = fake_trt("10.3.0.30", manifest=m)
    graph = str(m.path(m.target.graph_for("tensorrt").path))
    ok, errors = _stand_in_parse(fake, graph)
    assert not ok and "operator: RMSNormalization" in errors[0]
    capsys.readouterr()  # the export's progress
    assert main(["build-engines", str(b)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: TensorRT 10.3's ONNX parser cannot import this bundle (target/model.onnx uses opset 24 (from 10.15), "
        "RMSNormalization (from 10.15)): export the bundle with `export-models --tensorrt 10.3`\n"
    )
    assert fake.calls["parsed"] == [graph] and not (b / "engines").exists()  # only the direct parse above
    # JetPack 7.0 / 7.1 (TensorRT 10.13 / 10.14) do not import RMSNormalization either.
    for version in ("10.13.3.9", "10.14.1.48"):
        fake_trt(version, manifest=m)
        assert main(["build-engines", str(b)]) == 2
        assert "RMSNormalization (from 10.15)" in capsys.readouterr().err
    fake = fake_trt("10.15.1.29", manifest=m)
    build_engines(b, BuildOptions(), log=lambda s: None)
    assert fake.calls["builds"] == 1


def test_build_engines_refuses_a_bundle_exported_for_a_newer_tensorrt(tmp_path, fake_trt, capsys):
    fake = fake_trt(version="10.3.0.30", kv_mode="delta")
    b = _bundle(tmp_path, "delta", opset=20, exported_for="10.16")
    assert main(["build-engines", str(b)]) == 2
    assert capsys.readouterr().err == (
        "error: this bundle was exported for TensorRT 10.16 and this machine has TensorRT 10.3: "
        "export it again with `export-models --tensorrt 10.3`\n"
    )
    assert fake.calls["parsed"] == [] and not (b / "engines").exists()


def test_build_engines_takes_a_bundle_exported_for_its_tensorrt_or_an_older_one(tmp_path, fake_trt):
    for i, (exported_for, installed) in enumerate((("10.3", "10.3.0.30"), ("10.3", "10.16.0.31"))):
        fake = fake_trt(version=installed, kv_mode="delta")
        b = _bundle(tmp_path / str(i), "delta", opset=20, exported_for=exported_for)
        build_engines(b, BuildOptions(), log=lambda s: None)
        assert fake.calls["builds"] == 1


def test_build_engines_refuses_a_bundle_without_a_graph_for_tensorrt(tmp_path, fake_trt, capsys):
    fake = fake_trt()
    b = _bundle(tmp_path, flavour="ort", backends=("ort-cpu", "ort-cuda"))
    assert main(["build-engines", str(b)]) == 2
    assert capsys.readouterr().err == (
        "error: this bundle offers TensorRT no graph (its graphs are for ONNX Runtime only): "
        "export it with `export-models --tensorrt 10.15`\n"
    )
    assert fake.calls["parsed"] == []


def test_build_engines_refuses_tensorrt_older_than_the_table(tmp_path, fake_trt, capsys):
    fake_trt(version="10.1.0.27", kv_mode="delta")
    b = _bundle(tmp_path, "delta", opset=20)
    assert main(["build-engines", str(b)]) == 2
    assert capsys.readouterr().err == (
        "error: TensorRT 10.1.0.27 is older than 10.3, the oldest TensorRT specedge supports: "
        "install one of 10.3, 10.13, 10.14, 10.15, 10.16, 11.0, 11.1 (or newer)\n"
    )
