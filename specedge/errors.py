"""Errors meant for the user: the CLI prints their message as one `error: …` line, exit code 2."""


class UserError(Exception):
    """Bad input (arguments, files, bundles): exit code 2, no traceback unless --debug."""

    exit_code = 2
