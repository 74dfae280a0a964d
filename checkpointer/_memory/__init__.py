"""Host memory: aligned host arrays, the reusable snapshot buffer pool, the host copy of shards
(one copy per shard, per backend), huge-page restore destinations, XLA-owned (donatable)
restore destinations on CPU, the staging buffers of direct writes, and a pause of Python's
cyclic GC around batch work.
"""

from ._aligned import aligned_empty
from ._buffer_pool import PAGE_ALIGN, HostBufferPool, page_aligned_empty, release_host_buffers, shared_pool
from ._device_copy import POOL, HostCopies, reads_in_place, snapshot_route, snapshot_to_host
from ._device_destination import device_destinations, populate_destination, supported as device_destination_supported
from ._gc import paused
from ._host import copy_to_host
from ._restore_memory import host_buffer
from ._staging import StagingBuffers, staging_buffers

__all__ = [
    'PAGE_ALIGN', 'POOL', 'HostBufferPool', 'HostCopies', 'StagingBuffers', 'aligned_empty', 'copy_to_host', 'device_destination_supported',
    'device_destinations', 'host_buffer', 'page_aligned_empty', 'paused', 'populate_destination', 'reads_in_place', 'release_host_buffers', 'shared_pool', 'snapshot_route',
    'snapshot_to_host', 'staging_buffers',
]
