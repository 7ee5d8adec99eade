"""Draft heads (issue 14): target features in the graph contract, the EagleHead family file and its
ONNX graph, `specedge train-draft`, and the head drafter in the runtime. Tiny random targets."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specedge.contract import FEATURES_OUTPUT
from specedge.manifest import BundleError, load_manifest
from specedge.models import FAMILIES, build_model
from specedge.models.common import default_feature_layers
from specedge.models.eagle_head import head_for_target
from specedge.models.testing import randomize_, tiny_config

FAMILY_LIST = sorted({n for n in FAMILIES if n != "gemma3_text"})
TRAIN = dict(
    budget="3k",
    draft_vocab=48,
    seq_len=32,
    batch=2,
    answer_tokens=16,
    max_prompts=4,
    doc_tokens=600,
    threads=1,
    checkpoint_every_s=0.0,
)


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "specedge", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def assert_user_error(p, *fragments):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def _target(family: str):
    torch.manual_seed(0)
    m = randomize_(build_model(tiny_config(family)), 0).eval()
    m.feature_layers = default_feature_layers(m.num_layers)
    return m


def _snapshot(bundle: Path) -> dict:
    return {
        str(p.relative_to(bundle)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(bundle.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def feat_bundle(tiny_bundle_factory, tmp_path_factory) -> Path:
    """A tiny llama bundle whose target returns features, copied so tests may add heads to it."""
    src = tiny_bundle_factory("llama", features=True)
    dst = tmp_path_factory.mktemp("head") / "bundle"
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def trained(feat_bundle, tmp_path_factory) -> Path:
    from specedge.training.train import TrainOptions, train_draft

    train_draft(feat_bundle, TrainOptions(**TRAIN, checkpoint=str(tmp_path_factory.mktemp("ck"))))
    return feat_bundle


@pytest.fixture(scope="module")
def trained_run(tiny_bundle_factory, tmp_path_factory) -> tuple[Path, Path]:
    """(bundle, checkpoint folder) of a train-draft run on a bundle of its own, which no other
    test retrains (its head is the checkpoint's)."""
    from specedge.training.train import TrainOptions, train_draft

    root = tmp_path_factory.mktemp("run")
    shutil.copytree(tiny_bundle_factory("llama", features=True), root / "bundle")
    train_draft(root / "bundle", TrainOptions(**TRAIN, checkpoint=str(root / "ck")))
    return root / "bundle", root / "ck"


# ----------------------------------------------------------------------------- 1. features in the contract


def _run_graph(path: Path, model, ids: np.ndarray, max_seq: int):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {"input_ids": ids[None], "position": np.zeros(1, np.int64)}
    for c, name in zip(
        model.empty_cache(max_seq), [f"past_{kv}.{i}" for i in range(model.num_layers) for kv in ("key", "value")]
    ):
        feed[name] = c.numpy()
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feed)))


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_features_output_matches_pytorch(family, tmp_path):
    from specedge.export.onnx_graph import export_graph

    model = _target(family)
    ids = np.arange(3, 12, dtype=np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None]), torch.zeros(1, dtype=torch.int64), *model.empty_cache(32))
    export_graph(model, tmp_path / "m.onnx", 32, "scatter", flavour="portable")
    out = _run_graph(tmp_path / "m.onnx", model, ids, 32)
    assert list(out)[-1] == FEATURES_OUTPUT  # appended after the caches, nothing renamed
    h = model.embed_tokens.weight.shape[1]
    assert out[FEATURES_OUTPUT].shape == (1, ids.size, 3 * h)
    np.testing.assert_allclose(out[FEATURES_OUTPUT], ref[-1].numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out["logits"], ref[0].numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
def test_bundle_features_in_every_flavour_match_the_torch_taps(tiny_bundle_factory, kv_mode):
    from specedge.runtime.backends.ort import OrtBackend

    b = tiny_bundle_factory("llama", kv_mode=kv_mode, features=True, graphs="both" if kv_mode == "scatter" else "auto")
    m = load_manifest(b)
    assert m.schema_version == 2 and m.target.features["dim"] == 3 * m.target.hidden_size
    assert m.target.outputs[-1].name == FEATURES_OUTPUT
    assert FEATURES_OUTPUT not in [t.name for t in m.draft.outputs]  # the self-draft does not pay for them
    model = _target("llama")
    from specedge.export.sources import load as load_ckpt
    from specedge.models import load_weights

    ck = load_ckpt(m.target.source)
    load_weights(model, ck.state_dict)
    ids = np.arange(4, 24, dtype=np.int64)
    with torch.no_grad():
        ref = model(torch.from_numpy(ids[None]), torch.zeros(1, dtype=torch.int64), *model.empty_cache(m.max_seq))[-1]
    for g in m.target.graphs:  # ort and portable flavours (scatter); portable (delta)
        out = _run_graph(m.path(g.path), model, ids, m.max_seq)
        np.testing.assert_allclose(out[FEATURES_OUTPUT][0], ref[0].numpy(), atol=1e-4, rtol=1e-4)
    be = OrtBackend(m, m.target)
    be.run(ids[:16], 0)
    be.run(ids[16:], 16)  # rows land at their cache slots, like the K/V
    np.testing.assert_allclose(be.features[0, : ids.size], ref[0].numpy(), atol=1e-4, rtol=1e-4)


def test_bundles_without_features_are_unchanged(tiny_bundle_factory, tmp_path):
    m = load_manifest(tiny_bundle_factory("llama"))
    assert not m.target.features and FEATURES_OUTPUT not in [t.name for t in m.target.outputs]
    assert "features" not in json.loads((m.root / "manifest.json").read_text())["models"]["target"]
    # a schema-1 manifest (every bundle exported before features existed) still loads
    old = tmp_path / "old"
    shutil.copytree(m.root, old)
    j = json.loads((old / "manifest.json").read_text())
    j["schema_version"] = 1
    (old / "manifest.json").write_text(json.dumps(j))
    assert load_manifest(old).schema_version == 1


def test_schema_1_manifest_with_version_2_fields_is_refused(tiny_bundle_factory, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(tiny_bundle_factory("llama", features=True), b)
    j = json.loads((b / "manifest.json").read_text())
    j["schema_version"] = 1
    (b / "manifest.json").write_text(json.dumps(j))
    with pytest.raises(BundleError, match="version 2 fields"):
        load_manifest(b)


def test_inspect_describes_the_features_output(tiny_bundle_factory):
    p = cli("inspect", tiny_bundle_factory("llama", features=True))
    assert p.returncode == 0, p.stderr
    assert f"{FEATURES_OUTPUT} [B, T, 192]: the outputs of layers 0, 1, 1" in p.stdout


# ----------------------------------------------------------------------------- 2. the head and its graph


@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
@pytest.mark.parametrize("family", FAMILY_LIST)
def test_head_graph_matches_pytorch(family, tmp_path, kv_mode):
    """Each family's head (its rotary embedding, activation, widths) as an ONNX graph equals the
    PyTorch module, over target features and then chained over its own hidden state."""
    from specedge.export.head_graph import export_head_graph

    target = _target(family)
    F = 3 * target.embed_tokens.weight.shape[1]
    head = randomize_(head_for_target(target, F, 40), 1).eval()
    head.kv_mode = kv_mode
    export_head_graph(head, tmp_path / "h.onnx", 64, kv_mode)
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "h.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.RandomState(0)
    feats = rng.randn(1, 6, F).astype(np.float32)
    ids = rng.randint(0, head.hc.target_vocab, (1, 6)).astype(np.int64)
    cache = [c.numpy() for c in head.empty_cache(64)]
    hid0 = np.zeros((1, 6, head.hc.hidden_size), np.float32)
    o1 = sess.run(
        None,
        {
            "input_ids": ids,
            "position": np.zeros(1, np.int64),
            "features": feats,
            "hidden": hid0,
            "past_key.0": cache[0],
            "past_value.0": cache[1],
        },
    )
    with torch.no_grad():
        r1 = head(
            torch.from_numpy(ids),
            torch.zeros(1, dtype=torch.int64),
            torch.from_numpy(feats),
            torch.from_numpy(hid0),
            *map(torch.from_numpy, cache),
        )
    for a, b in zip(o1, r1):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=1e-4)
    # a chained step over the head's own hidden state, against the training-time test's step 1
    if kv_mode == "scatter":
        kc, vc = o1[2], o1[3]
    else:
        kc, vc = cache[0].copy(), cache[1].copy()
        kc[:, :, :6], vc[:, :, :6] = o1[2], o1[3]
    nxt = np.array([[7]], np.int64)
    o2 = sess.run(
        None,
        {
            "input_ids": nxt,
            "position": np.array([6]),
            "features": np.zeros((1, 1, F), np.float32),
            "hidden": o1[1][:, -1:],
            "past_key.0": kc,
            "past_value.0": vc,
        },
    )
    with torch.no_grad():
        u = head.forward_unrolled(
            torch.from_numpy(np.concatenate([ids, nxt], 1)),
            torch.from_numpy(np.concatenate([feats, np.zeros((1, 1, F), np.float32)], 1)),
            2,
        )
    np.testing.assert_allclose(u[0][0, :6].numpy(), o1[0][0], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(u[1][0, 6].numpy(), o2[0][0, 0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILY_LIST)
def test_head_loss_falls_for_every_family(family):
    """A few training steps on the target's own features and greedy labels lower the loss."""
    from specedge.training.train import _loss

    target = _target(family)
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 25))
    with torch.no_grad():
        out = target(ids, torch.zeros(2, dtype=torch.int64), *target.empty_cache(32, batch=2))
    feats, labels = out[-1], out[0].argmax(-1)
    head = head_for_target(target, feats.shape[-1], target.embed_tokens.weight.shape[0])
    x_in, f_in, lab = ids[:, 1:], feats[:, :-1], labels[:, 1:]
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(12):
        loss, _, _ = _loss(head, x_in, f_in, lab, lab, 3, head.d2t)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses


def test_head_loss_falls_with_soft_labels_and_one_hot_soft_labels_are_the_hard_loss():
    """The soft loss (the target's top-K distribution as the label) trains the head, and with a
    one-hot distribution on the greedy label it is exactly the hard cross-entropy."""
    from specedge.training.train import _loss

    target = _target("llama")
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 25))
    with torch.no_grad():
        out = target(ids, torch.zeros(2, dtype=torch.int64), *target.empty_cache(32, batch=2))
    feats, logits = out[-1], out[0]
    head = head_for_target(target, feats.shape[-1], target.embed_tokens.weight.shape[0])
    x_in, f_in, lab = ids[:, 1:], feats[:, :-1], logits[:, 1:].argmax(-1)
    top = torch.softmax(logits[:, 1:], -1).topk(8, -1)
    soft = (top.indices, top.values / top.values.sum(-1, keepdim=True))
    one_hot = (
        torch.cat([lab[..., None], torch.zeros_like(top.indices[..., 1:])], -1),
        torch.cat([torch.ones_like(top.values[..., :1]), torch.zeros_like(top.values[..., 1:])], -1),
    )
    with torch.no_grad():
        hard = _loss(head, x_in, f_in, lab, lab, 3, head.d2t)[0]
        assert float(abs(_loss(head, x_in, f_in, lab, lab, 3, head.d2t, one_hot)[0] - hard)) < 1e-5
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(12):
        loss, _, _ = _loss(head, x_in, f_in, lab, lab, 3, head.d2t, soft)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    # cross-entropy against a distribution is bounded below by its entropy: the KL part must fall
    w = torch.tensor([0.8**s for s in range(3)])
    ent = torch.stack([-(soft[1][:, s:] * soft[1][:, s:].clamp(min=1e-12).log()).sum(-1).mean() for s in range(3)])
    floor = float((w * ent).sum() / w.sum())
    assert losses[-1] - floor < 0.7 * (losses[0] - floor), (floor, losses)


