"""User-facing errors: a one-line message that names the file, tensor or number at fault.

The command line prints these without a traceback and exits with status 2.
"""


class UserError(Exception):
    """A mistake in the user's input (a path, a checkpoint, a flag), not a bug."""


class DataError(UserError):
    """The machine's own data failed (a damaged layer store, a failing disk, a chat template that
    hangs or kills its worker), not the request:
    one line at the command line like any UserError; a server answers 503 instead of 400."""


class GenerationCancelled(Exception):
    """A generation stopped on request (a server client went away): raised between two layers of
    a forward pass, so the engine is free again within one layer's time."""
