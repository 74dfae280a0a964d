"""The commit protocol: the agreement before anything is written, the one commit sequence
(reports, records, catalog entry, manifest, marker, publication, announcement), the commit
strategies (rename or marker), the step catalog, and a directory's step folders
(committed, partial, crashed, being deleted).
"""

from ._agreement import DEFAULT_AGREEMENT_TIMEOUT_S, agree, next_ticket, proposal, refuse
from ._catalog import add_entry
from ._directory import (
    FINISHED_NAME,
    LOCK_NAME,
    SAVE_JOURNAL,
    SAVE_LOCK_SUFFIX,
    StepEntry,
    committed_folders,
    committed_steps,
    delete_step,
    entries,
    foreign_entries,
    plan_recovery,
    recover,
    repair,
    retire_step,
    retired_folders,
    unpublish_step,
)
from ._publish import Commit, commit_round, remove_leftovers
from ._strategies import strategy_for

__all__ = ['Commit', 'DEFAULT_AGREEMENT_TIMEOUT_S', 'FINISHED_NAME', 'LOCK_NAME', 'SAVE_JOURNAL', 'SAVE_LOCK_SUFFIX', 'StepEntry', 'add_entry', 'agree', 'commit_round', 'committed_folders', 'committed_steps', 'delete_step', 'entries', 'foreign_entries', 'next_ticket', 'plan_recovery', 'proposal', 'recover', 'refuse', 'remove_leftovers', 'repair', 'retire_step', 'retired_folders', 'strategy_for', 'unpublish_step']
