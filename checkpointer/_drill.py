"""The restore drill, and the default restore targets that `checkpointer plan` shares.

A drill answers "if the job died now, could it resume, and how long would it take?":
restore the newest committed step onto a scratch mesh of the devices present, time it,
then read every stored byte and check every checksum.

Default target rule (`default_spec`): each entry of a leaf's saved PartitionSpec is kept
when every mesh axis it names exists in the new mesh and the product of those axes'
sizes divides that dimension; otherwise that dimension is replicated (None). A leaf
saved without a named sharding (a single device, a host numpy array) is replicated.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import math
import os
import time
import urllib.parse
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey

from . import _directory
from ._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ._format import ArrayMetadata
from ._metadata import CheckpointMetadata, read_metadata
from ._restore import plan_restore, resolve_target, restore
from ._storage import storage_for
from ._tree import escape_key, flatten
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


# --- meshes ---------------------------------------------------------------------------------


class MeshError(ValueError):
    """A scratch mesh cannot be built: too few devices, or names that do not fit the shape."""


def scratch_mesh(mesh_shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh of the first `prod(mesh_shape)` of `devices`, in order.

    Args:
      mesh_shape: axis sizes, each >= 1.
      axis_names: one distinct name per axis.
      devices: the devices to use (default: `jax.local_devices()`).
    Returns:
      A `jax.sharding.Mesh` (Auto axes, so any PartitionSpec works).
    Raises:
      MeshError (a ValueError): a size < 1, names that do not match the shape, or fewer
        devices than the mesh needs (the message says how many are needed and present,
        and how to simulate CPU devices with XLA_FLAGS).

    Multi-process: uses only the caller's devices; no collective.
    """
    shape = tuple(int(s) for s in mesh_shape)
    names = tuple(str(a) for a in axis_names)
    if not shape or any(s < 1 for s in shape):
        raise MeshError(f"mesh shape {shape} must be one or more sizes >= 1")
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise MeshError(f"mesh shape {_shape_str(shape)} needs {len(shape)} distinct axis names, got {list(names)}")
    devices = list(jax.local_devices() if devices is None else devices)
    need = math.prod(shape)
    if need > len(devices):
        kind = devices[0].platform if devices else "cpu"
        raise MeshError(
            f"mesh {_shape_str(shape)} needs {need} devices but {len(devices)} {kind} device"
            f"{'s are' if len(devices) != 1 else ' is'} present; to simulate {need} CPU devices, run with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} (and JAX_PLATFORMS=cpu)"
        )
    return Mesh(np.array(devices[:need], dtype=object).reshape(shape), names)


def _shape_str(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape)


def _saved_meshes(meta: CheckpointMetadata) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """The saved meshes `(axis names, shape)`, most common first (ties: first seen)."""
    counts = collections.Counter(
        (m.saved_sharding.mesh_axis_names, m.saved_sharding.mesh_shape)
        for m in meta.arrays.values()
        if m.saved_sharding is not None and m.saved_sharding.kind == "named"
    )
    return [mesh for mesh, _ in counts.most_common()]


def default_axis_names(meta: CheckpointMetadata, rank: int) -> tuple[str, ...]:
    """Axis names for a new mesh of `rank` axes.

    Returns:
      The axis names of the most common saved mesh with `rank` axes, else
      `("axis0", "axis1", ...)`.

    Multi-process: pure; any process may call it.
    """
    for names, _ in _saved_meshes(meta):
        if len(names) == rank:
            return names
    return tuple(f"axis{i}" for i in range(rank))


def default_mesh_shape(meta: CheckpointMetadata, device_count: int) -> tuple[int, ...]:
    """The drill's mesh shape when none is given.

    Returns:
      The shape of the most common saved mesh when it has exactly `device_count`
      devices (the job resumes on the same layout), else `(device_count,)`.

    Multi-process: pure; any process may call it.
    """
    for _, shape in _saved_meshes(meta):
        if math.prod(shape) == device_count:
            return shape
    return (device_count,)


# --- default targets ------------------------------------------------------------------------


def target_shape(meta: ArrayMetadata) -> tuple[int, ...]:
    """The shape a restore of `meta` produces (a PRNG key array's shape without the key data dims).

    Multi-process: pure; any process may call it.
    """
    return resolve_target(meta, None, "").shape


