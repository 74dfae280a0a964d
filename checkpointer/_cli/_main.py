"""The `checkpointer` command line: ls, inspect, plan, verify, gc, drill, timeline, import-orbax, export.

Every subcommand prints readable tables (rich) or, with `--json`, one JSON document on
stdout. Errors are one line on stderr, `checkpointer: error: ...`, with exit status 2
for usage errors and missing checkpoints, 1 for failed verifications, drills and other
failures, 0 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import _commit, _format, _manage, _tools
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    DTypeMismatchError,
    InvalidTargetError,
    MeshError,
    ShapeMismatchError,
    StructureMismatchError,
    UsageError,
)
from .._storage import Storage, storage_for

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec

PROG = "checkpointer"

_SPEC_RULE = """\
Default target per leaf: each entry of the leaf's saved PartitionSpec is kept when every
mesh axis it names exists in the new mesh and the product of those axes' sizes divides
that dimension; otherwise that dimension is replicated (None). Leaves saved without a
named sharding (one device, a host numpy array) are replicated.

--spec GLOB=SPEC overrides the default for every leaf whose name matches GLOB; the
last matching --spec wins. Names are key paths as `inspect` prints them, like
jax.tree_util.keystr: ['params']['dense']['kernel'], .opt_state[0].mu['w']. In GLOB, '*'
matches any characters and '?' one; brackets and dots are literal. The escaped storage
path (params/dense/kernel) is matched too. SPEC is one entry per dimension,
comma-separated: a mesh axis name, several joined with '+' for one dimension, or
'none' / empty for None. Examples: "['params']*=data,model",
'*opt_state*=data+model,none', '.step=' (replicated)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with errors raised (one line) instead of printed with the usage."""

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# --- formatting -------------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _spec_str(spec) -> str:
    parts = [repr(e) if not isinstance(e, tuple) else "(" + ", ".join(repr(a) for a in e) + ")" for e in spec]
    return f"P({', '.join(parts)})"


def _spec_json(spec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _metrics_str(metrics: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def _json_value(v: object) -> object:
    if v is None or isinstance(v, (bool, str)) or isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v):
        return v
    return repr(v)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, (CheckpointError, UsageError)):
        return text or type(e).__name__
    if isinstance(e, OSError):
        return f"{type(e).__name__}: {text}"
    return f"internal error: {type(e).__name__}: {text} (rerun with --traceback for details)"


def _exit_code(e: BaseException) -> int:
    usage = (UsageError, FileNotFoundError, NotADirectoryError, InvalidTargetError, MeshError, ShapeMismatchError,
             DTypeMismatchError, StructureMismatchError)
    return 2 if isinstance(e, usage) else 1


class _UI:
    """Where output goes: rich consoles on stdout/stderr, or JSON on stdout."""

    def __init__(self, json_mode: bool):
        from rich.console import Console

        self.json_mode = json_mode
        out = Console(file=sys.stdout, highlight=False, soft_wrap=False)
        if not out.is_terminal and "COLUMNS" not in os.environ:
            out = Console(file=sys.stdout, highlight=False, soft_wrap=False, width=200)
        self.out = out
        self.err = Console(file=sys.stderr, highlight=False)

    def json(self, obj: object) -> None:
        sys.stdout.write(json.dumps(obj, indent=2) + "\n")

    def line(self, text: str = "", style: str | None = None) -> None:
        from rich.text import Text

        self._print(Text(text, style=style or ""))

    def _print(self, renderable) -> None:
        if self.out.is_terminal:
            self.out.print(renderable)
            return
        with self.out.capture() as cap:  # plain text: no padding at line ends
            self.out.print(renderable)
        sys.stdout.write("".join(line.rstrip() + "\n" for line in cap.get().splitlines()))

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[object]], *, right: Sequence[str] = (),
              title: str | None = None, footer: Sequence[object] | None = None) -> None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        t = Table(box=box.SIMPLE, title=title, title_justify="left", show_footer=footer is not None, show_edge=False,
                  pad_edge=False)
        for i, c in enumerate(columns):
            t.add_column(c, justify="right" if c in right else "left", no_wrap=True,
                         footer=Text(str(footer[i])) if footer is not None else "")
        for r in rows:
            t.add_row(*(Text(str(x)) for x in r))
        self._print(t)

    def fields(self, pairs: Sequence[tuple[str, object]]) -> None:
        from rich.table import Table
        from rich.text import Text

        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold", no_wrap=True)
        t.add_column()
        for k, v in pairs:
            t.add_row(Text(k), Text(str(v)))
        self._print(t)


@contextlib.contextmanager
def _quiet_library_logs():
    """Keeps the library's log records off stderr (Python's last-resort handler); the
    commands print what happened themselves."""
    logger = logging.getLogger("checkpointer")
    handler = logging.NullHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


# --- shared helpers ---------------------------------------------------------------------------


def _open_dir(location: str) -> tuple[Storage, str]:
    storage, directory = storage_for(location)
    if storage.has_folders and not storage.is_folder(directory):
        raise CheckpointNotFoundError(f"{directory} is not a directory")
    return storage, directory


def _lock_holder(storage: Storage, directory: str) -> str | None:
    """Who holds the directory lock of a running CheckpointManager, or None (always
    None on storage without locks)."""
    return storage.lock_holder(f"{directory}/{_commit.LOCK_NAME}")


def _metadata(location: str):
    """`ckpt.metadata`, with a hint when `location` is a directory of steps."""
    from .._format import read_metadata

    storage, path = storage_for(location)
    try:
        return read_metadata(storage, path)
    except CheckpointNotFoundError as e:
        steps = _commit.committed_steps(storage, path)
        if steps:
            raise CheckpointNotFoundError(
                f"{path} is a directory of steps (committed: {', '.join(map(str, steps[-5:]))}), not a checkpoint; "
                f"give one step, e.g. {path}/{steps[-1]}"
            ) from e
        raise


def _parse_mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"--mesh {text!r}: give axis sizes >= 1 joined by 'x', e.g. 4x2 or 8")
    return shape


def _parse_axes(text: str | None, rank: int) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(a.strip() for a in text.split(","))
    if len(names) != rank or not all(names) or len(set(names)) != len(names):
        raise UsageError(f"--axes {text!r}: give {rank} distinct comma-separated names, one per mesh axis")
    return names


def _parse_spec(text: str, mesh) -> tuple[str, PartitionSpec]:
    from jax.sharding import PartitionSpec as P

    glob, eq, spec = text.partition("=")
    if not eq or not glob:
        raise UsageError(f"--spec {text!r}: expected LEAF_GLOB=SPEC, e.g. \"['params']*=data,model\"")
    entries: list = []
    used: list[str] = []
    for raw in spec.split(",") if spec.strip() else []:
        raw = raw.strip()
        if raw.lower() in ("", "none"):
            entries.append(None)
            continue
        names = tuple(n.strip() for n in raw.split("+"))
        for n in names:
            if n not in mesh.axis_names:
                raise UsageError(f"--spec {text!r}: the mesh has no axis {n!r} (axes: {', '.join(mesh.axis_names)})")
            if n in used:
                raise UsageError(f"--spec {text!r}: mesh axis {n!r} is used twice")
            used.append(n)
        entries.append(names[0] if len(names) == 1 else names)
    return glob, P(*entries)


def _build_mesh(args, meta, *, abstract: bool = False):
    """The `--mesh`/`--axes` mesh: of this machine's devices, or abstract (no devices needed)."""
    shape = _parse_mesh(args.mesh)
    axes = _parse_axes(args.axes, len(shape)) or _tools.default_axis_names(meta, len(shape))
    try:
        return _tools.abstract_mesh(shape, axes) if abstract else _tools.scratch_mesh(shape, axes)
    except MeshError as e:
        hint = "" if abstract else "; or plan without the devices with --processes P"
        raise UsageError(f"{e}{hint}") from e


