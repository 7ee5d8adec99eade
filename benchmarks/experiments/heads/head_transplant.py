"""Give a second bundle of the same target weights the draft head train-draft trained for a first.

    python benchmarks/experiments/heads/head_transplant.py SRC_BUNDLE DST_BUNDLE [--checkpoint DIR]

For benchmarks that need a head in a bundle with other graphs of the same model (a `--tree`
export, for tree_bench.py): training one again would take the 2-core CPU most of an hour for
the same result. The head's weights come from SRC's train-draft checkpoint (default
`.SRC.train-draft/` beside it); DST gets them through train-draft's own writer (export/head_graph.py
`write_head`: the head graph for DST's kv mode and max_seq, DST's target checksum, atomically).
Refused unless the head was trained on the same weights: both targets' weight files (external
data) have the same sha256, the same feature layers and width, the same tokenizer, and the
checkpoint's target checksum is SRC's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from specedge.manifest import load_manifest, target_fingerprint  # noqa: E402


def _weights(m) -> list[str]:
    return sorted(m.files[rel]["sha256"] for g in m.target.graphs for rel in g.external_data)


def transplant(src: Path, dst: Path, checkpoint: Path | None = None) -> dict:
    import torch

    from specedge.export.head_graph import write_head
    from specedge.models.eagle_head import head_for_target
    from specedge.training.train import _target_module, default_checkpoint

    ms, md = load_manifest(src, verify="size"), load_manifest(dst, verify="size")
    if ms.head is None:
        raise SystemExit(f"error: {src} has no draft head")
    for what, a, b in (
        ("target weights", _weights(ms), _weights(md)),
        ("features", ms.target.features, md.target.features),
        ("tokenizer", ms.files.get("tokenizer.json"), md.files.get("tokenizer.json")),
    ):
        if not a or a != b:
            raise SystemExit(f"error: the two bundles' {what} differ: the head would not fit {dst}")
    ck = Path(checkpoint) if checkpoint else default_checkpoint(src)
    state = torch.load(ck / "checkpoint.pt", weights_only=True)
    if state.get("target_fingerprint") != target_fingerprint(ms):
        raise SystemExit(f"error: the checkpoint in {ck} was not trained for {src}'s target")
    head = head_for_target(_target_module(ms), int(ms.target.features["dim"]), int(state["d2t"].numel()))
    head.load_state_dict(state["head"])
    head.eval()
    training = {**ms.head.extra.get("training", {}), "transplanted_from": str(src)}
    m = write_head(dst, head, training)
    return {"src": str(src), "dst": str(dst), "head": m.head.graphs[0].path, "draft_vocab": m.head.vocab_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--checkpoint", default=None)
    a = ap.parse_args(argv)
    print(transplant(Path(a.src), Path(a.dst), a.checkpoint))
    return 0


if __name__ == "__main__":
    sys.exit(main())
