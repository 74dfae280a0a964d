"""Runs benchmark scripts for two commits alternately in one run and compares their
ratios to Orbax, so that a change that moves code (issue 19's package layout) can be
checked against the commit before it on the same machine, in the same state.

    python benchmarks/compare_commits.py BEFORE AFTER [--runs 3] [--scripts save_bench.py ...]

Each commit is checked out into a temporary git worktree; for each script, in turn, the
BEFORE and the AFTER version run (`--runs N --results <tmp>/<commit>/<script>.md`, with
`PYTHONPATH` set to that worktree, so each imports its own checkpointer). Absolute times
vary up to 4x between runs on a shared 2-core VM; the ratio to Orbax measured inside the
same script run is the figure compared. Prints, per ratio row ("... / orbax ..." with a
value in x), BEFORE, AFTER and the relative cost (AFTER / BEFORE for a ratio of
checkpointer's cost to Orbax's, BEFORE / AFTER for an Orbax / checkpointer speed-up); `--markdown FILE` writes the same table.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SCRIPTS = ("save_bench.py", "restore_bench.py", "fresh_restore_bench.py", "train_loss_bench.py", "small_leaves_bench.py", "replicated_save_bench.py")
_RATIO = re.compile(r"^\|(?P<cells>.*)\|\s*$")
_VALUE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)×\s*$")


def ratios(markdown: str) -> dict[str, float]:
    """Every table row that compares with Orbax: label (the cells before the first value
    in ×) -> that value."""
    out = {}
    for line in markdown.splitlines():
        m = _RATIO.match(line)
        if not m or "orbax" not in line.lower():
            continue
        cells = [c.strip() for c in m.group("cells").split("|")]
        for i, c in enumerate(cells):
            v = _VALUE.match(c)
            if v and i > 0:
                label = " | ".join(cells[:i])
                if "/ orbax" in label.lower() or "orbax /" in label.lower() or "× orbax" in label.lower():
                    out[label] = float(v.group(1))
                break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--scripts", nargs="+", default=list(DEFAULT_SCRIPTS))
    ap.add_argument("--markdown", default=None, help="also write the comparison table to this file")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="compare-commits-"))
    trees = {}
    for name, rev in (("before", args.before), ("after", args.after)):
        trees[name] = tmp / name
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(trees[name]), rev], check=True)
    results: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    try:
        for script in args.scripts:
            for name in ("before", "after"):
                tree = trees[name]
                out = tmp / f"{name}-{script}.md"
                env = dict(os.environ, PYTHONPATH=str(tree), XLA_FLAGS="--xla_force_host_platform_device_count=8")
                cmd = [sys.executable, str(tree / "benchmarks" / script), "--runs", str(args.runs), "--results", str(out)]
                print(f"== {name} ({args.before if name == 'before' else args.after}): {script}", flush=True)
                subprocess.run(cmd, cwd=tree, env=env, check=True)
                for label, value in ratios(out.read_text()).items():
                    results[name][f"{script}: {label}"] = value
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    rows = ["| ratio to Orbax (medians, one run of each side) | before | after | relative cost after / before (> 1: worse) |", "|---|---:|---:|---:|"]
    for label in results["before"]:
        b, a = results["before"][label], results["after"].get(label)
        # "orbax / checkpointer" rows are speed-ups (higher is better), the others costs.
        change = None if a is None else (b / a if ": orbax /" in label.lower() else a / b)
        rows.append(f"| {label} | {b:.2f}× | {'' if a is None else f'{a:.2f}×'} | {'' if change is None else f'{change:.2f}'} |")
    text = "\n".join(rows)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
