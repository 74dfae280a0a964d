"""The data loader keeps its page cache: a reader streams a dataset file while a checkpoint
manager saves every few seconds, the reader and the saver inside one memory cgroup whose
limit fits the dataset plus less than one checkpoint, so that checkpoint bytes written
through the page cache must evict something.

Per run, in an order rotated from run to run, each method runs in a fresh process:

  no checkpoints          the reader alone: the baseline.
  checkpointer direct     ckpt.CheckpointManager(dir, keep=KeepLatest(2), direct_io=True).
  checkpointer buffered   the same with direct_io=False (TensorStore writes through the cache).
  orbax                   ocp.CheckpointManager(dir, CheckpointManagerOptions(
                          enable_async_checkpointing=True, max_to_keep=2)), StandardSave.

State: 16 float32 leaves P('data', 'model') on the 2x4 mesh of 8 host (CPU) devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8) plus one replicated leaf, about
`--state-mib` MiB. Dataset: one file of `--dataset-mib` MiB of random bytes.

One method's process (`--child`), started by this script inside a new cgroup v1 memory
group `/sys/fs/cgroup/memory/checkpointer-page-cache-<pid>-<n>` (its pid written into
`cgroup.procs` before it runs; the group is removed afterwards, even on error):
  1. builds the state and its manager and saves once untimed (the warm-up: compilation,
     host buffer pools), sampling its anonymous memory (`RssAnon`) meanwhile;
  2. evicts the dataset and every checkpoint file (`fsync`, then
     `posix_fadvise(POSIX_FADV_DONTNEED)`), then sets `memory.limit_in_bytes` to its peak
     anonymous memory + `--headroom-mib` (the reader process, transient allocations) +
     the dataset + `--slack` × the state's bytes (default 0.5: less than one checkpoint);
  3. warms the dataset once (one sequential read, charged to the group), so that every
     method starts from the same state;
  4. starts the reader, a separate process in the same group that reads the dataset
     sequentially in `--block-mib` MiB pieces (`preadv` into one reused buffer), looping
     over it, as a data loader does, as fast as it can;
  5. saves `--saves` times, one save every `--interval-s` seconds (each waited for until
     committed: `wait_until_finished`); after each, the dataset's page-cache residency and
     the bytes of that step's files still cached (`mincore` of every file, through ctypes);
     the baseline takes the same readings at the same times without saving; a thread
     reads the dataset's residency every 0.2 s meanwhile (its lowest: dips during a save);
  6. stops the reader at the end of the window and reads the residency once more.
Figures: the reader's throughput over the window (MB/s, 10^6 bytes) and its ratio to the
same run's baseline, the bytes it read from storage (`read_bytes` of /proc/<pid>/io: page-
cache misses), the dataset's residency after each save and at the end, the checkpoint's
bytes cached after each save (% of the bytes of that step's files), the group's limit.

Needs root and the cgroup v1 memory controller (`/sys/fs/cgroup/memory`); exits 1 saying
so without them. The reader and the saver share the machine's cores: on a machine with
few cores the save's CPU lowers the reader's throughput whether or not its data stays
cached; `read_bytes` and the residency separate the two.

Run:  .venv/bin/python benchmarks/page_cache_bench.py [--runs 5] [--quick] [--dir /tmp]
      [--dataset-mib 512] [--state-mib 512] [--saves 3] [--interval-s 2.0]   (or `make bench`).
      Replaces the page_cache_bench section of benchmarks/RESULTS.md (--quick: 64 MiB
      each, 1 run, RESULTS.md untouched unless --results is given).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
BASE, DIRECT, BUFFERED, ORBAX = "no checkpoints", "checkpointer direct", "checkpointer buffered", "orbax"
METHODS = (BASE, DIRECT, BUFFERED, ORBAX)
N_LEAVES = 16


# --- page cache: residency and eviction ------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_PROT_READ, _MAP_SHARED, _MAP_FAILED = 1, 1, ctypes.c_void_p(-1).value


def resident_bytes(path: str) -> tuple[int, int]:
    """(bytes of `path` in the page cache, its size): `mincore` over a read-only mapping
    (mapping a file faults nothing in)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = -(-size // PAGE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1))
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * PAGE, size), size


