"""`specedge train-draft BUNDLE`: train a draft head (EAGLE-3 style) for the bundle's target and
write it into the bundle (specedge/training). Exit code 0 done, 2 bad input, 74 a write that failed,
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): the bundle is then as it was, and the steps
made so far are saved in the checkpoint a later run resumes from."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path


def register(subparsers) -> argparse.ArgumentParser:
    from ..training.train import TrainOptions

    d = TrainOptions()
    p = subparsers.add_parser(
        "train-draft",
        help="train a draft head for a bundle's target",
        description="Train a small draft head (one decoder layer over the target's hidden states, EAGLE-3 "
        "style) on self-distilled data: prompts written for it (749 by default) are answered by the "
        "model (its int4 self-draft when the bundle has one) and labelled by the target; the head learns "
        "the target's choices. The head is written into the bundle at the end "
        "(atomically); run it with `specedge generate BUNDLE --draft head`. The bundle's target must "
        "return features (`export-models --features`).",
    )
    p.add_argument("bundle", help="bundle folder")
    p.add_argument(
        "--budget",
        default=d.budget,
        help=f"training tokens (200000, 200k, 1.5M) or minutes for the whole run (30m) (default {d.budget})",
    )
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed (default {d.seed})")
    p.add_argument("--device", default=d.device, help="cpu or cuda (default cpu)")
    p.add_argument(
        "--steps", type=int, default=d.steps, help=f"chain steps unrolled per training step (default {d.steps})"
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=d.draft_vocab,
        help=f"draft vocabulary: the most frequent target tokens (default {d.draft_vocab})",
    )
    p.add_argument("--seq-len", type=int, default=d.seq_len, help=f"training window in tokens (default {d.seq_len})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"windows per step (default {d.batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr})")
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=d.answer_tokens,
        help=f"tokens the target writes per prompt (default {d.answer_tokens})",
    )
    p.add_argument(
        "--sampled-answers",
        type=int,
        default=d.sampled_answers,
        help=f"answers per prompt sampled from the target besides its greedy one: more training "
        f"contexts, each answer costs its generation time (default {d.sampled_answers})",
    )
    p.add_argument(
        "--answers-by",
        default=d.answers_by,
        help="who writes the answers the target then labels: the target (its runtime), the draft "
        "(the bundle's draft model alone: an int4 self-draft writes about 1.6x faster on a "
        "CPU), or auto: the draft when it is a self-draft, else the target (default auto)",
    )
    p.add_argument(
        "--soft-labels",
        type=int,
        default=d.soft_labels,
        help=f"learn the target's distribution over its K most probable tokens at each position "
        f"(0: only its greedy choice) (default {d.soft_labels})",
    )
    p.add_argument(
        "--train-dtype",
        default=d.train_dtype,
        help="the training step's matmuls: bf16 (weights and optimizer stay fp32), fp32, or auto: "
        "bf16 where the device computes it natively (a CUDA GPU that does, a CPU with "
        f"AVX512-BF16 or AMX) (default {d.train_dtype})",
    )
    p.add_argument(
        "--doc-tokens", type=int, default=d.doc_tokens, help=f"tokens of documentation text (default {d.doc_tokens})"
    )
    p.add_argument("--max-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--threads", type=int, default=None, help="CPU threads")
    p.add_argument(
        "--checkpoint", default=None, help="checkpoint folder (default .BUNDLE.train-draft next to the bundle)"
    )
    p.add_argument(
        "--no-resume", action="store_true", help="train afresh even if a checkpoint exists (its saved data is reused)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
    return p


class _Bars:
    """One TickingBar per stage; the training bar names tokens, loss, top-1 accuracy and the ETA."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.stage = None
        self.bar = None
        self.t0 = None

    def __call__(self, stage, done, total, info=None):
        from ..progress import TickingBar

        if stage != self.stage:
            self.close()
            self.stage, self.t0 = stage, time.monotonic()
            names = {
                "answers": "target answers",
                "features": "target features",
                "labels": "target distributions",
                "training": "training",
            }
            self.bar = TickingBar(names.get(stage, stage), total, quiet=self.quiet).__enter__()
            self.last = 0
        self.bar.update(done - self.last)
        self.last = done
        if info:
            el = time.monotonic() - self.t0
            eta = el / max(done, 1) * max(total - done, 0)
            self.bar.status(
                f"loss {info['loss']:.3f}  top-1 {100 * info['top1']:.1f}%  ETA {int(eta // 60)}m{int(eta % 60):02d}s"
            )

    def close(self):
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def run(args) -> int:
    from ..errors import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated, raise_terminated
    from ..training.train import TrainOptions, default_checkpoint, train_draft

    o = TrainOptions(
        budget=args.budget,
        seed=args.seed,
        device=args.device,
        steps=args.steps,
        draft_vocab=args.draft_vocab,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=args.lr,
        answer_tokens=args.answer_tokens,
        sampled_answers=args.sampled_answers,
        answers_by=args.answers_by,
        soft_labels=args.soft_labels,
        train_dtype=args.train_dtype,
        doc_tokens=args.doc_tokens,
        max_prompts=args.max_prompts,
        threads=args.threads,
        checkpoint=args.checkpoint,
        resume=not args.no_resume,
    )
    bars = _Bars(args.quiet or args.json)
    # SIGTERM (a service manager, `timeout`) stops the run as Ctrl-C does: through the training
    # loop's clean-up, which saves a checkpoint a later run resumes from.
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        m = train_draft(args.bundle, o, progress=bars)
    except (KeyboardInterrupt, Terminated) as e:
        bars.close()
        ck = Path(o.checkpoint) if o.checkpoint else default_checkpoint(Path(args.bundle))
        saved = (
            f"the training so far is saved in '{ck}': run again to resume"
            if (ck / "checkpoint.pt").is_file()
            else "no training step was saved"
        )
        stopped = "terminated" if isinstance(e, Terminated) else "interrupted"
        print(f"error: {stopped}: the bundle is as it was; {saved}", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
        bars.close()
    t = m.head.extra.get("training", {})
    if args.json:
        print(
            json.dumps(
                {
                    "bundle": str(args.bundle),
                    "head": m.head.graphs[0].path,
                    "draft_vocab": m.head.vocab_size,
                    "weight_bytes": m.head.weight_bytes,
                    "target_weight_bytes": m.target.weight_bytes,
                    "training": t,
                }
            )
        )
    else:
        print(
            f"draft head written to {args.bundle} ({m.head.graphs[0].path}): {t.get('tokens')} tokens, "
            f"loss {t.get('loss')}, top-1 {100 * t.get('top1', 0):.1f}% vs the target, "
            f"{m.head.weight_bytes / max(m.target.weight_bytes, 1):.1%} of the target's weight bytes per step",
            file=sys.stdout,
        )
    return 0
