"""Async save benchmark: how long `ckpt.save_async` blocks the caller, and how long until the
checkpoint is committed, next to a plain numpy copy of the same bytes and orbax-checkpoint's
async CheckpointManager.

State: 16 float32 arrays of 4096x4096 sharded P('data', 'model') over a 2x4 mesh of 8 host
(CPU) devices, plus one float32 1024x1024 replicated (P()): 1 GiB + 4 MiB of logical bytes.

Each run measures the four below, in an order rotated from run to run, each on freshly
computed device buffers (same values) and, except the manager, into a new folder under the temp
dir (removed after):

  plain copy    np.array(shard.data, copy=True) of every replica_id == 0 addressable shard:
                the physical floor of any blocking host snapshot.
  checkpointer  h = ckpt.save_async(path, state); blocking = until it returns, committed =
                until h.wait() returns, both from the start of the call.
  checkpointer CheckpointManager (buffers reused)
                one ckpt.CheckpointManager(dir, keep=ckpt.KeepLatest(1)) kept for the whole
                script (its first save, in the warm-up round, is not counted), so each save
                copies into the previous snapshot's host buffers; mgr.save(step, state),
                blocking = until save returns, committed = until mgr.wait_until_finished()
                returns (retention of the previous step included), both from the call start.
  orbax         ocp.CheckpointManager(dir, options=CheckpointManagerOptions(
                enable_async_checkpointing=True)).save(0, args=ocp.args.StandardSave(state));
                blocking = until save returns, committed = until wait_until_finished returns.
                (Manager construction and close are not timed.)

"Process CPU-seconds of the blocking call": user + system CPU of every thread of the process
from the call to its return (getrusage), the figure to compare on a loaded machine, where the
blocking wall time mostly measures the scheduler.

Peak RSS is sampled every 5 ms and reported as the rise over the RSS before the call (taken
after gc.collect() and malloc_trim(0)). One warm-up round is not counted. Writes go through the page cache and are fsynced by both
libraries; the page cache is warm and cannot be dropped here. The manager's reused host
buffers are already in the RSS before its call, so its rise excludes them.

Then benchmarks/fresh_save_cost.py runs once per library, case and run, each a fresh process:
one save until committed of the same state and of one 64 MiB array, by checkpointer direct
(direct_io=True), checkpointer buffered (direct_io=False) and orbax: CPU-seconds per GiB saved
(process CPU) and peak RSS rise / bytes written, against issue 20's targets (≤ 0.6 s per GiB,
≤ 1.25×, checkpointer direct).

Afterwards benchmarks/orbax_donation_check.py runs in a subprocess on the same state size; its
result (does each library still commit the save-time values when the caller donates the arrays
right after the blocking call?) goes into the Notes of the RESULTS.md section.

Run:  .venv/bin/python benchmarks/save_bench.py [--runs 5] [--quick] [--dir /tmp]
      (or `make bench`). Prints a markdown table and replaces the save_bench section of
      benchmarks/RESULTS.md (--quick: 1/8 of the state, 1 run, RESULTS.md untouched).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import absl.logging  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import checkpointer as ckpt  # noqa: E402

absl.logging.set_verbosity(absl.logging.ERROR)


def asarray_aliases(state) -> bool:
    """Whether np.asarray of a device shard is a view of the device buffer (CPU backend)."""
    data = jax.tree.leaves(state)[0].addressable_shards[0].data
    return np.asarray(data).ctypes.data == data.unsafe_buffer_pointer()


def disk_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


def process_cpu_s() -> float:
    """User + system CPU seconds of every thread of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plain_copy(state, d):
    with C.Measure() as m:
        c0 = process_cpu_s()
        host = [np.array(s.data, copy=True) for x in jax.tree.leaves(state) for s in x.addressable_shards if s.replica_id == 0]
        block_cpu = process_cpu_s() - c0
    nbytes = sum(h.nbytes for h in host)
    del host
    return {"block": m.seconds, "block_cpu": block_cpu, "rss": m.peak_delta, "bytes": nbytes}


