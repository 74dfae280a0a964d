"""The on-disk layout of format_version 1: the names of a checkpoint's files and folders.

```
<path>/
  manifest.json          written last but one, by process 0
  arrays/<leaf path>/    one zarr v3 array per array leaf
  processes/<i>.json     what process i wrote
  COMMITTED              the commit marker, written last
  RETIRED                (incremental saves) a step kept only for the chunks newer
                         steps reference: hidden from listings, not restorable itself
<path>.partial-<generation>/   a save in flight or a crashed one
<path>.deleting-<generation>/  a replaced checkpoint being removed (overwrite, POSIX)
```
A generation names one save attempt: `<UTC yyyymmddHHMMSS>-<8 hex>` (`new_generation`).
A step folder's name is the step in canonical decimal (`is_step_name`).

The rest of the format: the leaves' dtypes (`_dtypes`), their zarr arrays (`_zarr_arrays`,
`_shard_file`), the manifest (`_manifest`, `_leaves`, `_values`), the process records
(`_records`) and the JSON encoding of those files (`_json`).
"""

from __future__ import annotations

import datetime
import re
import uuid
from collections.abc import Sequence

from ._tree import check_leaf_path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"
RETIRED = "RETIRED"  # docs/format.md, "Retired steps"
ARRAYS = "arrays"
PROCESSES = "processes"
PARTIAL_INFIX = ".partial-"
DELETING_INFIX = ".deleting-"
# strftime pattern of a generation's time part (UTC), and its length in characters.
GENERATION_TIME_FORMAT = "%Y%m%d%H%M%S"
GENERATION_TIME_CHARS = 14

# Generations are parsed more loosely than `new_generation` writes them: any lowercase
# letters, digits and dashes (folders left by earlier versions or by hand stay visible).
_PARTIAL_RE = re.compile(rf"(?P<name>.+){re.escape(PARTIAL_INFIX)}(?P<generation>[0-9a-z-]+)")
_DELETING_RE = re.compile(rf"(?P<name>.+?){re.escape(DELETING_INFIX)}(?P<generation>.+)")


def new_generation(now: datetime.datetime | None = None) -> str:
    """A fresh save-attempt id: `<UTC yyyymmddHHMMSS>-<8 hex>`, e.g. `20260101120000-0a1b2c3d`.

    Args:
      now: the time to stamp (default: the current UTC time).
    Returns:
      The generation; sorting generations of one path sorts them by start time (to the
      second), and the 32 random bits tell apart attempts started in the same second.

    Multi-process: every process may call it; a save uses process 0's (agreed on through
    `_agreement.agree`).
    """
    now = datetime.datetime.now(datetime.UTC) if now is None else now.astimezone(datetime.UTC)
    return f"{now:{GENERATION_TIME_FORMAT}}-{uuid.uuid4().hex[:8]}"


def generation_time(generation: str) -> datetime.datetime | None:
    """When save attempt `generation` started (UTC, to the second), or None if its name
    does not start with a timestamp (generations of older or hand-made folders)."""
    try:
        t = datetime.datetime.strptime(generation[:GENERATION_TIME_CHARS], GENERATION_TIME_FORMAT)
    except ValueError:
        return None
    return t.replace(tzinfo=datetime.UTC)


def is_step_name(name: str) -> bool:
    """Whether `name` is the canonical decimal of a step: ASCII digits, no sign, no
    leading zero ('0' itself is canonical). '0900000', '+5', '²' or '٣' are not steps:
    such folders are foreign, ignored by readers and never deleted."""
    return name.isascii() and name.isdigit() and (name == "0" or not name.startswith("0"))


def partial_name(name: str, generation: str) -> str:
    """The folder name of save attempt `generation` of checkpoint `name`."""
    return f"{name}{PARTIAL_INFIX}{generation}"


def parse_partial_name(name: str) -> tuple[str, str] | None:
    """`("100", generation)` for `"100.partial-<generation>"`, else None."""
    m = _PARTIAL_RE.fullmatch(name)
    return (m["name"], m["generation"]) if m else None


def deleting_name(name: str, generation: str) -> str:
    """The folder name checkpoint `name` is moved to while save `generation` replaces it."""
    return f"{name}{DELETING_INFIX}{generation}"


def parse_deleting_name(name: str) -> tuple[str, str] | None:
    """`("100", suffix)` for `"100.deleting-<suffix>"` (the first `.deleting-` splits), else None."""
    m = _DELETING_RE.fullmatch(name)
    return (m["name"], m["generation"]) if m else None


def array_dir(leaf_path: str) -> str:
    """The folder of a leaf's zarr array, relative to the checkpoint path."""
    check_leaf_path(leaf_path)
    return f"{ARRAYS}/{leaf_path}" if leaf_path else f"{ARRAYS}/%root"


def process_record_name(process_index: int) -> str:
    return f"{PROCESSES}/{process_index}.json"



def chunk_key(leaf_path: str, chunk_index: Sequence[int]) -> str:
    """Key of a chunk (a zarr shard file) relative to the checkpoint path."""
    return f"{array_dir(leaf_path)}/c" + "".join(f"/{i}" for i in chunk_index) if chunk_index else f"{array_dir(leaf_path)}/c"

