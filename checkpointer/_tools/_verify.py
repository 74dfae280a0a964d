"""`verify`: read every stored byte of a checkpoint and check every checksum."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

from .. import _encoding, _format
from .._encoding import VerifyContext
from .._errors import CheckpointError
from .._format import ChunkRecord, ProcessRecord, process_record_name, read_metadata, read_process_record
from .._storage import Storage, storage_for


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """The result of `verify`.

    Attributes:
      path: the checkpoint path.
      ok: True when no problem was found.
      problems: one line per problem, each naming the leaf and the chunk key.
      chunks_checked: zarr shard files read.
      bytes_checked: bytes of array data decoded and checksummed.
      elapsed_s: seconds the verification took.
    """

    path: str
    ok: bool
    problems: tuple[str, ...]
    chunks_checked: int
    bytes_checked: int
    elapsed_s: float

    def __str__(self) -> str:
        head = f"{self.path}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'}"
        head += f" ({self.chunks_checked} chunks, {self.bytes_checked / 2**20:.1f} MiB, {self.elapsed_s:.2f} s)"
        return "\n".join([head] + [f"  - {p}" for p in self.problems])


def verify(path: str | os.PathLike, *, progress: Callable[[int, int], object] | None = None) -> VerifyReport:
    """Reads every chunk of the committed checkpoint at `path` and checks it.

    Checks: the manifest parses; every chunk of every array leaf exists and decodes
    (TensorStore checks the `crc32c` of each inner chunk and of each zarr shard file's
    index); the decoded bytes match the `data_crc32c` the writing process recorded in
    `processes/<i>.json`; every chunk was recorded by exactly one process. Packed
    leaves (`_pack`): each pack file has the size the manifest's index says and
    decodes (its `crc32c` codec) to the bytes its writer recorded, every packed chunk
    matches the manifest's crc32c (a packed chunk counts in `chunks_checked`), and the
    index's copies in `processes/<i>.json` and in the pack's `zarr.json` attributes
    agree with the manifest's, entry by entry. Each leaf's encoding checks its own
    (`LeafEncoding.verify`).

    Args:
      path: a checkpoint path.
      progress: optional callable `progress(done_chunks, total_chunks)`.
    Returns:
      A `VerifyReport` listing every problem found (it does not stop at the first).
    Raises:
      CheckpointNotFoundError: no committed checkpoint at `path`.
      CorruptCheckpointError: the manifest itself is unreadable.

    Multi-process: any process may call it alone; it reads everything.
    """
    t0 = time.perf_counter()
    storage, path = storage_for(path)
    meta = read_metadata(storage, path)
    problems: list[str] = []
    recorded: dict[str, ChunkRecord] = {}
    records: dict[str, ProcessRecord] = {}
    listed = set(storage.list_dir(f"{path}/{_format.PROCESSES}"))
    for name in sorted(listed):
        where = f"{path}/{_format.PROCESSES}/{name}"
        try:
            record = records[name] = read_process_record(storage, where)
        except CheckpointError as e:
            problems.append(f"process record {name} is malformed: {e}")
            continue
        for c in record.chunks:
            if c.key in recorded:
                problems.append(f"chunk {c.key} is recorded by two processes")
            recorded[c.key] = c
    expected = range(min(meta.process_count, len(listed) + 1))
    own = _local_process(storage, path)
    if own is not None:  # a two-tier manager's local step (or a peer's copy of one): its own process's record only
        expected = range(own, own + 1)
    missing = [i for i in expected if process_record_name(i).rsplit("/", 1)[1] not in listed]
    if missing:  # (not counted past the records found: a manifest may claim 10**9 processes)
        problems.append(f"process record {process_record_name(missing[0])} is missing (process {missing[0]} of "
                        f"{meta.process_count}; {len(listed)} record{'s' * (len(listed) != 1)} found): that "
                        "process's chunks and per-process state are not recorded")
    ctx = VerifyContext(records, recorded, problems, progress=progress)
    groups = _encoding.by_encoding(meta.arrays.values())
    ctx.total = sum(enc.chunk_count(m) for enc, metas in groups for m in metas)  # packed chunks count like any other
    for enc, metas in groups:
        enc.verify(storage, path, metas, ctx)
    return VerifyReport(path, not problems, tuple(problems), ctx.checked, ctx.bytes_checked, time.perf_counter() - t0)


def _local_process(storage: Storage, path: str) -> int | None:
    """The process whose local step `path` is (its marker says `"tier": "local"`: a local
    step holds that process's record only), or None (any other checkpoint)."""
    try:
        marker = _format.loads(storage.read_file(f"{path}/{_format.COMMITTED}"), f"{path}/{_format.COMMITTED}")
    except (OSError, CheckpointError):
        return None
    p = marker.get("process_index") if isinstance(marker, dict) and marker.get("tier") == "local" else None
    return p if isinstance(p, int) and not isinstance(p, bool) and p >= 0 else None
