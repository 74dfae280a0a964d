"""The interface of a stored-leaf encoding: how an array leaf's chunks lie in storage,
and every operation whose work depends on it.

An encoding is chosen per leaf at save time and recorded in the manifest
(`ArrayMetadata.packed`); `encoding_of(meta)` (`_registry`) gives it, and the callers
(restore, `plan_restore`, the cooperative planner, `verify`, export, the two tiers) call
its methods instead of branching on the encoding. The registry `ENCODINGS` lists every
encoding; `tests/test_encodings.py` runs every operation on each, so an encoding that
lacks one, or an operation that forgets an encoding, fails there.

Who calls what, where:
  plan, plan_share  pure; `plan_restore` (any process, for any process) and restore
                    (each process, for itself), through `_restore._plan.build_plan`.
  files             pure; the two tiers (is a local step whole on this process?).
  check_files       restore, each process, before planning or allocating anything.
  start_restore     restore, each process, its own plan (collective only through the
                    exchange that follows, which is the caller's).
  verify            `verify`, any process alone; reads everything.
  region_reader     export (and any reader walking a leaf region by region), any process.
  read_into         the same into the caller's buffers (a restart's holder reading a lost
                    node's boxes, `_manage/_peer_transfer`), any process.
  replicated_files  the two tiers' replication, each process, from its own record.
  start_write       a save, each process, its own chunks (the write path's files; the
                    direct or the buffered way, `_write.WriteContext`).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .._errors import CheckpointError
from .._format import PROCESSES, ArrayMetadata, Box, ChunkRecord, ProcessRecord, read_process_record
from .._storage import DEFAULT_MAX_OVER_READ_RATIO, Storage
from ._leaf_plan import LeafRestorePlan
from ._read import RestoreStats
from ._write import LeafWrite, WriteContext, WriteResult


class Budget(Protocol):
    """The restore's bound on host memory in flight (`_restore._Budget`)."""

    limit: int

    def acquire(self, n: int) -> None: ...

    def release(self, n: int) -> None: ...


@dataclasses.dataclass
class ReadContext:
    """What one process's restore gives every encoding's `start_restore`.

    Attributes:
      budget: host memory in flight; an encoding charges each read to it.
      stats: the restore's statistics (bytes and reads, as planned).
      process_index: this process (for error messages).
      copies_in_flight: host copies a read box costs at most (file bytes, host box,
        device staging), for the budget.
      leaf_pool, chunk_pool: worker threads for leaves and for chunks within a leaf.
      x64: the caller's `jax_enable_x64` (worker threads must place arrays with it).
      piece_crcs: filled by the reads: `(file key, offset)` → crc32c of each piece of a
        shared chunk (`LeafRestorePlan.shared`) this process read, for the check after
        the exchange.
      max_over_read_ratio, read_chunk_bytes: how nearby byte ranges of one file are
        fetched together (`restore`'s options of these names, `_storage.coalesce_ranges`).
    """

    budget: Budget
    stats: RestoreStats
    process_index: int
    copies_in_flight: int
    leaf_pool: concurrent.futures.Executor | None = None
    chunk_pool: concurrent.futures.Executor | None = None
    x64: bool = False
    piece_crcs: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
    max_over_read_ratio: float = DEFAULT_MAX_OVER_READ_RATIO
    read_chunk_bytes: int | None = None


