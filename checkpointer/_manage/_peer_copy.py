"""The copy wire of peer copies: framing of the peers' messages, both sides of one copy
(the files of a committed step, their lengths and crc32c), the sockets' timeouts and the
priority of the threads that move the bytes (`_peers` runs the service; this module holds
no state but up to `_IDLE_BLOCKS` idle transfer buffers).

Every message is a 4-byte big-endian length and a JSON object (at most
`MAX_HEADER_BYTES`); file bytes travel raw between messages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import os
import shutil
import socket
import struct
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Sequence

import crc32c
import numpy as np

from .. import _format
from .._encoding import combine_crc32c
from .._errors import CheckpointError, CorruptCheckpointError
from .._memory import aligned_empty, host_buffer
from .._save import BACKGROUND_NICE
from .._storage import DIRECT_ALIGN, LocalStorage

CHUNK_BYTES = 4 << 20  # bytes of a file in memory at once, per transfer (a restore's fetch)
MAX_HEADER_BYTES = 64 << 20  # a header lists the files of one step
COPY_RECORD = "peer-copy.json"
_LEN = struct.Struct(">I")


def lower_thread_priority(nice: int = BACKGROUND_NICE) -> None:
    """Adds `nice` to the calling thread's nice value (Linux; elsewhere nothing): the
    priority rule of the direct writer's threads."""
    if sys.platform != "linux" or nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


def block_with_timeout(sock: socket.socket, timeout_s: float) -> None:
    """Puts `sock` in blocking mode with the kernel's send and receive timeouts
    (`SO_SNDTIMEO`/`SO_RCVTIMEO`, Linux) instead of Python's (elsewhere: `settimeout`).

    Python's timeout makes the socket non-blocking and polls before each system call, so a
    `recv_into(..., MSG_WAITALL)` returns whatever has arrived (a few skbs) and `sendall`
    polls between partial sends: per block, tens of calls and as many trips through the
    interpreter on a loaded machine. In blocking mode one call moves a whole block; the
    kernel's timeout still bounds each call (a stalled peer: OSError, EAGAIN)."""
    if sys.platform != "linux":
        sock.settimeout(timeout_s)
        return
    usec = max(1, round(timeout_s * 1e6))  # 0 would mean no timeout
    tv = struct.pack("@ll", usec // 1_000_000, usec % 1_000_000)  # struct timeval
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


@contextlib.contextmanager
def timeouts_named():
    """A kernel timeout (`block_with_timeout`: EAGAIN on a blocking socket) as TimeoutError."""
    try:
        yield
    except BlockingIOError as e:
        raise TimeoutError(errno.ETIMEDOUT, "the peer moved no bytes within the timeout") from e


def send_json(sock: socket.socket, obj: object) -> None:
    """Sends one message: its length (4 bytes, big-endian) and `obj` as JSON."""
    data = json.dumps(obj).encode()
    with timeouts_named():
        sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """The next `n` bytes, or ConnectionError when the peer closes first."""
    buf = bytearray()
    with timeouts_named():
        while len(buf) < n:
            part = sock.recv(min(n - len(buf), CHUNK_BYTES))
            if not part:
                raise ConnectionError(f"the peer closed the connection after {len(buf)} of {n} bytes")
            buf += part
    return bytes(buf)


def recv_json(sock: socket.socket) -> dict:
    """The next message (`send_json`); ConnectionError when it is too long or no object."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_HEADER_BYTES:
        raise ConnectionError(f"a peer message of {n} bytes (at most {MAX_HEADER_BYTES})")
    obj = _format.load_json(recv_exact(sock, n), what="a peer message", max_bytes=MAX_HEADER_BYTES)
    if not isinstance(obj, dict):
        raise ConnectionError("a peer message is not a JSON object")
    return obj


def stream_files(sock: socket.socket, folder: str, files: Sequence[dict]) -> None:
    """Sends each file's first `size` bytes (the kernel copies them: `sendfile`)."""
    for f in files:
        size = int(f["size"])
        with open(f"{folder}/{f['key']}", "rb") as src:
            sent = sock.sendfile(src, 0, size) if size else 0
            if sent != size:
                raise ConnectionError(f"{folder}/{f['key']} is shorter than {size} bytes")


def step_files(folder: str) -> list[dict]:
    """Every file of a committed step folder with its length (`{"key", "size"}`), the
    marker last. Reads no file: the sender takes each crc32c in the pass that sends it."""
    out: list[dict] = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, folder).replace(os.sep, "/")
            if key in (_format.COMMITTED, COPY_RECORD):
                continue
            out.append({"key": key, "size": os.stat(path).st_size})
    out.sort(key=lambda f: str(f["key"]))
    return [*out, {"key": _format.COMMITTED, "size": os.stat(f"{folder}/{_format.COMMITTED}").st_size}]


