"""The snapshot's copy into shard files against its floors, in isolation (issue 28 item 1).

CPU-seconds per GiB (`time.thread_time`, one thread, best of `--repeat`) of 1 GiB of
save_bench.py's boxes (128 C-contiguous float32 boxes of 2048 x 1024, zarr inner chunks of
256 x 512: a box's file order is not its C order), every destination touched before it is
timed (a pool's reused buffers):

- `contiguous copy`: the box's 8 MiB as one `np.copyto` (the floor of any copy);
- `crc32c, one cold pass`: the writer's pass over the inner chunks (`ShardImage.checksum`);
- `fill as today`: `_image._fill` without and with the record's `data_crc32c` of the
  box's rows taken while hot (what `fill_images` runs per task);
- alternatives to the fill's per-inner-chunk 2-D copies: one 3-D copy per band, one 4-D
  copy per box, rows bounced through a cache-sized scratch, sub-bands (the crc32c of
  fewer rows, in L2), and the inner chunks' crc32c taken hot in the fill too.

Each source box sits at the page offset `--src-offset` (bytes): glibc's `memmove` copies a
2 KiB row backwards, slower here, where the destination's page offset is 0-255 bytes past
the source's (mod 2048 in this layout); XLA's CPU buffers are only 64-byte aligned, so
some shards of a save land there. `--files DIR` adds the file side: 64 files of a shard
file's size written with `O_DIRECT` as new files (deleting the previous round's, as
retention does) against written over the previous round's files (renamed, no `O_TRUNC`).

    PYTHONPATH=. .venv/bin/python benchmarks/fill_copy_floor.py [--src-offset 64] [--files /tmp/x]
"""

import argparse
import mmap
import os
import resource
import shutil
import time

import crc32c
import numpy as np

from checkpointer._encoding import _image
from checkpointer._format import ShardFileLayout

BOXES, ROWS, COLS = 128, 2048, 1024  # 1 GiB of float32
LAYOUT = ShardFileLayout((ROWS, COLS), (256, 512), 4)
IB = LAYOUT.inner_bytes_with_crc
INNER = LAYOUT.inner_bytes


def _aligned(n: int, offset: int) -> np.ndarray:
    raw = np.ones(n + 2 * 4096, np.uint8)  # touched
    at = (-raw.ctypes.data) % 4096 + offset
    return raw[at : at + n]


