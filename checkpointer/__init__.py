"""checkpointer: sharded, asynchronous, atomic checkpoints of JAX training state.

    import checkpointer as ckpt
    ckpt.save("/ckpt/100", state)
    state = ckpt.restore("/ckpt/100", target)   # target: ShapeDtypeStructs with shardings

See DESIGN.md for the on-disk format and the commit protocol.

The public names are loaded on first use (PEP 562 `__getattr__`): `import checkpointer`
imports only the errors, so a resumed job that only restores never loads the save,
manager, CLI or export modules (see docs/DESIGN-decisions.md, "Fresh-process restore").
`from checkpointer import X` and `checkpointer.X` work as for eager names.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

from ._errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitTimeoutError,
    CorruptCheckpointError,
    DTypeMismatchError,
    InvalidTargetError,
    MeshError,
    ProcessCountMismatchError,
    RestoreAgreementError,
    SaveAgreementError,
    SaveError,
    ShapeMismatchError,
    StructureMismatchError,
    UnsupportedValueError,
)

if TYPE_CHECKING:  # the lazy names below, for type checkers and IDEs
    from ._api import save, save_async
    from ._async import AsyncSave
    from ._box import Box
    from ._buffer_pool import release_host_buffers
    from ._drill import DrillReport
    from ._export import ExportReport, export
    from ._format import ArrayMetadata, SavedSharding, ValueMetadata
    from ._leaf_plan import BoxRead, ChunkRead, LeafRestorePlan, PeerPiece, RestorePlan
    from ._manager import CheckpointManager, ManagerStatus
    from ._metadata import CheckpointMetadata, metadata
    from ._orbax_import import import_orbax
    from ._policies import KeepAny, KeepBest, KeepEvery, KeepLatest, KeepPolicy, KeepSteps
    from ._process_state import per_process_state
    from ._read import RestoreStats
    from ._restore import plan_restore, restore
    from ._save_plan import LeafAssignment, ProcessWrites, SavePlan
    from ._save_preview import plan_save
    from ._timeline import timeline
    from ._verify import VerifyReport, verify

    __version__: str

# public name -> the private module that defines it (loaded on first access)
_LAZY: dict[str, str] = {
    "save": "_api", "save_async": "_api", "AsyncSave": "_async", "Box": "_box", "DrillReport": "_drill",
    "release_host_buffers": "_buffer_pool",
    "ExportReport": "_export", "export": "_export",
    "ArrayMetadata": "_format", "SavedSharding": "_format", "ValueMetadata": "_format",
    "CheckpointManager": "_manager", "ManagerStatus": "_manager",
    "CheckpointMetadata": "_metadata", "metadata": "_metadata", "import_orbax": "_orbax_import",
    "KeepAny": "_policies", "KeepBest": "_policies", "KeepEvery": "_policies", "KeepLatest": "_policies",
    "KeepPolicy": "_policies", "KeepSteps": "_policies", "per_process_state": "_process_state",
    "RestoreStats": "_read", "plan_restore": "_restore", "restore": "_restore",
    "BoxRead": "_leaf_plan", "ChunkRead": "_leaf_plan", "LeafRestorePlan": "_leaf_plan",
    "PeerPiece": "_leaf_plan", "RestorePlan": "_leaf_plan",
    "LeafAssignment": "_save_plan", "ProcessWrites": "_save_plan", "SavePlan": "_save_plan",
    "plan_save": "_save_preview", "timeline": "_timeline", "VerifyReport": "_verify", "verify": "_verify",
}


def _module(name: str) -> ModuleType:
    """The private module `name` (a value of `_LAZY`), imported by a static statement:
    the library never imports by computed name (tests/test_hostile.py)."""
    if name == "_api":
        from . import _api

        return _api
    if name == "_async":
        from . import _async

        return _async
    if name == "_box":
        from . import _box

        return _box
    if name == "_buffer_pool":
        from . import _buffer_pool

        return _buffer_pool
    if name == "_drill":
        from . import _drill

        return _drill
    if name == "_export":
        from . import _export

        return _export
    if name == "_format":
        from . import _format

        return _format
    if name == "_manager":
        from . import _manager

        return _manager
    if name == "_metadata":
        from . import _metadata

        return _metadata
    if name == "_orbax_import":
        from . import _orbax_import

        return _orbax_import
    if name == "_policies":
        from . import _policies

        return _policies
    if name == "_process_state":
        from . import _process_state

        return _process_state
    if name == "_read":
        from . import _read

        return _read
    if name == "_restore":
        from . import _restore

        return _restore
    if name == "_leaf_plan":
        from . import _leaf_plan

        return _leaf_plan
    if name == "_save_plan":
        from . import _save_plan

        return _save_plan
    if name == "_save_preview":
        from . import _save_preview

        return _save_preview
    if name == "_timeline":
        from . import _timeline

        return _timeline
    if name == "_verify":
        from . import _verify

        return _verify
    raise AssertionError(f"no lazy module {name}")


def __getattr__(name: str) -> object:
    """Loads a public name's module on first access and caches the name here."""
    if name == "__version__":
        from ._metadata import library_version

        value: object = library_version()  # the installed distribution's, as each manifest records it
    elif name in _LAZY:
        value = getattr(_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"__version__"})


__all__ = [
    "save", "save_async", "restore", "metadata", "per_process_state", "plan_restore", "plan_save", "RestoreStats", "verify",
    "VerifyReport", "import_orbax", "export", "ExportReport", "timeline", "release_host_buffers",
    "AsyncSave", "CheckpointManager", "ManagerStatus", "DrillReport",
    "KeepPolicy", "KeepLatest", "KeepEvery", "KeepBest", "KeepSteps", "KeepAny",
    "CheckpointMetadata", "ArrayMetadata", "ValueMetadata", "SavedSharding",
    "RestorePlan", "LeafRestorePlan", "BoxRead", "ChunkRead", "PeerPiece", "Box",
    "SavePlan", "ProcessWrites", "LeafAssignment",
    "CheckpointError", "CheckpointNotFoundError", "CheckpointExistsError", "StructureMismatchError",
    "ShapeMismatchError", "DTypeMismatchError", "InvalidTargetError", "MeshError", "UnsupportedValueError",
    "CorruptCheckpointError", "SaveError", "CommitTimeoutError", "SaveAgreementError", "ProcessCountMismatchError",
    "RestoreAgreementError",
]
