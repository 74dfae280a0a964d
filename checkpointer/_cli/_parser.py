"""The command line's argparse parser: one subcommand per command module, errors raised
as `UsageError` (one line) instead of printed with the usage."""

from __future__ import annotations

import argparse

from .._errors import UsageError
from ._checks import _cmd_drill, _cmd_verify
from ._conversion import _cmd_export, _cmd_import_orbax
from ._gc import _cmd_gc
from ._inspection import _cmd_inspect, _cmd_ls, _cmd_timeline
from ._planning import _cmd_plan, _cmd_plan_save
from ._status import _cmd_status
from ._ui import PROG

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


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `checkpointer` (subcommands ls, inspect, plan, verify, gc, drill, status, ...)."""
    from .._format import library_version

    parser = _Parser(
        prog=PROG,
        description="Inspect, plan, verify and clean up checkpointer checkpoints.",
        epilog="DIR is a manager's directory (step folders inside), PATH one checkpoint (DIR/<step>); either is a local "
        "path or a file://, gs:// or s3:// URL. Exit status: 0 ok; 1 verify or drill found problems, or an operation "
        "failed; 2 usage error or no such checkpoint (status: 3 DIR unreadable).",
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
                       "Reads only manifest.json (with --png also processes/<i>.json); needs no devices.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--png", metavar="OUT", help="also draw the shard maps of the selected leaves (--leaf; default: the "
                   "largest) into the PNG file OUT: which process and device wrote each chunk, replicas skipped "
                   "(needs matplotlib: pip install 'checkpointer[notebook]')")
    p.add_argument("--leaf", action="append", metavar="NAME", help="with --png: a leaf's key path as inspect prints "
                   "it (\".params['w']\"), or a glob over them (\"*kernel*\"); repeat for several")
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
    p.add_argument("--png", metavar="OUT", help="also draw the read plan into the PNG file OUT: bytes needed and read "
                   "per target device and per process, the read amplification (with --processes P: every process's "
                   "plan; needs matplotlib: pip install 'checkpointer[notebook]')")
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

    p = sub.add_parser("status", parents=[common], help="probe a directory in use: newest step, lag, failures",
                       description="Read the state of a manager's directory while its writer runs, without any lock: "
                       "the newest committed step and its age (from its manifest), the step in flight, the commit lag "
                       "(the last step the writer handed to save, noted at most every 10 s, minus the newest committed) "
                       "and the last failed save (from DIR/.checkpointer-journal.jsonl). For a cron job or a Kubernetes "
                       "probe. Exit status: 0 ok; 1 a bound crossed, or a save failed and none committed since; "
                       "2 usage error; 3 DIR cannot be read.")
    p.add_argument("directory", metavar="DIR")
    p.add_argument("--max-lag-steps", type=_non_negative_int, metavar="N", help="alert when the commit lag exceeds N steps")
    p.add_argument("--max-age-s", type=_positive_seconds, metavar="S", help="alert when the newest committed step is "
                   "older than S seconds (or there is none)")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("import-orbax", parents=[common], help="convert an Orbax checkpoint into a checkpointer checkpoint",
                       description="Read the Orbax checkpoint at SRC (an item folder holding _METADATA, a "
                       "CheckpointManager step folder, every item of it, or a whole CheckpointManager directory, every "
                       "finalized step with its metrics) through TensorStore, OCDBT or plain zarr, and write it as a "
                       "checkpointer checkpoint at DST (for a directory: DST/<step> per step; run it again to resume), "
                       "one chunk at a time (host memory stays at about one chunk). Arrays keep their dtype, shape and "
                       "saved sharding, PRNG keys their impl; DST's last component, if an integer, is the step.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--overwrite", action="store_true", help="replace committed checkpoints at DST (without it a "
                   "directory import keeps the steps it already imported)")
    p.set_defaults(func=_cmd_import_orbax)

    p = sub.add_parser("export", parents=[common], help="write the arrays as safetensors or npz, or everything as Orbax",
                       description="Write the array leaves of the checkpoint at PATH as safetensors (model.safetensors, "
                       "or model-0000i-of-0000N.safetensors plus model.safetensors.index.json beyond --max-shard-bytes, "
                       "as Hugging Face shards) or as one .npz, reading one slab at a time. Tensor names are the "
                       "keys joined by --separator (params.dense.kernel). Non-array leaves are not exported. "
                       "--format orbax writes the whole checkpoint as an Orbax checkpoint (StandardCheckpointer's "
                       "layout), or, when PATH is a manager directory, every committed step as an Orbax "
                       "CheckpointManager directory with its metrics; per-process state is not exported (listed).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--format", choices=["safetensors", "npz", "orbax"], default="safetensors", help="default: safetensors")
    p.add_argument("-o", "--output", metavar="OUT", help="safetensors: a folder; npz: a file; orbax: the Orbax "
                   "checkpoint or manager directory (default: PATH.safetensors, PATH.npz or PATH.orbax beside PATH)")
    p.add_argument("--max-shard-bytes", type=_parse_bytes, default="5GB", metavar="SIZE",
                   help="safetensors: data per file, e.g. 5GB (the default, as Hugging Face), 2GiB, 500MB")
    p.add_argument("--separator", default=".", help="joins a leaf's keys into its tensor name (default: .)")
    p.add_argument("--upcast", action="store_true", help="export dtypes the format lacks (bfloat16 in npz, int4) as a "
                   "wider dtype holding every value exactly (float32, int8) instead of failing")
    p.add_argument("--leaves", action="append", metavar="GLOB", help="export only the leaves GLOB matches: a tensor "
                   "name (params.*), a key string as inspect prints it (\"['params']*\") or a key prefix (params: the "
                   "parameters only); repeat for several")
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


def _non_negative_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return n


def _positive_seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = 0.0
    if not 0 < s < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return s


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
