"""Import Orbax step folders and whole Orbax CheckpointManager directories (`import_orbax`).

What a CheckpointManager writes (orbax-checkpoint 0.12):

```
DIR/<step>/                     a finalized step (plain decimal, or `<prefix>_<step>`,
                                maybe zero-padded); `<step>.orbax-checkpoint-tmp-<t>/` is
                                one being written (never finalized on POSIX: renamed when done)
DIR/<step>/commit_success.txt   written last on object stores (no rename there): the
                                step is finalized only when it is present
DIR/<step>/_CHECKPOINT_METADATA {"item_handlers": {item: handler class}, "metrics": {...}, ...}
DIR/<step>/<item>/              one folder per item: a PyTree item (`_METADATA`, read by
                                `_orbax_import`), or a JSON item (JsonCheckpointHandler:
                                one file `metadata`); `metrics/metrics` holds the metrics
```

How a step comes over: a single item named `default` (a manager without `Composite`)
becomes the whole tree, as Orbax restores it; otherwise every tree item becomes the
subtree named by the item (`tree["state"]`, as Orbax's `Composite` restores); JSON items
go to `user_metadata["orbax_items"][name]`; the metrics (the `metrics` item, or
`_CHECKPOINT_METADATA`'s) to `user_metadata["metrics"]`, where `KeepBest` and
`checkpointer ls` read them. An item of another handler raises, naming it: nothing is
dropped without a word. A manager directory becomes a directory of steps `DST/<step>`;
a step already imported from the same Orbax step is kept (the import resumes).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Callable

from .._errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedValueError
from .._format import metrics_json, read_metadata
from .._save import ArraySource, save_leaf_by_leaf
from .._storage import Storage, storage_for
from ._orbax_import import METADATA_FILE, OrbaxItem, below, orbax_tree, read_json

CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
COMMIT_SUCCESS = "commit_success.txt"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
JSON_ITEM_FILE = "metadata"  # JsonCheckpointHandler's default file name
METRICS_ITEM = "metrics"
_STEP_NAME = re.compile(r"^(?:.*_)?(\d+)$")

# progress(steps done, steps in all, the step just done): after each step of a directory.
ImportProgress = Callable[[int, int, int], None]


@dataclasses.dataclass(frozen=True)
class ImportReport:
    """What `import_orbax` imported.

    Attributes:
      src: the Orbax folder imported (an item, a step, or a manager directory).
      dst: the checkpoint (or, for a manager directory, the directory) written.
      step: the step recorded (None for a directory, or a `dst` not named by a number).
      items: Orbax item name -> what it became: `"tree"` (the whole tree), `"tree['state']"`
        (a subtree), `"user_metadata['orbax_items']['extra']"`, `"user_metadata['metrics']"`.
      placeholders: key string -> Orbax's type of each empty node the tree holds as a
        None (or `{}`, `[]`, `()`) leaf; restore fills a None placeholder with the
        target's empty container (optax's `EmptyState()`).
      prng_keys: key strings of the typed PRNG key arrays (restored typed).
      metrics: the metrics stored with the step.
      arrays: array leaves written.
      values: non-array leaves written.
      total_bytes: bytes of array data written.
      elapsed_s: wall time of the import, seconds.
      steps: a manager directory: one report per step imported, in step order.
      resumed: a manager directory: the steps already imported into `dst`, kept.
    """

    src: str
    dst: str
    step: int | None
    items: dict
    placeholders: dict
    prng_keys: tuple[str, ...]
    metrics: dict
    arrays: int
    values: int
    total_bytes: int
    elapsed_s: float
    steps: tuple[ImportReport, ...] = ()
    resumed: tuple[int, ...] = ()


# Where Orbax's custom_metadata goes when it is not an object, or for its keys that the
# import's own keys (imported_from, orbax_items, metrics) would replace.
ORBAX_CUSTOM_METADATA = "orbax_custom_metadata"


def _json_file(storage: Storage, path: str) -> object:
    return read_json(storage, path)


def _handlers(storage: Storage, step_dir: str) -> dict[str, str]:
    path = f"{step_dir}/{CHECKPOINT_METADATA}"
    meta = _json_file(storage, path) if storage.exists(path) else {}
    handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
    return {str(k): str(v) for k, v in handlers.items()} if isinstance(handlers, dict) else {}


def _is_step(storage: Storage, path: str) -> bool:
    return storage.exists(f"{path}/{CHECKPOINT_METADATA}") or any(
        storage.exists(f"{path}/{n}/{METADATA_FILE}") for n in storage.list_dir(path))


def _json_item_file(storage: Storage, folder: str, handler: str) -> str | None:
    """The file of a JSON item: `metadata`, or the one file of a JsonCheckpointHandler's
    folder besides `commit_success.txt` (the manager's `metrics` item writes `metrics`)."""
    if storage.exists(f"{folder}/{JSON_ITEM_FILE}") and ("Json" in handler or not handler):
        return f"{folder}/{JSON_ITEM_FILE}"
    if "Json" not in handler:
        return None
    files = [n for n in storage.list_dir(folder) if n != COMMIT_SUCCESS and not storage.is_folder(f"{folder}/{n}")]
    return f"{folder}/{files[0]}" if len(files) == 1 else None


def _step_items(storage: Storage, step_dir: str) -> list[tuple[str, str]]:
    """(item name, "tree" | JSON file) of each item of a step folder, sorted by name.

    Raises:
      UnsupportedValueError: an item written by a handler this import does not read.
    """
    handlers = _handlers(storage, step_dir)
    names = sorted(set(handlers) | {n for n in storage.list_dir(step_dir) if storage.is_folder(f"{step_dir}/{n}")})
    out = []
    for name in names:
        folder, handler = f"{step_dir}/{name}", handlers.get(name, "")
        if not storage.is_folder(folder):  # a handler registered for an item this step did not save
            continue
        json_file = None if storage.exists(f"{folder}/{METADATA_FILE}") else _json_item_file(storage, folder, handler)
        if storage.exists(f"{folder}/{METADATA_FILE}"):
            out.append((name, "tree"))
        elif json_file is not None:
            out.append((name, json_file))
        elif name in handlers or storage.list_dir(folder):
            raise UnsupportedValueError(
                f"{folder}: item {name!r} of the Orbax step {step_dir} was written by "
                f"{handler or 'an unknown handler'}; this import reads PyTree/Standard items (with {METADATA_FILE}) "
                "and JSON items. Restore that item with Orbax and save it with ckpt.save (or import the other "
                f"items one by one: import_orbax('{step_dir}/<item>', ...))"
            )
    return out


def _leaf_counts(tree: object) -> tuple[int, int, int]:
    import jax

    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None or isinstance(x, ArraySource))
    arrays = [x for x in leaves if isinstance(x, ArraySource)]
    nbytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)
    return len(arrays), len(leaves) - len(arrays), nbytes