def tree_files(folder: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]


def tree_resident(folder: str) -> tuple[int, int]:
    """(cached bytes, bytes) summed over every file under `folder`."""
    cached = total = 0
    for path in tree_files(folder):
        try:
            c, n = resident_bytes(path)
        except FileNotFoundError:  # removed meanwhile (retention)
            continue
        cached, total = cached + c, total + n
    return cached, total


def evict(path: str) -> None:
    """Drops `path`'s pages from the page cache: `fsync` (no dirty page stays), then
    `posix_fadvise(POSIX_FADV_DONTNEED)`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_tree(folder: str) -> None:
    for path in tree_files(folder):
        try:
            evict(path)
        except FileNotFoundError:
            pass


# --- the reader process ----------------------------------------------------------------

def _read_bytes_from_storage() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def reader_main(path: str, block_bytes: int, cpus: str) -> None:
    """Streams `path` sequentially in `block_bytes` pieces, looping, until SIGTERM; then
    prints one JSON line: bytes read, seconds, bytes read from storage, and `(time, bytes
    so far)` every 0.1 s (`time.perf_counter`: CLOCK_MONOTONIC, the same in every process).
    `cpus`: the cores to run on, comma-separated ("": any)."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    view = memoryview(bytearray(block_bytes))
    print("ready", flush=True)
    io0, t0 = _read_bytes_from_storage(), time.perf_counter()
    offset = total = 0
    marks, next_mark = [(t0, 0)], t0 + 0.1
    while not stop.is_set():
        n = os.preadv(fd, [view], offset)
        total += n
        offset = offset + n if offset + n < size and n else 0
        now = time.perf_counter()
        if now >= next_mark:
            marks.append((now, total))
            next_mark = now + 0.1
    t1 = time.perf_counter()
    marks.append((t1, total))
    print(json.dumps({"bytes": total, "seconds": t1 - t0, "storage_bytes": _read_bytes_from_storage() - io0,
                      "marks": marks}), flush=True)


def split_throughput(marks: list, spans: list) -> tuple[float | None, float | None]:
    """(MB/s while a save ran, MB/s otherwise) from the reader's marks and the saves'
    `(start, end)` spans: each 0.1 s slice goes to the saves when its middle lies in one."""
    inside = [0.0, 0.0]
    outside = [0.0, 0.0]
    for (ta, ba), (tb, bb) in zip(marks, marks[1:]):
        mid = (ta + tb) / 2
        acc = inside if any(s <= mid <= e for s, e in spans) else outside
        acc[0], acc[1] = acc[0] + (bb - ba), acc[1] + (tb - ta)
    return (inside[0] / inside[1] / 1e6 if inside[1] else None, outside[0] / outside[1] / 1e6 if outside[1] else None)


# --- one method's process --------------------------------------------------------------

def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class _PeakAnon:
    """Peak `RssAnon` of this process, sampled every 5 ms by a thread, in a `with` block."""

    def __enter__(self):
        self.peak, self._stop = _rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


class _LowestResidency:
    """The lowest page-cache residency of a file, read every `interval_s` by a thread
    between `start` and `stop` (catches the dips during a save that readings after it miss)."""

    def __init__(self, path: str, interval_s: float = 0.2):
        self.path, self.interval_s, self.lowest, self.readings = path, interval_s, 1.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(self.interval_s):
            cached, size = resident_bytes(self.path)
            self.lowest, self.readings = min(self.lowest, cached / size), self.readings + 1

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _state(state_bytes: int):
    import _common as C
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    cols = 4096
    rows = max(8, state_bytes // (N_LEAVES * cols * 4) // 8 * 8)  # divisible by the mesh's 2 x 4
    m = C.mesh()
    out = {f"w{k:02d}": NamedSharding(m, P("data", "model")) for k in range(N_LEAVES)}
    out["replicated"] = NamedSharding(m, P())

    def build():
        d = {f"w{k:02d}": C._fill((rows, cols), k) for k in range(N_LEAVES)}
        d["replicated"] = C._fill((256, 256), 99)
        return d

    return jax.block_until_ready(jax.jit(build, out_shardings=out)())


class _Saver:
    def __init__(self, method: str, directory: str):
        self.method = method
        if method == ORBAX:
            import absl.logging
            import orbax.checkpoint as ocp

            absl.logging.set_verbosity(absl.logging.ERROR)
            self._ocp = ocp
            self.mgr = ocp.CheckpointManager(
                directory, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=2))
        else:
            import checkpointer as ckpt

            self.mgr = ckpt.CheckpointManager(directory, keep=ckpt.KeepLatest(2), direct_io=method == DIRECT)

    def save(self, step: int, state) -> None:
        if self.method == ORBAX:
            self.mgr.save(step, args=self._ocp.args.StandardSave(state))
        else:
            self.mgr.save(step, state)
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.close()


