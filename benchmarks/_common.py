"""Shared pieces of the benchmark scripts: the benchmark state, timing and RSS sampling,
statistics, machine description and the per-script section of benchmarks/RESULTS.md.

The importing script sets XLA_FLAGS (8 host devices) before this module imports jax.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from importlib import metadata as _md
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import psutil
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

N_LEAVES = 16
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def parse_args(doc: str, add_arguments=None) -> argparse.Namespace:
    """The common options; `add_arguments(parser)` adds a script's own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    if add_arguments is not None:
        add_arguments(ap)
    ap.add_argument("--runs", type=int, default=5, help="measured runs (default 5)")
    ap.add_argument("--quick", action="store_true", help="1/8 of the state, 1 run; does not touch RESULTS.md unless --results is given")
    ap.add_argument("--dir", default=None, help="parent of the temporary checkpoint folders (default: the system temp dir)")
    ap.add_argument("--results", default=None, help=f"markdown file to update (default {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS})")
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    args.scale = 8 if args.quick else 1
    args.results = Path(args.results) if args.results else (None if args.quick else RESULTS)
    return args


def mesh(shape=(2, 4), axes=("data", "model")) -> Mesh:
    """The first prod(shape) devices as a mesh: the library's own `scratch_mesh`."""
    from checkpointer._tools._default_targets import scratch_mesh

    return scratch_mesh(shape, axes, jax.devices())


def shapes(scale: int = 1) -> tuple[tuple[int, int], tuple[int, int]]:
    """(big leaf shape, replicated leaf shape); scale=8 gives 1/8 of the bytes."""
    if scale == 1:
        return (4096, 4096), (1024, 1024)
    assert scale == 8
    return (2048, 1024), (512, 256)


def _fill(shape, seed: int) -> jax.Array:
    """Cheap pseudo-random float32 in [0, 1): an integer hash of the element index."""
    x = lax.iota(jnp.uint32, shape[0] * shape[1]).reshape(shape) * jnp.uint32(2654435761)
    x = x + jnp.uint32((seed * 0x9E3779B9) & 0xFFFFFFFF)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x2C1B3C6D)
    x = x ^ (x >> 12)
    return lax.bitcast_convert_type((x >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0


@functools.cache
def _builder(scale: int):
    big, small = shapes(scale)
    m = mesh()
    out = {f"w{k:02d}": NamedSharding(m, P("data", "model")) for k in range(N_LEAVES)}
    out["replicated"] = NamedSharding(m, P())

    def build():
        d = {f"w{k:02d}": _fill(big, k) for k in range(N_LEAVES)}
        d["replicated"] = _fill(small, 99)
        return d

    return jax.jit(build, out_shardings=out)


def make_state(scale: int = 1) -> dict:
    """16 float32 leaves sharded P('data','model') on a 2x4 mesh + 1 replicated leaf (P()).

    Deterministic: every call gives fresh device buffers holding the same values."""
    return jax.block_until_ready(_builder(scale)())


def logical_bytes(tree) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _malloc_trim() -> None:
    """Returns freed heap memory to the OS (glibc), so RSS rises measure new allocations."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Measure:
    """Wall time and peak RSS (sampled every 5 ms by a thread) of a `with` block.

    `peak_delta` is the peak RSS minus the RSS at entry (after gc and malloc_trim), bytes."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.proc = interval, psutil.Process()

    def __enter__(self):
        gc.collect()
        _malloc_trim()
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def lap(self) -> float:
        """Seconds since entry."""
        return time.perf_counter() - self.t0

    def __exit__(self, *exc):
        self.seconds = self.lap()
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self.peak_delta = self.peak - self.base


def stats(xs) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def fmt(xs, unit: str = "s", digits: int = 3) -> str:
    """`median (min–max)` of a list, or `—` if empty."""
    if not xs:
        return "—"
    med, lo, hi = stats(xs)
    if len(xs) == 1:
        return f"{med:.{digits}f} {unit}".rstrip()
    return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f}) {unit}".rstrip()