def default_spec(meta: ArrayMetadata, mesh: Mesh) -> P:
    """The default target PartitionSpec of one leaf on `mesh` (see the module docstring).

    Args:
      meta: the stored leaf.
      mesh: the target mesh.
    Returns:
      The saved spec with every entry that does not fit `mesh` (an axis name it lacks,
      or axis sizes that do not divide the dimension) replaced by None; `P()` for
      leaves saved without a named sharding.

    Multi-process: pure; every process gets the same answer.
    """
    saved = meta.saved_sharding
    if saved is None or saved.kind != "named":
        return P()
    shape = target_shape(meta)
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    entries = []
    for dim, entry in enumerate(saved.spec):
        names = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
        fits = (
            entry is not None
            and dim < len(shape)
            and all(n in sizes for n in names)
            and shape[dim] % math.prod(sizes[n] for n in names) == 0
        )
        entries.append(entry if fits else None)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def target_specs(meta: CheckpointMetadata, mesh: Mesh, overrides: Sequence[tuple[str, P]] = ()) -> dict[str, P]:
    """The target PartitionSpec of every array leaf.

    Args:
      meta: the checkpoint's metadata.
      mesh: the target mesh.
      overrides: `(glob, spec)` pairs; a leaf whose path matches `glob`
        (`fnmatch.fnmatchcase`) gets `spec`; the last matching pair wins.
    Returns:
      Leaf path → PartitionSpec, for the array leaves, in tree order.
    Raises:
      ValueError: a glob matches no array leaf, or an overriding spec does not fit its
        leaf (more entries than dimensions, an axis `mesh` lacks or uses twice, axis
        sizes that do not divide the dimension); the message names the leaf.

    Multi-process: pure; every process gets the same answer.
    """
    specs = {p: default_spec(m, mesh) for p, m in meta.arrays.items()}
    chosen: dict[str, str] = {}
    for glob, spec in overrides:
        hits = [p for p in specs if fnmatch.fnmatchcase(p, glob)]
        if not hits:
            shown = ", ".join(repr(p) for p in list(specs)[:8]) + (", ..." if len(specs) > 8 else "")
            raise ValueError(f"the leaf glob {glob!r} matches no array leaf (leaves: {shown})")
        for p in hits:
            specs[p], chosen[p] = spec, glob
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    for p, glob in chosen.items():
        shape, spec = target_shape(meta.arrays[p]), specs[p]
        where = f"{spec} (from {glob!r}) for leaf {p!r} of shape {shape}"
        if len(spec) > len(shape):
            raise ValueError(f"{where}: {len(spec)} entries for {len(shape)} dimension(s); narrow the glob or add a later spec for that leaf")
        used: list[str] = []
        for dim, entry in enumerate(spec):
            names = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
            for n in names:
                if n not in sizes or n in used:
                    raise ValueError(f"{where}: mesh axis {n!r} is {'used twice' if n in used else 'not in the mesh'}")
                used.append(n)
            if shape[dim] % math.prod(sizes[n] for n in names):
                raise ValueError(
                    f"{where}: dimension {dim} of size {shape[dim]} is not divisible by {math.prod(sizes[n] for n in names)} "
                    f"({'*'.join(names)}); JAX needs even shards"
                )
    return specs


class _PathNode:
    """A pytree node whose children flatten to given leaf-path components.

    Lets a restore target be built from the manifest's leaf paths alone, whatever node
    types (and key types) the saved tree had.
    """

    def __init__(self, keys: tuple, children: list):
        self.keys, self.children = keys, children


jax.tree_util.register_pytree_with_keys(
    _PathNode,
    lambda n: (list(zip(n.keys, n.children)), n.keys),
    lambda keys, children: _PathNode(keys, list(children)),
    lambda n: (n.children, n.keys),
)


def _key_entry(component: str) -> DictKey:
    """A key entry that `_tree.escape_key` turns back into `component`."""
    if component.startswith("@int:"):
        entry = DictKey(int(component[len("@int:") :]))
    elif component.startswith("@"):
        type_name, _, quoted = component[1:].partition(":")
        text = urllib.parse.unquote(quoted)
        entry = DictKey(type(type_name, (), {"__repr__": lambda self: text})())
    elif component == "%":
        entry = DictKey("")
    else:
        entry = DictKey(urllib.parse.unquote(component))
    if escape_key(entry) != component:
        raise CorruptCheckpointError(f"leaf path component {component!r} is not in canonical escaped form")
    return entry


def target_tree(meta: CheckpointMetadata, leaves: Mapping[str, object]) -> object:
    """A restore target with exactly the checkpoint's leaf paths.

    Args:
      meta: the checkpoint's metadata.
      leaves: leaf path → target leaf (a Sharding, ShapeDtypeStruct, ...); leaf paths
        absent from it (non-array leaves) get None.
    Returns:
      A pytree to pass as `target` to `restore` / `plan_restore`; its nodes are
      internal, so the restored tree is for inspection, not for training code.
    Raises:
      CorruptCheckpointError: a leaf path is not in the canonical escaped form.

    Multi-process: pure; any process may call it.
    """
    if list(meta.leaves) == [""]:
        return leaves.get("")
    root: dict = {}
    for path in meta.leaves:
        node = root
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaves.get(path)

    def build(d: dict) -> _PathNode:
        return _PathNode(tuple(_key_entry(k) for k in d), [build(v) if isinstance(v, dict) else v for v in d.values()])

    tree = build(root)
    flat = [p for p, _ in flatten(tree, is_leaf=lambda x: x is None or not isinstance(x, _PathNode))]
    if sorted(flat) != sorted(meta.leaves):
        raise CorruptCheckpointError(f"the leaf paths of {meta.path} cannot be rebuilt into a target tree")
    return tree


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
      MeshError (a ValueError): the mesh needs more devices than are present, or the
        axis names do not fit its shape.

    Multi-process: uses the caller's local devices only (`jax.local_devices()`) and runs
    no collective, so any one process may call it alone; it reads what its scratch mesh
    needs, then every chunk for `verify`.
    """
    storage, directory = storage_for(directory)
    steps = _directory.committed_steps(storage, directory)
    if not steps:
        raise CheckpointNotFoundError(
            f"no committed step in {directory}, nothing to drill; `checkpointer ls {directory}` lists its step folders"
        )
    step = steps[-1]
    path = f"{directory}/{step}"
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
