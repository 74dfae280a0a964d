"""Restoring: the target resolved per leaf, the cooperative tree plan, the restore pipeline
and its agreement, per-process state, and restore from safetensors files.
"""

from ._options import RestoreOptions
from ._pipeline import plan_restore, restore, restore_from
from ._process_state import per_process_state
from ._safetensors import restore_safetensors
from ._targets import resolve_target, resolve_tree

__all__ = ['RestoreOptions', 'per_process_state', 'plan_restore', 'resolve_target', 'resolve_tree', 'restore', 'restore_from', 'restore_safetensors']
