"""The C++ TensorRT backend (cpp/src/trt_backend.cpp) run end to end on the CPU fakes.

`cmake -DSPECEDGE_FAKE_TENSORRT=ON` builds the runtime against cpp/tests/fake_tensorrt (TensorRT
10.3's runtime API and the CUDA runtime on the CPU; fake_gpu.h says what they simulate and what
not), in a build folder of its own ($SPECEDGE_CPP_FAKE_TRT_BUILD, default cpp/build-fake-trt),
once per module and only `specedge_generate`. A `--tensorrt 10.3` bundle (delta graphs) gets the
fake plans of tests/test_tensorrt_fake.py under engines/<device tag>/ (one plan format for both
fakes), and `specedge_generate --backend tensorrt` must give the token ids of `--backend ort-cpu`
and of the Python runtime, with CUDA graphs captured and replayed, and with them off. Skipped
where g++, cmake or third_party/onnxruntime are missing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_tensorrt_fake import GPU_CC, GPU_NAME, write_fake_plan

from specedge.engines import plan_json as pj
from specedge.manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("SPECEDGE_CPP_FAKE_TRT_BUILD", REPO / "cpp" / "build-fake-trt"))
GENERATE = BUILD / "specedge_generate"
ORT_ROOT = REPO / "third_party" / "onnxruntime"
TRT_VERSION = "10.3.0.26"  # the fake's NvInferVersion.h
PROMPTS = ["def add(a, b):", "the cat sat on the mat. the cat sat on the mat. the cat"]


@pytest.fixture(scope="module")
def generate() -> Path:
    """specedge_generate built against the fakes (configured and built once; make reuses it)."""
    missing = [t for t in ("g++", "cmake") if not shutil.which(t)]
    if missing or not (ORT_ROOT / "include").is_dir():
        pytest.skip(
            f"needs g++, cmake and third_party/onnxruntime (bash scripts/cpp_setup.sh); missing: "
            f"{', '.join(missing) or 'third_party/onnxruntime'}"
        )
    cfg = [
        "cmake",
        "-S",
        str(REPO / "cpp"),
        "-B",
        str(BUILD),
        f"-DONNXRUNTIME_ROOT={ORT_ROOT}",
        "-DSPECEDGE_FAKE_TENSORRT=ON",
        "-DSPECEDGE_BUILD_TESTS=OFF",
        # unoptimized: the build is most of this test's time, and the tiny model runs as fast
        "-DCMAKE_BUILD_TYPE=Debug",
        "-DCMAKE_CXX_FLAGS_DEBUG=-O0",
    ]
    build = ["cmake", "--build", str(BUILD), "--target", "specedge_generate", "specedge_fake_refusals", "-j2"]
    with open("/tmp/specedge-cpp.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for cmd in (cfg, build):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "SPECEDGE_FAKE_TENSORRT:BOOL=ON" in (BUILD / "CMakeCache.txt").read_text()
    return GENERATE


def with_plans(src: Path, dst: Path) -> Path:
    """A copy of bundle `src` with fake plans of its models where build-engines puts them."""
    shutil.copytree(src, dst)
    m = load_manifest(dst)
    folder = pj.engines_root(dst) / pj.device_tag(GPU_NAME, GPU_CC)
    for spec in (m.target, m.draft):
        if spec is not None and spec.kind == "model":
            write_fake_plan(m, spec, folder, TRT_VERSION)
    return dst


@pytest.fixture(scope="module", params=["int8-self", "ngram"])
def bundle(request, tiny_bundle_factory, tmp_path_factory) -> Path:
    """A tiny `--tensorrt 10.3` bundle (delta graphs, opset 18) with its fake plans: the int8
    self-draft (TensorRT 10.3's weight-only form) runs on TensorRT too; or the n-gram drafter."""
    kw = {"draft": "self", "draft_precision": "int8"} if request.param == "int8-self" else {"draft": "ngram"}
    src = tiny_bundle_factory("llama", kv_mode=None, tensorrt="10.3", **kw)
    b = with_plans(src, tmp_path_factory.mktemp("trt") / "bundle")
    assert load_manifest(b).kv_mode == "delta"
    return b


def run(exe: Path, bundle: Path, prompt: str, *args, env=None, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [str(exe), str(bundle), prompt, "--json", "--threads", "1", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    if check:
        assert p.returncode == 0, p.stderr
    return p


def fake_stats(stderr: str) -> dict:
    """The fake cudart's counters (SPECEDGE_FAKE_GPU_STATS=1) and what it reported."""
    assert "never freed" not in stderr and "never destroyed" not in stderr and "pending" not in stderr, stderr
    m = re.search(r"fake cudart: captures=(\d+) graph_launches=(\d+) engine_steps=(\d+)", stderr)
    assert m, stderr
    return dict(zip(("captures", "launches", "steps"), map(int, m.groups())))


def test_tokens_equal_ort_cpu_and_python(generate, bundle):
    from specedge.runtime.api import load

    with load(bundle, threads=1) as pipe:
        for prompt in PROMPTS:
            for extra in ([], ["--no-spec"], ["--temperature", "0.8", "--seed", "7"]):
                ref = json.loads(run(generate, bundle, prompt, "--max-new-tokens", 24, *extra).stdout)
                if not extra:
                    assert ref["token_ids"] == pipe.generate(prompt, max_new_tokens=24).token_ids
                for graphs in ("1", "0"):
                    p = run(
                        generate,
                        bundle,
                        prompt,
                        "--max-new-tokens",
                        24,
                        "--backend",
                        "tensorrt",
                        *extra,
                        env={"SPECEDGE_CUDA_GRAPHS": graphs, "SPECEDGE_FAKE_GPU_STATS": "1"},
                    )
                    got = json.loads(p.stdout)
                    assert got["token_ids"] == ref["token_ids"], (prompt, extra, graphs)
                    st = fake_stats(p.stderr)
                    assert st["steps"] > 0
                    if graphs == "1":  # T = 1 and T = k + 1 captured (per model), then replayed
                        assert st["captures"] >= 2 and st["launches"] > 0, st
                    else:
                        assert st["captures"] == 0 and st["launches"] == 0, st


def test_long_generation_to_the_end_of_the_context(generate, bundle):
    """Prefill chunks on the range profile, calls up to the last slots of the cache (the delta
    copies at the end of the arena), a k whose verification call needs the range profile."""
    prompt = " ".join(["def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"] * 2)
    for extra in ([], ["--spec-tokens", 6, "--adaptive-k"]):
        ref = json.loads(run(generate, bundle, prompt, "--max-new-tokens", 400, *extra).stdout)
        assert ref["finish_reason"] in ("context", "eos")
        got = json.loads(run(generate, bundle, prompt, "--max-new-tokens", 400, "--backend", "tensorrt", *extra).stdout)
        assert got["token_ids"] == ref["token_ids"]


def assert_refused(p: subprocess.CompletedProcess, *parts: str) -> None:
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for part in parts:
        assert part in lines[0], lines[0]


def test_refusals(generate, bundle, tmp_path, tiny_bundle_factory):
    # a plan.json for another GPU, and one of another bundle's graph
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    folder = pj.engines_root(b) / pj.device_tag(GPU_NAME, GPU_CC)
    meta = folder / "target.plan.json"
    info = json.loads(meta.read_text())
    meta.write_text(json.dumps({**info, "gpu_name": "NVIDIA H200"}))
    assert_refused(
        run(generate, b, "hi", "--backend", "tensorrt", check=False),
        "engine built for NVIDIA H200 sm_90 with TensorRT 10.3; this device is NVIDIA Fake GPU sm_90",
    )
    meta.write_text(json.dumps({**info, "onnx_sha256": "0" * 64}))
    assert_refused(
        run(generate, b, "hi", "--backend", "tensorrt", check=False),
        "the target engine was built from another target/model.onnx than the bundle's",
    )
    # a plan built for TensorRT 10.15 on this 10.3
    meta.write_text(json.dumps({**info, "tensorrt_version": "10.15.1.29"}))
    assert_refused(
        run(generate, b, "hi", "--backend", "tensorrt", check=False),
        "with TensorRT 10.15",
        "this device is NVIDIA Fake GPU sm_90 with TensorRT 10.3",
    )
    meta.write_text(json.dumps(info))
    # another bundle's plan: the size and checksum of plan.json first, then TensorRT's own check
    other = with_plans(
        tiny_bundle_factory("llama", kv_mode=None, tensorrt="10.3", draft="ngram", seed=1), tmp_path / "other"
    )
    plan = folder / "target.plan"
    own = plan.read_bytes()
    plan.write_bytes((pj.engines_root(other) / pj.device_tag(GPU_NAME, GPU_CC) / "target.plan").read_bytes())
    assert_refused(
        run(generate, b, "hi", "--backend", "tensorrt", check=False),
        "target.plan has",
        "bytes, its plan.json says",
        "--force",
    )
    plan.write_bytes(own.replace(b'"batch": 1', b'"batch": 2'))  # same size, another plan
    assert_refused(
        run(generate, b, "hi", "--backend", "tensorrt", check=False), "does not match its plan.json checksum", "--force"
    )
    data = b"NOT-A-PLAN" + plan.read_bytes()
    plan.write_bytes(data)
    meta.write_text(json.dumps({**info, "plan_bytes": len(data), "plan_sha256": pj.sha256_bytes(data)}))
    assert_refused(
        run(generate, b, "hi", "--backend", "tensorrt", check=False),
        "TensorRT could not load",
        "Magic tag does not match",
        "--force",
    )
    # no GPU at all
    assert_refused(
        run(generate, bundle, "hi", "--backend", "tensorrt", env={"SPECEDGE_FAKE_GPU_COUNT": "0"}, check=False),
        "backend 'tensorrt' needs a CUDA GPU: cudaErrorNoDevice",
    )


TREE_PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a", "the cat the cat the cat the cat"]


def test_tree_bundle_chains_and_tree_rounds(generate, tiny_bundle_factory, tmp_path):
    """A `--tensorrt 10.3 --tree` bundle: its TensorRT graph takes `tree_mask`, bound for every
    call (lower-triangular for chains); `--tree` rounds verify trees in one call and commit the
    accepted path in the cache arena (keep_path); greedy ids equal ort-cpu's and target-only."""
    b = with_plans(
        tiny_bundle_factory("llama", kv_mode=None, tensorrt="10.3", draft="ngram", tree=True), tmp_path / "tree"
    )
    for prompt in TREE_PROMPTS:
        plain = json.loads(run(generate, b, prompt, "--max-new-tokens", 32, "--no-spec").stdout)["token_ids"]
        for extra in ([], ["--tree", "--no-guard"]):
            ref = json.loads(run(generate, b, prompt, "--max-new-tokens", 32, *extra).stdout)
            assert ref["token_ids"] == plain
            for graphs in ("1", "0"):
                p = run(
                    generate,
                    b,
                    prompt,
                    "--max-new-tokens",
                    32,
                    "--backend",
                    "tensorrt",
                    *extra,
                    env={"SPECEDGE_CUDA_GRAPHS": graphs, "SPECEDGE_FAKE_GPU_STATS": "1"},
                )
                got = json.loads(p.stdout)
                assert got["token_ids"] == plain, (prompt, extra, graphs)
                fake_stats(p.stderr)
                if extra:
                    assert got["stats"]["tree_rounds"] > 0 and got["stats"]["trees_off"] is False
        # a GPU's call cost, flat in T: trees grow to the largest measured size + 2, which the engine's
        # largest profile (16) must bound (it refused "no optimization profile covers T = 17")
        p = run(
            generate,
            b,
            prompt,
            "--max-new-tokens",
            48,
            "--backend",
            "tensorrt",
            "--tree",
            "--no-guard",
            env={"SPECEDGE_FAKE_TRT_STEP_US": "20000"},
        )
        assert (
            json.loads(p.stdout)["token_ids"]
            == json.loads(run(generate, b, prompt, "--max-new-tokens", 48, "--no-spec").stdout)["token_ids"]
        )


def test_draft_head_reads_the_engines_features(generate, tiny_bundle_factory, tmp_path):
    """A draft head (on ONNX Runtime) beside the TensorRT target reads the features the engine's
    `hidden_states` output copied back after each call (TrtBackend::keep_features): the same
    drafts, acceptances and tokens as beside the ort-cpu target (fixed k, no guard)."""
    from specedge.training.train import TrainOptions, train_draft

    b = tmp_path / "head"
    shutil.copytree(tiny_bundle_factory("llama", kv_mode=None, tensorrt="10.3", draft="ngram", features=True), b)
    train_draft(
        b,
        TrainOptions(
            budget="500",
            draft_vocab=48,
            seq_len=32,
            batch=2,
            answer_tokens=16,
            max_prompts=4,
            doc_tokens=600,
            threads=1,
            checkpoint_every_s=0.0,
            checkpoint=str(tmp_path / "ck"),
        ),
    )
    with_plans(b, tmp_path / "head-trt")
    b = tmp_path / "head-trt"
    for prompt in ("hello there", "def add(a, b): return a + b"):
        args = ("--max-new-tokens", 40, "--draft", "head", "--no-guard", "--spec-tokens", 3)
        ref = json.loads(run(generate, b, prompt, *args).stdout)
        p = run(generate, b, prompt, *args, "--backend", "tensorrt", env={"SPECEDGE_FAKE_GPU_STATS": "1"})
        got = json.loads(p.stdout)
        fake_stats(p.stderr)
        assert got["token_ids"] == ref["token_ids"]
        assert got["stats"]["drafter"] == "head"
        for key in ("drafted", "accepted", "accepted_histogram", "draft_calls"):
            assert got["stats"][key] == ref["stats"][key], key


def test_the_fakes_refuse_what_tensorrt_and_cuda_refuse(generate, bundle):
    """The refusals the runtime never reaches when it is right (a misaligned or missing address,
    an unset shape, a shape outside the profile, a capture without warm-up, a copy of the wrong
    direction or past an allocation), checked on the fakes themselves with a bundle's plan."""
    plan = pj.engines_root(bundle) / pj.device_tag(GPU_NAME, GPU_CC) / "target.plan"
    p = subprocess.run(
        [str(generate.with_name("specedge_fake_refusals")), str(plan)], capture_output=True, text=True, timeout=120
    )
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 0 and len(lines) == 14 and all(x.startswith("ok: ") for x in lines), p.stdout + p.stderr
    assert "never freed" not in p.stderr, p.stderr
