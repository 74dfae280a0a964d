"""Plumbing of ``elastic_resume.py``: phases, training loop, digests, printing, the plot.

Nothing in here calls the checkpointing library except through the process
harness (``checkpointer.testing``), which runs each phase as fresh JAX
processes with their own number of simulated CPU devices.
"""

import contextlib
import hashlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import _charlm
import jax
import numpy as np
from jax.experimental import multihost_utils

from checkpointer import testing

MIB = 2**20
# A phase that runs longer than this is killed and the demo fails.
PHASE_TIMEOUT_S = 300
# Once one process of a phase failed, how long the others get before they are
# killed (a peer of a dead process would wait in a collective).
FAILURE_GRACE_S = 10
# How long process 0 of phase 1 waits for the emergency save's folder to appear.
PREEMPTION_TIMEOUT_S = 60
# Marks an output directory as created by this demo, so it may be wiped.
OUTPUT_MARKER_NAME = ".elastic_resume_demo"


class Phase(NamedTuple):
    """How one phase of the demo runs: its processes, their devices, the mesh."""

    name: str
    num_processes: int
    devices_per_process: int
    data_axis_size: int
    model_axis_size: int
    description: str

    @property
    def num_devices(self) -> int:
        """Devices of all processes together."""
        return self.num_processes * self.devices_per_process

    @property
    def devices(self) -> str:
        """Describes the processes and devices, e.g. ``2 processes x 4 devices``."""
        processes = "process" if self.num_processes == 1 else "processes"
        return f"{self.num_processes} {processes} x {self.devices_per_process} devices"

    @property
    def layout(self) -> str:
        """Describes the devices and mesh, e.g. ``1 process x 8 devices, mesh data=2 x model=4``."""
        return f"{self.devices}, mesh data={self.data_axis_size} x model={self.model_axis_size}"

    def mesh(self) -> jax.sharding.Mesh:
        """The phase's ``data x model`` mesh over the devices of all its processes."""
        return _charlm.make_mesh(self.data_axis_size, self.model_axis_size)


# ----------------------------------------------------------------------------
# Inside the training processes.
# ----------------------------------------------------------------------------


def say(message: str) -> None:
    """Prints one indented line of a phase's report (process 0 only)."""
    if jax.process_index() == 0:
        print(f"  {message}", flush=True)


def fail(message: str) -> NoReturn:
    """Ends the demo (or the phase, inside a training process) with ``FAILED: message``."""
    sys.exit(f"FAILED: {message}")


def format_bytes(num_bytes: int) -> str:
    """Formats a byte count in MiB, or KiB / bytes when it is small."""
    if num_bytes >= MIB // 10:
        return f"{num_bytes / MIB:.1f} MiB"
    if num_bytes >= 1024:
        return f"{num_bytes / 1024:.1f} KiB"
    return f"{num_bytes} bytes"


