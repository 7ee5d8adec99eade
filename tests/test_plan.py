"""The memory planner's arithmetic against hand-computed figures, and the `specedge plan` command.

The manifest is the default bundle's shape (SmolLM2-135M: llama, 30 layers, 3 kv heads, head_dim 64,
hidden 576 -> 9 query heads, vocab 49152) with an fp16 target and an int4 self-draft (whose KV stays
fp32, as KV_DTYPE says for weight-only int4), max_seq 2048, k = 4, prefill chunk 64. The weight
bytes are those of the exported default bundle (bundles/smollm2-135m-instruct: fp32 target
538,551,992 bytes, halved for fp16; int4 draft 84,682,424 bytes).
"""

import json

import pytest

from specedge.cli.main import main
from specedge.contract import graph_io
from specedge.manifest import ModelSpec, parse_manifest
from specedge.plan import (
    DEVICES,
    WORKSPACE_BYTES,
    DeviceProfile,
    GiB,
    MiB,
    custom_device,
    largest_max_seq,
    model_memory,
    num_query_heads,
    plan_memory,
    weight_bytes,
    with_reserve,
)

TARGET_WEIGHTS = 538_551_992 // 2  # the default bundle's fp32 weight_bytes (538,551,992), at fp16
DRAFT_WEIGHTS = 84_682_424  # the default bundle's int4 self-draft (weight_bytes as exported)


def _model(precision, kv_dtype, weight_bytes, layers=30, kvh=3, hd=64, hidden=576, vocab=49152):
    spec = ModelSpec(role="x", kind="model", num_layers=layers, num_kv_heads=kvh, head_dim=hd, vocab_size=vocab)
    ins, outs = graph_io(spec, "scatter", 2048)
    return {
        "kind": "model",
        "family": "llama",
        "source": "default",
        "precision": precision,
        "kv_dtype": kv_dtype,
        "num_layers": layers,
        "num_kv_heads": kvh,
        "head_dim": hd,
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_params": 134_515_008,
        "weight_bytes": weight_bytes,
        "graphs": [{"flavour": "portable", "path": f"{precision}/model.onnx", "backends": ["tensorrt"]}],
        "inputs": [t.to_json() for t in ins],
        "outputs": [t.to_json() for t in outs],
    }


def default_like(max_seq=2048, kv_mode="scatter", draft=True, k=4, chunk=64):
    return {
        "schema_version": 1,
        "created_by": "test",
        "max_seq": max_seq,
        "batch": 1,
        "kv_mode": kv_mode,
        "spec": {"k": k, "prefill_chunk": chunk},
        "tokenizer": {"vocab_size": 49152, "eos_token_ids": [2], "bos_token_id": None, "add_bos": False, "files": []},
        "models": {
            "target": _model("fp16", "float16", TARGET_WEIGHTS),
            "draft": _model("int4", "float32", DRAFT_WEIGHTS) if draft else {"kind": "ngram"},
        },
        "files": {
            "fp16/model.onnx": {"sha256": "0" * 64, "bytes": 1},
            "int4/model.onnx": {"sha256": "0" * 64, "bytes": 1},
        },
    }


# Hand-computed, default-like bundle (scatter mode):
#   target KV   = 2*30*1*3*2048*64*2 bytes              =  47,185,920
#   logits      = 1*(1 + 5 + 64)*49152*4                =  13,762,560   (per model)
#   attention   = 2*1*9 heads*64*2048*4                 =   9,437,184   (per model)
#   hidden      = 16*1*64*576*4                         =   2,359,296   (per model)
#   draft KV    = 2*30*1*3*2048*64*4 (fp32)             =  94,371,840
T_KV, D_KV = 47_185_920, 94_371_840
LOGITS, ATTN, HIDDEN = 13_762_560, 9_437_184, 2_359_296
T_TOTAL = TARGET_WEIGHTS + T_KV + LOGITS + ATTN + HIDDEN  # 342,020,956
D_TOTAL = DRAFT_WEIGHTS + D_KV + LOGITS + ATTN + HIDDEN  # 204,613,304
NEEDED = T_TOTAL + D_TOTAL + 256 * 1024 * 1024  # 815,069,716
SLOPE = (2 * 30 * 3 * 64 * 2 + 2 * 9 * 64 * 4) + (2 * 30 * 3 * 64 * 4 + 2 * 9 * 64 * 4)  # 78,336 bytes per token
BASE = NEEDED - SLOPE * 2048  # 654,637,588


