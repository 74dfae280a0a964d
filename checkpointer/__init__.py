"""checkpointer: sharded, asynchronous, atomic checkpoints of JAX training state.

    import checkpointer as ckpt
    ckpt.save("/ckpt/100", state)
    state = ckpt.restore("/ckpt/100", target)   # target: ShapeDtypeStructs with shardings

See DESIGN.md for the on-disk format and the commit protocol.

The public names are loaded on first use (PEP 562 `__getattr__`): `import checkpointer`
imports only the errors, so a resumed job that only restores never loads the save,
manager, CLI or tools packages (see docs/DESIGN-decisions.md, "Fresh-process restore").
`from checkpointer import X` and `checkpointer.X` work as for eager names.

The table of lazy names is written once: the `if TYPE_CHECKING:` imports below, which
type checkers and IDEs read as they are; at run time `_public_table` reads the same
statements from this file's syntax tree, and `_package` imports the package named with a
static statement (the library never imports by computed name: tests/test_hostile.py).
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
    UnknownMetricError,
    UnsupportedValueError,
)

if TYPE_CHECKING:  # THE TABLE: each lazy public name and the package that exports it
    from ._encoding import BoxRead, ChunkRead, LeafRestorePlan, PeerPiece, RestorePlan, RestoreStats
    from ._format import ArrayMetadata, Box, CheckpointMetadata, SavedSharding, ValueMetadata, metadata
    from ._manage import (
        CheckpointManager,
        DirectoryStatus,
        KeepAny,
        KeepBest,
        KeepEvery,
        KeepEverySeconds,
        KeepLatest,
        KeepNewerThan,
        KeepPolicy,
        KeepSteps,
        ManagerStatus,
        SaveFailure,
        read_status,
    )
    from ._memory import release_host_buffers
    from ._restore import per_process_state, plan_restore, restore, restore_safetensors
    from ._save import AsyncSave, LeafAssignment, ProcessWrites, SavePlan, plan_save, save, save_async
    from ._storage import Storage, register_storage
    from ._tools import (
        CheckpointTree,
        DrillReport,
        ExportReport,
        ImportReport,
        LeafSummary,
        VerifyReport,
        WrittenChunk,
        export,
        import_orbax,
        inspect_tree,
        plot_plan,
        plot_run,
        plot_shards,
        shard_chunks,
        timeline,
        verify,
    )

    __version__: str


def _public_table() -> tuple[list[str], dict[str, str]]:
    """(the errors imported above, {lazy public name: package}), read from this file's
    own import statements: the errors' `from ._errors import` and the `if TYPE_CHECKING:` block."""
    import ast

    # Through the loader, not the file system: a zipped install (zipimport) has no file.
    source = __spec__.loader.get_source(__name__) if __spec__ is not None and __spec__.loader is not None else None  # type: ignore[attr-defined]
    if source is None:
        raise ImportError(f"checkpointer: the source of {__name__} cannot be read (a sourceless install); install from the wheel or sdist")
    tree = ast.parse(source)
    errors = next(n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "_errors")
    block = next(n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
    lazy = {a.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) and node.module for a in node.names}
    return [a.name for a in errors.names], lazy


def _package(name: str) -> ModuleType:
    """The package `name` (a value of `_LAZY`), imported by a static statement."""
    if name == "_encoding":
        from . import _encoding

        return _encoding
    if name == "_format":
        from . import _format

        return _format
    if name == "_manage":
        from . import _manage

        return _manage
    if name == "_memory":
        from . import _memory

        return _memory
    if name == "_restore":
        from . import _restore

        return _restore
    if name == "_save":
        from . import _save

        return _save
    if name == "_storage":
        from . import _storage

        return _storage
    if name == "_tools":
        from . import _tools

        return _tools
    raise AssertionError(f"no lazy package {name}")


_ERRORS, _LAZY = _public_table()
__all__ = [*_ERRORS, *_LAZY]


def __getattr__(name: str) -> object:
    """Loads a public name's package on first access and caches the name here."""
    if name == "__version__":
        from ._format import library_version

        value: object = library_version()  # the installed distribution's, as each manifest records it
    elif name in _LAZY:
        value = getattr(_package(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"__version__"})

