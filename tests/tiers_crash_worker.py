"""Saves step 1 through two tiers, then SIGKILLs itself while step 2 is being replicated.

Usage: python tiers_crash_worker.py DIR LOCAL_DIR
Step s holds {"w": arange(64*32) + s on the 2x4 mesh, "step": s}. Step 1 is durable
before step 2 is saved; the second file copy of step 2's replication kills the process,
so step 2 is committed on the local tier and not on DIR.
"""

import os
import signal
import sys

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec as P,  # noqa: E402
)

import checkpointer as ckpt  # noqa: E402
from checkpointer._manage import _tiers  # noqa: E402

directory, local = sys.argv[1], sys.argv[2]
mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))


def state(step):
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step
    return {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b"))), "step": step}


with ckpt.CheckpointManager(directory, local_directory=local, keep_local=ckpt.KeepLatest(2)) as mngr:
    mngr.save(1, state(1))
    mngr.wait_until_finished()
    real = _tiers._copy_verified
    copies = []

    def copy_then_die(*a, **kw):
        copies.append(a[1])
        if len(copies) == 2:
            print("killing during replication", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)

    _tiers._copy_verified = copy_then_die
    mngr.save(2, state(2))
    mngr.wait_until_finished()
print("not killed", flush=True)
