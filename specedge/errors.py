"""Errors meant for the user: the CLI prints their message as one `error: …` line, exit code 2."""

import importlib


class UserError(Exception):
    """Bad input (arguments, files, bundles): exit code 2, no traceback unless --debug."""

    exit_code = 2


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
