"""A training-like loop that saves asynchronously every step, for the kill tests.

Usage: python crash_worker.py DIR KILL_POINT N
  KILL_POINT is `<hook>:<n>`: SIGKILL this process the n-th time <hook> runs, or
  `none` (run to the end). Hooks sit at the protocol's steps: `snapshot_done`,
  `chunks_issued`, `record_written`, `manifest_written`, `marker_written`, `renamed`,
  `retention_renamed`, `replace_moved_old`. The state of step s is filled with s.
"""

import os
import signal
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec as P,  # noqa: E402
)

import checkpointer as ckpt  # noqa: E402
from checkpointer._manage import _manager  # noqa: E402
from checkpointer._storage import _local as _storage

directory, kill_point, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
hook, _, nth = kill_point.partition(":")
counts: dict[str, int] = {}


def reached(name: str) -> None:
    counts[name] = counts.get(name, 0) + 1
    if name == hook and counts[name] == int(nth):
        print(f"killing at {name} #{nth}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def wrap(module, attr, before=None, after=None):
    real = getattr(module, attr)

    def wrapped(*args, **kwargs):
        if before:
            reached(before)
        out = real(*args, **kwargs)
        if after:
            reached(after)
        return out

    setattr(module, attr, wrapped)


wrap(_manager, "take_snapshot", after="snapshot_done")
_real_write_file = _storage.LocalStorage.write_file


def write_file(self, path, data):
    name = path.rsplit("/", 1)[-1]
    if name == "0.json":
        reached("chunks_issued")  # chunks are written, the record is next
    _real_write_file(self, path, data)
    reached({"0.json": "record_written", "manifest.json": "manifest_written", "COMMITTED": "marker_written"}.get(name, "other"))


_storage.LocalStorage.write_file = write_file
_real_rename = _storage.LocalStorage.rename


def rename(self, src, dst):
    _real_rename(self, src, dst)
    if ".deleting-gc" in dst:
        reached("retention_renamed")
    elif ".deleting-" in dst:
        reached("replace_moved_old")
    else:
        reached("renamed")


_storage.LocalStorage.rename = rename

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
sharding = NamedSharding(mesh, P("data", "model"))
with ckpt.CheckpointManager(directory, keep=ckpt.KeepLatest(2)) as mgr:
    start = (mgr.latest_step() or 0) + 1
    for step in range(start, start + steps):
        state = {"w": jax.device_put(jnp.full((64, 32), step, jnp.float32), sharding), "step": step}
        mgr.save(step, state, force=(step == start + 2))
    # A forced replacement of the newest step, to exercise the two-rename path.
    mgr.wait_until_finished()
    last = start + steps - 1
    mgr.save(last, {"w": jax.device_put(jnp.full((64, 32), last, jnp.float32), sharding), "step": last}, force=True)
print("finished", flush=True)
