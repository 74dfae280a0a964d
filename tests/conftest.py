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


# --- the quick subset (`pytest -m quick`; docs/DESIGN-decisions.md, "Dependency floors") ---
# `.ci/compat-venvs` runs it against the declared floors (constraints-lowest.txt) and the
# newest releases. Whole files: save/restore round trips onto other meshes, packed
# leaves, encodings, the restore planner, the manager and its policies, the CLI,
# multi-process saves, safetensors and Orbax imports. Nothing here needs a server (S3/GCS).
QUICK_FILES = {
    "test_format.py", "test_save_restore.py", "test_pack.py", "test_encodings.py",
    "test_zarr_groups.py", "test_restore_plan.py", "test_restore_reads.py",
    "test_manager.py", "test_policies.py", "test_cli.py", "test_multiprocess.py",
    "test_safetensors_restore.py", "test_orbax_import.py", "test_save_plan.py",
    "test_fresh_restore.py", "test_inputs.py", "test_interop.py", "test_export.py",
    "test_coop_restore.py", "test_hostile.py", "test_storage_faults.py", "test_direct_io.py",
    "test_rendezvous.py", "test_zarr_dtypes.py",
}
# Tests of those files left out of it, and why.
QUICK_EXCLUDED = {
    # Asserts jax.distributed's text for a dead peer ("\n1\n"; jax 0.8.1 names
    # /job:jax_worker/replica:0/task:1), and each mode waits out a heartbeat or a commit timeout.
    "test_killed_process_during_async_save_commits_nothing",
    # Asserts jax's text for a sharding (jax 0.8.1 prints `PartitionSpec()`, newer `P()`).
    "test_cooperative_restore_agreement_names_the_differing_leaf",
    # Not a message text (docs/DESIGN-decisions.md, "Dependency floors"): a peak-RSS bound
    # (512 MiB) that the Orbax import meets with the newest releases (424-440 MiB here) and
    # only just at the floors (456-521 MiB).
    "test_import_and_export_of_1_gib_stay_within_the_largest_leaf_plus_256_mib",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in QUICK_FILES and item.originalname not in QUICK_EXCLUDED:
            item.add_marker(pytest.mark.quick)


def pytest_ignore_collect(collection_path, config):
    # Under `-m quick` the other files are not even imported: their import may need what
    # the floors lack (test_tree.py builds DictKey(None), which jaxlib 0.8.1 refuses).
    if config.getoption("markexpr") == "quick" and collection_path.name.startswith("test_") \
            and collection_path.suffix == ".py" and collection_path.name not in QUICK_FILES:
        return True
    return None
