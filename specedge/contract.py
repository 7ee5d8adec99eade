"""The graph I/O contract every half of specedge agrees on (docs/design.md, "The graph contract").

Export writes graphs with these names and shapes, the engine builder checks TensorRT networks
against them, and every runtime backend binds its buffers by them. Keeping the names, their
parsing, the check and the limits in this one module (which imports nothing else from specedge)
is what lets `export`, `engines` and `runtime` share them without importing each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ARGMAX_OUTPUT",
    "FEATURES_OUTPUT",
    "KEY",
    "MAX_SPEC_TOKENS",
    "NGRAM_SIZES",
    "DEFAULT_K_MODEL_DRAFT",
    "DEFAULT_K_NGRAM",
    "SEED_MAX",
    "TREE_INPUT",
    "TensorSpec",
    "VALUE",
    "check_graph_names",
    "expected_names",
    "graph_io",
    "head_graph_io",
    "parse_kv_name",
    "reserved_call_size",
]

# k, the drafts per speculative round: 1..MAX_SPEC_TOKENS (the manifest's spec.k, --spec-tokens,
# GenerationConfig.spec_tokens; cpp/src/manifest.h's kMaxSpecTokens holds the same value).
MAX_SPEC_TOKENS = 16

# The n-gram drafter's match sizes, longest first, where a bundle names none (its draft's
# extra.ngram_sizes; cpp/src/manifest.h holds the same default).
NGRAM_SIZES = (3, 2, 1)

# The k an export writes when --spec-tokens is not given, by drafter: a model draft (the
# GGUF-exact int4 self-draft above all) agrees with its target on most tokens and costs a small
# part of a target step, so longer chains pay; prompt lookup hits in shorter runs. (The k sweep
# behind these: BENCHMARKS.md; `specedge bench --tune` writes a bundle's own best k.)
DEFAULT_K_MODEL_DRAFT = 12
DEFAULT_K_NGRAM = 4

# Sampling seeds: 0..SEED_MAX, the C API's uint64_t (GenerationConfig.seed, --seed, the server's
# `seed`; specedge.h's SPECEDGE_SEED_MAX, the same value).
SEED_MAX = 2**64 - 1

KEY, VALUE = 0, 1
ARGMAX_OUTPUT = "argmax"  # optional extra output added by build-engines (TopK over logits)
# A tree-capable graph's third input: bool [B, T, T], row t marks t and its ancestors among the
# call's new tokens (docs/design.md, "Tree calls"). A chain call binds the lower triangle.
TREE_INPUT = "tree_mask"
# Target features for a draft head: [B, T, len(layers) * hidden] fp32, the last output, present only
# when the model's manifest entry has `features` (schema 2).
FEATURES_OUTPUT = "hidden_states"
_KV_NAME = re.compile(r"^(past_key|past_value|present_key|present_value|new_key|new_value)\.(\d+)$")


def reserved_call_size(prefill_chunk: int) -> int:
    """The call size T host buffers are first sized for: a prefill chunk, or twice the largest
    verification call (k + 1 tokens), so that no call of the speculative loop makes a backend
    grow its buffers mid-request (cpp/src/ort_backend.cpp sizes its buffers the same way)."""
    return max(int(prefill_chunk), 2 * (MAX_SPEC_TOKENS + 1))


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: list  # ints, or the string "T" for the one dynamic dimension

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def graph_io(
    spec, kv_mode: str, max_seq: int, batch: int = 1, tree: bool = False
) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph contract for one model (a manifest ModelSpec, or anything with its num_layers,
    num_kv_heads, head_dim, vocab_size and kv_dtype): input and output tensors, in order.
    tree: the graph takes tree calls (the `tree_mask` input after `position`)."""
    kvs = [batch, spec.num_kv_heads, max_seq, spec.head_dim]
    inputs = [TensorSpec("input_ids", "int64", [batch, "T"]), TensorSpec("position", "int64", [batch])]
    if tree:
        inputs.append(TensorSpec(TREE_INPUT, "bool", [batch, "T", "T"]))
    outputs = [TensorSpec("logits", "float32", [batch, "T", spec.vocab_size])]
    for i in range(spec.num_layers):
        inputs.append(TensorSpec(f"past_key.{i}", spec.kv_dtype, list(kvs)))
        inputs.append(TensorSpec(f"past_value.{i}", spec.kv_dtype, list(kvs)))
    for i in range(spec.num_layers):
        if kv_mode == "scatter":
            outputs.append(TensorSpec(f"present_key.{i}", spec.kv_dtype, list(kvs)))
            outputs.append(TensorSpec(f"present_value.{i}", spec.kv_dtype, list(kvs)))
        else:
            d = [batch, spec.num_kv_heads, "T", spec.head_dim]
            outputs.append(TensorSpec(f"new_key.{i}", spec.kv_dtype, d))
            outputs.append(TensorSpec(f"new_value.{i}", spec.kv_dtype, list(d)))
    feats = getattr(spec, "features", None)
    if feats:
        outputs.append(TensorSpec(FEATURES_OUTPUT, "float32", [batch, "T", int(feats["dim"])]))
    return inputs, outputs


