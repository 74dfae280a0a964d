"""The copy wire of peer copies: framing of the peers' messages, the sender's side of a
copy (the files of a committed step, their lengths and crc32c), and the priority of the
threads that move the bytes (`_peers` runs the service; this module holds no state).

Every message is a 4-byte big-endian length and a JSON object (at most
`MAX_HEADER_BYTES`); file bytes travel raw between messages.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence

import crc32c
import numpy as np

from .. import _format
from .._errors import CorruptCheckpointError
from .._memory import aligned_empty
from .._save import BACKGROUND_NICE
from .._storage import DIRECT_ALIGN, DirectFile

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
# After the put's header, each file travels as its `size` bytes and then the crc32c of those
# bytes as the sender read them (`_CRC`, 4 bytes): the sender takes it in the pass that
# sends, the holder in the pass that receives; the holder refuses a file whose length or
# crc32c differ. Both sides move the bytes through one `BLOCK_BYTES` buffer, aligned for
# `O_DIRECT`: the sender reads its committed files past the page cache (they were written
# past it), the holder writes its copy past it and fsyncs each file. Per byte, the CPU of
# the copy is one copy into the socket, one out of it and two crc32c passes
# (docs/DESIGN-decisions.md, "Peer copies: the copy's CPU").

BLOCK_BYTES = 4 << 20  # each transfer's one buffer, a multiple of DIRECT_ALIGN
_CRC = struct.Struct(">I")


def _block() -> tuple[np.ndarray, memoryview]:
    buf = aligned_empty((BLOCK_BYTES,), np.dtype(np.uint8), DIRECT_ALIGN)
    return buf, memoryview(buf.data).cast("B")


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
    followed by the crc32c of the bytes read (one pass: read, crc32c, send).

    Args:
      damage: tests only: called with (key, block) after the crc32c of each block is
        taken and before it is sent (a copy damaged on the way).
    Raises:
      OSError: a file is shorter than its `size`, or the socket failed.
    """
    _, view = _block()
    for f in files:
        key, size = str(f["key"]), int(f["size"])
        path = f"{folder}/{key}"
        fd, direct = _open_for_reading(path)
        try:
            offset, crc = 0, 0
            while offset < size:
                # Only the blocks that hold the file: a direct read past the end fills the
                # rest of the buffer with zeros (iomap), a copy for nothing.
                want = min(BLOCK_BYTES, -(-(size - offset) // DIRECT_ALIGN) * DIRECT_ALIGN)
                n, fd, direct = _read_block(fd, direct, path, view[:want], offset)
                n = min(n, size - offset)
                if n <= 0:
                    raise OSError(errno.EIO, f"{path} is shorter than {size} bytes ({offset})")
                crc = crc32c.crc32c(view[:n], crc)
                if damage is not None:
                    damage(key, view[:n])
                with timeouts_named():
                    sock.sendall(view[:n])
                offset += n
        finally:
            os.close(fd)
        with timeouts_named():
            sock.sendall(_CRC.pack(crc))


class _CopyFile:
    """One received file: `O_DIRECT` for its whole aligned blocks, its unaligned tail (the
    last `size % DIRECT_ALIGN` bytes) through the page cache, so the file ends at its size
    without a truncation (ext4 reads the padded block back from disk to truncate it);
    or all through the page cache where the holder's file system refuses `O_DIRECT`.
    `finish` fsyncs the file (its data, the tail's page and its size) and closes it."""

    def __init__(self, path: str, direct: bool) -> None:
        self.path, self.direct = path, direct
        self._direct: DirectFile | None = None
        self._fd: int | None = None  # buffered: the whole file, or the tail of a direct one
        if direct:
            try:
                self._direct = DirectFile(path)
                return
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self.direct = False
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def write_at(self, offset: int, buf: np.ndarray, n: int) -> None:
        """Writes `buf[:n]` at `offset` (a multiple of `DIRECT_ALIGN`; `n` too, but for a
        file's last block)."""
        if self._direct is not None:
            aligned = n - n % DIRECT_ALIGN
            try:
                if aligned:
                    self._direct.write_at(offset, buf[:aligned])
            except OSError as e:  # a file system that refuses direct writes only when written
                if offset or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self._direct.close()
                self._direct, self.direct = None, False
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            else:
                if aligned == n:
                    return
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)  # the tail, buffered
                offset, buf, n = offset + aligned, buf[aligned:], n - aligned
        assert self._fd is not None
        view, done = memoryview(buf.data).cast("B")[:n], 0
        while done < n:
            done += os.pwrite(self._fd, view[done:], offset + done)

    def finish(self, size: int) -> None:
        if self._direct is not None:  # its fsync covers the tail's page too (one inode)
            self._direct.finish(size)
            self.close()
            return
        fd, self._fd = self._fd, None
        assert fd is not None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def receive_copy(sock: socket.socket, folder: str, files: Sequence[dict], received_path: Callable[[str, str], str]) -> list[dict]:
    """Writes the files `send_copy` streams into `folder` (at `received_path(folder, key)`),
    each fsynced, its crc32c taken over the bytes as they arrive: a file counts only when
    its length and crc32c are the sender's. Memory: one `BLOCK_BYTES` buffer.

    Returns:
      The files with their checked crc32c (`{"key", "size", "crc32c"}`), for the copy's record.
    Raises:
      CorruptCheckpointError: a file's crc32c is not the sender's (names the file).
      ConnectionError: the sender closed the connection early, or sent a name outside `folder`.
      OSError: the holder's file system (ENOSPC on a full memory tier).
    """
    buf, view = _block()
    direct = True
    out = []
    made: set[str] = set()  # the folders created so far (one system call per folder, not per file)
    for f in files:
        key, size = str(f["key"]), int(f["size"])
        if key.startswith("/") or ".." in key.split("/") or size < 0:
            raise ConnectionError(f"a peer sent the file {key!r} of {size} bytes")
        path = received_path(folder, key)
        if (parent := os.path.dirname(path)) not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        copy = _CopyFile(path, direct)
        direct = copy.direct  # a refusal holds for the rest of the folder
        try:
            offset, crc = 0, 0
            while offset < size:
                want, got = min(BLOCK_BYTES, size - offset), 0
                with timeouts_named():
                    while got < want:  # a full block, so every direct write is aligned
                        n = sock.recv_into(view[got:want], want - got, socket.MSG_WAITALL)
                        if not n:
                            raise ConnectionError(f"the peer closed the connection in {key} ({offset + got} of {size} bytes)")
                        got += n
                crc = crc32c.crc32c(view[:want], crc)
                copy.write_at(offset, buf, want)
                offset += want
            copy.finish(size)
        finally:
            copy.close()
        (expected,) = _CRC.unpack(recv_exact(sock, _CRC.size))
        if crc != expected:
            raise CorruptCheckpointError(
                f"the copy {path} has crc32c {crc:#010x}, expected {expected:#010x} ({size} bytes): the bytes were "
                "damaged on the way")
        out.append({"key": key, "size": size, "crc32c": crc})
    return out
