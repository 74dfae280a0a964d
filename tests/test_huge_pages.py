"""Huge pages only where they pay (`_memory._restore_memory.huge_pages_pay`): the check of
the guest's free page reporting, its override, and the page size the library's large
host buffers then get (read back from /proc/self/smaps)."""

import jax
import numpy as np
import pytest

from checkpointer._memory import _device_destination, _restore_memory
from checkpointer._memory._restore_memory import HUGE_PAGE_BYTES, _huge_pages_pay, host_buffer


def _sysfs(tmp_path, order=None, features=None):
    root = tmp_path / "sys"
    if order is not None:
        p = root / "module/page_reporting/parameters"
        p.mkdir(parents=True)
        (p / "page_reporting_order").write_text(f"{order}\n")
    for i, bits in enumerate(features or []):
        d = root / f"bus/virtio/drivers/virtio_balloon/virtio{i}"
        d.mkdir(parents=True)
        (d / "features").write_text(bits + "\n")
    return str(root)


REPORTING = "0110010" + "0" * 57  # bit 5: VIRTIO_BALLOON_F_REPORTING (as this VM's balloon shows)
NO_REPORTING = "0110000" + "0" * 57


@pytest.mark.parametrize(("order", "features", "pays"), [
    (None, [], True),                     # a kernel without free page reporting
    (9, [], True),                        # reporting built in, no balloon that reports
    (9, [NO_REPORTING], True),            # a balloon without the reporting feature
    (9, [REPORTING], False),              # free 2 MiB blocks go back to the host
    (10, [REPORTING], True),              # only 4 MiB blocks are reported: a huge page stays backed
    (9, [NO_REPORTING, REPORTING], False),
])
def test_huge_pages_pay_unless_the_guest_reports_free_huge_blocks_to_its_host(tmp_path, order, features, pays):
    assert _huge_pages_pay(None, _sysfs(tmp_path, order, features)) is pays


def test_the_environment_overrides_the_check_and_a_bad_value_says_what_it_expects(tmp_path):
    reporting = _sysfs(tmp_path, 9, [REPORTING])
    assert _huge_pages_pay("1", reporting) is True
    assert _huge_pages_pay("0", str(tmp_path / "nothing")) is False
    assert _huge_pages_pay("", reporting) is False  # empty: as if unset
    with pytest.raises(ValueError, match=r"CHECKPOINTER_HUGE_PAGES='yes': expected '1'.*or '0'"):
        _huge_pages_pay("yes", reporting)


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
        _restore_memory.huge_pages_pay.cache_clear()
    yield set_
    monkeypatch.delenv(_restore_memory.HUGE_PAGES_ENV)
    _restore_memory.huge_pages_pay.cache_clear()


@pytest.mark.skipif(not _thp_available(), reason="no transparent huge pages on this kernel")
def test_host_buffers_are_huge_pages_only_where_they_pay(pay):
    for value in (True, False):
        pay(value)
        buf = host_buffer((4 * HUGE_PAGE_BYTES // 4,), np.float32)
        buf[:] = 1  # the first touch
        huge = _smaps_kib(buf.ctypes.data, buf.ctypes.data + buf.nbytes)
        assert (huge > 0) if value else (huge == 0), (value, huge)
        del buf


@pytest.mark.skipif(not _thp_available(), reason="no transparent huge pages on this kernel")
def test_xla_destinations_are_4k_pages_populated_whole_where_huge_pages_do_not_pay(pay):
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    for value in (True, False):
        pay(value)
        ((array, view),) = _device_destination.device_destinations([((6 * HUGE_PAGE_BYTES // 4,), np.float32, sharding)])
        lo, hi = view.ctypes.data, view.ctypes.data + view.nbytes
        resident_kib = _smaps_kib(lo, hi, "Rss")  # before the first write
        view[:] = 2
        assert float(np.asarray(array).sum()) == 2.0 * array.size
        huge = _smaps_kib(lo, hi)
        if value:
            assert huge > 0, huge
        else:  # no huge page, and every page of the buffer was there before the fill touched it
            assert huge == 0 and resident_kib >= view.nbytes // 1024, (huge, resident_kib)
        del view, array
