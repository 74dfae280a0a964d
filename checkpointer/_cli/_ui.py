"""What the commands print: rich tables and fields on a terminal, plain text in a pipe,
one JSON document with `--json` (`_UI`); the formatting of ages, shapes, PartitionSpecs
and metrics; the library's log records kept off stderr."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Sequence

from .._format import value_repr

PROG = "checkpointer"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _spec_str(spec) -> str:
    parts = [repr(e) if not isinstance(e, tuple) else "(" + ", ".join(repr(a) for a in e) + ")" for e in spec]
    return f"P({', '.join(parts)})"


def _spec_json(spec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _metrics_str(metrics: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def _json_value(v: object) -> object:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 13_000:
        return value_repr(v)  # json.dumps of it would raise (the int-to-text digit limit)
    if v is None or isinstance(v, (bool, str)) or isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v):
        return v
    return repr(v)


def _mesh_str(mesh) -> str:
    return " x ".join(f"{n}={s}" for n, s in mesh.shape.items())


class _UI:
    """Where output goes: rich consoles on stdout/stderr, or JSON on stdout."""

    def __init__(self, json_mode: bool):
        from rich.console import Console

        self.json_mode = json_mode
        out = Console(file=sys.stdout, highlight=False, soft_wrap=False)
        if not out.is_terminal and "COLUMNS" not in os.environ:
            out = Console(file=sys.stdout, highlight=False, soft_wrap=False, width=200)
        self.out = out
        self.err = Console(file=sys.stderr, highlight=False)

    def json(self, obj: object) -> None:
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")

    def line(self, text: str = "", style: str | None = None) -> None:
        from rich.text import Text

        self._print(Text(text, style=style or ""))

    def _print(self, renderable) -> None:
        if self.out.is_terminal:
            self.out.print(renderable)
            return
        with self.out.capture() as cap:  # plain text: no padding at line ends
            self.out.print(renderable)
        sys.stdout.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[str] = (),
              title: str | None = None, footer: Sequence[object] | None = None) -> None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        t = Table(box=box.SIMPLE, title=title, title_justify="left", show_footer=footer is not None, show_edge=False,
                  pad_edge=False)
        for i, c in enumerate(columns):
            t.add_column(c, justify="right" if c in right else "left", no_wrap=True,
                         footer=Text(str(footer[i])) if footer is not None else "")
        for r in rows:
            t.add_row(*(Text(str(x)) for x in r))
        self._print(t)

    def fields(self, pairs: Sequence[tuple[str, object]]) -> None:
        from rich.table import Table
        from rich.text import Text

        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold", no_wrap=True)
        t.add_column()
        for k, v in pairs:
            t.add_row(Text(k), Text(str(v)))
        self._print(t)


@contextlib.contextmanager
def _quiet_library_logs():
    """Keeps the library's log records off stderr (Python's last-resort handler); the
    commands print what happened themselves."""
    logger = logging.getLogger("checkpointer")
    handler = logging.NullHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
