"""A draft head's graph on ONNX Runtime (CPU): the target backend's buffers and in-place cache,
plus the head's own tensors (contract.head_graph_io): `features` and `hidden` in, `hidden_out` out.
"""

from __future__ import annotations

import numpy as np

from ...contract import head_graph_io
from .ort import OrtBackend

__all__ = ["OrtHeadBackend"]


class OrtHeadBackend(OrtBackend):
    name = "ort-cpu"

    def _expected_names(self) -> tuple[list[str], list[str]]:
        ins, outs = head_graph_io(self.spec, self.kv_mode, self.max_seq, self.batch)
        return [t.name for t in ins], [t.name for t in outs]

    def _allocate(self, t_max: int) -> None:
        super()._allocate(t_max)
        B, F, H = self.batch, int(self.spec.extra["feature_dim"]), int(self.spec.hidden_size)
        self._in_feat = np.zeros(B * self.t_max * F, dtype=np.float32)
        self._in_hidden = np.zeros(B * self.t_max * H, dtype=np.float32)
        self._out_hidden = np.zeros(B * self.t_max * H, dtype=np.float32)
        self._head_bound: set[int] = set()

    def _binding(self, t: int):
        b = super()._binding(t)
        if t not in self._head_bound:
            B, F, H = self.batch, int(self.spec.extra["feature_dim"]), int(self.spec.hidden_size)
            b.bind_input("features", "cpu", 0, np.float32, [B, t, F], self._in_feat.ctypes.data)
            b.bind_input("hidden", "cpu", 0, np.float32, [B, t, H], self._in_hidden.ctypes.data)
            b.bind_output("hidden_out", "cpu", 0, np.float32, [B, t, H], self._out_hidden.ctypes.data)
            self._head_bound.add(t)
        return b

    def step(
        self, input_ids, position: int, features: np.ndarray | None = None, hidden: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run T tokens at `position` over target `features` [T, F] (chained steps: None) and/or
        the head's own `hidden` [T, H] of the step before (target rows: None); return the draft
        logits [T, Vd] and hidden_out [T, H] (views valid until the next call). Batch 1."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        t = ids.shape[0]
        if t > self.t_max:
            self._allocate(t)
        F, H = int(self.spec.extra["feature_dim"]), int(self.spec.hidden_size)
        fbuf, hbuf = self._in_feat[: t * F].reshape(t, F), self._in_hidden[: t * H].reshape(t, H)
        if features is None:
            fbuf[:] = 0.0
        else:
            fbuf[:] = features
        if hidden is None:
            hbuf[:] = 0.0
        else:
            hbuf[:] = hidden
        logits = self.run(ids, position)
        return logits, self._out_hidden[: t * H].reshape(t, H)
