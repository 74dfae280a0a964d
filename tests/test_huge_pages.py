"""The page size of the library's large host buffers (`_memory._restore_memory.use_huge_pages`,
`CHECKPOINTER_HUGE_PAGES`): huge pages by default, 4 KiB pages when chosen, read back from
/proc/self/smaps."""

import jax
import numpy as np
import pytest

from checkpointer._memory import _device_destination, _restore_memory
from checkpointer._memory._restore_memory import HUGE_PAGE_BYTES, _use_huge_pages, host_buffer


def test_huge_pages_are_the_default_and_the_environment_chooses_and_a_bad_value_says_what_it_expects():
    assert _use_huge_pages(None) is True and _use_huge_pages("") is True
    assert _use_huge_pages("1") is True and _use_huge_pages(" 0\n") is False
    with pytest.raises(ValueError, match=r"CHECKPOINTER_HUGE_PAGES='yes': expected '1'.*or '0'"):
        _use_huge_pages("yes")


def _smaps_kib(lo, hi, field="AnonHugePages"):
    """`field` (kB) summed over the mappings (kernel VMAs: an madvise splits one) that
    overlap [lo, hi), from /proc/self/smaps."""
    found, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                found = a < hi and lo < b
            elif found and head == f"{field}:":
                total += int(line.split()[1])
    return total


def _thp_available():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.fixture
def pay(monkeypatch):
    def set_(value):
        monkeypatch.setenv(_restore_memory.HUGE_PAGES_ENV, "1" if value else "0")
        _restore_memory.use_huge_pages.cache_clear()
    yield set_
    monkeypatch.delenv(_restore_memory.HUGE_PAGES_ENV)
    _restore_memory.use_huge_pages.cache_clear()


@pytest.mark.skipif(not _thp_available(), reason="no transparent huge pages on this kernel")
def test_host_buffers_are_huge_pages_unless_4k_pages_are_chosen(pay):
    for value in (True, False):
        pay(value)
        buf = host_buffer((4 * HUGE_PAGE_BYTES // 4,), np.float32)
        buf[:] = 1  # the first touch
        huge = _smaps_kib(buf.ctypes.data, buf.ctypes.data + buf.nbytes)
        assert (huge > 0) if value else (huge == 0), (value, huge)
        del buf


def _vma(address):
    """The smaps fields of the mapping (kernel VMA) holding `address`: its size, Rss (kB)
    and VmFlags ("hg": advised MADV_HUGEPAGE, "nh": MADV_NOHUGEPAGE)."""
    entries = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                entries.append((lo, hi, {"bytes": hi - lo}))
            elif head in ("Rss:", "AnonHugePages:"):
                entries[-1][2][head[:-1]] = int(line.split()[1])
            elif head == "VmFlags:":
                entries[-1][2]["VmFlags"] = line.split()[1:]
    return next(fields for lo, hi, fields in entries if lo <= address < hi)


@pytest.mark.skipif(not _thp_available(), reason="no transparent huge pages on this kernel")
def test_xla_destinations_are_4k_pages_populated_whole_when_chosen(pay):
    """The whole 2 MiB pages of a destination are their own mapping once advised (the
    advice splits XLA's). XLA may hand out memory it had before (huge pages already there
    stay), so the test reads the advice and what is resident, not the page size."""
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    for value in (False, True):
        pay(value)
        ((array, view),) = _device_destination.device_destinations([((6 * HUGE_PAGE_BYTES // 4,), np.float32, sharding)])
        middle = _vma(view.ctypes.data + view.nbytes // 2)  # before the first write
        assert ("hg" if value else "nh") in middle["VmFlags"], middle
        assert ("nh" if value else "hg") not in middle["VmFlags"], middle
        if not value:  # populated whole before the fill touched it
            assert middle["Rss"] * 1024 == middle["bytes"], middle
        view[:] = 2
        assert float(np.asarray(array).sum()) == 2.0 * array.size
        del view, array