def test_hand_computed_constants_are_what_the_comments_say():
    assert (T_TOTAL, D_TOTAL, NEEDED, SLOPE, BASE) == (342_020_956, 204_613_304, 815_069_716, 78_336, 654_637_588)


def test_model_memory_matches_hand_computation():
    m = parse_manifest(default_like())
    t = model_memory(m.target, max_seq=2048, batch=1, k=4, prefill_chunk=64, kv_mode="scatter")
    assert (t.weights, t.kv_cache, t.logits, t.attention, t.hidden, t.delta) == (
        TARGET_WEIGHTS,
        T_KV,
        LOGITS,
        ATTN,
        HIDDEN,
        0,
    )
    assert t.total == T_TOTAL
    assert t.kv_cache == m.target.kv_bytes(2048)  # the manifest's own formula
    d = model_memory(m.draft, max_seq=2048, batch=1, k=4, prefill_chunk=64, kv_mode="scatter")
    assert (d.kv_cache, d.total) == (D_KV, D_TOTAL)
    assert t.per_seq_token + d.per_seq_token == SLOPE


def test_delta_mode_adds_delta_buffers_and_wider_attention():
    m = parse_manifest(default_like(kv_mode="delta"))
    t = model_memory(m.target, max_seq=2048, batch=1, k=4, prefill_chunk=64, kv_mode="delta")
    assert t.delta == 2 * 30 * 3 * 64 * 2 * (1 + 5 + 64)  # new K/V per captured size: 3,225,600
    assert t.attention == 2 * 9 * 64 * (2048 + 64) * 4  # keys = cache + the chunk's new entries


def test_plan_on_orin_nano_fits_and_largest_max_seq_is_solved_linearly():
    m = parse_manifest(default_like())
    dev = DEVICES["orin-nano-8gb"]
    # 7.4 GiB visible, 0.9 GiB OS + 0.9 GiB CUDA context (each rounded to whole bytes)
    assert dev.memory_bytes == 7_945_689_498
    assert dev.reserve_bytes == 2 * 966_367_642
    plan = plan_memory(m, dev)
    assert plan.needed == NEEDED
    assert plan.available == 7_945_689_498 - 1_932_735_284 == 6_012_954_214
    assert plan.fits and plan.headroom == 6_012_954_214 - NEEDED
    # (6,012,954,214 - 654,637,588) // 78,336 = 68,401 -> multiple of 64: 68,352
    assert plan.largest_max_seq == 68_352
    j = plan.to_json()
    assert j["fits"] is True and j["needed_bytes"] == NEEDED and j["total_bytes"] == NEEDED + 1_932_735_284


def test_largest_max_seq_on_a_tight_device():
    m = parse_manifest(default_like())
    dev = DeviceProfile("tight", "test", 800_000_000, 0, 0, False)
    # (800,000,000 - 654,637,588) // 78,336 = 1,855 -> 1,792
    assert largest_max_seq(m, dev) == 1792
    plan = plan_memory(m, dev)
    assert not plan.fits
    assert "max_seq 1792 would fit" in plan.reason
    assert plan_memory(m, dev, max_seq=1792).fits
    assert not plan_memory(m, dev, max_seq=1792 + 64).fits


def test_nothing_fits_when_weights_alone_are_too_big():
    m = parse_manifest(default_like())
    dev = DeviceProfile("tiny", "test", 600_000_000, 0, 0, False)
    plan = plan_memory(m, dev)
    assert not plan.fits and plan.largest_max_seq == 0
    assert "not even max_seq 64 fits" in plan.reason


def test_ngram_draft_costs_nothing_on_the_device():
    m = parse_manifest(default_like(draft=False))
    plan = plan_memory(m, DEVICES["h200-141gb"])
    assert plan.models[1].total == 0
    assert plan.needed == T_TOTAL + WORKSPACE_BYTES


def test_weight_bytes_fallback_and_heads():
    spec = ModelSpec(
        role="t", kind="model", precision="int4", num_params=1000, hidden_size=640, head_dim=256, num_kv_heads=1
    )
    assert weight_bytes(spec) == 562  # 1000 * 0.5625, rounded
    assert num_query_heads(spec) == 1  # 640 % 256 != 0: falls back to kv heads
    spec.extra = {"num_attention_heads": 4}
    assert num_query_heads(spec) == 4


