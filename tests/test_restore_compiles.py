"""Distinct leaf shapes do not cost a compile each (issue 28 item 2): the XLA-owned
destination buffers of a restore (`_memory._device_destination`) are allocated by one
compiled program for all its leaves, not one program per box shape."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt

LEAVES = 300


def _shape(i: int) -> tuple[int, ...]:
    return (8, 64 + i)


def _restore_in_a_fresh_process(path: str) -> str:
    """Restores the 300 leaves at `path` in a new interpreter (nothing compiled yet),
    counting XLA backend compiles during the restore; checks every value there."""
    script = textwrap.dedent(f"""
        import jax, numpy as np
        import jax.monitoring
        from jax.sharding import NamedSharding, PartitionSpec as P
        import checkpointer as ckpt
        compiles = []
        def listen(event, duration_s, **kwargs):
            if event == "/jax/core/compile/backend_compile_duration":
                compiles.append(duration_s)
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
        target = {{f"l{{i}}": jax.ShapeDtypeStruct((8, 64 + i), np.float32, sharding=NamedSharding(mesh, P("d")))
                  for i in range({LEAVES})}}
        jax.monitoring.register_event_duration_secs_listener(listen)
        out = jax.block_until_ready(ckpt.restore({path!r}, target))
        n = len(compiles)
        bad = [k for i, (k, v) in enumerate(sorted(out.items(), key=lambda kv: int(kv[0][1:])))
               if not (np.asarray(v) == np.arange(v.shape[1], dtype=np.float32) + i).all()]
        print("compiles", n, "bad", bad)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env).stdout


def test_300_distinct_shapes_restore_with_a_constant_number_of_compiles(tmp_path):
    mesh = make_mesh((8,), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    state = {f"l{i}": jax.device_put(np.arange(_shape(i)[1], dtype=np.float32) + i + np.zeros(_shape(i), np.float32), sharding)
             for i in range(LEAVES)}
    path = str(tmp_path / "1")
    ckpt.save(path, state, pack_small_leaves_bytes=0)  # every leaf its own zarr array: the destination path
    out = _restore_in_a_fresh_process(path).split()
    assert out[out.index("bad") + 1] == "[]"
    # Before: one compile per distinct box shape (300); now one program allocates them all.
    assert int(out[out.index("compiles") + 1]) <= 3, out


def test_leaves_of_one_shape_on_one_device_get_their_own_buffers():
    from checkpointer._memory import device_destinations

    devices = jax.devices()[:2]
    on = [jax.sharding.SingleDeviceSharding(d) for d in devices]
    # Two replicated leaves of one shape (both boxes on device 0), a sharded leaf over
    # both devices, scalars and a (1,) that share one allocation slot shape.
    requests = [((4, 3), np.float32, on[0]), ((4, 3), np.float32, on[0]), ((4, 3), np.float32, on[1]),
                ((), np.int32, on[0]), ((1,), np.int32, on[0]), ((5,), np.int8, on[1])]
    made = device_destinations(requests)
    pointers = set()
    for k, ((shape, dtype, sharding), m) in enumerate(zip(requests, made, strict=True)):
        assert m is not None
        array, view = m
        assert array.shape == shape and array.dtype == dtype and array.sharding.device_set == sharding.device_set
        view[...] = k + 1
        pointers.add(array.unsafe_buffer_pointer())
        del view
    assert len(pointers) == len(requests)
    for k, (array, _) in enumerate(made):
        np.testing.assert_array_equal(np.asarray(array), np.full(array.shape, k + 1, array.dtype))


def test_destinations_compile_a_few_programs_whatever_the_mix_of_shapes():
    # In a fresh process (nothing cached); one program per number of boxes sharing a
    # shape, over all the requests' devices while the blocks nobody asked for stay within
    # 64 MiB (else one per set of devices). 300 boxes of one shape spread over 8 devices
    # (38 on 4 of them, 37 on the others): one single-output program (two before the
    # spare blocks). 300 shapes sharded over 8 devices: one program. 300 shapes of
    # 51-89 KiB each on one device: three sets of devices fit the 64 MiB of spare blocks,
    # five do not: six (eight before). A transformer-like mix (24 layers of 4 shapes, 3
    # shapes once): two (one round of 7 outputs, 23 of 4). 24 layers of a sharded weight
    # and a replicated norm scale (its box on the first device only): one (two before).
    # fresh_restore_bench's state, 16 sharded leaves and a replicated one (17 arrays of
    # two specs, at most `_FLAT_ARRAYS`): one 17-output program (two before).
    script = textwrap.dedent("""
        import jax, numpy as np
        import jax.monitoring
        from checkpointer._memory import device_destinations
        compiles = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, duration_s, **kw: compiles.append(1) if event == "/jax/core/compile/backend_compile_duration" else None)
        on = [jax.sharding.SingleDeviceSharding(d) for d in jax.devices()]
        def count(requests):
            before = len(compiles)
            made = device_destinations(requests)
            assert all(m is not None and m[0].shape == r[0] for m, r in zip(made, requests))
            return len(compiles) - before
        same = [((64, 32), np.float32, on[i % 8]) for i in range(300)]
        distinct = [((8 + i, 32), np.float32, d) for i in range(300) for d in on]
        apart = [((400 + i, 32), np.float32, on[i % 8]) for i in range(300)]
        mixed = [((s, 16), np.float32, d) for _ in range(24) for s in (3, 5, 7, 9) for d in on] + [((2, s), np.float32, on[0]) for s in (1, 2, 3)]
        layers = [r for _ in range(24) for r in [((96, 32), np.float32, d) for d in on] + [((48,), np.float32, on[0])]]
        bench = [((80, 16), np.float32, d) for _ in range(16) for d in on] + [((40, 16), np.float32, on[0])]
        print(count(same), count(distinct), count(apart), count(mixed), count(layers), count(bench))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env).stdout.split()
    same, distinct, apart, mixed, layers, bench = map(int, out[-6:])
    assert (same, distinct, apart, mixed, layers, bench) == (1, 1, 6, 2, 1, 1), out