def _read_step(storage: Storage, src: str) -> tuple[object, dict, dict, dict, tuple[str, ...], dict]:
    """(tree, items, orbax JSON items, placeholders, prng keys, metrics) of an item or step folder."""
    if storage.exists(f"{src}/{METADATA_FILE}"):
        item = orbax_tree(src)
        return item.tree, {os.path.basename(src): "tree"}, {}, item.placeholders, item.prng_keys, {}
    items = _step_items(storage, src)
    if not items:
        raise CheckpointNotFoundError(
            f"{src} is not an Orbax PyTree checkpoint: no {METADATA_FILE} in it or in a subfolder (an Orbax "
            "CheckpointManager step folder holds one folder per item, e.g. <step>/default). Checkpoints written "
            "by Orbax before _METADATA existed: restore them with Orbax and save them with ckpt.save"
        )
    trees: dict[str, OrbaxItem] = {name: orbax_tree(f"{src}/{name}") for name, kind in items if kind == "tree"}
    became: dict[str, str] = {}
    json_items: dict[str, object] = {}
    metrics: dict = {}
    for name, kind in items:
        if kind == "tree":
            continue
        value = _json_file(storage, kind)
        if name == METRICS_ITEM and isinstance(value, dict):
            metrics, became[name] = value, "user_metadata['metrics']"
        else:
            json_items[name], became[name] = value, f"user_metadata['orbax_items'][{name!r}]"
    if not metrics:
        meta_path = f"{src}/{CHECKPOINT_METADATA}"
        step_meta = _json_file(storage, meta_path) if storage.exists(meta_path) else {}
        if isinstance(step_meta, dict) and isinstance(step_meta.get("metrics"), dict):
            metrics = step_meta["metrics"]
    placeholders: dict[str, str] = {}
    prng: list[str] = []
    if list(trees) == ["default"]:  # a manager without Composite: the item is the tree
        tree: object = trees["default"].tree
        became["default"] = "tree"
        placeholders.update(trees["default"].placeholders)
        prng += trees["default"].prng_keys
    else:
        tree = {name: t.tree for name, t in trees.items()}
        for name, t in trees.items():
            became[name] = f"tree[{name!r}]"
            placeholders.update({f"[{name!r}]{k}": v for k, v in t.placeholders.items()})
            prng += [f"[{name!r}]{k}" for k in t.prng_keys]
    return tree, dict(sorted(became.items())), json_items, placeholders, tuple(prng), metrics