def test_devices_and_overrides():
    assert set(DEVICES) == {"orin-nano-8gb", "orin-nx-16gb", "agx-orin-64gb", "thor", "h100-80gb", "h200-141gb"}
    for d in DEVICES.values():
        assert 0 < d.reserve_bytes < d.memory_bytes
        if d.unified:  # Jetson: OS + CUDA context about 1.5-2.5 GB
            assert 1.5 * GiB <= d.reserve_bytes <= 2.5 * GiB
    assert DEVICES["h200-141gb"].memory_bytes == 143771 * MiB
    c = custom_device(4)
    assert c.memory_bytes == 4 * GiB and c.reserve_bytes == GiB // 2
    r = with_reserve(DEVICES["orin-nano-8gb"], 1.0)
    assert r.reserve_bytes == GiB and r.memory_bytes == DEVICES["orin-nano-8gb"].memory_bytes
    with pytest.raises(ValueError):
        custom_device(0)


# ----------------------------------------------------------------------------- the command


@pytest.fixture
def bundle(tmp_path):
    d = tmp_path / "bundle"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(default_like()))
    return d


def test_cli_plan_fits_exit_0(bundle, capsys):
    assert main(["plan", str(bundle), "--device", "orin-nano-8gb"]) == 0
    out = capsys.readouterr().out
    assert "orin-nano-8gb" in out and "fits" in out and "largest max_seq that fits: 68352 " in out


def test_cli_plan_json(bundle, capsys):
    assert main(["plan", str(bundle), "--device", "h100-80gb", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["needed_bytes"] == NEEDED and j["fits"] and j["device"]["name"] == "h100-80gb"
    assert [m["role"] for m in j["models"]] == ["target", "draft"]


def test_cli_plan_does_not_fit_exit_3(bundle, capsys):
    assert main(["plan", str(bundle), "--memory-gb", "1"]) == 3
    cap = capsys.readouterr()
    assert "does not fit" in cap.out
    assert cap.err.startswith("error: the bundle does not fit custom")


def test_cli_plan_accepts_manifest_file_and_max_seq(bundle, capsys):
    assert (
        main(["plan", str(bundle / "manifest.json"), "--memory-gb", "1", "--reserve-gb", "0", "--max-seq", "256"]) == 0
    )
    assert "max_seq 256" in capsys.readouterr().out


def test_cli_plan_bad_input_exit_2(tmp_path, capsys):
    assert main(["plan", str(tmp_path), "--device", "thor"]) == 2
    assert "not a bundle" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", str(tmp_path)])  # neither --device nor --memory-gb
    assert e.value.code == 2


def test_cli_plan_rejects_bad_numbers(bundle, capsys):
    assert main(["plan", str(bundle), "--memory-gb", "-1"]) == 2
    assert main(["plan", str(bundle), "--device", "thor", "--max-seq", "0"]) == 2
    assert main(["plan", str(bundle), "--device", "thor", "--reserve-gb", "-2"]) == 2
    assert "must be" in capsys.readouterr().err


def test_largest_max_seq_is_capped_at_the_models_positions(tmp_path, capsys):
    """Memory alone would allow 68,352 on an Orin Nano, but the model takes 8,192 positions, the
    limit export-models checks --max-seq against: the suggestion stops there and says why."""
    j = default_like()
    for role in ("target", "draft"):
        j["models"][role]["extra"] = {"max_position_embeddings": 8192}
    m = parse_manifest(j)
    plan = plan_memory(m, DEVICES["orin-nano-8gb"])
    assert plan.largest_max_seq == 8192 and plan.memory_max_seq == 68_352 and plan.position_limit == 8192
    (tmp_path / "manifest.json").write_text(json.dumps(j))
    assert main(["plan", str(tmp_path), "--device", "orin-nano-8gb"]) == 0
    out = capsys.readouterr().out
    assert (
        "  largest max_seq that fits: 8192 (the model's limit, 8192 positions; memory alone would take 68352, " in out
    )
    assert main(["plan", str(tmp_path), "--device", "orin-nano-8gb", "--json", "--max-seq", "16384"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["largest_max_seq"] == 8192 and p["position_limit"] == 8192
    assert "max_seq 16384 is above the model's 8192 positions, which export-models refuses" in p["notes"]
    # a smaller draft limit is the bundle's limit
    j["models"]["draft"]["extra"] = {"max_position_embeddings": 2048}
    assert plan_memory(parse_manifest(j), DEVICES["orin-nano-8gb"]).largest_max_seq == 2048
