"""Restored arrays are donatable in place (issue 20 item 4): after a jitted step with
`donate_argnums`, every restored leaf `is_deleted()`, and the step's outputs take the
restored buffers (no second copy of the state)."""

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt

SPECS = {"w": P("data", "model"), "rep": P(), "col": P(None, "model"), "b": P("model")}
SHAPES = {"w": (256, 512), "rep": (64, 128), "col": (128, 256), "b": (512,)}

# On the CPU backend `jax.device_put` of an aligned host array adopts it, and XLA gives a
# donated output a fresh buffer instead of reusing an adopted one; restored zarr-array
# leaves are therefore read into buffers XLA allocated (`_memory._device_destination`), and
# packed leaves are placed from buffers XLA cannot adopt (`_pack.unadoptable`).
ENCODINGS = [pytest.param(0, id="zarr_arrays"), pytest.param(None, id="packed")]


def _restored_and_step(tmp_path, pack):
    mesh = make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(4)
    sharding = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
    state = {k: jax.device_put(rng.standard_normal(SHAPES[k], dtype=np.float32), sharding[k]) for k in SPECS}
    path = str(tmp_path / "1")
    ckpt.save(path, state, pack_small_leaves_bytes=pack)
    step = jax.jit(lambda s: {k: v * 2 + 1 for k, v in s.items()}, donate_argnums=0, out_shardings=sharding)
    step.lower(state).compile()  # compiled before the restore, as a resumed job does
    want = {k: np.asarray(v) * 2 + 1 for k, v in state.items()}
    return ckpt.restore(path, sharding), step, want


def _buffers(tree) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for v in tree.values() for s in v.addressable_shards}


@pytest.mark.parametrize("pack", ENCODINGS)
def test_a_donating_step_deletes_every_restored_leaf(tmp_path, pack):
    restored, step, want = _restored_and_step(tmp_path, pack)
    out = step(restored)
    jax.block_until_ready(out)
    assert [k for k, v in restored.items() if not v.is_deleted()] == []
    for k in SPECS:
        np.testing.assert_array_equal(np.asarray(out[k]), want[k])


@pytest.mark.parametrize("pack", ENCODINGS)
def test_a_donating_step_reuses_the_restored_buffers(tmp_path, pack):
    restored, step, _ = _restored_and_step(tmp_path, pack)
    before = _buffers(restored)
    out = step(restored)
    jax.block_until_ready(out)
    fresh = _buffers(out) - before
    assert not fresh, f"{len(fresh)} of {len(_buffers(out))} output shards are new allocations: a second copy of the state"


def test_a_restore_cast_to_another_dtype_is_donated_in_place(tmp_path):
    mesh = make_mesh((2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", "model"))
    saved = np.random.default_rng(5).standard_normal((256, 512), dtype=np.float32)
    path = str(tmp_path / "1")
    ckpt.save(path, {"w": jax.device_put(saved, sharding)})
    target = {"w": jax.ShapeDtypeStruct((256, 512), np.float16, sharding=sharding)}
    step = jax.jit(lambda s: {"w": s["w"] * 2}, donate_argnums=0, out_shardings={"w": sharding})
    restored = ckpt.restore(path, target)
    before = _buffers(restored)
    out = jax.block_until_ready(step(restored))
    assert restored["w"].is_deleted() and out["w"].dtype == np.float16
    assert not _buffers(out) - before
    np.testing.assert_array_equal(np.asarray(out["w"]), saved.astype(np.float16) * 2)


@pytest.mark.parametrize("shape", [(), (3,), (1024, 769), (3 << 20,)], ids=["scalar", "tiny", "unaligned", "12MiB"])
def test_device_destinations_are_xla_buffers_filled_through_their_views(shape):
    from checkpointer._memory import device_destinations

    devices = jax.devices()[:2]
    made = device_destinations([(shape, np.dtype(np.float32), jax.sharding.SingleDeviceSharding(d)) for d in devices])
    want = []
    for k, (_array, view) in enumerate(made):
        assert view.shape == shape and view.dtype == np.float32 and view.flags.writeable
        want.append(np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + k)
        view[...] = want[-1]
    arrays = [a for a, _ in made]
    del made, view
    assert [next(iter(a.devices())) for a in arrays] == devices
    step = jax.jit(lambda x: x + 1, donate_argnums=0)
    for a, w in zip(arrays, want):
        pointer = a.unsafe_buffer_pointer()
        out = jax.block_until_ready(step(a))
        assert a.is_deleted() and out.unsafe_buffer_pointer() == pointer
        np.testing.assert_array_equal(np.asarray(out), w + 1)


def test_a_destination_xla_gives_in_another_dtype_is_refused_not_filled(monkeypatch):
    # jax canonicalises 64-bit types to 32 bits with x64 off: a view of such a buffer must
    # never be handed to the reader as the 64-bit destination it asked for.
    from checkpointer._memory import _device_destination, device_destinations

    narrowed = lambda requests: [jax.device_put(np.zeros(shape, np.float32), d) for shape, _, d in requests]  # noqa: E731
    monkeypatch.setattr(_device_destination, "_allocate_all", narrowed)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert device_destinations([((4, 4), np.dtype(np.float64), sharding)]) == [None]


def test_a_64_bit_destination_with_x64_on_is_filled_through_its_view():
    from checkpointer._memory import device_destinations

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with jax.enable_x64(True):
        [(array, view)] = device_destinations([((4, 4), np.dtype(np.float64), sharding)])
        view[...] = 0.5
        del view
        assert array.dtype == np.float64 and float(np.asarray(array).sum()) == 8.0
