"""Default restore targets (pure): the meshes and PartitionSpecs `checkpointer plan` and
the drill restore onto when the user names none.

Owns the scratch and abstract meshes of the CLI and the drill (`scratch_mesh`,
`abstract_mesh`), their default shape and axis names from the saved meshes
(`default_mesh_shape`, `default_axis_names`), each leaf's default PartitionSpec on a
new mesh (`default_spec`, `target_specs` with glob overrides) and a target tree built
from the manifest's leaf paths alone (`target_tree`). Resolution of the targets built
here is `_targets`'s. No I/O.

Default target rule (`default_spec`): each entry of a leaf's saved PartitionSpec is kept
when every mesh axis it names exists in the new mesh and the product of those axes'
sizes divides that dimension; otherwise that dimension is replicated (None). A leaf
saved without a named sharding (a single device, a host numpy array) is replicated.
"""

from __future__ import annotations

import collections
import math
import re
import urllib.parse
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from jax.tree_util import DictKey

from .._errors import CorruptCheckpointError, MeshError
from .._format import ArrayMetadata, CheckpointMetadata, escape_key, flatten, spec_axes
from .._restore import resolve_target

# --- meshes ---------------------------------------------------------------------------------


def scratch_mesh(mesh_shape: Sequence[int], axis_names: Sequence[str], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh of the first `prod(mesh_shape)` of `devices`, in order.

    Args:
      mesh_shape: axis sizes, each >= 1.
      axis_names: one distinct name per axis.
      devices: the devices to use (default: `jax.local_devices()`).
    Returns:
      A `jax.sharding.Mesh` (Auto axes, so any PartitionSpec works).
    Raises:
      MeshError (a CheckpointError and ValueError): a size < 1, names that do not match
        the shape, or fewer devices than the mesh needs (the message says how many are
        needed and present, and how to simulate CPU devices with XLA_FLAGS).

    Multi-process: uses only the caller's devices; no collective.
    """
    shape, names = check_mesh_shape(mesh_shape, axis_names)
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


def abstract_mesh(mesh_shape: Sequence[int], axis_names: Sequence[str]) -> jax.sharding.AbstractMesh:
    """A `jax.sharding.AbstractMesh` of this shape: a mesh to plan for without its devices.

    Raises:
      MeshError: a size < 1 or names that do not match the shape.

    Multi-process: pure.
    """
    shape, names = check_mesh_shape(mesh_shape, axis_names)
    return jax.sharding.AbstractMesh(shape, names)


def check_mesh_shape(mesh_shape: Sequence[int], axis_names: Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """`(shape, names)` checked: sizes >= 1, one distinct name per axis; raises MeshError."""
    shape = tuple(int(s) for s in mesh_shape)
    names = tuple(str(a) for a in axis_names)
    if not shape or any(s < 1 for s in shape):
        raise MeshError(f"mesh shape {shape} must be one or more sizes >= 1")
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise MeshError(f"mesh shape {_shape_str(shape)} needs {len(shape)} distinct axis names, got {list(names)}")
    return shape, names


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


def default_spec(meta: ArrayMetadata, mesh: Mesh | jax.sharding.AbstractMesh) -> P:
    """The default target PartitionSpec of one leaf on `mesh` (see the module docstring).

    Args:
      meta: the stored leaf.
      mesh: the target mesh (concrete or abstract).
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
    sizes = dict(mesh.shape)
    entries = []
    for dim, entry in enumerate(saved.spec):
        names = spec_axes(entry)
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


def target_specs(
    meta: CheckpointMetadata, mesh: Mesh | jax.sharding.AbstractMesh, overrides: Sequence[tuple[str, P]] = ()
) -> dict[str, P]:
    """The target PartitionSpec of every array leaf.

    Args:
      meta: the checkpoint's metadata.
      mesh: the target mesh (concrete or abstract).
      overrides: `(glob, spec)` pairs; a leaf whose key string (as
        `jax.tree_util.keystr` prints it: `['params']['dense']['kernel']`) or escaped
        leaf path (`params/dense/kernel`) matches `glob` (`glob_matches`) gets `spec`;
        the last matching pair wins.
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
        hits = [p for p in specs if glob_matches(glob, meta.keystr(p)) or glob_matches(glob, p)]
        if not hits:
            shown = ", ".join(meta.keystr(p) or "<root>" for p in list(specs)[:8]) + (", ..." if len(specs) > 8 else "")
            raise ValueError(f"the leaf glob {glob!r} matches no array leaf (leaves: {shown})")
        for p in hits:
            specs[p], chosen[p] = spec, glob
    sizes = dict(mesh.shape)
    for p, glob in chosen.items():
        shape, spec = target_shape(meta.arrays[p]), specs[p]
        what = f"{spec} (from {glob!r}) for leaf {meta.keystr(p) or '<root>'} of shape {shape}"
        if len(spec) > len(shape):
            raise ValueError(f"{what}: {len(spec)} entries for {len(shape)} dimension(s); narrow the glob or add a later spec for that leaf")
        used: list[str] = []
        for dim, entry in enumerate(spec):
            names = spec_axes(entry)
            for n in names:
                if n not in sizes or n in used:
                    raise ValueError(f"{what}: mesh axis {n!r} is {'used twice' if n in used else 'not in the mesh'}")
                used.append(n)
            if shape[dim] % math.prod(sizes[n] for n in names):
                raise ValueError(
                    f"{what}: dimension {dim} of size {shape[dim]} is not divisible by {math.prod(sizes[n] for n in names)} "
                    f"({'*'.join(names)}); JAX needs even shards"
                )
    return specs


def glob_matches(glob: str, name: str) -> bool:
    """Whether `name` matches `glob`: `*` matches any run of characters (`/`, `[`, `.`
    included), `?` one character; every other character is literal, so the brackets
    and quotes of a key string (`['params']['w']`) need no escaping.

    Multi-process: pure.
    """
    pattern = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in glob)
    return re.fullmatch(pattern, name, flags=re.DOTALL) is not None


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
