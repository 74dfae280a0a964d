"""User metadata as JSON: one rule for `save(metadata=)` and the manager's `metrics=`.

Rule (both arguments, at any depth):
- `None`, `bool`, `str` and Python `int` are stored as they are; a finite `float` too.
- numpy and JAX scalars (0-d `np.ndarray`, `np.generic`, 0-d `jax.Array`, ml_dtypes
  such as bfloat16) become the Python number of the same value: bool, int or float.
- A NaN or infinite float (Python or numpy/JAX) is stored as the string `"NaN"`,
  `"Infinity"` or `"-Infinity"` (JSON has no such numbers; `KeepBest` skips them).
- Dicts need `str` keys; lists and tuples become lists.
- Anything else (arrays of rank >= 1, complex numbers, bytes, objects) is refused with
  `UnsupportedValueError` naming the key path, e.g. `metadata['a']['b']`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np

from .._errors import UnsupportedValueError

MAX_DEPTH = 100


def _float_json(x: float) -> float | str:
    if math.isfinite(x):
        return x
    if math.isnan(x):
        return "NaN"
    return "Infinity" if x > 0 else "-Infinity"


def _scalar(value: object) -> object | None:
    """The Python number of a numpy/JAX 0-d value, else None (not such a value)."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        arr = np.asarray(value)
    elif isinstance(value, jax.Array) and value.ndim == 0:
        arr = np.asarray(value)
    else:
        return None
    kind = arr.dtype.kind
    if kind == "b":
        return bool(arr)
    if kind in "iu":
        return int(arr)
    if kind == "f" or arr.dtype.type.__module__ == "ml_dtypes":
        try:
            return float(arr.astype(np.float64))
        except (TypeError, ValueError):
            return None
    return None


def to_json(value: object, where: str, *, _depth: int = 0) -> object:
    """Converts `value` by the rule of the module docstring.

    Args:
      value: the metadata value (a dict at the top level for `metadata=`).
      where: its key path for messages, e.g. `"metadata"` or `"metrics['loss']"`.
    Returns:
      A JSON-serialisable value (no NaN or infinity: those become strings).
    Raises:
      UnsupportedValueError: a value of another kind; the message names its key path.
    """
    if _depth > MAX_DEPTH:
        raise UnsupportedValueError(f"{where} is nested more than {MAX_DEPTH} levels deep (a cycle?); flatten it")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and not isinstance(value, np.generic):
        return int(value)
    if isinstance(value, float) and not isinstance(value, np.generic):
        return _float_json(float(value))
    number = _scalar(value)
    if number is not None:
        return _float_json(number) if isinstance(number, float) else number
    if isinstance(value, Mapping):
        return _mapping_json(value, where, _depth)
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{where}[{i}]", _depth=_depth + 1) for i, v in enumerate(value)]
    shape = getattr(value, "shape", None)
    hint = (
        f"an array of shape {tuple(shape)} belongs in the tree, not in metadata; or convert it with .tolist()"
        if shape else "convert it to a str, number, bool, None, list or dict"
    )
    raise UnsupportedValueError(f"{where} is a {type(value).__module__}.{type(value).__qualname__} {value!r:.80}, "
                                f"which metadata cannot hold: {hint}")


def _mapping_json(value: Mapping, where: str, depth: int) -> dict[str, object]:
    """A dict by the rule: `str` keys, each value converted by `to_json`."""
    out: dict[str, object] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise UnsupportedValueError(
                f"{where} has the key {k!r} of type {type(k).__name__}; metadata keys must be str "
                f"(JSON object keys), e.g. {str(k)!r}"
            )
        out[k] = to_json(v, f"{where}[{k!r}]", _depth=depth + 1)
    return out


def metadata_json(metadata: object, path: str) -> dict:
    """`save(metadata=)` as the JSON dict stored in the manifest's `user_metadata`.

    Raises:
      UnsupportedValueError: `metadata` is not a dict, or holds a value the rule refuses
        (names its key path and the checkpoint path).
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise UnsupportedValueError(f"metadata for {path} must be a dict, got {type(metadata).__name__}")
    try:
        return _mapping_json(metadata, "metadata", 0)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"saving {path}: {e}") from None


def metrics_json(metrics: Mapping[str, object] | None, path: str) -> dict:
    """The manager's `metrics=` as JSON: by the same rule, each value a number (stored as
    a float), a non-finite number (stored as "NaN" / "Infinity" / "-Infinity"), a str,
    a bool or None.

    Args:
      metrics: the metrics of one save.
      path: the checkpoint path of that save, for messages.
    Raises:
      UnsupportedValueError: a metric of another kind (a list, dict, array, object),
        naming it, e.g. `metrics['loss']`, and the checkpoint path.
    """
    if metrics is None:
        return {}
    try:
        return _metrics_json(metrics)
    except UnsupportedValueError as e:
        raise UnsupportedValueError(f"saving {path}: {e}") from None


def _metrics_json(metrics: object) -> dict:
    if not isinstance(metrics, Mapping):
        raise UnsupportedValueError(f"metrics must be a dict of numbers, got {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        where = f"metrics[{name!r}]"
        if not isinstance(name, str):
            raise UnsupportedValueError(f"metrics has the key {name!r} of type {type(name).__name__}; metric names must be str")
        v = to_json(value, where)
        if isinstance(v, (list, dict)):
            raise UnsupportedValueError(f"{where} must be a number, got {type(value).__name__} {value!r:.80}")
        try:
            out[name] = float(v) if isinstance(v, int) and not isinstance(v, bool) else v
        except OverflowError:  # an int beyond any float
            raise UnsupportedValueError(f"{where} = {value!r:.40} is too large for a float; metrics are stored as floats") from None
    return out
