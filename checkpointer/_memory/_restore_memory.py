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
import glob
import math
import mmap
import os

import numpy as np

HUGE_PAGE_BYTES = 2 << 20
_HUGE_PAGE_ORDER = 9  # 2 MiB = 2**9 pages of 4 KiB
_MADV_HUGEPAGE = 14  # Linux; Python's mmap module names it only where the platform has it
_MADV_NOHUGEPAGE = 15
_VIRTIO_BALLOON_F_REPORTING = 5  # the virtio spec's feature bit of free page reporting
HUGE_PAGES_ENV = "CHECKPOINTER_HUGE_PAGES"


@functools.cache
def huge_pages_pay() -> bool:
    """Whether the library backs its large host buffers (restore destinations, snapshot
    buffers) with transparent huge pages (`MADV_HUGEPAGE`) or keeps them in 4 KiB pages
    (`MADV_NOHUGEPAGE`). Decided once per process.

    True, except on a virtual machine whose guest kernel reports free memory to its host
    at huge-page order (a virtio-balloon device with free page reporting,
    `VIRTIO_BALLOON_F_REPORTING`, and `page_reporting_order` <= 9; the virtio spec 1.2,
    section 5.5, and Linux's `mm/page_reporting.c`): there every free 2 MiB block is
    handed back to the host, every huge page comes from such a block, and its first
    touch faults in the host as well as the guest, while 4 KiB pages come mostly from
    memory freed recently and still backed. Filling 1 GiB of fresh destinations took
    2.8 s of system time in huge pages against 1.0 s in 4 KiB pages on such a guest
    (docs/DESIGN-decisions.md, "Huge pages only where they pay").

    The environment variable `CHECKPOINTER_HUGE_PAGES` ("1" or "0") overrides the check.

    Raises:
      ValueError: `CHECKPOINTER_HUGE_PAGES` is set to something other than "0" or "1".
    """
    return _huge_pages_pay(os.environ.get(HUGE_PAGES_ENV), "/sys")


def _huge_pages_pay(setting: str | None, sysfs: str) -> bool:
    if setting is not None and setting.strip() != "":
        if setting.strip() not in ("0", "1"):
            raise ValueError(f"{HUGE_PAGES_ENV}={setting!r}: expected '1' (transparent huge pages for the "
                             "library's large host buffers) or '0' (4 KiB pages); unset it to let the library decide")
        return setting.strip() == "1"
    try:
        with open(f"{sysfs}/module/page_reporting/parameters/page_reporting_order") as f:
            order = int(f.read())
    except (OSError, ValueError):  # no free page reporting in this kernel
        return True
    if order > _HUGE_PAGE_ORDER:
        return True
    for path in glob.glob(f"{sysfs}/bus/virtio/drivers/virtio_balloon/virtio*/features"):
        try:
            with open(path) as f:
                bits = f.read().strip()  # one character per feature bit, bit 0 first
        except OSError:
            continue
        if len(bits) > _VIRTIO_BALLOON_F_REPORTING and bits[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return False
    return True


def host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array for a restore's destination.

    At least one huge page: its own anonymous mapping, 2 MiB-aligned and advised
    `MADV_HUGEPAGE` (where the platform has it), or `MADV_NOHUGEPAGE` where huge pages
    do not pay (`huge_pages_pay`); smaller: a 64-byte aligned numpy buffer. The memory is
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
        if huge_pages_pay():
            m.madvise(_MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE_BYTES)
        else:
            m.madvise(_MADV_NOHUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, still correct
        pass
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)
