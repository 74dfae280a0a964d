"""Coordination of processes through the key-value store of JAX's distributed runtime:
the job's processes and the one rendezvous (`Round`) every meeting of them uses.
"""

from ._distributed import DEFAULT_COMMIT_TIMEOUT_S, check_timeout_s, client, poll, process_count, process_index, records
from ._rendezvous import MAX_SHOWN, Details, Round, canonical, error_text, groups, procs, refusals

__all__ = ['DEFAULT_COMMIT_TIMEOUT_S', 'Details', 'MAX_SHOWN', 'Round', 'canonical', 'check_timeout_s', 'client', 'error_text', 'groups', 'poll', 'process_count', 'process_index', 'procs', 'records', 'refusals']
