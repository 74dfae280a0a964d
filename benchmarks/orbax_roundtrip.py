"""The Orbax round-trip table of docs/orbax_export.md: for each kind of Orbax checkpoint,
written here by the installed orbax-checkpoint on a 2 x 4 mesh of 8 host devices,

- imported exactly: `ckpt.import_orbax` then `ckpt.restore` into the kind's natural target
  (the abstract tree on a 4 x 2 mesh; NNX: `nnx.state(nnx.eval_shape(...))`) gives every
  leaf of the tree given to Orbax's save bit for bit, with its type (no `partial=True`;
  for the directory: each step as Orbax restores it);
- exported exactly: the imported checkpoint, `ckpt.export(..., format="orbax")`, restored by
  Orbax with the same call and target that restore the original (StandardCheckpointer /
  PyTreeCheckpointer / CheckpointManager with `args.StandardRestore`, and the v1 `load`),
  gives what Orbax restores from the original, bit for bit with the same types.

    PYTHONPATH=. .venv/bin/python benchmarks/orbax_roundtrip.py [--markdown]

Prints one line per kind (or the markdown table). Not a timing benchmark.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402
from orbax.checkpoint.experimental import v1  # noqa: E402

import checkpointer as ckpt  # noqa: E402

MESH = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
OTHER = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


def _spec(x) -> P:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return P("model") if x.ndim else P()
    return {2: P("data", "model"), 1: P("model")}.get(x.ndim, P())


def _put(tree):
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(MESH, _spec(a))) if hasattr(a, "shape") and not isinstance(a, np.generic) and not isinstance(a, np.ndarray) else a, tree)


def _abstract(tree, mesh=OTHER):
    def one(x):
        if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _spec(x)))
        return x
    return jax.tree.map(one, tree)


def _bits(x) -> bytes:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def same(got, want) -> str | None:
    """None when bit-exact with the same structure and leaf types, else what differs."""
    fg, tg = jax.tree_util.tree_flatten_with_path(got)
    fw, tw = jax.tree_util.tree_flatten_with_path(want)
    if tg != tw:
        return f"structure {tg} != {tw}"
    for (kp, g), (_, w) in zip(fg, fw):
        name = jax.tree_util.keystr(kp)
        if isinstance(w, jax.Array | np.ndarray):
            if type(g) is not type(w) and not (isinstance(g, jax.Array) and isinstance(w, jax.Array)):
                return f"{name}: {type(g).__name__} != {type(w).__name__}"
            if g.dtype != w.dtype or g.shape != w.shape or _bits(g) != _bits(w):
                return f"{name}: values differ"
        elif type(g) is not type(w) or (g != w and not (g != g and w != w)):
            return f"{name}: {g!r} ({type(g).__name__}) != {w!r} ({type(w).__name__})"
    return None


# --- the trees ----------------------------------------------------------------------------------


def train():
    rng = np.random.default_rng(0)
    params = _put({"dense": {"kernel": rng.standard_normal((64, 32)).astype(np.float32),
                             "bias": rng.standard_normal(32).astype(ml_dtypes.bfloat16)}})
    state = train_state.TrainState.create(apply_fn=lambda *a: None, params=params, tx=optax.adamw(1e-2))
    state = state.apply_gradients(grads=jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params))
    keys = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(MESH, P("model")))
    return {"train": state, "rng": jax.random.key(42), "rngs": keys}


def special_floats():
    x = np.array([np.nan, np.inf, -np.inf, -0.0, 1.5, -2.25, 3e38, 1e-40], np.float32).repeat(4).reshape(8, 4)
    return _put({"f32": x, "bf16": x.astype(ml_dtypes.bfloat16), "f64": x.astype(np.float64)})


F8 = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e3m4", "float8_e8m0fnu"]


def float8s():
    x = np.linspace(-4, 4, 32, dtype=np.float32).reshape(8, 4)
    return _put({n: x.astype(getattr(ml_dtypes, n)) for n in F8})


def int4s():
    x = (np.arange(32) % 16 - 8).reshape(8, 4)
    return _put({"int4": x.astype(ml_dtypes.int4), "int2": (x % 4 - 2).astype(ml_dtypes.int2)})


def keys():
    return {"threefry": jax.device_put(jax.random.split(jax.random.key(3), 8), NamedSharding(MESH, P("model"))),
            "rbg": jax.random.key(5, impl="rbg"), "unsafe_rbg": jax.random.key(6, impl="unsafe_rbg")}


def host_values():
    return {"np": np.arange(12, dtype=np.int16).reshape(3, 4), "i": 7, "f": -2.5, "b": True, "s": "a string",
            "w": _put(np.ones((8, 4), np.float32))}


def numpy_scalars():
    return {"f32": np.float32(1.5), "i64": np.int64(-3), "w": _put(np.ones((8, 4), np.float32))}


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)


class _Layers(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(2)])


def _nnx(make: Callable[[], object]):
    with jax.set_mesh(MESH):
        state = nnx.state(make())
    state = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(MESH, _spec(a))), state)
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(OTHER, _spec(s))),
                          nnx.state(nnx.eval_shape(make)))
    return state, target


# --- the kinds ----------------------------------------------------------------------------------


class Kind(NamedTuple):
    name: str
    save: Callable[[str, object], None]  # writes the Orbax checkpoint
    tree: Callable[[], tuple[object, object]]  # (tree, target)
    restore: Callable[[str, object], object]  # Orbax's restore of a checkpoint of this kind
    item: str = ""  # the subtree a Composite step keeps the state under


def _pytree_handler(ocdbt: bool, zarr3: bool):
    def save(path, tree):
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3)) as c:
            c.save(path, args=ocp.args.PyTreeSave(tree))
    return save


def _standard_save(path, tree):
    with ocp.StandardCheckpointer() as c:
        c.save(path, tree)


def _standard_restore(path, target):
    with ocp.StandardCheckpointer() as c:
        out = c.restore(path, target)
    return out


def _pytree_restore(path, target):
    restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding) if isinstance(t, jax.ShapeDtypeStruct)
                                else ocp.RestoreArgs(), target)
    with ocp.PyTreeCheckpointer() as c:
        return c.restore(path, args=ocp.args.PyTreeRestore(target, restore_args=restore_args))


def _composite_save(path, tree):
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"])
    with ocp.CheckpointManager(path, item_names=("state", "extra"), options=options) as m:
        m.save(12, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), extra=ocp.args.JsonSave({"lr": 0.1})),
               metrics={"loss": 0.25})


def _composite_restore(path, target):
    if os.path.exists(f"{path}/12"):  # the Orbax original
        with ocp.CheckpointManager(path, item_names=("state", "extra")) as m:
            return m.restore(12, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    return _standard_restore(path, {"state": target})["state"]  # the export: the step's tree is {"state": ...}


def _manager_save(path, tree):
    with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")) as m:
        for step in (1, 2, 3):
            def bump(x, step=step):
                return x + step if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            m.save(step, args=ocp.args.StandardSave(jax.tree.map(bump, tree)),
                   metrics={"loss": 1.0 / step})


def _manager_restore(path, target):
    with ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")) as m:
        return {"steps": m.all_steps(), "latest": m.latest_step(), "best": m.best_step(),
                "metrics": [m.metrics(s)["loss"] for s in m.all_steps()],
                "trees": [m.restore(s, args=ocp.args.StandardRestore(target)) for s in m.all_steps()]}


def _tree_of(make):
    def tree():
        t = make()
        return t, _abstract(t)
    return tree


KINDS = [
    Kind("StandardCheckpointer: TrainState (AdamW), typed keys", _standard_save, _tree_of(train), _standard_restore),
    Kind("PyTreeCheckpointHandler, OCDBT, zarr2", _pytree_handler(True, False), _tree_of(train), _pytree_restore),
    Kind("PyTreeCheckpointHandler, OCDBT, zarr3", _pytree_handler(True, True), _tree_of(train), _pytree_restore),
    Kind("PyTreeCheckpointHandler, no OCDBT, zarr2", _pytree_handler(False, False), _tree_of(train), _pytree_restore),
    Kind("PyTreeCheckpointHandler, no OCDBT, zarr3", _pytree_handler(False, True), _tree_of(train), _pytree_restore),
    Kind("CheckpointManager step, Composite(state, JSON extra), metrics", _composite_save, _tree_of(train), _composite_restore),
    Kind("CheckpointManager directory, 3 steps with metrics", _manager_save, _tree_of(train), _manager_restore),
    Kind("float32 / bfloat16 / float64 with NaN, inf, -0.0", _standard_save, _tree_of(special_floats), _standard_restore),
    Kind("every float8 variant", _standard_save, _tree_of(float8s), _standard_restore),
    Kind("int4, int2", _standard_save, _tree_of(int4s), _standard_restore),
    Kind("typed PRNG keys: threefry (split, sharded), rbg, unsafe_rbg", _standard_save, _tree_of(keys), _standard_restore),
    Kind("numpy array, Python scalars, a string (PyTreeCheckpointer)", _pytree_handler(True, False), _tree_of(host_values), _pytree_restore),
    Kind("numpy scalar types (np.float32, np.int64)", _pytree_handler(True, False), _tree_of(numpy_scalars), _pytree_restore),
    Kind("NNX Module state (nnx.state of nnx.Linear layers)", _standard_save, lambda: _nnx(lambda: _Mlp(nnx.Rngs(0))), _standard_restore),
    Kind("NNX nnx.Optimizer state (optax.adam)", _standard_save,
         lambda: _nnx(lambda: nnx.Optimizer(_Mlp(nnx.Rngs(0)), optax.adam(1e-3), wrt=nnx.Param)), _standard_restore),
    Kind("NNX nnx.List layers", _standard_save, lambda: _nnx(lambda: _Layers(nnx.Rngs(0))), _standard_restore),
]


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def run_kind(kind: Kind, tmp: str) -> tuple[str, str]:
    """(imported exactly, exported exactly): "yes" or "no: <why>"."""
    tree, target = kind.tree()
    orbax_in, imported, orbax_out = (os.path.join(tmp, n) for n in ("orbax_in", "imported", "orbax_out"))
    kind.save(orbax_in, tree)
    by_orbax = kind.restore(orbax_in, target)
    ckpt.import_orbax(f"{orbax_in}/12" if kind.save is _composite_save else orbax_in, imported)
    directory = kind.save is _manager_save
    try:
        if directory:
            got = [ckpt.restore(f"{imported}/{s}", target) for s in (1, 2, 3)]
            why = same(got, by_orbax["trees"])
        else:
            restored = ckpt.restore(imported, {"state": target} if kind.save is _composite_save else target)
            why = same(restored["state"] if kind.save is _composite_save else restored, tree)  # as saved, types too
        imported_ok = "yes" if why is None else f"no: {why}"
    except Exception as e:  # noqa: BLE001  (the table records the failure)
        imported_ok = f"no: {_error(e)}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ckpt.export(imported, orbax_out, format="orbax")
        if directory:
            got_dir = _manager_restore(orbax_out, target)
            why = same(got_dir["trees"], by_orbax["trees"]) or (
                None if {k: v for k, v in got_dir.items() if k != "trees"} == {k: v for k, v in by_orbax.items() if k != "trees"}
                else f"steps/metrics differ: {[got_dir[k] for k in ('steps', 'latest', 'best', 'metrics')]}")
        else:
            why = same(kind.restore(orbax_out, target), by_orbax)
            if why is None and kind.restore is _standard_restore:  # and through the v1 load
                v1_why = same(v1.load(orbax_out, target), by_orbax)
                why = v1_why and f"v1 load: {v1_why}"
        exported_ok = "yes" if why is None else f"no: {why}"
    except Exception as e:  # noqa: BLE001
        exported_ok = f"no: {_error(e)}"
    return imported_ok, exported_ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print the markdown table of docs/orbax_export.md")
    args = ap.parse_args()
    logging.getLogger("absl").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)  # v1's "TensorStore data files not found" note, see the doc
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message="Sharding info not provided")
    rows = []
    for kind in KINDS:
        tmp = tempfile.mkdtemp(prefix="orbax_roundtrip_")
        try:
            rows.append(tuple(c.replace(tmp, "<tmp>") for c in (kind.name, *run_kind(kind, tmp))))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not args.markdown:
            print(f"{rows[-1][0]}: imported {rows[-1][1]}; exported {rows[-1][2]}", flush=True)
    if args.markdown:
        print("| Orbax checkpoint | imported exactly | exported and restored by Orbax exactly |")
        print("| --- | --- | --- |")
        for name, imp, exp in rows:
            print(f"| {name} | {imp} | {exp} |")
    n_imp = sum(r[1] == "yes" for r in rows)
    n_exp = sum(r[2] == "yes" for r in rows)
    print(f"\n{len(rows)} kinds: imported exactly {n_imp}, exported and restored by Orbax exactly {n_exp} "
          f"(orbax-checkpoint {ocp.__version__}, jax {jax.__version__})")


if __name__ == "__main__":
    main()
