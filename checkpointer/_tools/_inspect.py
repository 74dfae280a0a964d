"""Looking inside a checkpoint from a notebook: its tree (treescope, `inspect_tree`) and
which process wrote each chunk (`shard_chunks`, `plot_shards`); the helpers shared with
the plan picture (`_plan_figure`) and the run picture (`_run_figure`).

Sources, all parsed by `_format` (nothing is reparsed here):

- the manifest (`read_metadata`): per leaf its key path, shape, dtype, chunk grid, saved
  sharding and whether it is packed;
- `processes/<i>.json` (`read_process_record`): the chunks process `i` wrote. An
  unpacked leaf's chunk is a `ChunkRecord` with `leaf` and `box`; a packed leaf's chunk
  is a `PackedBoxRecord` of the record's `packed` index (the pack's own chunk file is a
  `ChunkRecord` without `leaf`, which names no leaf and is not drawn);
- the saved sharding (mesh shape and PartitionSpec, `named_shard_boxes`): which mesh
  positions held each chunk's region when it was saved. The writer is one of them; the
  others held replicas the save skipped.

Which *device* wrote a chunk is not recorded, only its process. `plot_shards` names the
device by its position in the saved mesh (`mesh.devices.flat` order): the first holder
of the chunk among the writing process's devices, assuming each process's devices form
a consecutive block of the mesh, as `jax.make_mesh` and a reshaped `jax.devices()`
build it (the save writes from the replica with the lowest `replica_id`, which is the
first holder in mesh order). When no holder fits that assumption, only the process is
named.

matplotlib and treescope are optional (the `notebook` extra): they are imported inside
the functions that draw.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError, CorruptCheckpointError, StructureMismatchError
from .._format import (
    ArrayMetadata,
    Box,
    CheckpointMetadata,
    ProcessRecord,
    ValueMetadata,
    cell_box,
    chunk_key,
    format_bytes,
    named_shard_boxes,
    process_record_name,
    read_metadata,
    read_process_record,
    value_repr,
)
from .._storage import storage_for

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Leaves `plot_shards` draws when none are selected: the largest ones.
DEFAULT_LEAVES = 4
# Chunks one panel labels; beyond, rectangles are drawn without text (still coloured).
MAX_LABELLED_CHUNKS = 64
_FONT = 11  # points: legible at a notebook's ~ 900 px width
_DPI = 80


def _import_matplotlib() -> Any:
    """The Figure class of the pictures (`_picture_class`); a clear error without matplotlib."""
    try:
        import matplotlib.figure  # noqa: F401
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"checkpointer's pictures need matplotlib ({e}); install the extra: pip install 'checkpointer[notebook]'"
        ) from e
    return _picture_class()


@functools.cache
def _picture_class() -> Any:
    """A `matplotlib.figure.Figure` that a notebook shows as PNG (`_repr_png_`), with no
    pyplot state and no `%matplotlib` magic."""
    from matplotlib.figure import Figure

    class Picture(Figure):
        """A matplotlib Figure that renders itself in a notebook (`_repr_png_`)."""

        def _repr_png_(self) -> bytes:
            import io

            out = io.BytesIO()
            self.savefig(out, format="png", dpi=self.dpi)
            return out.getvalue()

    return Picture


def _metadata_of(checkpoint: str | os.PathLike | CheckpointMetadata) -> CheckpointMetadata:
    if isinstance(checkpoint, CheckpointMetadata):
        return checkpoint
    storage, path = storage_for(checkpoint)
    return read_metadata(storage, path)


def _unit(n: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return scale, name
    return 1, "bytes"


# --- the tree --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafSummary:
    """One leaf of a checkpoint, as `inspect_tree` shows it.

    Attributes:
      keystr: the leaf's key path as `jax.tree_util.keystr` prints it.
      shape: the global shape (None for a value leaf).
      dtype: the stored dtype's name (for a value leaf: the value's type).
      nbytes: bytes of the array's data (0 for a value leaf).
      saved_sharding: how it was sharded when saved (`SavedSharding.describe()`), "host
        numpy array", or for a value leaf its value's repr.
      packed: whether its chunks are byte ranges of the processes' packs of small leaves
        (`pack_small_leaves_bytes`) instead of a zarr array of its own.
      chunk_shape: the stored chunk shape (None for a value leaf).
      leaf_path: the storage path (a key of `CheckpointMetadata.leaves`).
    """

    keystr: str
    shape: tuple[int, ...] | None
    dtype: str
    nbytes: int
    saved_sharding: str
    packed: bool
    chunk_shape: tuple[int, ...] | None
    leaf_path: str


def _summary(meta: CheckpointMetadata, leaf_path: str) -> LeafSummary:
    m = meta.leaves[leaf_path]
    if isinstance(m, ArrayMetadata):
        saved = m.saved_sharding.describe() if m.saved_sharding else "host numpy array"
        dtype = str(m.dtype) + (f" (key<{m.key_impl}>)" if m.key_impl else "")
        return LeafSummary(meta.keystr(leaf_path), m.shape, dtype, m.nbytes, saved, m.packed, m.chunk_shape, leaf_path)
    return LeafSummary(meta.keystr(leaf_path), None, type(m.value).__name__, 0,
                       f"value {value_repr(m.value, 60)}", False, None, leaf_path)


@dataclasses.dataclass(frozen=True)
class CheckpointTree:
    """A checkpoint's tree with a `LeafSummary` per leaf; renders with treescope.

    In a notebook the last expression `ckpt.inspect_tree(path)` shows an interactive
    tree (folds open and closed; `_repr_html_`). `treescope.show(view.tree)` does the same.

    Attributes:
      path: the checkpoint path.
      step: its step, or None.
      tree: the saved tree (containers as a target-less restore rebuilds them) with a
        `LeafSummary` at each leaf.
      leaves: leaf path → `LeafSummary`, in tree order.
      total_bytes: bytes of all array data.
    """

    path: str
    step: int | None
    tree: object
    leaves: Mapping[str, LeafSummary]
    total_bytes: int

    def _repr_html_(self) -> str:
        try:
            import treescope
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"the interactive tree needs treescope ({e}); install the extra: pip install 'checkpointer[notebook]'"
            ) from e
        return treescope.render_to_html(self.tree, roundtrip_mode=False)

    def __str__(self) -> str:
        rows = [f"{self.path} (step {self.step}): {len(self.leaves)} leaves, {format_bytes(self.total_bytes)}"]
        for s in self.leaves.values():
            if s.shape is None:
                rows.append(f"  {s.keystr or '<root>'}: {s.dtype} {s.saved_sharding}")
            else:
                rows.append(f"  {s.keystr or '<root>'}: {s.dtype}{list(s.shape)} {format_bytes(s.nbytes)}, {s.saved_sharding}"
                            + (", packed" if s.packed else ""))
        return "\n".join(rows)


def inspect_tree(checkpoint: str | os.PathLike | CheckpointMetadata) -> CheckpointTree:
    """A checkpoint's tree for a notebook: per leaf its key path, shape, dtype, bytes,
    saved sharding and whether it is packed.

    Args:
      checkpoint: a checkpoint path (local or URL) or its `ckpt.metadata(path)`.
    Returns:
      A `CheckpointTree`: displayed in a notebook it is an interactive treescope tree
      (needs treescope: `pip install 'checkpointer[notebook]'`); `print` it for text;
      `.leaves` holds the `LeafSummary` entries.
    Raises:
      CheckpointNotFoundError: no committed checkpoint at `checkpoint`.
      CorruptCheckpointError: its manifest is malformed.

    Multi-process: reads only the manifest; any process may call it.
    """
    import jax

    meta = _metadata_of(checkpoint)
    summaries = {p: _summary(meta, p) for p in meta.leaves}
    by_id = {id(m): summaries[p] for p, m in meta.leaves.items()}
    tree = jax.tree.map(lambda m: by_id.get(id(m), m), meta.tree,
                        is_leaf=lambda x: isinstance(x, (ArrayMetadata, ValueMetadata)))
    return CheckpointTree(meta.path, meta.step, tree, summaries, meta.total_bytes)


# --- who wrote which chunk -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WrittenChunk:
    """One stored chunk of a leaf and who wrote it (`shard_chunks`).

    Attributes:
      box: the chunk's region of the global array.
      process_index: the process whose `processes/<i>.json` lists it.
      packed: a byte range of that process's pack (True) or a zarr shard file (False).
      key: its file, relative to the checkpoint path.
      data_bytes: bytes of array data in it.
      holders: mesh positions (`mesh.devices.flat` order of the saved mesh) whose shard
        held the region when saved; () when the saved sharding is not a NamedSharding.
      writer: the holder that wrote it (see the module docstring), or None if unknown
        (the device order does not fit, or the checkpoint was imported: `import_orbax`
        writes from the host).
      referenced_in: an incremental save's reference: the earlier checkpoint (a sibling
        folder) whose file holds the chunk, which this process did not write again; None
        for a chunk written here.
    """

    box: Box
    process_index: int
    packed: bool
    key: str
    data_bytes: int | None
    holders: tuple[int, ...]
    writer: int | None
    referenced_in: str | None = None

    @property
    def skipped(self) -> tuple[int, ...]:
        """The holders whose copy the save skipped (replicas); () when the writer is unknown."""
        return tuple(h for h in self.holders if h != self.writer) if self.writer is not None else ()


def _records(meta: CheckpointMetadata) -> dict[int, ProcessRecord]:
    storage, path = storage_for(meta.path)
    out = {}
    for i in range(meta.process_count):
        location = f"{path}/{process_record_name(i)}"
        try:
            out[i] = read_process_record(storage, location)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{location} is missing: process {i} of {meta.process_count} left no record of its chunks in {meta.path}"
            ) from e
    return out


def _holders(m: ArrayMetadata, box: Box, process_count: int, process_index: int) -> tuple[tuple[int, ...], int | None]:
    s = m.saved_sharding
    if s is None or s.kind != "named" or len(s.mesh_shape) != len(s.mesh_axis_names):
        return (), None
    from jax.sharding import PartitionSpec

    try:
        boxes = named_shard_boxes(m.shape, dict(zip(s.mesh_axis_names, s.mesh_shape)), PartitionSpec(*s.spec))
    except ValueError:
        return (), None
    holders = tuple(i for i, b in enumerate(boxes) if all(o <= bo and bo + bs <= o + n for o, n, bo, bs
                                                           in zip(b.origin, b.shape, box.origin, box.shape)))
    per_process = len(boxes) // process_count if process_count and len(boxes) % process_count == 0 else None
    writer = next((h for h in holders if per_process and h // per_process == process_index), None)
    return holders, writer


def shard_chunks(checkpoint: str | os.PathLike | CheckpointMetadata, leaf: str) -> list[WrittenChunk]:
    """The stored chunks of one array leaf, with the process (and mesh position) that
    wrote each and the replicas the save skipped.

    Args:
      checkpoint: a checkpoint path (local or URL) or its `ckpt.metadata(path)`.
      leaf: the leaf's key path as `jax.tree_util.keystr` prints it (`meta.keystr`), or
        its storage path (a key of `meta.leaves`).
    Returns:
      `WrittenChunk` records in process, then record order: packed and unpacked chunks alike.
    Raises:
      StructureMismatchError: no array leaf of that name (the message lists some).
      CorruptCheckpointError: a process record is missing or malformed.

    Multi-process: reads every process's record; any process may call it.
    """
    meta = _metadata_of(checkpoint)
    path = _leaf_path(meta, leaf)
    return _chunks_of(meta, _records(meta), path)


def _chunks_of(meta: CheckpointMetadata, records: Mapping[int, ProcessRecord], leaf_path: str) -> list[WrittenChunk]:
    m = meta.arrays[leaf_path]
    imported = "imported_from" in meta.user_metadata  # written from the host by import_orbax: no writing device
    out = []
    for pidx, rec in sorted(records.items()):
        found: list[tuple[Box, bool, str, int | None]] = []
        for pack in rec.own_packs:  # its pack, and packs of local steps copied into a durable step (two tiers)
            found += [(b.box, True, pack.key, b.data_bytes) for b in pack.boxes if b.leaf == leaf_path]
        found += [(c.box, False, c.key, c.data_bytes) for c in rec.chunks if c.leaf == leaf_path and c.box is not None]
        refs = [r for r in rec.references or () if r.get("leaf") == leaf_path]
        for box, packed, key, nbytes in found:
            holders, writer = _holders(m, box, meta.process_count, pidx)
            out.append(WrittenChunk(box, pidx, packed, key, nbytes, holders, None if imported else writer))
        for r in refs:  # unchanged since an earlier step: referenced, not written (the manifest's entry is the truth)
            ref = m.references.get(tuple(r.get("chunk") or ()))
            if ref is None:
                continue
            box = cell_box(ref.chunk, m.chunk_shape, m.shape)
            holders, writer = _holders(m, box, meta.process_count, pidx)
            out.append(WrittenChunk(box, pidx, False, chunk_key(leaf_path, ref.chunk), box.size * m.dtype.itemsize, holders,
                                    None if imported else writer, ref.folder))
        for p in rec.packed_references or ():  # packed chunks referenced in an earlier step's pack
            for b in p.boxes:
                if b.leaf == leaf_path:
                    holders, writer = _holders(m, b.box, meta.process_count, pidx)
                    out.append(WrittenChunk(b.box, pidx, True, p.key, b.data_bytes, holders, None if imported else writer,
                                            str(p.extra.get("in"))))
    return out


def _leaf_path(meta: CheckpointMetadata, leaf: str) -> str:
    arrays = meta.arrays
    if leaf in arrays:
        return leaf
    for p in arrays:
        if meta.keystr(p) == leaf:
            return p
    some = ", ".join(repr(meta.keystr(p)) for p in list(arrays)[:5])
    raise StructureMismatchError(
        f"{meta.path} has no array leaf {leaf!r}; its array leaves are named like {some} (as jax.tree_util.keystr prints "
        "them), or give a glob such as \"*kernel*\""
    )


def _select(meta: CheckpointMetadata, leaves: str | Sequence[str] | None) -> list[str]:
    arrays = meta.arrays
    if leaves is None:
        return sorted(arrays, key=lambda p: -arrays[p].nbytes)[:DEFAULT_LEAVES]
    globs = [leaves] if isinstance(leaves, str) else list(leaves)
    out = []
    for g in globs:
        if g in arrays or any(meta.keystr(p) == g for p in arrays):
            hits = [_leaf_path(meta, g)]
        else:  # a glob over key paths (`[` is literal) or storage paths
            hits = [p for p in arrays if fnmatch.fnmatchcase(meta.keystr(p), g.replace("[", "[[]")) or fnmatch.fnmatchcase(p, g)]
        if not hits:
            _leaf_path(meta, g)  # raises, naming some leaves
        out += [p for p in hits if p not in out]
    return out


def _chunk_label(c: WrittenChunk) -> str:
    """`p<process>`, `dev@<mesh position>` of the writer, and the replicas skipped (short lines)."""
    lines = [f"p{c.process_index}"] + ([f"dev@{c.writer}"] if c.writer is not None else [])
    if c.referenced_in is not None:
        lines.append(f"in {c.referenced_in}")
    if c.skipped:
        lines.append(f"skip @{','.join(map(str, c.skipped))}" if len(c.skipped) <= 2 else f"skip {len(c.skipped)}")
    return "\n".join(lines)


def _plane(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[int | None, int | None]:
    """The two dimensions a panel shows (rows, columns): the last two the chunk grid
    splits (or the array's last two); None for a missing one."""
    split = [d for d, (n, c) in enumerate(zip(shape, chunk_shape)) if n > c]
    dims = split[-2:] if len(split) >= 2 else sorted(set(split) | set(range(len(shape))[-2:]))[-2:]
    if not dims:
        return None, None
    if len(dims) == 1:
        return None, dims[0]
    return dims[0], dims[1]


def _span(box: Box, dim: int | None) -> tuple[int, int]:
    return (0, 1) if dim is None else (box.origin[dim], box.shape[dim])


def _process_colors(n: int) -> list:
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "viridis"]
    return [cmap(i if n <= 20 else i / max(1, n - 1)) for i in range(n)]


