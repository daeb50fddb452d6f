"""One error type for everything a user can get wrong: the CLI prints it as one line.

``exit_code`` is what the command exits with: 2 for a usage error (the command line asks for something this model or
these options cannot do), 1 for a runtime error (:class:`MoetoolRuntimeError`: no network, a corrupt file, no CUDA
device, not enough memory).
"""


class MoetoolError(Exception):
    """A user-facing error (bad input, unknown model, bad flag value...). Printed as one line; exit code 2."""

    exit_code = 2


class MoetoolRuntimeError(MoetoolError):
    """A user-facing error of the machine or the files rather than the command line (no network, corrupt
    weights, no CUDA, not enough memory). Printed as one line; exit code 1."""

    exit_code = 1
