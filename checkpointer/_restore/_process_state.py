"""Per-process state: each process's own JSON value, kept in its `processes/<i>.json`.

A save's non-array leaves must be equal on every process (the agreement checks it);
what differs per process (a data loader's position, a host's RNG seed) is saved with
`save(..., per_process_state=obj)` and read back here, never by `restore`.

The rule when reading: a job with as many processes as saved the checkpoint gets, on
process i, what process i saved. With another process count there is no one-to-one
match, so the plain call raises `ProcessCountMismatchError`; the caller asks for all
N records (`all_processes=True`, a list indexed by the saving process) and maps them
onto its own processes itself, or names one record (`process_index=`).
"""

from __future__ import annotations

import os

import jax

from .. import _format
from .._errors import CorruptCheckpointError, ProcessCountMismatchError
from .._format import read_metadata, read_process_record
from .._storage import Storage, storage_for


def per_process_state(path: str | os.PathLike, process_index: int | None = None, *, all_processes: bool = False) -> object:
    """Returns the per-process state saved with the checkpoint at `path`.

    Args:
      path: a committed checkpoint path.
      process_index: read the record of this saving process (0 <= i < the saving
        process count), whatever this job's process count. Default: this process's
        own record, which needs the same process count as the save.
      all_processes: return every saving process's state, as a list indexed by process.
    Returns:
      The JSON value that process saved (dicts, lists, str, numbers, bool, None; tuples
      came back as lists), None if it saved none; with `all_processes`, a list of those.
    Raises:
      CheckpointNotFoundError: no committed checkpoint at `path`.
      ProcessCountMismatchError: this job's process count differs from the save's and
        neither `process_index` nor `all_processes` says which record to take.
      ValueError: `process_index` is not one of the saving processes.
      CorruptCheckpointError: a process record is missing or malformed.

    Multi-process: any process may call it alone; it reads small JSON files only.
    """
    storage, path = storage_for(path)
    saved = read_metadata(storage, path).process_count
    if all_processes:
        return [_read_state(storage, path, i) for i in range(saved)]
    if process_index is None:
        current = jax.process_count()
        if current != saved:
            raise ProcessCountMismatchError(
                f"{path} was saved by {saved} processes and this job has {current}, so there is no one-to-one "
                f"match for per-process state (process {jax.process_index()} asked for its own). Call "
                "per_process_state(path, all_processes=True) to get all the saved records (a list indexed by the "
                "saving process) and map them onto this job's processes yourself, or pass process_index=i for one."
            )
        process_index = jax.process_index()
    if isinstance(process_index, bool) or not isinstance(process_index, int) or not 0 <= process_index < saved:
        raise ValueError(f"process_index must be an int in [0, {saved}) for {path} (saved by {saved} processes), got {process_index!r}")
    return _read_state(storage, path, process_index)


def _read_state(storage: Storage, path: str, i: int) -> object:
    name = _format.process_record_name(i)
    try:
        parsed = read_process_record(storage, f"{path}/{name}")
    except FileNotFoundError as e:
        raise CorruptCheckpointError(
            f"{path} is committed but has no {name}, the record of process {i}: the checkpoint is damaged. "
            f"Run `checkpointer verify {path}`."
        ) from e
    if parsed.process_index != i:
        raise CorruptCheckpointError(
            f"{path}/{name} is the record of process {parsed.process_index}, expected process {i}: the checkpoint "
            f"is damaged. Run `checkpointer verify {path}`."
        )
    return parsed.per_process_state
