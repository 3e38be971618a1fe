"""The `pykvq` command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType

from pykvq.convert.command import add_convert_command

from pykvq import __version__
from pykvq.commands.calibrate import add_calibrate_command
from pykvq.commands.info import add_info_command
from pykvq.commands.inspect import add_inspect_command
from pykvq.commands.perplexity import add_perplexity_command
from pykvq.commands.run import add_run_command

log = logging.getLogger("pykvq")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pykvq", description="Low-bit KV-cache quantization for llama.cpp / GGUF models.")
    parser.add_argument("--version", action="version", version=f"pykvq {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_command(commands)
    add_info_command(commands)
    add_perplexity_command(commands)
    add_calibrate_command(commands)
    add_convert_command(commands)
    add_inspect_command(commands)
    for command in commands.choices.values():
        command.set_defaults(command_parser=command)
    return parser


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, an unknown flag refused with its command's usage (argparse gives the top level's)."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


class Terminated(BaseException):
    """SIGTERM (what `timeout` and `kill` send), raised where Python runs next so that, as on Ctrl-C, every
    ``finally`` runs: a command's temporary files and folders go, the user's files stay as they were."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if sys.stdout is None:
        # a closed stdout: print() would drop every result without a word
        print("pykvq: error: standard output is closed: nothing could be shown or piped", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="pykvq: %(message)s")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    logging.getLogger("gguf").setLevel(logging.WARNING)
    # llama.cpp's own log only with -v: its errors reach the user as the exception's message
    logging.getLogger("pykvq.llama").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.handler(args)
    except BrokenPipeError:
        # the reader is gone (`| head`): end quietly, as a command killed by SIGPIPE, with nothing left to flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (RuntimeError, OSError, ValueError) as exc:
        # One line, no traceback: these carry a message meant for the user.
        print(f"pykvq: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\npykvq: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Terminated:
        print("\npykvq: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
