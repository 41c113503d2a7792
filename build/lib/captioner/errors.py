"""The one error type the CLI turns into a one-line message and a non-zero exit."""


class CaptionerError(Exception):
    """Bad input from the user: a file, a config or a checkpoint. The message is one line and
    names the file (or key) and the problem."""
