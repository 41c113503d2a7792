"""The one error type the CLI turns into a one-line message and a non-zero exit, and the write errors it names."""
import errno

# What writing a file fails with when the disk (or quota) is full or failing. The system does not say
# which file: the writers name it (`files.naming_write_errors`).
WRITE_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


class CaptionerError(Exception):
    """Bad input from the user: a file, a config or a checkpoint. The message is one line and
    names the file (or key) and the problem."""
