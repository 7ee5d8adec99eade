"""scripts/bench_peers.py's int4 rows: a bad --int4-bundle is refused with one error line."""

from __future__ import annotations


def test_int4_bundle_must_be_an_int4_bundle(load_script, tiny_bundle_factory, tmp_path, capsys):
    bp = load_script("bench_peers")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    fp32 = tiny_bundle_factory()
    args = [
        "--bundle",
        str(fp32),
        "--gguf",
        str(gguf),
        "--engines",
        "specedge",
        "--out",
        str(tmp_path / "o"),
        "--cache",
        str(tmp_path / "c"),
    ]
    capsys.readouterr()  # the tiny export's progress
    assert bp.main(args + ["--int4-bundle", str(fp32)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --int4-bundle") and "has a fp32 target, not int4" in err[0]
    assert bp.main(args + ["--int4-bundle", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --int4-bundle: ")


def test_peer_python_must_be_an_executable(load_script, tiny_bundle_factory, tmp_path, capsys):
    bp = load_script("bench_peers")
    fp32 = tiny_bundle_factory()
    capsys.readouterr()
    args = [
        "--bundle",
        str(fp32),
        "--engines",
        "ortgenai",
        "--out",
        str(tmp_path / "o"),
        "--cache",
        str(tmp_path / "c"),
        "--peer-python",
        str(tmp_path / "no-python"),
    ]
    assert bp.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --peer-python {tmp_path / 'no-python'}: not an executable"]


def test_peer_import_error_says_why(load_script, tmp_path):
    bp = load_script("bench_peers")
    import sys

    assert bp.peer_import_error(sys.executable, "json") is None
    msg = bp.peer_import_error(sys.executable, "no_such_module_here")
    assert msg.startswith(f"not installed for {sys.executable}") and "--peer-python" in msg
