"""The copy wire of peer copies: framing of the peers' messages, the sender's side of a
copy (the files of a committed step, their lengths and crc32c), and the priority of the
threads that move the bytes (`_peers` runs the service; this module holds no state).

Every message is a 4-byte big-endian length and a JSON object (at most
`MAX_HEADER_BYTES`); file bytes travel raw between messages.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading

import crc32c

from .. import _format
from .._save import BACKGROUND_NICE

CHUNK_BYTES = 4 << 20  # bytes of a file in memory at once, per transfer
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


def send_json(sock: socket.socket, obj: object) -> None:
    """Sends one message: its length (4 bytes, big-endian) and `obj` as JSON."""
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """The next `n` bytes, or ConnectionError when the peer closes first."""
    buf = bytearray()
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



def _file_crc(path: str) -> tuple[int, int]:
    """(length, crc32c) of a file, read in `CHUNK_BYTES` pieces."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            crc = crc32c.crc32c(chunk, crc)
            size += len(chunk)
    return size, crc


def step_files(folder: str) -> list[dict]:
    """Every file of a committed step folder with its length and crc32c, the marker last."""
    out: list[dict] = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, folder).replace(os.sep, "/")
            if key in (_format.COMMITTED, COPY_RECORD):
                continue
            size, crc = _file_crc(path)
            out.append({"key": key, "size": size, "crc32c": crc})
    out.sort(key=lambda f: str(f["key"]))
    size, crc = _file_crc(f"{folder}/{_format.COMMITTED}")
    return [*out, {"key": _format.COMMITTED, "size": size, "crc32c": crc}]
