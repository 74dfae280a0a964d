"""The restore drill: could the job resume from its newest step now, and how fast?

Restores the newest committed step onto a scratch mesh of the devices present with the
default targets of `_default_targets` (the same ones `checkpointer plan` uses), times it, then
reads every stored byte and checks every checksum.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding

from .. import _commit
from .._errors import CheckpointError, CheckpointNotFoundError
from .._format import read_metadata
from .._restore import plan_restore, restore
from .._storage import storage_for
from ._default_targets import default_axis_names, default_mesh_shape, scratch_mesh, target_specs, target_tree
from ._verify import verify


@dataclasses.dataclass(frozen=True)
class DrillReport:
    """The result of a restore drill.

    Attributes:
      path: the checkpoint path that was drilled (the newest committed step).
      step: its step.
      mesh_shape: the scratch mesh's axis sizes.
      mesh_axis_names: the scratch mesh's axis names.
      restore_s: seconds from calling `restore` to every array being ready on its
        devices (manifest read and planning included); None when the restore failed.
      verify_s: seconds `verify` took to read every chunk and check every checksum.
      bytes_read: bytes the restore plan fetches from storage for this process, index
        reads included (`RestorePlan.bytes_read`).
      bytes_needed: bytes of the unique target boxes of this process.
      read_amplification: `bytes_read / bytes_needed`.
      ok: True when the restore succeeded and `verify` found no problem.
      problems: one line per problem (a failed restore first, then `verify`'s findings).
    """

    path: str
    step: int
    mesh_shape: tuple[int, ...]
    mesh_axis_names: tuple[str, ...]
    restore_s: float | None
    verify_s: float
    bytes_read: int
    bytes_needed: int
    read_amplification: float
    ok: bool
    problems: tuple[str, ...]

    def to_json(self) -> dict:
        """The report as a JSON-serialisable dict (field names as keys, units in the names)."""
        out = dataclasses.asdict(self)
        out["mesh_shape"], out["mesh_axis_names"], out["problems"] = list(self.mesh_shape), list(self.mesh_axis_names), list(self.problems)
        return out

    def __str__(self) -> str:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_axis_names, self.mesh_shape))
        restored = f"{self.restore_s:.3f} s" if self.restore_s is not None else "FAILED"
        lines = [
            f"drill of {self.path} (step {self.step}) on mesh {mesh}: {'OK' if self.ok else 'FAILED'}",
            f"  restore: {restored}, {self.bytes_read} bytes read for {self.bytes_needed} needed "
            f"(amplification {self.read_amplification:.3f})",
            f"  verify: {self.verify_s:.3f} s",
        ]
        return "\n".join(lines + [f"  - {p}" for p in self.problems])


# --- the drill ------------------------------------------------------------------------------


def drill(directory: str | os.PathLike, mesh_shape: Sequence[int] | None = None, *, axis_names: Sequence[str] | None = None) -> DrillReport:
    """Restores the newest committed step onto a scratch mesh, verifies it, and times it.

    The targets are the planner's defaults (`default_spec`: each saved PartitionSpec
    entry is kept where its mesh axes exist in the scratch mesh and divide the
    dimension, else that dimension is replicated). The restored arrays are dropped
    before `verify` reads every chunk and checks every checksum.

    Args:
      directory: a manager's directory (local path or kvstore URL).
      mesh_shape: the scratch mesh's axis sizes, e.g. `(2, 2)`. Default: the saved
        mesh's shape when it has exactly as many devices as are present, else one axis
        of all devices present.
      axis_names: the scratch mesh's axis names. Default: those of the most common
        saved mesh with as many axes, else `axis0, axis1, ...`.
    Returns:
      A `DrillReport` (`restore_s`, `verify_s` in seconds; `bytes_read`, `bytes_needed`
      in bytes; `read_amplification`; `ok`; `problems`). A restore that fails on
      damaged data is a finding (`ok=False`, `restore_s=None`), not an exception.
    Raises:
      CheckpointNotFoundError: `directory` holds no committed step.
      CorruptCheckpointError: the newest step's manifest is unreadable.
      MeshError (a CheckpointError and ValueError): the mesh needs more devices than are present, or the
        axis names do not fit its shape.

    Multi-process: uses the caller's local devices only (`jax.local_devices()`) and runs
    no collective, so any one process may call it alone; it reads what its scratch mesh
    needs, then every chunk for `verify`.
    """
    storage, directory = storage_for(directory)
    folders = _commit.committed_folders(storage, directory)
    if not folders:
        raise CheckpointNotFoundError(
            f"no committed step in {directory}, nothing to drill; `checkpointer ls {directory}` lists its step folders"
        )
    step = max(folders)
    path = f"{directory}/{folders[step]}"
    meta = read_metadata(storage, path)
    devices = jax.local_devices()
    shape = tuple(mesh_shape) if mesh_shape is not None else default_mesh_shape(meta, len(devices))
    names = tuple(axis_names) if axis_names is not None else default_axis_names(meta, len(shape))
    mesh = scratch_mesh(shape, names, devices)
    specs = target_specs(meta, mesh)
    # Leaves saved as host numpy arrays come back as numpy (a float64 one could not be
    # put on a device with jax_enable_x64 off).
    on_devices = {p: NamedSharding(mesh, s) for p, s in specs.items() if meta.arrays[p].kind == "jax"}
    target = target_tree(meta, on_devices)
    plan = plan_restore(path, target)

    problems: list[str] = []
    restore_s = None
    t0 = time.perf_counter()
    try:
        restored = restore(path, target)
        jax.block_until_ready([x for x in jax.tree_util.tree_leaves(restored) if isinstance(x, jax.Array)])
        restore_s = time.perf_counter() - t0
        del restored
    except (CheckpointError, OSError) as e:
        problems.append("restore failed: " + " ".join(str(e).split()))
    report = verify(path)
    problems.extend(report.problems)
    return DrillReport(
        path=path, step=step, mesh_shape=tuple(mesh.devices.shape), mesh_axis_names=tuple(mesh.axis_names),
        restore_s=restore_s, verify_s=report.elapsed_s, bytes_read=plan.bytes_read, bytes_needed=plan.bytes_needed,
        read_amplification=plan.read_amplification, ok=not problems, problems=tuple(problems),
    )
