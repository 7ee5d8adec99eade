#!/usr/bin/env python
"""The int4 target's correction nodes, A/B in one run (issue 18): the exported GGUF-exact graph of
an int4 bundle (blocksum = Reshape + ReduceSum) against the same graph with every blocksum
rewritten to one MatMul with a 0/1 block-indicator matrix (what `export-models --precision int4`
writes with gguf_exact's blocksum="matmul"), nothing else changed.

For each graph: step time at T=1, T=2 (a batch-invariant single-token step) and T=5 (k + 1) at
position 100, 2 threads, static cache bound in place, the graphs alternated block by block
(--rounds blocks of --reps steps each; medians of every step); nodes before and after ONNX
Runtime's optimizer; teacher-forced logits on the 117-token prompt of tests/test_default_model.py:
the largest difference to the unchanged graph and top-1 agreement with it. A third graph has every
min correction removed (not exact: the weights lose their block mins) — what any lever on the
correction could save at most. A fourth has every residual Add + RMSNormalization pair fused into
com.microsoft SkipSimplifiedLayerNormalization (as onnxruntime-genai's graphs have it).

    flock /work/bench.lock python scripts/int4_blocksum.py INT4_BUNDLE > benchmarks/results/int4_blocksum.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))
from int4_levers import POS, Stepper  # noqa: E402
from test_default_model import PROMPT  # noqa: E402

from specedge.export.gguf_exact import block_indicator  # noqa: E402
from specedge.manifest import load_manifest  # noqa: E402

NO_CORR = "no correction (not exact: the cost bound)"
SKIP = "residual Add + RMSNormalization as SkipSimplifiedLayerNormalization"


def to_matmul_blocksums(proto: onnx.ModelProto) -> int:
    """Reshape + ReduceSum blocksums → MatMul(a, P_K). In place; returns how many were rewritten."""
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    drop, repl, new_inits, ind = set(), {}, [], {}
    for n in g.node:
        if n.op_type != "ReduceSum" or "_gguf_blocksum" not in n.name:
            continue
        rs = producer[n.input[0]]
        assert rs.op_type == "Reshape", rs.op_type
        tail = numpy_helper.to_array(inits[rs.input[1]])[-2:]
        k = int(tail[0] * tail[1])
        if k not in ind:
            ind[k] = f"gguf_block_indicator_{k}"
            new_inits.append(numpy_helper.from_array(block_indicator(k), ind[k]))
        drop.add(id(rs))
        repl[id(n)] = helper.make_node("MatMul", [rs.input[0], ind[k]], [n.output[0]], name=n.name)
    nodes = [repl.get(id(n), n) for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(new_inits)
    used = {x for nd in g.node for x in nd.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    return len(repl)


def drop_corrections(proto: onnx.ModelProto) -> int:
    """Every min correction removed (y = the MatMulNBits output alone): NOT exact, only the cost
    bound of any lever on the correction. In place; returns how many were removed."""
    g = proto.graph
    n_rm = 0
    nodes = []
    for n in g.node:
        if n.op_type == "Add" and "_gguf_add" in n.name:
            mm = n.input[0]  # Add(MatMulNBits output, correction)
            nodes.append(helper.make_node("Identity", [mm], [n.output[0]], name=n.name))
            n_rm += 1
        else:
            nodes.append(n)
    needed = {o.name for o in g.output}
    keep = []
    for n in reversed(nodes):  # topological order: drop what no later node or output reads
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(n.input)
    del g.node[:]
    g.node.extend(reversed(keep))
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
    return n_rm


def fuse_skip_norms(proto: onnx.ModelProto) -> int:
    """Every residual Add feeding an RMSNormalization → one com.microsoft
    SkipSimplifiedLayerNormalization (normed output + the sum as its 4th output), what
    onnxruntime-genai's graphs use. The correction nodes stay; in place; returns how many."""
    g = proto.graph
    prod = {o: n for n in g.node for o in n.output}
    fused, drop = {}, set()
    for n in g.node:
        if n.op_type != "RMSNormalization":
            continue
        add = prod.get(n.input[0])
        if add is None or add.op_type != "Add" or "_gguf_" in add.name:
            continue
        eps = next(helper.get_attribute_value(a) for a in n.attribute if a.name == "epsilon")
        fused[id(n)] = helper.make_node(
            "SkipSimplifiedLayerNormalization",
            [add.input[0], add.input[1], n.input[1]],
            [n.output[0], "", "", add.output[0]],
            name=n.name + "_skip",
            domain="com.microsoft",
            epsilon=eps,
        )
        drop.add(id(add))
    nodes = [fused.get(id(n), n) for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(nodes)
    return len(fused)


def optimized_nodes(path: str, tmp: str) -> dict:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    out = os.path.join(tmp, "opt.onnx")
    so.optimized_model_filepath = out
    ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    m = onnx.load(out, load_external_data=False)
    ops: dict[str, int] = {}
    for n in m.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"nodes": len(m.graph.node), "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def main() -> None:
    bundle = sys.argv[1]
    rounds = int(os.environ.get("ROUNDS", "12"))
    reps = int(os.environ.get("REPS", "15"))
    m = load_manifest(bundle, verify="none")
    assert m.target.precision == "int4", m.target.precision
    path_a = str(m.path(m.target.graph_for("ort-cpu").path))
    ids = Tokenizer.from_file(str(m.path("tokenizer.json"))).encode(PROMPT).ids
    out = {
        "bundle": Path(bundle).name,
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "step_position": POS,
        "rounds": rounds,
        "reps_per_round": reps,
    }
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {"reduce (exported)": path_a}
        out["graphs"] = {"reduce (exported)": {"nodes": len(onnx.load(path_a, load_external_data=False).graph.node)}}
        # each variant: a rewrite of the exported graph, saved beside it, with what the rewrite changed
        for name, rewrite, what in (
            ("matmul indicator", to_matmul_blocksums, "blocksums_rewritten"),
            (NO_CORR, drop_corrections, "corrections_removed"),
            (SKIP, fuse_skip_norms, "fused"),
        ):
            proto = onnx.load(path_a)
            changed = rewrite(proto)
            path = os.path.join(tmp, f"v{len(graphs)}.onnx")
            onnx.save_model(proto, path, save_as_external_data=True, location=f"v{len(graphs)}.onnx.data")
            graphs[name] = path
            out["graphs"][name] = {"nodes": len(proto.graph.node), what: changed}
            del proto
        for name, p in graphs.items():
            out["graphs"][name]["after_ort_optimizer"] = optimized_nodes(p, tmp)
        st = {name: Stepper(p, m) for name, p in graphs.items()}
        lg = {name: s.run(ids, 0) for name, s in st.items()}
        a = lg["reduce (exported)"]
        out["logits_vs_exported"] = {
            name: {
                "positions": len(ids),
                "max_abs_diff": float(np.abs(a - b).max()),
                "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
            }
            for name, b in lg.items()
            if name != "reduce (exported)"
        }
        times = {name: {t: [] for t in (1, 2, 5)} for name in graphs}
        for t in (1, 2, 5):
            for s in st.values():
                s.run([1] * t, POS)  # binds this shape
                for _ in range(3):
                    s.step()
            for r in range(rounds):
                order = list(graphs) if r % 2 == 0 else list(graphs)[::-1]
                for name in order:
                    s = st[name]
                    s.run([1] * t, POS)
                    s.step()
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        s.step()
                        times[name][t].append(time.perf_counter() - t0)
        for name in graphs:
            out["graphs"][name].update(
                {f"t{t}_ms": round(1000 * float(np.median(v)), 3) for t, v in times[name].items()}
            )
        base = out["graphs"]["reduce (exported)"]
        out["ratio_to_exported"] = {
            name: {f"t{t}": round(out["graphs"][name][f"t{t}_ms"] / base[f"t{t}_ms"], 4) for t in (1, 2, 5)}
            for name in graphs
            if name != "reduce (exported)"
        }
    out["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