# --- one copy: the owner's sending and the holder's receiving ------------------------------
#
# After the put's header, each file travels as its `size` bytes and then the crc32c the
# owner claims for them (`_CRC`, 4 bytes); the holder takes the crc32c of the bytes as they
# arrive and refuses a file whose length or crc32c differ. The owner's claim: for a chunk
# file (a zarr shard file, a pack), the crc32c it has when intact, from its layout alone
# (`intact_crc32c`; its own index checked as it passes); for any other file, the crc32c of
# the bytes it read, in the pass that sends them. Both sides move the bytes through one
# `BLOCK_BYTES` buffer (huge pages where the kernel gives them), aligned for `O_DIRECT`:
# the sender reads its committed files past the page cache (they were written past it),
# the holder writes its copy past it (over its spare's files) and fdatasyncs each file. Per byte, the CPU is
# one copy into the socket, one out of it and the holder's crc32c pass
# (docs/DESIGN-decisions.md, "Peer copies: the copy's CPU").

BLOCK_BYTES = 4 << 20  # each transfer's one buffer, a multiple of DIRECT_ALIGN
_CRC = struct.Struct(">I")
# crc32c of any bytes followed by their own crc32c (u32, little-endian): a constant.
_RESIDUE = 0x48674BC7


_IDLE_BLOCKS = 2  # transfer buffers kept for the next transfers (8 MiB), beyond them freed
_idle: list[memoryview] = []
_idle_mu = threading.Lock()


@contextlib.contextmanager
def _block() -> Iterator[memoryview]:
    """The one buffer of a transfer, `BLOCK_BYTES`: a buffer an earlier transfer used (in
    this VM, fresh memory costs a page fault and a zeroed page, 4.7 ms per 4 MiB here),
    or a new one on 2 MiB huge pages where the kernel gives them (a direct read or write
    pins one page per 2 MiB instead of per 4 KiB), else 4 KiB."""
    with _idle_mu:
        view = _idle.pop() if _idle else None
    if view is None:
        buf = host_buffer((BLOCK_BYTES,), np.dtype(np.uint8))
        if buf.ctypes.data % DIRECT_ALIGN:
            buf = aligned_empty((BLOCK_BYTES,), np.dtype(np.uint8), DIRECT_ALIGN)
        view = memoryview(buf.data).cast("B")  # keeps `buf` alive
    try:
        yield view
    finally:
        with _idle_mu:
            if len(_idle) < _IDLE_BLOCKS:
                _idle.append(view)


# --- what an intact chunk file's crc32c is ------------------------------------------------
#
# A zarr shard file of this format is its inner chunks, each its bytes then their crc32c
# (u32 LE), then the index and its crc32c: segments that each end in their own crc32c.
# The crc32c of such a segment is `_RESIDUE` whatever its bytes, so the file's crc32c
# follows from the segments' lengths (`combine_crc32c`), without reading a byte; a pack
# (`packed/process-<i>/c/0`: its bytes then their crc32c) is one segment. A file whose
# bytes were damaged anywhere has another crc32c (with the usual 2^-32 chance of a miss),
# so the holder's check catches damage on the way and on the owner's disk alike.


@dataclasses.dataclass(frozen=True)
class _Intact:
    """What the owner claims for one chunk file: its crc32c when intact; for a shard
    file also its index, which the sender checks as it passes (`index_ok`)."""

    crc: int
    segment: int = 0  # bytes of each inner chunk with its crc32c (shard files)
    inner: int = 0  # inner chunks (shard files; 0: a pack, no index)

    @property
    def index_bytes(self) -> int:
        return 16 * self.inner + 4 if self.inner else 0

    def index_ok(self, tail: memoryview) -> bool:
        """Whether `tail` (the file's last `index_bytes`) is the index this format's
        writers write: the inner chunks back to back in C order, then its crc32c."""
        return tail == _expected_index(self.segment, self.inner)


