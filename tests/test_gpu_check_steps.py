"""scripts/gpu_check.py's steps and their runner (scripts/gpu_runner.py), on the CPU.

A GPU window is a quarter of an hour now and then: the check must return every figure it measured
even when a step fails or its call is stopped, and its steps must work against the real runtime
API before they meet a GPU. Here the runner meets failing, skipping and overrunning steps, and the
ort-cuda, I/O-binding and tree steps run on ONNX Runtime's CPU provider and the torch backend on
the CPU over a tiny bundle.
"""

from __future__ import annotations

import json
import time

import pytest


def test_the_runner_writes_after_every_step_and_records_failures_and_timeouts(load_script, tmp_path):
    gr = load_script("gpu_runner")
    path = tmp_path / "report.json"
    report = {"results": []}
    seen = {}
    runner = gr.StepRunner(path, report, total_s=6.0, log=lambda m: None)

    def measured(rec):
        rec["figure"] = 1.5

    def reads_the_file_then_breaks(rec):
        seen.update(json.loads(path.read_text()))  # what a stopped call would return by now
        raise RuntimeError("boom")

    def overruns(rec):
        rec["partial"] = 7
        runner.save()
        try:
            time.sleep(30)
        except Exception:  # a step's own broad handler must not swallow its timeout
            rec["swallowed"] = True

    def says_not_ok(rec):
        rec["ok"] = False

    def nothing_to_check(rec):
        raise gr.Skip("no GPU here")

    steps = [
        gr.Step("measured", 5, measured),
        gr.Step("breaks", 5, reads_the_file_then_breaks),
        gr.Step("overruns", 0.5, overruns),
        gr.Step("not_ok", 5, says_not_ok),
        gr.Step("skip", 5, nothing_to_check),
        gr.Step("too_big", 100, measured),
    ]
    t0 = time.monotonic()
    runner.run(steps[:5])
    time.sleep(max(0.0, 5.0 - (time.monotonic() - t0)))  # leave the last step less than it needs
    runner.run(steps[5:])
    assert seen["steps"]["measured"] == {
        "status": "ok",
        "budget_s": 5,
        "figure": 1.5,
        "seconds": seen["steps"]["measured"]["seconds"],
    }
    assert seen["steps"]["breaks"]["status"] == "running"  # written before the step began
    final = json.loads(path.read_text())
    s = final["steps"]
    assert s["breaks"]["status"] == "error" and s["breaks"]["error"] == "RuntimeError: boom"
    assert s["overruns"]["status"] == "timeout" and s["overruns"]["error"] == "stopped at its budget of 0.5 s"
    assert s["overruns"]["partial"] == 7 and "swallowed" not in s["overruns"] and s["overruns"]["seconds"] < 5
    assert s["not_ok"]["status"] == "failed"
    assert s["skip"] == {"status": "skipped", "budget_s": 5, "reason": "no GPU here", "seconds": s["skip"]["seconds"]}
    assert s["too_big"]["status"] == "skipped" and s["too_big"]["reason"].startswith("out of time (")
    assert list(s) == ["measured", "breaks", "overruns", "not_ok", "skip", "too_big"]  # the fixed order


@pytest.fixture(scope="module")
def self_draft_bundle(tiny_bundle_factory):
    pytest.importorskip("torch")
    return tiny_bundle_factory(family="llama", draft="self", max_seq=512)


