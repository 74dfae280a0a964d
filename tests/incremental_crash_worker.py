"""Incremental saves with retention, for the kill tests of retention (issue 30).

Usage: python incremental_crash_worker.py DIR KILL_POINT [LOCAL]
  KILL_POINT is `<hook>:<n>`: SIGKILL this process the n-th time <hook> runs, or `none`.
  LOCAL: a two-tier manager (`local_directory=LOCAL`, keep_local=KeepLatest(2)); the
  hooks then count the retention of both tiers.
  Hooks: `refs_read` (retention read a step's references), `retention_renamed` (a step
  moved aside: unpublished), `retention_deleted` (its bytes removed); on object stores
  (DIR an `s3://` URL): `catalog` (its marker deleted, its catalog entry not yet removed),
  `unpublished` (both done), `kv_deleted` (its objects removed); retired steps:
  `retired` (a step's RETIRED marker written, nothing pruned yet), `pruned` (POSIX: one
  unreferenced chunk file of a retired step deleted).
The base changes at step 4 (steps before it reference step 0's base, later ones step 4's);
the adapter changes every other step (odd steps reference the even step before).
The adapter of step s is filled with s - s % 2; the tree's "step" is s.
"""

import os
import signal
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec as P,  # noqa: E402
)

import checkpointer as ckpt  # noqa: E402
from checkpointer import _commit  # noqa: E402
from checkpointer._commit import _directory  # noqa: E402
from checkpointer._manage import _maintenance  # noqa: E402
from checkpointer._storage import (
    _kvstore,  # noqa: E402
    _local as _storage,  # noqa: E402
)

directory, kill_point = sys.argv[1], sys.argv[2]
tiers = {"local_directory": sys.argv[3], "keep_local": ckpt.KeepLatest(2)} if len(sys.argv) > 3 else {}
hook, _, nth = kill_point.partition(":")
counts: dict[str, int] = {}


def reached(name: str) -> None:
    counts[name] = counts.get(name, 0) + 1
    if name == hook and counts[name] == int(nth):
        print(f"killing at {name} #{nth}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


_real_refs = _maintenance.referenced_steps


def referenced_steps(*args):
    out = _real_refs(*args)
    reached("refs_read")
    return out


_maintenance.referenced_steps = referenced_steps
_real_rename = _storage.LocalStorage.rename


def rename(self, src, dst):
    _real_rename(self, src, dst)
    if ".deleting-gc" in dst:
        reached("retention_renamed")


_storage.LocalStorage.rename = rename
_real_delete = _storage.LocalStorage.delete_tree


def delete_tree(self, path):
    _real_delete(self, path)
    if ".deleting-gc" in path:
        reached("retention_deleted")


_storage.LocalStorage.delete_tree = delete_tree
_real_remove_entry = _directory._catalog.remove_entry


def remove_entry(*args, **kwargs):
    reached("catalog")
    return _real_remove_entry(*args, **kwargs)


_directory._catalog.remove_entry = remove_entry
_real_unpublish = _commit.unpublish_step


def unpublish_step(*args, **kwargs):
    out = _real_unpublish(*args, **kwargs)
    reached("unpublished")
    return out


_commit.unpublish_step = unpublish_step
_real_retire = _commit.retire_step


def retire_step(*args, **kwargs):
    _real_retire(*args, **kwargs)
    reached("retired")


_commit.retire_step = retire_step
_real_delete_file = _storage.LocalStorage.delete_file


def delete_file(self, path):
    _real_delete_file(self, path)
    if "/arrays/" in path:
        reached("pruned")


_storage.LocalStorage.delete_file = delete_file
_real_kv_delete = _kvstore.KvStorage.delete_tree


def kv_delete_tree(self, path):
    _real_kv_delete(self, path)
    reached("kv_deleted")


_kvstore.KvStorage.delete_tree = kv_delete_tree

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
sharding = NamedSharding(mesh, P("a", "b"))
base = jax.device_put(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32), sharding)
with ckpt.CheckpointManager(directory, keep=ckpt.KeepLatest(2), incremental=True, async_save=False,
                            pack_small_leaves_bytes=0, **tiers) as mgr:
    start = (mgr.latest_step() or -1) + 1
    for step in range(start, start + 8):
        if step == 4:
            base = jax.device_put(np.random.default_rng(4).standard_normal((256, 256)).astype(np.float32), sharding)
        adapter = jax.device_put(np.full((256, 256), step - step % 2, np.float32), sharding)  # unchanged at odd steps
        mgr.save(step, {"base": base, "adapter": adapter, "step": step})
print("finished", flush=True)