def tree_nbytes(tree: Any) -> int:
    """Returns the total size of a pytree's arrays in bytes."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def describe_state(state: Any, config: _charlm.Config) -> str:
    """One line on the model and the size of its training state."""
    num_params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    return (
        f"model: {config.num_layers}-layer transformer, d_model {config.d_model}, "
        f"{num_params:,} params; state with AdamW moments: "
        f"{len(jax.tree.leaves(state))} arrays, {tree_nbytes(state) / MIB:.1f} MiB"
    )


def leaf_digests(tree: Any) -> dict[str, str]:
    """Hashes every array of a pytree, as its global value.

    With several processes this gathers every array to every process: a
    collective, so all processes must call it at the same point.

    Args:
        tree: Pytree of arrays (on any devices, with any sharding).

    Returns:
        Map from ``jax.tree_util.keystr`` path to the sha256 hex digest of the
        leaf's dtype, shape and bytes, as assembled on the host.
    """
    digests = {}
    host_tree = multihost_utils.process_allgather(tree, tiled=True)
    for path, leaf in jax.tree_util.tree_flatten_with_path(host_tree)[0]:
        host = np.ascontiguousarray(leaf)
        hasher = hashlib.sha256(f"{host.dtype}{host.shape}".encode())
        hasher.update(host.tobytes())
        digests[jax.tree_util.keystr(path)] = hasher.hexdigest()
    return digests


def check_restored(state: Any, target: Any, step: int, saved_digests: dict[str, str]) -> None:
    """Checks a restored state against its target layout and the saved state's digests.

    Args:
        state: The restored TrainState.
        target: The abstract target it was restored into.
        step: The checkpoint step that was restored.
        saved_digests: :func:`leaf_digests` of the state when it was saved.

    Raises:
        SystemExit: Describing the first kind of mismatch found.
    """
    if int(state.step) != step:
        fail(f"restored state.step is {int(state.step)}, expected {step}")
    restored_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, leaf), wanted in zip(restored_leaves, jax.tree.leaves(target), strict=True):
        if not leaf.sharding.is_equivalent_to(wanted.sharding, leaf.ndim):
            fail(f"{jax.tree_util.keystr(path)} was restored with sharding {leaf.sharding}, "
                 f"expected {wanted.sharding}")
    restored = leaf_digests(state)
    mismatched = sorted(k for k in saved_digests.keys() | restored.keys()
                        if saved_digests.get(k) != restored.get(k))
    if mismatched:
        fail(f"restored state differs from the saved state in {len(mismatched)} leaves, "
             f"e.g. {mismatched[:3]}")
    say(f"restored state is bit-identical to the saved state: {len(restored)} leaves, "
        f"{tree_nbytes(state) / MIB:.1f} MiB")


def train(
    state: Any,
    mesh: jax.sharding.Mesh,
    config: _charlm.Config,
    steps: range,
    after_step: Callable[[int, Any, float], None] | None = None,
) -> tuple[Any, dict[int, float]]:
    """Runs training steps on the deterministic batch sequence.

    Every process of the mesh runs the same steps; each builds the global
    batch and places only its own devices' rows.

    Args:
        state: Sharded TrainState; it is donated to the first step.
        mesh: Mesh the state lives on.
        config: Model and training settings.
        steps: 1-based step numbers to run; step ``s`` trains on batch ``s``
            and leaves ``state.step == s``.
        after_step: Optional ``after_step(step, state, loss)`` hook, e.g. to
            save a checkpoint.

    Returns:
        The final state and the loss of every step.
    """
    corpus = _charlm.load_corpus()
    train_step = _charlm.make_train_step(_charlm.state_shardings(state, mesh), mesh)
    losses = {}
    for step in steps:
        batch = _charlm.device_batch(_charlm.batch_for_step(corpus, step, config), mesh)
        state, loss = train_step(state, batch)
        losses[step] = float(loss)  # replicated on every device, so every process reads it
        if after_step is not None:
            after_step(step, state, losses[step])
    return state, losses


def list_folders(directory: str | Path) -> list[str]:
    """The folders in ``directory`` (files and hidden names left out), by leading number."""
    names = [entry.name for entry in os.scandir(directory)
             if entry.is_dir() and not entry.name.startswith(".")]
    return sorted(names, key=lambda name: (int(re.match(r"\d*", name).group() or -1), name))


def wait_for_new_folder(directory: str, before: list[str]) -> None:
    """Waits until ``directory`` holds a folder that is not in ``before``.

    Raises:
        SystemExit: If none appears within ``PREEMPTION_TIMEOUT_S``.
    """
    deadline_s = time.monotonic() + PREEMPTION_TIMEOUT_S
    while not set(list_folders(directory)) - set(before):
        if time.monotonic() > deadline_s:
            fail(f"no new folder appeared in {directory} within {PREEMPTION_TIMEOUT_S} s")
        time.sleep(0.001)


# ----------------------------------------------------------------------------
# In the parent process.
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def phase_report(phase: Phase) -> Iterator[None]:
    """Prints a phase's heading before the block and its wall time after it."""
    print(f"\n[{phase.name}] {phase.layout}: {phase.description}", flush=True)
    start_s = time.perf_counter()
    yield
    print(f"  ({phase.name} took {time.perf_counter() - start_s:.1f} s)", flush=True)


def run_phase(
    phase: Phase, function: Callable[..., None], expected_returncode: int = 0, **args: Any
) -> testing.ProcessResult:
    """Runs ``function(**args)`` in the phase's fresh processes, echoing process 0's report.

    Returns:
        What process 0 did (its records carry the phase's results).

    Raises:
        SystemExit: If a process fails or hangs (the message holds every process's output).
    """
    try:
        results = testing.run_processes(
            function, phase.num_processes, phase.devices_per_process, args, PHASE_TIMEOUT_S,
            expected_returncode=expected_returncode, fail_fast_grace_s=FAILURE_GRACE_S, echo=True,
            distributed=phase.num_processes > 1,  # one process alone needs no jax.distributed
        )
    except testing.ProcessesFailed as error:
        fail(f"{phase.name}: {error}")
    return results[0]


def losses_of(record: dict[str, Any]) -> dict[int, float]:
    """The ``losses`` of a phase's record, with the JSON string keys turned into steps."""
    return {int(step): loss for step, loss in record["losses"].items()}


