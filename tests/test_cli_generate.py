"""`specedge generate` and `specedge chat` through a real subprocess: streaming, --json, stdin,
the REPL, every bad-input path (exit 2, one `error:` line, no traceback), and the rule that the
runtime and its CLI never import torch, transformers or the export code."""

import json
import os
import shutil
import subprocess
import sys

import onnxruntime as ort
import pytest

PROMPT = "def add(a, b):"


def cli(*args, stdin=None, timeout=180):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "specedge", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_user_error(p, *fragments, code=2):
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def bundle(tiny_bundle_factory):
    return tiny_bundle_factory()  # llama, fp32 target, int4 self draft, max_seq 128


def test_import_isolation():
    code = (
        "import specedge.runtime.api, specedge.cli.generate, specedge.cli.chat, sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or m.startswith('specedge.export')))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_generate_json_stream_stdin_and_no_spec(bundle):
    p = cli("generate", bundle, PROMPT, "--max-new-tokens", 12, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) >= {"text", "token_ids", "finish_reason", "stats"}
    assert out["finish_reason"] in ("length", "eos") and 1 <= len(out["token_ids"]) <= 12
    for key in (
        "tokens",
        "tokens_per_s",
        "ttft_s",
        "acceptance_rate",
        "mean_accepted",
        "accepted_histogram",
        "time_draft_s",
        "time_verify_s",
        "time_other_s",
        "k",
        "fallbacks",
    ):
        assert key in out["stats"], key
    plain = json.loads(cli("generate", bundle, PROMPT, "--max-new-tokens", 12, "--json", "--no-spec").stdout)
    assert plain["token_ids"] == out["token_ids"] and plain["stats"]["speculative"] is False
    streamed = cli("generate", bundle, PROMPT, "--max-new-tokens", 12, "--stats")
    assert streamed.returncode == 0 and streamed.stdout == out["text"] + "\n"
    assert streamed.stderr.startswith("stats: ") and "tok/s" in streamed.stderr
    piped = cli("generate", bundle, "-", "--max-new-tokens", 12, "--draft", "ngram", stdin=PROMPT + "\n")
    assert piped.returncode == 0 and piped.stdout == out["text"] + "\n"


def test_generate_chat_and_sampling(bundle):
    p = cli("generate", bundle, "hello there", "--chat", "--max-new-tokens", 8, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["finish_reason"] in ("length", "eos", "stop")
    args = (
        "generate",
        bundle,
        PROMPT,
        "--max-new-tokens",
        16,
        "--temperature",
        0.9,
        "--top-p",
        0.9,
        "--top-k",
        30,
        "--seed",
        7,
        "--json",
    )
    a, b = cli(*args), cli(*args)
    assert a.returncode == 0 and json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def test_chat_repl_with_piped_input(bundle):
    first = cli("generate", bundle, "hello", "--chat", "--max-new-tokens", 6, "--json")
    want = json.loads(first.stdout)["text"]
    p = cli("chat", bundle, "--max-new-tokens", 6, stdin="hello\n/reset\nhello\n\n/exit\nnever read\n")
    assert p.returncode == 0, p.stderr
    assert "(history cleared)" in p.stderr and "Traceback" not in p.stderr
    # after /reset the same question gets the same (greedy) answer as a fresh conversation
    assert p.stdout == f"{want}\n{want}\n"
    eof = cli("chat", bundle, "--max-new-tokens", 4, stdin="hi\nand again\n")  # EOF ends the session
    assert eof.returncode == 0 and eof.stdout.count("\n") >= 2


def _copy(bundle, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    return dst


def test_bundle_errors(bundle, tmp_path):
    assert_user_error(cli("generate", tmp_path / "nope", PROMPT), "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(cli("generate", empty, PROMPT), "no manifest.json")
    b = _copy(bundle, tmp_path)
    manifest = (b / "manifest.json").read_text()
    (b / "manifest.json").write_text("{ not json")
    assert_user_error(cli("generate", b, PROMPT), "not valid JSON")
    obj = json.loads(manifest)
    obj["schema_version"] = 99
    (b / "manifest.json").write_text(json.dumps(obj))
    assert_user_error(cli("generate", b, PROMPT), "schema version 99")
    (b / "manifest.json").write_text(manifest)
    data = next(p for p in sorted((b / "target").iterdir()) if p.suffix == ".data")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, different content
    data.write_bytes(bytes(raw))
    assert_user_error(cli("generate", b, PROMPT), "checksum mismatch")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
        (["--spec-tokens", "0"], "--spec-tokens must be between 1 and 16"),
        (["--spec-tokens", "17"], "--spec-tokens must be between 1 and 16"),
        (["--backend", "nope"], "unknown backend 'nope'"),
    ],
)
def test_argument_errors(bundle, args, fragment):
    assert_user_error(cli("generate", bundle, PROMPT, *args), fragment)


def test_prompt_errors(bundle):
    assert_user_error(cli("generate", bundle, ""), "prompt is empty")
    assert_user_error(cli("generate", bundle, "-", stdin=""), "prompt is empty")
    assert_user_error(cli("generate", bundle, "word " * 300), "context holds 128")


def test_backend_and_provider_errors(bundle):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here")
    line = assert_user_error(cli("generate", bundle, PROMPT, "--provider", "cuda"), "onnxruntime-gpu")
    assert "CUDAExecutionProvider" in line
    assert_user_error(
        cli("generate", bundle, PROMPT, "--provider", "OpenVINOExecutionProvider"), "onnxruntime-openvino"
    )
    assert_user_error(
        cli("generate", bundle, PROMPT, "--provider", "FooExecutionProvider"), "unknown execution provider"
    )
    line = assert_user_error(cli("generate", bundle, PROMPT, "--backend", "ort-cuda"))
    assert "onnxruntime-gpu" in line or "not available in this build" in line
