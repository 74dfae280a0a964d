"""What the incremental tests (test_incremental*.py) put in a step and read back of it:
a 4 MiB leaf, a step's manifest, the steps a leaf references, the chunk files a leaf
holds itself."""

import json
import os

import jax
import numpy as np

N = 1024  # 1024x1024 float32 = 4 MiB per leaf, 8 chunks of 512 KiB on the 2x4 mesh: not packed


def arr(sharding, value=0.0, seed=None):
    """An NxN float32 leaf: standard normal from `seed` when given, else all `value`."""
    if seed is not None:
        host = np.random.default_rng(seed).standard_normal((N, N)).astype(np.float32)
    else:
        host = np.full((N, N), value, np.float32)
    return jax.device_put(host, sharding)


def manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def refs_in(path, leaf):
    """The steps whose chunks `leaf` of the step at `path` references."""
    return {r["in"] for r in manifest(path)["leaves"][leaf].get("references", [])}


def chunk_files(path, leaf):
    """How many chunk files `leaf` of the step at `path` holds itself (not referenced)."""
    root = os.path.join(path, "arrays", leaf, "c")
    return sum(len(files) for _, _, files in os.walk(root)) if os.path.isdir(root) else 0
