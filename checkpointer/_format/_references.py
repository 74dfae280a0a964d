"""References of incremental saves: a chunk stored as "the same chunk of an earlier
committed checkpoint of the same directory" instead of as bytes (docs/incremental.md,
docs/format.md, "format_version 2: references").

In the manifest, an array leaf's entry lists its referenced chunks:
```
"references": [{"chunk": [0, 1], "in": "100", "generation": "2026...-0a1b2c3d",
                "data_crc32c": 123, "xxh3_128": "9f..."}]
```
`in` is the name of a sibling folder of the checkpoint (a committed checkpoint of the
same directory), `generation` the save attempt that folder's manifest must name (an
overwritten target is detected), `data_crc32c` / `xxh3_128` the chunk's bytes. The chunk
file is `<directory>/<in>/arrays/<leaf>/c/...`, with the layout of this leaf (the target
leaf must have the same shape, dtype, chunk and inner chunk shape). References are
flat: the target holds the bytes itself (a reference to a reference is refused), which
rules out chains and cycles.

A manifest with references has `format_version` `FORMAT_VERSION_REFERENCES` (2); one
without keeps 1, readable by older releases. Older readers refuse version 2 by their
version check (they would read a missing chunk as the fill value).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .._errors import CorruptCheckpointError

FORMAT_VERSION_REFERENCES = 2
_MAX_NAME = 255


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    """One chunk of an array leaf that lives in an earlier checkpoint of the directory.

    Attributes:
      chunk: the chunk's cell in the leaf's chunk grid.
      folder: the sibling folder (checkpoint) that holds the chunk file (JSON `"in"`).
      generation: the save attempt whose bytes are referenced (that folder's manifest's).
      data_crc32c: crc32c of the chunk's C-order bytes.
      xxh3_128: XXH3-128 of those bytes, 32 hex digits, or None when unknown.
    """

    chunk: tuple[int, ...]
    folder: str
    generation: str
    data_crc32c: int
    xxh3_128: str | None = None

    def to_json(self) -> dict:
        out: dict[str, object] = {"chunk": list(self.chunk), "in": self.folder, "generation": self.generation,
                                  "data_crc32c": self.data_crc32c}
        if self.xxh3_128 is not None:
            out["xxh3_128"] = self.xxh3_128
        return out


def check_folder_name(name: object, own: str, where: str) -> str:
    """`name` if it names a sibling folder of the checkpoint `own` (one path component,
    not `.`/`..`, not `own` itself), else CorruptCheckpointError."""
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        raise CorruptCheckpointError(
            f"{where}: a reference points to {name!r:.100}, which is not a checkpoint of the same directory; references "
            "never leave the directory. The manifest is damaged or hostile: restore another step"
        )
    if name == own:
        raise CorruptCheckpointError(f"{where}: a reference points to the checkpoint itself ({name!r}): a cycle")
    return name


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def refs_from_json(raw: object, own: str, rank: int, where: str) -> tuple[ChunkRef, ...]:
    """Parses one leaf's `"references"` list (`own`: the checkpoint's folder name).

    Raises:
      CorruptCheckpointError: malformed, leaving the directory, pointing to itself, or a
        chunk listed twice.
    """
    if not isinstance(raw, list):
        raise CorruptCheckpointError(f"{where}: 'references' is not a list")
    out, seen = [], set()
    for i, r in enumerate(raw):
        if not isinstance(r, dict):
            raise CorruptCheckpointError(f"{where}: reference {i} is not an object")
        chunk, gen, crc, h = r.get("chunk"), r.get("generation"), r.get("data_crc32c"), r.get("xxh3_128")
        if not (isinstance(chunk, list) and len(chunk) == rank and all(_is_count(c) for c in chunk)):
            raise CorruptCheckpointError(f"{where}: reference {i}: chunk {chunk!r:.100} is not a cell of rank {rank}")
        folder = check_folder_name(r.get("in"), own, f"{where}: reference {i}")
        if not isinstance(gen, str) or not gen or len(gen) > _MAX_NAME or not isinstance(crc, int) or not _is_count(crc) or crc >= 1 << 32:
            raise CorruptCheckpointError(f"{where}: reference {i}: malformed generation or data_crc32c")
        if h is not None and not (isinstance(h, str) and len(h) == 32 and all(c in "0123456789abcdef" for c in h)):
            raise CorruptCheckpointError(f"{where}: reference {i}: xxh3_128 {h!r:.100} is not 32 hex digits")
        cell = tuple(chunk)
        if cell in seen:
            raise CorruptCheckpointError(f"{where}: chunk {list(cell)} is referenced twice")
        seen.add(cell)
        out.append(ChunkRef(cell, folder, gen, crc, h))
    return tuple(out)


def sibling(path: str, folder: str) -> str:
    """The path of checkpoint `folder` beside the checkpoint at `path`."""
    return f"{path.rstrip('/').rsplit('/', 1)[0]}/{folder}"


def source_path(path: str, folder: str | None) -> str:
    """Where a chunk file of the checkpoint at `path` lies: `path` itself (None), or its
    sibling `folder` (a reference)."""
    return path if folder is None else sibling(path, folder)


def pack_ref_key(folder: str, key: str) -> str:
    """The in-memory key (`PackedBox.key`) of a pack file of the sibling `folder`: keeps
    the runs of different checkpoints' packs apart. Never written to disk (the manifest
    says `"in"`)."""
    return f"../{folder}/{key}"


def split_pack_key(key: str) -> tuple[str | None, str]:
    """`(folder, key in it)` of a `PackedBox.key` (`pack_ref_key`); `(None, key)` for
    this checkpoint's own pack."""
    if key.startswith("../"):
        folder, rest = key[3:].split("/", 1)
        return folder, rest
    return None, key


def pack_file(path: str, key: str) -> str:
    """The path of the pack file `key` (a `PackedBox.key`) of the checkpoint at `path`:
    in it, or in the sibling checkpoint a pack reference names."""
    folder, rest = split_pack_key(key)
    return f"{source_path(path, folder)}/{rest}"


def by_chunk(refs: tuple[ChunkRef, ...]) -> Mapping[tuple[int, ...], ChunkRef]:
    return {r.chunk: r for r in refs}
