"""Where bytes live: the storage contract (local POSIX files or a TensorStore kvstore, with
declared capabilities, ranged readers and one lock class) and write-rate pacing.
"""

from .._errors import LockHeldError
from ._coalesce import DEFAULT_MAX_OVER_READ_RATIO, DEFAULT_READ_CHUNK_BYTES, check_read_options, coalesce_ranges
from ._contract import FileLock, Reader, Storage
from ._direct import (
    ALIGN as DIRECT_ALIGN,
    DirectFile,
    check_direct_io,
    probe as probe_direct,
    sync_folders,
    write_file as write_direct_file,
)
from ._kvstore import KvStorage, Location, StorageFactory, register_storage, registered_schemes, storage_for, ts_context
from ._local import LocalStorage
from ._ratelimit import TokenBucket, acquire, limiter_for

__all__ = ['DEFAULT_MAX_OVER_READ_RATIO', 'DEFAULT_READ_CHUNK_BYTES', 'DIRECT_ALIGN', 'DirectFile', 'FileLock', 'KvStorage', 'LocalStorage', 'Location', 'LockHeldError', 'Reader', 'Storage', 'StorageFactory', 'TokenBucket', 'acquire', 'check_direct_io', 'check_read_options', 'coalesce_ranges', 'limiter_for', 'probe_direct', 'register_storage', 'registered_schemes', 'storage_for', 'sync_folders', 'ts_context', 'write_direct_file']