def test_bf16_steps_train_like_fp32_steps():
    """--train-dtype bf16 runs the step's matmuls in bfloat16 (the loss differs from float32's in
    its low digits, so autocast is really on) and the head still learns: its loss falls as the
    float32 one does, from the same start."""
    from specedge.training.train import _loss, step_autocast

    target = _target("llama")
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 25))
    with torch.no_grad():
        out = target(ids, torch.zeros(2, dtype=torch.int64), *target.empty_cache(32, batch=2))
    feats, lab = out[-1][:, :-1], out[0].argmax(-1)[:, 1:]
    runs = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(1)
        head = head_for_target(target, feats.shape[-1], target.embed_tokens.weight.shape[0])
        opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
        losses = []
        for _ in range(12):
            with step_autocast("cpu", dtype):
                loss, _, _ = _loss(head, ids[:, 1:], feats, lab, lab, 3, head.d2t)
            assert loss.dtype == torch.float32
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        assert all(p.dtype == torch.float32 for p in head.parameters())  # master weights stay fp32
        runs[dtype] = losses
    assert runs["bf16"][0] != runs["fp32"][0] and abs(runs["bf16"][0] - runs["fp32"][0]) < 0.02 * runs["fp32"][0]
    assert runs["bf16"][-1] < 0.7 * runs["bf16"][0], runs["bf16"]


