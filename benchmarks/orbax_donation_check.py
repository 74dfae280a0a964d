"""Does an async save still commit the values of save time if the caller donates the arrays
right after the blocking call returns?  Checked for orbax-checkpoint and for checkpointer.

Why: on the CPU backend np.asarray(shard.data) is a view of the device buffer, and orbax's
device-to-host step (orbax/checkpoint/_src/serialization/replica_slices.py,
transfer_arrays_to_host: `data.copy_to_host_async()` then `np.asarray(data)`) keeps such a
view for its background write instead of a copy. So its short blocking time may be a
reference, not a snapshot. This script tests what that means for the committed bytes.

Per library, on the benchmark state (same structure as save_bench.py; 1/8 of the bytes unless
--full), fresh device buffers each time:
  1. expected = host copies of every leaf (the values at save time)
  2. start an async save: orbax CheckpointManager(enable_async_checkpointing=True).save(0,
     args=StandardSave(state)) / ckpt.CheckpointManager(dir, keep=KeepLatest(1)).save(0, state)
  3. at once: new = jax.jit(lambda s: tree_map(lambda x: x * 0 + 7, s), donate_argnums=0)(state),
     block_until_ready(new) (compiled beforehand, so this takes milliseconds)
  4. wait_until_finished(), restore step 0 onto the same shardings, compare with expected.
Prints one line per library: "intact" (the committed checkpoint equals the values at save
time) or "torn" (it does not), with whether XLA really reused the donated buffers and any error.

Run:  /tmp/venv0/bin/python benchmarks/orbax_donation_check.py [--full] [--dir /tmp] [--json]
      (--json: one JSON object on the last line, read by save_bench.py for RESULTS.md)
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import absl.logging  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import checkpointer as ckpt  # noqa: E402

absl.logging.set_verbosity(absl.logging.ERROR)

overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 7, s), donate_argnums=0)


def _pointers(tree) -> list[int]:
    return [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards]


def _abstract(state) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}


def _orbax(d: str, state, target, donate):
    mgr = ocp.CheckpointManager(f"{d}/orbax", options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True))
    try:
        mgr.save(0, args=ocp.args.StandardSave(state))
        kept = donate()
        mgr.wait_until_finished()
        return kept, mgr.restore(0, args=ocp.args.StandardRestore(target))
    finally:
        mgr.close()


def _checkpointer(d: str, state, target, donate):
    with ckpt.CheckpointManager(f"{d}/ckpt", keep=ckpt.KeepLatest(1)) as mgr:
        mgr.save(0, state)
        kept = donate()
        mgr.wait_until_finished()
        return kept, mgr.restore(0, target)


LIBRARIES = {"orbax": _orbax, "checkpointer": _checkpointer}


def check(name: str, scale: int, parent: str | None) -> dict:
    state = C.make_state(scale)
    expected = {k: np.array(v) for k, v in state.items()}
    target = _abstract(state)
    before = _pointers(state)
    out = {"library": name, "leaves": len(expected)}
    holder = {}

    def donate():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            new = jax.block_until_ready(overwrite(state))
            out["donate_call_s"] = time.perf_counter() - t0
        holder["new"] = new  # keep the overwritten buffers alive until the check is done
        after = _pointers(new)
        out["leaves_donated"] = sum(x.is_deleted() for x in jax.tree.leaves(state))
        out["buffers_reused"] = sum(a == b for a, b in zip(before, after))
        out["buffers"] = len(before)
        out["warnings"] = [str(x.message).splitlines()[0] for x in w]
        return new

    d = tempfile.mkdtemp(prefix="donation_check_", dir=parent)
    try:
        try:
            _, restored = LIBRARIES[name](d, state, target, donate)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            out["verdict"], out["error"] = "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            return out
        bad = {k: np.asarray(restored[k]) for k in expected if not np.array_equal(np.asarray(restored[k]), expected[k])}
        out["verdict"] = "torn" if bad else "intact"
        out["leaves_differ"] = len(bad)
        n = sum(v.size for v in bad.values())
        out["sevens_in_differing"] = (sum(int((v == 7).sum()) for v in bad.values()) / n) if n else 0.0
        out["differing_leaves"] = sorted(bad)
        return out
    finally:
        holder.clear()
        shutil.rmtree(d, ignore_errors=True)


def line(r: dict) -> str:
    if "leaves_donated" not in r:
        don = "the donating call did not run"
    else:
        don = (f"jax donated {r['leaves_donated']}/{r['leaves']} leaves, {r['buffers_reused']}/{r['buffers']} device "
               f"buffers reused in place, donating call {r['donate_call_s'] * 1e3:.0f} ms")
        if r["leaves_donated"] < r["leaves"]:
            don += " (a leaf not donated keeps its old buffers and is silently copied out of place)"
    if r["verdict"] == "error":
        return f"{r['library']}: error ({r['error']}); {don}"
    if r["verdict"] == "torn":
        what = (f"{r['leaves_differ']}/{r['leaves']} leaves differ from the values at save time "
                f"({r['sevens_in_differing']:.1%} of their elements are the post-donation value 7)")
    else:
        what = f"all {r['leaves']} leaves equal the values at save time"
    warn = f"; jax warned: {'; '.join(r['warnings'])}" if r.get("warnings") else ""
    return f"{r['library']}: {r['verdict']} - {what}; {don}{warn}"


def view_blocks_donation(scale: int) -> bool:
    """Control for the mechanism: does holding np.asarray(shard.data) of one shard (what orbax keeps
    on CPU) make jax skip the donation of that leaf?"""
    state = C.make_state(scale)
    view = np.asarray(state["w00"].addressable_shards[0].data)
    new = jax.block_until_ready(overwrite(state))
    held = not state["w00"].is_deleted() and all(v.is_deleted() for k, v in state.items() if k != "w00")
    del view, new, state
    return held


def run(scale: int = 8, parent: str | None = None) -> dict:
    jax.block_until_ready(overwrite(C.make_state(scale)))  # compile the donating function first
    return {"scale": scale, "results": [check(name, scale, parent) for name in LIBRARIES],
            "view_blocks_donation": view_blocks_donation(scale)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the full 1 GiB state (default: 1/8 of it)")
    ap.add_argument("--dir", default=None, help="parent of the temporary checkpoint folders")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = ap.parse_args()
    scale = 1 if args.full else 8
    print(f"state: {C.N_LEAVES} x float32 {C.shapes(scale)[0]} P('data','model') + {C.shapes(scale)[1]} P() on "
          f"{jax.device_count()} {jax.devices()[0].platform} devices; jax {jax.__version__}, "
          f"orbax-checkpoint {C._version('orbax-checkpoint')}")
    res = run(scale, args.dir)
    for r in res["results"]:
        print(line(r))
    print(f"control: holding np.asarray(shard.data) of one shard of leaf w00 {'makes' if res['view_blocks_donation'] else 'does not make'} "
          "jax skip donating w00 (and only w00), without a warning")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
