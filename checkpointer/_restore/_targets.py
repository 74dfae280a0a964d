"""Restore targets (pure): what each leaf becomes, and which box each device holds.

Owns everything between a user's target tree and the restore planner: the target tree
matched to the stored leaves and resolved per leaf (`resolve_tree`; the matching rule is
`_matching.match`), one target leaf resolved into a `LeafTarget` (shape, dtype cast,
sharding; `resolve_target`), and assigning the target's per-device boxes to
processes (`device_boxes`, from a device→process mapping, so `plan_restore`, the CLI
and the drill plan for any process count with the same code). The default targets of
`checkpointer plan` and the drill live in `_default_targets`. No I/O; devices are only
read from the target's shardings.

Device→process rule (`device_boxes`): by default each device belongs to its own
`process_index`; with `processes=P` the target mesh's devices are spread over P
processes in mesh order, each holding a consecutive block of `n_devices // P`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, TypeGuard

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .. import _format
from .._errors import (
    CorruptCheckpointError,
    DTypeMismatchError,
    InvalidTargetError,
    MeshError,
    ShapeMismatchError,
    where,
)
from .._format import ArrayMetadata, Box, CheckpointMetadata, ValueMetadata, named_shard_boxes, spec_axes
from ._matching import match

# --- one leaf -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafTarget:
    """A resolved target for one array leaf.

    Attributes:
      sharding: where the result goes, or None for a host numpy array.
      shape: the shape of the result (the stored shape; for PRNG keys without the
        key data's trailing dimensions).
      dtype: the result dtype (a cast from the stored dtype when it differs).
    """

    sharding: jax.sharding.Sharding | None
    shape: tuple[int, ...]
    dtype: np.dtype | None


def _check_cast(meta: ArrayMetadata, dtype, path: str) -> np.dtype | None:
    """The dtype to cast to, None when none is needed; raises DTypeMismatchError."""
    stored_key = meta.key_impl is not None
    if dtype is None:
        return None
    target_key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if stored_key or target_key:
        if stored_key != target_key:
            raise DTypeMismatchError(
                f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: stored {'a PRNG key array' if stored_key else meta.dtype} "
                f"but the target asks for {dtype}; a key and its raw data are not interchangeable. "
                "Use jax.random.key_data / wrap_key_data on your side."
            )
        stored = jax.eval_shape(lambda: jax.random.key(0, impl=meta.key_impl)).dtype
        if stored != dtype:
            raise DTypeMismatchError(
                f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: stored a {meta.key_impl} PRNG key array ({stored}) but the "
                f"target asks for {dtype}; keys of one impl cannot be made into another. Fix the target's impl."
            )
        return None
    dtype = np.dtype(dtype)
    if dtype == meta.dtype:
        return None
    if _format.dtype_kind(meta.dtype) != _format.dtype_kind(dtype) or _format.dtype_kind(dtype) is None:
        raise DTypeMismatchError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: stored dtype {meta.dtype}, target dtype {dtype}. A target "
            "dtype is applied as a cast only within one kind (float to float, int to int, complex to complex); "
            f"restore as {meta.dtype} and convert it yourself, or fix the target."
        )
    return dtype


def _context_mesh() -> Mesh | None:
    """The concrete mesh set by `jax.set_mesh` / `jax.sharding.use_mesh`, if any."""
    get = getattr(jax.sharding, "get_mesh", None)
    mesh = get() if get is not None else None
    return None if mesh is None or mesh.empty else mesh


def concrete_sharding(sharding: jax.sharding.Sharding, meta: ArrayMetadata, path: str) -> jax.sharding.Sharding:
    """`sharding`, with an `AbstractMesh` (what `jax.eval_shape` / `nnx.eval_shape` under
    `jax.set_mesh` give) replaced by a concrete mesh of the same axis names and sizes.

    Resolution: the concrete mesh in context (`jax.set_mesh`, `jax.sharding.use_mesh`)
    when its axes match; else `jax.make_mesh` over `jax.devices()` (global, in
    `jax.make_mesh` order) when their count is the mesh's size and their platform is
    the abstract mesh's (when it names one).

    Raises:
      MeshError: no concrete mesh stands for the abstract one; the message names the
        leaf, both meshes and how to make it concrete.

    Multi-process: pure; every process resolves to the same global mesh.
    """
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, jax.sharding.AbstractMesh):
        return sharding
    am = sharding.mesh
    wanted = tuple(am.shape.items())
    ctx = _context_mesh()
    if ctx is not None and tuple(ctx.shape.items()) == wanted:
        return NamedSharding(ctx, sharding.spec, memory_kind=sharding.memory_kind)
    devices = jax.devices()
    platform = getattr(getattr(am, "abstract_device", None), "platform", None)
    if len(devices) == math.prod(am.axis_sizes) and (platform is None or platform == devices[0].platform):
        mesh = jax.make_mesh(am.axis_sizes, am.axis_names, axis_types=am.axis_types, devices=devices)
        return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    shown = " x ".join(f"{n}={s}" for n, s in wanted)
    found = f"the mesh in context is {' x '.join(f'{n}={s}' for n, s in ctx.shape.items())}" if ctx is not None else "no mesh is in context"
    raise MeshError(
        f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: the target sharding is over an abstract mesh ({shown}, "
        f"{math.prod(am.axis_sizes)} devices) with no concrete devices: {found} and jax.devices() has "
        f"{len(devices)} {devices[0].platform if devices else ''} device(s). Restore under `with jax.set_mesh(mesh):` "
        "of a concrete mesh with these axis names and sizes, or build the target with NamedSharding(mesh, spec) "
        "on a concrete mesh (plan_restore(..., processes=P) plans for an abstract mesh without devices)."
    )


def resolve_target(meta: ArrayMetadata, target: object, path: str, *, concrete: bool = True) -> LeafTarget:
    """Turns one target leaf (see `restore`) into a `LeafTarget`, checking shape and dtype.

    Args:
      meta: the stored leaf.
      target: the target leaf.
      path: the checkpoint path, for messages.
      concrete: resolve a sharding over an `AbstractMesh` to a concrete mesh
        (`concrete_sharding`); False keeps it abstract (for planning without devices).
    Raises:
      ShapeMismatchError, DTypeMismatchError, InvalidTargetError: the target leaf does
        not fit the stored leaf; MeshError: an abstract mesh that cannot be made
        concrete; CorruptCheckpointError: the stored PRNG key entry is inconsistent.
    """
    stored_shape = meta.shape
    if meta.key_impl is not None:
        try:
            data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=meta.key_impl)))
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptCheckpointError(
                f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: unknown PRNG key impl {meta.key_impl!r:.100} ({e})"
            ) from e
        key_dims = len(data.shape)
        if meta.shape[len(meta.shape) - key_dims :] != tuple(data.shape) or meta.dtype != data.dtype:
            raise CorruptCheckpointError(
                f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: a {meta.key_impl} key array needs key data of trailing "
                f"shape {tuple(data.shape)} and dtype {data.dtype}; the manifest says {meta.shape} {meta.dtype}"
            )
        stored_shape = meta.shape[: len(meta.shape) - key_dims]
    if target is None or isinstance(target, (bool, int, float, complex, np.generic)):
        # A scalar in the target (e.g. `step=0` of a fresh TrainState where the saved
        # state had an array): the stored array comes back on the host.
        return LeafTarget(None, stored_shape, None)
    if not isinstance(target, (jax.sharding.Sharding, np.ndarray, jax.ShapeDtypeStruct, jax.Array)):
        raise InvalidTargetError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: target leaf of type {type(target).__name__} is not one of "
            "jax.ShapeDtypeStruct (with a sharding), jax.Array, jax.sharding.Sharding, None or a scalar"
        )
    if isinstance(target, jax.sharding.Sharding):
        return LeafTarget(concrete_sharding(target, meta, path) if concrete else target, stored_shape, None)
    if isinstance(target, np.ndarray):
        shape, dtype, sharding = target.shape, target.dtype, None
    else:
        shape, dtype = tuple(target.shape), target.dtype
        sharding = getattr(target, "sharding", None)
        if sharding is None:
            raise InvalidTargetError(
                f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: target ShapeDtypeStruct has no sharding; give it one "
                "(jax.ShapeDtypeStruct(shape, dtype, sharding=...)) or use None for a host numpy array"
            )
    if tuple(shape) != stored_shape:
        raise ShapeMismatchError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: stored shape {stored_shape}, target shape {tuple(shape)}. "
            "Restore needs the same global shape; fix the target (jax.eval_shape of your init gives it) or "
            "restore with a Sharding / None leaf to take the stored shape."
        )
    cast = _check_cast(meta, dtype, path)
    if sharding is not None and concrete:
        sharding = concrete_sharding(sharding, meta, path)
    return LeafTarget(sharding, stored_shape, cast)


# --- device boxes ---------------------------------------------------------------------------


def _check_fits(lt: LeafTarget, meta: ArrayMetadata, path: str) -> None:
    """Checks a NamedSharding target against the shape, each problem with its own message.

    Raises:
      InvalidTargetError: more PartitionSpec entries than dimensions, an axis the mesh
        lacks, or axis sizes that do not divide a dimension.
    """
    s = lt.sharding
    if not isinstance(s, NamedSharding):
        return
    what = f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: the target sharding {s.spec} on shape {lt.shape}"
    if len(s.spec) > len(lt.shape):
        raise InvalidTargetError(
            f"{what} has {len(s.spec)} PartitionSpec entries for {len(lt.shape)} dimension(s). Give at most one entry "
            "per dimension."
        )
    sizes = dict(s.mesh.shape)
    for dim, n in enumerate(lt.shape):
        axes = spec_axes(s.spec[dim]) if dim < len(s.spec) else ()
        missing = [a for a in axes if a not in sizes]
        if missing:
            raise InvalidTargetError(
                f"{what} names mesh axis {missing[0]!r}, which the mesh ({', '.join(sizes)}) lacks. Use the mesh's axis names."
            )
        if n % math.prod(sizes[a] for a in axes):
            raise InvalidTargetError(
                f"{what} does not fit: dimension {dim} of size {n} is not divisible by "
                f"{math.prod(sizes[a] for a in axes)} ({'*'.join(axes)}). Choose a PartitionSpec whose mesh axes divide "
                "the dimensions, or replicate that dimension (None)."
            )


def _concrete_device_boxes(lt: LeafTarget, meta: ArrayMetadata, path: str) -> list[tuple[int, int, Box]]:
    """`(device id, the device's process_index, box)` of every device of a concrete
    target sharding, in mesh order (sharding device order for other shardings), from JAX."""
    s = lt.sharding
    assert s is not None, "device_boxes handles host targets"
    try:
        return list(_sharding_boxes(s, tuple(lt.shape)))
    except ValueError as e:
        raise InvalidTargetError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: JAX cannot lay out the target sharding {s} on shape {lt.shape}: "
            f"{str(e).rstrip('.')}. Fix the target's sharding."
        ) from e


@functools.lru_cache(maxsize=256)
def _sharding_boxes(s: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[tuple[int, int, Box], ...]:
    """`_concrete_device_boxes` by (sharding, shape): a tree's leaves share a few of
    them (issue 15's 2,000 leaves: two), and JAX's index map costs ~50 µs a leaf."""
    indices = s.devices_indices_map(shape)
    order: list[Any] = list(s.mesh.devices.flat) if isinstance(s, NamedSharding) else list(indices)  # Any: no Device stubs
    return tuple((d.id, d.process_index, Box.from_index(indices[d], shape)) for d in order)


def device_boxes(
    lt: LeafTarget, meta: ArrayMetadata, process_index: int, *, processes: int | None = None, path: str = ""
) -> tuple[tuple[int, Box], ...]:
    """`(device id, box)` of the target's devices that belong to `process_index`.

    Args:
      lt: the resolved target; a host target (sharding None) is one box, device id -1.
      meta: the stored leaf (a PRNG key's trailing key-data dimensions are whole in
        every box).
      process_index: the process to plan for.
      processes: None: each device belongs to its own `process_index` (an abstract
        mesh then raises MeshError); P: the mesh's devices are spread over P processes
        in mesh order, consecutive blocks of `n // P` devices each (devices of an
        abstract mesh get ids 0..n-1).
      path: the checkpoint path, for messages.
    Returns:
      The pairs, in mesh order.
    Raises:
      InvalidTargetError: the sharding does not fit the shape (too many spec entries,
        an unknown axis, a dimension its axes do not divide, or JAX cannot lay it out;
        each with its own message). MeshError: `processes` does not divide the device
        count, or an abstract mesh without `processes`.

    Multi-process: pure; any process may plan for any other.
    """
    if lt.sharding is None:
        return ((-1, Box.whole(meta.shape)),)
    _check_fits(lt, meta, path)
    key_tail = meta.shape[len(lt.shape) :]
    s = lt.sharding
    n_devices = math.prod(s.mesh.axis_sizes) if isinstance(s, NamedSharding) else len(s.device_set)
    if processes is not None:
        if processes < 1 or n_devices % processes:
            raise MeshError(f"{processes} processes do not divide the target's {n_devices} devices; choose a divisor")
        per = n_devices // processes
        mine = range(process_index * per, (process_index + 1) * per) if 0 <= process_index < processes else range(0)
    elif _is_abstract(s):
        raise MeshError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: the target sharding is over an abstract mesh; give the process "
            "count to plan for (processes=P) or a concrete mesh"
        )
    if _is_abstract(s):
        # No devices: ids are the positions in the mesh; only this process's are computed.
        pairs = list(zip(mine, named_shard_boxes(lt.shape, s.mesh.shape, s.spec, mine)))
    else:
        every = _concrete_device_boxes(lt, meta, path)
        if processes is not None:
            pairs = [(every[i][0], every[i][2]) for i in mine]
        else:
            pairs = [(d, b) for d, owner, b in every if owner == process_index]
    return tuple((d, Box(b.origin + (0,) * len(key_tail), b.shape + key_tail)) for d, b in pairs)


def all_device_boxes(
    lt: LeafTarget, meta: ArrayMetadata, *, processes: int | None = None, path: str = ""
) -> tuple[tuple[int, int, Box], ...]:
    """`(device id, process, box)` of every device of a `NamedSharding` target, in
    row-major mesh order (the order `named_shard_boxes` and `mesh.devices.flat` use).

    Args:
      lt: the resolved target; its sharding must be a `NamedSharding`.
      meta: the stored leaf (a PRNG key's trailing key-data dimensions are whole).
      processes: as for `device_boxes` (None: each device's own `process_index`).
      path: the checkpoint path, for messages.
    Raises:
      As `device_boxes`.

    Multi-process: pure; the same on every process.
    """
    s = lt.sharding
    assert isinstance(s, NamedSharding), "all_device_boxes is for NamedSharding targets"
    _check_fits(lt, meta, path)
    key_tail = meta.shape[len(lt.shape) :]
    n_devices = math.prod(s.mesh.axis_sizes)
    if processes is not None:
        if processes < 1 or n_devices % processes:
            raise MeshError(f"{processes} processes do not divide the target's {n_devices} devices; choose a divisor")
        per = n_devices // processes
        triples = [(i, i // per, b) for i, b in enumerate(named_shard_boxes(lt.shape, s.mesh.shape, s.spec))]
        if not _is_abstract(s):
            ids = [d.id for d in s.mesh.devices.flat]
            triples = [(ids[i], p, b) for i, p, b in triples]
    elif _is_abstract(s):
        raise MeshError(
            f"{where(leaf=meta.path, keystr=meta.keystr, path=path)}: the target sharding is over an abstract mesh; give the process "
            "count to plan for (processes=P) or a concrete mesh"
        )
    else:
        triples = _concrete_device_boxes(lt, meta, path)
    return tuple((d, p, Box(b.origin + (0,) * len(key_tail), b.shape + key_tail)) for d, p, b in triples)


def _is_abstract(s: jax.sharding.Sharding) -> TypeGuard[NamedSharding]:
    return isinstance(s, NamedSharding) and isinstance(s.mesh, jax.sharding.AbstractMesh)


# --- the tree -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResolvedLeaf:
    """One leaf of a matched target.

    Attributes:
      path: the leaf path.
      meta: the stored leaf.
      target: its resolved target; None for a non-array (value) leaf.
      device_boxes: `(device id, box)` of this process's devices (empty for a value leaf).
      all_boxes: `(device id, process, box)` of every device of the target, in mesh
        order; only when resolved with `cooperative=True` and the target is a
        `NamedSharding` on devices, else empty.
    """

    path: str
    meta: ArrayMetadata | ValueMetadata
    target: LeafTarget | None
    device_boxes: tuple[tuple[int, Box], ...]
    all_boxes: tuple[tuple[int, int, Box], ...] = ()


@dataclasses.dataclass(frozen=True)
class ResolvedTarget:
    """A target tree matched to a checkpoint for one process.

    Attributes:
      treedef: the target's tree structure, or None to rebuild it from the manifest.
      leaves: one entry per leaf to restore, in target order.
      process_index: the process the device boxes are for.
      kept: leaf path → the target's own leaf, for target leaves that are not read
        (`missing="keep_target"` leaves absent from the checkpoint, and None leaves
        over a saved subtree with `partial=True`); returned as they are.
      order: every target leaf path in target order (read and kept); empty when
        `treedef` is None.
      kept_keystrs: the kept leaves' key strings (as `jax.tree_util.keystr`), for the log.
    """

    treedef: object | None
    leaves: tuple[ResolvedLeaf, ...]
    process_index: int
    kept: Mapping[str, object] = dataclasses.field(default_factory=dict)
    order: tuple[str, ...] = ()
    kept_keystrs: tuple[str, ...] = ()


def resolve_tree(
    meta: CheckpointMetadata,
    target: object,
    *,
    partial: bool,
    process_index: int,
    processes: int | None = None,
    missing: str = "error",
    cooperative: bool = False,
) -> ResolvedTarget:
    """Matches `target` to the checkpoint and resolves every leaf for one process.

    Args:
      meta: the checkpoint's metadata.
      target: as for `restore`.
      partial: as for `restore`.
      process_index: the process whose devices' boxes are listed.
      missing: as for `restore` (see `match`).
      processes: see `device_boxes`. With it, shardings over an `AbstractMesh` stay
        abstract (planning needs no devices); without, they are made concrete
        (`concrete_sharding`).
      cooperative: also list every device's box and process (`ResolvedLeaf.all_boxes`)
        for `NamedSharding` targets, so the planner can split boxes that several
        processes need.
    Returns:
      A `ResolvedTarget`.
    Raises:
      As `match`, `resolve_target` and `device_boxes`.

    Multi-process: pure; any process may resolve for any other.
    """
    matched = match(meta, target, partial=partial, path=meta.path, missing=missing)
    leaves = []
    # Leaves of one (stored layout, target shape, dtype and sharding) resolve alike: once
    # (a tree of many small leaves has a few such). Keyed by the sharding's id: the target
    # keeps its shardings alive meanwhile.
    resolved: dict[tuple, tuple[LeafTarget, tuple[tuple[int, Box], ...]]] = {}
    for p, m, t in matched.pairs:
        if isinstance(m, ValueMetadata):
            leaves.append(ResolvedLeaf(p, m, None, ()))
            continue
        key = None
        if type(t) is jax.ShapeDtypeStruct or isinstance(t, jax.Array):
            key = (type(t), id(t.sharding), tuple(t.shape), t.dtype, m.shape, m.dtype, m.key_impl)
        hit = resolved.get(key) if key is not None else None
        if hit is not None and not cooperative:
            leaves.append(ResolvedLeaf(p, m, hit[0], hit[1]))
            continue
        lt = resolve_target(m, t, meta.path, concrete=processes is None)
        mine = device_boxes(lt, m, process_index, processes=processes, path=meta.path)
        if key is not None:
            resolved[key] = (lt, mine)
        every: tuple[tuple[int, int, Box], ...] = ()
        if cooperative and isinstance(lt.sharding, NamedSharding):
            every = all_device_boxes(lt, m, processes=processes, path=meta.path)
        leaves.append(ResolvedLeaf(p, m, lt, mine, every))
    return ResolvedTarget(
        matched.treedef, tuple(leaves), process_index, kept=matched.kept, order=matched.order,
        kept_keystrs=matched.kept_keystrs,
    )
