"""Host memory: aligned host arrays, the reusable snapshot buffer pool, the host copy of shards,
huge-page restore destinations, the staging buffers of direct writes, and a pause of Python's cyclic GC around batch work.
"""

from ._aligned import aligned_empty
from ._buffer_pool import HostBufferPool, release_host_buffers, shared_pool
from ._gc import paused
from ._host import copy_to_host
from ._restore_memory import host_buffer
from ._staging import StagingBuffers, staging_buffers

__all__ = ['HostBufferPool', 'StagingBuffers', 'aligned_empty', 'copy_to_host', 'host_buffer', 'paused', 'release_host_buffers', 'shared_pool', 'staging_buffers']