def test_train_dtype_auto_is_bf16_only_where_the_device_computes_it(monkeypatch):
    from specedge.training import train as train_mod

    assert train_mod.uses_bf16("cpu", "bf16") and not train_mod.uses_bf16("cpu", "fp32")
    for avx512_bf16, amx, native in ((False, False, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        assert train_mod.native_bf16("cpu") is native
        assert train_mod.uses_bf16("cpu", "auto") is native
        with train_mod.step_autocast("cpu", "auto"):
            assert torch.is_autocast_enabled("cpu") is native
    # a torch without the private probes: float32, never emulated bfloat16
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert train_mod.native_bf16("cpu") is False


def test_top_k_probs_are_the_softmax_head_most_probable_first():
    from specedge.training.data import top_k_probs

    x = np.random.RandomState(0).randn(6, 50).astype(np.float32)
    x[0, 7] = x[0, 3] = 6.0  # a tie: the lower id first
    ids, p = top_k_probs(x, 5)
    full = np.exp(x - x.max(1, keepdims=True))
    full /= full.sum(1, keepdims=True)
    assert ids.dtype == np.int32 and p.dtype == np.float16 and ids.shape == p.shape == (6, 5)
    np.testing.assert_array_equal(ids, np.argsort(-full, axis=1, kind="stable")[:, :5])
    np.testing.assert_allclose(p, np.take_along_axis(full, ids.astype(np.int64), 1), rtol=2e-3)
    assert list(ids[0, :2]) == [3, 7]
    assert top_k_probs(x[:, :3], 5)[0].shape == (6, 3)  # k beyond the vocabulary: the whole row


# ----------------------------------------------------------------------------- 3. train-draft


def _toy_data(lengths, dim=4):
    """Distilled data whose token, feature and label at position p of sequence i are 100 i + p (exact in fp16)."""
    from specedge.training.data import Distilled

    toks = [np.arange(n, dtype=np.int64) + 100 * i for i, n in enumerate(lengths)]
    feats = [np.repeat(t[:, None].astype(np.float16), dim, 1) for t in toks]
    return Distilled(toks, feats, [t.copy() for t in toks], ["doc:x"] * len(toks))


@pytest.mark.parametrize("seq_len", [8, 9, 32])
def test_windows_score_every_slot_once_with_left_context(seq_len):
    """Overlapping windows: every slot (features j, token j + 1, label j + 1) of every sequence is
    scored exactly once, and a scored slot sees all its left context or at least seq_len // 2 slots."""
    from specedge.training.train import _batch, _windows

    lengths = [2, 3, 8, 9, 10, 17, 33, 70]
    data = _toy_data(lengths)
    wins = _windows(data, seq_len)
    t2d = np.arange(1000, dtype=np.int64)
    ids, feats, dl, lab = (x.numpy() for x in _batch(data, wins, t2d, seq_len))
    scored = {}
    for b, (i, start, first) in enumerate(wins):
        for j in range(seq_len):
            if lab[b, j] < 0:
                continue
            assert j >= first
            slot = start + j
            # the slot's features, token and label are those of positions slot, slot + 1, slot + 1
            assert feats[b, j, 0] == 100 * i + slot and ids[b, j] == 100 * i + slot + 1 == lab[b, j] == dl[b, j]
            assert j >= min(slot, seq_len // 2)  # left context inside the window
            scored[(i, slot)] = scored.get((i, slot), 0) + 1
    want = {(i, s) for i, n in enumerate(lengths) for s in range(n - 1)}
    assert set(scored) == want and set(scored.values()) == {1}


def test_soft_batch_lies_where_the_labels_do_and_keeps_only_the_draft_vocabulary():
    """Slot j's soft label is the target's distribution at the position whose argmax is its hard
    label; ids outside the draft vocabulary get -100 and no probability, the rest renormalised."""
    from specedge.training.train import _batch, _soft_batch, _windows

    lengths = [2, 9, 33, 70]
    data = _toy_data(lengths)
    # at each position: the label, then label + 1 (outside the draft vocabulary when odd), then 999
    data.soft_ids = [np.stack([t, t + 1, np.full_like(t, 999)], 1).astype(np.int32) for t in data.tokens]
    data.soft_p = [np.tile(np.array([0.5, 0.3, 0.2], np.float16), (t.size, 1)) for t in data.tokens]
    t2d = np.where(np.arange(1000) % 2 == 0, np.arange(1000) // 2, -100).astype(np.int64)
    t2d[999] = 7
    wins = _windows(data, 16)
    _, _, dl, lab = (x.numpy() for x in _batch(data, wins, t2d, 16))
    sid, sp = (x.numpy() for x in _soft_batch(data, wins, t2d, 16, 3))
    assert sid.shape == sp.shape == (len(wins), 16, 3)
    scored = lab >= 0
    np.testing.assert_array_equal(sid[..., 0][scored], dl[scored])
    assert (sp[~scored] == 0).all() and (sid[~scored] == -100).all()
    even = scored & (lab % 2 == 0)
    odd = scored & (lab % 2 == 1)
    # label even: label + 1 outside
    assert (sid[even][:, 1] == -100).all()
    np.testing.assert_allclose(sp[even], np.tile([5 / 7, 0.0, 2 / 7], (even.sum(), 1)), rtol=2e-3)
    # label odd: itself outside, label + 1 inside
    assert (sid[odd][:, 0] == -100).all() and (sid[odd][:, 1] == (lab[odd] + 1) // 2).all()
    np.testing.assert_allclose(sp[odd], np.tile([0.0, 0.6, 0.4], (odd.sum(), 1)), rtol=2e-3)
    assert (sid[..., 2][scored] == 7).all()
    # a smaller k than saved takes the most probable ones
    assert _soft_batch(data, wins, t2d, 16, 1)[0].shape[-1] == 1


def test_feature_scale_is_one_over_each_layers_rms_and_in_the_graph(tmp_path):
    """The head divides each tapped layer's features by its RMS over the data (clamped), and the
    exported graph applies the same scale."""
    from specedge.export.head_graph import export_head_graph
    from specedge.training.train import feature_rms

    data = _toy_data([5, 9])
    data.features = [
        np.concatenate([f * 0 + 3.0, f * 0 - 0.5, f * 0 + 1e-9], 1).astype(np.float16) for f in data.features
    ]
    np.testing.assert_allclose(feature_rms(data, 3), [3.0, 0.5, 0.0], rtol=1e-3)
    target = _target("llama")
    head = randomize_(head_for_target(target, 192, 40), 1).eval()
    head.set_feature_scale([4.0, 0.25, 0.0])
    want = np.repeat([0.25, 4.0, 1e3], 64).astype(np.float32)
    np.testing.assert_allclose(head.feature_scale.numpy(), want, rtol=1e-6)
    with pytest.raises(ValueError, match="feature RMS values"):
        head.set_feature_scale([1.0] * 5)
    export_head_graph(head, tmp_path / "h.onnx", 32, "scatter")
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "h.onnx"), providers=["CPUExecutionProvider"])
    feats = np.random.RandomState(0).randn(1, 3, 192).astype(np.float32)
    ids, cache = np.array([[1, 2, 3]]), [c.numpy() for c in head.empty_cache(32)]
    got = sess.run(
        None,
        {
            "input_ids": ids,
            "position": np.zeros(1, np.int64),
            "features": feats,
            "hidden": np.zeros((1, 3, 64), np.float32),
            "past_key.0": cache[0],
            "past_value.0": cache[1],
        },
    )
    with torch.no_grad():
        ref = head.forward_unrolled(torch.from_numpy(ids), torch.from_numpy(feats), 1)[0]
        head.feature_scale.fill_(1.0)
        plain = head.forward_unrolled(torch.from_numpy(ids), torch.from_numpy(feats), 1)[0]
    np.testing.assert_allclose(got[0], ref.numpy(), atol=1e-4, rtol=1e-4)
    assert not np.allclose(got[0], plain.numpy(), atol=1e-3)  # the scale is really in the graph


def test_training_writes_a_head_with_its_vocabulary_map(trained):
    m = load_manifest(trained)
    assert m.head is not None and m.head.vocab_size == 48
    t = m.head.extra["training"]
    assert t["tokens"] >= 3000 and t["steps"] > 0
    assert 0 < t["data_seconds"] < t["seconds"]  # where the run's time went: data, then training
    from specedge.training.train import native_bf16

    assert t["train_dtype"] == ("bf16" if native_bf16("cpu") else "fp32")  # TRAIN leaves it at auto
    d2t = json.loads(m.path(m.head.extra["draft_vocab_file"]).read_text())["d2t"]
    assert len(d2t) == 48 and len(set(d2t)) == 48 and set(m.eos_token_ids) <= set(d2t)
    assert m.head.weight_bytes < m.target.weight_bytes


def test_training_is_deterministic_and_resumes(feat_bundle, tmp_path):
    from specedge.training.train import TrainOptions, train_draft

    def head_state(ck):
        return torch.load(Path(ck) / "checkpoint.pt", weights_only=True)

    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        train_draft(feat_bundle, TrainOptions(**{**TRAIN, "budget": "1k"}, checkpoint=str(folder)))
    sa, sb = head_state(a), head_state(b)
    assert sa["step"] == sb["step"]
    for k in sa["head"]:
        assert torch.equal(sa["head"][k], sb["head"][k]), k
    # a larger budget resumes from the checkpoint instead of starting again
    train_draft(feat_bundle, TrainOptions(**{**TRAIN, "budget": "2k"}, checkpoint=str(a)))
    assert head_state(a)["step"] > sa["step"] and head_state(a)["tokens"] >= 2000


def test_interrupted_training_leaves_the_bundle_untouched(trained, tmp_path, monkeypatch):
    from specedge.training import train as train_mod

    before = _snapshot(trained)
    real, calls = train_mod._loss, []

    def interrupting(*a, **k):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "_loss", interrupting)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train_draft(trained, train_mod.TrainOptions(**TRAIN, checkpoint=str(tmp_path / "ck")))
    assert _snapshot(trained) == before
    monkeypatch.setattr(train_mod, "_loss", real)

    # a failure while the head is written: the manifest and every file stay as they were
    from specedge.export import head_graph

    def failing(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(head_graph, "check_head_graph", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        train_mod.train_draft(
            trained, train_mod.TrainOptions(**{**TRAIN, "budget": "500"}, checkpoint=str(tmp_path / "ck2"))
        )
    assert _snapshot(trained) == before


def test_train_draft_bad_input_exits_2(tiny_bundle_factory, trained, tmp_path):
    assert_user_error(
        cli("train-draft", tiny_bundle_factory("llama"), "--budget", "1k"), "returns no features", "--features"
    )
    assert_user_error(cli("train-draft", trained, "--budget", "0"), "--budget must be more than 0")
    assert_user_error(cli("train-draft", trained, "--budget", "lots"), "--budget must be a number")
    assert_user_error(cli("train-draft", trained, "--device", "tpu"), "--device must be cpu or cuda")
    assert_user_error(
        cli("train-draft", trained, "--sampled-answers", "-1"), "--sampled-answers must be an integer of at least 0"
    )
    assert_user_error(
        cli("train-draft", trained, "--soft-labels", "-1"), "--soft-labels must be an integer of at least 0"
    )
    assert_user_error(
        cli("train-draft", trained, "--train-dtype", "fp16"), "--train-dtype must be auto, fp32 or bf16, got 'fp16'"
    )
    # a checkpoint of another target
    other = tmp_path / "ck"
    other.mkdir()
    torch.save({"target_fingerprint": "0" * 64, "head": {}, "opt": {}, "step": 1, "tokens": 1}, other / "checkpoint.pt")
    assert_user_error(cli("train-draft", trained, "--checkpoint", other), "trained for another target")


def test_a_minutes_budget_spent_before_the_first_step_writes_no_head(trained, tmp_path):
    """A minutes budget counts the whole run; one used up by building the data used to write an
    untrained head (0 steps) into the bundle. Now: exit 2, the bundle as it was, the data kept."""
    before = _snapshot(trained)
    p = cli(
        "train-draft",
        trained,
        "--budget",
        "0.001m",
        "--checkpoint",
        tmp_path / "ck",
        "--draft-vocab",
        "48",
        "--seq-len",
        "32",
        "--answer-tokens",
        "16",
        "--max-prompts",
        "4",
        "--doc-tokens",
        "600",
        "--threads",
        "1",
        "--quiet",
    )
    assert_user_error(p, "before the first training step", "nothing was written")
    assert _snapshot(trained) == before
    assert (tmp_path / "ck" / "data.npz").is_file()


def test_a_head_for_another_target_is_refused(trained, tmp_path):
    b = tmp_path / "b"
    shutil.copytree(trained, b)
    j = json.loads((b / "manifest.json").read_text())
    j["models"]["head"]["extra"]["target_fingerprint"] = "f" * 64
    (b / "manifest.json").write_text(json.dumps(j))
    assert_user_error(cli("generate", b, "hello", "--draft", "head"), "trained for another target")


def test_head_draft_on_a_bundle_without_head_exits_2(tiny_bundle_factory):
    assert_user_error(
        cli("generate", tiny_bundle_factory("llama"), "hi", "--draft", "head"), "no draft head", "train-draft"
    )


# ----------------------------------------------------------------------------- 4. the head drafter


PROMPTS = ["hello there", "def add(a, b):", "The quick brown fox", "for i in range(10):"]


@pytest.mark.parametrize("kv_mode", ["scatter", "delta"])
def test_greedy_with_the_head_equals_target_only(tiny_bundle_factory, trained, tmp_path, kv_mode):
    from specedge.runtime.api import load

    b = trained
    if kv_mode == "delta":
        from specedge.training.train import TrainOptions, train_draft

        b = tmp_path / "delta"
        shutil.copytree(tiny_bundle_factory("llama", kv_mode="delta", features=True), b)
        train_draft(b, TrainOptions(**{**TRAIN, "budget": "1k"}, checkpoint=str(tmp_path / "ck")))
    head = load(b, draft="head", threads=1)
    ref = load(b, draft="ngram", threads=1)
    drafted = accepted = 0
    for p in PROMPTS:
        a = head.generate(p, max_new_tokens=40, guard=False)
        r = ref.generate(p, max_new_tokens=40, speculative=False)
        assert a.token_ids == r.token_ids, p
        drafted += a.stats["drafted"]
        accepted += a.stats["accepted"]
    assert drafted > 0 and head.drafter.calls > 0
    assert accepted > 0  # a trained head gets some drafts accepted even on a random tiny target


@pytest.mark.parametrize("family", [f for f in FAMILY_LIST if f != "llama"])  # llama: the test above
def test_greedy_with_the_head_equals_target_only_for_every_family(tiny_bundle_factory, tmp_path, family):
    """Each family's bundle with features (an n-gram draft, as the other families' tests use: the
    target writes the answers): a head trains on it, and greedy output with the head is the
    target's own."""
    from specedge.runtime.api import load
    from specedge.training.train import TrainOptions, train_draft

    b = tmp_path / family
    shutil.copytree(tiny_bundle_factory(family, draft="ngram", features=True), b)
    m = train_draft(b, TrainOptions(**{**TRAIN, "budget": "1k"}, checkpoint=str(tmp_path / "ck")))
    assert m.head is not None and m.head.extra["training"]["steps"] > 0
    head, ref = load(b, draft="head", threads=1), load(b, draft="ngram", threads=1)
    drafted = 0
    for p in PROMPTS[:2]:
        a = head.generate(p, max_new_tokens=24, guard=False)
        assert a.token_ids == ref.generate(p, max_new_tokens=24, speculative=False).token_ids, p
        drafted += a.stats["drafted"]
    assert drafted > 0 and head.drafter.calls > 0


def test_a_head_on_an_int4_target_trains_and_keeps_its_greedy_output(tiny_bundle_factory, tmp_path):
    """An int4 target (whose auto draft is n-gram) with features: train-draft writes the answers
    with the target itself and trains on its int4 features; greedy output with the head is the
    int4 target's own."""
    from specedge.runtime.api import load
    from specedge.training.train import TrainOptions, train_draft

    b = tmp_path / "int4"
    shutil.copytree(tiny_bundle_factory("llama", precision="int4", draft="ngram", features=True), b)
    m = train_draft(b, TrainOptions(**{**TRAIN, "budget": "1k"}, checkpoint=str(tmp_path / "ck")))
    assert m.target.precision == "int4" and m.head.extra["training"]["answers_by"] == "target"
    head, ref = load(b, draft="head", threads=1), load(b, draft="ngram", threads=1)
    drafted = 0
    for p in PROMPTS:
        a = head.generate(p, max_new_tokens=30, guard=False)
        assert a.token_ids == ref.generate(p, max_new_tokens=30, speculative=False).token_ids, p
        drafted += a.stats["drafted"]
    assert drafted > 0


def test_runtime_drafts_equal_the_training_time_test(trained_run):
    """Every chain the runtime drafts (ONNX head, catch-up in chunks, chained T = 1 steps) is the
    chain training's forward_unrolled predicts from the same features (the torch head of the
    checkpoint): draft j of a proposal after n committed tokens is step j's argmax at slot n - 2 + j."""
    from specedge.runtime.api import load
    from specedge.training.train import _target_module

    bundle, ck = trained_run
    m = load_manifest(bundle)
    state = torch.load(ck / "checkpoint.pt", weights_only=True)
    head = head_for_target(_target_module(m), int(m.target.features["dim"]), state["d2t"].numel())
    head.load_state_dict(state["head"])
    head.eval()
    pipe = load(bundle, draft="head", threads=1)
    checked = 0
    for p in PROMPTS:
        seen, real = [], pipe.drafter.propose

        def spy(history, k, params, rng=None):
            prop = real(history, k, params, rng)
            seen.append((list(history), list(prop.tokens)))
            return prop

        pipe.drafter.propose = spy
        r = pipe.generate(p, max_new_tokens=30, guard=False, spec_tokens=3)
        pipe.drafter.propose = real
        feats = pipe.drafter._features().copy()  # rows of the final sequence: committed tokens never change
        for history, drafts in seen:
            if not drafts:
                continue
            n, k = len(history), len(drafts)
            ids = torch.tensor([history[1:] + drafts[:-1]])
            f = torch.from_numpy(np.concatenate([feats[: n - 1], np.zeros((k - 1, feats.shape[1]), np.float32)]))
            with torch.no_grad():
                outs = head.forward_unrolled(ids, f[None], k)
            want = [int(head.d2t[outs[j][0, n - 2 + j].argmax()]) for j in range(k)]
            assert drafts == want, (p, n)
            checked += 1
        assert r.stats["drafted"] > 0
    assert checked >= 8


def test_the_head_only_proposes_tokens_of_its_draft_vocabulary(trained):
    from specedge.runtime.api import load

    pipe = load(trained, draft="head", threads=1)
    allowed = set(pipe.drafter.d2t.tolist())
    seen, real = [], pipe.drafter.propose

    def spy(*a, **k):
        prop = real(*a, **k)
        seen.extend(prop.tokens)
        if prop.probs is not None:  # sampled: q is zero outside the map and sums to one
            outside = np.ones(prop.probs.shape[1], bool)
            outside[list(allowed)] = False
            assert np.all(prop.probs[:, outside] == 0) and np.allclose(prop.probs.sum(1), 1.0)
        return prop

    pipe.drafter.propose = spy
    for p in PROMPTS:
        pipe.generate(p, max_new_tokens=24, guard=False)
        pipe.generate(p, max_new_tokens=24, guard=False, temperature=0.9, seed=3)
    assert seen and set(seen) <= allowed
    assert len(allowed) < pipe.vocab  # a real reduction: ids outside it exist and never appear


def test_sampling_with_the_head_is_reproducible(trained):
    from specedge.runtime.api import load

    pipe = load(trained, draft="head", threads=1)
    a = pipe.generate("hello", max_new_tokens=20, temperature=0.8, seed=5)
    b = pipe.generate("hello", max_new_tokens=20, temperature=0.8, seed=5)
    assert a.token_ids == b.token_ids and a.stats["drafted"] > 0


def test_export_models_draft_head_exports_and_trains(tiny_checkpoint_factory, tmp_path):
    ck = tiny_checkpoint_factory("llama")
    out = tmp_path / "b"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "specedge.cli.export_models",
            "--target",
            ck,
            "--out",
            out,
            "--max-seq",
            "128",
            "--draft",
            "head",
            "--head-budget",
            "500",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    m = load_manifest(out)
    assert m.target.features and m.head is not None and m.draft.is_model  # the self-draft stays beside it
    assert m.head.extra["training"]["tokens"] >= 500
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "specedge.cli.export_models",
            "--target",
            ck,
            "--out",
            tmp_path / "c",
            "--head-budget",
            "500",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_user_error(bad, "--head-budget needs --draft head")


def test_sampled_answers_add_seeded_target_written_contexts(feat_bundle):
    """--sampled-answers N: besides each prompt's greedy answer, N answers sampled from the target,
    the same for the same seed and other for another; the greedy answers stay what they were."""
    from specedge.training.data import generate_answers
    from specedge.training.prompts import distill_prompts

    prompts = distill_prompts()[:3]
    greedy = generate_answers(feat_bundle, prompts, 12, 1, lambda d, t: None)
    a = generate_answers(feat_bundle, prompts, 12, 1, lambda d, t: None, sampled=2, seed=5)
    b = generate_answers(feat_bundle, prompts, 12, 1, lambda d, t: None, sampled=2, seed=5)
    c = generate_answers(feat_bundle, prompts, 12, 1, lambda d, t: None, sampled=2, seed=6)
    assert len(greedy) == 3 and len(a) == 9 and a == b and a != c
    assert [x for i, x in enumerate(a) if i % 3 == 0] == greedy  # prompt order: greedy, then its samples
    assert all(a[i][0] == greedy[i // 3][0] for i in range(9))  # each sample keeps its prompt's category
    assert {tuple(x[1]) for x in a[1:3]} != {tuple(greedy[0][1])}  # the samples are other answers


def test_soft_labels_are_added_to_saved_data_without_writing_answers_again(feat_bundle, tmp_path, monkeypatch):
    """Data saved by a run with fewer soft labels (or none) is labelled again by the target, not
    rebuilt: the answers are not written again, and the new labels are the target's own
    distribution (its first token the greedy label)."""
    from specedge.training import data as data_mod
    from specedge.training.train import TrainOptions, train_draft

    ck = tmp_path / "ck"
    train_draft(feat_bundle, TrainOptions(**{**TRAIN, "budget": "500", "soft_labels": 0}, checkpoint=str(ck)))
    z = np.load(ck / "data.npz")
    assert "soft_ids" not in z.files

    def no_answers(*a, **k):
        raise AssertionError("the answers were written again")

    monkeypatch.setattr(data_mod, "generate_answers", no_answers)
    monkeypatch.setattr(data_mod, "write_with_draft", no_answers)
    train_draft(
        feat_bundle, TrainOptions(**{**TRAIN, "budget": "500", "soft_labels": 4}, checkpoint=str(ck), resume=False)
    )
    z2 = np.load(ck / "data.npz")
    np.testing.assert_array_equal(z2["tokens"], z["tokens"])
    np.testing.assert_array_equal(z2["labels"], z["labels"])
    assert z2["soft_ids"].shape == (z["tokens"].size, 4)
    np.testing.assert_array_equal(z2["soft_ids"][:, 0], z["labels"])
    p = z2["soft_p"].astype(np.float32)
    assert (np.diff(p, axis=1) <= 1e-3).all() and (p.sum(1) <= 1.01).all() and (p[:, 0] > 0).all()
    assert load_manifest(feat_bundle).head.extra["training"]["soft_labels"] == 4


def test_data_with_sampled_answers_is_not_reused_without_them(tmp_path):
    """train-draft keeps its data next to the checkpoint and reuses it only for the same options:
    data made with sampled answers is not taken for a run without them, or with another seed."""
    from specedge.training.data import Distilled, load_data, save_data

    d = Distilled([np.arange(4)], [np.zeros((4, 2), np.float16)], [np.arange(4)], ["answer:chat"])
    meta = {"target_fingerprint": "x", "sampled_answers": 2, "sample_seed": 0}
    save_data(d, tmp_path, meta)
    assert load_data(tmp_path, meta) is not None
    assert load_data(tmp_path, {**meta, "sampled_answers": 0, "sample_seed": None}) is None
    assert load_data(tmp_path, {**meta, "sample_seed": 1}) is None


# ----------------------------------------------------------------------------- training prompts and writers


def _norm(text: str) -> str:
    import re

    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


def test_training_prompts_hold_no_bench_or_held_out_prompt(load_script):
    """The bench suite is the evaluation set and head_diagnose's prompts the held-out set: no
    training prompt may contain one of their requests (first sentence), or be contained in one."""
    from specedge.bench.runner import load_prompts
    from specedge.training.prompts import distill_prompts, more_prompts, training_prompts

    train = [_norm(m) for _, m in training_prompts()]
    assert len(train) == len(distill_prompts()) + len(more_prompts()) and len(more_prompts()) >= 500
    assert len(set(train)) == len(train)
    evals = [" ".join(x["content"] for x in p["messages"] if x["role"] == "user") for p in load_prompts()]
    evals += [m for _, m in load_script("benchmarks/experiments/heads/head_diagnose").HELD_OUT]
    for e in evals:
        full = _norm(e)
        first = _norm(e.split("\n")[0].split(". ")[0].split("? ")[0])
        for t in train:
            assert first not in t and t not in full, (e[:80], t[:80])


def test_draft_written_answers_are_the_draft_models_greedy_answers(tiny_bundle_factory):
    """--answers-by draft: the bundle's draft graph alone writes the answers. With an fp32
    self-draft (the target's own weights) they are the target's greedy answers token for token;
    sampled ones are seeded like the target's (same seed: same answers, another: others)."""
    from specedge.training.data import generate_answers, write_with_draft
    from specedge.training.prompts import distill_prompts, more_prompts

    b = tiny_bundle_factory("llama", draft_precision="fp32", features=True)
    m = load_manifest(b)
    prompts = distill_prompts()[:2] + more_prompts()[:2]  # short enough for the tiny max_seq
    say = lambda d, t: None  # noqa: E731
    assert write_with_draft(m, prompts, 12, 1, say) == generate_answers(b, prompts, 12, 1, say)
    a = write_with_draft(m, prompts, 12, 1, say, sampled=2, seed=5)
    assert a == write_with_draft(m, prompts, 12, 1, say, sampled=2, seed=5)
    assert a != write_with_draft(m, prompts, 12, 1, say, sampled=2, seed=6)
    assert len(a) == 12 and all(a[i][0] == prompts[i // 3][0] for i in range(12))


def test_answers_by_picks_the_self_draft_and_refuses_a_bundle_without_draft_model(tiny_bundle_factory, tmp_path):
    from specedge.errors import UserError
    from specedge.training.data import answer_writer

    selfd = load_manifest(tiny_bundle_factory("llama", features=True))
    other = load_manifest(tiny_bundle_factory("llama", draft="model"))
    ngram = tiny_bundle_factory("llama", draft="ngram", features=True)
    assert answer_writer(selfd, "auto") == "draft" and answer_writer(selfd, "target") == "target"
    assert answer_writer(other, "auto") == "target" and answer_writer(other, "draft") == "draft"
    assert answer_writer(load_manifest(ngram), "auto") == "target"
    with pytest.raises(UserError, match="must be auto, target or draft"):
        answer_writer(selfd, "fast")
    p = cli("train-draft", ngram, "--answers-by", "draft", "--checkpoint", tmp_path / "ck", "--budget", "1k")
    assert_user_error(p, "--answers-by draft needs a bundle with a draft model", "--answers-by target")
    p = cli("train-draft", ngram, "--answers-by", "fast", "--budget", "1k")
    assert_user_error(p, "--answers-by", "'fast'")


def test_head_transplant_gives_a_tree_bundle_of_the_same_weights_the_trained_head(
    trained_run, tiny_bundle_factory, tmp_path, load_script
):
    """benchmarks/experiments/heads/head_transplant.py: a head trained for one bundle, written into a --tree export of
    the same weights, drafts there with greedy output equal to target-only; a bundle of other
    weights is refused."""
    from specedge.runtime.api import load

    src, ck = trained_run
    dst = tmp_path / "tree"
    shutil.copytree(tiny_bundle_factory("llama", features=True, tree=True), dst)
    out = load_script("benchmarks/experiments/heads/head_transplant").transplant(src, dst, ck)
    m = load_manifest(dst)
    assert m.head is not None and out["draft_vocab"] == load_manifest(src).head.vocab_size
    pipe = load(dst, draft="head", threads=1)
    try:
        ids = pipe.encode(messages=[{"role": "user", "content": "Hello there"}])
        ref = pipe.generate(token_ids=ids, max_new_tokens=24, speculative=False).token_ids
        for tree in (False, True):
            r = pipe.generate(token_ids=ids, max_new_tokens=24, guard=False, tree=tree)
            assert r.token_ids == ref and r.stats["drafted"] > 0
    finally:
        pipe.close()
    other = tmp_path / "other"
    shutil.copytree(tiny_bundle_factory("mistral", features=True), other)
    with pytest.raises(SystemExit, match="differ"):
        load_script("benchmarks/experiments/heads/head_transplant").transplant(src, other, ck)


def test_answers_are_cut_to_the_context_and_no_data_is_one_clear_error(feat_bundle, tmp_path, monkeypatch):
    """A short-context bundle still gets answers (cut to what fits); when no prompt leaves room for
    one and there is no documentation text, train-draft says so and writes nothing."""
    from specedge.errors import UserError
    from specedge.training import data as data_mod
    from specedge.training.train import TrainOptions, train_draft

    assert data_mod.answer_room(20, 160, 128) == 108 and data_mod.answer_room(20, 16, 128) == 16
    assert data_mod.answer_room(124, 160, 128) == 0 and data_mod.answer_room(126, 2, 128) == 2
    before = _snapshot(feat_bundle)
    monkeypatch.setattr(data_mod, "training_prompts", lambda: [("chat", "tell me more " * 80)])
    with pytest.raises(UserError) as e:
        train_draft(feat_bundle, TrainOptions(**{**TRAIN, "doc_tokens": 0}, checkpoint=str(tmp_path / "ck")))
    assert "no training data could be made" in str(e.value) and "--doc-tokens" in str(e.value)
    assert _snapshot(feat_bundle) == before and not (tmp_path / "ck" / "data.npz").exists()
