"""Issue 38, outside the server: write errors with their exit codes, one line per error, `plan`'s
numbers, one seed range, a closed pipeline, non-regular bundle files, `export-models --force` on
what is not verifiably a bundle, ONNX Runtime's telemetry files, and `train-draft`'s paths,
signals and leftovers. Python CLIs in subprocesses; the C++ CLIs when the build exists."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_generate import assert_user_error

REPO = Path(__file__).resolve().parents[1]
BUILD = Path(os.environ.get("SPECEDGE_CPP_BUILD", REPO / "cpp" / "build"))
CPP_GENERATE = BUILD / "specedge_generate"
CPP_CHAT = BUILD / "specedge_chat"
needs_cpp = pytest.mark.skipif(not CPP_GENERATE.is_file(), reason=f"C++ build not found at {BUILD} (see docs/cpp.md)")
SEED_MAX = 2**64 - 1
SEED_RULE = "must be an integer from 0 to 18446744073709551615 (2^64-1), got"


def cli(*args, stdin=None, timeout=300, stdout=None, env=None):
    env = dict(os.environ, PYTHONIOENCODING="utf-8", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "specedge", *map(str, args)],
        input=stdin,
        timeout=timeout,
        stdout=stdout if stdout is not None else subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )


def one_error(p, code: int, *fragments: str) -> str:
    return assert_user_error(p, *fragments, code=code)


@pytest.fixture(scope="module")
def bundle(tiny_bundle_factory):
    return tiny_bundle_factory()


# ----------------------------------------------------------------------------- write errors


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "hi", "--max-new-tokens", "4"],
        ["generate", "hi", "--max-new-tokens", "4", "--json"],
        ["inspect"],
        ["plan", "--memory-gb", "8"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_a_full_stdout_is_one_line_and_exit_74(bundle, args):
    with open("/dev/full", "w") as full:
        p = cli(args[0], bundle, *args[1:], stdout=full)
    one_error(p, 74, "cannot write to standard output: No space left on device")


def test_a_full_stdout_in_chat_and_no_stdout_at_all(bundle):
    with open("/dev/full", "w") as full:
        p = cli("chat", bundle, "--max-new-tokens", "4", stdin="hello\n", stdout=full)
    one_error(p, 74, "cannot write to standard output: No space left on device")
    # started without a descriptor 1 (`cmd >&-`): the same sentence, EBADF, in both runtimes
    cmds = [[sys.executable, "-m", "specedge", "inspect", str(bundle)]]
    if CPP_GENERATE.is_file():
        cmds.append([str(CPP_GENERATE), str(bundle), "hi", "--max-new-tokens", "2", "--threads", "1"])
    for cmd in cmds:
        p = subprocess.run(
            cmd,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            cwd=REPO,
            close_fds=True,
            preexec_fn=lambda: os.close(1),
        )
        one_error(p, 74, "cannot write to standard output: Bad file descriptor")


def test_the_exit_code_table_is_documented():
    from specedge import errors

    doc = (REPO / "docs" / "security.md").read_text()
    for code in (
        errors.EXIT_OK,
        errors.EXIT_FAULT,
        errors.EXIT_USAGE,
        errors.EXIT_WRITE,
        errors.EXIT_INTERRUPTED,
        errors.EXIT_TERMINATED,
    ):
        assert f"| {code} |" in doc, code


@needs_cpp
def test_cpp_generate_fails_on_a_full_stdout(bundle):
    for extra in ([], ["--json"]):
        with open("/dev/full", "w") as full:
            p = subprocess.run(
                [str(CPP_GENERATE), str(bundle), "hi", "--max-new-tokens", "4", "--threads", "1", *extra],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
            )
        one_error(p, 74, "cannot write to standard output: No space left on device")


@needs_cpp
def test_cpp_chat_with_a_closed_stdout_ends_quietly_and_a_full_one_fails(default_bundle):
    bundle = default_bundle  # a ChatML template, which the C++ runtime formats
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(
            [str(CPP_CHAT), str(bundle), "--max-new-tokens", "8", "--threads", "1"],
            stdout=w,
            stderr=subprocess.PIPE,
            input="hello\nagain\n",
            text=True,
            timeout=120,
        )
    finally:
        os.close(w)
    assert p.returncode == 0 and p.stderr == "", (p.returncode, p.stderr)  # not -SIGPIPE
    with open("/dev/full", "w") as full:
        p = subprocess.run(
            [str(CPP_CHAT), str(bundle), "--max-new-tokens", "8", "--threads", "1"],
            stdout=full,
            stderr=subprocess.PIPE,
            input="hello\nagain\n",
            text=True,
            timeout=120,
        )
    one_error(p, 74, "cannot write to standard output: No space left on device")


# ----------------------------------------------------------------------------- a closed pipeline


def test_a_closed_pipeline_says_so(bundle):
    from specedge.runtime.api import PipelineClosedError, load

    pipe = load(bundle, threads=1)
    assert pipe.generate("hi", max_new_tokens=2).token_ids
    pipe.close()
    pipe.close()  # twice is fine
    assert pipe.closed
    for call in (
        lambda: pipe.generate("hi", max_new_tokens=2),
        lambda: pipe.stream("hi", max_new_tokens=2),
        lambda: pipe.calibrate(),
    ):
        with pytest.raises(PipelineClosedError, match=r"the pipeline is closed: close\(\) freed its sessions"):
            call()
    assert not pipe.busy  # a refused request does not keep the pipeline


# ----------------------------------------------------------------------------- plan's numbers


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--memory-gb", "inf"], "--memory-gb must be a finite number of GiB, got inf"),
        (["--memory-gb", "nan"], "--memory-gb must be a finite number of GiB, got nan"),
        (["--memory-gb", "-8"], "--memory-gb must be more than 0 and at most 1048576 GiB, got -8"),
        (["--memory-gb", "0"], "--memory-gb must be more than 0 and at most 1048576 GiB, got 0"),
        (["--memory-gb", "1e300"], "--memory-gb must be more than 0 and at most 1048576 GiB, got 1e+300"),
        (["--memory-gb", "8", "--reserve-gb", "100"], "--reserve-gb 100 is not less than the device's memory (8 GiB)"),
        (["--device", "orin-nano-8gb", "--reserve-gb", "8"], "--reserve-gb 8 is not less than the device's memory"),
        (["--memory-gb", "8", "--reserve-gb", "inf"], "--reserve-gb must be a finite number of GiB, got inf"),
        (["--memory-gb", "8", "--reserve-gb", "-1"], "--reserve-gb must be >= 0, got -1"),
        (
            ["--memory-gb", "8", "--max-seq", str(10**14)],
            "--max-seq must be between 1 and 1048576, got 100000000000000",
        ),
        (["--memory-gb", "8", "--max-seq", "0"], "--max-seq must be between 1 and 1048576, got 0"),
    ],
)
def test_plan_checks_its_numbers(bundle, args, fragment):
    one_error(cli("plan", bundle, *args), 2, fragment)


def test_plan_still_plans_at_the_bounds(bundle):
    p = cli("plan", bundle, "--memory-gb", "8", "--max-seq", "1048576", "--json")
    assert p.returncode in (0, 3), p.stderr
    assert json.loads(p.stdout)["max_seq"] == 1048576


# ----------------------------------------------------------------------------- one seed range


@pytest.mark.parametrize("opt", ["--max-new-tokens", "--top-k"])
def test_generate_bounds_its_counts_as_the_cpp_cli(bundle, opt):
    one_error(cli("generate", bundle, "hi", opt, str(10**20)), 2, f"{opt} must be <= 1073741824, got {10**20}")


def test_one_seed_range_in_the_python_cli_and_api(bundle):
    from specedge.contract import SEED_MAX as contract_max

    assert contract_max == SEED_MAX
    for bad in ("-1", str(SEED_MAX + 1), str(10**30)):
        one_error(cli("generate", bundle, "hi", "--seed", bad), 2, f"--seed {SEED_RULE} {bad}")
    p = cli(
        "generate",
        bundle,
        "hi",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0.8",
        "--seed",
        str(SEED_MAX),
        "--json",
        "--threads",
        "1",
    )
    assert p.returncode == 0, p.stderr
    q = cli(
        "generate",
        bundle,
        "hi",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0.8",
        "--seed",
        str(SEED_MAX),
        "--json",
        "--threads",
        "1",
    )
    assert json.loads(p.stdout)["token_ids"] == json.loads(q.stdout)["token_ids"]


def test_one_seed_range_in_the_server_schema():
    pydantic = pytest.importorskip("pydantic")
    from specedge.serve.schemas import CompletionRequest

    CompletionRequest(prompt="hi", seed=SEED_MAX)
    for bad in (-1, SEED_MAX + 1):
        with pytest.raises(pydantic.ValidationError, match="seed"):
            CompletionRequest(prompt="hi", seed=bad)


@needs_cpp
def test_one_seed_range_in_the_cpp_cli(bundle):
    for bad in ("-1", str(SEED_MAX + 1), str(10**30)):
        p = subprocess.run(
            [str(CPP_GENERATE), str(bundle), "hi", "--seed", bad], capture_output=True, text=True, timeout=120
        )
        one_error(p, 2, f"--seed {SEED_RULE} {bad}")
    outs = [
        subprocess.run(
            [
                str(CPP_GENERATE),
                str(bundle),
                "hi",
                "--max-new-tokens",
                "4",
                "--temperature",
                "0.8",
                "--seed",
                str(SEED_MAX),
                "--json",
                "--threads",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for _ in range(2)
    ]
    assert outs[0].returncode == 0, outs[0].stderr
    assert json.loads(outs[0].stdout)["token_ids"] == json.loads(outs[1].stdout)["token_ids"]


# ----------------------------------------------------------------------------- non-regular bundle files


def _with_fifo(bundle: Path, tmp_path: Path, rel: str) -> Path:
    b = tmp_path / "b"
    shutil.copytree(bundle, b)
    (b / rel).unlink()
    os.mkfifo(b / rel)
    return b


@pytest.mark.parametrize("rel", ["tokenizer.json", "target/model.onnx"])
@pytest.mark.parametrize("verify", ["none", "size", "full"])
def test_a_named_pipe_in_the_bundle_is_refused_before_opening(bundle, tmp_path, rel, verify):
    b = _with_fifo(bundle, tmp_path, rel)
    one_error(
        cli("generate", b, "hi", "--verify", verify, timeout=60),
        2,
        f"the bundle's file '{rel}' is a named pipe, not a regular file: refused before opening it",
    )


@needs_cpp
@pytest.mark.parametrize("verify", ["none", "full"])
def test_cpp_refuses_a_named_pipe_before_opening(bundle, tmp_path, verify):
    b = _with_fifo(bundle, tmp_path, "target/model.onnx")
    p = subprocess.run(
        [str(CPP_GENERATE), str(b), "hi", "--verify", verify], capture_output=True, text=True, timeout=60
    )
    one_error(
        p, 2, "the bundle's file 'target/model.onnx' is a named pipe, not a regular file: refused before opening it"
    )


# ----------------------------------------------------------------------------- ONNX Runtime's telemetry files


def test_no_onnxruntime_files_under_home(bundle, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache")}
    env_clean = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    p = subprocess.run(
        [sys.executable, "-m", "specedge", "generate", str(bundle), "hi", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env_clean, **env},
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr
    assert not list(home.rglob("*")), list(home.rglob("*"))
    if CPP_GENERATE.is_file():
        p = subprocess.run(
            [str(CPP_GENERATE), str(bundle), "hi", "--max-new-tokens", "2"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env_clean, **env},
        )
        assert p.returncode == 0, p.stderr
        assert not list(home.rglob("*")), list(home.rglob("*"))


# ----------------------------------------------------------------------------- train-draft

TRAIN_ARGS = [
    "--draft-vocab",
    "48",
    "--seq-len",
    "32",
    "--batch",
    "2",
    "--answer-tokens",
    "16",
    "--max-prompts",
    "4",
    "--doc-tokens",
    "600",
    "--threads",
    "1",
    "--quiet",
]


@pytest.fixture
def feat(tiny_bundle_factory, tmp_path) -> Path:
    dst = tmp_path / "feat"
    shutil.copytree(tiny_bundle_factory("llama", features=True), dst)
    return dst


def _tree(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_draft_checks_its_paths_before_any_work(feat, tmp_path):
    before = _tree(feat)
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    cases = [
        (a_file, f"--checkpoint '{a_file}' exists and is not a folder"),
        (a_file / "sub", f"cannot create the checkpoint folder '{a_file / 'sub'}' (a file is in the way)"),
    ]
    ck_dir_file = tmp_path / "ck-dir"
    (ck_dir_file / "checkpoint.pt").mkdir(parents=True)
    cases.append((ck_dir_file, f"'{ck_dir_file / 'checkpoint.pt'}' in the checkpoint folder is not a regular file"))
    for ck, message in cases:
        t0 = time.monotonic()
        one_error(cli("train-draft", feat, "--checkpoint", ck, "--budget", "1k", *TRAIN_ARGS), 2, message)
        assert time.monotonic() - t0 < 120
        assert not (tmp_path / "ck-dir" / "data.npz").exists()
    assert a_file.read_text() == "mine"
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "checkpoint.pt").write_bytes(b"not a checkpoint")
    one_error(
        cli("train-draft", feat, "--checkpoint", damaged, "--budget", "1k", *TRAIN_ARGS),
        2,
        f"the checkpoint '{damaged / 'checkpoint.pt'}' cannot be read",
        "--no-resume",
    )
    assert _tree(feat) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root's permission override (runs as root in CI)")
def test_train_draft_refuses_a_bundle_it_cannot_write_before_any_work(feat, tmp_path):
    from test_export_cli import _drop_dac_caps

    os.chmod(feat, 0o555)
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "specedge",
                "train-draft",
                str(feat),
                "--checkpoint",
                str(tmp_path / "ck"),
                "--budget",
                "1k",
                *TRAIN_ARGS,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=_drop_dac_caps,
            cwd=REPO,
        )
    finally:
        os.chmod(feat, 0o755)
    one_error(p, 2, f"the bundle folder (the head is written into it) '{feat}' is not writable (Permission denied)")
    assert not (tmp_path / "ck" / "data.npz").exists()


def test_train_draft_removes_only_the_leftovers_that_are_its_own(feat, tmp_path):
    from specedge.errors import UserError
    from specedge.training.paths import clean_leftovers, lock_bundle

    (feat / ".head-0123abcd.partial").mkdir()
    (feat / ".head-0123abcd.partial" / "model.onnx").write_bytes(b"half")
    (feat / "head-89abcdef").mkdir()  # emptied while an old head was removed
    (feat / "head-deadbeef").mkdir()
    (feat / "head-deadbeef" / "notes.txt").write_text("mine")  # a head-like name, not ours
    (feat / ".head-feedf00d.partial").symlink_to(tmp_path)  # a link: never followed
    (feat / "head-0000000g").mkdir()  # not a head's name
    fd = lock_bundle(feat)
    try:
        with pytest.raises(UserError, match="another train-draft is training a head for"):
            lock_bundle(feat)
    finally:
        os.close(fd)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "checkpoint.tmp").write_bytes(b"half a checkpoint")  # a save that was killed
    one_error(
        cli("train-draft", feat, "--checkpoint", tmp_path / "ck", "--budget", "0.001m", *TRAIN_ARGS),
        2,
        "before the first training step",
    )
    assert not (tmp_path / "ck" / "checkpoint.tmp").exists()
    left = sorted(p.name for p in feat.iterdir() if "head" in p.name)
    assert left == [".head-feedf00d.partial", "head-0000000g", "head-deadbeef"], left
    assert (feat / "head-deadbeef" / "notes.txt").read_text() == "mine"
    assert clean_leftovers(feat, set()) == []


def test_train_draft_saves_its_checkpoint_when_interrupted_and_resumes(feat, tmp_path, monkeypatch):
    """Ctrl-C between checkpoints keeps the steps made since the last one; a later run resumes."""
    import torch

    from specedge.training import train as train_mod

    real, calls = train_mod._loss, []

    def interrupting(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(train_mod, "_loss", interrupting)
    opts = dict(
        budget="3k",
        draft_vocab=48,
        seq_len=32,
        batch=2,
        answer_tokens=16,
        max_prompts=4,
        doc_tokens=600,
        threads=1,
        checkpoint_every_s=3600.0,
        checkpoint=str(tmp_path / "ck"),
    )
    with pytest.raises(KeyboardInterrupt):
        train_mod.train_draft(feat, train_mod.TrainOptions(**opts))
    state = torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 3
    monkeypatch.setattr(train_mod, "_loss", real)
    seen = []
    train_mod.train_draft(
        feat,
        train_mod.TrainOptions(**{**opts, "budget": "1k"}),
        progress=lambda stage, d, t, info=None: seen.append(info["step"]) if info else None,
    )
    assert seen and seen[0] == 4  # went on from step 3


def test_train_draft_sigterm_saves_the_checkpoint_and_exits_143(feat, tmp_path):
    import threading

    ck = tmp_path / "ck"
    args = [a for a in TRAIN_ARGS if a != "--quiet"]  # the progress bars say when training runs
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specedge",
            "train-draft",
            str(feat),
            "--checkpoint",
            str(ck),
            "--budget",
            "100M",
            *args,
        ],
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    err = bytearray()

    def read():
        for chunk in iter(lambda: proc.stderr.read1(4096), b""):
            err.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while b"top-1" not in err and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert b"top-1" in err, err.decode()  # training steps are running, well inside 60 s of the first
        assert not (ck / "checkpoint.pt").exists()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(timeout=10)
    finally:
        proc.kill()
    text = err.decode()
    assert proc.returncode == 143, text
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    assert [line for line in lines if line.startswith("error:")] == [
        f"error: terminated: the bundle is as it was; the training so far is saved in '{ck}': run again to resume"
    ]
    assert lines[-1].startswith("error: terminated") and "Traceback" not in text
    assert (ck / "checkpoint.pt").is_file()


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--budget", "9" * 400], "--budget must be at most 1e15 tokens or 1e9 minutes"),
        (["--lr", "inf"], "--lr must be a finite number more than 0, got inf"),
        (["--steps", "1000000"], "--steps must be at most 64, got 1000000"),
        (["--seq-len", str(1 << 40)], "--seq-len must be at most 1048576"),
        (["--max-prompts", "0"], "--max-prompts must be an integer from 1 to 1048576, got 0"),
        (["--threads", "-2"], "--threads must be an integer from 1 to 1024, got -2"),
        (["--seed", str(SEED_MAX + 1)], f"--seed {SEED_RULE} {SEED_MAX + 1}"),
    ],
)
def test_train_draft_checks_its_numbers(feat, tmp_path, args, fragment):
    one_error(cli("train-draft", feat, "--checkpoint", tmp_path / "ck", *args), 2, fragment)
    assert not (tmp_path / "ck").exists()


def test_bench_seed_range(bundle):
    one_error(cli("bench", bundle, "--seed", str(SEED_MAX + 1), "--quick"), 2, f"--seed {SEED_RULE} {SEED_MAX + 1}")


def test_an_export_onto_a_full_disk_names_the_bundle_and_exits_74(tmp_path, monkeypatch, capsys):
    from specedge.cli import export_models
    from specedge.export import pipeline
    from specedge.export.output import OutputPlan

    out = tmp_path / "b"
    monkeypatch.setattr(pipeline, "prepare", lambda opts: OutputPlan(out, "new", {}))

    def full(opts, progress, plan):
        raise OSError(errno.ENOSPC, "No space left on device")  # as numpy or onnx raise it: no file name

    monkeypatch.setattr(pipeline, "export_bundle", full)
    assert export_models.main(["--out", str(out), "--quiet"]) == 74
    assert capsys.readouterr().err.splitlines() == [f"error: cannot write the bundle '{out}': No space left on device"]


def test_an_onnxruntime_run_failure_is_one_line_on_stderr(bundle):
    """ONNX Runtime logs its own error lines (colour codes, source locations) to stderr before it
    raises; the backends keep its logger at fatal, so the failure is only the one line it becomes."""
    code = (
        "import sys, numpy as np\n"
        "from specedge.manifest import load_manifest\n"
        "from specedge.runtime.backends.ort import OrtBackend\n"
        "from specedge.runtime.backends.base import BackendError\n"
        f"m = load_manifest({str(bundle)!r})\n"
        "be = OrtBackend(m, m.target, threads=1)\n"
        "try:\n"
        "    be.run(np.array([10**9], dtype=np.int64), 0)\n"
        "except BackendError as e:\n"
        "    print('error:', e, file=sys.stderr)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ONNX Runtime failed to run the target graph"), p.stderr
