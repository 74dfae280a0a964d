"""Listing benchmark: `all_steps()` / `latest_step()` on S3 with and without the step catalog.

A moto S3 server (tests/s3server.py: the real S3 REST protocol over loopback HTTP, reached
through TensorStore's `s3` driver) holds a run directory of 50 committed steps x 1,000
objects each (999 tiny chunk objects plus the `COMMITTED` marker; uploaded with boto3,
which is not timed). Timed, each the median of --runs calls on a fresh `storage_for`:

  full listing  `_directory.committed_steps` on the directory without a catalog (what
                every reader did before, and still does on directories of older releases):
                TensorStore lists every key under the directory.
  catalog       the same call after `_catalog.repair` (what a manager's start does once)
                built the catalog: a listing of `DIR/.checkpointer-catalog/` and one
                marker read per step.
  repair        the one-off `_catalog.repair` (one full listing plus the writes).

Run:  PYTHONPATH=.:tests .venv/bin/python benchmarks/listing_bench.py [--steps 50]
      [--files 1000] [--runs 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from s3server import running_s3_server

from checkpointer._commit import _catalog, _directory
from checkpointer._storage._kvstore import storage_for


def _timed(fn, runs: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--files", type=int, default=1000, help="objects per step, marker included")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with running_s3_server() as s3:
        bucket = s3.new_bucket("listing")
        steps = [100 * (i + 1) for i in range(args.steps)]
        keys = [f"run/{s}/arrays/w{j // 100}/c/{j % 100}" for s in steps for j in range(args.files - 1)]
        keys += [f"run/{s}/COMMITTED" for s in steps]
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: s3.client.put_object(Bucket=bucket, Key=k, Body=b"x" * 16), keys))
        print(f"uploaded {len(keys)} objects in {time.perf_counter() - t0:.0f} s (not timed below)", flush=True)
        directory = f"s3://{bucket}/run"

        def listed():
            storage, d = storage_for(directory)
            return _directory.committed_steps(storage, d)

        full_s, full = _timed(listed, args.runs)
        storage, d = storage_for(directory)
        t0 = time.perf_counter()
        _catalog.repair(storage, d)
        repair_s = time.perf_counter() - t0
        cat_s, cat = _timed(listed, args.runs)
        assert full == cat == steps, (full, cat)
        print(f"{args.steps} steps x {args.files} objects ({len(keys)} keys), median of {args.runs} runs, "
              f"moto {s3.endpoint}")
        print("| all_steps() | seconds | keys listed | requests |")
        print("|---|---:|---:|---:|")
        print(f"| full listing (no catalog) | {full_s:.3f} | {len(keys)} | {(len(keys) + 999) // 1000} LIST pages |")
        print(f"| catalog | {cat_s:.3f} | {args.steps + 1} | 1 LIST + {args.steps} GET |")
        print(f"| speed-up | {full_s / cat_s:.0f}x | | |")
        print(f"| one-off repair (builds the catalog) | {repair_s:.3f} | | |")


if __name__ == "__main__":
    main()
