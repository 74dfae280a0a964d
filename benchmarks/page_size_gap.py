"""Fresh-process restores of fresh_restore_bench's 1 GiB state (same 2x4 mesh), huge pages
against 4 KiB pages (`CHECKPOINTER_HUGE_PAGES`), alternating, with a pause of GAP seconds
before each child: on a guest with free page reporting, the memory the previous child freed
is reported to the host after about 2 s, and a huge page from a reported block faults in
the host at its first touch (docs/DESIGN-decisions.md, "Huge pages only where they pay").

Run:  .venv/bin/python benchmarks/page_size_gap.py RUNS GAP[,GAP...]   e.g. 4 0.3,8
"""
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C
import fresh_restore_bench as F

import checkpointer as ckpt

runs = int(sys.argv[1])
gaps = [float(g) for g in sys.argv[2].split(",")]
root = tempfile.mkdtemp(prefix="gap_exp_", dir=None)
state = C.make_state(1)
shapes = {k: list(v.shape) for k, v in state.items()}
ckpt.save(f"{root}/ckpt/0", state)
del state
res = {}
for run in range(-1, runs):
    for gap in gaps:
        for pages in (["1", "0"] if run % 2 else ["0", "1"]):
            time.sleep(gap)
            spec = {"method": F.OTHER_PAGES, "other_pages": pages, "target": "same", "shapes": shapes,
                    "ckpt": f"{root}/ckpt/0", "orbax": "", "check": False}
            C.set_page_cache([f"{root}/ckpt/0"], "warm")
            r = C.run_child(F.__file__, spec, f"{root}/pycache")
            if run >= 0:
                res.setdefault((gap, pages), []).append(r)
            print(f"run {run} gap {gap:4.1f} s {'huge' if pages == '1' else '4k  '}: {r['s']:.3f} s sys {r['sys_s']:.2f} user {r['user_s']:.2f} faults {r['minflt']//1000} k", flush=True)
shutil.rmtree(root)
for (gap, pages), rs in sorted(res.items()):
    print(f"gap {gap:4.1f} {'huge' if pages == '1' else '4k  '}: median {statistics.median(r['s'] for r in rs):.3f} s "
          f"(min {min(r['s'] for r in rs):.3f} max {max(r['s'] for r in rs):.3f}) sys {statistics.median(r['sys_s'] for r in rs):.2f}")
