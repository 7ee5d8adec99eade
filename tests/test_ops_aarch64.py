"""specedge's CPU kernels on aarch64 (issue 37): the NEON dot-product path of MatMulQ41, MatMulQ80
and the batch-invariant attention gives the x86-64 paths' bits. The kernels' standalone test
(cpp/ops/tests/ops_kernels_test.cpp: every path this CPU has bit-equal to the portable one, and
MatMulQ41 and MatMulQ80 rows of T = 1..17 row calls equal to one-row calls) is built for this machine and
cross-built for aarch64, the latter run under qemu-user twice: as a CPU with the dot-product
extension (the NEON path) and as a Cortex-A72 without it (the portable path). All three must pass
and print the same hashes of their outputs on the same inputs. libspecedge_ops.so itself
cross-builds too (it needs ONNX Runtime's headers only). The cross compiler and qemu come
from Debian's g++-aarch64-linux-gnu and qemu-user (scripts/cpp_setup.sh installs them as root);
without them the test skips and says so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPS = ROOT / "cpp" / "ops"
ORT_INCLUDE = OPS / "third_party" / "onnxruntime" / "include"  # the pinned headers the kernels build against
SOURCES = [
    OPS / "isa.cpp",
    OPS / "q41_kernel.cpp",
    OPS / "q80_kernel.cpp",
    OPS / "gqa_kernel.cpp",
    OPS / "tests" / "ops_kernels_test.cpp",
]
# as CMake builds libspecedge_ops (Release: -O3), and no contraction of a*b+c into fma on any target
FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-Wall", "-Wextra", "-Wno-unused-parameter"]
HOST_CXX = shutil.which("g++") or shutil.which("c++")
CROSS_CXX = shutil.which("aarch64-linux-gnu-g++")  # binutils-aarch64-linux-gnu comes with it
QEMU = shutil.which("qemu-aarch64")

needs_tools = pytest.mark.skipif(
    not (HOST_CXX and CROSS_CXX and QEMU),
    reason="needs g++, aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user; "
    "scripts/cpp_setup.sh installs them when run as root)",
)


def build(cxx: str, out: Path, extra: list[str], sources: list[Path] = SOURCES) -> Path:
    # -Wno-maybe-uninitialized: GCC 12's own _mm512_reduce_* intrinsics, as in cpp/CMakeLists.txt
    p = subprocess.run(
        [cxx, *FLAGS, "-Wno-maybe-uninitialized", *extra, *map(str, sources), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return out


def run(cmd: list[str]) -> dict[str, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return dict(line.split(" ", 1) for line in p.stdout.splitlines())


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> dict[str, str]:
    return run([str(build(HOST_CXX, tmp_path_factory.mktemp("host") / "host", []))])


@needs_tools
def test_aarch64_paths_give_the_x86_bits(host, tmp_path):
    arm = build(CROSS_CXX, tmp_path / "arm", ["-static"])
    neon = run([QEMU, "-cpu", "max", str(arm)])
    plain = run([QEMU, "-cpu", "cortex-a72", str(arm)])  # ARMv8.0: no dot product, so portable only
    assert neon["paths"] == "portable neondot" and plain["paths"] == "portable"
    for out in ("q41", "q80", "attention"):
        assert neon[out] == plain[out] == host[out], (out, host["paths"])


@needs_tools
def test_a_different_rounding_is_caught(host, tmp_path):
    """The comparison can fail: built the aarch64 compilers' default way (a*b+c contracted into
    one fma), the rotary step rounds once instead of twice and the hash is no longer x86's."""
    arm = build(CROSS_CXX, tmp_path / "arm", ["-static", "-ffp-contract=fast"])
    fused = run([QEMU, "-cpu", "max", str(arm)])
    assert fused["q41"] == host["q41"] and fused["q80"] == host["q80"]
    assert fused["attention"] != host["attention"]


@needs_tools
@pytest.mark.skipif(
    not (ORT_INCLUDE / "onnxruntime_cxx_api.h").is_file(), reason=f"ONNX Runtime headers not in {ORT_INCLUDE}"
)
def test_the_library_builds_for_aarch64(tmp_path):
    """libspecedge_ops.so itself (the ONNX Runtime ops around the kernels) cross-builds for
    aarch64 and exports what both runtimes look up; it links nothing, so no aarch64 ONNX Runtime
    is needed to build it."""
    sources = [OPS / "specedge_ops.cpp", OPS / "gqa_attention.cpp", *SOURCES[:4]]
    lib = build(
        CROSS_CXX,
        tmp_path / "libspecedge_ops.so",
        ["-fPIC", "-shared", "-fvisibility=hidden", "-isystem", str(ORT_INCLUDE)],
        sources,
    )
    nm = subprocess.run(
        ["aarch64-linux-gnu-nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    assert exported == {"RegisterCustomOps", "specedge_ops_isa"}