def _best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return min(times) * (1 << 30) / (BOXES * ROWS * COLS * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src-offset", type=int, default=64, help="page offset of each source box, bytes")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--files", help="a folder for the file side (new files against over a spare's)")
    args = ap.parse_args()
    srcs = [_aligned(ROWS * COLS * 4, args.src_offset).view(np.float32).reshape(ROWS, COLS) for _ in range(BOXES)]
    for i, s in enumerate(srcs):
        s[...] = i
    size = _image.image_bytes(LAYOUT, (ROWS, COLS))
    dsts = [_aligned(size, 0) for _ in range(BOXES)]
    flat = [_aligned(ROWS * COLS * 4, 0) for _ in range(BOXES)]
    stored = _image.stored_inner_chunks(LAYOUT, (ROWS, COLS))
    scratch = _aligned(64 * 2048, 1024)

    def contiguous():
        for s, d in zip(srcs, flat):
            np.copyto(d, s.reshape(-1).view(np.uint8))

    def cold_crc():
        for d in dsts:
            for k in range(len(stored)):
                crc32c.crc32c(d[k * IB : k * IB + INNER].data)

    def fill(parts: bool):
        def run():
            for s, d in zip(srcs, dsts):
                _image._fill(LAYOUT, s, d, stored, 0, len(stored), [(0, 0)] if parts else None, 0)
        return run

    def band_3d():
        for s, d in zip(srcs, dsts):
            u = s.view(np.uint8)
            for b in range(8):
                dst = np.lib.stride_tricks.as_strided(d[2 * b * IB :], shape=(2, 256, 2048), strides=(IB, 2048, 1))
                np.copyto(dst, u[b * 256 : (b + 1) * 256].reshape(256, 2, 2048).transpose(1, 0, 2))

    def box_4d():
        for s, d in zip(srcs, dsts):
            dst = np.lib.stride_tricks.as_strided(d, shape=(8, 2, 256, 2048), strides=(2 * IB, IB, 2048, 1))
            np.copyto(dst, s.view(np.uint8).reshape(8, 256, 2, 2048).transpose(0, 2, 1, 3))

    def bounce():  # 64 rows at a time through a 128 KiB scratch, then one contiguous copy
        sv = scratch.reshape(64, 2048)
        for s, d in zip(srcs, dsts):
            u = s.view(np.uint8)
            for k in range(16):
                b, c = divmod(k, 2)
                for r in range(0, 256, 64):
                    np.copyto(sv, u[b * 256 + r : b * 256 + r + 64, c * 2048 : (c + 1) * 2048])
                    np.copyto(d[k * IB + r * 2048 : k * IB + (r + 64) * 2048], scratch)

    def sub_bands(rows: int, inner_crc: bool = False):
        def run():
            for s, d in zip(srcs, dsts):
                u, crc = s.view(np.uint8), 0
                for b in range(8):
                    for r in range(0, 256, rows):
                        for c in range(2):
                            o = (2 * b + c) * IB + r * 2048
                            np.copyto(d[o : o + rows * 2048].reshape(rows, 2048), u[b * 256 + r : b * 256 + r + rows, c * 2048 : (c + 1) * 2048])
                        crc = crc32c.crc32c(u[b * 256 + r : b * 256 + r + rows].reshape(-1).data, value=crc)
                    if inner_crc:  # the band's two inner chunks, just written
                        for c in range(2):
                            o = (2 * b + c) * IB
                            crc32c.crc32c(d[o : o + INNER].data)
        return run

    rows = [
        ("contiguous copy (floor)", contiguous),
        ("crc32c, one cold pass (writer)", cold_crc),
        ("fill as today, copy only", fill(False)),
        ("fill as today, + hot rows crc32c", fill(True)),
        ("one 3-D copy per band", band_3d),
        ("one 4-D copy per box", box_4d),
        ("bounced through 128 KiB scratch", bounce),
        ("sub-bands of 64 rows + hot crc32c", sub_bands(64)),
        ("fill + hot inner-chunk crc32c too", sub_bands(256, inner_crc=True)),
    ]
    print(f"source page offset {args.src_offset} B; CPU-s per GiB, best of {args.repeat}")
    for name, fn in rows:
        print(f"  {name:36s} {_best(fn, args.repeat):.3f}", flush=True)
    if args.files:
        _files(args.files, size)


def _files(folder: str, size: int) -> None:
    """Process CPU of 64 shard files (0.5 GiB) written with O_DIRECT: new files (the
    previous round's deleted, as retention does) against over the previous round's."""
    file_bytes = size - size % 4096 + 4096
    buf = mmap.mmap(-1, file_bytes)
    view = memoryview(buf)
    for i in range(0, file_bytes, 4096):
        buf[i] = 1

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def write(path: str, new: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if new else 0) | os.O_DIRECT, 0o644)
        try:
            os.pwrite(fd, view, 0)
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    os.makedirs(folder, exist_ok=True)
    new, over, prev = [], [], None
    for rnd in range(6):
        d = f"{folder}/new{rnd}"
        os.makedirs(d)
        c = cpu()
        for k in range(64):
            write(f"{d}/{k}", True)
        if prev:
            shutil.rmtree(prev)
        new.append(cpu() - c)
        prev = d
    for rnd in range(6):
        d = f"{folder}/over{rnd}"
        c = cpu()
        os.rename(prev, d)
        for k in range(64):
            write(f"{d}/{k}", False)
        over.append(cpu() - c)
        prev = d
    shutil.rmtree(folder)
    print("64 shard files (0.5 GiB), process CPU ms, sorted:")
    print(f"  new files, previous round deleted: {sorted(round(1000 * x) for x in new)}")
    print(f"  written over the previous round's: {sorted(round(1000 * x) for x in over)}")


if __name__ == "__main__":
    main()
