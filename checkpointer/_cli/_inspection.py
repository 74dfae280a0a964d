"""The commands that show what a directory or a checkpoint holds: `ls` (step folders,
committed or not, and the local tier), `inspect` (a checkpoint's tree and metadata) and
`timeline` (where each save's time went)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from .. import _commit, _format, _manage, _tools
from .._errors import CheckpointError, StructureMismatchError, UsageError
from ._inputs import _lock_holder, _metadata, _open_dir
from ._ui import _UI, PROG, _age, _json_value, _metrics_str, _shape, _spec_json


def _generation_time(generation: str | None) -> float | None:
    t = _format.generation_time(generation) if generation else None
    return None if t is None else t.timestamp()


def _state(e: _commit.StepEntry, committed: set[int]) -> str:
    if _format.parse_deleting_name(e.name):
        return "deleting"
    if e.retired:
        return "retired"  # kept only for the chunks newer steps reference (incremental saves)
    if e.generation is None:
        return "committed" if e.committed else "no marker"
    if e.committed:
        return "committed, not renamed" if e.step not in committed else "superseded"
    return "partial"


def _cmd_ls(args, ui: _UI) -> int:
    from .._format import read_metadata

    storage, directory = _open_dir(args.directory)
    names = storage.list_dir(directory)  # one listing for the steps and the foreign entries
    found = _commit.entries(storage, directory, names)
    if not found and storage.exists(f"{directory}/{_format.COMMITTED}"):
        raise UsageError(f"{directory} is one checkpoint, not a directory of steps: use `{PROG} inspect {directory}`")
    # Steps committed in their own `<step>/` (a committed partial of another step is
    # "committed, not renamed"; see `_commit.committed_folders`), by the markers just read.
    committed = {e.step for e in found if e.committed and e.generation is None and not e.retired}
    now = time.time()
    rows = []
    for e in found:
        state = _state(e, committed)
        row: dict[str, Any] = {"step": e.step, "folder": e.name, "state": state, "committed": state == "committed",
               "size_bytes": None, "shared_bytes": 0, "shared_from": [], "created_unix_s": None, "age_s": None,
               "metrics": {}, "note": None}
        if e.retired:
            row["note"] = "only the chunks newer steps reference are kept"
        elif e.committed:
            try:
                meta = read_metadata(storage, f"{directory}/{e.name}")
                row["created_unix_s"] = meta.created_unix_s or None
                metrics = meta.user_metadata.get("metrics", {})
                row["metrics"] = {k: _json_value(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {}
                row["size_bytes"] = sum(meta.process_bytes_written)  # replaced by the files' sizes where cheap
                # Incremental saves: data bytes this step references in earlier steps (it owns `size_bytes`).
                row["shared_bytes"] = meta.referenced_bytes
                row["shared_from"] = sorted(meta.referenced_folders)
            except CheckpointError as err:
                row["note"] = "manifest unreadable: " + " ".join(str(err).split())
        if row["created_unix_s"] is None:
            row["created_unix_s"] = _generation_time(e.generation)
        folder = f"{directory}/{e.name}"
        size = storage.folder_bytes(folder)
        if size is not None:
            row["size_bytes"] = size
        if row["created_unix_s"] is None:
            row["created_unix_s"] = storage.modified_unix_s(folder)
        if row["created_unix_s"] is not None:
            row["age_s"] = max(0.0, now - row["created_unix_s"])
        rows.append(row)
    holder = _lock_holder(storage, directory)
    foreign = _commit.foreign_entries(storage, directory, names)
    local_rows = _manage.local_listing(args.local, storage, directory) if args.local else None
    if ui.json_mode:
        doc: dict[str, Any] = {"directory": directory, "manager": holder, "steps": rows, "foreign": foreign}
        if local_rows is not None:
            doc["local"] = local_rows
        ui.json(doc)
        return 0
    if local_rows is not None:  # two tiers: what each process holds on its node-local tier
        ui.table(
            ["process", "step", "state", "size", "folder"],
            [(r["process"], r["step"], r["state"], _format.format_bytes(r["size_bytes"]), r["folder"]) for r in local_rows],
            right=["process", "step", "size"], title=f"local tier {args.local}",
        )
        if any(r["state"] == "not durable" for r in local_rows):
            ui.line("Steps 'not durable' are committed on that node only (replication pending, failed or cut short); "
                    "a restart resumes from one only when every process holds it whole.")
    if not rows and not foreign:
        ui.line(f"no step folders in {directory}")
        return 0
    if any(r["shared_bytes"] for r in rows):  # incremental saves: what each step owns, what it shares
        ui.table(
            ["step", "state", "owns", "shares", "from", "age", "metrics", "folder"],
            [(r["step"], r["state"] + (f" ({r['note']})" if r["note"] else ""), _format.format_bytes(r["size_bytes"]),
              _format.format_bytes(r["shared_bytes"]), ",".join(r["shared_from"]) or "-", _age(r["age_s"]),
              _metrics_str(r["metrics"]) or "-", r["folder"]) for r in rows]
            + [("-", "foreign", "-", "-", "-", "-", "-", name) for name in foreign],
            right=["step", "owns", "shares", "age"], title=f"{directory}",
        )
        ui.line("owns: bytes of the step's own files; shares: data bytes it references in the steps under 'from' "
                "(incremental saves), which retention keeps while it does.")
    else:
        ui.table(
            ["step", "state", "size", "age", "metrics", "folder"],
            [(r["step"], r["state"] + (f" ({r['note']})" if r["note"] else ""), _format.format_bytes(r["size_bytes"]), _age(r["age_s"]),
              _metrics_str(r["metrics"]) or "-", r["folder"]) for r in rows]
            + [("-", "foreign", "-", "-", "-", name) for name in foreign],
            right=["step", "size", "age"], title=f"{directory}",
        )
    if foreign:
        ui.line(f"Foreign entries ({len(foreign)}) are not step folders (a step folder's name is the step in plain "
                "decimal, e.g. 900000, not 0900000): readers ignore them and nothing deletes them.")
    n_partial = sum(1 for r in rows if r["state"] == "partial")
    n_other = len(rows) - n_partial - len(committed)
    summary = f"{len(committed)} committed, {n_partial} partial" + (f", {n_other} other" if n_other else "")
    ui.line(summary + ".")
    if any(r["state"] == "no marker" for r in rows):
        ui.line("Folders without a commit marker are not checkpoints (on object stores: a save in flight or a crashed "
                "one); gc removes them once they have stayed unchanged for an hour.")
    if n_partial and storage.supports_locks:
        # A save in flight holds an flock on `<partial>.lock` (with or without a manager).
        writing = sum(1 for r in rows if r["state"] == "partial"
                      and storage.lock_holder(f"{directory}/{r['folder']}{_commit.SAVE_LOCK_SUFFIX}") is not None)
        crashed = n_partial - writing
        if writing:
            ui.line(f"{writing} partial folder(s) are saves in flight (their save holds its lock).")
        if crashed:
            ui.line(f"{crashed} partial folder(s) are crashed saves: readers never remove them (nor does opening a "
                    f"CheckpointManager); its first save or recover() does, and so does `{PROG} gc {args.directory}`"
                    + (" once the manager holding it closes." if holder else "."))
    elif holder:
        ui.line(f"A CheckpointManager holds this directory ({holder}): partial folders may be saves in flight.")
    return 0


def _cmd_inspect(args, ui: _UI) -> int:
    from .._format import ArrayMetadata

    meta = _metadata(args.path)
    if args.leaf and not args.png:
        raise UsageError("--leaf selects the leaves --png draws; add --png OUT")
    if args.png and not meta.arrays:
        raise UsageError(f"--png draws the shard maps of array leaves; {meta.path} holds none (only values)")
    if args.png:
        _draw(lambda: _tools.plot_shards(meta, args.leaf), args.png)
    leaves = []
    for p, m in meta.leaves.items():
        if isinstance(m, ArrayMetadata):
            leaves.append({
                "path": p, "keystr": meta.keystr(p), "type": "array", "shape": list(m.shape), "dtype": str(m.dtype), "key_impl": m.key_impl,
                "kind": m.kind,
                "saved_sharding": m.saved_sharding.describe() if m.saved_sharding else None,
                "saved_spec": _spec_json(m.saved_sharding.spec) if m.saved_sharding and m.saved_sharding.kind == "named" else None,
                "chunk_shape": list(m.chunk_shape), "inner_chunk_shape": list(m.inner_chunk_shape), "bytes": m.nbytes,
                "packed": m.packed,
            })
        else:
            leaves.append({"path": p, "keystr": meta.keystr(p), "type": "value", "value_type": type(m.value).__name__,
                           "value": _json_value(m.value)})
    info = {
        "path": meta.path, "step": meta.step, "format_version": meta.format_version, "process_count": meta.process_count,
        "created_unix_s": meta.created_unix_s, "library_version": meta.library_version, "jax_version": meta.jax_version,
        "user_metadata": meta.user_metadata, "total_bytes": meta.total_bytes, "leaves": leaves,
    }
    if args.png:
        info["png"] = args.png
    if ui.json_mode:
        ui.json(info)
        return 0
    created = datetime.datetime.fromtimestamp(meta.created_unix_s, datetime.UTC) if meta.created_unix_s else None
    n_arrays = sum(1 for leaf in leaves if leaf["type"] == "array")
    ui.fields([
        ("path", meta.path),
        ("step", meta.step if meta.step is not None else "-"),
        ("created", f"{created:%Y-%m-%d %H:%M:%S} UTC ({_age(time.time() - meta.created_unix_s)} ago)" if created else "-"),
        ("processes", meta.process_count),
        ("versions", f"format {meta.format_version}, checkpointer {meta.library_version or '?'}, jax {meta.jax_version or '?'}"),
        ("leaves", f"{n_arrays} array{'s' * (n_arrays != 1)}, {len(leaves) - n_arrays} value{'s' * (len(leaves) - n_arrays != 1)}"),
        ("total bytes", f"{meta.total_bytes} ({_format.format_bytes(meta.total_bytes)})"),
        ("user metadata", json.dumps(meta.user_metadata, sort_keys=True) if meta.user_metadata else "-"),
    ])
    rows = []
    for leaf in leaves:
        name = leaf["keystr"] or "<root>"
        if leaf["type"] == "array":
            dtype = leaf["dtype"] + (f" (key<{leaf['key_impl']}>)" if leaf["key_impl"] else "")
            sharding = leaf["saved_sharding"] or "host numpy array"
            # A packed leaf's chunks are byte ranges of the processes' packs: no inner chunks.
            inner = "packed" if leaf["packed"] else _shape(leaf["inner_chunk_shape"])
            rows.append((name, _shape(leaf["shape"]), dtype, sharding, _shape(leaf["chunk_shape"]), inner, leaf["bytes"]))
        else:
            value = _format.value_repr(meta.leaves[leaf["path"]].value, 40)
            rows.append((name, "-", leaf["value_type"], f"value {value}", "-", "-", "-"))
    ui.table(["leaf", "shape", "dtype", "saved sharding", "chunk", "inner chunk", "bytes"], rows, right=["bytes"],
             footer=["total", "", "", "", "", "", meta.total_bytes])
    if args.png:
        ui.line(f"wrote the shard map to {args.png}")
    return 0


def _draw(figure: Callable[[], Any], out: str) -> None:
    """Draws `figure()` into the PNG file `out`; a missing matplotlib or an unknown leaf is a usage error."""
    try:
        fig = figure()
    except ModuleNotFoundError as e:
        raise UsageError(f"--png needs matplotlib ({e}); install it with `pip install 'checkpointer[notebook]'`") from e
    except StructureMismatchError as e:
        raise UsageError(f"--leaf: {e}") from e
    _tools.save_png(fig, out)


def _cmd_timeline(args, ui: _UI) -> int:
    from .. import _tools

    phases = _tools.read_timeline(args.location, last=args.last)
    if args.png and phases:
        try:
            _tools.render_png(phases, args.png, title=f"{PROG} timeline {args.location}")
        except ModuleNotFoundError as e:
            raise UsageError(f"--png needs matplotlib ({e}); install it with `pip install matplotlib`") from e
    if ui.json_mode:
        ui.json({"phases": [dataclasses.asdict(p) for p in phases], "png": args.png if phases else None})
        return 0
    if not phases:
        ui.line(f"{args.location}: no save phases recorded (saved by a version without timestamps)")
        return 0
    with ui.out.capture() as cap:
        _tools.render_text(phases, ui.out, width=args.width)
    sys.stdout.write(cap.get() if ui.out.is_terminal else "".join(ln.rstrip() + "\n" for ln in cap.get().splitlines()))
    if args.png:
        ui.line(f"wrote {args.png}")
    return 0
