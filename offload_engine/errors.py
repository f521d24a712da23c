"""User-facing errors: a one-line message that names the file, tensor or number at fault.

The command line prints these without a traceback and exits with status 2.
"""


class UserError(Exception):
    """A mistake in the user's input (a path, a checkpoint, a flag), not a bug."""


class GenerationCancelled(Exception):
    """A generation stopped on request (a server client went away): raised between two layers of
    a forward pass, so the engine is free again within one layer's time."""
