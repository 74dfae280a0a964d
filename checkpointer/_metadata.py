"""Reading a committed checkpoint's manifest into `CheckpointMetadata`, with validation.

Needs no devices: a checkpoint saved by 8 processes × 4 devices is described on a laptop.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os

from . import _format
from ._errors import CheckpointNotFoundError, CorruptCheckpointError
from ._format import ArrayMetadata, ValueMetadata
from ._storage import Storage, storage_for
from ._tree import check_leaf_path, leaf_paths_of, rebuild


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a committed checkpoint holds, read from its manifest.

    Attributes:
      path: the checkpoint path.
      step: the training step, or None if the save gave none.
      format_version: the on-disk format version (1).
      tree: the saved tree with each leaf replaced by its `ArrayMetadata` or
        `ValueMetadata` (containers rebuilt as in a target-less restore).
      leaves: leaf path → `ArrayMetadata` | `ValueMetadata`, in tree order.
      user_metadata: the `metadata=` / `metrics=` dict given at save time.
      process_count: how many processes saved it.
      process_bytes_written: bytes of chunk files each process wrote.
      created_unix_s: when the manifest was written, seconds since the epoch.
      library_version: checkpointer version that wrote it.
      jax_version: JAX version that wrote it.
      structure: the raw JSON tree structure.
    """

    path: str
    step: int | None
    format_version: int
    tree: object
    leaves: dict[str, ArrayMetadata | ValueMetadata]
    user_metadata: dict
    process_count: int
    process_bytes_written: tuple[int, ...]
    created_unix_s: float
    library_version: str
    jax_version: str
    structure: dict

    @property
    def total_bytes(self) -> int:
        """Bytes of all array data (sum of shape × itemsize)."""
        return sum(m.nbytes for m in self.leaves.values() if isinstance(m, ArrayMetadata))

    @property
    def arrays(self) -> dict[str, ArrayMetadata]:
        """The array leaves only."""
        return {p: m for p, m in self.leaves.items() if isinstance(m, ArrayMetadata)}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _require(cond: bool, what: str, where: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"manifest of {where}: {what}")


def parse_manifest(raw: object, where: str) -> CheckpointMetadata:
    """Validates a parsed manifest; every failure is a `CorruptCheckpointError`."""
    _require(isinstance(raw, dict), "not a JSON object", where)
    version = raw.get("format_version")
    if not _is_int(version) or version != _format.FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where} has format_version {version!r}; this library reads format_version "
            f"{_format.FORMAT_VERSION}. Upgrade checkpointer to read newer checkpoints."
        )
    step = raw.get("step")
    _require(step is None or _is_int(step), f"step {step!r:.100} is not an int", where)
    leaves_raw = raw.get("leaves")
    _require(isinstance(leaves_raw, dict), "'leaves' is not an object", where)
    structure = raw.get("structure")
    _require(isinstance(structure, dict), "'structure' is not an object", where)
    user_metadata = raw.get("user_metadata", {})
    _require(isinstance(user_metadata, dict), "'user_metadata' is not an object", where)
    pcount = raw.get("process_count", 1)
    _require(_is_int(pcount) and pcount >= 1, f"process_count {pcount!r:.100} is invalid", where)
    pbytes = raw.get("process_bytes_written", [])
    _require(
        isinstance(pbytes, list) and all(_is_int(b) and 0 <= b <= _format.MAX_ARRAY_BYTES for b in pbytes),
        "'process_bytes_written' is not a list of byte counts",
        where,
    )
    created = raw.get("created_unix_s", 0.0)
    _require(
        (isinstance(created, (int, float)) and not isinstance(created, bool)) and math.isfinite(created),
        "'created_unix_s' is not a number",
        where,
    )

    leaves: dict[str, ArrayMetadata | ValueMetadata] = {}
    for path, entry in leaves_raw.items():
        check_leaf_path(path, where=where)
        _require(isinstance(entry, dict), f"leaf {path!r} is not an object", where)
        if entry.get("type") == "array":
            leaves[path] = _format.array_metadata_from_json(path, entry, where)
        elif entry.get("type") == "value":
            leaves[path] = ValueMetadata(path, _format.value_from_json(entry.get("value"), f"leaf {path!r} in {where}"))
        else:
            raise CorruptCheckpointError(f"leaf {path!r} in {where} has unknown type {entry.get('type')!r}")
    ordered = leaf_paths_of(structure)
    _require(sorted(ordered) == sorted(leaves), "the tree structure and the leaves disagree", where)
    leaves = {p: leaves[p] for p in ordered}
    tree = rebuild(structure, lambda p: leaves[p], where=where)
    return CheckpointMetadata(
        path=where, step=step, format_version=version, tree=tree, leaves=leaves, user_metadata=user_metadata,
        process_count=pcount, process_bytes_written=tuple(pbytes), created_unix_s=float(created),
        library_version=str(raw.get("library_version", "")), jax_version=str(raw.get("jax_version", "")),
        structure=structure,
    )


def read_metadata(storage: Storage, path: str) -> CheckpointMetadata:
    """Reads the manifest of the committed checkpoint at `path`.

    Raises:
      CheckpointNotFoundError: no commit marker at `path`.
      CorruptCheckpointError: the manifest is missing or malformed.
    """
    if not storage.exists(f"{path}/{_format.COMMITTED}"):
        parent, name = path.rstrip("/").rsplit("/", 1)
        partials = [n for n in storage.list_dir(parent) if (_format.parse_partial_name(n) or ("",))[0] == name]
        hint = (
            f" Found uncommitted save attempts {partials}: they crashed or are still writing, and are not checkpoints."
            if partials
            else " Check the path, or list committed steps with `checkpointer ls DIR`."
        )
        raise CheckpointNotFoundError(f"no committed checkpoint at {path}: the commit marker {_format.COMMITTED} is absent.{hint}")
    try:
        data = storage.read_file(f"{path}/{_format.MANIFEST}", max_bytes=_format.MAX_MANIFEST_BYTES)
    except (FileNotFoundError, IsADirectoryError) as e:
        raise CorruptCheckpointError(f"{path} is marked committed but has no {_format.MANIFEST} file") from e
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
        raise CorruptCheckpointError(f"{path}/{_format.MANIFEST} is larger than {_format.MAX_MANIFEST_BYTES} bytes") from e
    return parse_manifest(_format.loads(data, f"{path}/{_format.MANIFEST}"), path)


def metadata(path: str | os.PathLike) -> CheckpointMetadata:
    """Returns the metadata of the committed checkpoint at `path`.

    Reads only `manifest.json`; needs no devices, whatever mesh saved the checkpoint.

    Args:
      path: a checkpoint path (local, `file://`, `memory://`, `gs://`, `s3://`).
    Returns:
      A `CheckpointMetadata` (step, per-leaf shape/dtype/chunking/saved sharding, user
      metadata, process count, versions).
    Raises:
      CheckpointNotFoundError: `path` has no commit marker.
      CorruptCheckpointError: the manifest is malformed.

    Multi-process: any process may call it alone.
    """
    storage, path = storage_for(path)
    return read_metadata(storage, path)
