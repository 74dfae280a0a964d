"""Worker-side helpers for `tests/multiprocess.py`: join the job, build data, report.

Joining and reporting are `checkpointer.testing`'s; the test tree is defined here.

A worker script starts with

    import _common
    args = _common.init()          # jax.distributed.initialize, from the harness's environment

and reports with `_common.emit(event="...", ...)` (one JSON line the test parses).
"""

from __future__ import annotations

from checkpointer import testing

# Join the job (jax.distributed from the harness's environment) and return the worker args.
init = testing.initialize
# Report one JSON record (`{"event": ..., ...}`) to the test.
emit = testing.emit
process_index = testing.process_id
# The worker args of a worker that runs as an independent program (started with
# `distributed=False`: e.g. a writer and a separate evaluation job).
mp_args = testing.initialize


def mesh(shape, axis_names):
    """A Mesh of the first prod(shape) devices of `jax.devices()` (all processes), row-major:
    the library's own `scratch_mesh` (MeshError when the job has too few devices)."""
    import jax

    from checkpointer._tools._default_targets import scratch_mesh

    return scratch_mesh(shape, axis_names, jax.devices())


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


def step_mismatches(out, expected) -> list[str]:
    """Per restored leaf of `expected` (name -> global numpy value, "w" offset by the
    restored step as the tier workers save it), what differs in the shards of `out`."""
    import numpy as np

    mismatches = []
    for name, g in expected.items():
        if name == "w":
            g = (g + np.float32(out["step"])).astype(g.dtype)
        for s in out[name].addressable_shards:
            if not same_bits(np.asarray(s.data), g[s.index]):
                mismatches.append(f"{name}: shard on device {s.device.id} differs")
    return mismatches


# --- a replicated state (cooperative restore) ----------------------------------------------


def packed_values() -> dict:
    """The global numpy value of each leaf of the packed cooperative-restore test
    (`coop_packed_worker.py`): a 512 KiB float32 matrix and a small int16 vector."""
    import numpy as np

    return {
        "w": np.arange(256 * 512, dtype=np.float32).reshape(256, 512) * 0.5,
        "small": np.arange(64, dtype=np.int16),
    }


def replicated_values() -> dict:
    """The global numpy value of each array leaf of the cooperative-restore tests; "key"
    is the key data (uint32, trailing dimension 2) of a threefry PRNG key array."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(20261130)
    return {
        "w": rng.standard_normal((1024, 1024)).astype(np.float32),
        "emb": rng.standard_normal((512, 1024)).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal(4096).astype(np.float32),
        "key": rng.integers(0, 2**32, (8, 2), dtype=np.uint32),
    }
