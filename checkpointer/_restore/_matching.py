"""Matching a target tree to a checkpoint's leaves (pure): which target leaves are read,
which are kept as they are, and the errors that name what differs (`match`).

Matching rule (`match`): a target leaf whose leaf path is stored is read; a None target
leaf over a stored subtree is skipped with `partial=True` and an error naming both
otherwise; a target leaf the checkpoint lacks is kept as it is with
`missing="keep_target"` (a concrete value only) and an error otherwise; a stored leaf
the target lacks is an error unless `partial=True`, except a stored None where the
target holds an empty container (optax's `EmptyState()`, `()`, `{}`), which comes back
as the target's container (Orbax writes empty nodes as None placeholders). In a checkpoint
imported from Orbax, a target's integer dict key matches the string Orbax wrote for it
(`0` and `'0'`: NNX states), and a stored Python number restored into a numpy scalar comes
back as the target's numpy type when that holds it exactly. Messages name leaves by key
string (`jax.tree_util.keystr`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from .._errors import InvalidTargetError, StructureMismatchError
from .._format import ArrayMetadata, CheckpointMetadata, ValueMetadata, flatten, value_repr


def _is_target_leaf(x: object) -> bool:
    return x is None or isinstance(x, (jax.ShapeDtypeStruct, jax.Array, jax.sharding.Sharding, np.ndarray))


MISSING_CHOICES = ("error", "keep_target")


@dataclasses.dataclass(frozen=True)
class Match:
    """A target tree paired with a checkpoint's leaves (`match`).

    Attributes:
      treedef: the target's tree structure, or None ("rebuild from the manifest").
      pairs: `(leaf path, stored metadata, target leaf)` of the leaves to read, in target order.
      kept: leaf path → target leaf returned as it is (see `ResolvedTarget.kept`).
      order: every target leaf path, in target order.
      kept_keystrs: the kept leaves' key strings.
    """

    treedef: object | None
    pairs: list[tuple[str, ArrayMetadata | ValueMetadata, object]]
    kept: dict[str, object]
    order: tuple[str, ...]
    kept_keystrs: tuple[str, ...]


def _is_concrete_value(x: object) -> bool:
    """A target leaf that can stand for itself in the restored tree."""
    return x is None or isinstance(x, (jax.Array, np.ndarray, bool, int, float, complex, str, np.generic))


def _under(prefix: str, paths: Sequence[str]) -> list[str]:
    """The leaf paths strictly below `prefix` (every path is below the root `""`)."""
    return [p for p in paths if p != prefix and (prefix == "" or p.startswith(prefix + "/"))]


def match(meta: CheckpointMetadata, target: object, *, partial: bool, path: str, missing: str = "error") -> Match:
    """Pairs target leaves with stored leaves.

    Rules, per target leaf path: in the checkpoint → read. None where the checkpoint
    holds a subtree → kept as None with `partial=True`, else an error that says so.
    Absent from the checkpoint → kept as it is with `missing="keep_target"` (it must
    be a concrete value: a `jax.Array`, numpy array, scalar or None), else an error.
    Saved leaves absent from the target → an error unless `partial=True`.

    Raises:
      StructureMismatchError: leaf paths differ (names, as `jax.tree_util.keystr`
        prints them, the missing and extra leaves and the fix); a None target leaf over
        a saved subtree without `partial=True` (names both).
      InvalidTargetError: with `missing="keep_target"`, a target-only leaf that is
        abstract (a ShapeDtypeStruct or a Sharding): a value is needed.
      ValueError: `missing` is not one of `MISSING_CHOICES`.
    """
    if missing not in MISSING_CHOICES:
        raise ValueError(f"missing={missing!r}: expected one of {', '.join(repr(c) for c in MISSING_CHOICES)}")
    if target is None:
        return Match(None, [(p, m, None) for p, m in meta.leaves.items()], {}, (), ())
    flat = flatten_target(target)
    names = {p: jax.tree_util.keystr(kp) for (p, _), (kp, _) in zip(
        flat, jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_target_leaf)[0])}
    saved = list(meta.leaves)
    inner = {q.rsplit("/", i)[0] for q in saved for i in range(1, q.count("/") + 1)}  # the saved subtrees' paths
    if _imported_from_orbax(meta):
        flat, names = _orbax_int_keys(flat, names, set(saved) | inner)
    pairs: list[tuple[str, ArrayMetadata | ValueMetadata, object]] = []
    kept: dict[str, object] = {}
    covered: set[str] = set()
    missing_paths: list[str] = []
    none_over_subtree: list[tuple[str, list[str]]] = []
    abstract_kept: list[str] = []
    for p, leaf in flat:
        if p in meta.leaves:
            pairs.append((p, _typed_value(meta.leaves[p], leaf), leaf))
            covered.add(p)
            continue
        below = _under(p, saved) if leaf is None and (p == "" or p in inner) else []
        if below:
            covered.update(below)
            if partial:
                kept[p] = None
            else:
                none_over_subtree.append((p, below))
        elif missing == "keep_target":
            if _is_concrete_value(leaf):
                kept[p] = leaf
            else:
                abstract_kept.append(p)
        else:
            missing_paths.append(p)
    if none_over_subtree:
        lines = [f"the target does not match the checkpoint {path}:"]
        for p, below in none_over_subtree:
            shown = _show([meta.keystr(b) for b in below], 3)
            lines.append(
                f"  the target has None at {_name(names[p])} where the checkpoint holds a subtree of {len(below)} "
                f"leaves ({shown})"
            )
        lines.append(
            "A None target leaf stands for one array or value, not a subtree. Pass the abstract subtree there "
            "(e.g. jax.eval_shape(tx.init, params) for an optimizer state), or pass partial=True to skip it "
            "(it comes back as None)."
        )
        raise StructureMismatchError("\n".join(lines))
    if abstract_kept:
        raise InvalidTargetError(
            f"missing='keep_target': the target leaves {_show([_name(names[p]) for p in abstract_kept])} are not in "
            f"the checkpoint {path} and are abstract (a ShapeDtypeStruct or Sharding), so there is no value to keep. "
            "Give those leaves a value (initialise them, e.g. the new head's jax.Array), or remove them from the target."
        )
    extra = [p for p in saved if p not in covered] if not partial else []
    placeholders = {p for p in extra if _is_none_value(meta.leaves[p])}
    if placeholders:
        empty = empty_node_paths(target)
        extra = [p for p in extra if p not in empty or p not in placeholders]
    if missing_paths or extra:
        msg = [f"the target tree does not match the checkpoint {path}:"]
        if missing_paths:
            msg.append(
                f"  in the target but not in the checkpoint ({len(missing_paths)}): "
                f"{_show([_name(names[p]) for p in missing_paths])}"
            )
            holders = dict.fromkeys(q for p in missing_paths[:10] for q in saved if q == "" or p.startswith(q + "/"))
            for holder in list(holders)[:3]:
                m = meta.leaves[holder]
                what = f"the value {value_repr(m.value, 40)}" if isinstance(m, ValueMetadata) else f"an array {m.shape}"
                msg.append(f"  the checkpoint holds one leaf, {what}, at {_name(meta.keystr(holder))}, where the target has a subtree")
        if extra:
            msg.append(f"  in the checkpoint but not in the target ({len(extra)}): {_show([_name(meta.keystr(p)) for p in extra])}")
        fixes = ["Fix the target's structure (ckpt.metadata(path).tree shows the saved one)"]
        if extra and not missing_paths:
            fixes.append("or pass partial=True to restore a subset")
        if missing_paths and not extra:
            fixes.append("or, to keep the target's own values for leaves the checkpoint lacks (fine-tuning a new "
                         "head), pass missing='keep_target'")
        msg.append(", ".join(fixes) + ".")
        raise StructureMismatchError("\n".join(msg))
    treedef = jax.tree_util.tree_structure(target, is_leaf=_is_target_leaf)
    kept_names = tuple(names[p] for p in kept)
    return Match(treedef, pairs, kept, tuple(p for p, _ in flat), kept_names)


def _imported_from_orbax(meta: CheckpointMetadata) -> bool:
    origin = meta.user_metadata.get("imported_from") if isinstance(meta.user_metadata, dict) else None
    return isinstance(origin, dict) and origin.get("format") == "orbax"


def _orbax_int_keys(flat: list[tuple[str, object]], names: dict[str, str], stored: set[str]) -> tuple[list[tuple[str, object]], dict[str, str]]:
    """Target leaf paths with integer dict keys (`@int:0`, an `nnx.State` over an
    `nnx.List` or an optimizer's `opt_state`) renamed to the stored path where Orbax wrote
    the key as the string `'0'` (Orbax's metadata records every dict key as a string).
    Only paths the checkpoint holds and the target does not already hold are renamed: a
    key that differs (`1` against `'0'`) still mismatches."""
    own = {p for p, _ in flat}
    out, out_names = [], dict(names)
    for p, leaf in flat:
        if p not in stored and "@int:" in p:
            alt = "/".join(c[len("@int:"):] if c.startswith("@int:") else c for c in p.split("/"))
            if alt in stored and alt not in own:
                out_names[alt] = names[p]
                p = alt
        out.append((p, leaf))
    return out, out_names


_KINDS = {bool: "b", int: "iu", float: "f", complex: "c"}


def _typed_value(m: ArrayMetadata | ValueMetadata, target: object) -> ArrayMetadata | ValueMetadata:
    """A stored Python number restored into a numpy scalar of its kind comes back as the
    target's numpy type (`np.int64(-3)`: Orbax, and Python, store it as an int), when that
    type holds the value exactly; anything else is returned as stored."""
    if not (isinstance(m, ValueMetadata) and isinstance(target, np.generic)) or isinstance(m.value, np.generic):
        return m
    kind = _KINDS.get(type(m.value))
    if kind is None or target.dtype.kind not in kind:
        return m
    try:
        typed = target.dtype.type(m.value)
    except (OverflowError, ValueError, TypeError):
        return m
    if typed != m.value:
        return m
    return dataclasses.replace(m, value=typed)


def _name(keystr: str) -> str:
    """A key string for messages; the root leaf's empty one is shown as `<root>`."""
    return keystr or "<root>"


def flatten_target(target: object) -> list[tuple[str, object]]:
    """(leaf path, target leaf) pairs; ShapeDtypeStructs, arrays, shardings and None are leaves."""
    return flatten(target, is_leaf=_is_target_leaf)


def _is_none_value(m: ArrayMetadata | ValueMetadata) -> bool:
    return isinstance(m, ValueMetadata) and m.value is None


def _is_empty_node(x: object) -> bool:
    """A pytree node without leaves (`EmptyState()`, `()`, `{}`, `[]`); None is a leaf here."""
    if _is_target_leaf(x):
        return False
    return len(jax.tree_util.tree_leaves(x, is_leaf=_is_target_leaf)) == 0


def empty_node_paths(target: object) -> set[str]:
    """The leaf paths of the target's empty containers (where a stored None placeholder fits)."""
    return {p for p, x in flatten(target, is_leaf=lambda x: _is_target_leaf(x) or _is_empty_node(x)) if _is_empty_node(x)}


def _show(paths: list[str], n: int = 10) -> str:
    shown = ", ".join(paths[:n])
    return shown + (f", ... ({len(paths) - n} more)" if len(paths) > n else "")
