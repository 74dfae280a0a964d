"""The restore plan as a picture (`plot_plan`): bytes needed and read per target device
and per process, and the read amplification (`RestorePlan`'s totals) in the headline.
matplotlib is imported inside `plot_plan` (the `notebook` extra)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._inspect import _DPI, _FONT, _import_matplotlib, _unit

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .._encoding import RestorePlan

# The plan picture's bars: beyond this many devices (or processes), neighbours share a bar.
MAX_BARS = 32
_NEEDED, _READ, _RECEIVED = "#9ecae1", "#08519c", "#fd8d3c"



@dataclasses.dataclass(frozen=True)
class PlanBars:
    """What `plot_plan` draws, as numbers (bytes).

    Attributes:
      devices: per bar of the device panel, (label, bytes needed, bytes read); a box
        several devices hold is charged in equal parts to each, a packed chunk read
        once to the first box that needs it (so the read bars sum to the plans'
        `bytes_read`, and the needed bars to their `bytes_needed` unless a leaf is read
        cooperatively: its needs are per process only, in `processes`).
      processes: per bar of the process panel, (label, bytes needed, bytes read,
        bytes received from peers).
      bytes_needed: the plans' total.
      bytes_read: the plans' total.
      bytes_received: the plans' total.
      read_amplification: `bytes_read / bytes_needed` (1.0 when nothing is needed).
      cooperative: some leaf is read cooperatively (`RestorePlan.cooperative`): what a
        device needs comes partly from peers, so the device panel shows reads only.
    """

    devices: tuple[tuple[str, float, float], ...]
    processes: tuple[tuple[str, int, int, int], ...]
    bytes_needed: int
    bytes_read: int
    bytes_received: int
    read_amplification: float
    cooperative: bool = False


def _device_bytes(plan: RestorePlan) -> dict[int, list[float]]:
    """Device id → [bytes needed, bytes read] of one process's plan."""
    out: dict[int, list[float]] = {}
    for leaf in plan.leaves:
        seen: set[tuple] = set()  # packed (key, offset); zarr (source, chunk key, inner id or -1 for the index)
        for b in leaf.boxes:
            devices = b.device_ids or (-1,)
            read = 0
            if b.packed:
                for p in b.packed:
                    if (p.key, p.offset) not in seen:
                        seen.add((p.key, p.offset))
                        read += p.nbytes
            elif b.slabs:
                read = b.bytes_read
            else:  # an index or inner chunk that several boxes need is read once (`LeafRestorePlan.bytes_read`)
                for r in b.reads:
                    for key, n in [((r.source, r.chunk_key, -1), r.index_bytes),
                                   *(((r.source, r.chunk_key, i), r.inner_bytes_with_crc) for i in r.inner_ids)]:
                        if key not in seen:
                            seen.add(key)
                            read += n
            needed = b.bytes_needed if leaf.exchange_spec is None else 0
            for d in devices:
                row = out.setdefault(d, [0.0, 0.0])
                row[0] += needed / len(devices)
                row[1] += read / len(devices)
    return out


