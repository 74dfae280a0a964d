"""Coordination of processes through the key-value store of JAX's distributed runtime.
"""

from ._distributed import DEFAULT_COMMIT_TIMEOUT_S, Coordinator, _client, poll_reports, process_count, process_index

__all__ = ['Coordinator', 'DEFAULT_COMMIT_TIMEOUT_S', '_client', 'poll_reports', 'process_count', 'process_index']
