"""Where bytes live: the storage contract (local POSIX files or a TensorStore kvstore, with
declared capabilities, ranged readers and one lock class) and write-rate pacing.
"""

from ._backends import FileLock, LocalStorage, LockHeldError, Reader, Storage, storage_for, ts_context
from ._ratelimit import TokenBucket, acquire, limiter_for

__all__ = ['FileLock', 'LocalStorage', 'LockHeldError', 'Reader', 'Storage', 'TokenBucket', 'acquire', 'limiter_for', 'storage_for', 'ts_context']
