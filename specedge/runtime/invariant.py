"""Batch-invariant target steps: exact greedy speculation on targets whose kernels round a
single-token call differently from a call of several tokens.

Speculative decoding is exact only if the verification call (T = k + 1 tokens) gives each row
the very logits a target-only step (T = 1) would. ONNX Runtime's CPU kernels do not: at T = 1
GroupQueryAttention (and fp32 MatMul, and MatMulNBits at accuracy level 0/1) take an M = 1 path
that sums in another order than the M >= 2 one. In fp32 that is a 1e-5 logit gap; in an int4
graph at accuracy level 4 the difference flips int8 activation roundings downstream and grows to
~1 logit, enough to change greedy picks (scripts/int4_exactness.py). Every call with T >= 2
tokens, by contrast, gives row i bit for bit the same logits whatever T is (measured: T = 2 row
0 equals each row of T = 5; tests/test_invariant.py pins it on a tiny bundle).

So in this mode a single-token step is run as T = 2: the real token plus one padding token
written at the next slot. The graph masks every slot at or beyond position + T, and the next
call writes that slot first, so the padding is never read; only row 0 is returned. The one
exception is the last cache slot, where a second token does not fit: there both target-only and
speculative decoding make the same T = 1 call (k is 0 with one free slot), so they still agree.
"""

from __future__ import annotations

import numpy as np

from .backends import Backend

__all__ = ["InvariantSteps", "PAD_TOKEN", "rows_independent_of_t", "wants_invariant_steps"]

PAD_TOKEN = 0  # any id works: its row is dropped and its K/V slot is masked, then overwritten

# precisions whose single-token step rounds visibly differently from a verification row
QUANTIZED = ("int4", "int8", "fp16", "bf16")


def wants_invariant_steps(precision: str) -> bool:
    """The default for a target of this precision: on for quantized and half-precision targets
    (gaps that flip greedy picks), off for fp32 (a 1e-5 gap; 20/20 prompts agree without it)."""
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


class InvariantSteps:
    """A target backend whose T = 1 calls run as T = 2 (see the module docstring). Everything
    else is the wrapped backend's: attribute reads go through to it."""

    def __init__(self, backend: Backend):
        self.inner = backend

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _padded(self, input_ids, position: int):
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        if ids.shape[0] == 1 and position + 2 <= self.inner.max_seq:
            return np.array([ids[0], PAD_TOKEN], dtype=np.int64), True
        return ids, False

    def run(self, input_ids, position: int) -> np.ndarray:
        ids, padded = self._padded(input_ids, position)
        out = self.inner.run(ids, position)
        return out[:1] if padded else out

    def argmax(self, input_ids, position: int) -> np.ndarray:
        ids, padded = self._padded(input_ids, position)
        out = self.inner.argmax(ids, position)
        return out[:1] if padded else out

    def copy_kv_from(self, other, start: int, end: int) -> bool:
        return self.inner.copy_kv_from(getattr(other, "inner", other), start, end)

    def describe(self) -> dict:
        d = self.inner.describe()
        d["invariant_steps"] = True
        return d
