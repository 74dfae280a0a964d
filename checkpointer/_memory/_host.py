"""Host snapshot buffers: the blocking part of a save.

A snapshot must be a real copy (DESIGN.md commit protocol, step 1): on the CPU backend
`np.asarray(shard)` is a view of the device buffer, which donation or deletion could
reuse while the background thread still writes it. The copy is made as fast as the
machine allows: every device-to-host transfer is started before any is waited on,
large shards are split into row blocks copied on all cores, and a `HostBufferPool`
(`_buffer_pool`) lets a manager or `save_async` reuse the previous snapshot's buffers,
which avoids the page faults of fresh memory (a warm copy runs at about twice the speed
of a cold one here).
This is the snapshot's copy on the CPU backend (and of numpy leaves);
on accelerators `_device_copy` copies each shard once without it.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from ._aligned import aligned_empty

if TYPE_CHECKING:
    from ._buffer_pool import HostBufferPool

_COPY_THREADS = max(2, os.cpu_count() or 2)
_BLOCK_BYTES = 8 << 20  # large shards are copied in row blocks of about this size
# Shards up to this size are copied on the calling thread: a thread pool's hand-off
# (tens of µs) costs more than copying them: the 5,000 shards of 1-16 KiB of issue 15's
# 2,000-leaf input copy in 0.047 s instead of 0.205 s (medians of 6, loaded 2-core VM).
_INLINE_BYTES = 256 << 10


def _blocks(n_rows: int, row_bytes: int) -> list[slice]:
    rows = max(1, _BLOCK_BYTES // max(1, row_bytes))
    return [slice(i, min(n_rows, i + rows)) for i in range(0, n_rows, rows)]


def copy_to_host(datas: Sequence[jax.Array | np.ndarray], pool: HostBufferPool | None = None) -> list[np.ndarray]:
    """Real host copies of single-device arrays (or numpy arrays), in the same order.

    Args:
      datas: the shards to copy (`shard.data`) or host numpy arrays.
      pool: reuse buffers from this pool (else fresh 64-byte aligned buffers).
    Returns:
      C-contiguous numpy arrays that share no memory with the inputs.
    """
    for d in datas:
        if isinstance(d, jax.Array):
            d.copy_to_host_async()
    if pool is not None:  # bounds the pool's idle memory by the largest snapshot
        pool.note_snapshot(sum(np.dtype(d.dtype).itemsize * int(np.prod(d.shape)) for d in datas))
    outs: list[np.ndarray] = []
    tasks: list[tuple[np.ndarray, np.ndarray]] = []
    for d in datas:
        src = np.asarray(d)
        dst = pool.take(src.shape, src.dtype) if pool is not None else aligned_empty(src.shape, src.dtype)
        outs.append(dst)
        if src.ndim == 0 or src.size == 0 or src.nbytes <= _INLINE_BYTES:
            np.copyto(dst, src)
            continue
        row_bytes = math.prod(src.shape[1:]) * src.dtype.itemsize
        tasks.extend((src[b], dst[b]) for b in _blocks(src.shape[0], row_bytes))
    if len(tasks) == 1:
        np.copyto(tasks[0][1], tasks[0][0])
    elif tasks:
        with concurrent.futures.ThreadPoolExecutor(_COPY_THREADS) as ex:
            for f in [ex.submit(np.copyto, dst, src) for src, dst in tasks]:
                f.result()
    return outs
