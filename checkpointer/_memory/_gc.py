"""A pause of Python's cyclic garbage collector around the library's batch work.

Saving or restoring a tree of thousands of small leaves creates and keeps tens of
thousands of small objects (metadata, records, index entries, JSON). Each time enough of
them survive, Python runs a full (generation 2) collection over the whole process heap,
which in a JAX program is large: measured on issue 15's 2,000 leaves, about 0.25 s of a
0.6 s save and of a 0.6 s restore were such collections. Reference counting frees all of
the library's objects without the collector (none form cycles that matter), so the
collector is paused over those stretches (never over waits for I/O of unbounded length).

A pause alone only defers the work: every object made during it is still young when it
ends, so the first allocation after it runs a collection over all of them, then another
as they are promoted, and the promotion itself can set off a full collection (measured at
100,000 small leaves: 12 µs a leaf of a save, 27 of a restore). So when the last pause
ends, the objects still alive are moved to the oldest generation without being traversed
(`gc.freeze()` then `gc.unfreeze()`: two list splices), which also resets the young
generation's count. They are collected with the program's next full collection; objects
moved this way do not count towards starting one. Not done when the program froze objects
itself (`gc.get_freeze_count()`): unfreezing would release its permanent generation.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Disables the cyclic collector for the block; nested and concurrent blocks (any
    thread) share one pause, and the collector is enabled again after the last one only
    if it was enabled before the first (a program that disabled it keeps it off). No
    collection is forced afterwards."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if gc.get_freeze_count() == 0:  # promote the survivors untraversed (module docstring)
                    gc.freeze()
                    gc.unfreeze()
                if _was_enabled:
                    gc.enable()
