"""Incremental saves (issue 30): a LoRA-style fine-tune saved every step, and a pretraining
loop where everything changes.

LoRA: a frozen base (`--base-mib`, default 1024 MiB of float32, 8 leaves sharded
P('data', 'model')), 16 MiB of adapters and their AdamW state (mu, nu: 48 MiB changing per
step) on a 2x4 mesh of 8 host devices, saved every step `--steps` times (default 50) by a
CheckpointManager with KeepLatest(3), async saves. Modes, each into a new folder:

  full            incremental=False (today's saves)
  incr-identity   incremental=True; the base is the same jax.Array every step (no copy, no hash)
  incr-content    incremental=True; the base is a fresh copy of the same values every step
                  (crc32c + XXH3-128, the first save after the first compares with the stored bytes)
  orbax           orbax-checkpoint's CheckpointManager(max_to_keep=3), StandardSave (if installed)
  incr-two-tiers  (--two-tiers) incr-identity with local_directory= (KeepLatest(2) locally, every
                  step replicated): bytes are the durable step's (replication's copies)

Per save: bytes written (the manifest's process_bytes_written; orbax: the step folder's size),
the time `save()` blocks the loop (training time lost), the time until committed
(`save` + `wait_until_finished`). At the end: disk used by the directory.

Restoring the newest step, as a resumed job meets it: once every mode has saved, each mode's
newest step is restored onto the saved shardings in a fresh child process (`--child`): jax,
the library (`ckpt.restore` loaded) and orbax imported, the target built (jax.ShapeDtypeStruct
leaves; the devices initialised) and orbax's CheckpointManager(DIR) made before the timer;
the timer covers `ckpt.restore(DIR/STEP, target)` / `manager.restore(STEP, StandardRestore)`
until `jax.block_until_ready`. Beside each, the plain read of the same files in a fresh
process (`_common.plain_read`: every file the restore reads, an incremental step's referenced
chunks in the older folders included, from the restore plan; orbax: the step folder, whole),
one thread, into one new buffer. Before each timed restore and plain read the files it reads
are read once (warm page cache). The modes alternate in `--rounds` rounds (default 3): round 1
full, incr-identity, ..., round 2 in reverse, and so on; a warm-up round before them, not
counted, checks every restore's values (per-leaf sums against the saving process's) and fills
the children's bytecode cache. Before the first child the free memory is touched once
(`_common.touch_free_memory`, unless --no-touch): the VM's first touch of a page costs
~1.8 s/GiB, and would otherwise land on whichever child reaches fresh memory first.
Reported: median (min–max) of the rounds, the ratio of medians to full's (the target:
within 1.1x), the child's user and system CPU and minor page faults over the timed part.

Pretraining: `--base-mib` of state that changes every step, saved at `--pretrain-saves`
steps (default 30, after one unmeasured first save) by two managers, incremental off and on,
both saving the same state at each step, the order alternating step by step. Measured per
save: the process CPU seconds (save + wait_until_finished + the removals its retention
handed the manager's deleter thread, all threads) per GiB, and the blocking time. The check's
cost is the paired difference on − off of each step: its median, a distribution-free 90%
interval of that median (order statistics) and its min–max (the medians of the two series and
their difference beside, as before). On this CPU route (shard images) the crc32c comes from
the snapshot's copy, so only a matching crc32c costs more; on accelerators, object stores or
direct_io=False it is a crc32c pass of its own, 1/8 of the saves (`_save/_incremental.py`).

Run:  .venv/bin/python benchmarks/incremental_bench.py [--base-mib 1024] [--steps 50]
      [--rounds 3] [--pretrain-saves 30] [--two-tiers] [--quick] [--no-touch] [--dir /tmp]
      [--results FILE] [--only-pretrain]
      (--quick: 256 MiB base, 10 steps, 2 rounds, 4 pretraining saves, at most 2 GiB touched;
      RESULTS.md untouched unless --results is given)
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import (
    NamedSharding,  # noqa: E402
    PartitionSpec as P,  # noqa: E402
)

import checkpointer as ckpt  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
ADAPTER_MIB = 16
METHODS = ("restore", "plain read")
CHECK_LIMIT = 0.05  # CPU-s per GiB the equality check may add (issue 30)
RESTORE_LIMIT = 1.1  # newest incremental step's restore ÷ the full checkpoint's


def _args():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-mib", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of fresh-process restores, the modes alternating (default 3)")
    ap.add_argument("--pretrain-saves", type=int, default=30, help="measured steps of the pretraining loop, each saved off and on (default 30)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-pretrain", action="store_true", help="only the pretraining loop (its own RESULTS.md section)")
    ap.add_argument("--two-tiers", action="store_true", help="also incr-two-tiers (a local tier, every step replicated)")
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes (default: all)")
    ap.add_argument("--no-touch", action="store_true", help="do not touch the free memory before the fresh-process restores")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    if args.quick:
        args.base_mib, args.steps, args.pretrain_saves = min(args.base_mib, 256), min(args.steps, 10), min(args.pretrain_saves, 4)
        args.rounds = min(args.rounds, 2)
    args.runs = 1
    if not args.only_pretrain:
        args.page_cache = "warm"  # header_lines: the files are read once before each timed restore
    args.results = Path(args.results) if args.results else (None if args.quick else Path(__file__).resolve().parent / "RESULTS.md")
    return args


def _side(total_bytes: int, n: int) -> int:
    """The side of each of `n` square float32 leaves of `total_bytes` together (a multiple of 8)."""
    return int((total_bytes // n // 4) ** 0.5) // 8 * 8


def _leaves(total_bytes: int, n: int, sharding, seed: int) -> list:
    side = _side(total_bytes, n)
    rng = np.random.default_rng(seed)
    return [jax.device_put(rng.standard_normal((side, side), dtype=np.float32), sharding) for _ in range(n)]


def _target(base_mib: int, sharding: NamedSharding) -> dict:
    """The LoRA state's restore target (jax.ShapeDtypeStruct leaves on the saved shardings)."""
    def sds(total_bytes: int) -> list:
        side = _side(total_bytes, 8)
        return [jax.ShapeDtypeStruct((side, side), np.float32, sharding=sharding) for _ in range(8)]

    count = jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(sharding.mesh, P()))
    return {"base": sds(base_mib * MiB), "lora": sds(ADAPTER_MIB * MiB),
            "opt": {"mu": sds(ADAPTER_MIB * MiB), "nu": sds(ADAPTER_MIB * MiB), "count": count}}


