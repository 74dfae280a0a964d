"""The training state of the campaign's loop: a deterministic function of the step, so
any committed step can be checked bit-exactly without keeping what was saved."""

from __future__ import annotations

import ml_dtypes
import numpy as np

# `w` (float32, 1 MiB, split in 2 shards over the mesh's first axis) is above the
# packing threshold: each shard its own zarr shard file, written by the direct writer;
# `mu` (bfloat16, 64 KiB, sharded over every device), `b` and `step` go into the pack
# of small leaves.
W_SHAPE = (512, 512)
MU_SHAPE = (128, 256)


def expected(step: int) -> dict:
    """The host values of the state saved at `step`."""
    w = np.arange(np.prod(W_SHAPE), dtype=np.float32).reshape(W_SHAPE) * np.float32(0.5) + np.float32(step)
    return {
        "params": {"w": w, "b": np.full(7, step, np.int32)},
        "opt": {"mu": (w[:MU_SHAPE[0], :MU_SHAPE[1]] * np.float32(0.25)).astype(ml_dtypes.bfloat16)},
        "step": step,
    }


def make(step: int, mesh=None) -> dict:
    """The state at `step`: `w` sharded over the mesh's first axis, `mu` over both (a
    2 x n mesh of every device of the job when `mesh` is None)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if mesh is None:
        devices = np.array(jax.devices())
        mesh = Mesh(devices.reshape(2, -1) if devices.size % 2 == 0 else devices.reshape(1, -1), ("a", "b"))
    host = expected(step)
    w, mu = host["params"]["w"], host["opt"]["mu"]
    return {
        "params": {
            "w": jax.make_array_from_callback(W_SHAPE, NamedSharding(mesh, P("a")), lambda idx: w[idx]),
            "b": host["params"]["b"],
        },
        "opt": {"mu": jax.make_array_from_callback(MU_SHAPE, NamedSharding(mesh, P("a", "b")), lambda idx: mu[idx])},
        "step": step,
    }


def differences(restored: object, step: int) -> str:
    """'' when `restored` equals the state of `step` bit for bit, else what differs."""
    want = expected(step)
    out = []
    try:
        pairs = [
            ("params/w", restored["params"]["w"], want["params"]["w"]),
            ("params/b", restored["params"]["b"], want["params"]["b"]),
            ("opt/mu", restored["opt"]["mu"], want["opt"]["mu"]),
        ]
    except (KeyError, TypeError) as e:
        return f"tree differs: {e!r}"
    for name, got, exp in pairs:
        got, exp = np.asarray(got), np.asarray(exp)
        if got.dtype != exp.dtype or got.shape != exp.shape or got.tobytes() != exp.tobytes():
            out.append(f"{name}: {got.dtype}{got.shape} differs from the saved {exp.dtype}{exp.shape}")
    if restored["step"] != step:
        out.append(f"step: {restored['step']} != {step}")
    return "; ".join(out)
