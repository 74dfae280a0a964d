"""Restore destinations that XLA's CPU client owns, so that a donating step reuses them.

`jax.device_put` of an aligned host array on the CPU backend adopts the array without a
copy, but the device buffer is then external memory that XLA does not own, and a jitted
step with `donate_argnums` gives its output a fresh buffer instead of reusing it: the
first training step after a restore allocates (and page-faults) the whole state again.
Here XLA allocates the device buffer itself (an output of a no-op
`jax.experimental.buffer_callback`, which leaves its pages untouched; one program
allocates every buffer a restore asks for at once, so distinct shapes share a compile), the pages are
advised `MADV_HUGEPAGE` as `host_buffer` does, and the reader fills the buffer through a
writable view of its memory before the array is handed to anyone. See
docs/DESIGN-decisions.md, "Donatable restored arrays".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._restore_memory import _MADV_HUGEPAGE, _MADV_NOHUGEPAGE, HUGE_PAGE_BYTES, use_huge_pages

_MADV_POPULATE_WRITE = 23  # Linux 5.14
_PAGE_BYTES = 4096
# Below this, page faults cost less than the call (and the heap's pages are mostly there).
_POPULATE_MIN_BYTES = 64 << 10


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


# One compiled program allocates at most this many arrays (per set of devices): a
# restore of N distinct box shapes compiles ceil(N / this) programs, not N.
_BATCH_ARRAYS = 512
# Up to this many arrays per set of devices are one program, whatever their rounds.
_FLAT_ARRAYS = 32
# Untouched blocks a restore may allocate beside the ones it asked for, to allocate the
# boxes of several sets of devices in one program (`_merge_into_union`).
_SPARE_BYTES = 64 << 20


@functools.cache
def _allocator(specs: tuple[tuple[tuple[int, ...], np.dtype], ...], devices: tuple[Any, ...]) -> Any:
    """A compiled function that returns, per `(shape, dtype)` of `specs`, an XLA-allocated,
    uninitialised array of one `shape` block per device, stacked along the first axis.

    One compile per list of specs and set of devices (~20 ms for one spec, ~0.3 s for
    300 here): every box a restore places on these devices is allocated by one program,
    so distinct shapes do not cost a compile each (docs/DESIGN-decisions.md, "Distinct
    shapes, one compile")."""
    from jax.experimental.buffer_callback import buffer_callback

    def leave(ctx: object, *out: object) -> None:
        del ctx, out  # the reader fills the buffers afterwards

    mesh = jax.sharding.Mesh(np.array(devices, dtype=object), ("devices",))
    spec = jax.sharding.PartitionSpec("devices")
    # Inside shard_map: each device's own block of every output.
    per_device = buffer_callback(leave, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs])
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(), out_specs=[spec] * len(specs)),
                   out_shardings=[jax.sharding.NamedSharding(mesh, spec)] * len(specs))