def _sums(tree) -> list[float]:
    return [float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(tree)]


def _du(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _lora(args, sharding, mode: str, root: str) -> dict:
    d = f"{root}/{mode}"
    base = _leaves(args.base_mib * MiB, 8, sharding, 0)
    adapters = _leaves(ADAPTER_MIB * MiB, 8, sharding, 1)
    written, lost, committed = [], [], []
    orbax = mode == "orbax"
    if orbax:
        import orbax.checkpoint as ocp

        mgr = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    elif mode == "incr-two-tiers":
        mgr = ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(3), incremental=True, local_directory=f"{root}/{mode}-local",
                                     keep_local=ckpt.KeepLatest(2))
    else:
        mgr = ckpt.CheckpointManager(d, keep=ckpt.KeepLatest(3), incremental=mode != "full")
    for step in range(args.steps):
        adapters = [a + 1e-3 for a in adapters]
        mu = [a * 0.1 for a in adapters]
        nu = [a * a for a in adapters]
        b = base if mode != "incr-content" else [jax.device_put(np.asarray(x), sharding) for x in base]
        count = jax.device_put(np.int32(step), NamedSharding(sharding.mesh, P()))
        state = {"base": b, "lora": adapters, "opt": {"mu": mu, "nu": nu, "count": count}}
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        if orbax:
            mgr.save(step, args=ocp.args.StandardSave(state))
        else:
            mgr.save(step, state)
        t1 = time.perf_counter()
        mgr.wait_until_finished()
        t2 = time.perf_counter()
        lost.append(t1 - t0)
        committed.append(t2 - t0)
        written.append(_du(f"{d}/{step}") if orbax else sum(ckpt.metadata(f"{d}/{step}").process_bytes_written))
    newest = args.steps - 1
    mgr.close()
    return {"written": written[1:], "lost": lost[1:], "committed": committed[1:], "disk": _du(d),
            "first_written": written[0], "dir": d, "step": newest, "sums": _sums(state)}


# ---------------------------------------------------------------------------------------------
# Restoring the newest step in fresh processes

