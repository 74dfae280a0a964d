"""Every array of a checkpoint opens in plain zarr-python (issue 25 item 3): bfloat16, the
float8 variants, float4_e2m1fn, int4 and int2 through the data types
`checkpointer.zarr_dtypes` registers, typed PRNG key data as uint32; the zarr.json stays
TensorStore's (both ways). In the quick subset: .ci/compat-venvs runs it against the floor
(zarr 3.1.0) and the newest zarr-python."""

import importlib
import json
import os
import subprocess
import sys
import tomllib

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr

import checkpointer as ckpt
from checkpointer import zarr_dtypes
from checkpointer._format import zarr_supports_dtype

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every ml_dtypes type TensorStore's zarr3 driver stores, so every one this library writes.
WRITTEN = [n for n in dir(ml_dtypes) if not n.startswith("_") and isinstance(getattr(ml_dtypes, n), type) and n not in ("finfo", "iinfo")
           and zarr_supports_dtype(np.dtype(getattr(ml_dtypes, n)))]


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes()


def _values(name: str) -> np.ndarray:
    dtype = np.dtype(getattr(ml_dtypes, name))
    raw = np.arange(-8, 56, dtype=np.float32).reshape(8, 8) / 4
    if "int" in name:
        info = ml_dtypes.iinfo(dtype)
        raw = np.arange(64).reshape(8, 8) % (int(info.max) - int(info.min) + 1) + int(info.min)
    return raw.astype(dtype)


def test_every_ml_dtype_the_library_writes_has_a_zarr_python_data_type():
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2", "int4"} <= set(WRITTEN)
    assert set(WRITTEN) <= set(zarr_dtypes.DATA_TYPES), set(WRITTEN) - set(zarr_dtypes.DATA_TYPES)


def test_zarr_python_opens_every_array_of_a_checkpoint_with_the_saved_values(tmp_path):
    path = str(tmp_path / "1")
    tree = {name: _values(name) for name in WRITTEN}
    tree["keys"] = jax.random.split(jax.random.key(7), 4)
    tree["rbg_key"] = jax.random.key(3, impl="rbg")
    ckpt.save(path, tree, pack_small_leaves_bytes=0)
    arrays = zarr.open_group(f"{path}/arrays", mode="r")
    assert {k for k, _ in arrays.arrays()} == set(tree)
    for name in WRITTEN:
        got = zarr.open_array(f"{path}/arrays/{name}", mode="r")[...]
        assert got.dtype == tree[name].dtype and got.shape == tree[name].shape, name
        assert _bits(got) == _bits(tree[name]), name
        on_disk = json.loads((tmp_path / "1" / "arrays" / name / "zarr.json").read_text())
        store = ts.open({"driver": "zarr3", "kvstore": f"file://{path}/arrays/{name}"}).result()
        assert _bits(arrays[name].fill_value) == _bits(store.fill_value), name  # read as TensorStore reads it
        mine = arrays[name].metadata.to_dict()  # zarr-python's JSON of it is TensorStore's
        for field in ("data_type", "fill_value"):  # (its codecs JSON adds defaults: index_location)
            assert json.dumps(mine[field], sort_keys=True) == json.dumps(on_disk[field], sort_keys=True), (name, field)
    for name in ("keys", "rbg_key"):
        got = arrays[name][...]
        assert got.dtype == np.uint32 and _bits(got) == _bits(jax.random.key_data(tree[name])), name


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2fnuz", "int4"])
def test_an_array_zarr_python_writes_is_read_by_tensorstore_and_back(tmp_path, name):
    """The JSON zarr-python writes for these types is what TensorStore reads, fill values
    included (NaN, -Infinity, the hex of a NaN's bits TensorStore writes)."""
    dtype = np.dtype(getattr(ml_dtypes, name))
    fills = [0] if "int" in name else [float("nan"), float("-inf"), 1.5]
    for i, fill in enumerate(fills):
        p = str(tmp_path / f"{name}{i}")
        a = zarr.create_array(p, shape=(8, 8), chunks=(4, 8), dtype=dtype, fill_value=fill, compressors=None)
        a[:4] = _values(name)[:4]  # the second chunk is never written: the fill value
        store = ts.open({"driver": "zarr3", "kvstore": f"file://{p}"}).result()
        assert store.dtype.numpy_dtype == dtype
        got = store.read().result()
        assert _bits(got[:4]) == _bits(_values(name)[:4])
        want = np.full((4, 8), fill, np.float32).astype(dtype)  # -inf is NaN in float8_e4m3fn (no infinities)
        np.testing.assert_array_equal(got[4:].astype(np.float32), want.astype(np.float32))
        np.testing.assert_array_equal(zarr.open_array(p, mode="r")[4:].astype(np.float32), want.astype(np.float32))
    if "int" not in name:  # TensorStore writes its own NaN's bits as hex; zarr-python keeps them
        p = str(tmp_path / f"{name}_ts")
        ts.open({"driver": "zarr3", "kvstore": f"file://{p}", "create": True,
                 "metadata": {"shape": [3], "data_type": name, "fill_value": "NaN"}}).result()
        with open(f"{p}/zarr.json", encoding="utf-8") as f:
            on_disk = json.load(f)["fill_value"]
        a = zarr.open_array(p, mode="r")
        assert np.isnan(np.float32(a[...])).all() and a.metadata.to_dict()["fill_value"] == on_disk


