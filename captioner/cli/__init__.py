"""The `captioner` command: one entry point, a subcommand per job, one module per subcommand.

Each subcommand module has `add(subparsers)`, which declares its arguments, and `run(args) -> int`,
which calls the library with plain values and prints. Nothing else happens here: the work is the
library's. `main(argv)` turns a `CaptionerError` into a one-line message and exit status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from captioner.cli import average, caption, demo, evaluate, export, prepare, serve, train, visualize
from captioner.errors import WRITE_ERRORS, CaptionerError

COMMANDS = (demo, prepare, train, caption, visualize, evaluate, serve, export, average)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="captioner", description="Image captioning with Bahdanau attention: "
                                     "train on your captions, caption photos, see where the model looked.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command. Whatever a user can cause ends in one line on stderr and a non-zero status,
    never a traceback: bad input (2), an unwritable or full disk (2), Ctrl-C (130), a closed
    output pipe (`captioner caption ... | head -1`: quietly, 141)."""
    args = build_parser().parse_args(argv)
    # The project's own progress at INFO; other libraries' only from WARNING (the ONNX exporter and
    # quantizer log a hundred lines of their internals at INFO).
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("captioner").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        status = args.func(args)
        if sys.stdout is not None:
            sys.stdout.flush()  # inside the try: a full disk or a closed pipe behind stdout is reported here
        return status
    except CaptionerError as e:
        print(f"captioner: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more can be shown. Point stdout at /dev/null so the
        # interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a full disk, a read-only folder, a vanished file: the system's own words
        # the files captioner writes are named where they are written (`files.naming_write_errors`):
        # a write error naming none is the output the command prints
        where = f"{e.filename}: " if e.filename else "standard output: " if e.errno in WRITE_ERRORS else ""
        print(f"captioner: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("captioner: interrupted", file=sys.stderr)
        return 130
