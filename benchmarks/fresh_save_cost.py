"""One save in a fresh process: its CPU seconds and its peak host memory, for save_bench.py.

Run by `benchmarks/save_bench.py` (one process per library, case and run; it can be run
alone too). The process builds the case's device arrays, makes one small warm-up save
with the same library and mode (so one-time costs — lazy imports, TensorStore's context,
Orbax's handlers — are not counted; checkpointer's warm-up buffers are then freed with
`ckpt.release_host_buffers()`, so the measured save starts without any), then measures
one save of the case until it is committed:

  cpu_s        user + system CPU seconds of the whole process (getrusage, every thread)
               from the call to committed;
  peak_rise    the peak resident set during the save (VmHWM, reset through
               /proc/self/clear_refs just before the call) minus the resident set before
               it, bytes;
  bytes_written  the bytes of the checkpoint folder once committed (data, indexes,
               metadata).

Libraries: `direct` (ckpt.save, direct_io=True), `buffered` (ckpt.save, direct_io=False:
TensorStore writes every file), `orbax` (ocp.CheckpointManager, async, save then
wait_until_finished; manager construction and close not counted).
Cases: `state` (the save_bench state: 16 × float32 4096² on a 2x4 mesh + one replicated
1024², 1 GiB; `--scale 8`: 1/8 of it) and `array64` (one float32 4096² array on one
device: 64 MiB, one chunk).

Run:  .venv/bin/python benchmarks/fresh_save_cost.py LIBRARY CASE [--scale 1] [--dir /tmp]
      prints one JSON line.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

LIBRARIES = ("direct", "buffered", "orbax")
CASES = ("state", "array64")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Resets VmHWM to the current RSS (Linux ≥ 4.0); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def build(case: str, scale: int):
    if case == "state":
        return C.make_state(scale)
    x = jax.jit(lambda: C._fill((4096, 4096), 7), out_shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))()
    return {"x": jax.block_until_ready(x)}


def saver(library: str):
    """`save(path, tree)` of the library, until committed."""
    if library == "orbax":
        import absl.logging
        import orbax.checkpoint as ocp

        absl.logging.set_verbosity(absl.logging.ERROR)

        def save(path, tree):
            mgr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
            try:
                t0 = time.perf_counter()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                mgr.save(0, args=ocp.args.StandardSave(tree))
                mgr.wait_until_finished()
                return t0, r0
            finally:
                mgr.close()

        return save
    import checkpointer as ckpt

    def save(path, tree):
        t0 = time.perf_counter()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        ckpt.save(path, tree, direct_io=library == "direct")
        return t0, r0

    return save


def measure(library: str, case: str, scale: int, parent: str | None) -> dict:
    tree = build(case, scale)
    save = saver(library)
    d = tempfile.mkdtemp(prefix="fresh_save_cost_", dir=parent)
    try:
        save(f"{d}/warmup", {"x": jax.device_put(np.ones(1 << 12, np.float32))})
        if library != "orbax":
            import checkpointer as ckpt

            ckpt.release_host_buffers()
        shutil.rmtree(f"{d}/warmup")
        gc.collect()
        C._malloc_trim()
        hwm_ok = _reset_peak()
        rss0 = _status_kib("VmRSS") << 10
        t0, r0 = save(f"{d}/ckpt", tree)
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        peak = (_status_kib("VmHWM") << 10) if hwm_ok else None
        written = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(f"{d}/ckpt") for f in fs)
        mode = None
        if library != "orbax":
            rec = next(Path(d, "ckpt", "processes").glob("*.json"))
            mode = json.loads(rec.read_text()).get("write_mode")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"library": library, "case": case, "scale": scale, "write_mode": mode,
            "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
            "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime, "wall_s": t1 - t0,
            "peak_rise": None if peak is None else peak - rss0, "bytes_written": written,
            "logical_bytes": C.logical_bytes(tree)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("library", choices=LIBRARIES)
    ap.add_argument("case", choices=CASES)
    ap.add_argument("--scale", type=int, default=1, choices=(1, 8))
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    print(json.dumps(measure(args.library, args.case, args.scale, args.dir)), flush=True)


if __name__ == "__main__":
    main()
