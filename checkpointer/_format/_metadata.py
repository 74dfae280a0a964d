"""`CheckpointMetadata`: what a committed checkpoint holds, as its manifest says (parsed
by `_manifest.parse_manifest`, read by `ckpt.metadata`)."""

from __future__ import annotations

import dataclasses
import math

from .._errors import path_keystr
from ._leaves import ArrayMetadata, ValueMetadata


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """What a committed checkpoint holds, read from its manifest.

    Attributes:
      path: the checkpoint path.
      step: the training step, or None if the save gave none.
      format_version: the on-disk format version (1; 2 when it has references, see `_references`).
      tree: the saved tree with each leaf replaced by its `ArrayMetadata` or
        `ValueMetadata` (containers rebuilt as in a target-less restore).
      leaves: leaf path → `ArrayMetadata` | `ValueMetadata`, in tree order. The leaf
        path is the escaped storage name (`mlp%2F~%2Flinear_0/w`); show users each
        entry's `.keystr` (`['mlp/~/linear_0']['w']`), or `keystr(leaf_path)`.
      user_metadata: the `metadata=` / `metrics=` dict given at save time.
      process_count: how many processes saved it.
      process_bytes_written: bytes of chunk files each process wrote.
      created_unix_s: when the manifest was written, seconds since the epoch.
      library_version: checkpointer version that wrote it.
      jax_version: JAX version that wrote it.
      structure: the raw JSON tree structure.
      generation: the save attempt that wrote it (None in a manifest without one).
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
    generation: str | None = None

    @property
    def referenced_bytes(self) -> int:
        """Bytes of array data in chunks that live in earlier checkpoints (references of
        an incremental save); the rest of `total_bytes` this checkpoint holds itself."""
        total = 0
        for m in self.arrays.values():
            for cell in m.references:
                total += math.prod(min(c, s - i * c) for i, c, s in zip(cell, m.chunk_shape, m.shape)) * m.dtype.itemsize
            total += sum(b.nbytes for b in m.pack_boxes if b.folder is not None)  # referenced packed chunks
        return total

    @property
    def referenced_folders(self) -> set[str]:
        """The sibling checkpoints (folder names) whose chunks or packed chunks this one
        references (incremental saves); empty without references."""
        out = {r.folder for m in self.arrays.values() for r in m.references.values()}
        return out | {b.folder for m in self.arrays.values() for b in m.pack_boxes if b.folder is not None}

    @property
    def total_bytes(self) -> int:
        """Bytes of all array data (sum of shape × itemsize)."""
        return sum(m.nbytes for m in self.leaves.values() if isinstance(m, ArrayMetadata))

    @property
    def arrays(self) -> dict[str, ArrayMetadata]:
        """The array leaves only."""
        return {p: m for p, m in self.leaves.items() if isinstance(m, ArrayMetadata)}

    def keystr(self, leaf_path: str) -> str:
        """The user's name of a leaf: its key path as `jax.tree_util.keystr` prints it.

        Args:
          leaf_path: a key of `leaves` (the escaped storage name).
        Returns:
          E.g. `"['mlp/~/linear_0']['w']"` for the leaf path `"mlp%2F~%2Flinear_0/w"`,
          `".params['dense']['kernel']"` under a flax `TrainState`; `""` for a root leaf.
        Raises:
          KeyError: no such leaf path.
        """
        name = self.leaves[leaf_path].keystr
        return name if name is not None else path_keystr(leaf_path)