def _read_files(mode: str, path: str, target: dict) -> list[str]:
    """The files a restore of `path` reads (an incremental step's referenced chunks where
    they live, from the restore plan); orbax: every file of its step folder."""
    if mode == "orbax":
        return sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
    plan = ckpt.plan_restore(path, target)
    parent = os.path.dirname(path)
    files = {os.path.join(parent, r.source, r.chunk_key) if r.source else os.path.join(path, r.chunk_key) for r in plan.reads}
    files |= {os.path.normpath(os.path.join(path, pr.key)) for leaf in plan.leaves for b in leaf.boxes for pr in b.packed}
    return sorted(files)


def child(spec: dict) -> None:
    """One restore (or plain read) of a mode's newest step in this fresh process: prints its
    RESULT line (wall time, user and system CPU, minor faults of the timed part)."""
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)
    method, orbax = spec["method"], spec["mode"] == "orbax"
    if method == "plain read":
        files = json.loads(Path(spec["files"]).read_text())
    else:
        target = _target(spec["base_mib"], NamedSharding(C.mesh(), P("data", "model")))
        restore = ckpt.restore  # the restore package loads on first use (PEP 562): not in the timer
    if orbax and method == "restore":
        import orbax.checkpoint as ocp

        mgr = ocp.CheckpointManager(spec["dir"])
        restore_args = ocp.args.StandardRestore(target)
    gc.collect()
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if method == "plain read":
        out = C.plain_read(files)
    elif orbax:
        out = jax.block_until_ready(mgr.restore(spec["step"], args=restore_args))
    else:
        out = jax.block_until_ready(restore(f"{spec['dir']}/{spec['step']}", target))
    t1, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    res = {"s": t1 - t0, "user_s": ru1.ru_utime - ru0.ru_utime, "sys_s": ru1.ru_stime - ru0.ru_stime,
           "minflt": ru1.ru_minflt - ru0.ru_minflt}
    if method == "plain read":
        res["bytes"] = int(out.nbytes)
    elif spec["check"]:
        res["sums"] = _sums(out)
    if orbax and method == "restore":
        mgr.close()
    C.print_result(res)


def _fresh_restores(args, sharding, modes: list[str], lora: dict, root: str) -> tuple[dict, str]:
    """{mode: {method: [child records of the counted rounds]}} and the line on touched memory."""
    target = _target(args.base_mib, sharding)
    spec_of, warm_of = {}, {}
    for mode in modes:
        d, step = lora[mode]["dir"], lora[mode]["step"]
        files = _read_files(mode, f"{d}/{step}", target)
        Path(f"{root}/files-{mode}.json").write_text(json.dumps(files))
        warm_of[mode] = [f"{d}/{step}", *(f for f in files if not f.startswith(f"{d}/{step}/"))]
        spec_of[mode] = {"mode": mode, "dir": d, "step": step, "base_mib": args.base_mib, "files": f"{root}/files-{mode}.json"}
    touch = "free memory not touched (--no-touch)"
    if not args.no_touch:
        done, s = C.touch_free_memory(limit_bytes=2 * GiB if args.quick else None)
        touch = f"{done / GiB:.1f} GiB of free memory touched once before the first child, {s:.1f} s"
        print(touch, flush=True)
    res: dict = {m: {k: [] for k in METHODS} for m in modes}
    sequence = [(m, k) for m in modes for k in METHODS]
    for rnd in range(-1, args.rounds):  # -1: the warm-up round (restores only, values checked)
        for mode, method in (sequence if rnd % 2 == 0 else sequence[::-1]):
            if rnd < 0 and method != "restore":
                continue
            C.set_page_cache(warm_of[mode], "warm")
            r = C.run_child(__file__, {**spec_of[mode], "method": method, "check": rnd < 0}, f"{root}/pycache")
            if rnd < 0 and r["sums"] != lora[mode]["sums"]:
                raise SystemExit(f"{mode}: the fresh restore of step {lora[mode]['step']} gave other values: "
                                 f"{r['sums']} != {lora[mode]['sums']}")
            if rnd >= 0:
                res[mode][method].append(r)
            print(f"  round {rnd if rnd >= 0 else 'warm-up'}: {mode:14s} {method:10s} {r['s']:.3f} s (user {r['user_s']:.2f} s, "
                  f"sys {r['sys_s']:.2f} s, {r['minflt'] / 1e3:.0f} k faults)", flush=True)
    return res, touch


