"""User-facing errors: a one-line message that names the file, tensor or number at fault.

The command line prints these without a traceback and exits with status 2.
"""


class UserError(Exception):
    """A mistake in the user's input (a path, a checkpoint, a flag), not a bug."""
