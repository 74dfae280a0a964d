"""The `checkpointer` command line: ls, inspect, plan, verify, gc, drill, timeline, import-orbax, export.

Every subcommand prints readable tables (rich) or, with `--json`, one JSON document on
stdout. Errors are one line on stderr, `checkpointer: error: ...`, with exit status 2
for usage errors and missing checkpoints, 1 for failed verifications, drills and other
failures, 0 otherwise.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .._errors import (
    CheckpointError,
    DTypeMismatchError,
    InvalidTargetError,
    MeshError,
    ShapeMismatchError,
    StructureMismatchError,
    UsageError,
)
from ._parser import build_parser
from ._ui import _UI, PROG, _quiet_library_logs


def _one_line(e: BaseException) -> str:
    # The notes too: what the failed operation left behind (an unfinished export removed).
    text = " ".join(" ".join([str(e), *(n for n in getattr(e, "__notes__", ()) if isinstance(n, str))]).split())
    if isinstance(e, (CheckpointError, UsageError)):
        return text or type(e).__name__
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {text}"
    return f"internal error: {type(e).__name__}: {text} (rerun with --traceback for details)"


def _exit_code(e: BaseException) -> int:
    usage = (UsageError, FileNotFoundError, NotADirectoryError, InvalidTargetError, MeshError, ShapeMismatchError,
             DTypeMismatchError, StructureMismatchError)
    return 2 if isinstance(e, usage) else 1


def _closed_stdout() -> int:
    """The reader of stdout went away (`checkpointer ... | head`): exit quietly, status 141
    (128 + SIGPIPE, what a shell reports for a command killed by the broken pipe). Later
    writes, including the interpreter's flush at exit, go to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `checkpointer` command line.

    Args:
      argv: the arguments after the program name (default: `sys.argv[1:]`).
    Returns:
      The exit status: 0 ok, 1 a verification or drill found problems or an operation
      failed, 2 a usage error or no such checkpoint. Errors are printed as one line on
      stderr (`checkpointer: error: ...`), without a traceback unless `--traceback`.

    Multi-process: a single-process tool; `plan --processes P` emulates P processes.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: error: {_one_line(e)}\n")
        return 2
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    try:
        with _quiet_library_logs():
            status = args.func(args, _UI(getattr(args, "json", False)))
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
            return status
    except BrokenPipeError:
        return _closed_stdout()
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: error: interrupted\n")
        return 130
    except Exception as e:
        if args.traceback:
            raise
        sys.stderr.write(f"{PROG}: error: {_one_line(e)}\n")
        return _exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
