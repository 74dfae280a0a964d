"""Test set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from checkpointer._tools._default_targets import scratch_mesh  # noqa: E402


def make_mesh(shape, names, devices=None):
    """A Mesh of the first prod(shape) devices (Auto axes, so any PartitionSpec works):
    the library's own `scratch_mesh`, over `jax.devices()` unless `devices` is given."""
    return scratch_mesh(shape, names, jax.devices() if devices is None else devices)


@pytest.fixture
def ckpt_dir(tmp_path):
    return str(tmp_path / "ckpt")


@pytest.fixture
def unpacked_layout(monkeypatch):
    """Saves without packing small leaves (`pack_small_leaves_bytes` default 0): for test
    files about the per-leaf layout (one zarr array per leaf, its chunk files), which
    damage, list or count those files. The packed layout has its own tests
    (tests/test_pack.py)."""
    from checkpointer._encoding import _pack

    monkeypatch.setattr(_pack, "DEFAULT_PACK_BYTES", 0)