def plot_shards(
    checkpoint: str | os.PathLike | CheckpointMetadata,
    leaves: str | Sequence[str] | None = None,
    *,
    columns: int = 2,
) -> Figure:
    """Draws the shard map of array leaves: each stored chunk as a rectangle of the
    global array, coloured by the process that wrote it, labelled with the writing
    device's mesh position and the replicas the save skipped.

    A 1-D leaf is a strip; a leaf of more dimensions is drawn over the two dimensions
    its chunk grid splits last (others are projected). Packed chunks are hatched.

    Args:
      checkpoint: a checkpoint path (local or URL) or its `ckpt.metadata(path)`.
      leaves: key paths as `jax.tree_util.keystr` prints them (`".params['w']"`), storage
        paths, or globs over key paths (`"*kernel*"`); default: the
        `DEFAULT_LEAVES` largest arrays.
      columns: panels per row.
    Returns:
      A `matplotlib.figure.Figure`, not attached to pyplot: a notebook shows it as the
      cell's value (or `display(fig)`); `fig.savefig(out)` writes a file.
    Raises:
      StructureMismatchError: a name matches no array leaf.
      ValueError: the checkpoint holds no array leaf (only values).
      ModuleNotFoundError: matplotlib is not installed (`pip install 'checkpointer[notebook]'`).
      CorruptCheckpointError: a process record is missing or malformed.

    Multi-process: reads every process's record; call it from one process.
    """
    Figure = _import_matplotlib()
    from matplotlib.patches import Patch, Rectangle

    meta = _metadata_of(checkpoint)
    chosen = _select(meta, leaves)
    if not chosen:
        raise ValueError(f"{meta.path} holds no array leaf to draw")
    records = _records(meta)
    colors = _process_colors(meta.process_count)
    cols = max(1, min(columns, len(chosen)))
    rows = -(-len(chosen) // cols)
    # A row of 1-D (or 0-D) leaves only is a row of strips: less height.
    flat = [all(_plane(meta.arrays[p].shape, meta.arrays[p].chunk_shape)[0] is None for p in chosen[r * cols:(r + 1) * cols])
            for r in range(rows)]
    heights = [2.2 if f else 4.2 for f in flat]
    fig = Figure(figsize=(6.0 * cols, sum(heights) + 0.8), dpi=_DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, height_ratios=heights)
    for ax in axes.flat[len(chosen):]:
        ax.set_visible(False)
    for ax, leaf_path in zip(axes.flat, chosen):
        m = meta.arrays[leaf_path]
        chunks = _chunks_of(meta, records, leaf_path)
        rdim, cdim = _plane(m.shape, m.chunk_shape)
        height = m.shape[rdim] if rdim is not None else 1
        width = m.shape[cdim] if cdim is not None else 1
        across = len({_span(c.box, cdim)[0] for c in chunks})  # chunks side by side: the labels' room
        fontsize = _FONT - 1 if across <= 4 else _FONT - 3 if across <= 8 else 0
        for c in chunks:
            (r0, h), (c0, w) = _span(c.box, rdim), _span(c.box, cdim)
            ax.add_patch(Rectangle((c0, r0), w, h, facecolor=colors[c.process_index], edgecolor="black", linewidth=1.0,
                                   alpha=0.35 if c.referenced_in is not None else 0.8, hatch="/" if c.packed else None))
            if fontsize and len(chunks) <= MAX_LABELLED_CHUNKS:
                ax.text(c0 + w / 2, r0 + h / 2, _chunk_label(c), ha="center", va="center", fontsize=fontsize)
        if rdim is None:
            ax.set_box_aspect(0.25)  # a 1-D leaf: a strip
        ax.set_xlim(0, max(width, 1))
        ax.set_ylim(max(height, 1), 0)
        if rdim is None:
            ax.set_yticks([])
        ax.set_xlabel(f"dim {cdim}" if cdim is not None else "", fontsize=_FONT - 1)
        ax.set_ylabel(f"dim {rdim}" if rdim is not None else "", fontsize=_FONT - 1)
        ax.tick_params(labelsize=_FONT - 2)
        saved = m.saved_sharding.describe() if m.saved_sharding else "host numpy array"
        writers = sorted({c.process_index for c in chunks})
        skipped = sum(len(c.skipped) for c in chunks)
        ax.set_title(f"{meta.keystr(leaf_path) or '<root>'}  {m.dtype}{list(m.shape)}\n{saved}\n"
                     + (f"{len(chunks)} chunks{' (packed)' if m.packed else ''} by process{'es' * (len(writers) > 1)} "
                        f"{', '.join(map(str, writers))}; {skipped} replica{'s' * (skipped != 1)} skipped" if chunks
                        else "no chunk stored (size 0)"), fontsize=_FONT - 1)
    used = sorted({c.process_index for leaf_path in chosen for c in _chunks_of(meta, records, leaf_path)})
    handles = [Patch(facecolor=colors[i], label=f"process {i}") for i in used]
    if any(meta.arrays[p].packed for p in chosen):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="/", label="packed"))
    if any(meta.arrays[p].references for p in chosen):
        handles.append(Patch(facecolor="lightgrey", edgecolor="black", alpha=0.35, label="referenced: in an earlier step"))
    if handles:  # none when every leaf drawn has size 0 (no chunk stored)
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), fontsize=_FONT - 1, frameon=False)
    fig.suptitle(f"Who wrote which chunk: {meta.path}" + (f" (step {meta.step})" if meta.step is not None else "")
                 + "\npN: process N wrote the chunk, dev@k: the device at position k of the saved mesh; "
                 "skip: the replicas not written", fontsize=_FONT)
    return fig


def save_png(fig: Figure, out: str | os.PathLike) -> None:
    """Writes a picture of this module to the PNG file `out` at its own dpi."""
    try:
        fig.savefig(out, dpi=fig.dpi)
    except OSError as e:
        raise CheckpointError(f"cannot write the picture {out}: {e}") from e
