"""Two processes save with a CheckpointManager while process 0 runs `checkpointer status`
as a separate process on the directory in use (no lock): with a save in flight (process
1's write of step 2 held until released), after a failed save (process 1's write of
step 3 fails), and after a later step commits.

args: {"directory": path}
emits (process 0): {"event": "probes", "in_flight": .., "in_flight_bounded": .., "failing": .., "recovered": ..}
       each {"code": exit status, "doc": the --json document}; and {"event": "failures", "processes": [...]}
       (every process): {"event": "done", "all_steps": [...]}
"""

import json
import os
import subprocess
import sys
import time

import _common

args = _common.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import checkpointer as ckpt  # noqa: E402
import checkpointer._save._pipeline as save_mod  # noqa: E402
from checkpointer._manage import _alerts  # noqa: E402

_alerts.REQUESTED_EVERY_S = 0.0  # note every step handed to save: the lag is exact
directory = args["directory"]
flags = os.path.dirname(directory.rstrip("/"))
pidx = jax.process_index()
real_write = save_mod.write_snapshot


def wait_for(name):
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(flags, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} never appeared")
        time.sleep(0.02)


def mark(name):
    open(os.path.join(flags, name), "w").close()


def write(snap):
    if pidx == 1 and snap.step == 2:
        wait_for("release-2")  # step 2 stays in flight until process 0 has probed
    if pidx == 1 and snap.step == 3:
        raise ckpt.SaveError(f"injected: no space left on device on process {pidx}")
    return real_write(snap)


save_mod.write_snapshot = write


def probe(*extra):
    r = subprocess.run([sys.executable, "-m", "checkpointer._cli", "status", directory, "--json", *extra],
                       capture_output=True, text=True, timeout=120)
    return {"code": r.returncode, "doc": json.loads(r.stdout) if r.stdout.strip() else None, "stderr": r.stderr}


def probe_until(check, *extra):
    deadline = time.monotonic() + 60
    while True:
        got = probe(*extra)
        if (got["doc"] is not None and check(got["doc"])) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def tree(step):
    return {"w": np.full((64,), step, np.float32)}


probes = {}
with ckpt.CheckpointManager(directory, keep=ckpt.KeepLatest(10), commit_timeout_s=60) as mgr:
    mgr.save(1, tree(1))
    mgr.wait_until_finished()
    mgr.save(2, tree(2))  # process 1's write is held: step 2 in flight
    if pidx == 0:
        probes["in_flight"] = probe_until(lambda d: d["step_in_flight"] == 2 and d["last_requested_step"] == 2)
        probes["in_flight_bounded"] = probe("--max-lag-steps", "0")
        mark("release-2")
    mgr.wait_until_finished()
    mgr.save(3, tree(3))  # fails on process 1, so on both
    try:
        mgr.wait_until_finished()
    except ckpt.CheckpointError:
        pass
    mark(f"failed-3-{pidx}")
    if pidx == 0:
        wait_for("failed-3-1")  # process 1 has noted its failure
        probes["failing"] = probe()
        with open(os.path.join(directory, ".checkpointer-journal.jsonl"), encoding="utf-8") as f:
            noted = [json.loads(line) for line in f]
        _common.emit(event="failures", processes=sorted(e["process_index"] for e in noted
                                                        if e.get("event") == "save_failed" and e["step"] == 3))
    mgr.save(4, tree(4))
    mgr.wait_until_finished()
    if pidx == 0:
        probes["recovered"] = probe("--max-lag-steps", "0")
        _common.emit(event="probes", **probes)
    _common.emit(event="done", all_steps=mgr.all_steps())