def median_interval(xs, level: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free confidence interval of the median of `xs`: `(low, high, coverage)`,
    the order statistics x_(j) and x_(n+1-j) with the largest j whose coverage (from the
    binomial(n, 1/2) law of how many values fall below the median) is at least `level`;
    with too few values, (min, max) and its coverage, below `level`."""
    v, n = sorted(xs), len(xs)
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]  # P(exactly i values below the median)
    j = 1
    while j < n // 2 and 1 - 2 * sum(below[:j + 1]) >= level:
        j += 1
    return v[j - 1], v[n - j], 1 - 2 * sum(below[:j])


def ratio(a, b) -> str:
    return f"{statistics.median(a) / statistics.median(b):.2f}×"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _version(dist: str) -> str:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return "not installed"


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    vers = ", ".join(f"{d} {_version(d)}" for d in ("jax", "jaxlib", "tensorstore", "orbax-checkpoint", "numpy", "checkpointer"))
    return (f"{cpu}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, "
            f"{platform.system()} {platform.release()}; Python {platform.python_version()}, {vers}; "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")


class OtherLoad:
    """CPU time used by *other* processes while the script runs, as a share of all cores."""

    def __init__(self):
        self.proc = psutil.Process()
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()

    def _busy(self) -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def _own(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system + t.children_user + t.children_system

    def share(self) -> float:
        wall = time.perf_counter() - self.t0
        return max(0.0, (self._busy() - self.busy0) - (self._own() - self.own0)) / (wall * (os.cpu_count() or 1))


def header_lines(title: str, args, wall_s: float, load: OtherLoad) -> str:
    cmd = shlex.join(["python", *sys.argv])
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    share = load.share()
    warn = " (**the machine was not idle: treat these numbers with care**)" if share > 0.1 else ""
    return (f"## {title}\n\n"
            f"- Command: `{cmd}` (interpreter {sys.executable}), {now}, script wall time {wall_s:.0f} s\n"
            f"- Machine: {machine()}\n"
            f"- Other processes used {share:.0%} of the CPU time of all cores during the script{warn}\n"
            f"- Checkpoints on local disk under {args.dir or '/tmp'} (`{_fs_of(args.dir)}`), {_cache_of(args)}; "
            f"cells are median (min–max) of {args.runs} run(s)\n")


def _cache_of(args) -> str:
    state = getattr(args, "page_cache", None)
    if state is None:
        return "warm page cache"
    how = "read once" if state == "warm" else "fsynced and evicted (posix_fadvise DONTNEED)"
    return f"page cache {state}: every library's files {how} before each timed restore"


def _fs_of(d) -> str:
    d = os.path.realpath(d or "/tmp")
    parts = [p for p in psutil.disk_partitions(all=True) if d == p.mountpoint or d.startswith(p.mountpoint.rstrip("/") + "/")]
    best = max(parts, key=lambda p: len(p.mountpoint), default=None)
    return f"{best.device} {best.fstype}" if best else "unknown fs"


PAGE_CACHE_STATES = ("warm", "cold")


def page_cache_argument(ap: argparse.ArgumentParser) -> None:
    """`--page-cache warm|cold`: the state every library's files are put in before a timed restore."""
    ap.add_argument("--page-cache", choices=PAGE_CACHE_STATES, default="warm",
                    help="before each timed restore, read every checkpoint file once (warm, the default) or "
                         "fsync and evict them with posix_fadvise(DONTNEED) (cold: the disk's speed)")


def set_page_cache(paths, state: str) -> int:
    """Puts every file under `paths` (folders or files) in the same page-cache state: "warm"
    reads each once, "cold" fsyncs it and evicts it (`posix_fadvise(POSIX_FADV_DONTNEED)`).
    Direct writes leave this library's files uncached while Orbax's are cached: call this on
    both before timing a restore. Returns the bytes of the files."""
    total = 0
    for root in paths:
        root = Path(root)
        for f in sorted([root] if root.is_file() else (p for p in root.rglob("*") if p.is_file())):
            fd = os.open(f, os.O_RDONLY)
            try:
                total += os.fstat(fd).st_size
                if state == "cold":
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                else:
                    while os.read(fd, 16 << 20):
                        pass
            finally:
                os.close(fd)
    return total


def write_section(path: Path | None, name: str, body: str) -> None:
    """Replaces (or appends) the `<!-- name:start -->`…`<!-- name:end -->` block of `path`."""
    if path is None:
        print("\n(not writing RESULTS.md: --quick without --results)")
        return
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else (
        "# Benchmark results\n\nEach section below is written by the script it names; rerun the script to replace it.\n")
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
    print(f"\nwrote section {name!r} of {path}")


def touch_free_memory(margin_bytes: int = 2 << 30, limit_bytes: int | None = None, chunk_bytes: int = 256 << 20) -> tuple[int, float]:
    """Writes one byte per page of (almost) all available memory once, then frees it.

    On these VMs the first touch of a page after boot costs ~1.8 s/GiB (the host backs it
    then), against ~0.2 s/GiB once touched: without this, whichever measurement first
    reaches fresh memory pays for it. Touches `available - margin_bytes` (at most
    `limit_bytes`) in `chunk_bytes` pieces held until the end, so each is a distinct page.
    Returns (bytes touched, seconds)."""
    want = max(0, psutil.virtual_memory().available - margin_bytes)
    if limit_bytes is not None:
        want = min(want, limit_bytes)
    held, done, t0 = [], 0, time.perf_counter()
    page = os.sysconf("SC_PAGE_SIZE")
    while done < want:
        if psutil.virtual_memory().available < margin_bytes:  # others took memory meanwhile
            break
        a = np.empty(min(chunk_bytes, want - done), np.uint8)
        a[::page] = 1
        held.append(a)
        done += a.nbytes
    del held
    gc.collect()
    _malloc_trim()
    return done, time.perf_counter() - t0


def run_child(script, spec: dict, pycache: str | None = None) -> dict:
    """One measurement in a fresh process: runs `python SCRIPT --child JSON(spec)` and returns
    the dict of the `RESULT {...}` line it prints (`print_result`); a child that prints none
    ends the script with the tail of its stderr.

    pycache: a folder for the children's bytecode cache (PYTHONPYCACHEPREFIX, bytecode on even
    under PYTHONDONTWRITEBYTECODE): an installed library imports from its .pyc files, as jax
    and orbax do here from site-packages; without it an editable checkout would compile its
    modules in every child. A warm-up round fills it. None: the parent's environment as is."""
    env = None
    if pycache is not None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = pycache
    p = subprocess.run([sys.executable, str(script), "--child", json.dumps(spec)], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"child {json.dumps(spec)[:400]} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")


def print_result(res: dict) -> None:
    """The child's side of `run_child`: its one result line."""
    print("RESULT " + json.dumps(res), flush=True)


def plain_read(files, sizes=None) -> np.ndarray:
    """`readinto()` of every file of `files` (paths), in order, into one new numpy buffer, one
    thread, unbuffered: the floor for reading those bytes into fresh memory. `sizes`: the
    files' sizes in bytes, known beforehand (None: each file is stat()ed first)."""
    sizes = [os.stat(f).st_size for f in files] if sizes is None else list(sizes)
    buf = np.empty(sum(sizes), np.uint8)
    view, off = memoryview(buf), 0
    for f, n in zip(files, sizes):
        with open(f, "rb", buffering=0) as fh:
            end = off + n
            while off < end:
                got = fh.readinto(view[off:end])
                if not got:
                    raise OSError(f"{f} is shorter than {n} bytes")
                off += got
    return buf