def report_comparison(
    phases: dict[str, Phase],
    reference: dict[int, float],
    phase1: dict[int, float],
    phase2: dict[int, float],
    resume_step: int,
    tolerance: float,
) -> bool:
    """Prints how far the interrupted run's losses are from the reference's.

    Returns:
        Whether every loss is within ``tolerance`` of the reference.
    """
    phase1_diff = max(abs(loss - reference[step]) for step, loss in phase1.items())
    phase2_diff = max(abs(loss - reference[step]) for step, loss in phase2.items())
    resumed_devices, reference_devices = phases["phase2"].num_devices, phases["reference"].num_devices
    final_step = max(phase2)
    print("\n[compare] per-step losses of the interrupted run vs the reference run")
    print(f"  phase 1, steps 1-{max(phase1)}, same mesh on {phases['phase1'].num_processes} "
          f"processes instead of 1: max |diff| = {phase1_diff:.1e}")
    print(f"  phase 2, steps {resume_step + 1}-{final_step}, {resumed_devices} devices instead of "
          f"{reference_devices}: max |diff| = {phase2_diff:.1e}")
    print(f"  tolerance {tolerance:.0e}: the losses are not bit-exact because gloo's all-reduce "
          f"across processes and XLA\n  on {resumed_devices} devices add float32 partial sums in "
          "another order than one 8-device process does\n  (float addition is not associative)")
    print(f"  final loss: resumed {phase2[final_step]:.4f}, reference {reference[final_step]:.4f}")
    passed = max(phase1_diff, phase2_diff) <= tolerance
    if passed:
        print("  OK: the resumed run matches the uninterrupted one")
    else:
        print(f"  FAILED: a loss differs from the reference by more than {tolerance:.0e}")
    return passed


def plot_losses(
    path: Path,
    phases: dict[str, Phase],
    reference: dict[int, float],
    phase1: dict[int, float],
    phase2: dict[int, float],
    resume_step: int,
) -> None:
    """Writes a PNG of the reference loss curve and the interrupted run's.

    The top panel shows the losses, the bottom one how far each phase of the
    interrupted run is from the reference.

    Args:
        path: PNG file to write.
        phases: The demo's phases, for the legend.
        reference: Losses of the uninterrupted run.
        phase1: Losses of phase 1, up to the preemption.
        phase2: Losses of phase 2, after the resume.
        resume_step: Checkpoint step phase 2 resumed from.
    """
    import matplotlib  # Imported here so that the training processes skip it.

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff) = plt.subplots(
        2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax_loss.plot(list(reference), list(reference.values()), color="0.6", lw=5, alpha=0.6,
                 label=f"reference: {phases['reference'].layout}, uninterrupted")
    ax_loss.plot(list(phase1), list(phase1.values()), color="tab:blue", lw=1.2,
                 label=f"phase 1: {phases['phase1'].layout}")
    ax_loss.plot(list(phase2), list(phase2.values()), color="tab:orange", lw=1.2,
                 label=f"phase 2: {phases['phase2'].layout}")
    for ax in (ax_loss, ax_diff):
        ax.axvline(resume_step, color="tab:green", ls="--")
        ax.axvspan(resume_step, max(phase1), color="tab:red", alpha=0.12, lw=0)
        ax.grid(alpha=0.3)
    ax_loss.plot([], [], color="tab:green", ls="--", label=f"resumed from checkpoint {resume_step}")
    ax_loss.fill_between([], [], color="tab:red", alpha=0.12, lw=0,
                         label=f"work lost at the preemption after step {max(phase1)}")
    ax_loss.set_ylabel("cross-entropy (nats / byte)")
    ax_loss.set_title(
        f"Elastic resume: checkpoint on {phases['phase1'].devices}, killed mid-save,\n"
        f"restore and continue on {phases['phase2'].devices}"
    )
    ax_loss.legend()

    for losses, color in ((phase1, "tab:blue"), (phase2, "tab:orange")):
        diff = [losses[step] - reference[step] for step in losses]
        ax_diff.plot(list(losses), diff, color=color, marker=".", ms=3, lw=0.8)
    ax_diff.axhline(0, color="0.6", lw=1)
    ax_diff.set_xlabel("training step")
    ax_diff.set_ylabel("loss - reference")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prepare_output_dir(out_dir: Path) -> None:
    """Creates an empty output directory, replacing one from a previous run.

    Args:
        out_dir: Directory to (re)create.

    Raises:
        SystemExit: If ``out_dir`` is a non-empty directory this demo did not
            create, to avoid deleting unrelated files.
    """
    if out_dir.exists():
        if any(out_dir.iterdir()) and not (out_dir / OUTPUT_MARKER_NAME).exists():
            sys.exit(f"refusing to overwrite {out_dir}: not empty and not created by this demo")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / OUTPUT_MARKER_NAME).touch()
