"""`specedge generate BUNDLE PROMPT|-`: generate text with speculative decoding, streamed to stdout.

Greedy by default (temperature 0): the output is exactly the target's own greedy output.
`--json` prints one object (text, token_ids, finish_reason, stats) instead of streaming.
Nothing here imports torch or the export code: the runtime install is enough.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..contract import MAX_SPEC_TOKENS as MAX_K


def add_sampling_args(p: argparse.ArgumentParser, max_new_default: int) -> None:
    """Options shared by `generate` and `chat`."""
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_default,
        metavar="N",
        help=f"tokens to generate at most (default {max_new_default})",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default), else sampling temperature"
    )
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (same seed, same output)")
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=None,
        metavar="K",
        help=f"draft tokens per round, 1..{MAX_K} (default: the bundle's)",
    )
    p.add_argument("--no-spec", action="store_true", help="decode with the target alone")
    p.add_argument(
        "--draft",
        choices=("model", "ngram", "head"),
        default=None,
        help="drafter: the draft model, prompt lookup or the trained draft head (default: the bundle's)",
    )
    p.add_argument(
        "--adaptive-k", action="store_true", help="grow k while drafts are accepted, shrink it on early rejections"
    )
    p.add_argument(
        "--no-guard",
        action="store_true",
        help="never shrink k or fall back to target-only when speculation does not pay",
    )
    p.add_argument(
        "--tree",
        action="store_true",
        help="verify a tree of drafted continuations per target call, sized by the measured call cost "
        "(a bundle exported with --tree; n-gram drafter)",
    )
    p.add_argument("--stop", action="append", default=None, metavar="STR", help="stop when STR appears (repeatable)")
    p.add_argument(
        "--backend", default="auto", help="auto, ort-cpu, ort-cuda, ort-trt, tensorrt or torch (default auto)"
    )
    p.add_argument("--draft-backend", default=None, metavar="B", help="backend of the draft model (default: --backend)")
    p.add_argument(
        "--provider",
        action="append",
        default=None,
        metavar="EP",
        help="ONNX Runtime execution provider for ort-* backends, e.g. cuda or OpenVINOExecutionProvider (repeatable)",
    )
    p.add_argument("--threads", type=int, default=None, metavar="N", help="intra-op threads per ONNX Runtime session")
    p.add_argument(
        "--verify",
        choices=("full", "size", "none"),
        default="full",
        help="bundle file check at load (default full: sha256)",
    )
    p.add_argument("--stats", action="store_true", help="print speed and acceptance figures on stderr")
    p.add_argument(
        "--int4-kernel",
        choices=("auto", "specedge", "matmulnbits"),
        default="auto",
        help="which graph an int4 model with two runs on ort-cpu: auto (default) specedge's kernels where "
        "they have a fast path here, else ONNX Runtime's MatMulNBits; or that one",
    )


MAX_COUNT = 1 << 30  # --max-new-tokens and --top-k, as the C++ CLI bounds them


def check_args(args) -> None:
    """Argument checks that need no bundle (fail fast, one sentence each)."""
    from ..errors import UserError

    for opt, v in (("--max-new-tokens", args.max_new_tokens), ("--top-k", args.top_k)):
        if v > MAX_COUNT:
            raise UserError(f"{opt} must be <= {MAX_COUNT}, got {v}")
    from ..runtime.requests import CLI_FLAGS, GenerationConfig

    try:  # the request's settings: the runtime's one check, in the flags' names
        GenerationConfig(**gen_kwargs(args)).validate(names=CLI_FLAGS)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    from ..runtime.api import MAX_THREADS

    if args.threads is not None and args.threads > MAX_THREADS:
        raise UserError(f"--threads must be <= {MAX_THREADS}, got {args.threads}")
    for opt, text in [("--stop", s) for s in args.stop or ()] + [("--system", getattr(args, "system", None))]:
        if text is not None and not is_utf8(text):
            raise UserError(f"{opt} is not valid UTF-8 text")
    from ..runtime.backends import NAMES

    for opt, name in (("--backend", args.backend), ("--draft-backend", args.draft_backend)):
        if name is not None and name not in NAMES:
            raise UserError(f"unknown backend '{name}' ({opt}); valid backends: {', '.join(NAMES)}")


def is_utf8(text: str) -> bool:
    """False for an argument the OS handed over as bytes that are not UTF-8 (Python keeps them
    as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_utf8(data: bytes, what: str) -> str:
    from ..errors import UserError

    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def require_chat_template(bundle: str, instead: str) -> None:
    """Refuse a bundle without a chat template (a base model) from its manifest alone, before
    any weights load: loading takes seconds to minutes and would only end in this refusal."""
    from ..errors import UserError
    from ..manifest import load_manifest

    if not load_manifest(bundle, verify="none").chat_template:
        raise UserError(f"the bundle has no chat template (a base model?): {instead}")


def load_pipeline(args):
    from ..progress import TickingBar
    from ..runtime.api import load

    # A ticking bar while the bundle loads, on a terminal only: piped stderr stays for errors and stats.
    quiet = getattr(args, "json", False) or getattr(args, "quiet", False) or not sys.stderr.isatty()
    with TickingBar(f"loading {args.bundle}", quiet=quiet, leave=False) as bar:
        return load(
            args.bundle,
            backend=args.backend,
            draft_backend=args.draft_backend,
            threads=args.threads,
            providers=args.provider,
            draft=args.draft,
            verify=args.verify,
            shared_pool=True,  # the CLI owns its process: target and draft on one spinning pool
            progress=bar.step,
            int4_kernel=getattr(args, "int4_kernel", "auto"),
        )


def gen_kwargs(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        spec_tokens=args.spec_tokens,
        speculative=not args.no_spec,
        adaptive_k=args.adaptive_k,
        guard=not args.no_guard,
        tree=args.tree,
    )


def format_stats(stats: dict) -> str:
    parts = [f"{stats['tokens']} tokens", f"{stats['tokens_per_s']:.1f} tok/s", f"ttft {stats['ttft_s'] * 1000:.0f} ms"]
    if stats.get("speculative"):
        parts += [
            f"{stats['drafter']} draft",
            f"acceptance {stats['acceptance_rate']:.2f}",
            f"{stats['mean_accepted']:.2f} tokens/target call",
            f"k {stats['k']}" + (f"->{stats['k_final']}" if stats.get("k_final") != stats["k"] else ""),
            f"draft {stats['time_draft_s']:.2f}s / verify {stats['time_verify_s']:.2f}s / other {stats['time_other_s']:.2f}s",
        ]
        if stats.get("fallbacks"):
            parts.append(f"{stats['fallbacks']} fallback(s) to target-only ({stats['fallback_tokens']} tokens)")
    else:
        parts.append("target only")
    parts += [f"{role} int4 kernel {how}" for role, how in stats.get("int4_kernels", {}).items()]
    return "stats: " + " | ".join(parts)


def safe_stdout() -> None:
    """Never die on a console that cannot show a character."""
    try:
        sys.stdout.reconfigure(errors="replace")
    except (AttributeError, ValueError):  # pragma: no cover - replaced streams
        pass


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="generate text from a prompt",
        description="Generate text with speculative decoding (greedy by default: exactly the target's output). "
        "The text is streamed to stdout as tokens are accepted.",
    )
    p.add_argument("bundle", help="bundle folder")
    p.add_argument("prompt", help="the prompt, or - to read it from stdin")
    add_sampling_args(p, 128)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the bundle's chat template"
    )
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, finish_reason, stats)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from ..errors import UserError

    check_args(args)
    prompt = args.prompt
    if prompt == "-":
        prompt = read_utf8(sys.stdin.buffer.read(), "the prompt read from stdin")
        if prompt.endswith("\n"):
            prompt = prompt[:-1]
    elif not is_utf8(prompt):
        raise UserError("the prompt is not valid UTF-8 text")
    if not prompt:
        raise UserError("the prompt is empty")
    if args.system is not None and not args.chat:
        raise UserError("--system needs --chat")
    if args.chat:
        require_chat_template(args.bundle, "drop --chat and give a plain prompt")
    pipe = load_pipeline(args)
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            src = dict(messages=messages)
        else:
            src = dict(prompt=prompt)
        stream = pipe.stream(**src, **gen_kwargs(args))
        if args.json:
            for _ in stream:
                pass
            r = stream.result
            print(
                json.dumps(
                    {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason, "stats": r.stats},
                    ensure_ascii=False,
                )
            )
        else:
            safe_stdout()
            try:
                for piece in stream:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                sys.stdout.write("\n")
                sys.stdout.flush()
            except BrokenPipeError:  # `specedge generate ... | head`: the reader left, fine
                stream.close()
                raise
            r = stream.result
        if args.stats:
            print(format_stats(r.stats) + f" | finish {r.finish_reason}", file=sys.stderr)
    finally:
        pipe.close()
    return 0
