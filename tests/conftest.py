"""Shared fixtures: tiny bundles exported once per session and the real default bundle.

`tiny_bundle_factory(family=..., kv_mode=..., draft=..., precision=..., draft_precision=...,
max_seq=..., spec_tokens=...)` exports a tiny random bundle through the real pipeline the first
time a combination is asked for and returns the cached path afterwards, so the export tests and
the runtime tests share one export per combination. Bundles are read-only for tests: copy one
before changing it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_BUNDLE = REPO / "bundles" / "smollm2-135m-instruct"


def pytest_configure(config):
    # Also declared in pyproject.toml; repeated here so the markers exist whatever the rootdir.
    config.addinivalue_line("markers", "slow: needs the real default model (minutes)")
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU")


def pytest_collection_modifyitems(config, items):
    # The real-model tests take minutes: they run only when `-m` names them.
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


class _TinyCache:
    """Checkpoints per (family, seed) and bundles per option set, created on first use.

    Under pytest-xdist every worker has its own session but all share one cache folder: a file
    lock per entry makes one worker export it while the others wait, and a `.done` marker beside
    the entry (not inside: a bundle holds only what specedge writes) says it is complete."""

    def __init__(self, root: Path):
        self.root = root
        self.checkpoints: dict[tuple, Path] = {}
        self.bundles: dict[tuple, Path] = {}

    @contextmanager
    def _once(self, path: Path):
        """Yield True when `path` still has to be made (under its lock), False when it is done."""
        path.parent.mkdir(parents=True, exist_ok=True)
        done = path.with_name(path.name + ".done")
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield not done.exists()
                done.touch()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def checkpoint(self, family: str = "llama", seed: int = 0) -> Path:
        key = (family, seed)
        if key not in self.checkpoints:
            from specedge.export.testing import tiny_checkpoint

            folder = self.root / "ckpt" / f"{family}-s{seed}"
            with self._once(folder) as todo:
                if todo:
                    shutil.rmtree(folder, ignore_errors=True)  # a worker killed half-way
                    tiny_checkpoint(folder, family, seed)
            self.checkpoints[key] = folder
        return self.checkpoints[key]

    def bundle(
        self,
        family="llama",
        kv_mode="scatter",
        draft="self",
        precision="fp32",
        draft_precision="int4",
        max_seq=128,
        spec_tokens=4,
        prefill_chunk=16,
        seed=0,
        **options,
    ) -> Path:
        key = (
            family,
            kv_mode,
            draft,
            precision,
            draft_precision,
            max_seq,
            spec_tokens,
            prefill_chunk,
            seed,
            *(f"{k}={v}" for k, v in sorted(options.items())),
        )
        if key not in self.bundles:
            from specedge.export.pipeline import ExportOptions, export_bundle

            d = draft
            if draft == "model":  # a second tiny checkpoint of the family, same tokenizer
                d = str(self.checkpoint(family, seed + 1))
            name = "-".join(str(k) for k in key)
            out = self.root / "bundles" / name
            target = str(self.checkpoint(family, seed))
            with self._once(out) as todo:
                if todo:
                    opts = ExportOptions(
                        target=target,
                        draft=d,
                        out=str(out),
                        precision=precision,
                        draft_precision=draft_precision,
                        max_seq=max_seq,
                        spec_tokens=spec_tokens,
                        kv_mode=kv_mode,
                        prefill_chunk=prefill_chunk,
                        force=True,
                        **options,
                    )
                    export_bundle(opts)
            self.bundles[key] = out
        return self.bundles[key]


@pytest.fixture(scope="session")
def _tiny_cache(tmp_path_factory) -> _TinyCache:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # no xdist: this session's own folder
        return _TinyCache(tmp_path_factory.mktemp("tiny"))
    # xdist: the workers' base temp folders share a parent, created afresh for each run
    return _TinyCache(tmp_path_factory.getbasetemp().parent / "tiny")


@pytest.fixture(scope="session")
def tiny_bundle_factory(_tiny_cache):
    """A function (family="llama", kv_mode="scatter", draft="self", precision="fp32",
    draft_precision="int4", max_seq=128, spec_tokens=4, **options) -> Path of a tiny exported
    bundle. draft: "self", "ngram" or "model" (a second tiny checkpoint with the same tokenizer);
    options: further ExportOptions fields (e.g. graphs="both"). prefill_chunk is 16."""
    return _tiny_cache.bundle


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(_tiny_cache):
    """A function (family="llama", seed=0) -> Path of the tiny HF checkpoint folder the bundles
    of that family are exported from (shared: do not modify it, copy it)."""
    return _tiny_cache.checkpoint


@pytest.fixture(scope="session")
def default_bundle() -> Path:
    """The real default bundle (SmolLM2-135M-Instruct): $SPECEDGE_DEFAULT_BUNDLE or
    <repo>/bundles/smollm2-135m-instruct. Skips when it has not been exported."""
    env = os.environ.get("SPECEDGE_DEFAULT_BUNDLE")
    path = Path(env) if env else DEFAULT_BUNDLE
    if not (path / "manifest.json").is_file():
        pytest.skip(f"default bundle not found at {path} (run `export-models` first, or set SPECEDGE_DEFAULT_BUNDLE)")
    return path


@pytest.fixture
def load_script():
    """A function (name) -> a fresh module of scripts/<name>.py, which is not a package; a name with a
    folder (benchmarks/experiments/int4/int4_profile) is that path from the repository root."""
    import importlib.util

    def load(name: str):
        path = REPO / f"{name}.py" if "/" in name else REPO / "scripts" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(Path(name).name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load
