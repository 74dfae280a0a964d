"""The snapshot's one copy of each shard, chosen per backend at run time.

On the CPU backend `np.asarray(shard)` is a view of the device buffer, so the one copy
is into a buffer of the pool (`_host.copy_to_host`). On an accelerator `np.asarray`
is itself a device-to-host copy into new memory, and a pool copy after it would be a
second one; there the snapshot copies each shard once, device to host, and keeps
that host copy:

- `pinned_host` (the device has that memory kind and a `pinned_host` array's
  `np.asarray` is a zero-copy view, probed once per platform): `jax.device_put` of the
  shard into `pinned_host` memory of its own device (`may_alias=False`: a real copy
  even of a shard already there), one DMA into memory that XLA's pinned host allocator
  reuses between snapshots; the snapshot keeps a read-only view of that array.
- `host_copy` (otherwise): `copy_to_host_async()`, then jax's own host copy
  (`np.asarray`, new memory) is kept, not copied again.

Either way, a host array that turns out to be a view of the shard's own buffer (a
shard in a host memory kind) is copied into the pool instead: a snapshot never
aliases the caller's arrays. Every transfer is started before any is waited on.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from ._host import copy_to_host

if TYPE_CHECKING:
    from ._buffer_pool import HostBufferPool

POOL = "pool"  # np.asarray is a view (CPU, numpy input): one copy into a pool buffer
PINNED_HOST = "pinned_host"  # device_put into pinned_host memory, keep a view of it
HOST_COPY = "host_copy"  # copy_to_host_async, keep jax's host copy

_ROUTES: dict[str, str] = {}  # platform -> route, probed once
_ROUTES_LOCK = threading.Lock()


@dataclasses.dataclass
class HostCopies:
    """The host copies of one snapshot, in the order of its shards.

    Attributes:
      arrays: C-contiguous host arrays sharing no memory with the inputs.
      pooled: per array, whether it is a buffer of the pool (to give back once
        written) or a host copy adopted from jax (dropped once written).
      copied_bytes: bytes copied to host memory, each shard's bytes once.
      route_bytes: those bytes by route (`POOL`, `PINNED_HOST`, `HOST_COPY`).
    """

    arrays: list[np.ndarray]
    pooled: list[bool]
    copied_bytes: int = 0
    route_bytes: dict[str, int] = dataclasses.field(default_factory=dict)


def _is_view_of(host: np.ndarray, arr: jax.Array) -> bool:
    """Whether `host` is the device buffer of `arr` itself (not a copy of it)."""
    if host.size == 0:
        return False
    try:
        return bool(host.ctypes.data == arr.unsafe_buffer_pointer())
    except (RuntimeError, ValueError, NotImplementedError):  # no host-visible pointer: a copy
        return False


def _probe(device: Any) -> str:
    if device.platform == "cpu":
        return POOL
    if PINNED_HOST not in {m.kind for m in device.addressable_memories()}:
        return HOST_COPY
    try:
        x = jax.device_put(np.zeros(4096, np.uint8), device)
        p = jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=PINNED_HOST), may_alias=False)
        return PINNED_HOST if _is_view_of(np.asarray(p), p) else HOST_COPY
    except (RuntimeError, ValueError, NotImplementedError, TypeError):  # this jax/backend cannot: the fallback
        return HOST_COPY


def snapshot_route(device: Any) -> str:
    """How the snapshot copies a shard on `device` (`POOL`, `PINNED_HOST` or
    `HOST_COPY`, see the module docstring); decided once per platform at run time."""
    with _ROUTES_LOCK:
        route = _ROUTES.get(device.platform)
        if route is None:
            route = _ROUTES[device.platform] = _probe(device)
        return route


def _route_of(data: jax.Array | np.ndarray) -> str:
    if not isinstance(data, jax.Array) or len(data.devices()) != 1:
        return POOL
    return snapshot_route(next(iter(data.devices())))


def reads_in_place(data: jax.Array | np.ndarray) -> bool:
    """Whether the snapshot reads this shard's bytes in place (`np.asarray` is a view: the
    `POOL` route of the CPU backend and of numpy arrays), so that its one copy can go
    anywhere the caller wants: a file-ordered shard file (`_encoding.fill_images`)
    instead of a pool buffer. On accelerators the device-to-host transfer is the copy."""
    return _route_of(data) == POOL


def snapshot_to_host(datas: Sequence[jax.Array | np.ndarray], pool: HostBufferPool | None = None) -> HostCopies:
    """Real host copies of single-device arrays (or numpy arrays), in the same order,
    each shard copied once.

    Args:
      datas: the shards to copy (`shard.data`, or a slice of it on its device) or host
        numpy arrays.
      pool: the buffers of the `POOL` route come from this pool (else fresh 64-byte
        aligned buffers).
    Returns:
      The copies, which of them are pool buffers, and the bytes copied.
    """
    routes = [_route_of(d) for d in datas]
    staged: list[Any] = [None] * len(datas)
    for i, (d, route) in enumerate(zip(datas, routes)):  # start every transfer first
        if route == PINNED_HOST:
            assert isinstance(d, jax.Array)
            device = next(iter(d.devices()))
            staged[i] = jax.device_put(d, jax.sharding.SingleDeviceSharding(device, memory_kind=PINNED_HOST), may_alias=False)
        elif route == HOST_COPY:
            assert isinstance(d, jax.Array)
            d.copy_to_host_async()
            staged[i] = d
    arrays: list[Any] = [None] * len(datas)
    pooled = [False] * len(datas)
    route_bytes: dict[str, int] = {}
    to_pool: list[int] = []
    for i, route in enumerate(routes):
        if route == POOL:
            to_pool.append(i)
            continue
        host = np.asarray(staged[i])
        if route == HOST_COPY and _is_view_of(host, staged[i]):  # a shard in host memory: copy it
            to_pool.append(i)
            continue
        arrays[i] = host
        route_bytes[route] = route_bytes.get(route, 0) + host.nbytes
    staged.clear()
    for i, host in zip(to_pool, copy_to_host([datas[i] for i in to_pool], pool)):
        arrays[i], pooled[i] = host, True
        route_bytes[POOL] = route_bytes.get(POOL, 0) + host.nbytes
    return HostCopies(arrays, pooled, sum(route_bytes.values()), route_bytes)