@functools.lru_cache(maxsize=256)
def _expected_index(segment: int, inner: int) -> bytes:
    """The index and its crc32c of a shard file of `inner` inner chunks of `segment`
    bytes each (with their crc32c), stored back to back in C order."""
    entries = np.empty((inner, 2), "<u8")
    entries[:, 0] = np.arange(inner, dtype=np.uint64) * segment
    entries[:, 1] = segment
    index = entries.tobytes()
    return index + crc32c.crc32c(index).to_bytes(4, "little")


@functools.lru_cache(maxsize=256)
def _segments_crc(segment: int, count: int, tail: int) -> int:
    """crc32c of `count` segments of `segment` bytes, then one of `tail` bytes (0: none),
    each ending in the crc32c of its other bytes (doubling: O(log count) combines)."""
    out, run, run_bytes = 0, _RESIDUE, segment  # `run`: crc32c of 2^k segments
    while count:
        if count & 1:
            out = combine_crc32c(out, run, run_bytes)
        run, run_bytes, count = combine_crc32c(run, run, run_bytes), 2 * run_bytes, count >> 1
    return combine_crc32c(out, _RESIDUE, tail) if tail else out


def intact_crc32c(folder: str, files: Sequence[dict]) -> dict[str, _Intact]:
    """The chunk files of the committed step `folder` whose crc32c when intact follows
    from the step's manifest (their size the layout's): zarr shard files of arrays (not
    packed) and this step's packs. Others (JSON files, a file of another size, a step
    whose manifest does not parse) are absent: the sender reads them for their crc32c."""
    try:
        meta = _format.read_metadata(LocalStorage(), folder, check_references=False)
    except (CheckpointError, OSError, ValueError):
        return {}
    shards: dict[str, _format.ShardFileLayout] = {}
    packs: dict[str, int] = {}
    for leaf in meta.leaves.values():
        if isinstance(leaf, _format.ArrayMetadata):
            if not leaf.packed:
                shards[f"{_format.array_dir(leaf.path)}/c"] = leaf.layout
            for box in leaf.pack_boxes:
                if box.folder is None:
                    packs[box.key] = box.file_bytes
    out: dict[str, _Intact] = {}
    for f in files:
        key, size = str(f["key"]), int(f["size"])
        if key in packs:
            if size == packs[key]:
                out[key] = _Intact(_RESIDUE)
            continue
        head, _, cell = key.rpartition("/c/")
        layout = shards.get(f"{head}/c") if cell.replace("/", "").isdigit() else shards.get(key)
        if layout is not None and size == layout.file_bytes and layout.inner_chunks:
            segment = layout.inner_bytes_with_crc
            out[key] = _Intact(_segments_crc(segment, layout.inner_chunks, layout.index_bytes), segment,
                               layout.inner_chunks)
    return out


