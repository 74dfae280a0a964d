"""Where bytes live: the storage contract (local POSIX files or a TensorStore kvstore, with
declared capabilities, ranged readers and one lock class) and write-rate pacing.
"""

from .._errors import LockHeldError
from ._contract import FileLock, Reader, Storage
from ._kvstore import KvStorage, storage_for, ts_context
from ._local import LocalStorage
from ._ratelimit import TokenBucket, acquire, limiter_for

__all__ = ['FileLock', 'KvStorage', 'LocalStorage', 'LockHeldError', 'Reader', 'Storage', 'TokenBucket', 'acquire', 'limiter_for', 'storage_for', 'ts_context']
