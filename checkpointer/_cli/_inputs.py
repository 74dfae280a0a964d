"""What the commands read from their arguments: a directory of steps, a checkpoint's
metadata (with a hint when the path is a directory of steps), the `--mesh`, `--axes`
and `--spec` options and the mesh they make."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _commit, _tools
from .._errors import CheckpointNotFoundError, MeshError, UsageError
from .._storage import Storage, storage_for

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec


def _open_dir(location: str) -> tuple[Storage, str]:
    storage, directory = storage_for(location)
    if storage.has_folders and not storage.is_folder(directory):
        raise CheckpointNotFoundError(f"{directory} is not a directory")
    return storage, directory


def _lock_holder(storage: Storage, directory: str) -> str | None:
    """Who holds the directory lock of a running CheckpointManager, or None (always
    None on storage without locks)."""
    return storage.lock_holder(f"{directory}/{_commit.LOCK_NAME}")


def _metadata(location: str):
    """`ckpt.metadata`, with a hint when `location` is a directory of steps."""
    from .._format import read_metadata

    storage, path = storage_for(location)
    try:
        return read_metadata(storage, path)
    except CheckpointNotFoundError as e:
        steps = _commit.committed_steps(storage, path)
        if steps:
            raise CheckpointNotFoundError(
                f"{path} is a directory of steps (committed: {', '.join(map(str, steps[-5:]))}), not a checkpoint; "
                f"give one step, e.g. {path}/{steps[-1]}"
            ) from e
        raise


def _parse_mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"--mesh {text!r}: give axis sizes >= 1 joined by 'x', e.g. 4x2 or 8")
    return shape


def _parse_axes(text: str | None, rank: int) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(a.strip() for a in text.split(","))
    if len(names) != rank or not all(names) or len(set(names)) != len(names):
        raise UsageError(f"--axes {text!r}: give {rank} distinct comma-separated names, one per mesh axis")
    return names


def _parse_spec(text: str, mesh) -> tuple[str, PartitionSpec]:
    from jax.sharding import PartitionSpec as P

    glob, eq, spec = text.partition("=")
    if not eq or not glob:
        raise UsageError(f"--spec {text!r}: expected LEAF_GLOB=SPEC, e.g. \"['params']*=data,model\"")
    entries: list = []
    used: list[str] = []
    for raw in spec.split(",") if spec.strip() else []:
        raw = raw.strip()
        if raw.lower() in ("", "none"):
            entries.append(None)
            continue
        names = tuple(n.strip() for n in raw.split("+"))
        for n in names:
            if n not in mesh.axis_names:
                raise UsageError(f"--spec {text!r}: the mesh has no axis {n!r} (axes: {', '.join(mesh.axis_names)})")
            if n in used:
                raise UsageError(f"--spec {text!r}: mesh axis {n!r} is used twice")
            used.append(n)
        entries.append(names[0] if len(names) == 1 else names)
    return glob, P(*entries)


def _build_mesh(args, meta, *, abstract: bool = False):
    """The `--mesh`/`--axes` mesh: of this machine's devices, or abstract (no devices needed)."""
    shape = _parse_mesh(args.mesh)
    axes = _parse_axes(args.axes, len(shape)) or _tools.default_axis_names(meta, len(shape))
    try:
        return _tools.abstract_mesh(shape, axes) if abstract else _tools.scratch_mesh(shape, axes)
    except MeshError as e:
        hint = "" if abstract else "; or plan without the devices with --processes P"
        raise UsageError(f"{e}{hint}") from e
