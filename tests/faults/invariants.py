"""What must hold after every fault (issue 27): the checks of a run's directories.

    inv = Invariants(run_dir, local_dir=None, sentinel_dir=sentinel)
    inv.after_fault()          # newest step never back; every committed step bit-exact + verify
    inv.after_clean_save()     # no `.partial-*` folder left
    inv.violations             # [(check, message)], empty when all held

The checks read the directories with plain `os` calls and restore with `ckpt.restore`
(not through the manager under test), and compare with `state.expected(step)`: the state
the loop saved at a step is a deterministic function of the step.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

import checkpointer as ckpt

from . import state as _state


def committed_steps(directory: str) -> list[int]:
    """Steps with a `COMMITTED` marker in `directory`, ascending (plain `os` listing)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isfile(os.path.join(directory, n, "COMMITTED")))


def partial_folders(*directories: str | None) -> list[str]:
    """`.partial-*` folders in the directories and in their `process-<i>/` folders."""
    found = []
    for d in directories:
        if not d or not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if ".partial-" in name:
                found.append(os.path.join(d, name))
            elif name.startswith("process-") and os.path.isdir(os.path.join(d, name)):
                found += [os.path.join(d, name, n) for n in os.listdir(os.path.join(d, name)) if ".partial-" in n]
    return sorted(found)


class Sentinel:
    """A sibling folder of the run's directories, with files whose content and times
    are recorded: nothing the library does may change, add or remove anything in it."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        for i in range(3):
            with open(os.path.join(path, f"file-{i}"), "wb") as f:
                f.write(os.urandom(4096))
        os.makedirs(os.path.join(path, "1"), exist_ok=True)  # looks like a step: a tempting target
        with open(os.path.join(path, "1", "COMMITTED"), "w") as f:
            f.write("not a checkpoint of the run\n")
        self._before = self.snapshot()

    def snapshot(self) -> dict[str, tuple[str, int]]:
        out = {}
        for root, dirs, files in os.walk(self.path):
            for name in dirs + files:
                p = os.path.join(root, name)
                st = os.lstat(p)
                digest = ""
                if os.path.isfile(p):
                    with open(p, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                out[os.path.relpath(p, self.path)] = (digest, st.st_mtime_ns)
        return out

    def changed(self) -> list[str]:
        """What differs from when it was made (empty: untouched)."""
        now = self.snapshot()
        return sorted(k for k in set(now) | set(self._before) if now.get(k) != self._before.get(k))


class Invariants:
    """The checks after a fault, accumulating violations.

    Args:
      run_dir: the durable directory of the run.
      local_dir: the local tier's directory (two tiers), or None.
      sentinel_dir: where to make the `Sentinel` folder (a sibling of the run's), or None.
    """

    def __init__(self, run_dir: str, local_dir: str | None = None, sentinel_dir: str | None = None) -> None:
        self.run_dir = run_dir
        self.local_dir = local_dir
        self.sentinel = Sentinel(sentinel_dir) if sentinel_dir else None
        self.high_water = -1  # the newest committed step seen so far
        self.verified: set[tuple[int, float]] = set()  # (step, marker mtime) already checked
        self.violations: list[tuple[str, str]] = []

    def violate(self, check: str, message: str) -> None:
        self.violations.append((check, message))

    def after_fault(self, context: str = "") -> None:
        """Newest committed step never goes back; every committed step restores
        bit-exactly and passes verify; the sentinel is untouched."""
        steps = committed_steps(self.run_dir)
        latest = steps[-1] if steps else -1
        if latest < self.high_water:
            self.violate("newest went back", f"{context}: newest committed step {latest} < {self.high_water} seen before")
        self.high_water = max(self.high_water, latest)
        for step in steps:
            self.check_step(step, context)
        self.check_sentinel(context)

    def check_step(self, step: int, context: str = "") -> None:
        """`step` (committed in run_dir) restores bit-exactly and passes verify."""
        path = os.path.join(self.run_dir, str(step))
        try:
            key = (step, os.stat(os.path.join(path, "COMMITTED")).st_mtime)
        except FileNotFoundError:
            return  # removed by retention meanwhile
        if key in self.verified:
            return
        try:
            restored = ckpt.restore(path)
            diff = _state.differences(restored, step)
            if diff:
                self.violate("not bit-exact", f"{context}: step {step}: {diff}")
            report = ckpt.verify(path)
            if not report.ok:
                self.violate("verify failed", f"{context}: step {step}: {list(report.problems)[:3]}")
        except ckpt.CheckpointNotFoundError:
            return  # retention removed it between the listing and the read
        except Exception as e:  # noqa: BLE001 - any failure to read a committed step is a violation
            if not os.path.isdir(path):
                return
            self.violate("committed step unreadable", f"{context}: step {step}: {type(e).__name__}: {e}")
            return
        self.verified.add(key)

    def after_clean_save(self, context: str = "") -> None:
        """No `.partial-*` folder survives a clean save."""
        left = partial_folders(self.run_dir, self.local_dir)
        if left:
            self.violate("partial survived", f"{context}: {left}")

    def check_sentinel(self, context: str = "") -> None:
        if self.sentinel is not None:
            changed = self.sentinel.changed()
            if changed:
                self.violate("outside touched", f"{context}: sentinel changed: {changed}")


def arrays_equal(a: object, b: object) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
