"""Batch-invariant target steps: exact greedy speculation on targets whose kernels round a
single-token call differently from a call of several tokens.

Speculative decoding is exact only if the verification call (T = k + 1 tokens) gives each row the
very logits a target-only step (T = 1) would. ONNX Runtime's CPU kernels do not: at T = 1
GroupQueryAttention (and fp32 MatMul, and MatMulNBits at low accuracy levels) take an M = 1 path
that sums in another order. Quantized graphs amplify the gap until greedy picks change
(benchmarks/experiments/int4/int4_exactness.py; docs/design.md "Batch-invariant target steps"). Calls with T >= 2
give row i the same bits whatever T is (tests/test_invariant.py pins it).

So a target's cache tracker (runtime/cache.py `CacheTracker(invariant_steps=True)`) runs each
single-token step as T = 2: the real token plus `PAD_TOKEN` at the next slot, which the graph masks
and the next call overwrites; only row 0 is returned. This module says when that is needed.
"""

from __future__ import annotations

import warnings

import numpy as np

from ..manifest import BundleError, Manifest
from .backends import Backend

__all__ = ["PAD_TOKEN", "choose_invariant_steps", "rows_independent_of_t", "wants_invariant_steps"]

PAD_TOKEN = 0  # any id works: its row is dropped and its K/V slot is masked, then overwritten

# precisions whose single-token step rounds visibly differently from a verification row
QUANTIZED = ("int4", "int8", "fp16", "bf16")


def wants_invariant_steps(precision: str) -> bool:
    """The default for a target of this precision: on for quantized and half-precision targets,
    whose gaps flip greedy picks; off for fp32, whose gap is too small to (docs/design.md)."""
    return precision in QUANTIZED


def rows_independent_of_t(backend: Backend, token: int = PAD_TOKEN) -> bool:
    """Whether a single-token call gives, on this machine, the very bits of row 0 of a two-token
    call. A graph whose manifest entry says `batch_invariant` (specedge's own kernels, no ONNX
    Runtime M = 1 paths) should; this is checked once when a pipeline loads, before padded steps
    are turned off, since the kernels a CPU dispatches to are only known at run time. It writes
    cache slots 0 and 1, which any prompt's prefill overwrites."""
    if backend.max_seq < 2:
        return False
    one = np.array(backend.run(np.array([token], dtype=np.int64), 0)[0], copy=True)
    two = backend.run(np.array([token, PAD_TOKEN], dtype=np.int64), 0)[0]
    return bool(np.array_equal(one, two))


def choose_invariant_steps(manifest: Manifest, backend_name: str, target: Backend) -> bool:
    """load()'s default: pad the steps of a target that wants it (`wants_invariant_steps`) unless
    its graph is marked batch-invariant and this machine's kernels confirm it (one warning if not)."""
    if not wants_invariant_steps(manifest.target.precision):
        return False
    try:  # the graph the backend chose (runtime/int4_kernel.py), else the one it serves
        marked = (getattr(target, "graph_spec", None) or manifest.target.graph_for(backend_name)).batch_invariant
    except BundleError:
        return True
    if not marked:
        return True
    if rows_independent_of_t(target):
        return False
    warnings.warn(
        "the target graph is marked batch-invariant, but on this machine a single-token call's row differs "
        "from a verification row: single-token steps run as 2 tokens to stay exact",
        RuntimeWarning,
        stacklevel=3,
    )
    return True