def _custom_metadata(storage: Storage, src: str) -> object:
    """The `custom_metadata` of the step's (or checkpoint's) `_CHECKPOINT_METADATA`: what
    `save(..., custom_metadata=)` of Orbax's Checkpointer or CheckpointManager stored (and
    this library's export of `save(metadata=)`); None if absent."""
    path = f"{src}/{CHECKPOINT_METADATA}"
    meta = _json_file(storage, path) if storage.exists(path) else {}
    return meta.get("custom_metadata") if isinstance(meta, dict) else None


def _import_one(storage: Storage, src: str, dst: str, step: int | None, overwrite: bool) -> ImportReport:
    t0 = time.perf_counter()
    tree, items, json_items, placeholders, prng, metrics = _read_step(storage, src)
    user: dict = {}
    custom = _custom_metadata(storage, src)
    if isinstance(custom, dict):  # the user's own keys, as save(metadata=) stores them
        user.update({str(k): v for k, v in custom.items()})
    elif custom is not None:
        user[ORBAX_CUSTOM_METADATA] = custom
    # The import's own keys win; a custom value under one of them is kept aside.
    clashes = {k: user.pop(k) for k in ("imported_from", "orbax_items", "metrics", ORBAX_CUSTOM_METADATA)
               if k in user and isinstance(custom, dict)}
    if clashes:
        user[ORBAX_CUSTOM_METADATA] = clashes
    user["imported_from"] = {"format": "orbax", "path": src, "items": items, "placeholders": placeholders}
    if json_items:
        user["orbax_items"] = json_items
    stored_metrics = metrics_json(metrics, dst) if metrics else {}
    if stored_metrics:
        user["metrics"] = stored_metrics
    save_leaf_by_leaf(dst, tree, metadata=user, step=step, overwrite=overwrite)
    arrays, values, nbytes = _leaf_counts(tree)
    return ImportReport(src, dst, step, items, placeholders, prng, stored_metrics, arrays, values, nbytes,
                        time.perf_counter() - t0)


def orbax_steps(storage: Storage, directory: str) -> list[tuple[int, str]]:
    """(step, folder) of each finalized step of an Orbax manager directory, by step.

    A folder counts when its name is a step (`100`, `0100`, `<prefix>_100`) without the
    `.orbax-checkpoint-tmp` suffix, it holds Orbax items, and, on a store without rename
    (object stores), its `commit_success.txt` is there.

    Raises:
      CorruptCheckpointError: two folders name one step (`3` and `ckpt_3`); names both.
    """
    out: dict[int, str] = {}
    for name in storage.list_dir(directory):
        m = _STEP_NAME.match(name)
        folder = f"{directory}/{name}"
        if TMP_SUFFIX in name or m is None:
            continue
        if not storage.supports_rename and not storage.exists(f"{folder}/{COMMIT_SUCCESS}"):
            continue
        if _is_step(storage, folder):
            step = int(m.group(1))
            if step in out:
                first, second = sorted((out[step], folder))
                raise CorruptCheckpointError(
                    f"{directory} holds two Orbax folders of step {step}: {first} and {second}; importing the "
                    "directory would leave one out. Import each on its own: import_orbax(FOLDER, DST/<step>)"
                )
            out[step] = folder
    return sorted(out.items())


def _import_run(storage: Storage, src: str, dst: str, steps: list[tuple[int, str]], overwrite: bool,
                progress: ImportProgress | None) -> ImportReport:
    t0 = time.perf_counter()
    dst_storage, dst = storage_for(dst)
    done: list[ImportReport] = []
    resumed: list[int] = []
    for i, (step, folder) in enumerate(steps):
        target = f"{dst}/{step}"
        try:
            previous = read_metadata(dst_storage, target)
        except CheckpointNotFoundError:
            previous = None
        if previous is not None and not overwrite:
            origin = previous.user_metadata.get("imported_from", {})
            if not (isinstance(origin, dict) and origin.get("path") == folder):
                raise CheckpointExistsError(
                    f"{target} is a committed checkpoint that was not imported from {folder}; pass overwrite=True "
                    "(--overwrite) to replace it, or import into another directory"
                )
            resumed.append(step)
        else:
            done.append(_import_one(storage, folder, target, step, overwrite))
        if progress is not None:
            progress(i + 1, len(steps), step)
    return ImportReport(
        src, dst, None, {k: v for r in done for k, v in r.items.items()},
        {k: v for r in done for k, v in r.placeholders.items()}, tuple(dict.fromkeys(k for r in done for k in r.prng_keys)),
        {}, sum(r.arrays for r in done), sum(r.values for r in done), sum(r.total_bytes for r in done),
        time.perf_counter() - t0, tuple(done), tuple(resumed))