def test_a_float8_e8m0fnu_fill_value_zarr_python_writes_is_the_one_tensorstore_reads(tmp_path):
    """TensorStore reads a JSON number for float8_e8m0fnu 64 exponents low (1.0 as 2**-64):
    zarr-python wrote `"fill_value": 1.0` and TensorStore read the unwritten chunk as 5.4e-20."""
    dtype = np.dtype(ml_dtypes.float8_e8m0fnu)
    from checkpointer._format import zarr_supports_dtype

    if not zarr_supports_dtype(dtype):  # TensorStore at the declared floor (0.1.81) has no float8_e8m0fnu
        pytest.skip("this TensorStore has no float8_e8m0fnu")
    for i, fill in enumerate([1.0, 2.0**-20, 2.0**100, 2.0**-127]):
        p = str(tmp_path / f"e8m0_{i}")
        a = zarr.create_array(p, shape=(4,), chunks=(2,), dtype=dtype, fill_value=fill, compressors=None)
        a[:2] = np.array([4.0, 8.0], dtype)
        got = ts.open({"driver": "zarr3", "kvstore": f"file://{p}"}).result().read().result()
        assert _bits(got) == _bits(np.array([4.0, 8.0, fill, fill], dtype)), fill
        assert _bits(zarr.open_array(p, mode="r")[...]) == _bits(got), fill


def test_an_int4_or_int2_fill_value_out_of_range_is_refused_not_wrapped(tmp_path):
    # ml_dtypes wraps: fill_value=20 for int4 was stored as 4, -9 as 7 (numpy's ints refuse).
    for name, fill in [("int4", 20), ("int4", -9), ("int2", 2)]:
        with pytest.raises(ValueError, match=f"{fill} is out of the range of {name}"):
            zarr.create_array(str(tmp_path / f"{name}{fill}"), shape=(4,), dtype=np.dtype(getattr(ml_dtypes, name)),
                              fill_value=fill)
    a = zarr.create_array(str(tmp_path / "ok"), shape=(2,), dtype=np.dtype(ml_dtypes.int4), fill_value=-8)
    assert int(a[0]) == -8


def test_the_entry_points_name_every_data_type():
    """`import zarr` alone finds them once the package is installed: pyproject's
    `zarr.data_type` entry points resolve to the classes, by their zarr v3 names."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        points = tomllib.load(f)["project"]["entry-points"]["zarr.data_type"]
    assert set(points) == set(zarr_dtypes.DATA_TYPES)
    for name, target in points.items():
        module, attr = target.split(":")
        cls = getattr(importlib.import_module(module), attr)
        assert cls is zarr_dtypes.DATA_TYPES[name] and cls._zarr_v3_name == name
        assert zarr.core.dtype.data_type_registry.get(name) is cls


def test_import_zarr_alone_finds_the_data_types_through_the_entry_points(tmp_path):
    """As an installed package: a dist-info with pyproject's entry points on the path of a
    fresh process that imports zarr and nothing of checkpointer. zarr-python loads
    data-type entry points from 3.4.1 on (3.1.0-3.4.0 collect them and never load them:
    there `import checkpointer.zarr_dtypes` registers them)."""
    if tuple(int(p) for p in zarr.__version__.split(".")[:3] if p.isdigit()) < (3, 4, 1):
        pytest.skip(f"zarr-python {zarr.__version__} loads no data-type entry points (3.4.1 does)")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        points = tomllib.load(f)["project"]["entry-points"]["zarr.data_type"]
    info = tmp_path / "site" / "checkpointer_probe-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: checkpointer-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[zarr.data_type]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    path = str(tmp_path / "1")
    ckpt.save(path, {"w": _values("bfloat16"), "q": _values("int4")}, pack_small_leaves_bytes=0)
    code = (
        "import sys, zarr, numpy as np\n"
        f"g = zarr.open_group({path + '/arrays'!r}, mode='r')\n"
        "print(g['w'].dtype, g['q'].dtype, g['w'][0, :3].astype(np.float32).tolist(), g['q'][0, :3].astype(int).tolist())\n"
        "print('jax' in sys.modules, 'tensorstore' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), ROOT]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["bfloat16 int4 [-2.0, -1.75, -1.5] [-8, -7, -6]", "False False"], out.stdout


def test_a_hex_fill_value_wider_than_the_type_is_refused_as_an_invalid_fill_value(tmp_path):
    # zarr.json's "fill_value": "0x1ffff" for bfloat16 (2 bytes) raised OverflowError ("int
    # too big to convert") from int.to_bytes, where every other bad fill value is zarr's
    # TypeError naming the value and the type.
    path = tmp_path / "a"
    zarr.create_array(str(path), shape=(2,), dtype=np.dtype(ml_dtypes.bfloat16))
    meta = json.loads((path / "zarr.json").read_text())
    for fill, name in [("0x1ffff", "bfloat16"), ("0x100", "float8_e4m3fn")]:
        meta.update(fill_value=fill, data_type=name)
        (path / "zarr.json").write_text(json.dumps(meta))
        with pytest.raises(TypeError, match=f"{fill}.*{name}"):
            zarr.open_array(str(path), mode="r")
    meta.update(fill_value="0x7fc0", data_type="bfloat16")  # the bits of NaN: fine
    (path / "zarr.json").write_text(json.dumps(meta))
    assert np.isnan(float(zarr.open_array(str(path), mode="r").fill_value))