def head_graph_io(spec, kv_mode: str, max_seq: int, batch: int = 1) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph contract of a draft head (a manifest ModelSpec of kind "head"): the target's, one
    layer, plus the `features` input (the target's FEATURES_OUTPUT rows, zeros for chained steps),
    the `hidden` input (the head's own `hidden_out` of the step before, zeros for target rows) and
    the `hidden_out` output; logits cover the draft vocabulary (spec.vocab_size)."""
    inputs, outputs = graph_io(spec, kv_mode, max_seq, batch)
    fdim, hdim = int(spec.extra["feature_dim"]), int(spec.hidden_size)
    inputs[2:2] = [
        TensorSpec("features", "float32", [batch, "T", fdim]),
        TensorSpec("hidden", "float32", [batch, "T", hdim]),
    ]
    outputs[1:1] = [TensorSpec("hidden_out", "float32", [batch, "T", hdim])]
    return inputs, outputs


def expected_names(spec, kv_mode: str, max_seq: int, batch: int = 1, tree: bool = False) -> tuple[list[str], list[str]]:
    inputs, outputs = graph_io(spec, kv_mode, max_seq, batch, tree)
    return [t.name for t in inputs], [t.name for t in outputs]


def parse_kv_name(name: str) -> tuple[str, int, int] | None:
    """'past_value.3' -> ('past', VALUE, 3); None for a name that is not a KV tensor."""
    m = _KV_NAME.match(name)
    if not m:
        return None
    prefix, kind = m.group(1).split("_")
    return prefix, (KEY if kind == "key" else VALUE), int(m.group(2))


def check_graph_names(
    role: str,
    expected_inputs: list[str],
    expected_outputs: list[str],
    actual_inputs: list[str],
    actual_outputs: list[str],
    optional_outputs: tuple[str, ...] = (ARGMAX_OUTPUT,),
) -> None:
    """Raise ValueError with one sentence if a session / engine does not follow the contract.

    Extra outputs are allowed when optional (argmax) or when they are named (hidden states for
    feature-level drafts are added by name, docs/design.md); extra or missing inputs are not."""
    missing_in = [n for n in expected_inputs if n not in actual_inputs]
    extra_in = [n for n in actual_inputs if n not in expected_inputs]
    missing_out = [n for n in expected_outputs if n not in actual_outputs]
    problems = []
    if missing_in:
        problems.append(f"missing input(s) {', '.join(repr(n) for n in missing_in[:3])}")
    if extra_in:
        problems.append(f"unexpected input(s) {', '.join(repr(n) for n in extra_in[:3])}")
    if missing_out:
        problems.append(f"missing output(s) {', '.join(repr(n) for n in missing_out[:3])}")
    if problems:
        raise ValueError(
            f"the {role} graph does not follow the bundle's I/O contract ({'; '.join(problems)}); "
            "re-export the bundle with this version of specedge"
        )
