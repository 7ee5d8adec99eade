"""`specedge` console script: dispatches to one module per command in this package.

Each command module defines `register(subparsers)`, which adds its parser and sets `func`
to a function taking the parsed args and returning an exit code. Expected failures
(bad input, bundle errors, missing packages) become one `error: …` line and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

COMMANDS = ("generate", "chat", "serve", "inspect", "bench", "plan", "build_engines", "train_draft")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: same one-line convention, exit 2
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def version() -> str:
    """The installed distribution's version; the package's own when run from a checkout that is
    not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("specedge")
    except PackageNotFoundError:
        from .. import __version__

        return __version__


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")


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


def _quiet_closed_stdout() -> None:
    """The reader of our stdout left (`specedge inspect B | head`): send the rest to /dev/null so
    neither the command nor the interpreter's final flush fails on it."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # pragma: no cover - stdout without a descriptor
        pass


class _GuardedStdout:
    """sys.stdout while a command runs: a write or flush that fails (a full disk behind `> file`,
    a failing device) becomes one OutputError naming standard output; a reader that left stays a
    BrokenPipeError (a quiet end)."""

    def __init__(self, stream):
        self._stream = stream
        self.failed = False

    def _guard(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            from ..errors import write_failure

            self.failed = True
            raise write_failure(e, "to standard output") from None

    def write(self, text):
        return self._guard(self._stream.write, text)

    def flush(self):
        return self._guard(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _ClosedStdout:
    """sys.stdout when the process started without a descriptor 1 (`cmd >&-`): Python leaves it
    None; a write fails as one on a closed descriptor would (EBADF), nothing else does."""

    def write(self, text):
        import errno

        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    def flush(self):
        pass

    def fileno(self):
        raise ValueError("standard output is closed")

    def isatty(self):
        return False

    def reconfigure(self, **kwargs):
        pass


def run_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Run the command `argv` names. Exit codes (docs/security.md): 0 done, 2 bad input (one
    `error: …` line), 74 an output that could not be written, 1 an internal fault (one line;
    --debug shows the traceback), 130 interrupted; a closed stdout ends the command quietly with 0."""
    from ..errors import EXIT_FAULT, EXIT_INTERRUPTED, EXIT_USAGE, EXIT_WRITE, WRITE_ERRNOS, one_line

    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    stdout = sys.stdout
    guarded = sys.stdout = _GuardedStdout(stdout if stdout is not None else _ClosedStdout())
    try:
        code = int(args.func(args) or 0)
        guarded.flush()  # what is still buffered fails here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_closed_stdout()
        return 0
    except expected_errors() as e:
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        return getattr(e, "exit_code", EXIT_USAGE)
    except ValueError as e:
        # Validation inside the library (sampling parameters, k, …) raises ValueError with a
        # sentence meant for the user.
        if debug:
            raise
        print(f"error: {one_line(e) or type(e).__name__}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        if debug:
            raise
        print("error: out of memory", file=sys.stderr)
        return EXIT_FAULT
    except OSError as e:
        # The system refused a file or a write: about the machine or the input, not a bug.
        if debug:
            raise
        reason = e.strerror or one_line(e) or type(e).__name__
        if e.errno in WRITE_ERRNOS:
            where = f"'{e.filename}'" if e.filename else "an output"
            print(f"error: cannot write {where}: {reason}", file=sys.stderr)
            return EXIT_WRITE
        if e.filename:
            print(f"error: cannot use '{e.filename}': {reason}", file=sys.stderr)
            return EXIT_USAGE
        print(
            f"error: internal error: {type(e).__name__}: {reason} (run with --debug for the traceback)", file=sys.stderr
        )
        return EXIT_FAULT
    except Exception as e:  # noqa: BLE001 - a bug: still one line, the traceback behind --debug
        if debug:
            raise
        print(
            f"error: internal error: {type(e).__name__}: {one_line(e)} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAULT
    finally:
        if sys.stdout is guarded:
            sys.stdout = stdout
        if guarded.failed and stdout is not None:
            _quiet_closed_stdout()  # the unwritable rest must not fail again in the interpreter's exit


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specedge", description="Speculative decoding on ONNX Runtime and TensorRT.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_version(p)
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


def exit_process(code: int) -> NoReturn:
    """End the interpreter with `code`. An interrupt that unwinds through `exec` of a string (the
    standard library does that when it builds classes, e.g. dataclasses) sets CPython's "unhandled
    KeyboardInterrupt" flag even when we catch it; under `python -m` the interpreter then kills
    itself with SIGINT at exit whatever sys.exit said. 130 therefore ends the process directly,
    after flushing, so a shell or CI sees the code the command chose."""
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # pragma: no cover - a closed stream has nothing to flush
                pass
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
