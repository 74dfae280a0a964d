"""Time to the first trained step of a resumed job: restore + the first donating jitted step,
each measurement in a fresh Python process (issue 20, item 4).

State: the one of benchmarks/fresh_restore_bench.py (`_common.make_state`): 16 float32
arrays of 4096x4096 saved P('data', 'model') on a 2x4 mesh of 8 host (CPU) devices plus one
float32 1024x1024 saved P(): 1 GiB + 4 MiB (1/8 with --quick), saved once with `ckpt.save`,
once with orbax (CheckpointManager + StandardSave) and once as one raw file per leaf (its
bytes in C order) by the parent process.

Targets: the same 2x4 mesh, and a 4x2 mesh, P('data', 'model') (the replicated leaf P()).

Each measurement runs in a fresh child process (`--child`): it imports jax, builds the
target (jax.ShapeDtypeStruct leaves) and compiles the training step for it, a jitted
SGD-like update of every leaf (`w - 1e-3 * tanh(w)`) with `donate_argnums=0` and the
target's shardings out (compiled before the timer, as a resumed job does while its data
loader starts). Then, timed:
  restore       plain read: np.fromfile of each leaf's raw file + jax.device_put onto the
                target sharding; checkpointer: `import checkpointer` + ckpt.restore;
                orbax: `import orbax.checkpoint` + CheckpointManager(path).restore(0,
                args=StandardRestore(target)); until jax.block_until_ready.
  first step    the compiled step on the restored state, until block_until_ready.
The child also reports the user/system CPU seconds and minor page faults of each part
(getrusage) and how many of the step's output buffers reuse a restored (donated) buffer.
Before each measurement every library's files are put in the same page-cache state
(`--page-cache`: read once, the default, or evicted). Methods rotated per run; one warm-up
round (not counted) checks that every restore returns the saved values.

Run:  .venv/bin/python benchmarks/first_step_bench.py [--runs 5] [--quick] [--dir /tmp]
      [--page-cache warm|cold]   (or `make bench`). Replaces the first_step_bench section of
      benchmarks/RESULTS.md (--quick: 1/8 of the state, 1 run, RESULTS.md untouched unless
      --results is given).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ["plain read", "checkpointer", "orbax"]
TARGETS = {"same": "same: 2x4 P('data','model')", "4x2": "4x2 mesh P('data','model')"}
ORBAX_LIMIT = 0.6


def _target(state_shapes: dict, which: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape((4, 2) if which == "4x2" else (2, 4)), ("data", "model"))
    big, small = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
    return {k: jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=small if k == "replicated" else big)
            for k, s in state_shapes.items()}


def _usage(ru0, ru1) -> dict:
    return {"user_s": ru1.ru_utime - ru0.ru_utime, "sys_s": ru1.ru_stime - ru0.ru_stime, "minflt": ru1.ru_minflt - ru0.ru_minflt}


def child(spec: dict) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import absl.logging
    import jax
    import jax.numpy as jnp
    import numpy as np

    absl.logging.set_verbosity(absl.logging.ERROR)
    method = spec["method"]
    tgt = _target(spec["shapes"], spec["target"])
    shardings = {k: v.sharding for k, v in tgt.items()}
    step = jax.jit(lambda s: {k: v - 1e-3 * jnp.tanh(v) for k, v in s.items()}, donate_argnums=0, out_shardings=shardings)
    step = step.lower(tgt).compile()
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if method == "plain read":
        state = jax.block_until_ready(
            {k: jax.device_put(np.fromfile(f"{spec['raw']}/{k}.bin", np.float32).reshape(v.shape), v.sharding) for k, v in tgt.items()})
    elif method == "checkpointer":
        import checkpointer as ckpt

        state = jax.block_until_ready(ckpt.restore(spec["ckpt"], tgt))
    else:
        import orbax.checkpoint as ocp

        mgr = ocp.CheckpointManager(spec["orbax"])
        state = jax.block_until_ready(mgr.restore(0, args=ocp.args.StandardRestore(tgt)))
    t1, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    res = {"restore_s": t1 - t0, "restore": _usage(ru0, ru1)}
    sums = {k: float(np.asarray(v, np.float64).sum()) for k, v in state.items()} if spec["check"] else None
    before = {s.data.unsafe_buffer_pointer() for v in state.values() for s in v.addressable_shards}
    ru1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = jax.block_until_ready(step(state))
    t2, ru2 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    after = [s.data.unsafe_buffer_pointer() for v in out.values() for s in v.addressable_shards]
    res.update({"step_s": t2 - t1, "step": _usage(ru1, ru2), "reused": sum(p in before for p in after), "buffers": len(after),
                "deleted": sum(v.is_deleted() for v in state.values()), "leaves": len(state), "sums": sums})
    if method == "orbax":
        mgr.close()
    print("RESULT " + json.dumps(res), flush=True)


def _med(rs, key) -> float:
    return statistics.median(r[key] for r in rs)


def report(C, args, res, logical, wall_s, load) -> str:
    rows, tgt_rows, where = [], [], []
    for t, tname in TARGETS.items():
        for name in METHODS:
            r = res[t][name]
            rows.append([tname if name == METHODS[0] else "", name, C.fmt([x["restore_s"] for x in r]),
                         f"{_med([x['restore'] for x in r], 'user_s'):.2f} / {_med([x['restore'] for x in r], 'sys_s'):.2f} s / "
                         f"{_med([x['restore'] for x in r], 'minflt') / 1e3:.0f} k" if r else "—",
                         C.fmt([x["step_s"] for x in r]), C.fmt([x["restore_s"] + x["step_s"] for x in r]),
                         f"{statistics.median(x['step']['sys_s'] for x in r):.2f} s / {_med([x['step'] for x in r], 'minflt') / 1e3:.0f} k"
                         if r else "—",
                         f"{r[-1]['reused']}/{r[-1]['buffers']}, {r[-1]['deleted']}/{r[-1]['leaves']}" if r else "—"])
        tot = {n: statistics.median(x["restore_s"] + x["step_s"] for x in res[t][n]) for n in METHODS}
        rst = {n: _med(res[t][n], "restore_s") for n in METHODS}
        stp = {n: _med(res[t][n], "step_s") for n in METHODS}
        where.append(f"- {tname}: restore {rst['checkpointer']:.3f} s ({rst['checkpointer'] - rst['plain read']:+.3f} s against the "
                     f"plain read's, {rst['checkpointer'] - rst['orbax']:+.3f} s against orbax's), first step {stp['checkpointer']:.3f} s "
                     f"({stp['checkpointer'] - stp['plain read']:+.3f} s against the plain read's, {stp['checkpointer'] - stp['orbax']:+.3f} s "
                     "against orbax's)")
        for other, limit in (("orbax", ORBAX_LIMIT), ("plain read", None)):
            v = tot["checkpointer"] / tot[other]
            verdict = "" if limit is None else ("met" if v <= limit else f"missed ({v / limit:.2f}× the target)")
            tgt_rows.append([f"checkpointer / {other}", tname, f"{v:.2f}×", f"≤ {limit}×" if limit else "(for reference)", verdict])
    big, small = C.shapes(args.scale)
    desc = (f"State: {C.N_LEAVES} × float32 {big} saved P('data','model') on a 2x4 mesh + float32 {small} saved P(); "
            f"logical bytes {logical / 2**20:.0f} MiB. Every measurement in a fresh Python process: jax imported, the target "
            "built and the donating step (`w - 1e-3 * tanh(w)` per leaf, `donate_argnums=0`) compiled before the timer; "
            "restore: the library's import and restore until block_until_ready (plain read: np.fromfile of one raw file "
            "per leaf + jax.device_put); first step: the compiled step on the restored state until block_until_ready. "
            "restore user / sys / faults: CPU seconds and minor page faults of the restore (median); step sys / faults: the step's system CPU seconds and minor page faults (median; fresh allocations show "
            "here); reused / deleted: the step's output buffers that reuse a donated restored buffer, and the restored "
            "leaves deleted by the donation (last run). Order rotated per run, 1 warm-up round that checks the values.")
    return "\n".join([C.header_lines("Time to the first trained step (`benchmarks/first_step_bench.py`)", args, wall_s, load), desc, "",
                      C.table(["target", "method", "restore", "restore user / sys / faults", "first step", "restore + step", "step sys / faults",
                               "reused, deleted"], rows), "", "Where checkpointer's time goes (medians):", "", *where,
                      "", "Against the target of issue 20 item 4 (ratios of the median restore + first step):", "",
                      C.table(["ratio", "target layout", "value", "target", ""], tgt_rows)])


def main() -> None:
    import _common as C
    import absl.logging
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    import checkpointer as ckpt

    absl.logging.set_verbosity(absl.logging.ERROR)
    args = C.parse_args(__doc__, C.page_cache_argument)
    t0, load = time.perf_counter(), C.OtherLoad()
    root = tempfile.mkdtemp(prefix="first_step_bench_", dir=args.dir)
    try:
        state = C.make_state(args.scale)
        logical = C.logical_bytes(state)
        cpath, opath, raw = f"{root}/ckpt/0", f"{root}/orbax", f"{root}/raw"
        ckpt.save(cpath, state)
        with ocp.CheckpointManager(opath) as mgr:
            mgr.save(0, args=ocp.args.StandardSave(state))
            mgr.wait_until_finished()
        os.makedirs(raw)
        for k, v in state.items():
            np.asarray(v).tofile(f"{raw}/{k}.bin")
        sums = {k: float(np.asarray(v, np.float64).sum()) for k, v in state.items()}
        shapes = {k: list(v.shape) for k, v in state.items()}
        del state
        print(f"devices: {jax.device_count()} × {jax.devices()[0].platform}; runs: {args.runs}; warm-up round first; "
              f"one fresh process per measurement; page cache {args.page_cache} before each")
        res = {t: {n: [] for n in METHODS} for t in TARGETS}
        for run in range(-1, args.runs):
            for t in TARGETS:
                k = run % len(METHODS)
                for name in METHODS[k:] + METHODS[:k]:
                    spec = {"method": name, "target": t, "shapes": shapes, "ckpt": cpath, "orbax": opath, "raw": raw, "check": run < 0}
                    C.set_page_cache([cpath, opath, raw], args.page_cache)
                    r = C.run_child(__file__, spec, f"{root}/pycache")
                    if run < 0 and r["sums"] != sums:
                        raise SystemExit(f"{name} restored wrong values onto {t}: {r['sums']} != {sums}")
                    if run >= 0:
                        res[t][name].append(r)
                    print(f"  run {run if run >= 0 else 'warm-up'}: {t:5s} {name:12s} restore {r['restore_s']:.3f} s + step "
                          f"{r['step_s']:.3f} s (step sys {r['step']['sys_s']:.2f} s, {r['step']['minflt'] / 1e3:.0f} k faults; "
                          f"{r['reused']}/{r['buffers']} buffers reused)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = report(C, args, res, logical, time.perf_counter() - t0, load)
    print("\n" + text)
    C.write_section(args.results, "first_step_bench", text)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()
