"""One error type for everything a user can get wrong: the CLI prints it as one line."""


class MoetoolError(Exception):
    """A user-facing error (bad input, unknown model, no network...). Printed as one line."""