def _check_outside(storage: Storage, src: str, dst: str | os.PathLike, steps: list[str] | None) -> None:
    """Refuses a `dst` inside the Orbax checkpoint `src` (`steps` None), or inside one of the
    step folders `steps` of the Orbax run `src`: it would change an Orbax checkpoint, and
    Orbax's retention would delete it with the step. Beside a run's steps is fine."""
    dst_storage, dst_path = storage_for(dst)
    if type(dst_storage) is not type(storage):
        return
    rel = below(src, dst_path)
    if rel is None:
        return
    inside = src if steps is None else None
    if steps is not None:
        first = rel.split("/", 1)[0]
        inside = f"{src.rstrip('/')}/{first}" if first in steps else None
    if inside is not None:
        raise CheckpointExistsError(
            f"{dst_path} is inside the Orbax checkpoint {inside}: the import would change it, and Orbax's retention "
            "would delete the import with it; nothing was written. Import into a folder outside it")


def import_orbax(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: ImportProgress | None = None,
) -> ImportReport:
    """Converts an Orbax checkpoint, or a whole Orbax run, into checkpointer checkpoints.

    Reads through TensorStore only (Orbax need not be installed): OCDBT or plain zarr
    (v2 or v3) layouts, with Orbax's PyTree metadata (`_METADATA`, `_sharding`,
    `_strings.json`, `array_metadatas/`). The tree comes out as Orbax restores it
    without a target: dicts and lists, scalars as Python numbers (a numpy scalar
    of a dtype no Python number is stored as, `np.float32(1.5)`, keeps its type; a target
    holding numpy scalars gets its own types back), strings; each array
    keeps its dtype, global shape and saved sharding, and restores onto any mesh like a
    checkpoint written by `ckpt.save`. Typed PRNG keys come back typed. Integer keys
    of NNX containers (`nnx.State`, `nnx.List` layers), which Orbax writes as strings
    (`'0'`), stay strings without a target and match the target's integer keys on
    restore (`restore`'s matching: for Orbax imports only). Empty nodes
    Orbax wrote as None (optax's `EmptyState()`) are None leaves that restore into the
    target's empty container; the report and `user_metadata["imported_from"]
    ["placeholders"]` list them.

    Args:
      src: an Orbax item folder (holding `_METADATA`); a CheckpointManager step folder
        (every item comes over: a lone `default` item is the tree, other tree items are
        subtrees named by the item, JSON items go to `user_metadata["orbax_items"]`,
        the metrics to `user_metadata["metrics"]`); or a CheckpointManager directory
        (every finalized step). Local path or kvstore URL.
      dst: the checkpoint path to write (a last component that is an integer is
        recorded as the step); for a manager directory, the directory that receives
        `dst/<step>` for every step. `user_metadata["imported_from"]` records the
        Orbax folder, what each item became and the placeholders; the keys of Orbax's
        `custom_metadata` (`_CHECKPOINT_METADATA`) are user metadata keys (those named
        `imported_from`, `orbax_items`, `metrics` in `user_metadata["orbax_custom_metadata"]`).
      overwrite: replace committed checkpoints at `dst`. Without it a directory
        import resumes: steps already imported from the same Orbax step are kept.
      progress: a directory import calls `progress(steps_done, steps_total, step)`
        after each step (the command line draws a progress bar with it).
    Returns:
      An `ImportReport` (for a directory, with one report per step in `steps`).
    Raises:
      CheckpointNotFoundError: no Orbax checkpoint at `src`.
      UnsupportedValueError: a leaf written by a custom Orbax TypeHandler, an item of
        another handler, or a dtype the format cannot hold (names it).
      CheckpointExistsError: `dst` (or a step in it not imported from `src`) is
        committed and `overwrite` is False; `dst` is inside the Orbax checkpoint `src`
        or inside one step folder of the Orbax run `src`.
      CorruptCheckpointError: the Orbax metadata or an array cannot be read.
      SaveError: writing failed; nothing was committed for that step.

    Host memory: about one chunk of the source array plus one chunk written (at most
    64 MiB), never the whole tree. Multi-process: call from one process.
    """
    storage, src = storage_for(src)
    if not storage.exists(f"{src}/{METADATA_FILE}") and not _is_step(storage, src):
        steps = orbax_steps(storage, src) if storage.is_folder(src) else []
        if steps:
            _check_outside(storage, src, dst, [os.path.basename(folder) for _, folder in steps])
            return _import_run(storage, src, os.fspath(dst), steps, overwrite, progress)
    else:  # an item or step folder (anything else is refused below as not an Orbax checkpoint)
        _check_outside(storage, src, dst, None)
    name = os.fspath(dst).rstrip("/").rsplit("/", 1)[-1]
    step = int(name) if name.isascii() and name.isdigit() else None
    return _import_one(storage, src, os.fspath(dst), step, overwrite)
