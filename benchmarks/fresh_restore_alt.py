"""Fresh-process restores of two checkouts, alternating per measurement (issue 28 items 2-3):
the plain read, BASE's checkpointer and this checkout's, each in a new process, onto the
saved 2x4 layout, a 4x2 mesh and 1x8 column blocks (P(None, 'model')), with wall time, user
and system CPU, minor page faults and `os.preadv` calls (the local reader's only read call)
over the restore. The state is `_common.make_state()` (1 GiB + 4 MiB), saved once by this
checkout under DIR. Order rotates per round; one warm-up round (bytecode caches, page cache).

Run:  .venv/bin/python benchmarks/fresh_restore_alt.py ROUNDS BASE DIR
      e.g. `... 2 /work/main /tmp/r3alt` (BASE: a checkout whose checkpointer package is
      imported with PYTHONPATH=BASE). Prints one line per measurement, then a markdown table.
"""
import json
import os
import resource
import subprocess
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = {"branch": HERE}
CKPT = ""

def child(tree, target):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    with open(CKPT + ".shapes") as f:
        shapes = json.load(f)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape((4, 2) if target == "4x2" else (1, 8) if target == "1x8 cols" else (2, 4)), ("data", "model"))
    spec = P(None, "model") if target == "1x8 cols" else P("data", "model")
    tgt = {k: jax.ShapeDtypeStruct(tuple(s), np.float32, sharding=NamedSharding(mesh, P() if k == "replicated" else spec)) for k, s in shapes.items()}
    calls = [0]
    real = os.preadv
    def spy(*a):
        calls[0] += 1
        return real(*a)
    os.preadv = spy
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if tree == "plain":
        from pathlib import Path

        files = sorted((str(p), p.stat().st_size) for p in Path(CKPT + "/arrays").rglob("*") if p.is_file())
        buf = np.empty(sum(n for _, n in files), np.uint8)
        view, off = memoryview(buf), 0
        for f, n in files:
            with open(f, "rb", buffering=0) as fh:
                end = off + n
                while off < end:
                    off += fh.readinto(view[off:end])
        out = {"x": buf}
    else:
        import checkpointer as ckpt
        out = jax.block_until_ready(ckpt.restore(CKPT, tgt))
    t1, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    s = sum(float(np.asarray(v[:1] if tree == "plain" else v.addressable_shards[0].data, np.float64).sum()) for v in out.values())
    print("RESULT " + json.dumps({"s": t1 - t0, "user": ru1.ru_utime - ru0.ru_utime, "sys": ru1.ru_stime - ru0.ru_stime,
                                   "faults": ru1.ru_minflt - ru0.ru_minflt, "preadv": calls[0], "check": s}))

def run(tree, target):
    # Bytecode on even under PYTHONDONTWRITEBYTECODE (as `_common` does for the bench's
    # children): else every child compiles the library's sources inside the timer.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=TREES.get(tree, TREES["branch"]), PYTHONPYCACHEPREFIX=os.path.join(os.path.dirname(CKPT), f"pyc-{tree}"))
    p = subprocess.run([sys.executable, __file__, "--child", tree, target, CKPT], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(p.stderr[-3000:])

if __name__ == "__main__":
    if sys.argv[1] == "--child":
        CKPT = sys.argv[4]
        child(sys.argv[2], sys.argv[3])
        sys.exit()
    rounds, TREES["main"], CKPT = int(sys.argv[1]), sys.argv[2], os.path.join(sys.argv[3], "ckpt")
    if not os.path.exists(CKPT):
        sys.path.insert(0, os.path.join(HERE, "benchmarks"))
        import _common as C

        import checkpointer as ckpt
        state = C.make_state()
        ckpt.save(CKPT, state)
        with open(CKPT + ".shapes", "w") as f:
            json.dump({k: list(v.shape) for k, v in state.items()}, f)
        del state
    res = {}
    targets = ["same", "4x2", "1x8 cols"]
    for t in targets:  # warm-up: bytecode caches, page cache
        for tree in ("plain", "main", "branch"):
            run(tree, t)
    for r in range(rounds):
        for t in targets:
            order = ("plain", "main", "branch") if r % 2 == 0 else ("branch", "main", "plain")
            for tree in order:
                x = run(tree, t)
                res.setdefault((t, tree), []).append(x)
                print(r, t, tree, json.dumps(x), flush=True)
    import statistics as st

    print("| target | method | time (median, min-max) | user | sys | faults | preadv calls |")
    print("|---|---|---|---|---|---|---|")
    for t in targets:
        for tree in ("plain", "main", "branch"):
            xs = res[t, tree]
            med = {k: st.median(x[k] for x in xs) for k in ("s", "user", "sys", "faults", "preadv")}
            lo, hi = min(x["s"] for x in xs), max(x["s"] for x in xs)
            print(f"| {t} | {tree} | {med['s']:.3f} s ({lo:.3f}-{hi:.3f}) | {med['user']:.2f} s | {med['sys']:.2f} s "
                  f"| {med['faults'] / 1e3:.0f} k | {med['preadv']:.0f} |")
