"""safetensors onto a mesh: `ckpt.restore_safetensors` against `safetensors.flax.load_file`
+ `jax.device_put`, and Orbax's v1 safetensors loader (`ocp.v1.load` with the SAFETENSORS
layout) where the installed orbax has one, in one run (issue 21 item 2).

File: one `model.safetensors` written by `safetensors.numpy.save_file`: 8 bfloat16 tensors
of (2048, 4096) (128 MiB; --quick: (256, 4096), 16 MiB), flat names (`t0` … `t7`).

Targets, on a 2x4 ('data', 'model') mesh of 8 host (CPU) devices:
  columns     P(None, 'model'): sharded on the second (non-leading) axis, so every
              device's box is a set of row runs of the file
  replicated  P(): every tensor on all 8 devices

Each measurement: gc and malloc_trim, then the load until `jax.block_until_ready`, its wall
time, the peak RSS rise (sampled every 5 ms) and the bytes the process read(2) meanwhile
(psutil `read_chars`; `load_file` maps the file instead, so its cell says the whole file,
which it materialises by design). For checkpointer the restore's own count is shown too,
with its number of data reads (each one `preadv` call here, one GET on an object store;
issue 28 item 3: at most one per MiB needed), and is compared with what this process's shards need (the file's bytes: one process holds
every device here; tests/test_safetensors_restore.py checks the per-process count with
two real processes). Methods rotate order per run; one warm-up round checks every result
against the file, bit for bit. Page cache warm (it cannot be dropped here).

Run:  .venv/bin/python benchmarks/safetensors_bench.py [--runs 5] [--quick] [--dir /tmp]
      Prints a markdown table and replaces the safetensors_bench section of
      benchmarks/RESULTS.md (--quick: 1 run of the small file, RESULTS.md untouched unless
      --results is given).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from checkpointer._encoding import RestoreStats  # noqa: E402
from checkpointer._restore import RestoreOptions  # noqa: E402
from checkpointer._restore._safetensors import read_safetensors  # noqa: E402
from checkpointer._storage import storage_for  # noqa: E402

N_TENSORS = 8
TARGETS = {"columns": P(None, "model"), "replicated": P()}
TIME_LIMIT, BYTES_LIMIT = 1.0, 1.05
READS_PER_MIB_LIMIT = 1.0  # issue 28 item 3: the restore's ranged reads (each one read call or request)


def _orbax_v1():
    """orbax's v1 API if it has the safetensors layout, else None."""
    try:
        from orbax.checkpoint import v1 as ocp

        ocp.options.CheckpointLayout.SAFETENSORS  # noqa: B018 (does this version have it?)
        return ocp
    except (ImportError, AttributeError):
        return None


def _write(folder: str, rows: int) -> tuple[str, dict]:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((rows, 4096), np.float32).astype(ml_dtypes.bfloat16) for i in range(N_TENSORS)}
    os.makedirs(folder, exist_ok=True)
    file = os.path.join(folder, "model.safetensors")
    save_file(tensors, file)
    return file, tensors


def _load_checkpointer(file, target, stats):
    return read_safetensors(*storage_for(file), target, RestoreOptions(), stats=stats)


def _load_safetensors(file, target, stats):
    from safetensors.flax import load_file

    tree = load_file(file)
    return jax.device_put(tree, {k: v.sharding for k, v in target.items()})


def _load_orbax(file, target, stats):
    ocp = _orbax_v1()
    with ocp.Context(checkpoint_layout=ocp.options.CheckpointLayout.SAFETENSORS):
        return ocp.load(os.path.dirname(file), abstract_state=target)


def _same(out, tensors) -> bool:
    return all(np.asarray(out[k]).view(np.uint16).tobytes() == v.view(np.uint16).tobytes() for k, v in tensors.items())