def _grouped(rows: Sequence[tuple[int, Sequence[float]]], prefix: str) -> list[tuple[str, list[float]]]:
    """At most `MAX_BARS` bars: consecutive ids share one when there are more."""
    rows = sorted(rows)
    per = max(1, -(-len(rows) // MAX_BARS))
    out = []
    for i in range(0, len(rows), per):
        part = rows[i:i + per]
        ids = [k for k, _ in part]
        label = (f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}-{ids[-1]}") if ids[0] >= 0 else "?"
        out.append((prefix + label, [sum(v[j] for _, v in part) for j in range(len(part[0][1]))]))
    return out


def plan_bars(plans: RestorePlan | Sequence[RestorePlan]) -> PlanBars:
    """The numbers `plot_plan` draws (see `PlanBars`); pure."""
    plans = [plans] if not isinstance(plans, Sequence) else list(plans)
    if not plans:
        raise ValueError("no restore plan to draw")
    per_device: dict[int, list[float]] = {}
    for plan in plans:
        for d, (n, r) in _device_bytes(plan).items():
            row = per_device.setdefault(d, [0.0, 0.0])
            row[0] += n
            row[1] += r
    devices = tuple((label, v[0], v[1]) for label, v in _grouped(list(per_device.items()), ""))
    procs = [(p.process_index, [p.bytes_needed, p.bytes_read, p.bytes_received]) for p in plans]
    processes = tuple((label, int(v[0]), int(v[1]), int(v[2])) for label, v in _grouped(procs, ""))
    needed = sum(p.bytes_needed for p in plans)
    read = sum(p.bytes_read for p in plans)
    return PlanBars(devices, processes, needed, read, sum(p.bytes_received for p in plans), read / needed if needed else 1.0,
                    any(p.cooperative for p in plans))


def plot_plan(plans: RestorePlan | Sequence[RestorePlan], *, title: str | None = None) -> Figure:
    """Draws a restore plan: the bytes each target device and each process needs and
    reads from storage, and the read amplification in the headline.

    Args:
      plans: a `RestorePlan` (`ckpt.plan_restore(path, target)`: one process's reads),
        or one per process (`plan_restore(..., process_index=i, processes=P)` for each
        `i`) to compare processes.
      title: a first line for the headline (default: the checkpoint path).
    Returns:
      A `matplotlib.figure.Figure` (a notebook shows it as the cell's value; `fig.savefig(out)`);
      at most `MAX_BARS` bars a panel (neighbouring devices share one beyond). The
      numbers are `plan_bars(plans)`; the headline's totals equal the plans'
      `bytes_needed`, `bytes_read` and `read_amplification`.
    Raises:
      ValueError: no plan given.
      ModuleNotFoundError: matplotlib is not installed (`pip install 'checkpointer[notebook]'`).

    Multi-process: pure (draws plans already made); call it anywhere.
    """
    Figure = _import_matplotlib()
    bars = plan_bars(plans)
    first = plans if not isinstance(plans, Sequence) else plans[0]
    per_process = len(bars.processes) > 1 or bars.cooperative
    fig = Figure(figsize=(11, 4.6), dpi=_DPI, layout="constrained")
    axes = fig.subplots(1, 2, width_ratios=[3, 1]) if per_process else [fig.subplots(1, 1)]
    scale, unit = _unit(max([max(n, r) for _, n, r in bars.devices] + [1]))
    ax = axes[0]
    xs = range(len(bars.devices))
    if not bars.cooperative:  # with an exchange, needs are known per process only
        ax.bar([x - 0.2 for x in xs], [n / scale for _, n, _ in bars.devices], width=0.4, color=_NEEDED, label="needed")
    ax.bar([x + 0.2 * (not bars.cooperative) for x in xs], [r / scale for _, _, r in bars.devices], width=0.4, color=_READ,
           label="read")
    ax.set_xticks(list(xs), [label for label, _, _ in bars.devices], fontsize=_FONT - 1,
                  rotation=45 if len(bars.devices) > 12 else 0)
    ax.set_xlabel("target device" + ("s" if any("-" in label for label, _, _ in bars.devices) else ""), fontsize=_FONT)
    ax.set_ylabel(unit, fontsize=_FONT)
    ax.tick_params(axis="y", labelsize=_FONT - 1)
    ax.set_title("bytes read from storage per target device (needs: per process, right)" if bars.cooperative
                 else "bytes per target device", fontsize=_FONT)
    if per_process:
        bx = axes[1]
        scale_p, unit_p = _unit(max([max(n, r) for _, n, r, _ in bars.processes] + [1]))
        ps = range(len(bars.processes))
        width = 0.27 if bars.cooperative else 0.4
        bx.bar([x - width for x in ps] if bars.cooperative else [x - 0.2 for x in ps],
               [n / scale_p for _, n, _, _ in bars.processes], width=width, color=_NEEDED, label="needed")
        bx.bar(list(ps) if bars.cooperative else [x + 0.2 for x in ps],
               [r / scale_p for _, _, r, _ in bars.processes], width=width, color=_READ, label="read")
        if bars.cooperative:
            bx.bar([x + width for x in ps], [g / scale_p for _, _, _, g in bars.processes], width=width, color=_RECEIVED,
                   label="from peers")
        bx.set_xticks(list(ps), [label for label, *_ in bars.processes], fontsize=_FONT - 1,
                      rotation=45 if len(bars.processes) > 8 else 0)
        bx.set_xlabel("process", fontsize=_FONT)
        bx.set_ylabel(unit_p, fontsize=_FONT)
        bx.tick_params(axis="y", labelsize=_FONT - 1)
        bx.set_title("bytes per process", fontsize=_FONT)
    from matplotlib.patches import Patch

    handles = [Patch(color=_NEEDED, label="bytes needed"), Patch(color=_READ, label="bytes read from storage")]
    if bars.cooperative:
        handles.append(Patch(color=_RECEIVED, label="bytes received from peers"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=_FONT - 1, frameon=False)
    fig.suptitle(f"{title or 'restore plan of ' + first.path}\n" + plan_headline(bars), fontsize=_FONT + 1)
    return fig


def plan_headline(bars: PlanBars) -> str:
    """The plan picture's headline: the totals, in bytes."""
    received = f", {bars.bytes_received:,} received from peers" if bars.bytes_received else ""
    return (f"{bars.bytes_needed:,} bytes needed, {bars.bytes_read:,} read{received}: "
            f"read amplification {bars.read_amplification:.3f}")