@dataclasses.dataclass
class VerifyContext:
    """What `verify` gives every encoding's `verify`, and collects from it.

    Attributes:
      records: every process's record (`processes/<i>.json`) that parsed, by file name.
      chunks: chunk key → the record entry of the process that wrote it.
      problems: the findings so far; an encoding appends one line per problem, naming
        the leaf, the file and, for a copy of an index, the copy and the entry.
      total: chunks to check in all (for progress).
      progress: `progress(done, total)` or None.
      checked, bytes_checked: chunks and bytes checked so far.
    """

    records: Mapping[str, ProcessRecord]
    chunks: Mapping[str, ChunkRecord]
    problems: list[str]
    total: int = 0
    progress: Callable[[int, int], object] | None = None
    checked: int = 0
    bytes_checked: int = 0

    _targets: dict[str, dict[str, ChunkRecord]] = dataclasses.field(default_factory=dict)

    def target_chunks(self, storage: Storage, target: str) -> Mapping[str, ChunkRecord]:
        """Chunk key → record entry of every process record of the referenced checkpoint
        `target` (read once; a record that does not parse adds a problem)."""
        if target not in self._targets:
            found: dict[str, ChunkRecord] = {}
            try:
                names = storage.list_dir(f"{target}/{PROCESSES}")
            except OSError as e:
                names = []
                self.problems.append(f"referenced checkpoint {target}: cannot list its process records: {e}")
            for name in names:
                try:
                    found.update((c.key, c) for c in read_process_record(storage, f"{target}/{PROCESSES}/{name}").chunks)
                except (CheckpointError, OSError) as e:
                    self.problems.append(f"referenced checkpoint {target}: process record {name}: {e}")
            self._targets[target] = found
        return self._targets[target]

    def done(self, chunks: int, nbytes: int = 0) -> None:
        """Counts `chunks` more chunks (and `nbytes` bytes) checked; reports progress."""
        self.checked += chunks
        self.bytes_checked += nbytes
        if self.progress is not None:
            self.progress(self.checked, self.total)


# A restore's work item: (stored leaf, its `_targets.LeafTarget` (`.sharding`, `.dtype`),
# its `LeafRestorePlan`). The target is duck-typed: `_restore` is above this package.
Item = tuple[ArrayMetadata, Any, LeafRestorePlan]


