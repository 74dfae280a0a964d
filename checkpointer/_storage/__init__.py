"""Where bytes live: the storage contract (local POSIX files or a TensorStore kvstore, with
declared capabilities, ranged readers and one lock class) and write-rate pacing.
"""

from .._errors import LockHeldError
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

__all__ = ['DIRECT_ALIGN', 'DirectFile', 'FileLock', 'KvStorage', 'LocalStorage', 'Location', 'LockHeldError', 'Reader', 'StorageFactory', 'register_storage', 'registered_schemes', 'Storage', 'TokenBucket', 'acquire', 'check_direct_io', 'limiter_for', 'probe_direct', 'storage_for', 'sync_folders', 'ts_context', 'write_direct_file']
