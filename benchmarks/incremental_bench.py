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
(`save` + `wait_until_finished`). At the end: disk used by the directory, and the time to
restore the newest step onto the saved shardings (vs the full save's newest step).

Pretraining: `--base-mib` of state that changes every step, saved `--pretrain-saves` times
(default 10) with incremental off and on; the process CPU seconds per save (save +
wait_until_finished, all threads) per GiB, and the blocking time. The difference is the
equality check's cost: on this CPU route (shard images) the crc32c comes from the snapshot's
copy, so only a matching crc32c costs more; on accelerators, object stores or
direct_io=False it is a crc32c pass of its own, 1/8 of the saves (`_save/_incremental.py`).

Run:  .venv/bin/python benchmarks/incremental_bench.py [--base-mib 1024] [--steps 50] [--quick] [--dir /tmp]
      (--quick: 256 MiB base, 10 steps, RESULTS.md untouched unless --results is given)
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import OtherLoad, header_lines, mesh, table, write_section  # noqa: E402
from jax.sharding import (
    NamedSharding,  # noqa: E402
    PartitionSpec as P,  # noqa: E402
)

import checkpointer as ckpt  # noqa: E402

MiB = 1 << 20


def _args():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-mib", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--pretrain-saves", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-pretrain", action="store_true", help="only the pretraining loop (its own RESULTS.md section)")
    ap.add_argument("--two-tiers", action="store_true", help="also incr-two-tiers (a local tier, every step replicated)")
    ap.add_argument("--modes", default=None, help="comma-separated subset of the modes (default: all)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    if args.quick:
        args.base_mib, args.steps, args.pretrain_saves = min(args.base_mib, 256), min(args.steps, 10), min(args.pretrain_saves, 4)
    args.runs = 1
    args.results = Path(args.results) if args.results else (None if args.quick else Path(__file__).resolve().parent / "RESULTS.md")
    return args


def _leaves(total_bytes: int, n: int, sharding, seed: int) -> list:
    side = int((total_bytes // n // 4) ** 0.5) // 8 * 8
    rng = np.random.default_rng(seed)
    return [jax.device_put(rng.standard_normal((side, side), dtype=np.float32), sharding) for _ in range(n)]


def _du(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _lora(args, sharding, mode: str, root: str) -> dict:
    d = f"{root}/{mode}"
    base = _leaves(args.base_mib * MiB, 8, sharding, 0)
    adapters = _leaves(16 * MiB, 8, sharding, 1)
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
    disk = _du(d)
    target = jax.tree.map(lambda a: a.sharding if isinstance(a, jax.Array) else None, state)
    restore_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        if orbax:
            with ocp.CheckpointManager(d) as m2:
                abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a, state)
                out = m2.restore(newest, args=ocp.args.StandardRestore(abstract))
        else:
            out = ckpt.restore(f"{d}/{newest}", target)
        jax.block_until_ready(out)
        restore_s.append(time.perf_counter() - t0)
    return {"written": written[1:], "lost": lost[1:], "committed": committed[1:], "disk": disk,
            "restore": statistics.median(restore_s), "first_written": written[0]}


def _pretrain(args, sharding, root: str) -> dict:
    """Incremental off and on, alternating save by save over the same changing state (the
    machine's load drifts: alternation spreads it over both)."""
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
                c0, t0 = time.process_time(), time.perf_counter()
                mgrs[on].save(step, {"w": state})
                t1 = time.perf_counter()
                mgrs[on].wait_until_finished()
                if step:  # the first save has no base
                    out[on]["cpu_per_gib"].append((time.process_time() - c0) / (nbytes / 2**30))
                    out[on]["lost"].append(t1 - t0)
    finally:
        for m in mgrs.values():
            m.close()
    return out


def main() -> None:
    args = _args()
    t_start, load = time.perf_counter(), OtherLoad()
    sharding = NamedSharding(mesh(), P("data", "model"))
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
            modes.insert(0, "full")  # the restore column's reference
    try:
        lora = {}
        for mode in ([] if args.only_pretrain else modes):
            lora[mode] = _lora(args, sharding, mode, root)
            print(mode, {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in lora[mode].items()}, flush=True)
            shutil.rmtree(f"{root}/{mode}", ignore_errors=True)
            shutil.rmtree(f"{root}/{mode}-local", ignore_errors=True)
        pre = _pretrain(args, sharding, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    changed = 16 * MiB * 3  # adapters, mu, nu (float32)
    med = statistics.median
    off, on = pre[False], pre[True]
    pre_text = (f"Pretraining, everything changes ({args.base_mib} MiB, {args.pretrain_saves} saves each, incremental off "
                f"and on alternating): process CPU per save per GiB (save + wait, all threads): off "
                f"{med(off['cpu_per_gib']):.3f} CPU-s/GiB, on {med(on['cpu_per_gib']):.3f} CPU-s/GiB (the check: "
                f"{med(on['cpu_per_gib']) - med(off['cpu_per_gib']):+.3f} CPU-s/GiB; target ≤ 0.05); loop blocked per save "
                f"{med(off['lost']):.3f} s off, {med(on['lost']):.3f} s on.\n")
    if args.only_pretrain:
        body = header_lines(f"Incremental saves, pretraining loop (`benchmarks/incremental_bench.py --only-pretrain`), "
                            f"{args.base_mib} MiB", args, time.perf_counter() - t_start, load) + "\n" + pre_text
        print(body)
        write_section(args.results, "incremental_bench_pretrain", body)
        return
    rows = []
    for mode in modes:
        r = lora[mode]
        rows.append([mode, f"{med(r['written']) / MiB:.1f} MiB", f"{med(r['written']) / changed:.3f}×",
                     f"{med(r['lost']):.3f} s", f"{med(r['committed']):.3f} s", f"{r['disk'] / MiB:.0f} MiB",
                     f"{r['restore']:.3f} s ({r['restore'] / lora['full']['restore']:.2f}× full)"])
    body = header_lines(f"Incremental saves (`benchmarks/incremental_bench.py`), base {args.base_mib} MiB", args,
                        time.perf_counter() - t_start, load)
    body += (f"\nLoRA-style fine-tune: frozen base {args.base_mib} MiB, adapters 16 MiB + AdamW mu/nu (changed per "
             f"save: {changed / MiB:.0f} MiB), {args.steps} saves with KeepLatest(3), async; medians over saves 2..{args.steps}. "
             f"Target: bytes per save ≤ 1.05× the changed bytes plus metadata; disk ≤ base + 3 × changed "
             f"({(args.base_mib * MiB + 3 * changed) / MiB:.0f} MiB) plus metadata.\n\n")
    body += table(["mode", "bytes written / save", "÷ changed", "loop blocked / save", "until committed / save",
                   "disk at the end", "restore newest"], rows)
    body += "\n\n" + pre_text
    print(body)
    write_section(args.results, "incremental_bench", body)


if __name__ == "__main__":
    main()
