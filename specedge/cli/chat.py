"""`specedge chat BUNDLE`: an interactive chat with history, the bundle's chat template and
streamed answers. Commands: /reset clears the history, /exit (or end of input) leaves.

Works with stdin that is not a terminal (one user message per line), so scripts and tests can
pipe a conversation in; the prompt marker and notes go to stderr, answers to stdout.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import one_line
from .generate import (
    add_sampling_args,
    check_args,
    format_stats,
    gen_kwargs,
    load_pipeline,
    require_chat_template,
    safe_stdout,
)

HELP = "commands: /reset clears the history, /exit leaves (so does end of input)"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "chat",
        help="interactive chat with a bundle",
        description="Chat with a bundle's model: history and chat template, answers streamed. " + HELP + ".",
    )
    p.add_argument("bundle", help="bundle folder")
    add_sampling_args(p, 512)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=run)
    return p


def _fit_history(pipe, messages: list[dict], n_system: int) -> list[dict]:
    """Drop the oldest exchanges until the rendered conversation leaves room to answer."""
    room = max(pipe.max_seq // 8, 16)
    while True:
        n = len(pipe.tokenizer.encode_chat(messages))
        if n + room <= pipe.max_seq or len(messages) <= n_system + 1:
            return messages
        del messages[n_system : n_system + 2]  # the oldest user + assistant pair


def run(args) -> int:
    check_args(args)
    require_chat_template(args.bundle, "use `specedge generate` for plain prompts")
    pipe = load_pipeline(args)
    safe_stdout()
    tty = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict] = list(system)
    if tty:
        print(f"specedge chat — {HELP}", file=sys.stderr)
    try:
        while True:
            if tty:
                print("> ", end="", file=sys.stderr, flush=True)
            try:
                raw = sys.stdin.buffer.readline()
            except KeyboardInterrupt:
                print(file=sys.stderr)
                break
            if not raw:  # end of input
                break
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:  # one bad line (a terminal in another encoding) is not the end
                print(
                    f"error: that line is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                    "nothing was sent",
                    file=sys.stderr,
                )
                continue
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                messages = list(system)
                print("(history cleared)", file=sys.stderr)
                continue
            if cmd.startswith("/") and " " not in cmd:
                print(f"unknown command {cmd}; {HELP}", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            messages = _fit_history(pipe, messages, len(system))
            try:
                stream = pipe.stream(messages=messages, **gen_kwargs(args))
            except ValueError as e:  # this message alone does not fit: say so and carry on
                print(f"error: {one_line(e)}", file=sys.stderr)
                messages.pop()
                continue
            try:
                for piece in stream:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                stream.close()
                sys.stdout.write("\n")
                print("(interrupted)", file=sys.stderr)
                messages.pop()
                continue
            sys.stdout.write("\n")
            sys.stdout.flush()
            r = stream.result
            messages.append({"role": "assistant", "content": r.text})
            if r.finish_reason == "context":
                print("(the context is full: /reset to start over)", file=sys.stderr)
            if args.stats:
                print(format_stats(r.stats) + f" | finish {r.finish_reason}", file=sys.stderr)
    finally:
        pipe.close()
    return 0