def _allocate_all(requests: Sequence[tuple[tuple[int, ...], np.dtype, Any]]) -> list[jax.Array]:
    """Per `(shape, dtype, device)` request, a single-device array whose buffer XLA
    allocated, untouched; a few programs for all of them (one per `_BATCH_ARRAYS` arrays
    and per number of leaves sharing a shape, or one for at most `_FLAT_ARRAYS` arrays;
    over all the requests' devices, or per set of devices where that would allocate more
    than `_SPARE_BYTES` nobody asked for), each compiled once per process."""
    # Per (shape, dtype), each device's requests; slot k holds the k-th request of every
    # device that has more than k (two leaves of one shape on one device: two slots).
    by_spec: dict[tuple[tuple[int, ...], np.dtype], dict[Any, list[int]]] = {}
    for i, (shape, dtype, device) in enumerate(requests):
        by_spec.setdefault((tuple(shape) or (1,), np.dtype(dtype)), {}).setdefault(device, []).append(i)
    slots: dict[tuple[Any, ...], list[tuple[tuple[tuple[int, ...], np.dtype], list[int | None]]]] = {}
    for spec, per_device in by_spec.items():
        for k in range(max(len(v) for v in per_device.values())):
            devices = tuple(sorted((d for d, v in per_device.items() if len(v) > k), key=lambda d: d.id))
            slots.setdefault(devices, []).append((spec, [per_device[d][k] for d in devices]))
    _merge_into_union(slots)
    arrays: list[Any] = [None] * len(requests)
    for devices, entries in slots.items():
        # Round r allocates the r-th slot of every spec that has more than r: the same
        # few programs however many leaves share a shape (300 leaves of one shape: one
        # single-output program run 300 times; of 300 shapes: one 300-output program).
        per_spec: dict[tuple[tuple[int, ...], np.dtype], list[list[int | None]]] = {}
        for spec, indices in entries:
            per_spec.setdefault(spec, []).append(indices)
        ordered = sorted(per_spec, key=lambda sp: (sp[0], sp[1].str))  # the same requests give the same (cached) programs
        rounds = [[(sp, r) for sp in ordered if len(per_spec[sp]) > r] for r in range(max(len(v) for v in per_spec.values()))]
        if len({tuple(sp for sp, _ in rd) for rd in rounds}) > 1 and sum(map(len, rounds)) <= _FLAT_ARRAYS:
            # Rounds of different specs would be programs of their own (16 sharded boxes
            # per device and a replicated leaf's box: two): a few arrays are one program.
            rounds = [[(sp, r) for sp in ordered for r in range(len(per_spec[sp]))]]
        for present in rounds:
            for at in range(0, len(present), _BATCH_ARRAYS):
                batch = present[at : at + _BATCH_ARRAYS]
                stacked = _allocator(tuple(sp for sp, _ in batch), devices)()
                for (spec, r), whole in zip(batch, stacked, strict=True):
                    by_device = {s.device: s.data for s in whole.addressable_shards}
                    for d, j in zip(devices, per_spec[spec][r], strict=True):
                        if j is not None:  # None: a spare block (`_merge_into_union`), freed with `whole`
                            arrays[j] = by_device[d]
    for i, (shape, _, _) in enumerate(requests):
        if not shape:  # a scalar: one block of one element, reshaped (a few bytes)
            arrays[i] = arrays[i].reshape(())
    return arrays


def _merge_into_union(slots: dict[tuple[Any, ...], list[tuple[tuple[tuple[int, ...], np.dtype], list[int | None]]]]) -> None:
    """Moves the slots of smaller sets of devices into the program of all the requests'
    devices while the blocks nobody asked for (allocated, never touched, freed at once)
    add up to at most `_SPARE_BYTES`: each set of devices is a program of its own to
    lower and compile (~27 ms here, before any byte is read), e.g. a fully replicated
    leaf's box on its first device beside leaves sharded over all of them. In place;
    a moved slot lists None for the devices it does not need."""
    union = tuple(sorted({d for devices in slots for d in devices}, key=lambda d: d.id))
    spare = 0
    for devices in sorted((ds for ds in slots if ds != union), key=len, reverse=True):
        entries = slots[devices]
        extra = sum(math.prod(shape) * dtype.itemsize for (shape, dtype), _ in entries) * (len(union) - len(devices))
        if spare + extra > _SPARE_BYTES:
            continue
        spare += extra
        at = {d: k for k, d in enumerate(devices)}
        slots.setdefault(union, []).extend((spec, [idx[at[d]] if d in at else None for d in union]) for spec, idx in entries)
        del slots[devices]


def supported(sharding: jax.sharding.SingleDeviceSharding) -> bool:
    """Whether `device_destinations` can allocate on this sharding: a CPU device in its
    default memory (other backends copy host arrays into memory they own anyway)."""
    device: Any = next(iter(sharding.device_set))  # Any: jaxlib has no stubs for Device
    if device.platform != "cpu" or sharding.memory_kind not in (None, device.default_memory().kind):
        return False
    try:
        from jax.experimental import buffer_callback  # noqa: F401  (jax releases without it: adoption)
    except ImportError:
        return False
    return True