def checkpointer_save(state, d):
    with C.Measure() as m:
        c0 = process_cpu_s()
        h = ckpt.save_async(f"{d}/ckpt/0", state)
        block, block_cpu = m.lap(), process_cpu_s() - c0
        h.wait()
    s = h.snapshot
    return {"block": block, "block_cpu": block_cpu, "commit": m.seconds, "rss": m.peak_delta, "disk": disk_bytes(d),
            "phases": (s.snapshot_s, s.result.write_s, s.result.commit_s)}


class ManagerSave:
    """One ckpt.CheckpointManager kept across runs: its saves reuse the previous host buffers."""

    def __init__(self, parent: str | None):
        self.dir = tempfile.mkdtemp(prefix="save_bench_manager_", dir=parent)
        self.mgr = ckpt.CheckpointManager(self.dir, keep=ckpt.KeepLatest(1))
        self.step = 0

    def __call__(self, state, _d):
        self.step += 1
        with C.Measure() as m:
            c0 = process_cpu_s()
            self.mgr.save(self.step, state)
            block, block_cpu = m.lap(), process_cpu_s() - c0
            self.mgr.wait_until_finished()
        st = self.mgr.status()
        assert st.latest_committed_step == self.step and self.mgr.all_steps() == [self.step], (st, self.mgr.all_steps())
        return {"block": block, "block_cpu": block_cpu, "commit": m.seconds, "rss": m.peak_delta,
                "disk": disk_bytes(self.mgr.step_path(self.step)),
                "phases": (st.last_snapshot_s, st.last_write_s, st.last_commit_s)}

    def close(self) -> None:
        self.mgr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def orbax_save(state, d):
    mgr = ocp.CheckpointManager(f"{d}/orbax", options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
    try:
        with C.Measure() as m:
            c0 = process_cpu_s()
            mgr.save(0, args=ocp.args.StandardSave(state))
            block, block_cpu = m.lap(), process_cpu_s() - c0
            mgr.wait_until_finished()
    finally:
        mgr.close()
    return {"block": block, "block_cpu": block_cpu, "commit": m.seconds, "rss": m.peak_delta, "disk": disk_bytes(d)}


CP, CK, CM, OB = ("plain numpy copy", "checkpointer save_async", "checkpointer CheckpointManager (buffers reused)",
                  "orbax async CheckpointManager")
METHODS = {CP: plain_copy, CK: checkpointer_save, CM: None, OB: orbax_save}  # CM: a ManagerSave, set in main()


def one_round(args, run: int, results: dict | None) -> None:
    names = list(METHODS)
    k = run % len(names)
    for name in names[k:] + names[:k]:
        state = C.make_state(args.scale)  # fresh device buffers, like a new training step
        gc.collect()
        d = tempfile.mkdtemp(prefix="save_bench_", dir=args.dir)
        try:
            before = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
            r = METHODS[name](state, d)
            after = resource.getrusage(resource.RUSAGE_SELF)
            r["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        finally:
            del state
            shutil.rmtree(d, ignore_errors=True)
        if results is not None:
            results[name].append(r)
        extra = f", committed {r['commit']:.3f} s" if "commit" in r else ""
        print(f"  run {run}: {name:48s} blocking {r['block']:.3f} s{extra}, peak RSS +{r['rss'] / 2**20:.0f} MiB", flush=True)


FRESH = {"direct": "checkpointer save, direct_io=True", "buffered": "checkpointer save, direct_io=False (TensorStore)",
         "orbax": "orbax async CheckpointManager"}
CPU_PER_GIB_TARGET, PEAK_TARGET = 0.6, 1.25  # issue 20 item 3 (the save-only figures)


def fresh_costs(args) -> dict:
    """benchmarks/fresh_save_cost.py per library and case, `args.runs` rounds (order rotated
    per round), each a fresh process: {(library, case): [result, ...]}."""
    script = str(Path(__file__).resolve().parent / "fresh_save_cost.py")
    jobs = [(lib, case) for lib in FRESH for case in ("state", "array64")]
    out: dict = {job: [] for job in jobs}
    print("\nfresh_save_cost.py (one save per fresh process):", flush=True)
    for run in range(args.runs):
        k = run % len(jobs)
        for lib, case in jobs[k:] + jobs[:k]:
            cmd = [sys.executable, script, lib, case, "--scale", str(args.scale)] + (["--dir", args.dir] if args.dir else [])
            p = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"{' '.join(cmd)} failed (exit {p.returncode}): {p.stderr.strip()[-500:]}")
            r = json.loads(lines[-1])
            out[(lib, case)].append(r)
            rise = "?" if r["peak_rise"] is None else f"{r['peak_rise'] / r['bytes_written']:.2f}×"
            print(f"  run {run}: {lib:8s} {case:7s} CPU {r['cpu_s']:.3f} s ({r['cpu_s'] / (r['logical_bytes'] / 2**30):.2f} s/GiB), "
                  f"peak RSS rise / bytes written {rise}, mode {r['write_mode']}", flush=True)
    return out


def fresh_report(fc: dict, args) -> str:
    def per_gib(lib, case):
        return [r["cpu_s"] / (r["logical_bytes"] / 2**30) for r in fc[(lib, case)]]

    def peak(lib, case):
        return [r["peak_rise"] / r["bytes_written"] for r in fc[(lib, case)] if r["peak_rise"] is not None]

    size = "1 GiB state" if args.scale == 1 else "1/8 of the state"
    def sys_share(lib, case):
        return [r["sys_s"] / r["cpu_s"] * 100 for r in fc[(lib, case)] if r["cpu_s"] > 0]

    rows = [[name, C.fmt(per_gib(lib, "state"), "s", 2), C.fmt(sys_share(lib, "state"), "%", 0), C.fmt(peak(lib, "state"), "×", 2),
             C.fmt(per_gib(lib, "array64"), "s", 2), C.fmt(peak(lib, "array64"), "×", 2)] for lib, name in FRESH.items()]
    main = C.table(["one save, fresh process", f"CPU-seconds per GiB saved, until committed ({size})", "of which system CPU",
                    f"peak RSS rise / bytes written ({size})", "CPU-seconds per GiB (64 MiB array)",
                    "peak RSS rise / bytes written (64 MiB array)"], rows)
    med = statistics.median
    targets = []
    for what, value, target in (("CPU-seconds per GiB saved, until committed", med(per_gib("direct", "state")), CPU_PER_GIB_TARGET),
                                (f"peak RSS rise / bytes written, {size}", med(peak("direct", "state")), PEAK_TARGET),
                                ("peak RSS rise / bytes written, 64 MiB array", med(peak("direct", "array64")), PEAK_TARGET)):
        unit = " s" if "CPU" in what else "×"
        targets.append([f"checkpointer direct: {what}", f"{value:.2f}{unit}", f"≤ {target}{unit}",
                        "met" if value <= target else f"missed ({value / target:.2f}× the target)"])
    for lib in ("buffered", "orbax"):
        r = med(per_gib("direct", "state")) / med(per_gib(lib, "state"))
        targets.append([f"checkpointer direct CPU / {FRESH[lib]} CPU", f"{r:.2f}×", "—", ""])
    modes = sorted({str(r["write_mode"]) for r in fc[("direct", "state")]})
    notes = ("Each cell: one save per fresh process (`benchmarks/fresh_save_cost.py`): the process builds the device "
             "arrays, makes one small warm-up save with the same library and mode (then `release_host_buffers`), and "
             "measures the next save until committed: process CPU (getrusage, every thread) and the peak RSS during it "
             "(VmHWM reset through /proc/self/clear_refs) above the RSS before it. Bytes written: the checkpoint "
             f"folder's size. The snapshot's buffers are fresh memory: their page faults are system CPU, which on this VM "
             "varies with the host's memory state from run to run (compare within one run). Direct mode used: "
             f"{modes}.")
    return "\n".join(["### CPU and peak host memory of one save (fresh process)", "", main, "",
                      C.table(["figure", "value", "target", ""], targets), "", notes])


def donation_check(args) -> dict:
    """Runs orbax_donation_check.py (same state size) in a subprocess; its JSON result, or {"error": ...}."""
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "orbax_donation_check.py"), "--json"]
    cmd += ["--full"] if args.scale == 1 else []
    cmd += ["--dir", args.dir] if args.dir else []
    print("\norbax_donation_check.py:", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    print("\n".join(lines), flush=True)
    if p.returncode != 0 or not lines or not lines[-1].startswith("{"):
        return {"error": f"exit {p.returncode}: {(p.stderr.strip().splitlines() or ['no output'])[-1][:300]}"}
    return json.loads(lines[-1])


def donation_note(dc: dict, orbax_block_s: float) -> str:
    """The Notes paragraph on orbax's blocking phase, written from the donation check's result."""
    head = (f"**What orbax's {orbax_block_s * 1e3:.0f} ms of blocking does here.** On CPU, `transfer_arrays_to_host` "
            "(orbax/checkpoint/_src/serialization/replica_slices.py, called inside the blocking `ArrayHandler.serialize` "
            "through `_serialize_arrays_batches_without_dispatcher` in jax_array_handlers.py) calls "
            "`copy_to_host_async()` and then keeps `np.asarray(shard)`, a zero-copy view of the device buffer, for the "
            "background write: no array bytes are copied before `save` returns.")
    if "error" in dc:
        return head + f" The donation experiment (benchmarks/orbax_donation_check.py) failed: {dc['error']}."
    r = {x["library"]: x for x in dc["results"]}
    ob, ck = r["orbax"], r["checkpointer"]
    size = "the full 1 GiB state" if dc["scale"] == 1 else "1/8 of the state"

    def verdict(x):
        if x["verdict"] == "error":
            return f"**failed** ({x['error']})"
        extra = f" ({x['leaves_differ']}/{x['leaves']} leaves differ from the save-time values)" if x["verdict"] == "torn" else ""
        return f"**{x['verdict']}**{extra}"

    def donated(x):
        return f"{x['leaves_donated']}/{x['leaves']}" if "leaves_donated" in x else "?"

    text = (f"{head} `benchmarks/orbax_donation_check.py` ({size}, run by this script: save, donate the arrays at once "
            "to `jax.jit(lambda s: tree_map(lambda x: x*0+7, s), donate_argnums=0)`, wait, restore) found orbax "
            f"{verdict(ob)} and checkpointer {verdict(ck)}")
    if ob["verdict"] == "intact" and ob.get("leaves_donated", ob["leaves"]) < ob["leaves"]:
        ctrl = ("a bare `np.asarray` view reproduces this" if dc.get("view_blocks_donation")
                else "a bare `np.asarray` view did not reproduce this in the control")
        text += (f", but jax donated only {donated(ob)} of the leaves orbax was writing (after checkpointer's save: "
                 f"{donated(ck)}): it declines, without a warning, to donate a buffer that a numpy view still "
                 f"references ({ctrl}) and writes the step's output to new memory. So orbax's short blocking time "
                 "moves the snapshot's cost into the next training step (the donating call took "
                 f"{ob['donate_call_s'] * 1e3:.0f} ms after orbax's save vs {ck['donate_call_s'] * 1e3:.0f} ms after "
                 "checkpointer's, one sample each, and a second copy of the state stays in memory until orbax's write "
                 "ends); it is not a like-for-like snapshot time, and on GPU/TPU both libraries must copy device to host "
                 "before `save` returns.")
    elif ob["verdict"] == "torn":
        text += (". So orbax's short blocking time comes from not snapshotting: a donation right after `save` changes "
                 "what orbax commits.")
    else:
        text += "."
    return text


def report(args, results: dict, nbytes: int, wall_s: float, load, aliases: bool, dc: dict, fresh: str) -> str:
    col = lambda name, key: [r[key] for r in results[name] if key in r]  # noqa: E731
    mib = lambda xs: [x / 2**20 for x in xs]  # noqa: E731
    rows = []
    for name in METHODS:
        disk = col(name, "disk")
        cpu = [c / (nbytes / 2**30) for c in col(name, "cpu_s")] if name != CP else []
        rows.append([name, C.fmt(col(name, "block")), C.fmt(col(name, "block_cpu"), "s", 3), C.fmt(col(name, "commit")),
                     C.fmt(mib(col(name, "rss")), "MiB", 0), f"{statistics.median(disk) / 2**20:.0f} MiB" if disk else "—",
                     C.fmt(cpu, "s", 2) if cpu else "—"])
    main = C.table(["", "blocking", "process CPU-seconds of the blocking call", "until committed", "peak RSS rise", "on disk",
                    "process CPU-seconds per GiB, until committed"], rows)
    med = lambda name, key: statistics.median(col(name, key))  # noqa: E731
    ratio_rows = []
    for ck, short in ((CK, "save_async"), (CM, "manager")):
        for what, key, den, target in (("blocking / plain copy", "block", (CP, "block"), 1.5),
                                       ("blocking / orbax blocking", "block", (OB, "block"), 0.5),
                                       ("committed / orbax committed", "commit", (OB, "commit"), 0.5)):
            r = med(ck, key) / med(*den)
            ratio_rows.append([f"checkpointer {short}: {what}", f"{r:.2f}×", f"≤ {target}×",
                               "met" if r <= target else f"missed ({r / target:.2f}× the target)"])
    for ck, short in ((CK, "save_async"), (CM, "manager (buffers reused)")):
        v = med(ck, "cpu_s") / (nbytes / 2**30)
        ratio_rows.append([f"checkpointer {short}: process CPU-seconds per GiB saved, until committed", f"{v:.2f} s",
                           f"≤ {CPU_PER_GIB_TARGET} s", "met" if v <= CPU_PER_GIB_TARGET else f"missed ({v / CPU_PER_GIB_TARGET:.2f}× the target)"])
    ratios = C.table(["ratio of medians", "value", "target", ""], ratio_rows)

    def phases_line(name, label):
        ph = list(zip(*col(name, "phases")))
        return (f"{label} (median): snapshot {statistics.median(ph[0]):.3f} s, "
                f"write + fsync {statistics.median(ph[1]):.3f} s "
                f"({nbytes / 1e9 / statistics.median(ph[1]):.2f} GB/s), commit {statistics.median(ph[2]):.3f} s")

    mp = list(zip(*col(CM, "phases")))
    mrest = [c - w for w, c in zip(mp[1], mp[2])]
    phases = (phases_line(CK, "checkpointer save_async's own phase timers") + ". The manager's (`status()`, "
              f"median): snapshot {statistics.median(mp[0]):.3f} s, write + fsync {statistics.median(mp[1]):.3f} s "
              f"({nbytes / 1e9 / statistics.median(mp[1]):.2f} GB/s), then commit + retention of the previous step "
              f"{statistics.median(mrest):.3f} s (last_commit_s − last_write_s).")
    state_desc = (f"State: {C.N_LEAVES} × float32 {C.shapes(args.scale)[0]} P('data','model') on a 2x4 mesh + float32 "
                  f"{C.shapes(args.scale)[1]} P(); {nbytes / 2**20:.0f} MiB in replica_id == 0 shards. Each "
                  "measurement on fresh device buffers, into a new folder (the manager: steps 1, 2, … of one folder, "
                  "KeepLatest(1)), order rotated per run, 1 warm-up round; malloc_trim before each.")
    alias = ("On this backend np.asarray(shard.data) is a view of the device buffer (checked at run time); "
             "checkpointer's snapshot is a real copy into its own host buffers, independent of the device buffers."
             if aliases else "np.asarray(shard.data) copies on this backend (checked at run time).")
    return "\n".join([C.header_lines("Async save (`benchmarks/save_bench.py`)", args, wall_s, load),
                      state_desc, "", main, "", ratios, "", phases, "", fresh, "", "### Notes", "", alias, "", donation_note(dc, med(OB, "block"))])


def main() -> None:
    args = C.parse_args(__doc__)
    t0, load = time.perf_counter(), C.OtherLoad()
    print(f"devices: {jax.device_count()} × {jax.devices()[0].platform}; runs: {args.runs}; warm-up round first")
    state = C.make_state(args.scale)
    nbytes, aliases = plain_copy(state, None)["bytes"], asarray_aliases(state)
    del state
    METHODS[CM] = manager = ManagerSave(args.dir)
    try:
        one_round(args, 0, None)  # warm-up; also the manager's first (uncounted) save
        results = {name: [] for name in METHODS}
        for run in range(args.runs):
            one_round(args, run, results)
    finally:
        manager.close()
    fresh = fresh_report(fresh_costs(args), args)
    dc = donation_check(args)
    text = report(args, results, nbytes, time.perf_counter() - t0, load, aliases, dc, fresh)
    print("\n" + text)
    C.write_section(args.results, "save_bench", text)


if __name__ == "__main__":
    main()
