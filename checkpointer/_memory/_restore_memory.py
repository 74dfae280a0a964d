"""Host memory of a restore: the destination buffers the reader fills.

In a fresh process every destination byte is fresh memory, and the kernel's work to
provide it (a page fault and a zeroed page per 4 KiB) costs more than reading the bytes
(see docs/DESIGN-decisions.md, "Fresh-process restore"). A destination of at least one
huge page is therefore an anonymous mapping aligned to 2 MiB and advised
`MADV_HUGEPAGE`, so transparent huge pages back it whole: one fault per 2 MiB instead of
512 (numpy's own allocations get the advice too, but their unaligned head and tail stay
in 4 KiB pages). Buffers are 64-byte aligned at least, so XLA's CPU client adopts them
without a copy (`jax.device_put`). Each such buffer is one mapping (up to three kernel
VMAs, the advised middle split from its ends); if the process runs out of mappings, the
buffer falls back to malloc (numpy).
"""

from __future__ import annotations

import functools
import math
import mmap
import os

import numpy as np

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux; Python's mmap module names it only where the platform has it
_MADV_NOHUGEPAGE = 15
HUGE_PAGES_ENV = "CHECKPOINTER_HUGE_PAGES"


@functools.cache
def use_huge_pages() -> bool:
    """Whether the library backs its large host buffers (restore destinations, snapshot
    buffers) with transparent huge pages (`MADV_HUGEPAGE`, the default) or keeps them in
    4 KiB pages (`MADV_NOHUGEPAGE`; restore destinations then populated whole in one call).
    Read once per process from the environment variable `CHECKPOINTER_HUGE_PAGES` ("1" or
    "0"; unset: "1").

    Huge pages cost one fault per 2 MiB instead of 512. On a virtual machine whose guest
    reports free memory to its host at huge-page order (a virtio-balloon with free page
    reporting), a huge page from a block already reported faults in the host at its first
    touch, and 4 KiB pages can be cheaper; which wins there depends on how long ago the
    memory was freed (docs/DESIGN-decisions.md, "Huge pages only where they pay").

    Raises:
      ValueError: `CHECKPOINTER_HUGE_PAGES` is set to something other than "0" or "1".
    """
    return _use_huge_pages(os.environ.get(HUGE_PAGES_ENV))


def _use_huge_pages(setting: str | None) -> bool:
    if setting is None or setting.strip() == "":
        return True
    if setting.strip() not in ("0", "1"):
        raise ValueError(f"{HUGE_PAGES_ENV}={setting!r}: expected '1' (transparent huge pages for the "
                         "library's large host buffers, the default) or '0' (4 KiB pages)")
    return setting.strip() == "1"


def host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array for a restore's destination.

    At least one huge page: its own anonymous mapping, 2 MiB-aligned and advised
    `MADV_HUGEPAGE` (where the platform has it), or `MADV_NOHUGEPAGE` where the user
    chose 4 KiB pages (`use_huge_pages`); smaller: a 64-byte aligned numpy buffer. The memory is
    freed with the last array that references it.

    Args:
      shape: the array shape, elements per dimension.
      dtype: the element type.
    """
    from ._aligned import aligned_empty

    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap.mmap, "madvise"):
        return aligned_empty(shape, dtype)
    try:
        m = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # e.g. the process's map count (vm.max_map_count) is exhausted: malloc still works
        return aligned_empty(shape, dtype)
    raw = np.frombuffer(m, np.uint8)  # keeps the mapping alive as long as any view of it
    offset = (-raw.ctypes.data) % HUGE_PAGE_BYTES
    try:
        if use_huge_pages():
            m.madvise(_MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE_BYTES)
        else:
            m.madvise(_MADV_NOHUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still correct
        pass
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)