def _open_for_reading(path: str) -> tuple[int, bool]:
    """A descriptor of `path` and whether it reads past the page cache (`O_DIRECT`,
    where the file system takes it)."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag | os.O_CLOEXEC), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC), False


def _read_block(fd: int, direct: bool, path: str, view: memoryview, offset: int) -> tuple[int, int, bool]:
    """Reads up to a block at `offset` (a multiple of `BLOCK_BYTES`); falls back to the
    page cache where the file system refuses a direct read. Returns (bytes, fd, direct)."""
    try:
        return os.preadv(fd, [view], offset), fd, direct
    except OSError as e:
        if not direct or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    return os.preadv(fd, [view], offset), fd, False


def send_copy(sock: socket.socket, folder: str, files: Sequence[dict],
              damage: Callable[[str, memoryview], None] | None = None) -> None:
    """Streams the first `size` bytes of each of `files` (`step_files`) of `folder`, each
    followed by the owner's crc32c of them: a chunk file's crc32c when intact
    (`intact_crc32c`, its index checked as it passes), else the crc32c of the bytes read,
    taken in the pass that sends them.

    Args:
      damage: tests only: called with (key, block) after the block is read (and its
        crc32c taken) and before it is sent (a copy damaged on the way).
    Raises:
      OSError: a file is shorter than its `size`, or the socket failed.
    """
    with timeouts_named(), _block() as view:
        _send_files(sock, folder, files, damage, view)


def _send_files(sock: socket.socket, folder: str, files: Sequence[dict],
                damage: Callable[[str, memoryview], None] | None, view: memoryview) -> None:
    intact = intact_crc32c(folder, files)
    for f in files:
        key, size = str(f["key"]), int(f["size"])
        path = f"{folder}/{key}"
        claim = intact.get(key)
        index_room = -(-claim.index_bytes // DIRECT_ALIGN) * DIRECT_ALIGN if claim is not None else 0
        if index_room * 2 > BLOCK_BYTES:
            claim = None  # an index too large to keep whole in the last block: read for the crc32c
        fd, direct = _open_for_reading(path)
        try:
            offset, crc = 0, 0
            while offset < size:
                # Only the blocks that hold the file: a direct read past the end fills the
                # rest of the buffer with zeros (iomap), a copy for nothing. A shard file's
                # index arrives whole in its last block.
                left = size - offset
                want = min(BLOCK_BYTES, -(-left // DIRECT_ALIGN) * DIRECT_ALIGN)
                if claim is not None and 0 < left - want < claim.index_bytes:
                    want -= index_room
                n, fd, direct = _read_block(fd, direct, path, view[:want], offset)
                n = min(n, left)
                if n <= 0:
                    raise OSError(errno.EIO, f"{path} is shorter than {size} bytes ({offset})")
                if claim is None:
                    crc = crc32c.crc32c(view[:n], crc)
                elif offset + n == size and claim.inner and (
                        n < claim.index_bytes or not claim.index_ok(view[n - claim.index_bytes:n])):
                    claim = _UNCLAIMED  # not the layout the manifest says: read it again for the crc32c
                if damage is not None:
                    damage(key, view[:n])
                sock.sendall(view[:n])
                offset += n
            if claim is _UNCLAIMED:
                crc, fd, direct = _file_crc32c(fd, direct, path, view, size)
            elif claim is not None:
                crc = claim.crc
        finally:
            os.close(fd)
        sock.sendall(_CRC.pack(crc))


_UNCLAIMED = _Intact(0)


def _file_crc32c(fd: int, direct: bool, path: str, view: memoryview, size: int) -> tuple[int, int, bool]:
    """crc32c of the first `size` bytes of the file open at `fd`, read again through
    `view`. Returns (crc32c, fd, direct)."""
    offset, crc = 0, 0
    while offset < size:
        want = min(len(view), -(-(size - offset) // DIRECT_ALIGN) * DIRECT_ALIGN)
        n, fd, direct = _read_block(fd, direct, path, view[:want], offset)
        n = min(n, size - offset)
        if n <= 0:
            raise OSError(errno.EIO, f"{path} is shorter than {size} bytes ({offset})")
        crc = crc32c.crc32c(view[:n], crc)
        offset += n
    return crc, fd, direct


# --- the spare: a dropped copy's folder and files, written over by the next copy ---------
#
# A holder that drops a copy keeps its folder as the owner's spare (one per owner), with
# its files: the next copy renames it to its partial folder and writes each file over the
# one of the same key, so it makes no folder, allocates no inode or block (same sizes)
# and unlinks nothing. On this VM's ext4 (no journal) each new inode scans past the
# recently deleted ones: creating, mkdir and unlinking were a third of the holder's CPU
# (docs/DESIGN-decisions.md, "Peer copies: the copy's CPU, third pass").

SPARE = "peer-copy-spare"  # in a peer-copies/process-<i>/ folder: no step name, never listed


def keep_spare(root: str, folder: str) -> bool:
    """Turns the dropped copy `folder` (a step folder in `root`) into `root`'s spare: one
    rename, which unpublishes it at once. False (nothing done) when `root` has a spare
    already: the caller deletes `folder`."""
    spare = f"{root}/{SPARE}"
    if os.path.lexists(spare):
        return False
    os.rename(folder, spare)
    return True


def take_spare(root: str, partial: str, served: Collection[int] = ()) -> dict[str, int] | None:
    """Renames `root`'s spare to `partial` (a copy's fresh partial folder), without its
    commit marker and record; returns its files (key -> size, from its record) for
    `receive_copy`'s `spare`. None when there is no spare (or it has no readable record:
    then it is deleted), or the spare is of a step in `served` (a get may be sending its
    files: left as it is), and `partial` does not exist."""
    spare = f"{root}/{SPARE}"
    try:
        with open(f"{spare}/{COPY_RECORD}", "rb") as f:  # bounded: never a RecursionError or MemoryError
            record = _format.load_json(f.read(_format.MAX_JSON_BYTES + 1), what=f"{spare}/{COPY_RECORD}")
        old = {str(x["key"]): int(x["size"]) for x in record["files"]}
        if record.get("step") in served:
            return None
    except FileNotFoundError:
        if os.path.lexists(spare):
            shutil.rmtree(spare, ignore_errors=True)
        return None
    except (OSError, ValueError, TypeError, KeyError, CheckpointError):
        shutil.rmtree(spare, ignore_errors=True)
        return None
    # No marker in a partial folder: a committed partial folder counts as committed.
    # FileNotFoundError: another put took the spare meanwhile (this one starts afresh).
    for name in (_format.COMMITTED, COPY_RECORD):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{spare}/{name}")
    try:
        os.rename(spare, partial)
    except FileNotFoundError:
        return None
    return old


def _drop_others(folder: str, paths: set[str], old: dict[str, int]) -> None:
    """Unlinks the spare's files that the copy does not have, then their emptied folders."""
    emptied: set[str] = set()
    for path in set(old) - paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        parent = os.path.dirname(path)
        while len(parent) > len(folder):
            emptied.add(parent)
            parent = os.path.dirname(parent)
    for parent in sorted(emptied, key=len, reverse=True):
        with contextlib.suppress(OSError):  # not empty: the copy has files there
            os.rmdir(parent)


