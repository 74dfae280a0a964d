"""Worker-side helpers for `tests/multiprocess.py`: join the job, build data, report.

A worker script starts with

    import _common
    args = _common.init()          # jax.distributed.initialize from MP_* variables

and reports with `_common.emit(event="...", ...)` (one JSON line the test parses).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

_T0 = time.monotonic()


def init() -> dict:
    """Joins the job described by the harness's `MP_*` variables; returns the worker args.

    Sets the CPU device count before JAX is imported, selects gloo CPU collectives when
    this jax has the option, and uses short initialisation and heartbeat timeouts so a
    dead peer is noticed in seconds.
    """
    n_dev = os.environ["MP_DEVICES_PER_PROCESS"]
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n_dev}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # option absent in this jax version
        pass
    if os.environ.get("MP_RECOVERABLE") == "1":
        # Let the job go on after a peer died (the coordination service then does not
        # propagate the peer's failure to every process, which would abort it).
        jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        coordinator_address=os.environ["MP_COORDINATOR"],
        num_processes=int(os.environ["MP_NUM_PROCESSES"]),
        process_id=int(os.environ["MP_PROCESS_ID"]),
        initialization_timeout=int(os.environ.get("MP_INIT_TIMEOUT_S", "60")),
        heartbeat_timeout_seconds=int(os.environ.get("MP_HEARTBEAT_TIMEOUT_S", "10")),
        shutdown_timeout_seconds=int(os.environ.get("MP_SHUTDOWN_TIMEOUT_S", "30")),
    )
    assert jax.process_count() == int(os.environ["MP_NUM_PROCESSES"])
    assert len(jax.local_devices()) == int(n_dev)
    sys.excepthook = _excepthook
    return json.loads(os.environ.get("MP_ARGS", "{}"))


def mp_args() -> dict:
    """The worker args, for a worker that runs as an independent program (it does not
    join a jax.distributed job: e.g. a writer and a separate evaluation job)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.excepthook = _excepthook
    return json.loads(os.environ.get("MP_ARGS", "{}"))


def _excepthook(tp, value, tb):
    emit(event="exception", type=tp.__name__, message=str(value), traceback="".join(traceback.format_exception(tp, value, tb)))
    sys.__excepthook__(tp, value, tb)


def process_index() -> int:
    return int(os.environ["MP_PROCESS_ID"])


def emit(**record) -> None:
    """Prints one JSON record for the test (`MPRESULT {...}`), tagged with the process."""
    record.setdefault("process", process_index())
    record.setdefault("t", round(time.monotonic() - _T0, 3))
    sys.stdout.write("MPRESULT " + json.dumps(record) + "\n")
    sys.stdout.flush()


def mesh(shape, axis_names):
    """A Mesh of the first prod(shape) devices of `jax.devices()` (all processes), row-major."""
    import math

    import jax
    import numpy as np

    n = math.prod(shape)
    devices = jax.devices()
    assert n <= len(devices), f"mesh {shape} needs {n} devices, the job has {len(devices)}"
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), tuple(axis_names))


def spec(entries):
    """A PartitionSpec from JSON: a list of None, an axis name or a list of axis names."""
    from jax.sharding import PartitionSpec as P

    return P(*[tuple(e) if isinstance(e, list) else e for e in entries])


# --- the test tree -----------------------------------------------------------------------
# Every process can recompute every leaf's global value from these definitions.

ARRAY_LEAVES = ("w", "emb", "rep", "bf", "ids")

# Saved on the 2x4 ('data', 'model') mesh with these specs.
SAVE_SPECS = {
    "w": ["data", "model"],  # sharded on both axes: each process writes its half
    "emb": ["model"],  # replicated over 'data', i.e. across the two processes
    "rep": [],  # fully replicated
    "bf": [None, "model"],  # bfloat16
    "ids": ["data"],  # int32
}

VALUES = {"step": 1234, "name": "run-α/β"}  # non-array leaves (live in the manifest)


def loader_state(process_index: int) -> dict:
    """The per-process state process `process_index` saves (its data loader's position)."""
    return {"shard": process_index, "position": 1000 + 17 * process_index, "files": [f"part-{process_index}"]}


def global_arrays() -> dict:
    """The global numpy value of each array leaf (deterministic)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(20240601)
    return {
        "w": rng.standard_normal((256, 128)).astype(np.float32),
        "emb": rng.standard_normal((128, 64)).astype(np.float32),
        "rep": np.arange(32 * 16, dtype=np.float32).reshape(32, 16) / 7,
        "bf": rng.standard_normal((64, 128)).astype(ml_dtypes.bfloat16),
        "ids": (np.arange(512, dtype=np.int64) * 2654435761 % (2**31 - 1)).astype(np.int32),
    }


def build_tree(mesh_, specs=SAVE_SPECS) -> dict:
    """The test tree on `mesh_`, every array made with `jax.make_array_from_callback`."""
    import jax
    from jax.sharding import NamedSharding

    tree = {}
    for name, g in global_arrays().items():
        sharding = NamedSharding(mesh_, spec(specs[name]))
        tree[name] = jax.make_array_from_callback(g.shape, sharding, lambda idx, g=g: g[idx], dtype=g.dtype)
    tree.update(VALUES)
    return tree


def bits(a):
    """An unsigned-integer view of an array, for bit-exact comparison (bfloat16, NaN, -0)."""
    import numpy as np

    a = np.ascontiguousarray(np.asarray(a))
    return a.view(f"u{a.dtype.itemsize}")


def same_bits(a, b) -> bool:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(bits(a), bits(b))
