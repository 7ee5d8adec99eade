"""`specedge` console script: dispatches to one module per command in this package.

Each command module defines `register(subparsers)`, which adds its parser and sets `func`
to a function taking the parsed args and returning an exit code. Expected failures
(bad input, bundle errors, missing packages) become one `error: …` line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("generate", "chat", "inspect", "bench", "plan", "build_engines")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: same one-line convention, exit 2
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def expected_errors() -> tuple[type[BaseException], ...]:
    from ..errors import UserError
    from ..manifest import BundleError

    errs: list[type[BaseException]] = [UserError, BundleError]
    try:
        from ..runtime.backends.base import BackendError

        errs.append(BackendError)
    except ImportError:  # pragma: no cover - the runtime is part of the package
        pass
    return tuple(errs)


def run_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except expected_errors() as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except ValueError as e:
        # Validation inside the library (sampling parameters, k, …) raises ValueError with a
        # sentence meant for the user.
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specedge", description="Speculative decoding on ONNX Runtime and TensorRT.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"{__package__}.{name}":
                continue  # command not built yet
            raise
        sp = mod.register(sub)
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
