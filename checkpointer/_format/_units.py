"""Byte counts for people, as messages, the CLI and the planners print them."""

from __future__ import annotations


def format_bytes(n: int | None) -> str:
    """A byte count for people: `"512 B"`, `"1.5 KiB"`, ... up to TiB; `"-"` for None."""
    if n is None:
        return "-"
    if abs(n) < 1024:
        return f"{n} B"
    x = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"