def main():
    args = _common.parse_args(__doc__)
    load = _common.OtherLoad()
    t_script = time.perf_counter()
    rows = 2048 // args.scale
    tmp = tempfile.mkdtemp(prefix="st-bench-", dir=args.dir)
    try:
        file, tensors = _write(os.path.join(tmp, "hf"), rows)
        size = os.path.getsize(file)
        mesh = _common.mesh((2, 4), ("data", "model"))
        methods = {"checkpointer restore_safetensors": _load_checkpointer, "safetensors.flax.load_file + device_put": _load_safetensors}
        if _orbax_v1() is not None:
            methods["orbax v1 load (SAFETENSORS layout)"] = _load_orbax
        results: dict = {}
        notes: list[str] = []
        proc = psutil.Process()
        for tname, spec in TARGETS.items():
            target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec)) for k, v in tensors.items()}
            for mname, fn in methods.items():  # warm-up and check
                try:
                    out = jax.block_until_ready(fn(file, target, RestoreStats()))
                    if not _same(out, tensors):
                        notes.append(f"{mname} on {tname}: result differs from the file")
                    del out
                except Exception as e:  # a loader this version cannot run on this target: say so
                    notes.append(f"{mname} on {tname}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    results[(tname, mname)] = None
            for run in range(args.runs):
                order = list(methods)
                order = order[run % len(order):] + order[: run % len(order)]
                for mname in order:
                    if results.get((tname, mname), []) is None:
                        continue
                    stats = RestoreStats()
                    r0 = proc.io_counters().read_chars
                    with _common.Measure() as m:
                        out = jax.block_until_ready(methods[mname](file, target, stats))
                    read = proc.io_counters().read_chars - r0
                    del out
                    cell = results.setdefault((tname, mname), [])
                    cell.append((m.seconds, m.peak_delta, read, stats.bytes_read, stats.chunk_reads))
        body = [_common.header_lines("safetensors onto a mesh (`benchmarks/safetensors_bench.py`)", args,
                                     time.perf_counter() - t_script, load)]
        body.append(f"File: one `model.safetensors`, {N_TENSORS} × bfloat16 ({rows}, 4096), {size / 2**20:.0f} MiB; "
                    "targets on a 2x4 mesh of 8 CPU devices, one process (it holds every device, so its shards need "
                    "the whole file). Bytes: read(2) bytes of the process during the load (`load_file` maps the file: "
                    "it materialises all of it).\n")
        table_rows, ratios = [], []
        for tname in TARGETS:
            for mname in methods:
                cells = results.get((tname, mname))
                if not cells:
                    table_rows.append([tname, mname, "failed (see notes)", "—", "—"])
                    continue
                secs = [c[0] for c in cells]
                peak = [c[1] / 2**20 for c in cells]
                read = [c[2] / 2**20 for c in cells]
                if mname.startswith("safetensors"):
                    read_cell = f"{size / 2**20:.0f} MiB (whole file, mapped)"
                elif mname.startswith("checkpointer"):
                    read_cell = (f"{_common.fmt(read, 'MiB', 1)} (restore's count {cells[0][3] / 2**20:.1f} MiB "
                                 f"in {cells[0][4]} reads)")
                else:
                    read_cell = _common.fmt(read, "MiB", 1)
                table_rows.append([tname, mname, _common.fmt(secs), _common.fmt(peak, "MiB", 0), read_cell])
            ours = results.get((tname, "checkpointer restore_safetensors"))
            theirs = results.get((tname, "safetensors.flax.load_file + device_put"))
            if ours and theirs:
                r = float(np.median([c[0] for c in ours]) / np.median([c[0] for c in theirs]))
                ratios.append([f"{tname}: time / load_file + device_put", f"{r:.2f}×", f"≤ {TIME_LIMIT}×",
                               "met" if r <= TIME_LIMIT else f"missed ({r / TIME_LIMIT:.2f}× the target)"])
                b = ours[0][3] / size
                ratios.append([f"{tname}: bytes read / bytes its shards need", f"{b:.3f}×", f"≤ {BYTES_LIMIT}×",
                               "met" if b <= BYTES_LIMIT else "missed"])
                per_mib = ours[0][4] / (size / 2**20)
                ratios.append([f"{tname}: data reads per MiB its shards need", f"{per_mib:.3f}", f"≤ {READS_PER_MIB_LIMIT}",
                               "met" if per_mib <= READS_PER_MIB_LIMIT else "missed"])
            orb = results.get((tname, "orbax v1 load (SAFETENSORS layout)"))
            if ours and orb:
                r = float(np.median([c[0] for c in ours]) / np.median([c[0] for c in orb]))
                ratios.append([f"{tname}: time / orbax v1 load", f"{r:.2f}×", "—", ""])
        body.append(_common.table(["target", "method", "time", "peak RSS rise", "bytes read"], table_rows))
        body.append("")
        body.append(_common.table(["ratio of medians", "value", "target", ""], ratios))
        if notes:
            body.append("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
        text = "\n".join(body) + "\n"
        print(text)
        _common.write_section(args.results, "safetensors_bench", text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