def device_destinations(
    requests: Sequence[tuple[tuple[int, ...], np.dtype, jax.sharding.SingleDeviceSharding]], *, populate: bool = True,
) -> list[tuple[jax.Array, np.ndarray] | None]:
    """Single-device arrays whose buffers XLA owns, and a writable host view of each buffer.

    The caller fills each view and drops it before handing its array out: a view does not
    keep its buffer alive, and once the array is deleted (donated) it points at freed
    memory. Before their first touch, the whole 2 MiB pages inside each buffer are advised
    `MADV_HUGEPAGE`, and its head and tail outside them (which the allocator's own page
    at the start of its mapping keeps out of huge pages) are populated in one call
    (`MADV_POPULATE_WRITE`) instead of one page fault per 4 KiB. Where the user chose 4 KiB
    pages (`use_huge_pages`, `CHECKPOINTER_HUGE_PAGES=0`), the buffer is advised
    `MADV_NOHUGEPAGE` and populated whole in one call.

    Ask for all of a restore's arrays in one call: they are allocated by one compiled
    program per set of devices (and per `_BATCH_ARRAYS` arrays), not one per shape.

    Args:
      requests: per array its shape (elements per dimension), dtype and device (a CPU
        device in its default memory: `supported`).
      populate: populate the heads and tails (or the whole buffer) now; False leaves that to
        `populate_destination`, called by whoever fills the view (so that the readers
        populate in parallel what one thread would populate here, a quarter of the
        bytes of 8 MiB boxes).

    Returns:
      Per request (in order) the array and its writable view: C-contiguous, of the
      request's shape and dtype; None where XLA gave another shape or dtype (a 64-bit
      dtype with `jax_enable_x64` off): place that one from a host array.

    Multi-process: per process, on its own devices.
    """
    arrays = _allocate_all([(tuple(shape), np.dtype(dtype), next(iter(sharding.device_set))) for shape, dtype, sharding in requests])
    out: list[tuple[jax.Array, np.ndarray] | None] = []
    for a, (shape, dtype, _) in zip(arrays, requests):
        a.block_until_ready()
        if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):  # e.g. 64-bit types canonicalised with x64 off
            out.append(None)
            continue
        if not a.nbytes:
            out.append((a, np.empty(a.shape, a.dtype)))
            continue
        pointer = a.unsafe_buffer_pointer()
        _prepare(pointer, a.nbytes, populate)
        view = np.ctypeslib.as_array((ctypes.c_uint8 * a.nbytes).from_address(pointer))
        out.append((a, view.view(a.dtype).reshape(a.shape)))
    return out


def _huge_range(lo: int, nbytes: int) -> tuple[int, int]:
    """The whole 2 MiB pages inside [lo, lo + nbytes), as [start, end) (empty: start = end)."""
    hi = lo + nbytes
    start, end = -(-lo // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES, hi // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    return (start, end) if end > start else (hi, hi)


def _prepare(lo: int, nbytes: int, populate: bool = True) -> None:
    """Huge pages for [lo, lo + nbytes) where they fit, the rest populated (`populate`);
    where the user chose 4 KiB pages (`use_huge_pages`), those, all populated. Errors
    (no transparent huge pages, a kernel before 5.14) only leave 4 KiB page faults:
    still correct."""
    start, end = _huge_range(lo, nbytes)
    if end > start and nbytes >= HUGE_PAGE_BYTES:
        advice = _MADV_HUGEPAGE if use_huge_pages() else _MADV_NOHUGEPAGE
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)
    if populate:
        _populate(lo, nbytes)


def _populate(lo: int, nbytes: int) -> None:
    start, end = _huge_range(lo, nbytes)
    if not use_huge_pages():  # one call for the whole buffer instead of one fault per 4 KiB
        start = end = -(-(lo + nbytes) // _PAGE_BYTES) * _PAGE_BYTES
    for a, b in ((lo // _PAGE_BYTES * _PAGE_BYTES, start), (end, -(-(lo + nbytes) // _PAGE_BYTES) * _PAGE_BYTES)):
        if b - a >= _POPULATE_MIN_BYTES:
            _libc().madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_POPULATE_WRITE)


def populate_destination(view: np.ndarray) -> None:
    """Populates the head and tail of a `device_destinations(..., populate=False)` view
    (the parts outside whole 2 MiB pages; the whole view with 4 KiB pages chosen)
    in one call each, before the view is filled:
    cheaper than one page fault per 4 KiB. Call it on the thread that fills the view."""
    if view.nbytes:
        _populate(view.ctypes.data, view.nbytes)