def test_the_gpu_steps_run_on_cpu_stand_ins_and_a_broken_step_does_not_stop_the_next(
    load_script, self_draft_bundle, tmp_path, capsys
):
    """ort-cuda's steps on ONNX Runtime's CPU provider (the backend's device='cpu' mode), the tree
    table on the torch backend on the CPU; the fp32 bundle is missing, so its step errors and the
    tree step after it still runs."""
    gc = load_script("gpu_check")
    rc = gc.main(
        [
            "--device",
            "cpu",
            "--bundle-fp16",
            str(self_draft_bundle),
            "--bundle-fp32",
            str(tmp_path / "missing"),
            "--steps",
            "exports,ort_cuda_fp16,ort_io_binding,ort_cuda_fp32,torch_trees",
            "--tokens",
            "8",
            "--repeats",
            "1",
            "--tree-prompts",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    s = report["steps"]
    assert list(s) == ["exports", "ort_cuda_fp16", "ort_io_binding", "ort_cuda_fp32", "torch_trees"]
    assert s["exports"]["fp16"] == {"bundle": str(self_draft_bundle), "given": True}
    fp16 = s["ort_cuda_fp16"]
    assert fp16["status"] == "ok", fp16
    assert fp16["ngram"]["exactness"]["status"] == "exact"
    assert set(fp16["ngram"]["timings"]) == {"target", "target+graphs", "speculative", "speculative+graphs"}
    sd = fp16["self_draft"]
    for key in ("graphs", "no_graphs"):
        assert sd[key]["speculative_equals_target_only"] and sd[key]["target_equals_graphs_run"]
        assert sd[key]["draft_backend"] == "ort-cuda" and sd[key]["target"]["tokens_per_s"] > 0
        assert sd[key]["speculative"]["mean_accepted"] > 1  # the draft's tokens were accepted
    io = s["ort_io_binding"]
    assert io["status"] == "ok" and io["target"]["runs"] == 16 and io["target"]["memcpy_nodes_per_run"] == 0
    assert io["target"]["outputs_stay_on_bound_addresses"] and io["target"]["output_devices"] == ["cpu"]
    assert io["draft"]["role"] == "draft" and io["draft"]["no_host_cache_copies"]
    assert s["ort_cuda_fp32"]["status"] == "error" and "missing" in s["ort_cuda_fp32"]["error"]
    trees = s["torch_trees"]
    assert trees["status"] == "ok" and trees["ok"] and trees["drafter"] == "ngram" and trees["tree"]["tree_rounds"] > 0
    assert report["ok"] is False and rc == 1  # the failed step, and nothing else
    assert [r["backend"] for r in report["results"]] == ["ort-cuda-fp16"]
    assert "ort_cuda_fp32         error" in out and "ort-cuda-fp16      self-draft    yes" in out
    assert out.rstrip().endswith("gpu_check.json")


def test_pytest_counts_come_from_the_junit_report(load_script, tmp_path):
    gc = load_script("gpu_check")
    xml = tmp_path / "j.xml"
    xml.write_text(
        "<testsuites><testsuite>"
        '<testcase classname="tests.test_head_gpu_backends" name="test_gpu_torch_target_with_the_head_equals_target_only[scatter]"/>'
        '<testcase classname="tests.test_head_gpu_backends" name="test_gpu_ort_cuda_target_with_the_head_equals_target_only[scatter]">'
        '<skipped message="onnxruntime-gpu is not installed"/></testcase>'
        '<testcase classname="tests.test_gpu_backends" name="test_a"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="tests.test_gpu_backends" name="test_b"><error message="fixture"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = gc.junit_counts(xml)
    assert got["counts"] == {"passed": 1, "skipped": 1, "failed": 1, "errors": 1}
    assert got["tests"][
        "tests.test_head_gpu_backends::test_gpu_ort_cuda_target_with_the_head_equals_target_only[scatter]"
    ] == {"outcome": "skipped", "message": "onnxruntime-gpu is not installed"}
    files = gc.gpu_test_files()
    assert "tests/test_head_gpu_backends.py" in files and "tests/test_gpu_backends.py" in files
    assert "tests/test_serve.py" not in files


def test_an_unknown_step_is_one_error_line(load_script, tmp_path, capsys):
    gc = load_script("gpu_check")
    assert gc.main(["--device", "cpu", "--steps", "exports,warp", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: unknown step 'warp' (steps: exports, pytest_gpu, ort_cuda_fp16, torch_module, ort_io_binding, "
        "ort_cuda_fp32, torch_trees, torch_module_more, tensorrt, torch_module_compile)"
    ]


def test_a_check_stopped_by_sigterm_keeps_its_json_and_prints_its_table(tmp_path):
    """`timeout` (gpu_check.sh's, or the device call's limit) ends the check with SIGTERM: the
    step in progress is recorded as stopped, the JSON keeps what was measured, the table prints."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        [
            sys.executable,
            str(root / "scripts/gpu_check.py"),
            "--device",
            "cpu",
            "--random-weights",
            "--layers",
            "2",
            "--dtypes",
            "float32",
            "--tokens",
            "2000",
            "--max-seq",
            "4096",
            "--steps",
            "exports,torch_module",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    path = tmp_path / "gpu_check.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if path.is_file() and json.loads(path.read_text())["steps"].get("torch_module", {}).get("status") == "running":
            break
        time.sleep(0.5)
    time.sleep(1)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out[-2000:]
    report = json.loads(path.read_text())
    assert report["steps"]["exports"]["status"] == "ok"
    assert report["steps"]["torch_module"]["status"] == "stopped" and report["ok"] is False
    assert any("stopped by SIGTERM" in n for n in report["notes"])
    assert "torch_module          stopped" in out and out.rstrip().endswith("gpu_check.json")


def test_gpu_md_renders_the_steps_of_a_budgeted_run(load_script):
    """BENCHMARKS.md's GPU section from a run with steps: each step's status and time, the pytest
    counts with the head tests, ort-cuda's self-draft rows and the I/O-binding verdict; a run from
    before the steps renders as it did."""
    import copy
    from pathlib import Path

    md = load_script("gpu_md")
    old = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/gpu/h200_run3.json").read_text())
    assert md.steps_lines(old) == []
    run = copy.deepcopy(old)
    del run["model"]  # the torch step did not run
    run["pipeline"] = {"trees": {"error": "RuntimeError: x"}}  # what the tree step leaves when it fails
    run["steps"] = {
        "exports": {"status": "ok", "seconds": 0.4, "budget_s": 15},
        "pytest_gpu": {
            "status": "ok",
            "seconds": 80.0,
            "budget_s": 100,
            "rc": 0,
            "counts": {"passed": 9, "skipped": 1, "failed": 0, "errors": 0},
            "head_beside_gpu_target": {
                "test_gpu_torch_target_with_the_head_equals_target_only[scatter]": {"outcome": "passed"}
            },
        },
        "ort_cuda_fp16": {
            "status": "timeout",
            "error": "stopped at its budget of 90 s",
            "seconds": 90.0,
            "budget_s": 90,
            "self_draft": {
                "graphs": {
                    "target": {"tokens_per_s": 300.0},
                    "draft_backend": "ort-cuda",
                    "speculative": {"tokens_per_s": 360.0, "mean_accepted": 2.5},
                    "speedup": 1.2,
                    "speculative_equals_target_only": True,
                }
            },
        },
        "ort_io_binding": {
            "status": "ok",
            "seconds": 3.0,
            "budget_s": 30,
            "how": "profile",
            "target": {
                "memcpy_nodes_per_run": 0.0,
                "memcpy_bytes_per_run": 0.0,
                "one_layer_kv_bytes": 1024,
                "ops_on_cpu": [],
                "outputs_stay_on_bound_addresses": True,
                "no_host_cache_copies": True,
            },
        },
    }
    lines = md.run_table("h200_run4.json", run)
    assert "| ort_cuda_fp16 | timeout: stopped at its budget of 90 s | 90.0 | 90 |" in lines
    assert any(
        x.startswith(
            "- `pytest -m gpu`: 9 passed, 1 skipped, 0 failed, 0 errors (exit 0); a draft head beside "
            "a GPU target: `test_gpu_torch_target_with_the_head_equals_target_only[scatter]` passed"
        )
        for x in lines
    )
    assert any(
        "CUDA graphs on: target-only 300.0 tok/s, speculative 360.0 tok/s (1.20x, 2.50 tokens/call" in x for x in lines
    )
    assert any("no host copies of the cache: **True** (profile)" in x and "ops on the CPU: none" in x for x in lines)
    assert "- pipeline trees: error: RuntimeError: x" in lines
    assert not any(x.startswith("- pipeline: `export-models") for x in lines)  # that line is the old pipeline check's


def test_gpu_check_sh_without_a_gpu_says_so_and_exits_0(tmp_path):
    """The last device call runs gpu_check.sh; on a machine whose torch sees no GPU it writes one
    skipped line and JSON, and succeeds (nothing to check)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the check would run")
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        ["bash", str(root / "scripts/gpu_check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path)),
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "gpu_check: skipped: no CUDA GPU"
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == {"skipped": "no CUDA GPU"}


def test_waiting_on_background_work_is_not_charged_to_the_step(load_script, tmp_path):
    """A step that waits for an export running in the background keeps its own budget for its
    work; the wait is bounded by the total and recorded."""
    gr = load_script("gpu_runner")
    report = {}
    runner = gr.StepRunner(tmp_path / "r.json", report, total_s=3.0, log=lambda m: None)

    def waits_then_works(rec):
        with runner.waiting(rec):
            time.sleep(1.0)  # twice the step's budget
        time.sleep(0.2)  # its own work, inside the budget
        rec["done"] = True

    def waits_too_long(rec):
        with runner.waiting(rec):
            time.sleep(30)

    runner.run([gr.Step("waits", 0.5, waits_then_works), gr.Step("outlasts_the_total", 0.5, waits_too_long)])
    s = report["steps"]
    assert s["waits"]["status"] == "ok" and s["waits"]["done"] and s["waits"]["waited_s"] >= 1.0
    assert s["outlasts_the_total"]["status"] == "timeout" and 1.0 < s["outlasts_the_total"]["waited_s"] < 3.0


def test_gpu_md_says_what_a_budgeted_run_had_installed(load_script):
    import copy
    from pathlib import Path

    md = load_script("gpu_md")
    old = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/gpu/h200_run3.json").read_text())
    assert "No onnxruntime-gpu and no TensorRT were installed there" in md.commands_line({"h200_run3.json": old})
    new = copy.deepcopy(old)
    new["steps"] = {}
    new["environment"].update(onnxruntime="1.31.1", onnxruntime_gpu=True)
    line = md.commands_line({"h200_run3.json": old, "h100_run4.json": new})
    assert "onnxruntime-gpu there: 1.31.1; TensorRT: none (it cannot be carried)" in line
    assert "`scripts/offline_gpu_pack.py`" in line