class LeafEncoding(abc.ABC):
    """One way of storing an array leaf's chunks, and the operations that depend on it.

    Every method names the leaf, the checkpoint path and (with several processes) the
    process in its errors, what was expected against what was found, and the fix.
    """

    name: str  # how `tests/test_encodings.py` and error messages name it
    # Whether a cooperative share should be contiguous in C order (the exchange layout
    # then splits the outermost dimension it can): true where a share that is one byte
    # range can be read alone and a cut one cannot.
    contiguous_shares: bool = False

    @abc.abstractmethod
    def stores(self, meta: ArrayMetadata) -> bool:
        """Whether `meta` (a manifest entry) is stored in this encoding. Exactly one
        encoding of `ENCODINGS` stores each array leaf."""

    # --- planning (pure) ------------------------------------------------------------------

    @abc.abstractmethod
    def plan(self, meta: ArrayMetadata, by_box: Mapping[Box, Sequence[int]], *, slab_bytes: int | None = None) -> LeafRestorePlan:
        """The reads of one leaf for one process's devices.

        Args:
          by_box: each unique target box → the (local) devices that hold it.
          slab_bytes: host-memory bound of one read; an encoding may plan larger boxes
            as slabs (`BoxRead.slabs`). None: no slabs.
        Guarantees: one `BoxRead` per unique box, in box order, whose reads assemble
        the box exactly; `bytes_read` counts every byte the reads fetch, each once.
        Raises:
          CorruptCheckpointError: the manifest does not locate a stored byte the boxes need.
        """

    @abc.abstractmethod
    def plan_share(
        self, meta: ArrayMetadata, mine: Sequence[tuple[int, Box]], holders: Mapping[Box, frozenset[int]],
        process_index: int, *, slab_bytes: int | None = None,
    ) -> LeafRestorePlan:
        """This process's share of a cooperative restore of one leaf.

        Args:
          mine: `(device id, exchange box)` of this process's devices.
          holders: every distinct exchange box of the leaf (all processes') → the
            processes whose devices hold it.
          process_index: this process.
        Guarantees: the reads assemble each of `mine`'s boxes; across processes every
        stored byte any box needs is read once in all where the encoding can split its
        checked units, and a unit split among processes is listed in `shared` (the same
        list on every process) so its checksum is checked after the exchange.
        `exchange_spec`, `receivers` and `received` are the caller's to fill in.
        """

    # --- before reading -------------------------------------------------------------------

    @abc.abstractmethod
    def files(self, meta: ArrayMetadata, boxes: Iterable[Box]) -> Iterator[tuple[str, int]]:
        """The files (key relative to the checkpoint path, expected size in bytes) that
        hold the bytes of `boxes`, each once, lazily (a hostile shape stops at the first).

        Raises:
          CorruptCheckpointError: the manifest does not locate a byte the boxes need.
        """

    @abc.abstractmethod
    def check_files(self, storage: Storage, path: str, leaves: Sequence[tuple[ArrayMetadata, Sequence[Box]]]) -> None:
        """Checks, before anything is planned or allocated, that the files holding these
        leaves' boxes exist with their expected sizes (local files only: a `stat` each;
        on object stores the reads check).

        Raises:
          CorruptCheckpointError: naming the leaves whose stored bytes are missing or
            cut off, the file, the size found against the size expected, and the fix.
        """

    # --- reading --------------------------------------------------------------------------

    @abc.abstractmethod
    def start_restore(self, storage: Storage, path: str, items: Sequence[Item], ctx: ReadContext) -> Callable[[], dict[str, object]]:
        """Starts reading these leaves as planned (on `ctx`'s pools, or at once) and
        returns the function that waits for them.

        Guarantees (of the returned function's result): leaf path → a `jax.Array` on
        the target's sharding (PRNG keys wrapped), a numpy array for a host target, or
        for a leaf with an exchange the raw global array of its exchange layout; every
        byte crc32c-checked, except pieces of `shared` chunks, whose crc32c are in
        `ctx.piece_crcs`; host memory within `ctx.budget`.
        Raises:
          CorruptCheckpointError: stored bytes are missing, cut off or fail a checksum.
        """

    # --- verify ---------------------------------------------------------------------------

    @abc.abstractmethod
    def chunk_count(self, meta: ArrayMetadata) -> int:
        """How many stored chunks `verify` checks for the leaf (its progress total)."""

    @abc.abstractmethod
    def verify(self, storage: Storage, path: str, metas: Sequence[ArrayMetadata], ctx: VerifyContext) -> None:
        """Reads every stored byte of these leaves and checks every checksum, the
        writers' records, and every copy of the encoding's own index; appends each
        problem to `ctx.problems` (never raises for damage) and counts what it checked."""

    # --- export ---------------------------------------------------------------------------

    @abc.abstractmethod
    def region_reader(self, storage: Storage, path: str, meta: ArrayMetadata) -> Callable[[Box], np.ndarray]:
        """Reads any region of the leaf, unplanned: `read(box)` returns its values in
        `box` (a fresh array), every byte checked.

        Raises (from `read`):
          CorruptCheckpointError: stored bytes are missing, cut off or fail a checksum.
        """

    def read_into(self, storage: Storage, path: str, meta: ArrayMetadata, boxes: Sequence[tuple[Box, np.ndarray]],
                  pool: concurrent.futures.Executor | None = None) -> None:
        """Reads regions of the leaf, unplanned, into the caller's buffers: each `(box,
        out)` with `out` C-contiguous, of the box's shape and the stored dtype; every byte
        checked. This default reads each box with `region_reader` and copies it; an
        encoding that can reads straight into `out` (one pass: read, check, place).

        Args:
          pool: worker threads for the reads of a box (never a pool one of whose workers
            calls this: they would wait on each other); None: this thread alone.
        Raises:
          CorruptCheckpointError: stored bytes are missing, cut off or fail a checksum.
        """
        read = self.region_reader(storage, path, meta)
        for box, out in boxes:
            if box.size:
                np.copyto(out, read(box))

    # --- two tiers ------------------------------------------------------------------------

    @abc.abstractmethod
    def replicated_files(self, record: ProcessRecord) -> list[str]:
        """The files of this encoding a process copies to the durable tier: those it
        wrote, from its own record (keys relative to the checkpoint path), each once."""

    # --- save -----------------------------------------------------------------------------

    @abc.abstractmethod
    def start_write(self, storage: Storage, root: str, leaves: Sequence[LeafWrite], ctx: WriteContext) -> Callable[[], WriteResult]:
        """Issues the writes of this process's chunks of these leaves into `root` (the
        save's write path), TensorStore's or the direct writer's (`ctx.direct`), and
        returns the function that waits for them.

        Guarantees (of the returned function's result): every chunk file durable, the
        same bytes either way; the chunk records in plan order; the pack's index where
        the encoding has one. Nothing it started still runs when it (or the returned
        function) raises.
        Raises:
          SaveError: naming the leaf, the path and the process.
        """