def _fresh_text(args, modes: list[str], fresh: dict, touch: str) -> str:
    med = statistics.median
    full = med(r["s"] for r in fresh["full"]["restore"])
    rows, verdicts = [], []
    for mode in modes:
        rs, ps = fresh[mode]["restore"], fresh[mode]["plain read"]
        t = med(r["s"] for r in rs)
        rows.append([mode, C.fmt([r["s"] for r in rs]), f"{t / full:.2f}×", C.fmt([r["user_s"] for r in rs], "s", 2),
                     C.fmt([r["sys_s"] for r in rs], "s", 2), f"{med(r['minflt'] for r in rs) / 1e3:.0f} k",
                     C.fmt([r["s"] for r in ps]), f"{t / med(r['s'] for r in ps):.2f}×", f"{ps[0]['bytes'] / MiB:.0f} MiB"])
        if mode.startswith("incr"):
            verdicts.append(f"{mode} {t / full:.2f}× ({'met' if t / full <= RESTORE_LIMIT else 'missed'})")
    text = (f"Restoring the newest step (step {args.steps - 1}) in a fresh process, as a resumed job does: library "
            "imported and target built before the timer (orbax: its CheckpointManager made too), timer from the restore "
            "call to `jax.block_until_ready`; beside it the plain read of the same files (an incremental step's "
            "referenced chunks where they live), one thread, into a new buffer, also in a fresh process. Page cache warm "
            f"(the files read once before each); the modes alternate, {args.rounds} rounds (round 1 in order, round 2 "
            f"reversed, ...) after a warm-up round that checks the values; {touch}. Median (min–max) of the rounds; user, "
            "sys: the child's CPU seconds over the timed part; faults: its minor page faults (median).\n\n")
    text += C.table(["mode", "restore newest (fresh process)", "÷ full", "user", "sys", "faults", "plain read of its files",
                     "restore ÷ plain read", "bytes read"], rows)
    if verdicts:
        text += (f"\n\nTarget: restoring the newest step within {RESTORE_LIMIT}× of a full checkpoint's restore time "
                 f"(ratio of medians): {'; '.join(verdicts)}.")
    return text + "\n"


# ---------------------------------------------------------------------------------------------
# Pretraining: everything changes

def _drain(mgr) -> None:
    """Waits for the removals retention handed the manager's deleter thread (a private
    attribute: a benchmark's reach), so they count to the save that started them rather than
    to whichever save runs next."""
    deleter = getattr(mgr, "_deleter", None)
    if deleter is not None:
        deleter.submit(lambda: None).result()


def _pretrain(args, sharding, root: str) -> dict:
    """Incremental off and on save the same changing state at every step, the order
    alternating step by step (the machine's load drifts: alternation spreads it over both,
    and the pairs of one step share it)."""
    state = _leaves(args.base_mib * MiB, 8, sharding, 2)
    out = {on: {"cpu_per_gib": [], "lost": []} for on in (False, True)}
    mgrs = {on: ckpt.CheckpointManager(f"{root}/pretrain-{'on' if on else 'off'}", keep=ckpt.KeepLatest(2), incremental=on)
            for on in (False, True)}
    nbytes = sum(x.nbytes for x in state)
    try:
        for step in range(args.pretrain_saves + 1):
            state = [x + 1.0 for x in state]
            jax.block_until_ready(state)
            for on in ((False, True) if step % 2 else (True, False)):
                gc.collect()
                c0, t0 = time.process_time(), time.perf_counter()
                mgrs[on].save(step, {"w": state})
                t1 = time.perf_counter()
                mgrs[on].wait_until_finished()
                _drain(mgrs[on])
                if step:  # the first save has no base
                    out[on]["cpu_per_gib"].append((time.process_time() - c0) / (nbytes / GiB))
                    out[on]["lost"].append(t1 - t0)
    finally:
        for m in mgrs.values():
            m.close()
    return out


