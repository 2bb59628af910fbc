"""The `dsv4` command line: one module per subcommand, listed in `COMMANDS`.

    dsv4 generate [PROMPT ...] [--model M]       answer prompts, print the speed
    dsv4 eval [--n N] [--json]                   score the embedded models on their task
    dsv4 inspect CHECKPOINT [--json]             would it load? (headers only, no tensor data)
    dsv4 convert SRC DST --layout native|hf      rewrite a checkpoint in another layout / format
    dsv4 env                                     the runtime and kernel backends this process sees

A subcommand module defines `add_arguments(parser)` and `run(args) -> exit status`, and imports nothing
heavy at module level: only the chosen command's module is imported, and torch only once it runs, so
`dsv4 --help` stays fast. Adding a command is one line in `COMMANDS`.

User errors (a bad argument, checkpoint, path or request: any `Dsv4Error`, or an OSError on a path the user
gave) print one line and exit with status 2; `--debug` prints the traceback as well. Anything else is a bug
and shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

from dsv4 import __version__
from dsv4.errors import Dsv4Error

EXIT_OK = 0
EXIT_USAGE = 2  # a user error, or problems found in what the user asked about (inspect)
EXIT_INTERRUPTED = 130  # the shell's convention for SIGINT


class Command(NamedTuple):
    """A subcommand: its name, the module that implements it, and its one-line help."""

    name: str
    module: str
    help: str


COMMANDS: tuple[Command, ...] = (
    Command("generate", "dsv4.cli.generate", "answer prompts (text, or token ids like 1,2,3) and print the speed"),
    Command("eval", "dsv4.cli.eval", "score the embedded models on held-out examples of their task"),
    Command("inspect", "dsv4.cli.inspect", "check that a checkpoint would load, from its headers only"),
    Command("convert", "dsv4.cli.convert", "rewrite a checkpoint in another layout or format"),
    Command("serve", "dsv4.server.launch", "serve a model over an OpenAI-compatible HTTP API"),
    Command("agreement", "dsv4.cli.agreement", "rollout-vs-trainer agreement metrics of a logprob file"),
    Command("env", "dsv4.cli.env", "print the runtime and the kernel backends chosen"),
)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (positional arguments describe theirs in words)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if not action.option_strings:
            return action.help
        return super()._get_help_string(action)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: every command is listed, only the chosen one's module is imported.

    Args:
        argv: the arguments after the program name.

    Returns:
        The parser; parsed arguments carry `run` (the command's entry point) and `command`.
    """
    parser = _Parser(prog="dsv4", description="DeepSeek-V4 inference engine", formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"dsv4 {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error, not one line")
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print the traceback of an error, not one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for command in COMMANDS:
        sub_parser = sub.add_parser(command.name, help=command.help, description=command.help,
                                    parents=[debug], formatter_class=_HelpFormatter)
        if command.name == chosen:
            module = importlib.import_module(command.module)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program name (None: sys.argv[1:]).

    Returns:
        The exit status: 0 success, 2 a user error or problems found, 130 interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except SystemExit as done:  # --help, --version, or a rejected argument (already printed)
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    _log_to_stderr()
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader of our output stopped early (`dsv4 inspect ... | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush stays quiet
        return EXIT_OK
    except (Dsv4Error, OSError) as exc:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"dsv4 {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"dsv4 {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return " ".join(text.split())


def _log_to_stderr() -> None:
    """Progress and status lines (logger "dsv4", INFO) go to stderr as plain text, unless the embedding
    program configured logging itself. (Imported here: `dsv4 --help` never needs logging.)"""
    import logging

    class StderrHandler(logging.Handler):
        """Writes each record to whatever sys.stderr is at that moment (tests and embedding programs swap it)."""

        def emit(self, record: logging.LogRecord) -> None:
            try:
                print(self.format(record), file=sys.stderr)
            except Exception:
                self.handleError(record)

    logger = logging.getLogger("dsv4")
    if logger.handlers or logging.getLogger().handlers:
        return
    logger.addHandler(StderrHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False
