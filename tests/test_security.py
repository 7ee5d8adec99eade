"""Hostile bundles and hostile input (docs/security.md), tried the way an attacker would.

* Tampered bundles, each built from a tiny exported bundle, each pointing (where it can) at a
  secret file next to the bundle: every one must end `specedge generate` with exit code 2 and one
  `error:` line saying what is wrong, open nothing outside the bundle (an audit hook on `open`,
  and the paths handed to ONNX Runtime, recorded inside the CLI's process), and leave every file
  as it was. The C++ CLI gets the same bundles; there `strace` records every file it opens.
* Bad input on good bundles: invalid UTF-8 (argument, stdin, a chat line), bounds, closed stdout.
* Hostile chat templates (limits), the protobuf reader against the onnx package, concurrency on
  one pipeline, and the onnxruntime floor.

All cases of one kind run in one child process (one import of onnxruntime), so the suite stays fast.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specedge.errors import BackendError

REPO = Path(__file__).resolve().parents[1]
CPP_BUILD = Path(os.environ.get("SPECEDGE_CPP_BUILD", REPO / "cpp" / "build"))
CPP_GENERATE = CPP_BUILD / "specedge_generate"
SECRET = b"the secret outside the bundle\n"

# Runs CLI cases in one process: per case the argv, stdin bytes and, recorded, the exit code,
# stderr, every path Python code opened (audit hook) and every graph handed to ONNX Runtime.
RUNNER = r"""
import io, json, os, sys
cases = json.load(open(sys.argv[1]))
state = {"opened": None}
def hook(event, args):
    if event == "open" and state["opened"] is not None and isinstance(args[0], (str, bytes)):
        state["opened"].append(os.path.abspath(os.fsdecode(args[0])))
sys.addaudithook(hook)
import onnxruntime as ort
handed = []
class Spy(ort.InferenceSession):
    def __init__(self, model, *a, **k):
        handed.append(str(model))
        super().__init__(model, *a, **k)
ort.InferenceSession = Spy
from specedge.cli.main import main
results = []
real = sys.stdin, sys.stdout, sys.stderr
for case in cases:
    out, err = io.StringIO(), io.StringIO()
    sys.stdin = io.TextIOWrapper(io.BytesIO(case["stdin"].encode("latin-1")), encoding="utf-8")
    sys.stdout, sys.stderr = out, err
    state["opened"], handed[:] = [], []
    argv = [os.fsdecode(a.encode("latin-1")) for a in case["argv"]]
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException as e:
        rc = "raised " + type(e).__name__
    finally:
        sys.stdin, sys.stdout, sys.stderr = real
    results.append({"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(),
                    "opened": state["opened"], "handed": list(handed)})
    state["opened"] = None
json.dump(results, open(sys.argv[2], "w"))
"""


def run_batch(cases: list[dict], tmp: Path) -> list[dict]:
    """cases: {"argv": [str], "stdin": bytes}; argv strings may carry raw bytes as latin-1."""
    spec = tmp / "cases.json"
    res = tmp / "results.json"
    spec.write_text(json.dumps([{"argv": c["argv"], "stdin": c.get("stdin", b"").decode("latin-1")} for c in cases]))
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-c", RUNNER, str(spec), str(res)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(res.read_text())


def snapshot(root: Path) -> dict:
    """Every file under root (links not followed) with its size and sha256: what "left as it was" means."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            if p.is_symlink():
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            else:
                out[str(p.relative_to(root))] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def one_error_line(stderr: str, usage_ok: bool = False) -> str:
    """The one `error: ` line stderr must be (argparse's own errors print their usage first)."""
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if usage_ok and lines and lines[0].startswith("usage: "):
        lines = [ln for ln in lines if not ln.startswith(("usage: ", " "))]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# ----------------------------------------------------------------------------- tampering helpers


