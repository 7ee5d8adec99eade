"""Tree calls through the exported graph (docs/design.md, "Tree calls", issue 15 step 1).

A tree of drafted tokens is run in one call with its ancestor mask; every row must equal the
row of the same token when its root path is run as an ordinary chain (same position, the
lower-triangular mask), for both graph flavours and families with sliding windows, partial
rotary and soft-capping."""

import numpy as np
import onnxruntime as ort
import pytest
import torch

from specedge.export.onnx_graph import export_graph
from specedge.models import build_model
from specedge.models.testing import tiny_config

MAX_SEQ = 64
PARENTS = [-1, 0, 0, 1, 2, 3]  # the root (pending token), two branches, then deeper nodes
TOKENS = [5, 7, 9, 11, 13, 4]


def ancestor_mask(parents):
    m = np.zeros((len(parents), len(parents)), bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def root_path(parents, leaf):
    path = []
    while leaf >= 0:
        path.append(leaf)
        leaf = parents[leaf]
    return path[::-1]


@pytest.mark.parametrize(
    "family,flavour,kv_mode",
    [
        ("llama", "ort", "scatter"),
        ("mistral", "ort", "scatter"),
        ("gemma3", "ort", "scatter"),
        ("phi3", "portable", "scatter"),
        ("qwen3", "portable", "delta"),
    ],
)
def test_tree_rows_equal_root_path_chains(tmp_path, family, flavour, kv_mode):
    cfg = tiny_config(family)
    cfg = getattr(cfg, "text_config", cfg)
    torch.manual_seed(0)
    model = build_model(cfg, kv_mode)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    path = tmp_path / "model.onnx"
    export_graph(model, path, MAX_SEQ, kv_mode, "fp32", flavour=flavour, tree=True)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()][:3] == ["input_ids", "position", "tree_mask"]
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def run(ids, pos, mask, kv):
        feeds = {"input_ids": np.array([ids], np.int64), "position": np.array([pos], np.int64), "tree_mask": mask[None]}
        for i in range(layers):
            feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = kv[2 * i], kv[2 * i + 1]
        out = sess.run(None, feeds)
        for i in range(2 * layers):
            if kv_mode == "scatter":
                kv[i][...] = out[1 + i]
            else:
                kv[i][:, :, pos : pos + len(ids)] = out[1 + i]
        return out[0][0]

    kv0 = [np.zeros((1, heads, MAX_SEQ, dim), np.float32) for _ in range(2 * layers)]
    prompt = list(range(3, 23))  # 20 tokens: past the tiny configs' sliding window of 8
    run(prompt, 0, np.tril(np.ones((20, 20), bool)), kv0)
    tree_rows = run(TOKENS, 20, ancestor_mask(PARENTS), [x.copy() for x in kv0])
    for leaf in range(len(TOKENS)):
        nodes = root_path(PARENTS, leaf)
        chain = run([TOKENS[i] for i in nodes], 20, np.tril(np.ones((len(nodes),) * 2, bool)), [x.copy() for x in kv0])
        for depth, node in enumerate(nodes):
            np.testing.assert_allclose(tree_rows[node], chain[depth], atol=1e-5, rtol=0)