def _mesh_str(mesh) -> str:
    return " x ".join(f"{n}={s}" for n, s in mesh.shape.items())


# --- ls ---------------------------------------------------------------------------------------


def _generation_time(generation: str | None) -> float | None:
    t = _format.generation_time(generation) if generation else None
    return None if t is None else t.timestamp()


def _state(e: _commit.StepEntry, committed: set[int]) -> str:
    if _format.parse_deleting_name(e.name):
        return "deleting"
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
    committed = {e.step for e in found if e.committed and e.generation is None}
    now = time.time()
    rows = []
    for e in found:
        state = _state(e, committed)
        row: dict[str, Any] = {"step": e.step, "folder": e.name, "state": state, "committed": state == "committed",
               "size_bytes": None, "created_unix_s": None, "age_s": None, "metrics": {}, "note": None}
        if e.committed:
            try:
                meta = read_metadata(storage, f"{directory}/{e.name}")
                row["created_unix_s"] = meta.created_unix_s or None
                metrics = meta.user_metadata.get("metrics", {})
                row["metrics"] = {k: _json_value(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {}
                row["size_bytes"] = sum(meta.process_bytes_written)  # replaced by the files' sizes where cheap
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
            ui.line(f"{crashed} partial folder(s) are crashed saves: readers never remove them; a CheckpointManager "
                    f"opening this directory does, and so does `{PROG} gc {args.directory}`"
                    + (" once the manager holding it closes." if holder else "."))
    elif holder:
        ui.line(f"A CheckpointManager holds this directory ({holder}): partial folders may be saves in flight.")
    return 0


# --- inspect ----------------------------------------------------------------------------------


def _cmd_inspect(args, ui: _UI) -> int:
    from .._format import ArrayMetadata

    meta = _metadata(args.path)
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
    if ui.json_mode:
        ui.json(info)
        return 0
    created = datetime.datetime.fromtimestamp(meta.created_unix_s, datetime.timezone.utc) if meta.created_unix_s else None
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
            value = repr(meta.leaves[leaf["path"]].value)
            value = value if len(value) <= 40 else value[:37] + "..."
            rows.append((name, "-", leaf["value_type"], f"value {value}", "-", "-", "-"))
    ui.table(["leaf", "shape", "dtype", "saved sharding", "chunk", "inner chunk", "bytes"], rows, right=["bytes"],
             footer=["total", "", "", "", "", "", meta.total_bytes])
    return 0


# --- plan -------------------------------------------------------------------------------------


def _cmd_plan(args, ui: _UI) -> int:
    import jax
    from jax.sharding import NamedSharding

    from .._restore import plan_restore

    meta = _metadata(args.path)
    processes = args.processes
    pidx = args.process_index
    # With --processes the plan is pure (an abstract mesh, no devices needed);
    # without, it is the plan of a restore run here, on this machine's devices.
    mesh = _build_mesh(args, meta, abstract=processes is not None)
    n_devices = math.prod(mesh.shape.values())
    overrides = [_parse_spec(s, mesh) for s in args.spec]
    try:
        specs = _tools.target_specs(meta, mesh, overrides)
    except ValueError as e:
        raise UsageError(f"--spec: {e}") from e
    if processes is None:
        processes = jax.process_count()
        pidx = jax.process_index() if pidx is None else pidx
        if not 0 <= pidx < processes:
            raise UsageError(
                f"--process-index {pidx}: this command runs as {processes} process(es); add --processes P to plan "
                "as if the mesh's devices were spread over P processes"
            )
    else:
        pidx = 0 if pidx is None else pidx
        if processes < 1 or n_devices % processes:
            raise UsageError(f"--processes {processes} must divide the mesh's {n_devices} devices")
        if not 0 <= pidx < processes:
            raise UsageError(f"--process-index {pidx} must be in [0, {processes})")
    target = _tools.target_tree(meta, {p: NamedSharding(mesh, s) for p, s in specs.items()})
    plan = plan_restore(meta.path, target, process_index=pidx, processes=args.processes, cooperative=args.cooperative)

    leaves: list[dict[str, Any]] = []
    for leaf in plan.leaves:
        leaves.append({
            "leaf": leaf.leaf_path, "keystr": meta.keystr(leaf.leaf_path), "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
            "target_spec": _spec_json(specs[leaf.leaf_path]),
            "boxes": len(leaf.boxes), "chunks": sum(len(b.reads) + len(b.packed) for b in leaf.boxes),
            "inner_chunks": sum(r.inner_chunks for b in leaf.boxes for r in b.reads),
            "bytes_needed": leaf.bytes_needed, "bytes_read": leaf.bytes_read, "bytes_received": leaf.bytes_received,
            "exchange_spec": None if leaf.exchange_spec is None else _spec_json(leaf.exchange_spec),
            "read_amplification": leaf.bytes_read / leaf.bytes_needed if leaf.bytes_needed else 1.0,
        })
    if ui.json_mode:
        ui.json({
            "path": meta.path, "mesh": {"shape": list(mesh.shape.values()), "axis_names": list(mesh.axis_names)},
            "process_index": pidx, "process_count": processes, "leaves": leaves,
            "chunks": sum(r["chunks"] for r in leaves), "bytes_needed": plan.bytes_needed, "bytes_read": plan.bytes_read,
            "bytes_received": plan.bytes_received, "cooperative": plan.cooperative,
            "read_amplification": plan.read_amplification,
        })
        return 0
    ui.line(f"restore plan for {meta.path}")
    ui.line(f"target mesh {_mesh_str(mesh)} ({n_devices} devices), process {pidx} of {processes}")
    ui.table(
        ["leaf", "target", "boxes", "chunks", "needed", "read", "received", "amplification"],
        [(r["keystr"] or "<root>", _spec_str(specs[r["leaf"]]), r["boxes"], r["chunks"], _format.format_bytes(r["bytes_needed"]),
          _format.format_bytes(r["bytes_read"]), _format.format_bytes(r["bytes_received"]), f"{r['read_amplification']:.3f}")
         for r in leaves],
        right=["boxes", "chunks", "needed", "read", "received", "amplification"],
        footer=["total", "", sum(r["boxes"] for r in leaves), sum(r["chunks"] for r in leaves), _format.format_bytes(plan.bytes_needed),
                _format.format_bytes(plan.bytes_read), _format.format_bytes(plan.bytes_received),
                f"{plan.read_amplification:.3f}"],
    )
    ui.line(f"{plan.bytes_read} bytes read for {plan.bytes_needed} bytes needed: read amplification {plan.read_amplification:.3f}")
    if plan.cooperative:
        ui.line(f"cooperative: {plan.bytes_received} bytes come from peers over the device interconnect instead of "
                "storage (--no-cooperative: every process reads all it needs)")
    if processes > 1:
        ui.line(f"These figures are process {pidx}'s of {processes}; --process-index I shows process I (0 <= I < {processes}).")
    return 0


def _cmd_plan_save(args, ui: _UI) -> int:
    import jax
    from jax.sharding import NamedSharding

    from .._save import plan_save

    meta = _metadata(args.path)
    mesh = _build_mesh(args, meta, abstract=True)
    n_devices = math.prod(mesh.shape.values())
    processes = args.processes
    if processes < 1 or n_devices % processes:
        raise UsageError(f"--processes {processes} must divide the mesh's {n_devices} devices")
    overrides = [_parse_spec(s, mesh) for s in args.spec]
    try:
        specs = _tools.target_specs(meta, mesh, overrides)
    except ValueError as e:
        raise UsageError(f"--spec: {e}") from e
    state = _tools.target_tree(meta, {
        p: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=NamedSharding(mesh, specs[p])) for p, m in meta.arrays.items()
    })
    plan = plan_save(state, processes=processes)
    leaves: list[dict[str, Any]] = [{
        "leaf": a.leaf_path, "shape": list(a.shape), "spec": _spec_json(specs[a.leaf_path]),
        "chunk_shape": list(a.chunk_shape), "replicas": a.replicas, "split_dim": a.split_dim,
        "split_factor": a.split_factor, "writers": len({p for p, _ in a.writes}), "chunks": len(a.writes),
    } for a in plan.leaves]
    rows = [{"process_index": p.process_index, "bytes_written": p.bytes_written, "data_bytes": p.data_bytes, "files": p.files}
            for p in plan.processes]
    if ui.json_mode:
        ui.json({
            "path": meta.path, "mesh": {"shape": list(mesh.shape.values()), "axis_names": list(mesh.axis_names)},
            "process_count": processes, "leaves": leaves, "processes": rows, "bytes_written": plan.bytes_written,
            "files": plan.files, "imbalance": plan.imbalance,
        })
        return 0
    ui.line(f"save plan of {meta.path}'s state from mesh {_mesh_str(mesh)} ({n_devices} devices) on {processes} processes")
    ui.table(
        ["leaf", "saved by", "chunk", "replicas", "split", "writers"],
        [(r["leaf"] or "<root>", _spec_str(specs[r["leaf"]]), _shape(r["chunk_shape"]), r["replicas"],
          f"{r['split_factor']} along dim {r['split_dim']}" if r["split_dim"] is not None else "-", r["writers"]) for r in leaves],
        right=["replicas", "writers"],
    )
    ui.table(
        ["process", "bytes written", "files"],
        [(r["process_index"], _format.format_bytes(r["bytes_written"]), r["files"]) for r in rows],
        right=["process", "bytes written", "files"],
        footer=["total", _format.format_bytes(plan.bytes_written), plan.files],
    )
    ui.line(f"largest process writes {plan.imbalance:.3f}x the mean ({_format.format_bytes(plan.bytes_written // max(1, processes))})")
    return 0


# --- verify -----------------------------------------------------------------------------------


def _cmd_verify(args, ui: _UI) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .._tools import verify

    _metadata(args.path)  # a clear error (with the directory hint) before the progress bar
    progress = Progress(TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TextColumn("chunks"),
                        TimeElapsedColumn(), console=ui.err, transient=True,
                        disable=ui.json_mode or not ui.err.is_terminal)
    with progress:
        task = progress.add_task("verify", total=None)
        report = verify(args.path, progress=lambda done, total: progress.update(task, completed=done, total=total))
    if ui.json_mode:
        ui.json({"path": report.path, "ok": report.ok, "problems": list(report.problems), "chunks_checked": report.chunks_checked,
                 "bytes_checked": report.bytes_checked, "elapsed_s": report.elapsed_s})
    else:
        verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
        ui.line(f"{report.path}: {verdict}", style="bold green" if report.ok else "bold red")
        ui.line(f"{report.chunks_checked} chunks, {report.bytes_checked} bytes ({_format.format_bytes(report.bytes_checked)}) "
                f"read and checksummed in {report.elapsed_s:.2f} s")
        for p in report.problems:
            ui.line(f"  - {p}")
    return 0 if report.ok else 1


# --- gc ---------------------------------------------------------------------------------------


def _cmd_gc(args, ui: _UI) -> int:
    storage, directory = _open_dir(args.directory)
    holder = _lock_holder(storage, directory)
    if holder and not args.dry_run:
        raise CheckpointError(
            f"a CheckpointManager is using {directory} ({holder}); gc would race its saves. Run gc after it closes "
            "(a manager also removes crashed saves itself on its first save)"
        )
    actions = _commit.plan_recovery(storage, directory)
    rolled = [n for n, a in actions if a == "roll forward"]
    steps = sorted(set(_commit.committed_steps(storage, directory)) | {int(n.split(".", 1)[0]) for n in rolled})
    lock = None
    if not args.dry_run:
        if storage.supports_locks:
            from .._manage import DirectoryLock

            try:
                lock = DirectoryLock(storage, directory)
            except CheckpointError as e:
                raise CheckpointError(f"{e} (gc needs the directory to itself)") from e
        try:
            keep = _manage.KeepLatest(args.keep_latest) if args.keep_latest else None
            recovered, doomed = _manage.maintain(storage, directory, keep=keep)  # as a manager's writer does
            actions = [(n, a) for n, a in actions if n in set(recovered)]
            steps = sorted(set(_commit.committed_steps(storage, directory)) | set(doomed))
        finally:
            if lock is not None:
                lock.release()
    else:
        doomed = steps[: -args.keep_latest] if args.keep_latest else []
    kept = [s for s in steps if s not in doomed]
    verb = {"remove": "would remove" if args.dry_run else "removed",
            "roll forward": "would roll forward" if args.dry_run else "rolled forward"}
    if ui.json_mode:
        ui.json({"directory": directory, "dry_run": args.dry_run,
                 "removed_partial": [n for n, a in actions if a == "remove"],
                 "rolled_forward": [n for n, a in actions if a == "roll forward"],
                 "removed_steps": doomed, "kept_steps": kept})
        return 0
    rows = [(verb[a], n, "crashed or replaced save" if a == "remove" else "committed, not yet renamed") for n, a in actions]
    rows += [("would remove" if args.dry_run else "removed", str(s), f"beyond the newest {args.keep_latest}") for s in doomed]
    if rows:
        ui.table(["action", "folder", "why"], rows, title=f"{directory}{' (dry run)' if args.dry_run else ''}")
    else:
        ui.line(f"{directory}: nothing to remove{' (dry run)' if args.dry_run else ''}")
    ui.line(f"kept steps: {', '.join(map(str, kept)) or 'none'}")
    if holder:
        ui.line(f"A CheckpointManager holds this directory ({holder}): gc without --dry-run would refuse to run.")
    return 0


# --- drill ------------------------------------------------------------------------------------


def _cmd_drill(args, ui: _UI) -> int:
    shape = _parse_mesh(args.mesh) if args.mesh else None
    axes = _parse_axes(args.axes, len(shape)) if shape is not None and args.axes else None
    if args.axes and shape is None:
        raise UsageError("--axes needs --mesh")
    _open_dir(args.directory)
    try:
        report = _tools.drill(args.directory, shape, axis_names=axes)
    except MeshError as e:
        raise UsageError(str(e)) from e
    if ui.json_mode:
        ui.json(report.to_json())
        return 0 if report.ok else 1
    ui.line(f"restore drill of {report.path} (step {report.step}): {'OK' if report.ok else 'FAILED'}",
            style="bold green" if report.ok else "bold red")
    mesh = " x ".join(f"{n}={s}" for n, s in zip(report.mesh_axis_names, report.mesh_shape))
    ui.fields([
        ("scratch mesh", f"{mesh} ({math.prod(report.mesh_shape)} device{'s' * (math.prod(report.mesh_shape) != 1)})"),
        ("time to restored state", f"{report.restore_s:.3f} s" if report.restore_s is not None else "restore FAILED"),
        ("bytes needed", f"{report.bytes_needed} ({_format.format_bytes(report.bytes_needed)})"),
        ("bytes read", f"{report.bytes_read} ({_format.format_bytes(report.bytes_read)})"),
        ("read amplification", f"{report.read_amplification:.3f}"),
        ("verify", f"{'OK' if not report.problems else f'{len(report.problems)} problem(s)'} in {report.verify_s:.3f} s"),
    ])
    for p in report.problems:
        ui.line(f"  - {p}")
    return 0 if report.ok else 1


# --- import-orbax / export ----------------------------------------------------------------------


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


def _cmd_import_orbax(args, ui: _UI) -> int:
    from .._format import read_metadata
    from .._tools import import_orbax

    t0 = time.perf_counter()
    import_orbax(args.src, args.dst, overwrite=args.overwrite)
    storage, dst = storage_for(args.dst)
    meta = read_metadata(storage, dst)
    elapsed_s = time.perf_counter() - t0
    if ui.json_mode:
        ui.json({"src": meta.user_metadata.get("imported_from", {}).get("path"), "dst": meta.path, "step": meta.step,
                 "arrays": len(meta.arrays), "values": len(meta.leaves) - len(meta.arrays),
                 "total_bytes": meta.total_bytes, "elapsed_s": elapsed_s})
        return 0
    ui.line(f"imported {meta.user_metadata.get('imported_from', {}).get('path', args.src)} into {meta.path}: "
            f"{len(meta.arrays)} arrays, {len(meta.leaves) - len(meta.arrays)} values, "
            f"{_format.format_bytes(meta.total_bytes)} in {elapsed_s:.2f} s")
    ui.line(f"`{PROG} inspect {meta.path}` shows the tree; ckpt.restore restores it onto any mesh.")
    return 0


def _parse_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    try:
        n = int(float(num) * units[unit])
    except (KeyError, ValueError):
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with KB, MB, GB, KiB, MiB, GiB")
    return n


def _cmd_export(args, ui: _UI) -> int:
    from .._tools import export

    _metadata(args.path)  # the directory hint when PATH is a directory of steps
    out = args.output
    if out is None:
        base = args.path.rstrip("/")
        out = f"{base}.safetensors" if args.format == "safetensors" else f"{base}.npz"
    report = export(args.path, out, format=args.format, max_shard_bytes=args.max_shard_bytes, separator=args.separator,
                    upcast=args.upcast, overwrite=args.overwrite)
    if ui.json_mode:
        ui.json({"files": list(report.files), "tensors": report.tensors, "skipped": list(report.skipped),
                 "total_bytes": report.total_bytes})
        return 0
    ui.line(f"exported {len(report.tensors)} tensors ({_format.format_bytes(report.total_bytes)}) as {args.format}:")
    for f in report.files:
        ui.line(f"  {f}")
    if report.skipped:
        ui.line(f"not exported (not arrays): {', '.join(report.skipped)}")
    return 0


# --- parser and entry point -------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `checkpointer` (subcommands ls, inspect, plan, verify, gc, drill)."""
    from .._format import library_version

    parser = _Parser(
        prog=PROG,
        description="Inspect, plan, verify and clean up checkpointer checkpoints.",
        epilog="DIR is a manager's directory (step folders inside), PATH one checkpoint (DIR/<step>); either is a local "
        "path or a file://, gs:// or s3:// URL. Exit status: 0 ok; 1 verify or drill found problems, or an operation "
        "failed; 2 usage error or no such checkpoint.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {library_version()}")
    parser.add_argument("--traceback", action="store_true", help="on an error, raise it with its traceback")
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ls", parents=[common], help="list step folders, committed or not",
                       description="List every step folder of DIR: committed steps, partial folders of crashed saves "
                       "(or saves in flight), folders being deleted; with size (sum of file sizes; from the manifest "
                       "for URLs), age and the metrics saved with each step.")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--local", metavar="LOCAL_DIR", default=None,
                   help="two tiers: also list the node-local tier (CheckpointManager(local_directory=LOCAL_DIR))")
    p.set_defaults(func=_cmd_ls)

    p = sub.add_parser("inspect", parents=[common], help="show a checkpoint's tree and metadata",
                       description="Show the tree of the checkpoint at PATH (per leaf: shape, dtype, saved sharding, "
                       "chunk and inner chunk shapes, bytes), its step, process count, versions and user metadata. "
                       "Reads only manifest.json; needs no devices.")
    p.add_argument("path", metavar="PATH")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("plan", parents=[common], help="read plan and read amplification for a target mesh",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Plan the restore of PATH onto a mesh: per leaf the unique target boxes, chunks, "
                       "bytes needed and read, and the read amplification. Pure: reads only the manifest. Without "
                       "--processes the mesh is of this machine's devices; with --processes P it is abstract (any "
                       "size, no devices needed, e.g. --mesh 64x128 --processes 1024).\n\n" + _SPEC_RULE)
    p.add_argument("path", metavar="PATH")
    p.add_argument("--mesh", required=True, metavar="SHAPE", help="mesh axis sizes, e.g. 4x2: a mesh of the first 4*2 "
                   "local devices (simulate N CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count=N), "
                   "or of any size with --processes")
    p.add_argument("--axes", metavar="NAMES", help="mesh axis names, e.g. data,model (default: those of the saved "
                   "mesh with as many axes, else axis0,axis1,...)")
    p.add_argument("--spec", action="append", default=[], metavar="LEAF_GLOB=SPEC",
                   help="target PartitionSpec for the leaves whose key path matches (repeatable), "
                   "e.g. \"['params']*=data,model\" or '*kernel=none,model'")
    p.add_argument("--process-index", type=int, metavar="I", help="plan for process I (default: this process)")
    p.add_argument("--processes", type=int, metavar="P", help="plan as if the mesh's devices were spread over P "
                   "processes, in mesh order, each holding a consecutive block; needs no devices")
    p.add_argument("--no-cooperative", dest="cooperative", action="store_false", help="plan restore(..., "
                   "cooperative=False): every process reads all its boxes itself (default: boxes several processes "
                   "need are split among them and exchanged; 'received' shows the bytes from peers)")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("plan-save", parents=[common], help="which process writes which bytes when a state is saved",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Plan a save of the state stored at PATH (its shapes and dtypes) from a mesh spread "
                       "over P processes: per leaf the chunk grid, the processes holding each box (replicas) and the "
                       "replica-parallel split; per process the bytes and files it writes. Pure: reads only the "
                       "manifest, needs no devices.\n\n" + _SPEC_RULE)
    p.add_argument("path", metavar="PATH")
    p.add_argument("--mesh", required=True, metavar="SHAPE", help="mesh axis sizes of the saving job, e.g. 4x2")
    p.add_argument("--axes", metavar="NAMES", help="mesh axis names, e.g. data,model (default: those of the saved "
                   "mesh with as many axes, else axis0,axis1,...)")
    p.add_argument("--spec", action="append", default=[], metavar="LEAF_GLOB=SPEC",
                   help="PartitionSpec of the matching leaves in the saving job (repeatable), e.g. 'params/*=data,model'")
    p.add_argument("--processes", type=int, required=True, metavar="P", help="the saving job's process count; the "
                   "mesh's devices are spread over them in mesh order, consecutive blocks")
    p.set_defaults(func=_cmd_plan_save)

    p = sub.add_parser("verify", parents=[common], help="read every byte, check every checksum",
                       description="Read every chunk of the checkpoint at PATH and check every checksum (the codec's "
                       "crc32c per inner chunk and index, and the writer's recorded crc32c per chunk). Exit status 1 "
                       "when a problem is found; each problem names the leaf and the chunk key.")
    p.add_argument("path", metavar="PATH")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("gc", parents=[common], help="remove crashed saves and old steps",
                       description="Remove the partial folders of crashed saves (a committed but not yet renamed one is "
                       "rolled forward instead) and, with --keep-latest N, every committed step but the newest N (the "
                       "newest is never removed). Refuses to run while a CheckpointManager holds DIR (local "
                       "directories); on object stores make sure no save is in flight.")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--keep-latest", type=_positive_int, metavar="N", help="keep only the newest N committed steps (N >= 1)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.set_defaults(func=_cmd_gc)

    p = sub.add_parser("drill", parents=[common], help="restore drill: restore the newest step, verify, time it",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Restore the newest committed step of DIR onto a scratch mesh of this machine's "
                       "devices with the default targets of `plan`, time it until every array is ready, then verify "
                       "every checksum. Reports time to restored state, bytes read, read amplification and the verify "
                       "result; exit status 1 when anything failed.\n\n" + _SPEC_RULE.split("\n\n")[0])
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--mesh", metavar="SHAPE", help="scratch mesh axis sizes, e.g. 2x2 (default: the saved mesh's shape "
                   "if it has as many devices as are present, else one axis of all devices)")
    p.add_argument("--axes", metavar="NAMES", help="mesh axis names (with --mesh), e.g. data,model")
    p.set_defaults(func=_cmd_drill)

    p = sub.add_parser("timeline", parents=[common], help="where each save's time went, per step and process",
                       description="Draw, per committed step and per process, the phases of each save: snapshot "
                       "(training blocked), write (arrays opened, chunk writes issued), durable (until every chunk "
                       "write completed), wait (for the other processes' durable reports, or for the commit), "
                       "commit (process 0: manifest, marker, rename) and retention (process 0, after the commit; "
                       "from DIR/.checkpointer-journal.jsonl). Reads the records the saves wrote; saves by older "
                       "versions have no timestamps and show no phases. Each step's bar runs from its first phase.")
    p.add_argument("location", metavar="DIR|PATH")
    p.add_argument("--png", metavar="OUT", help="also draw the timeline into the PNG file OUT (needs matplotlib)")
    p.add_argument("--last", type=_positive_int, metavar="N", help="only the newest N committed steps")
    p.add_argument("--width", type=_positive_int, default=60, metavar="COLS", help="characters per bar (default 60)")
    p.set_defaults(func=_cmd_timeline)

    p = sub.add_parser("import-orbax", parents=[common], help="convert an Orbax checkpoint into a checkpointer checkpoint",
                       description="Read the Orbax PyTree checkpoint at SRC (an item folder holding _METADATA, or a "
                       "CheckpointManager step folder with one item) through TensorStore, OCDBT or plain zarr, and "
                       "write it as a checkpointer checkpoint at DST, one chunk at a time (host memory stays at about "
                       "one chunk). Arrays keep their dtype, shape and saved sharding; DST's last component, if an "
                       "integer, is the step.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--overwrite", action="store_true", help="replace a committed checkpoint at DST")
    p.set_defaults(func=_cmd_import_orbax)

    p = sub.add_parser("export", parents=[common], help="write the arrays as safetensors or npz",
                       description="Write the array leaves of the checkpoint at PATH as safetensors (model.safetensors, "
                       "or model-0000i-of-0000N.safetensors plus model.safetensors.index.json beyond --max-shard-bytes, "
                       "as Hugging Face shards) or as one .npz, reading one slab at a time. Tensor names are the "
                       "keys joined by --separator (params.dense.kernel). Non-array leaves are not exported.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--format", choices=["safetensors", "npz"], default="safetensors", help="default: safetensors")
    p.add_argument("-o", "--output", metavar="OUT", help="safetensors: a folder; npz: a file (default: PATH.safetensors "
                   "or PATH.npz beside the checkpoint)")
    p.add_argument("--max-shard-bytes", type=_parse_bytes, default="5GB", metavar="SIZE",
                   help="safetensors: data per file, e.g. 5GB (the default, as Hugging Face), 2GiB, 500MB")
    p.add_argument("--separator", default=".", help="joins a leaf's keys into its tensor name (default: .)")
    p.add_argument("--upcast", action="store_true", help="export dtypes the format lacks (bfloat16 in npz, int4) as a "
                   "wider dtype holding every value exactly (float32, int8) instead of failing")
    p.add_argument("--overwrite", action="store_true", help="replace output files that exist")
    p.set_defaults(func=_cmd_export)
    return parser


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return n


def _closed_stdout() -> int:
    """The reader of stdout went away (`checkpointer ... | head`): exit quietly, status 141
    (128 + SIGPIPE, what a shell reports for a command killed by the broken pipe). Later
    writes, including the interpreter's flush at exit, go to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `checkpointer` command line.

    Args:
      argv: the arguments after the program name (default: `sys.argv[1:]`).
    Returns:
      The exit status: 0 ok, 1 a verification or drill found problems or an operation
      failed, 2 a usage error or no such checkpoint. Errors are printed as one line on
      stderr (`checkpointer: error: ...`), without a traceback unless `--traceback`.

    Multi-process: a single-process tool; `plan --processes P` emulates P processes.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        sys.stderr.write(f"{PROG}: error: {_one_line(e)}\n")
        return 2
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    try:
        with _quiet_library_logs():
            status = args.func(args, _UI(getattr(args, "json", False)))
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
            return status
    except BrokenPipeError:
        return _closed_stdout()
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: error: interrupted\n")
        return 130
    except Exception as e:
        if args.traceback:
            raise
        sys.stderr.write(f"{PROG}: error: {_one_line(e)}\n")
        return _exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
