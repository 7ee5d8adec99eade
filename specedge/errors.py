"""Errors meant for the user: the CLI prints their message as one `error: …` line, exit code 2."""

import errno
import importlib


class UserError(Exception):
    """Bad input (arguments, files, bundles): exit code 2, no traceback unless --debug."""

    exit_code = 2


class Terminated(BaseException):
    """SIGTERM, raised in the main thread by CLIs that clean up or save on the way out."""


def raise_terminated(signum, frame):
    raise Terminated()


class BackendError(Exception):
    """A backend that cannot be created or run; one sentence for the user (e.g. a missing package).

    Raised by runtime backends and by the engine-plan checks they share with the builder, which is
    why it lives here rather than in the runtime."""


def import_optional(module: str, needed_for: str, hint: str, error: type[Exception] = BackendError):
    """Import an optional dependency, or raise `error` saying what needs it and how to get it:
    "<needed_for> needs <hint>"."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(f"{needed_for} needs {hint}") from None


# Exit codes of every specedge CLI (Python and C++), documented in docs/security.md.
EXIT_OK = 0
EXIT_FAULT = 1  # a fault of the program itself (a bug, out of memory)
EXIT_USAGE = 2  # bad input: arguments, files, bundles
EXIT_WRITE = 74  # an output could not be written (a full disk, a read-only or failing device); sysexits' EX_IOERR
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

# errno values that mean "the output could not be written", not a fault of the program
WRITE_ERRNOS = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS", "EIO") if hasattr(errno, n))


class OutputError(UserError):
    """An output (a file, a folder, a standard stream) could not be written: one sentence naming it
    and the reason, exit code EXIT_WRITE."""

    exit_code = EXIT_WRITE


def write_failure(e: OSError, what: str | None = None) -> OutputError:
    """`e` (a failed write) as an OutputError naming `what` (a path or a stream), else the file the
    error names."""
    reason = e.strerror or one_line(e) or type(e).__name__
    where = what or (f"'{e.filename}'" if e.filename else "an output file")
    return OutputError(f"cannot write {where}: {reason}")


def one_line(text) -> str:
    """A message as one line: its first non-empty line (ONNX Runtime's messages carry details and
    stack frames on the lines after it), as the C++ runtime prints them."""
    for part in str(text).splitlines():
        if part.strip():
            return part.strip()
    return ""
