"""Two tiers benchmark: training blocked time and time to the first restore point, when the
durable tier is slower than local disk.

State: float32 arrays (default 256 MiB in 8 leaves) sharded P('data', 'model') over a 2x4 mesh
of 8 host devices. Each method saves steps 1..N (default 3) one after the other, as a training
loop would (--interval seconds of "training" between saves; the previous save may still
run), and the script prints per save, median over the saves:

  blocked        seconds `save` held the training loop (snapshot, plus any wait for the
                 previous save or for the local window).
  restore point  seconds from `save` until the step is a restore point: the local commit for
                 two tiers (this node's restart can resume from it), the durable commit for
                 a direct save and for Orbax.
  durable        seconds from `save` until the step is committed on the durable tier.

Methods, on the same slow durable tier:
  direct         CheckpointManager(durable)
  two tiers      CheckpointManager(durable, local_directory=<local tmp>, keep_local=KeepLatest(2))
  orbax          ocp.CheckpointManager(durable, enable_async_checkpointing=True) (StandardSave)

Durable tiers:
  rate-limited   a local directory; our managers pace their writes to it with
                 max_write_bytes_per_s (--rate MiB/s). Orbax cannot be paced: it writes the
                 same directory at full speed, so its row is a lower bound.
  s3 (moto)      --s3: a moto S3 server on 127.0.0.1 (tests/s3server.py). Orbax needs s3fs
                 for s3:// paths; where that is missing its row says so.

Not a timed test. Run:
  PYTHONPATH=. .venv/bin/python benchmarks/two_tier_bench.py [--mib 256] [--rate 100] [--steps 3] [--s3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec as P,  # noqa: E402
)

import checkpointer as ckpt  # noqa: E402

MiB = 2**20


def make_state(mib: int, leaves: int = 8) -> dict:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    per = mib * MiB // leaves // 4
    cols = 1024
    rows = max(8, per // cols // 8 * 8)
    sharding = NamedSharding(mesh, P("data", "model"))
    rng = np.random.default_rng(0)
    return {f"w{i}": jax.device_put(rng.standard_normal((rows, cols), np.float32), sharding) for i in range(leaves)}


def bump(state: dict) -> dict:
    return {k: v + 1.0 for k, v in state.items()}


class _Poller:
    """Records when each step first satisfies `probe(step)` (polled every 10 ms on a thread)."""

    def __init__(self, probes: dict):
        import threading

        self.probes, self.seen, self.started = probes, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for step in list(self.started):
                for name, probe in self.probes.items():
                    if (name, step) not in self.seen and probe(step):
                        self.seen[(name, step)] = time.perf_counter() - self.started[step]
            time.sleep(0.01)

    def stop(self, steps) -> None:
        deadline = time.monotonic() + 600
        while any((n, s) not in self.seen for n in self.probes for s in steps) and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join()


def _train_and_save(save, probes: dict, state: dict, steps: int, interval_s: float) -> dict:
    """The training loop: `interval_s` of "compute" (a sleep, the CPU stays free for the
    background writes), then a save, `steps` times; returns per-save seconds."""
    out: dict[str, list[float]] = {"blocked": []}
    poller = _Poller(probes)
    for step in range(1, steps + 1):
        time.sleep(interval_s)
        state = bump(state)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        poller.started[step] = t0
        save(step, state)
        out["blocked"].append(time.perf_counter() - t0)
    poller.stop(range(1, steps + 1))
    for name in probes:
        out[name] = [poller.seen[(name, s)] for s in range(1, steps + 1)]
    return out


def run_ours(durable: str, local: str | None, state: dict, steps: int, rate: float | None, interval_s: float) -> dict:
    """blocked / restore point / durable seconds per save (lists)."""
    mngr = ckpt.CheckpointManager(durable, local_directory=local, keep=ckpt.KeepLatest(2), keep_local=ckpt.KeepLatest(2),
                                  max_write_bytes_per_s=rate)
    # Cheap probes (a stat per poll; status() would list both tiers and compete for the CPU).
    if durable.startswith("s3://"):
        durable_probe = lambda s: (mngr.latest_step() or 0) >= s  # noqa: E731
    else:
        durable_probe = lambda s: os.path.exists(f"{durable}/{s}/COMMITTED")  # noqa: E731
    local_probe = (lambda s: os.path.exists(f"{local}/process-0/{s}/COMMITTED")) if local else durable_probe
    out = _train_and_save(mngr.save, {"restore_point": local_probe, "durable": durable_probe}, state, steps, interval_s)
    mngr.close()
    return out


def run_orbax(durable: str, state: dict, steps: int, interval_s: float) -> dict:
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(durable, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True,
                                                                               max_to_keep=2))
    # Orbax publishes a step by renaming its temporary folder to `<step>/` (local file system).
    probe = lambda s: os.path.isdir(f"{durable}/{s}")  # noqa: E731
    out = _train_and_save(lambda step, st: mngr.save(step, args=ocp.args.StandardSave(st)),
                          {"restore_point": probe, "durable": probe}, state, steps, interval_s)
    mngr.wait_until_finished()
    mngr.close()
    return out


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="state size, MiB (default 256)")
    ap.add_argument("--rate", type=float, default=100.0, help="rate-limited tier: MiB/s (default 100)")
    ap.add_argument("--steps", type=int, default=3, help="saves per method (default 3)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds of training between saves (default 1)")
    ap.add_argument("--dir", default=None, help="parent of the temporary folders")
    ap.add_argument("--s3", action="store_true", help="also use a moto S3 server as the durable tier")
    args = ap.parse_args()
    state = make_state(args.mib)
    print(f"state: {args.mib} MiB float32 in 8 leaves on a 2x4 mesh; {args.steps} saves per method; "
          f"jax {jax.__version__}; {os.cpu_count()} cpus", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rate = args.rate * MiB
        tier = f"rate-limited dir {args.rate:.0f} MiB/s"
        rows.append((tier, "direct", run_ours(f"{tmp}/direct", None, state, args.steps, rate, args.interval)))
        rows.append((tier, "two tiers", run_ours(f"{tmp}/tiers", f"{tmp}/local", state, args.steps, rate, args.interval)))
        rows.append((tier + " (orbax unpaced)", "orbax", run_orbax(f"{tmp}/orbax", state, args.steps, args.interval)))
        if args.s3:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from s3server import running_s3_server

            with running_s3_server() as server:
                bucket = server.new_bucket("bench")
                rows.append(("s3 (moto)", "direct", run_ours(f"s3://{bucket}/direct", None, state, args.steps, None, args.interval)))
                shutil.rmtree(f"{tmp}/local", ignore_errors=True)
                rows.append(("s3 (moto)", "two tiers",
                             run_ours(f"s3://{bucket}/tiers", f"{tmp}/local", state, args.steps, None, args.interval)))
                try:
                    rows.append(("s3 (moto)", "orbax", run_orbax(f"s3://{bucket}/orbax", state, args.steps, args.interval)))
                except Exception as e:  # s3fs missing, typically
                    print(f"orbax on s3://: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print("\n| durable tier | method | blocked s | restore point s | durable s |\n|---|---|---:|---:|---:|")
    for tier, method, r in rows:
        print(f"| {tier} | {method} | {med(r['blocked'])} | {med(r['restore_point'])} | {med(r['durable'])} |")


if __name__ == "__main__":
    main()