def rehash(bundle: Path) -> None:
    """Make the manifest's checksums match the files again, so a tampered file gets past the
    checksum check and meets the check under test."""
    mpath = bundle / "manifest.json"
    m = json.loads(mpath.read_text())
    for rel in m["files"]:
        p = bundle / rel
        if p.is_file():
            data = p.read_bytes()
            m["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    mpath.write_text(json.dumps(m, indent=2))


def edit_manifest(bundle: Path, fn) -> None:
    mpath = bundle / "manifest.json"
    m = json.loads(mpath.read_text())
    fn(m)
    mpath.write_text(json.dumps(m, indent=2))


def set_location(bundle: Path, location: str, graph: str = "target/model.onnx", list_it: bool = False) -> None:
    """Point the first external tensor of `graph` at `location` (and, with list_it, list it)."""
    import onnx

    path = bundle / graph
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    e.value = location
            break
    else:
        raise AssertionError("no external tensor")
    path.write_bytes(model.SerializeToString())
    if list_it:
        rel = os.path.normpath(os.path.join(os.path.dirname(graph), location))

        def add(m):
            for g in m["models"][graph.split("/")[0]]["graphs"]:
                if g["path"] == graph:
                    g["external_data"].append(rel)
            m["files"][rel] = {"sha256": "0" * 64, "bytes": 0}

        edit_manifest(bundle, add)
    rehash(bundle)


def replace_file(bundle: Path, rel: str, data: bytes) -> None:
    (bundle / rel).write_bytes(data)
    rehash(bundle)


def link_out(bundle: Path, rel: str) -> None:
    """Replace bundle/rel by a link to the secret next to the bundle (and re-checksum through it)."""
    p = bundle / rel
    p.unlink()
    os.symlink(os.path.relpath(bundle.parent / "secret.bin", p.parent), p)
    rehash(bundle)


def absurd_geometry(m: dict) -> None:
    m["max_seq"] = 1 << 20
    m["spec"]["prefill_chunk"] = 16
    for role in ("target", "draft"):
        m["models"][role].update(num_layers=512, num_kv_heads=1024, head_dim=1024)


def nest(bundle: Path) -> None:
    (bundle / "manifest.json").write_text('{"schema_version": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")


def template(text: str):
    return lambda b: replace_file(b, "chat_template.jinja", text.encode())


def _no_eos(m):
    m["tokenizer"]["eos_token_ids"] = []


def _unlisted_copy(b: Path):
    shutil.copy(b / "target" / "model.onnx.data", b / "target" / "other.data")
    set_location(b, "other.data")


# (id, tamper(bundle), CLI args after the bundle, Python message, C++ message)
CPP_NO_JINJA = "not a format this runtime knows"  # the C++ runtime formats ChatML/Gemma, it runs no template
TAMPERED = [
    (
        "location-absolute",
        lambda b: set_location(b, str(b.parent / "secret.bin")),
        [],
        "reads weights from '/",
        "reads weights from '/",
    ),
    ("location-dotdot", lambda b: set_location(b, "../../secret.bin"), [], "outside the bundle", "outside the bundle"),
    (
        "location-dotdot-inside",
        lambda b: set_location(b, "../target/model.onnx.data"),
        [],
        "outside the bundle",
        "outside the bundle",
    ),
    (
        "location-backslash",
        lambda b: set_location(b, "..\\..\\secret.bin"),
        [],
        "outside the bundle",
        "outside the bundle",
    ),
    ("location-drive", lambda b: set_location(b, "C:/secret.bin"), [], "outside the bundle", "outside the bundle"),
    ("location-empty", lambda b: set_location(b, ""), [], "outside the bundle", "outside the bundle"),
    ("location-unlisted", _unlisted_copy, [], "does not list", "does not list"),
    (
        "location-nul",
        lambda b: set_location(b, "model.onnx.data\x00/../../secret.bin"),
        [],
        "outside the bundle",
        "outside the bundle",
    ),
    (
        "location-in-draft-graph",
        lambda b: set_location(b, "/etc/hostname", graph="draft/model.onnx"),
        [],
        "the draft graph 'draft/model.onnx' reads weights from '/etc/hostname'",
        "the draft graph 'draft/model.onnx' reads weights from '/etc/hostname'",
    ),
    (
        "location-link-out",
        lambda b: (
            os.symlink("../../secret.bin", b / "target" / "evil.data"),
            set_location(b, "evil.data", list_it=True),
        ),
        [],
        "(through a link)",
        "(through a link)",
    ),
    (
        "graph-garbage",
        lambda b: replace_file(b, "target/model.onnx", b"\x0a\xff\xff\xff\xff\xff"),
        [],
        "not a usable ONNX file",
        "not a usable ONNX file",
    ),
    ("graph-empty", lambda b: replace_file(b, "target/model.onnx", b""), [], "it is empty", "it is empty"),
    (
        "graph-wire-group",
        lambda b: replace_file(b, "target/model.onnx", b"\x0b\x0c"),
        [],
        "not a valid ONNX protobuf",
        "not a valid ONNX protobuf",
    ),
    ("graph-link-out", lambda b: link_out(b, "target/model.onnx"), [], "(through a link)", "(through a link)"),
    ("data-link-out", lambda b: link_out(b, "target/model.onnx.data"), [], "(through a link)", "(through a link)"),
    (
        "manifest-link-out",
        lambda b: (
            os.replace(b / "manifest.json", b.parent / "secret.json"),
            os.symlink("../secret.json", b / "manifest.json"),
        ),
        [],
        "(through a link)",
        "(through a link)",
    ),
    (
        "manifest-not-json",
        lambda b: (b / "manifest.json").write_text("{ not json"),
        [],
        "not valid JSON",
        "not valid JSON",
    ),
    ("manifest-nested", nest, [], "nests its values too deeply", "lacks 'max_seq'"),
    (
        "manifest-not-utf8",
        lambda b: (b / "manifest.json").write_bytes(b'{"a": "\xff\xfe"}'),
        [],
        "not UTF-8",
        "not valid JSON",
    ),
    (
        "manifest-huge",
        lambda b: (b / "manifest.json").write_bytes(b" " * (65 << 20)),
        [],
        "larger than 64 MiB",
        "larger than 64 MiB",
    ),
    (
        "schema-99",
        lambda b: edit_manifest(b, lambda m: m.update(schema_version=99)),
        [],
        "schema version 99",
        "schema version 99",
    ),
    (
        "graph-path-out",
        lambda b: edit_manifest(b, lambda m: m["models"]["target"]["graphs"][0].update(path="../../secret.bin")),
        [],
        "outside the bundle",
        "outside the bundle",
    ),
    (
        "graph-path-absolute",
        lambda b: edit_manifest(
            b, lambda m: m["models"]["target"]["graphs"][0].update(path=str(b.parent / "secret.bin"))
        ),
        [],
        "outside the bundle",
        "outside the bundle",
    ),
    (
        "tokenizer-path-absolute",
        lambda b: edit_manifest(b, lambda m: m["tokenizer"].update(files=[str(b.parent / "secret.bin")])),
        [],
        "outside the bundle",
        "outside the bundle",
    ),
    (
        "external-data-listed-out",
        lambda b: edit_manifest(
            b, lambda m: m["models"]["target"]["graphs"][0]["external_data"].append("../secret.bin")
        ),
        [],
        "outside the bundle",
        "outside the bundle",
    ),
    (
        "template-link-out",
        lambda b: link_out(b, "chat_template.jinja"),
        ["--chat"],
        "(through a link)",
        "(through a link)",
    ),
    (
        "checksum",
        lambda b: (b / "tokenizer_config.json").write_text("{}"),
        [],
        "checksum mismatch",
        "checksum mismatch",
    ),
    ("data-missing", lambda b: (b / "target" / "model.onnx.data").unlink(), [], "is missing", "is missing"),
    (
        "unlisted-reference",
        lambda b: edit_manifest(b, lambda m: m["files"].pop("chat_template.jinja")),
        [],
        "lists no checksum",
        "lists no checksum",
    ),
    (
        "files-malformed",
        lambda b: edit_manifest(b, lambda m: m["files"].update(x={"sha256": 3})),
        [],
        "is malformed",
        "is malformed",
    ),
    (
        "layers-out-of-bounds",
        lambda b: edit_manifest(b, lambda m: m["models"]["target"].update(num_layers=100000)),
        [],
        "outside 1..512",
        "outside 1..512",
    ),
    (
        "geometry-absurd",
        lambda b: edit_manifest(b, absurd_geometry),
        [],
        "more than this machine's",
        "lacks input",
    ),  # C++ compares the graph first; its KV check (1 TiB) comes at allocation
    ("eos-empty", lambda b: edit_manifest(b, _no_eos), [], "eos_token_ids", "eos_token_ids"),
    (
        "vocab-short",
        lambda b: edit_manifest(b, lambda m: m["models"]["draft"].update(vocab_size=2)),
        [],
        "the draft's vocabulary (2 ids) does not cover the 256 ids the target and the tokenizer share",
        "the draft's vocabulary (2 ids) does not cover the 256 ids the target and the tokenizer share",
    ),
    (
        "tokenizer-garbage",
        lambda b: replace_file(b, "tokenizer.json", b'{"version": 1}'),
        [],
        "cannot read the bundle's tokenizer.json",
        "tokenizer.json has no model",
    ),
    (
        "template-nested-loops",
        template("{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}"),
        ["--chat"],
        "the chat template was stopped",
        CPP_NO_JINJA,
    ),
    (
        "template-silent-loops",
        template("{% set s = 'a' * 3000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"),
        ["--chat"],
        "loop iterations",
        CPP_NO_JINJA,
    ),
    ("template-range", template("{{ range(10**9)|list }}"), ["--chat"], "the chat template was stopped", CPP_NO_JINJA),
    ("template-include", template("{% include 'x' %}"), ["--chat"], "no loader", CPP_NO_JINJA),
    ("template-import", template("{% import '/etc/passwd' as p %}"), ["--chat"], "no loader", CPP_NO_JINJA),
    ("template-escape", template("{{ ''.__class__.__mro__[1].__subclasses__() }}"), ["--chat"], "unsafe", CPP_NO_JINJA),
    ("template-blowup", template("{{ 'a' * 10**10 }}"), ["--chat"], "larger than", CPP_NO_JINJA),
    ("template-width", template("{{ '%01000000000d' % 1 }}"), ["--chat"], "field width", CPP_NO_JINJA),
    (
        "template-recursion",
        template("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
        ["--chat"],
        "recursed too deeply",
        CPP_NO_JINJA,
    ),
]


@pytest.fixture(scope="module")
def tampered(tiny_bundle_factory, tmp_path_factory):
    """Each tampered bundle in its own folder next to a secret file, the CLI run on all of them
    (one child process), and snapshots of every folder before and after."""
    base = tiny_bundle_factory()
    root = tmp_path_factory.mktemp("hostile")
    dirs, cases, before = {}, [], {}
    for name, tamper, extra, _, _ in TAMPERED:
        d = root / name
        d.mkdir()
        (d / "secret.bin").write_bytes(SECRET)
        shutil.copytree(base, d / "bundle", symlinks=False)
        tamper(d / "bundle")
        dirs[name] = d
        before[name] = snapshot(d)
        cases.append({"argv": ["generate", str(d / "bundle"), "hi", "--max-new-tokens", "4", "--threads", "1", *extra]})
    results = dict(zip(dirs, run_batch(cases, root)))
    return dirs, results, before


def inside(path: str, root: Path) -> bool:
    real = os.path.realpath(path)
    r = os.path.realpath(root)
    return real == r or real.startswith(r + os.sep)


@pytest.mark.parametrize("name,tamper,extra,message,cpp_message", TAMPERED, ids=[t[0] for t in TAMPERED])
def test_tampered_bundle_python(tampered, name, tamper, extra, message, cpp_message):
    dirs, results, before = tampered
    r, d = results[name], dirs[name]
    assert r["rc"] == 2, r
    line = one_error_line(r["stderr"])
    assert message in line, line
    assert r["stdout"] == ""
    # nothing outside the bundle was opened: the folder holds only the bundle and the secrets
    strays = [p for p in r["opened"] if inside(p, d) and not inside(p, d / "bundle")]
    assert not strays, strays
    secrets = {os.path.realpath(d / "secret.bin"), os.path.realpath(d / "secret.json")}
    assert not secrets & {os.path.realpath(p) for p in r["opened"]}, r["opened"]
    # no graph of a refused bundle reached ONNX Runtime, except where the refusal is about the
    # template or the tokenizer, which come after the graphs are known to be sound
    if not name.startswith(("template-", "tokenizer-")):
        assert r["handed"] == [], r["handed"]
    for path in r["handed"]:
        assert inside(path, d / "bundle"), path
    assert snapshot(d) == before[name]  # nothing written, nothing left half-written


@pytest.fixture(scope="module")
def strace():
    exe = shutil.which("strace")
    if not exe:
        pytest.skip("strace not installed: it records the files the C++ runtime opens")
    return exe


@pytest.mark.skipif(not CPP_GENERATE.is_file(), reason=f"C++ build not found at {CPP_BUILD} (see docs/cpp.md)")
@pytest.mark.parametrize("name,tamper,extra,message,cpp_message", TAMPERED, ids=[t[0] for t in TAMPERED])
def test_tampered_bundle_cpp(tampered, strace, tmp_path, name, tamper, extra, message, cpp_message):
    dirs, _, before = tampered
    d = dirs[name]
    log = tmp_path / "opens.txt"
    p = subprocess.run(
        [
            strace,
            "-f",
            "-qq",
            "-e",
            "trace=open,openat",
            "-o",
            str(log),
            str(CPP_GENERATE),
            str(d / "bundle"),
            "hi",
            "--max-new-tokens",
            "4",
            "--threads",
            "1",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, (p.returncode, p.stderr)
    line = one_error_line(p.stderr)
    assert cpp_message in line, line
    opened = re.findall(r'open(?:at)?\((?:AT_FDCWD|\d+), "([^"]*)"', log.read_text())
    assert opened, "strace recorded no open"
    strays = [o for o in opened if inside(o, d) and not inside(o, d / "bundle")]
    assert not strays, strays
    assert snapshot(d) == before[name]


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def good(tiny_bundle_factory, tmp_path_factory):
    """A good bundle in a folder of its own (so an open outside it shows), and the n-gram one."""
    root = tmp_path_factory.mktemp("good")
    shutil.copytree(tiny_bundle_factory(), root / "bundle", symlinks=False)
    (root / "secret.bin").write_bytes(SECRET)
    return root


RAW_BAD = "\xff\xfe"  # bytes 0xff 0xfe (not UTF-8), carried to the runner's argv as latin-1

# (id, argv after "generate BUNDLE" or a full argv with {B}, stdin bytes, exit code, message)
BAD_INPUTS = [
    ("prompt-not-utf8", ["generate", "{B}", "caf" + RAW_BAD], b"", 2, "the prompt is not valid UTF-8 text"),
    ("stdin-not-utf8", ["generate", "{B}", "-"], b"ab\xffc", 2, "the prompt read from stdin is not valid UTF-8"),
    ("stdin-empty", ["generate", "{B}", "-"], b"", 2, "the prompt is empty"),
    ("prompt-empty", ["generate", "{B}", ""], b"", 2, "the prompt is empty"),
    ("stop-not-utf8", ["generate", "{B}", "hi", "--stop", RAW_BAD], b"", 2, "--stop is not valid UTF-8"),
    (
        "system-not-utf8",
        ["generate", "{B}", "hi", "--chat", "--system", RAW_BAD],
        b"",
        2,
        "--system is not valid UTF-8",
    ),
    ("threads-huge", ["generate", "{B}", "hi", "--threads", "100000"], b"", 2, "--threads must be <= 1024"),
    ("threads-zero", ["generate", "{B}", "hi", "--threads", "0"], b"", 2, "--threads must be >= 1"),
    (
        "max-new-zero",
        ["generate", "{B}", "hi", "--max-new-tokens", "0"],
        b"",
        2,
        "--max-new-tokens must be an integer >= 1",
    ),
    ("top-p-zero", ["generate", "{B}", "hi", "--top-p", "0"], b"", 2, "--top-p must be in (0, 1]"),
    ("temperature-negative", ["generate", "{B}", "hi", "--temperature", "-1"], b"", 2, "--temperature"),
    ("temperature-nan", ["generate", "{B}", "hi", "--temperature", "nan"], b"", 2, "--temperature"),
    ("temperature-inf", ["generate", "{B}", "hi", "--temperature", "inf"], b"", 2, "--temperature"),
    ("spec-tokens-17", ["generate", "{B}", "hi", "--spec-tokens", "17"], b"", 2, "--spec-tokens"),
    (
        "seed-negative",
        ["generate", "{B}", "hi", "--seed", "-1"],
        b"",
        2,
        "--seed must be an integer from 0 to 18446744073709551615 (2^64-1), got -1",
    ),
    ("stop-empty", ["generate", "{B}", "hi", "--stop", ""], b"", 2, "--stop strings must not be empty"),
    ("system-without-chat", ["generate", "{B}", "hi", "--system", "x"], b"", 2, "--system needs --chat"),
    ("backend-unknown", ["generate", "{B}", "hi", "--backend", "gpu9000"], b"", 2, "unknown backend"),
    ("prompt-too-long", ["generate", "{B}", "word " * 400, "--threads", "1"], b"", 2, "context holds"),
    ("bundle-missing", ["generate", "{B}/nope", "hi"], b"", 2, "does not exist"),
    ("bundle-is-a-file", ["generate", "{B}/manifest.json", "hi"], b"", 2, "is not a folder"),
    ("verify-choice", ["generate", "{B}", "hi", "--verify", "most"], b"", 2, "invalid choice"),
    ("unknown-option", ["generate", "{B}", "hi", "--frobnicate"], b"", 2, "unrecognized arguments"),
    ("inspect-missing", ["inspect", "{B}/nope"], b"", 2, "does not exist"),
    (
        "plan-max-seq",
        ["plan", "{B}", "--memory-gb", "8", "--max-seq", "0"],
        b"",
        2,
        "--max-seq must be between 1 and 1048576, got 0",
    ),
    (
        "plan-memory",
        ["plan", "{B}", "--memory-gb", "-1"],
        b"",
        2,
        "--memory-gb must be more than 0 and at most 1048576 GiB, got -1",
    ),
]


@pytest.fixture(scope="module")
def bad_input_results(good, tmp_path_factory):
    bundle = str(good / "bundle")
    before = snapshot(good)
    cases = [{"argv": [a.replace("{B}", bundle) for a in argv], "stdin": stdin} for _, argv, stdin, _, _ in BAD_INPUTS]
    results = run_batch(cases, tmp_path_factory.mktemp("bad_runs"))
    assert snapshot(good) == before
    return dict(zip([b[0] for b in BAD_INPUTS], results))


@pytest.mark.parametrize("name,argv,stdin,code,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(bad_input_results, good, name, argv, stdin, code, message):
    r = bad_input_results[name]
    assert r["rc"] == code, r
    line = one_error_line(r["stderr"], usage_ok=name in ("verify-choice", "unknown-option"))
    assert message in line, line
    strays = [p for p in r["opened"] if inside(p, good) and not inside(p, good / "bundle")]
    assert not strays, strays


def test_chat_survives_a_line_that_is_not_utf8(good):
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "chat", str(good / "bundle"), "--max-new-tokens", "3", "--threads", "1"],
        input=b"hello\n\xff\xfe oops\nbye\n",
        capture_output=True,
        timeout=300,
        cwd=REPO,
    )
    err = p.stderr.decode()
    assert p.returncode == 0, err
    assert "Traceback" not in err
    assert err.count("error: that line is not valid UTF-8 (byte 0xff at offset 0); nothing was sent") == 1, err
    assert len(p.stdout.decode().splitlines()) == 2  # both good lines were answered


def _closed_stdout_run(argv: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    """Run with stdout a pipe whose reader has already gone (`... | head` after head exits)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(argv, stdout=w, stderr=subprocess.PIPE, input=stdin, text=True, timeout=300, cwd=REPO)
    finally:
        os.close(w)


@pytest.mark.parametrize(
    "args",
    [
        ["inspect"],
        ["inspect", "--json"],
        ["generate", "hi", "--threads", "1"],
        ["generate", "hi", "--threads", "1", "--json"],
        ["chat", "--threads", "1"],
        ["plan", "--memory-gb", "8"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_closed_stdout(good, args):
    cmd = [sys.executable, "-m", "specedge", args[0], str(good / "bundle"), *args[1:]]
    p = _closed_stdout_run(cmd, stdin="hello\nagain\n")
    assert p.returncode == 0, p.stderr
    assert p.stderr == "", p.stderr


@pytest.mark.skipif(not CPP_GENERATE.is_file(), reason=f"C++ build not found at {CPP_BUILD} (see docs/cpp.md)")
def test_cpp_bad_input(good):
    b = str(good / "bundle")
    cases = [
        (["caf\xc3"], "the prompt is not valid UTF-8 text"),
        (["hi", "--threads", "100000"], "--threads must be <= 1024"),
        (["hi", "--max-new-tokens", str(1 << 31)], "--max-new-tokens must be <= 1073741824"),
        (["hi", "--top-k", str(1 << 31)], "--top-k must be <= 1073741824"),
        (["hi", "--stop", "\xff"], "a stop string is not valid UTF-8 text"),
    ]
    for args, message in cases:
        argv = [os.fsencode(str(CPP_GENERATE)), os.fsencode(b)] + [a.encode("latin-1") for a in args]
        p = subprocess.run(argv, capture_output=True, timeout=120)
        assert p.returncode == 2, (args, p.stderr)
        assert message in one_error_line(p.stderr.decode("utf-8", "replace")), args
    p = subprocess.run([str(CPP_GENERATE), b, "-"], input=b"ab\xffc", capture_output=True, timeout=120)
    assert p.returncode == 2 and "not valid UTF-8" in one_error_line(p.stderr.decode())
    p = _closed_stdout_run([str(CPP_GENERATE), b, "hello", "--max-new-tokens", "40", "--threads", "1"])
    assert p.returncode == 0 and p.stderr == "", p.stderr


@pytest.mark.skipif(not CPP_GENERATE.is_file(), reason=f"C++ build not found at {CPP_BUILD} (see docs/cpp.md)")
def test_cpp_onnxruntime_refusal_is_a_bundle_error(tiny_bundle_factory, tmp_path):
    """A graph that parses as protobuf but that ONNX Runtime refuses is bad input (exit 2), as in Python."""
    import onnx

    b = Path(shutil.copytree(tiny_bundle_factory(), tmp_path / "b", symlinks=False))
    model = onnx.load(str(b / "target" / "model.onnx"), load_external_data=False)
    model.graph.node[0].op_type = "NoSuchOperator"
    (b / "target" / "model.onnx").write_bytes(model.SerializeToString())
    rehash(b)
    p = subprocess.run([str(CPP_GENERATE), str(b), "hi", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "ONNX Runtime" in one_error_line(p.stderr) or "graph" in one_error_line(p.stderr)
    py = subprocess.run(
        [sys.executable, "-m", "specedge", "generate", str(b), "hi", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert py.returncode == 2
    assert "ONNX Runtime cannot load the target graph" in one_error_line(py.stderr)


# ----------------------------------------------------------------------------- the protobuf reader


def _locations_by_onnx(model) -> list[str]:
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    seen: dict[str, None] = {}
    for t in _get_all_tensors(model):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location":
                    seen.setdefault(e.value)
    return list(seen)


def test_external_locations_match_onnx_on_exported_graphs(tiny_bundle_factory):
    import onnx

    from specedge.bundle_files import graph_locations

    for kv in ("scatter", "delta"):
        b = tiny_bundle_factory(kv_mode=kv)
        for rel in ("target/model.onnx", "draft/model.onnx"):
            want = _locations_by_onnx(onnx.load(str(b / rel), load_external_data=False))
            assert want and graph_locations(b / rel) == want


def test_external_locations_in_subgraphs_attributes_and_sparse_tensors():
    """Every place a tensor can sit: initializers, Constant attributes, If branches (nested),
    sparse initializers, functions. The reader finds what the onnx package finds."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from specedge.bundle_files import external_locations

    def ext(name, loc):
        t = numpy_helper.from_array(np.zeros(2, np.float32), name)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=loc)
        t.external_data.add(key="offset", value="0")
        return t

    inner_then = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=ext("v3", "deep.bin"))],
        "then",
        [],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])],
    )
    inner_else = helper.make_graph(
        [], "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])], initializer=[ext("e", "else.bin")]
    )
    cond = helper.make_node("If", ["b"], ["y"], then_branch=inner_then, else_branch=inner_else)
    outer_then = helper.make_graph(
        [cond], "outer_then", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]
    )
    top = helper.make_node("If", ["b"], ["z"], then_branch=outer_then, else_branch=inner_else)
    sparse = helper.make_sparse_tensor(
        ext("sv", "sparse_values.bin"), numpy_helper.from_array(np.array([0], np.int64), "si"), [4]
    )
    graph = helper.make_graph(
        [top, helper.make_node("Constant", [], ["k"], value=ext("v1", "const.bin"))],
        "g",
        [helper.make_tensor_value_info("b", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
        initializer=[ext("w", "weights.bin"), numpy_helper.from_array(np.ones(3, np.float32), "inl")],
        sparse_initializer=[sparse],
    )
    fn = helper.make_function(
        "local",
        "f",
        [],
        ["o"],
        [helper.make_node("Constant", [], ["o"], value=ext("fv", "fn.bin"))],
        [helper.make_opsetid("", 21)],
    )
    model = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 21)])
    data = model.SerializeToString()
    got = external_locations(data)
    want = _locations_by_onnx(model)
    assert set(got) >= set(want) and {"deep.bin", "else.bin", "const.bin", "weights.bin", "sparse_values.bin"} <= set(
        got
    )
    assert "fn.bin" in got  # functions: onnx's helper does not walk them, ONNX Runtime inlines them
    with pytest.raises(ValueError, match="not a valid ONNX protobuf"):
        external_locations(data[: len(data) // 2])
    # nesting deeper than the limit is refused, not recursed into
    leaf = helper.make_graph([], "leaf", [], [])
    g = leaf
    for i in range(25):  # 75 message levels; one branch deeper per level (both would double the size)
        g = helper.make_graph([helper.make_node("If", ["b"], ["y"], then_branch=g, else_branch=leaf)], f"n{i}", [], [])
    with pytest.raises(ValueError, match="nests subgraphs"):
        external_locations(helper.make_model(g).SerializeToString())


# ----------------------------------------------------------------------------- chat templates


HOSTILE_TEMPLATES = [
    ("{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}", "was stopped"),
    ("{% set s = 'a' * 3000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "loop iterations"),
    ("{{ range(10**9)|list }}", "at most 100,000"),
    ("{% include 'x' %}", "no loader"),
    ("{% extends 'base' %}", "no loader"),
    ("{{ 'a' * 10**9 }}", "larger than"),
    ("{{ 'a'|center(10**9) }}", "at most 100,000"),
    ("{{ '%01000000000d' % 1 }}", "field width"),
    ("{{ '{:>1000000000}'.format(1) }}", "field width"),
    ("{{ lipsum(10**8) }}", "at most 100,000"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "larger than"),
    ("{{ ('a' * 1000000)|replace('', 'bbbbbbbbbbbbbbbbbbbb') }}", "larger than"),
    ("{% for i in range(100000) %}{{ 'x' * 99 }}{% endfor %}", "output passed"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
    ("{{ raise_exception('no system role') }}", "refused the messages: no system role"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for %}", "invalid"),
]


@pytest.mark.parametrize("source,message", HOSTILE_TEMPLATES)
def test_hostile_chat_template(source, message):
    from specedge.runtime.chat_template import ChatTemplate, ChatTemplateError

    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=re.escape(message)) as e:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 10


def test_chat_template_time_limit_without_output_or_calls():
    """The deadline holds when the template neither yields nor calls anything: loop iterations
    check it (here with the iteration budget lifted)."""
    from specedge.runtime.chat_template import ChatTemplate, ChatTemplateError, TemplateLimits

    limits = TemplateLimits(seconds=0.3, max_iterations=10**12)
    t = ChatTemplate("{% set s = 'a' * 3000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", limits)
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"ran longer than 0.3 s"):
        t.render([{"role": "user", "content": "hi"}])
    assert time.monotonic() - t0 < 2.0


def test_chat_template_renders_ordinary_templates_and_limits_are_per_render():
    from specedge.runtime.chat_template import ChatTemplate, TemplateLimits

    src = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    t = ChatTemplate(src, TemplateLimits(max_iterations=3))
    msgs = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    for _ in range(3):  # the budget is per render: three renders of two iterations each
        assert t.render(msgs) == want
    # numbers that are data, not sizes, pass: formatted values, namespace fields, defaults
    data = ChatTemplate(
        "{% set ns = namespace(total=1000000) %}{{ '%d|{}'|format(123456789) }} "
        "{{ '{}'.format(987654321) }} {{ ns.total }} {{ missing|default(5000000) }} {{ '%d' % 7000000 }}"
    )
    assert data.render(msgs) == "123456789|{} 987654321 1000000 5000000 7000000"
    results, errors = [], []

    def worker():
        try:
            results.append(t.render(msgs))
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and results == [want] * 8


# ----------------------------------------------------------------------------- concurrency


PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def shared_pipe(tiny_bundle_factory):
    from specedge.runtime.api import load

    with load(tiny_bundle_factory(), threads=1) as pipe:
        yield pipe


def test_generate_from_threads_on_one_pipeline_equals_one_thread(shared_pipe):
    want = {p: shared_pipe.generate(p, max_new_tokens=16).token_ids for p in PROMPTS}
    got, errors = [], []

    def worker(prompt):
        try:
            got.append((prompt, shared_pipe.generate(prompt, max_new_tokens=16).token_ids))
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(PROMPTS[i % len(PROMPTS)],)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 12 and all(ids == want[p] for p, ids in got)
    assert not shared_pipe.busy


def test_streams_on_one_pipeline(shared_pipe):
    from specedge.runtime.api import PipelineBusyError

    want = shared_pipe.generate(PROMPTS[0], max_new_tokens=12)
    s = shared_pipe.stream(PROMPTS[0], max_new_tokens=12)
    first = next(s)
    assert shared_pipe.busy
    # re-entrant use from the thread holding the open stream: a clear error, the stream unharmed
    with pytest.raises(PipelineBusyError, match="a stream this thread opened on it is still open"):
        shared_pipe.stream(PROMPTS[1], max_new_tokens=4)
    with pytest.raises(PipelineBusyError, match="generate|stream"):
        shared_pipe.generate(PROMPTS[1], max_new_tokens=4)
    # another thread waits its turn and then gets its own answer
    other = {}
    t = threading.Thread(target=lambda: other.update(ids=shared_pipe.generate(PROMPTS[1], max_new_tokens=8).token_ids))
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and "ids" not in other  # waiting, not interleaving
    text = first + "".join(s)
    t.join(timeout=60)
    assert text == want.text and s.result.token_ids == want.token_ids
    assert other["ids"] == shared_pipe.generate(PROMPTS[1], max_new_tokens=8).token_ids
    # a stream closed early, or dropped, frees the pipeline
    s2 = shared_pipe.stream(PROMPTS[2], max_new_tokens=12)
    next(s2)
    s2.close()
    assert not shared_pipe.busy
    s3 = shared_pipe.stream(PROMPTS[2], max_new_tokens=12)
    del s3
    assert not shared_pipe.busy
    # close() from the thread holding an open stream ends that stream first (a `finally` mid-stream)
    from specedge.runtime.api import load

    with load(shared_pipe.manifest.root, threads=1, warmup=False) as own:
        s5 = own.stream(PROMPTS[0], max_new_tokens=12)
        next(s5)
    assert not own.busy
    with pytest.raises(StopIteration):
        next(s5)
    # a stream that was never started holds it too, until closed
    with shared_pipe.stream(PROMPTS[3], max_new_tokens=4) as s4:
        assert shared_pipe.busy
        with pytest.raises(PipelineBusyError):
            shared_pipe.calibrate()
    assert s4.result is None and not shared_pipe.busy
    assert shared_pipe.generate(PROMPTS[0], max_new_tokens=12).token_ids == want.token_ids


def test_pipeline_api_refuses_bad_text_and_threads(shared_pipe, tiny_bundle_factory):
    from specedge.runtime.api import load

    with pytest.raises(ValueError, match="the prompt is not valid Unicode text"):
        shared_pipe.generate("caf\udcc3", max_new_tokens=2)
    with pytest.raises(ValueError, match="a message's content is not valid Unicode text"):
        shared_pipe.generate(messages=[{"role": "user", "content": "\ud800"}], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"threads must be an integer in 1\.\.1024, got 100000"):
        load(tiny_bundle_factory(), threads=100000)
    assert not shared_pipe.busy


# ----------------------------------------------------------------------------- onnxruntime floor


def test_onnxruntime_floor_is_the_version_the_code_checks():
    """pyproject's floor is ORT_MIN_VERSION, the version load() enforces; docs/security.md records the
    run on that version (and the refusal of the one before it)."""
    from specedge.runtime.ort_version import ORT_MIN_VERSION

    # read as text: tomllib is Python 3.11+, the project supports 3.10
    text = (REPO / "pyproject.toml").read_text()
    assert re.findall(r'"onnxruntime([<>=!~]=?[^"]*)"', text) == [f">={ORT_MIN_VERSION}"]
    assert re.findall(r'"onnxruntime-gpu([<>=!~]=?[^"]*)"', text) == [f">={ORT_MIN_VERSION}"]
    assert ORT_MIN_VERSION in (REPO / "docs" / "security.md").read_text()


def test_onnxruntime_older_than_the_floor_is_refused_in_one_sentence(tiny_bundle_factory, monkeypatch):
    import onnxruntime

    from specedge.runtime.api import load
    from specedge.runtime.backends.base import BackendError
    from specedge.runtime.ort_version import check_onnxruntime_version

    check_onnxruntime_version("1.24.1")
    check_onnxruntime_version("1.32.0+cu126")
    for old in ("1.23.2", "1.22.0", "1.9.1"):
        with pytest.raises(BackendError, match=rf"onnxruntime {re.escape(old)} is too old"):
            check_onnxruntime_version(old)
    monkeypatch.setattr(onnxruntime, "__version__", "1.23.2")
    with pytest.raises(BackendError, match=r"pip install -U 'onnxruntime>=1\.24\.1'"):
        load(tiny_bundle_factory(), threads=1)


# ----------------------------------------------------------------------------- exit codes


@pytest.mark.parametrize(
    "exc,code,line",
    [
        (
            RuntimeError("boom\nsecond line"),
            1,
            "error: internal error: RuntimeError: boom (run with --debug for the traceback)",
        ),
        (MemoryError(), 1, "error: out of memory"),
        (KeyboardInterrupt(), 130, "error: interrupted"),
        (BrokenPipeError(), 0, None),
        (ValueError("a sentence\nand more"), 2, "error: a sentence"),
        # a write the system refused (exit 74, docs/security.md), a path that cannot be used (2), and a
        # multi-line message of ONNX Runtime's (its first line)
        (
            OSError(errno.ENOSPC, "No space left on device", "/out/b/model.onnx.data"),
            74,
            "error: cannot write '/out/b/model.onnx.data': No space left on device",
        ),
        (OSError(errno.EROFS, "Read-only file system"), 74, "error: cannot write an output: Read-only file system"),
        (
            PermissionError(errno.EACCES, "Permission denied", "/etc/x"),
            2,
            "error: cannot use '/etc/x': Permission denied",
        ),
        (
            BackendError(
                "ONNX Runtime failed to run the target graph: [ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION\n"
                "Status Message: bad\nStacktrace:\n  frame"
            ),
            2,
            "error: ONNX Runtime failed to run the target graph: [ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION",
        ),
    ],
)
def test_every_failure_is_one_line_with_its_exit_code(exc, code, line, capsys, monkeypatch):
    from specedge.cli import main as cli_main

    monkeypatch.setattr(cli_main, "_quiet_closed_stdout", lambda: None)  # keep pytest's stdout

    def fail(args):
        raise exc

    parser = cli_main._Parser(prog="t")
    parser.add_argument("--debug", action="store_true")
    parser.set_defaults(func=fail)
    assert cli_main.run_cli(parser, []) == code
    err = capsys.readouterr().err
    assert err.splitlines() == ([line] if line else [])
    if code in (1, 2):
        with pytest.raises(type(exc)):
            cli_main.run_cli(parser, ["--debug"])


def test_an_interrupt_through_exec_still_exits_130_under_python_m(tmp_path):
    # The standard library runs `exec` on strings (dataclasses, namedtuple); an interrupt that
    # unwinds through one sets CPython's "unhandled KeyboardInterrupt" flag, and under `python -m`
    # the interpreter would then kill itself with SIGINT (returncode -2) despite the 130.
    (tmp_path / "interrupted_cli.py").write_text(
        "from specedge.cli import main as m\n"
        "parser = m._Parser(prog='t')\n"
        "parser.set_defaults(func=lambda args: exec('raise KeyboardInterrupt'))\n"
        "m.exit_process(m.run_cli(parser, []))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[1])])}
    proc = subprocess.run(
        [sys.executable, "-m", "interrupted_cli"],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == ["error: interrupted"]
