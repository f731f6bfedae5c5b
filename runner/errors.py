"""User-facing errors: the CLI turns these into a short message and exit code 2."""


class UserError(Exception):
    """Bad input the user can fix (a missing file, a malformed table, an impossible config).

    The message is shown as is, without a traceback, so it must say what was tried and how
    to fix it."""

    exit_code = 2