def _pretrain_text(args, pre: dict) -> str:
    med = statistics.median
    off, on = pre[False], pre[True]
    pairs = [b - a for a, b in zip(off["cpu_per_gib"], on["cpu_per_gib"])]
    check = med(pairs)
    lo, hi, cover = C.median_interval(pairs)
    verdict = "met" if check <= CHECK_LIMIT else "missed"
    verdict += f"; the interval's top {'is' if hi <= CHECK_LIMIT else 'is not'} within it"
    return (f"Pretraining, everything changes ({args.base_mib} MiB, {len(pairs)} steps each saved with incremental off "
            f"and on, the order alternating step by step): process CPU per save per GiB (save + wait + the removals its "
            f"retention started, all threads): off {C.fmt(off['cpu_per_gib'], 'CPU-s/GiB')}, on {C.fmt(on['cpu_per_gib'], 'CPU-s/GiB')}. "
            f"**The check, on − off of the same step: {check:+.3f} CPU-s/GiB** (median of {len(pairs)} pairs; "
            f"{cover:.0%} interval of the median {lo:+.3f} to {hi:+.3f}, distribution-free; pairs {min(pairs):+.3f} to "
            f"{max(pairs):+.3f}; difference of the medians {med(on['cpu_per_gib']) - med(off['cpu_per_gib']):+.3f}); "
            f"target ≤ {CHECK_LIMIT}: {verdict}. Loop blocked per save {med(off['lost']):.3f} s off, "
            f"{med(on['lost']):.3f} s on.\n")


def main() -> None:
    args = _args()
    t_start, load = time.perf_counter(), C.OtherLoad()
    sharding = NamedSharding(C.mesh(), P("data", "model"))
    root = tempfile.mkdtemp(dir=args.dir, prefix="incremental-bench-")
    modes = ["full", "incr-identity", "incr-content"]
    try:
        import orbax.checkpoint  # noqa: F401

        modes.append("orbax")
    except ImportError:
        pass
    if args.two_tiers:
        modes.append("incr-two-tiers")
    if args.modes:
        modes = [m for m in args.modes.split(",") if m in [*modes, "incr-two-tiers"]]
        if "full" not in modes:
            modes.insert(0, "full")  # the restore ratio's reference
    try:
        lora: dict = {}
        for mode in ([] if args.only_pretrain else modes):
            lora[mode] = _lora(args, sharding, mode, root)
            print(mode, {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in lora[mode].items() if k != "sums"},
                  flush=True)
            shutil.rmtree(f"{root}/{mode}-local", ignore_errors=True)
        fresh, touch = _fresh_restores(args, sharding, modes, lora, root) if lora else ({}, "")
        for mode in lora:
            shutil.rmtree(lora[mode]["dir"], ignore_errors=True)
        pre = _pretrain(args, sharding, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    pre_text = _pretrain_text(args, pre)
    if args.only_pretrain:
        body = C.header_lines(f"Incremental saves, pretraining loop (`benchmarks/incremental_bench.py --only-pretrain`), "
                              f"{args.base_mib} MiB", args, time.perf_counter() - t_start, load) + "\n" + pre_text
        print(body)
        C.write_section(args.results, "incremental_bench_pretrain", body)
        return
    changed = ADAPTER_MIB * MiB * 3  # adapters, mu, nu (float32)
    med = statistics.median
    rows = []
    for mode in modes:
        r = lora[mode]
        rows.append([mode, f"{med(r['written']) / MiB:.1f} MiB", f"{med(r['written']) / changed:.3f}×",
                     f"{med(r['lost']):.3f} s", f"{med(r['committed']):.3f} s", f"{r['disk'] / MiB:.0f} MiB"])
    body = C.header_lines(f"Incremental saves (`benchmarks/incremental_bench.py`), base {args.base_mib} MiB", args,
                          time.perf_counter() - t_start, load)
    body += (f"\nLoRA-style fine-tune: frozen base {args.base_mib} MiB, adapters {ADAPTER_MIB} MiB + AdamW mu/nu (changed per "
             f"save: {changed / MiB:.0f} MiB), {args.steps} saves with KeepLatest(3), async; medians over saves 2..{args.steps}. "
             f"Target: bytes per save ≤ 1.05× the changed bytes plus metadata; disk ≤ base + 3 × changed "
             f"({(args.base_mib * MiB + 3 * changed) / MiB:.0f} MiB) plus metadata.\n\n")
    body += C.table(["mode", "bytes written / save", "÷ changed", "loop blocked / save", "until committed / save",
                     "disk at the end"], rows)
    body += "\n\n" + _fresh_text(args, modes, fresh, touch) + "\n" + pre_text
    print(body)
    C.write_section(args.results, "incremental_bench", body)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