_WRITE = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC  # no O_TRUNC: a spare's file is written over
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _CopyFile:
    """One received file, one descriptor: `O_DIRECT` for its whole aligned blocks, then
    its unaligned tail (the last `size % DIRECT_ALIGN` bytes) through the page cache
    (`O_DIRECT` cleared on the same descriptor), so the file ends at its size without a
    truncation (ext4 reads a padded block back from disk to truncate it); or all through
    the page cache where the holder's file system refuses `O_DIRECT` (EINVAL/EOPNOTSUPP,
    at open or at the first write). `finish` fdatasyncs the file (its data, the tail's
    page and its size, not its times) and closes it.

    A spare's file (`old` bytes long, -1: not known) is written over in place; where it
    is longer than the copy's, first cut to the copy's whole blocks (at a block boundary:
    ext4 reads nothing back). Of the same size (a step of the same layout), the file keeps
    its size and blocks, so the `fdatasync` writes no inode."""

    def __init__(self, path: str, direct: bool, size: int, old: int = 0) -> None:
        self.path, self.direct = path, direct and _O_DIRECT != 0
        self.refused = False  # the file system refused O_DIRECT (at open or first write)
        self._fd = -1
        if self.direct:
            try:
                self._fd = os.open(path, _WRITE | _O_DIRECT, 0o644)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self.direct, self.refused = False, True
        if self._fd < 0:
            self._fd = os.open(path, _WRITE, 0o644)
        aligned = size - size % DIRECT_ALIGN
        if old < 0:
            old = os.fstat(self._fd).st_size  # a file the spare's record did not list
        if old > size:
            os.ftruncate(self._fd, aligned)

    def write_at(self, offset: int, view: memoryview, n: int) -> None:
        """Writes `view[:n]` at `offset` (a multiple of `DIRECT_ALIGN`; `n` too, but for a
        file's last block; `view` aligned for `O_DIRECT`)."""
        if self.direct:
            aligned = n - n % DIRECT_ALIGN
            try:
                done = 0
                while done < aligned:  # a direct write may take fewer bytes, a multiple of the block size
                    done += os.pwrite(self._fd, view[done:aligned], offset + done)
            except OSError as e:  # a file system that refuses direct writes only when written
                if offset or done or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                os.close(self._fd)
                self._fd, self.direct, self.refused = -1, False, True
                self._fd = os.open(self.path, _WRITE, 0o644)
            else:
                if aligned == n:
                    return
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
                self.direct = False  # the tail, through the page cache
                view, offset, n = view[aligned:], offset + aligned, n - aligned
        done = 0
        while done < n:
            done += os.pwrite(self._fd, view[done:n], offset + done)

    def finish(self) -> None:
        fd, self._fd = self._fd, -1
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def receive_copy(sock: socket.socket, folder: str, files: Sequence[dict], received_path: Callable[[str, str], str],
                 spare: dict[str, int] | None = None) -> list[dict]:
    """Writes the files `send_copy` streams into `folder` (at `received_path(folder, key)`),
    each fsynced, its crc32c taken over the bytes as they arrive: a file counts only when
    its length and crc32c are the sender's. Memory: one `BLOCK_BYTES` buffer.

    Args:
      spare: `folder` is a spare (`take_spare`): its files (key -> size), written over
        where the copy has the same key, unlinked first where it has not.

    Returns:
      The files with their checked crc32c (`{"key", "size", "crc32c"}`), for the copy's record.
    Raises:
      CorruptCheckpointError: a file's crc32c is not the sender's (names the file).
      ConnectionError: the sender closed the connection early, or sent a name outside `folder`.
      OSError: the holder's file system (ENOSPC on a full memory tier).
    """
    for f in files:
        key, size = str(f["key"]), int(f["size"])
        if key.startswith("/") or ".." in key.split("/") or size < 0:
            raise ConnectionError(f"a peer sent the file {key!r} of {size} bytes")
    old = {received_path(folder, key): size for key, size in (spare or {}).items()}
    paths = {received_path(folder, str(f["key"])) for f in files}
    if old:
        _drop_others(folder, paths, old)
    # Every folder once, parents first: one mkdir each (`makedirs` tries the deepest first);
    # none where the spare kept a file (nor above it: a mkdir that finds one costs little).
    folders: set[str] = set()
    have = {os.path.dirname(p) for p in old if p in paths}
    for path in paths:
        parent = os.path.dirname(path)
        while len(parent) > len(folder) and parent not in folders and parent not in have:
            folders.add(parent)
            parent = os.path.dirname(parent)
    for parent in sorted(folders, key=len):
        try:
            os.mkdir(parent)
        except FileExistsError:
            pass
        except FileNotFoundError:
            os.makedirs(parent, exist_ok=True)
    trailer = memoryview(bytearray(_CRC.size))
    direct = True
    out = []
    with timeouts_named(), _block() as view:
        for f in files:
            key, size = str(f["key"]), int(f["size"])
            path = received_path(folder, key)
            copy = _CopyFile(path, direct, size, old.get(path, -1) if spare is not None else 0)
            try:
                offset, crc = 0, 0
                while offset < size:
                    want, got = min(BLOCK_BYTES, size - offset), 0
                    while got < want:  # a full block, so every direct write is aligned
                        n = sock.recv_into(view[got:want], want - got, socket.MSG_WAITALL)
                        if not n:
                            raise ConnectionError(f"the peer closed the connection in {key} ({offset + got} of {size} bytes)")
                        got += n
                    crc = crc32c.crc32c(view[:want], crc)
                    copy.write_at(offset, view, want)
                    offset += want
                copy.finish()
            finally:
                copy.close()
            direct = direct and not copy.refused  # a refusal holds for the rest of the folder
            got = 0
            while got < _CRC.size:  # the owner's crc32c of the file
                n = sock.recv_into(trailer[got:], _CRC.size - got, socket.MSG_WAITALL)
                if not n:
                    raise ConnectionError(f"the peer closed the connection before the crc32c of {key}")
                got += n
            (expected,) = _CRC.unpack(trailer)
            if crc != expected:
                raise CorruptCheckpointError(
                    f"the copy {path} has crc32c {crc:#010x}, expected {expected:#010x} ({size} bytes): the bytes were "
                    "damaged on the way, or on the owner's disk")
            out.append({"key": key, "size": size, "crc32c": crc})
    return out