def child_main(spec: dict) -> None:
    """One method's measurement (module docstring, steps 1–6); writes its result as JSON
    to `spec["out"]`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    method, dataset, directory = spec["method"], spec["dataset"], spec["dir"]
    cgroup = Path(spec["cgroup"])
    import _common as C

    state = _state(spec["state_bytes"])
    state_bytes = C.logical_bytes(state)
    with _PeakAnon() as peak:  # the state and what a save adds (not the state's jit temporaries)
        saver = None if method == BASE else _Saver(method, directory)
        save_s = []
        if saver is not None:
            t = time.perf_counter()
            saver.save(0, state)
            save_s.append(time.perf_counter() - t)
    evict(dataset)
    evict_tree(directory)
    dataset_bytes = os.path.getsize(dataset)
    limit = peak.peak + spec["headroom_bytes"] + dataset_bytes + int(spec["slack"] * state_bytes)
    try:
        (cgroup / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as e:  # EBUSY: the group cannot reclaim down to the limit
        usage = int((cgroup / "memory.usage_in_bytes").read_text())
        raise SystemExit(f"{method}: cannot limit {cgroup} to {limit / MIB:.0f} MiB, it holds {usage / MIB:.0f} MiB "
                         f"that it cannot reclaim ({e}); raise --headroom-mib or --slack") from e
    failcnt0 = int((cgroup / "memory.failcnt").read_text())
    with open(dataset, "rb", buffering=0) as f:  # the warm read, charged to this group
        while f.read(spec["block_bytes"]):
            pass
    warm = resident_bytes(dataset)[0] / dataset_bytes
    # No preexec_fn here: this process has threads (XLA's, TensorStore's); the reader pins itself.
    reader = subprocess.Popen([sys.executable, __file__, "--reader", dataset, str(spec["block_bytes"]),
                               ",".join(map(str, spec["reader_cpus"]))], stdout=subprocess.PIPE, text=True)
    after, spans = [], []
    sampler = _LowestResidency(dataset)
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        sampler.start()
        for i in range(1, spec["saves"] + 1):
            if saver is not None:
                t = time.perf_counter()
                saver.save(i, state)
                spans.append((t, time.perf_counter()))
                save_s.append(spans[-1][1] - t)
            else:  # the same readings at the same times as a saver's
                time.sleep(max(0.0, t0 + (i - 0.5) * spec["interval_s"] - time.perf_counter()))
            ds = resident_bytes(dataset)[0] / dataset_bytes
            ck = tree_resident(f"{directory}/{i}") if saver is not None else (0, 0)
            after.append({"dataset": ds, "ckpt_cached": ck[0], "ckpt_bytes": ck[1]})
            time.sleep(max(0.0, t0 + i * spec["interval_s"] - time.perf_counter()))
        window_s = time.perf_counter() - t0
    finally:
        sampler.stop()
        reader.send_signal(signal.SIGTERM)
        out, _ = reader.communicate(timeout=60)
    read = json.loads(out.strip().splitlines()[-1])
    during, between = split_throughput(read["marks"], spans)
    end = resident_bytes(dataset)[0] / dataset_bytes
    result = {
        "method": method, "state_bytes": state_bytes, "dataset_bytes": dataset_bytes, "peak_anon": peak.peak,
        "limit": limit, "failcnt": int((cgroup / "memory.failcnt").read_text()) - failcnt0, "save_s": save_s,
        "warm": warm, "after": after, "end": end, "lowest": min(sampler.lowest, end), "window_s": window_s,
        "read_mbps": read["bytes"] / read["seconds"] / 1e6, "during_mbps": during, "between_mbps": between,
        "read_bytes": read["bytes"], "read_storage_bytes": read["storage_bytes"],
    }
    if saver is not None:
        saver.close()
    Path(spec["out"]).write_text(json.dumps(result))


# --- the driver ------------------------------------------------------------------------

def _check_cgroup() -> str | None:
    if not (CGROUP_ROOT / "cgroup.procs").exists():
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    if os.geteuid() != 0:
        return "creating a memory cgroup needs root"
    return None


def _remove_cgroup(group: Path) -> None:
    """Removes the group once its processes are gone (a process leaves it when it is
    reaped; rmdir refuses with EBUSY until then)."""
    for _ in range(100):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    group.rmdir()


def _cpus(pin: bool) -> tuple[set[int], set[int]]:
    """(the saver's cores, the reader's core): the last core of this process's for the
    reader, the others for the saver; both empty (no pinning) without `pin` or with one core."""
    mine = sorted(os.sched_getaffinity(0))
    if not pin or len(mine) < 2:
        return set(), set()
    return set(mine[:-1]), {mine[-1]}


def run_method(method: str, n: int, args, dataset: str, parent: str) -> dict:
    """One method in a fresh process inside a new memory cgroup (module docstring)."""
    evict(dataset)
    directory = tempfile.mkdtemp(prefix="page_cache_ckpt_", dir=parent)
    out = os.path.join(parent, f"page_cache_result_{os.getpid()}_{n}.json")
    group = CGROUP_ROOT / f"checkpointer-page-cache-{os.getpid()}-{n}"
    group.mkdir()
    procs = str(group / "cgroup.procs")

    saver_cpus, reader_cpus = _cpus(args.pin)

    def join_group() -> None:  # in the child, before it runs Python: every thread it starts inherits both
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
        if saver_cpus:
            os.sched_setaffinity(0, saver_cpus)

    spec = {"method": method, "dataset": dataset, "dir": directory, "cgroup": str(group), "out": out,
            "state_bytes": args.state_mib * MIB, "headroom_bytes": args.headroom_mib * MIB, "slack": args.slack,
            "block_bytes": args.block_mib * MIB, "saves": args.saves, "interval_s": args.interval_s,
            "reader_cpus": sorted(reader_cpus)}
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                preexec_fn=join_group)
        rc = proc.wait(timeout=600)
        if rc != 0:
            oom = (group / "memory.oom_control").read_text().split()
            kills = int(oom[oom.index("oom_kill") + 1]) if "oom_kill" in oom else 0
            why = (f": the group's OOM killer killed {kills} process(es); raise --headroom-mib" if kills
                   else " (its error above)")
            raise RuntimeError(f"{method}: its process exited with {rc}{why}")
        return json.loads(Path(out).read_text())
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        _remove_cgroup(group)
        shutil.rmtree(directory, ignore_errors=True)
        Path(out).unlink(missing_ok=True)


def make_dataset(path: str, nbytes: int) -> None:
    block = os.urandom(4 * MIB)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    def own(ap):
        ap.add_argument("--dataset-mib", type=int, default=512, help="dataset file size, MiB (default 512)")
        ap.add_argument("--state-mib", type=int, default=512, help="state size, MiB (default 512)")
        ap.add_argument("--saves", type=int, default=3, help="measured saves per method (default 3)")
        ap.add_argument("--interval-s", type=float, default=2.0, help="seconds from one save's start to the next (default 2.0)")
        ap.add_argument("--slack", type=float, default=0.5, help="the cgroup's room beyond the dataset and the process's "
                        "anonymous memory, as a fraction of the state's bytes (default 0.5)")
        ap.add_argument("--headroom-mib", type=int, default=64, help="extra room for the reader process, MiB (default 64)")
        ap.add_argument("--block-mib", type=int, default=4, help="the reader's read size, MiB (default 4)")
        ap.add_argument("--methods", default=",".join(m.split()[-1] for m in METHODS[1:]),
                        help="the methods beside the baseline, comma-separated (default direct,buffered,orbax)")
        ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="the reader on the last core, the saving process on the others (default: on)")

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"  # the children's, and the header's
    import _common as C

    args = C.parse_args(__doc__, own)
    if args.quick:
        args.dataset_mib, args.state_mib = args.dataset_mib // 8, args.state_mib // 8
    why = _check_cgroup()
    if why is not None:
        print(f"page_cache_bench: {why}; nothing measured", file=sys.stderr)
        sys.exit(1)
    t0, load = time.perf_counter(), C.OtherLoad()
    parent = args.dir or tempfile.gettempdir()
    dataset = os.path.join(parent, f"page_cache_dataset_{os.getpid()}.bin")
    print(f"dataset {args.dataset_mib} MiB, state {args.state_mib} MiB, {args.saves} saves every {args.interval_s} s, "
          f"runs: {args.runs}", flush=True)
    short = {m.split()[-1]: m for m in METHODS[1:]}
    unknown = set(args.methods.split(",")) - set(short)
    if unknown:
        sys.exit(f"page_cache_bench: unknown --methods {sorted(unknown)}; choose from {sorted(short)}")
    methods = (BASE, *(m for m in METHODS[1:] if m.split()[-1] in args.methods.split(",")))
    results: dict[str, list[dict]] = {m: [] for m in methods}
    n = 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` removes the groups and files
    try:
        make_dataset(dataset, args.dataset_mib * MIB)
        for run in range(args.runs):
            k = run % len(methods)
            for method in methods[k:] + methods[:k]:
                r = run_method(method, n, args, dataset, parent)
                n += 1
                results[method].append(r)
                _progress(run, method, r)
    finally:
        Path(dataset).unlink(missing_ok=True)
    text = report(args, results, time.perf_counter() - t0, load)
    print("\n" + text)
    C.write_section(args.results, "page_cache_bench", text)


def _progress(run: int, method: str, r: dict) -> None:
    ds = " ".join(f"{a['dataset']:.0%}" for a in r["after"])
    ck = " ".join(f"{a['ckpt_cached'] / max(1, a['ckpt_bytes']):.0%}" for a in r["after"])
    split = "" if r["during_mbps"] is None else f" ({r['during_mbps']:.0f} while saving, {r['between_mbps']:.0f} between)"
    print(f"  run {run}: {method:22s} {r['read_mbps']:8.0f} MB/s{split}, from storage "
          f"{r['read_storage_bytes'] / MIB:.0f} MiB; dataset resident: warm {r['warm']:.0%}, after saves {ds}, lowest "
          f"{r['lowest']:.0%}, end {r['end']:.0%}; checkpoint cached {ck or '—'}; limit {r['limit'] / MIB:.0f} MiB "
          f"(hit {r['failcnt']} times); saves {' '.join(f'{s:.2f}' for s in r['save_s'])} s", flush=True)


def _pct(xs) -> str:
    import _common as C

    return C.fmt([100 * x for x in xs], "%", 1) if xs else "—"


def report(args, results, wall_s: float, load) -> str:
    import _common as C

    base = {i: r["read_mbps"] for i, r in enumerate(results[BASE])}
    rows, summary = [], {}
    for method in results:
        rs = results[method]
        ratios = [r["read_mbps"] / base[i] for i, r in enumerate(rs)]
        after = [a["dataset"] for r in rs for a in r["after"]]
        lowest = [min([a["dataset"] for a in r["after"]] + [r["lowest"]]) for r in rs]
        cached = [a["ckpt_cached"] / a["ckpt_bytes"] for r in rs for a in r["after"] if a["ckpt_bytes"]]
        worst_cached = [max(a["ckpt_cached"] / a["ckpt_bytes"] for a in r["after"]) for r in rs if method != BASE]
        summary[method] = (ratios, lowest, worst_cached)
        saves = [s for r in rs for s in r["save_s"][1:]]
        rows.append([method, C.fmt([r["read_mbps"] for r in rs], "MB/s", 0),
                     "—" if method == BASE else C.fmt(ratios, "×", 2),
                     "—" if method == BASE else C.fmt([r["during_mbps"] for r in rs if r["during_mbps"]], "MB/s", 0),
                     "—" if method == BASE else C.fmt([r["between_mbps"] for r in rs if r["between_mbps"]], "MB/s", 0),
                     C.fmt([r["read_storage_bytes"] / MIB for r in rs], "MiB", 0),
                     _pct(after), _pct(lowest), _pct([r["end"] for r in rs]), _pct(cached) if method != BASE else "—",
                     C.fmt(saves) if saves else "—", C.fmt([r["limit"] / MIB for r in rs], "MiB", 0)])
    main = C.table(["", "dataset read throughput", "ratio to no checkpoints (same run)", "while a save ran",
                    "between saves", "read from storage",
                    "dataset resident after each save", "dataset resident, lowest of a run", "dataset resident at the end",
                    "checkpoint bytes cached after each save", "save until committed", "cgroup limit"], rows)
    targets = []
    for method in (m for m in (DIRECT, BUFFERED, ORBAX) if m in summary):
        ratios, lowest, worst = summary[method]
        tag = "" if method == DIRECT else " (for comparison)"
        for what, xs, goal, ok in (
            ("dataset resident (lowest of a run)", [100 * x for x in lowest], "≥ 95 %", lambda v: v >= 95),
            ("read throughput / no checkpoints", ratios, "≥ 0.9×", lambda v: v >= 0.9),
            ("checkpoint bytes cached (most after a save of a run)", [100 * x for x in worst], "≤ 5 %", lambda v: v <= 5),
        ):
            v = statistics.median(xs)
            unit = "×" if "throughput" in what else " %"
            targets.append([f"{method}{tag}: {what}", f"{v:.2f}{unit}" if unit == "×" else f"{v:.1f}{unit}", goal,
                            ("met" if ok(v) else "missed") if method == DIRECT else ("would meet" if ok(v) else "misses")])
    r0 = results[BASE][0]
    cores = ("the reader pinned to the last core, the saving process to the others" if args.pin
             else "the reader and the saving process share all cores")
    desc = (f"Dataset: one file of {r0['dataset_bytes'] / MIB:.0f} MiB read sequentially in {args.block_mib} MiB "
            f"pieces, looping, by a separate reader process as fast as it can ({cores}). State: {N_LEAVES} float32 "
            f"leaves P('data','model') on a 2x4 mesh + 1 replicated leaf: {r0['state_bytes'] / MIB:.0f} MiB. Each "
            "method in a fresh process, inside its own cgroup v1 memory group together with the reader; limit = the "
            f"process's peak anonymous memory during an untimed warm-up save + {args.headroom_mib} MiB + the dataset + "
            f"{args.slack:g} × the state's bytes. Before the window: dataset and checkpoints evicted (fsync + "
            "POSIX_FADV_DONTNEED), then the dataset warmed once by one read inside the group. Window: "
            f"{args.saves} saves, one every {args.interval_s:g} s, each waited for until committed; the readings "
            "(`mincore`) after each; the lowest: the least of those and of readings every 0.2 s through the window "
            "(dips during a save). Throughput in 10^6 bytes/s over the window; its ratio to the same run's baseline; "
            "while a save ran / between saves: the reader's 0.1 s slices whose middle falls inside a save's span "
            "(call to committed) or outside; read from storage: the reader's `read_bytes` (/proc/<pid>/io), its "
            "page-cache misses. Checkpoint bytes cached: of the step just committed, over the bytes of its files. "
            "Methods rotated per run. A save's memory traffic and CPU lower the reader's throughput even where the "
            "dataset stays cached (the column while a save ran); read from storage is the cache's own figure.")
    return "\n".join([C.header_lines("The data loader keeps its page cache (`benchmarks/page_cache_bench.py`)", args,
                                     wall_s, load), desc, "", main, "", C.table(["median over runs", "value", "target", ""],
                                                                                 targets)])


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--reader":
        reader_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        main()
