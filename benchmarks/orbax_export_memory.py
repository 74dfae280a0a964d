"""Peak host memory of `export(..., format="orbax")` of one large leaf: the export reads and
writes one output chunk (at most `REGION_BYTES`, 64 MiB) at a time, whatever the leaf's size.

    PYTHONPATH=. .venv/bin/python benchmarks/orbax_export_memory.py [--mib 1024]

Saves a float32 leaf of --mib MiB (in a child process), then exports it in a fresh process and
prints that process's peak RSS before and during the export, and the export's rate.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time


def _child(path: str, mib: int) -> None:
    import numpy as np

    import checkpointer as ckpt

    rows = mib * (1 << 20) // (4 * 4096)
    ckpt.save(path, {"w": np.arange(rows * 4096, dtype=np.float32).reshape(rows, 4096)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="size of the leaf, MiB (default 1024)")
    ap.add_argument("--_save", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._save:
        _child(args._save, args.mib)
        return
    with tempfile.TemporaryDirectory(prefix="orbax_export_memory_") as tmp:
        src, out = os.path.join(tmp, "ckpt"), os.path.join(tmp, "orbax")
        subprocess.run([sys.executable, __file__, "--mib", str(args.mib), "--_save", src], check=True)
        import checkpointer as ckpt

        ckpt.metadata(src)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        t0 = time.perf_counter()
        report = ckpt.export(src, out, format="orbax")
        elapsed = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"leaf {report.total_bytes / 2**20:.0f} MiB: peak RSS {before:.0f} MiB before the export, {peak:.0f} MiB "
              f"after (+{peak - before:.0f} MiB); {elapsed:.1f} s, {report.total_bytes / 2**20 / elapsed:.0f} MiB/s")


if __name__ == "__main__":
    main()
