"""The CPU of the peer copies' wire alone: one process's share of a local step copied
over loopback TCP again and again (`_manage/_peer_copy.send_copy` on one thread,
`receive_copy` on another, both at the copy threads' priority), each side's thread CPU
per GiB copied. No training, no manager, no coordination service: far less noise than
`peers_bench.py --only-cost`, whose copy threads run beside a training loop.

The share: a committed checkpoint of `--leaves` float32 leaves of 8 MiB each (the
peers_bench share at 1 GiB: 32 zarr shard files of 8 MiB + 68 bytes, 16 inner chunks
each), saved once with the library under `--dir`. The holder writes each copy into a
fresh folder, commits it (`_peers._commit_folder`: its record, the renames) and drops
the one before, as a holder drops the copy a newer one replaces: where the checkout has
spares (`_peer_copy.keep_spare`), the dropped copy becomes the spare that the next copy
writes over (`take_spare`), else it is deleted.

With `--baseline <checkout>`, that checkout's `_peer_copy` copies the same share in its
own process, alternating with this one's, `--rounds` times each.

With `--floor`, a third worker alternates with them: the same number of bytes through
a loopback TCP connection and nothing else (`sendall` of one 4 MiB buffer on one thread,
`recv_into` one 4 MiB buffer with `MSG_WAITALL` on another, blocking sockets, the same
thread priority; no file, no crc32c). It is the floor of any copy that crosses a socket
on this machine: the kernel's copy into the socket and its copy out of it. Loopback puts
both sides on one machine, as the benchmark's simulated nodes are; between two machines
each side pays its half.

Run:  .venv/bin/python benchmarks/peer_copy_cpu.py [--leaves 32] [--copies 4] [--rounds 3]
      [--baseline /work/main] [--floor] [--dir /tmp]
Prints one line per round and library, then the means; writes nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def make_share(folder: str, leaves: int) -> None:
    import numpy as np

    import checkpointer as ckpt

    rng = np.random.default_rng(0)
    ckpt.save(folder, {f"w{i:02d}": rng.standard_normal((2048, 1024), dtype=np.float32) for i in range(leaves)})


def _both(server: socket.socket, holder, owner, total: int, cpu: dict) -> dict:
    """Runs the holder's and the owner's side on two threads, then closes `server`; the
    bytes and each side's thread CPU (`cpu`, filled by the two sides) once both are done."""
    threads = [threading.Thread(target=holder), threading.Thread(target=owner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.close()
    return {"bytes": total, **cpu}


def copy_cpu(share: str, scratch: str, copies: int) -> dict:
    """Copies `share` `copies` times; thread CPU seconds of each side and the bytes."""
    from checkpointer._manage import _peer_copy
    from checkpointer._manage._peers import _commit_folder, _received_path, step_files

    files = step_files(share)
    total = sum(int(f["size"]) for f in files) * copies
    server = socket.create_server(("127.0.0.1", 0))
    cpu = {"send": 0.0, "receive": 0.0}
    timeout = getattr(_peer_copy, "block_with_timeout", None)

    def wire(sock):
        if timeout is not None:
            timeout(sock, 60)
        else:
            sock.settimeout(60)

    def holder():
        _peer_copy.lower_thread_priority()
        for i in range(copies):
            conn, _ = server.accept()
            wire(conn)
            t = time.thread_time()
            partial, spare = f"{scratch}/{i}.partial", None
            if i and not (hasattr(_peer_copy, "keep_spare") and _peer_copy.keep_spare(scratch, f"{scratch}/{i - 1}")):
                shutil.rmtree(f"{scratch}/{i - 1}")
            if hasattr(_peer_copy, "take_spare"):
                spare = _peer_copy.take_spare(scratch, partial)
            if spare is None:
                os.makedirs(partial)
            got = _peer_copy.receive_copy(conn, partial, files, _received_path, *([spare] if spare else []))
            _commit_folder(partial, f"{scratch}/{i}", {"files": got})
            conn.sendall(b"k")
            cpu["receive"] += time.thread_time() - t
            conn.close()

    def owner():
        _peer_copy.lower_thread_priority()
        for _ in range(copies):
            sock = socket.create_connection(server.getsockname(), timeout=60)
            wire(sock)
            t = time.thread_time()
            _peer_copy.send_copy(sock, share, files)
            sock.recv(1)
            cpu["send"] += time.thread_time() - t
            sock.close()

    return _both(server, holder, owner, total, cpu)


def wire_floor(total: int) -> dict:
    """`total` bytes over loopback TCP, 4 MiB per call, nothing else; thread CPU seconds
    of each side (the floor `--floor` reports)."""
    import numpy as np

    from checkpointer._manage import _peer_copy

    block = 4 << 20
    server = socket.create_server(("127.0.0.1", 0))
    cpu = {"send": 0.0, "receive": 0.0}

    def holder():
        _peer_copy.lower_thread_priority()
        conn, _ = server.accept()
        _peer_copy.block_with_timeout(conn, 60)
        view = memoryview(np.zeros(block, np.uint8)).cast("B")
        t, got = time.thread_time(), 0
        while got < total:
            n = conn.recv_into(view, min(block, total - got), socket.MSG_WAITALL)
            if n <= 0:
                raise ConnectionError(f"closed after {got} of {total} bytes")
            got += n
        conn.sendall(b"k")
        cpu["receive"] = time.thread_time() - t
        conn.close()

    def owner():
        _peer_copy.lower_thread_priority()
        sock = socket.create_connection(server.getsockname(), timeout=60)
        _peer_copy.block_with_timeout(sock, 60)
        view = memoryview(np.ones(block, np.uint8)).cast("B")
        t, sent = time.thread_time(), 0
        while sent < total:
            n = min(block, total - sent)
            sock.sendall(view[:n])
            sent += n
        sock.recv(1)
        cpu["send"] = time.thread_time() - t
        sock.close()

    return _both(server, holder, owner, total, cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leaves", type=int, default=32, help="leaves of 8 MiB in the share (default 32: 0.25 GiB)")
    ap.add_argument("--copies", type=int, default=4, help="copies per round (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per library (default 3)")
    ap.add_argument("--baseline", default=None, help="another checkout, e.g. /work/main, alternating with this one")
    ap.add_argument("--floor", action="store_true", help="also the loopback TCP floor (sendall + recv_into alone), alternating")
    ap.add_argument("--dir", default=None, help="parent of the temporary folders (default: the system temp dir)")
    ap.add_argument("--worker", nargs=3, metavar=("SHARE", "SCRATCH", "COPIES"), help=argparse.SUPPRESS)
    ap.add_argument("--floor-worker", nargs=2, metavar=("SHARE", "COPIES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        share, scratch, copies = args.worker
        print(json.dumps(copy_cpu(share, scratch, int(copies))))
        return
    if args.floor_worker:
        from checkpointer._manage._peers import step_files

        share, copies = args.floor_worker
        print(json.dumps(wire_floor(sum(int(f["size"]) for f in step_files(share)) * int(copies))))
        return
    libs = {"this checkout": str(HERE)} | ({f"baseline {args.baseline}": args.baseline} if args.baseline else {})
    if args.floor:
        libs["loopback TCP floor"] = str(HERE)
    per: dict[str, list[tuple[float, float]]] = {name: [] for name in libs}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peer-copy-cpu-") as d:
        make_share(f"{d}/share", args.leaves)
        for r in range(args.rounds):
            for name, lib in libs.items():
                env = dict(os.environ, PYTHONPATH=lib)
                work = (["--floor-worker", f"{d}/share", str(args.copies)] if name == "loopback TCP floor"
                        else ["--worker", f"{d}/share", f"{d}/scratch-{r}", str(args.copies)])
                out = subprocess.run([sys.executable, __file__, *work],
                                     env=env, cwd=lib, check=True, capture_output=True, text=True).stdout
                got = json.loads(out.strip().splitlines()[-1])  # the worker's figures
                shutil.rmtree(f"{d}/scratch-{r}", ignore_errors=True)
                gib = got["bytes"] / 2**30
                per[name].append((got["send"] / gib, got["receive"] / gib))
                print(f"round {r} {name}: owner {got['send'] / gib:.3f}, holder {got['receive'] / gib:.3f}, "
                      f"both {(got['send'] + got['receive']) / gib:.3f} CPU-s per GiB copied", flush=True)
    for name, rows in per.items():
        send, recv = statistics.mean(s for s, _ in rows), statistics.mean(r for _, r in rows)
        print(f"{name}: owner {send:.3f}, holder {recv:.3f}, both {send + recv:.3f} CPU-s per GiB copied "
              f"(mean of {len(rows)} rounds of {args.copies} copies)")


if __name__ == "__main__":
    main()
