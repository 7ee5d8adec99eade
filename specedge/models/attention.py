"""The attention primitives of the static-KV interface: the cache write, rotary application, the
masks derived from `position`, and grouped-query attention over a fixed-size cache.

They sit below both `common` (the modules of every family) and `gqa` (the fused ONNX Runtime op,
whose torch reference uses them), so neither of those imports the other's users.
"""

from __future__ import annotations

import torch


# The cache write is a custom op so that export can map it to ONNX TensorScatter (opset 24), which
# ONNX Runtime runs in place when past and present share a buffer and TensorRT maps to its KV
# update. Tracing an index_put instead would give a ScatterND over the whole cache.
@torch.library.custom_op("specedge::cache_write", mutates_args=())
def cache_write(cache: torch.Tensor, new: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    out = cache.clone()
    t = new.shape[-2]
    for b in range(cache.shape[0]):
        p = int(position[b])
        out[b, :, p : p + t] = new[b]
    return out


@cache_write.register_fake
def _cache_write_fake(cache, new, position):
    return torch.empty_like(cache)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))
    # Partial rotary (phi3 variants): only the first `rot` channels rotate.
    xr, xp = x[..., :rot], x[..., rot:]
    xr = (xr * cos.to(x.dtype)) + (_rotate_half(xr) * sin.to(x.dtype))
    return torch.cat([xr, xp], dim=-1)


def new_positions(position: torch.Tensor, t: int) -> torch.Tensor:
    """Absolute positions [B, T] of the new tokens."""
    return position[:, None] + torch.arange(t, dtype=position.dtype, device=position.device)[None, :]


def tree_positions(position: torch.Tensor, tree: torch.Tensor) -> torch.Tensor:
    """Absolute (rotary) positions [B, T] of a tree call's tokens: position + depth, the depth
    being the number of ancestors in the ancestor mask `tree` [B, T, T] (each row holds the
    token itself). For a chain (lower-triangular mask) this is new_positions."""
    return position[:, None] + tree.to(position.dtype).sum(-1) - 1


def _tree_keys(position: torch.Tensor, tree: torch.Tensor, slots: int):
    """For each key slot j: whether it holds one of the call's tokens, the ancestor mask read
    at that slot ([B, 1, T, slots]), and its absolute position (a tree token's is position +
    depth, not its slot) for sliding windows."""
    b, t, _ = tree.shape
    j = torch.arange(slots, dtype=position.dtype, device=position.device)[None, None, None, :]
    rel = j - position[:, None, None, None]
    inside = (rel >= 0) & (rel < t)
    idx = rel.clamp(0, t - 1).expand(b, 1, t, slots)
    seen = torch.gather(tree[:, None].expand(b, 1, t, t), -1, idx)
    depth_pos = tree_positions(position, tree)[:, None, None, :].expand(b, 1, t, t)
    kpos = torch.where(inside, torch.gather(depth_pos, -1, idx), j)
    return inside, seen, kpos


def attention_mask(
    position: torch.Tensor, t: int, slots: int, window: int | None, tree: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool [B, 1, T, slots]: query t sees cache slot j iff j <= position + t (and, for sliding
    layers, j > position + t - window). With an ancestor mask `tree` [B, T, T] a slot holding
    one of the call's tokens is seen only by its descendants, and windows count positions
    (position + depth), so the rows of a tree equal the rows of each root path run as a chain."""
    q = new_positions(position, t)[:, None, :, None]
    j = torch.arange(slots, dtype=position.dtype, device=position.device)[None, None, None, :]
    m = j <= q
    if tree is None:
        if window is not None:
            m = m & (j > q - window)
        return m
    inside, seen, kpos = _tree_keys(position, tree, slots)
    m = m & (~inside | seen)
    if window is not None:
        qd = tree_positions(position, tree)[:, None, :, None]
        m = m & (kpos > qd - window)
    return m


def delta_mask(
    position: torch.Tensor, t: int, slots: int, window: int | None, tree: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool [B, 1, T, slots + T] for delta mode, where keys are the old cache followed by the new
    entries: old slot j is visible iff j < position (stale slots beyond it are masked), new entry
    u iff u <= t (with an ancestor mask `tree`: iff u is t or an ancestor of it); sliding layers
    also drop what fell out of the window."""
    q = new_positions(position, t) if tree is None else tree_positions(position, tree)
    q = q[:, None, :, None]
    j = torch.arange(slots, dtype=position.dtype, device=position.device)[None, None, None, :]
    old = j < position[:, None, None, None]
    tt = torch.arange(t, dtype=position.dtype, device=position.device)
    if tree is None:
        new = (tt[None, :] <= tt[:, None])[None, None].expand(position.shape[0], 1, t, t)
        absu = new_positions(position, t)[:, None, None, :]
    else:
        new = tree[:, None]
        absu = tree_positions(position, tree)[:, None, None, :]
    if window is not None:
        old = old & (j > q - window)
        new = new & (absu > q - window)
    return torch.cat([old.expand(-1, -1, t, -1), new], dim=-1)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, KVH, S, D] -> [B, T, H*D]. Plain matmul + softmax so the graph
    uses standard ONNX ops that TensorRT parses."""
    b, h, t, d = q.shape
    kvh = k.shape[1]
    rep = h // kvh
    # Grouped-query attention without copying the cache: fold the query groups into T.
    qg = q.reshape(b, kvh, rep * t, d)
    scores = torch.matmul(qg.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(b, kvh, rep, t, -1)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).reshape(b, kvh, rep * t, -1)
    out = torch.matmul(probs.to(v.dtype), v).reshape(b, h, t, v.shape[-1])
    return out.transpose(1, 2).reshape(b, t, h * v.shape[-1])
