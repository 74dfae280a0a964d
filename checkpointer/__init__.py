"""checkpointer: sharded, asynchronous, atomic checkpoints of JAX training state.

    import checkpointer as ckpt
    ckpt.save("/ckpt/100", state)
    state = ckpt.restore("/ckpt/100", target)   # target: ShapeDtypeStructs with shardings

See DESIGN.md for the on-disk format and the commit protocol.
"""

from ._api import save, save_async
from ._async import AsyncSave
from ._box import Box
from ._drill import DrillReport
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
from ._export import ExportReport, export
from ._format import ArrayMetadata, SavedSharding, ValueMetadata
from ._manager import CheckpointManager, ManagerStatus
from ._metadata import CheckpointMetadata, library_version as _library_version, metadata
from ._orbax_import import import_orbax
from ._policies import KeepAny, KeepBest, KeepEvery, KeepLatest, KeepPolicy, KeepSteps
from ._process_state import per_process_state
from ._read import RestoreStats
from ._restore import plan_restore, restore
from ._restore_plan import BoxRead, ChunkRead, LeafRestorePlan, PeerPiece, RestorePlan
from ._save_plan import LeafAssignment, ProcessWrites, SavePlan
from ._save_preview import plan_save
from ._timeline import timeline
from ._verify import VerifyReport, verify

__version__ = _library_version()  # the installed distribution's, as each manifest records it

__all__ = [
    "save", "save_async", "restore", "metadata", "per_process_state", "plan_restore", "plan_save", "RestoreStats", "verify",
    "VerifyReport", "import_orbax", "export", "ExportReport", "timeline",
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
