"""Elastic resume: train on 8 devices, get preempted, resume on 4 devices.

A small byte-level transformer (see ``_charlm.py``) is trained on the Python
documentation text. The demo runs three fresh processes, each simulating its
own number of CPU devices:

1. ``phase1`` (8 devices, mesh data=2 x model=4) trains from scratch and saves
   an asynchronous checkpoint every ``SAVE_INTERVAL_STEPS`` steps, then is
   killed with SIGKILL between two checkpoints, losing the steps since the
   last one.
2. ``phase2`` (4 devices, mesh data=2 x model=2) finds the latest committed
   checkpoint, restores it onto the smaller mesh, checks that every array is
   bit-identical to what phase 1 saved, and trains on to ``TOTAL_STEPS``.
3. ``reference`` (8 devices, same mesh as phase 1) trains all steps without
   interruption.

The parent process then compares the loss curves, writes a plot and exits
non-zero if anything does not match.

Usage::

    python examples/elastic_resume.py [--out demo_out]
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

import _charlm
import checkpointer as ckpt

TOTAL_STEPS = 150
SAVE_INTERVAL_STEPS = 25
PREEMPTED_AFTER_STEP = 135
KEEP_CHECKPOINTS = 3
# Phase 2 runs on 4 devices instead of 8, so XLA splits the batch and the
# matrix products differently and sums float32 partial results in a different
# order. Float addition is not associative, so the losses differ in the last
# bits (below 1e-6 here); a difference near this tolerance would be a bug.
LOSS_TOLERANCE = 1e-4
CHECKPOINT_DIR_NAME = "checkpoints"
PLOT_NAME = "loss_curves.png"
# Marks an output directory as created by this demo, so it may be wiped.
OUTPUT_MARKER_NAME = ".elastic_resume_demo"
MIB = 2**20

CONFIG = _charlm.Config()


class Phase(NamedTuple):
    """How one subprocess of the demo runs: its simulated devices and mesh."""

    num_devices: int
    data_axis_size: int
    model_axis_size: int
    description: str

    @property
    def layout(self) -> str:
        """Describes the devices and mesh, e.g. ``8 devices, mesh data=2 x model=4``."""
        return (
            f"{self.num_devices} devices, mesh data={self.data_axis_size} x "
            f"model={self.model_axis_size}"
        )


PHASES = {
    "phase1": Phase(8, 2, 4, "train from scratch, checkpoint, get preempted"),
    "phase2": Phase(4, 2, 2, "resume from the latest checkpoint on a smaller mesh"),
    "reference": Phase(8, 2, 4, "train without interruption, for comparison"),
}


# ----------------------------------------------------------------------------
# Code that runs inside the training subprocesses.
# ----------------------------------------------------------------------------


def say(message: str) -> None:
    """Prints one indented line of a phase's report, unbuffered."""
    print(f"  {message}", flush=True)


def leaf_digests(tree: Any) -> dict[str, str]:
    """Hashes every array of a pytree.

    Args:
        tree: Pytree of arrays (on any devices, with any sharding).

    Returns:
        Map from ``jax.tree_util.keystr`` path to the sha256 hex digest of the
        leaf's dtype, shape and bytes, as assembled on the host.
    """
    digests = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        host = np.ascontiguousarray(leaf)
        hasher = hashlib.sha256(f"{host.dtype}{host.shape}".encode())
        hasher.update(host.tobytes())
        digests[jax.tree_util.keystr(path)] = hasher.hexdigest()
    return digests


def tree_nbytes(tree: Any) -> int:
    """Returns the total size of a pytree's arrays in bytes."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def checkpoint_bytes(checkpoint_dir: Path, step: int) -> int:
    """Returns the size of a committed checkpoint's arrays, from its metadata."""
    return ckpt.metadata(f"{checkpoint_dir}/{step}").total_bytes


def train(
    state: Any,
    mesh: jax.sharding.Mesh,
    steps: range,
    after_step: Callable[[int, Any, float], None] | None = None,
) -> dict[int, float]:
    """Runs training steps on the deterministic batch sequence.

    Args:
        state: Sharded TrainState; it is donated to the first step.
        mesh: Mesh the state lives on.
        steps: 1-based step numbers to run; step ``s`` trains on batch ``s``
            and leaves ``state.step == s``.
        after_step: Optional ``after_step(step, state, loss)`` hook, e.g. to
            save a checkpoint.

    Returns:
        The loss of every step.
    """
    corpus = _charlm.load_corpus()
    train_step = _charlm.make_train_step(_charlm.state_shardings(state, mesh), mesh)
    losses = {}
    for step in steps:
        batch = jax.device_put(
            _charlm.batch_for_step(corpus, step, CONFIG), _charlm.batch_sharding(mesh)
        )
        state, loss = train_step(state, batch)
        losses[step] = float(loss)
        if after_step is not None:
            after_step(step, state, losses[step])
    return losses


def new_manager(checkpoint_dir: Path) -> ckpt.CheckpointManager:
    """Returns the checkpoint manager both training phases use."""
    return ckpt.CheckpointManager(
        checkpoint_dir,
        keep=ckpt.KeepLatest(KEEP_CHECKPOINTS),
        save_interval_steps=SAVE_INTERVAL_STEPS,
        async_save=True,
    )


def run_phase1(out_dir: Path, mesh: jax.sharding.Mesh) -> None:
    """Trains from scratch with periodic async checkpoints, then dies hard.

    Writes ``phase1.json`` with the per-step losses and the leaf digests of
    every checkpointed state, then kills its own process with SIGKILL, so
    neither ``close()`` nor any other cleanup runs.

    Args:
        out_dir: Demo output directory.
        mesh: The 8-device mesh.
    """
    state = _charlm.init_state(CONFIG, mesh)
    num_params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    say(
        f"model: {CONFIG.num_layers}-layer transformer, d_model {CONFIG.d_model}, "
        f"{num_params:,} params; state with AdamW moments: "
        f"{len(jax.tree.leaves(state))} arrays, {tree_nbytes(state) / MIB:.1f} MiB"
    )

    checkpoint_dir = out_dir / CHECKPOINT_DIR_NAME
    manager = new_manager(checkpoint_dir)
    save_blocked_s = {}
    digests = {}

    def checkpoint(step: int, state: Any, loss: float) -> None:
        start_s = time.perf_counter()
        if manager.save(step, state, metrics={"loss": loss}):
            save_blocked_s[step] = time.perf_counter() - start_s
            digests[step] = leaf_digests(state)

    losses = train(state, mesh, range(1, PREEMPTED_AFTER_STEP + 1), checkpoint)
    # A real preemption can also land while a save is still being written; that
    # checkpoint is then never committed and the previous one is used instead.
    # Waiting here only makes the demo's output deterministic.
    manager.wait_until_finished()
    latest_step = manager.latest_step()
    (out_dir / "phase1.json").write_text(json.dumps({"losses": losses, "digests": digests}))

    say(
        f"trained steps 1-{PREEMPTED_AFTER_STEP}: "
        f"loss {losses[1]:.3f} -> {losses[PREEMPTED_AFTER_STEP]:.3f}"
    )
    say(
        f"saved checkpoints at steps {', '.join(map(str, save_blocked_s))}, "
        f"{checkpoint_bytes(checkpoint_dir, latest_step) / MIB:.1f} MiB each"
    )
    say(
        f"save() blocked training {np.mean(list(save_blocked_s.values())):.3f} s on average; "
        f"writes ran in the background (last: {manager.status().last_commit_s:.2f} s)"
    )
    say(
        f"PREEMPTED after step {PREEMPTED_AFTER_STEP} (SIGKILL): last committed checkpoint is "
        f"step {latest_step}, so {PREEMPTED_AFTER_STEP - latest_step} steps of work are lost"
    )
    os.kill(os.getpid(), signal.SIGKILL)


def run_phase2(out_dir: Path, mesh: jax.sharding.Mesh) -> None:
    """Restores the latest checkpoint onto a smaller mesh and trains on.

    Exits non-zero if the restored state differs from what phase 1 saved.
    Writes ``phase2.json`` with the resume step and the per-step losses.

    Args:
        out_dir: Demo output directory.
        mesh: The 4-device mesh.
    """
    abstract_state = jax.eval_shape(_charlm.make_init_fn(CONFIG))
    target = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_state,
        _charlm.state_shardings(abstract_state, mesh),
    )
    checkpoint_dir = out_dir / CHECKPOINT_DIR_NAME
    with new_manager(checkpoint_dir) as manager:
        resume_step = manager.latest_step()
        if resume_step is None:
            sys.exit(f"no committed checkpoint found in {checkpoint_dir}")
        say(f"committed checkpoints on disk: {manager.all_steps()}; resuming from {resume_step}")

        start_s = time.perf_counter()
        state = jax.block_until_ready(manager.restore(resume_step, target=target))
        restore_s = time.perf_counter() - start_s
        restored_bytes = checkpoint_bytes(checkpoint_dir, resume_step)
        say(
            f"restored step {resume_step} onto the new mesh in {restore_s:.2f} s "
            f"({restored_bytes / MIB:.1f} MiB, {restored_bytes / MIB / restore_s:.0f} MiB/s)"
        )
        verify_restored(state, target, resume_step, out_dir)

        def checkpoint(step: int, state: Any, loss: float) -> None:
            manager.save(step, state, metrics={"loss": loss})

        losses = train(state, mesh, range(resume_step + 1, TOTAL_STEPS + 1), checkpoint)
        manager.wait_until_finished()
        status = manager.status()

    (out_dir / "phase2.json").write_text(
        json.dumps({"resume_step": resume_step, "losses": losses})
    )
    say(
        f"trained steps {resume_step + 1}-{TOTAL_STEPS}: "
        f"loss {losses[resume_step + 1]:.3f} -> {losses[TOTAL_STEPS]:.3f}"
    )
    blocked_s = status.last_wait_s + status.last_snapshot_s
    say(
        f"last checkpoint (step {status.latest_committed_step}): save() blocked {blocked_s:.3f} s, "
        f"committed {status.last_commit_s:.2f} s later"
    )


def verify_restored(state: Any, target: Any, step: int, out_dir: Path) -> None:
    """Checks a restored state against the target layout and phase 1's digests.

    Args:
        state: The restored TrainState.
        target: The abstract target it was restored into.
        step: The checkpoint step that was restored.
        out_dir: Demo output directory holding ``phase1.json``.

    Raises:
        SystemExit: Describing the first kind of mismatch found.
    """
    if int(state.step) != step:
        sys.exit(f"restored state.step is {int(state.step)}, expected {step}")
    restored_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, leaf), wanted in zip(restored_leaves, jax.tree.leaves(target), strict=True):
        if not leaf.sharding.is_equivalent_to(wanted.sharding, leaf.ndim):
            sys.exit(
                f"{jax.tree_util.keystr(path)} was restored with sharding {leaf.sharding}, "
                f"expected {wanted.sharding}"
            )
    saved = json.loads((out_dir / "phase1.json").read_text())["digests"][str(step)]
    restored = leaf_digests(state)
    mismatched = sorted(
        key for key in saved.keys() | restored.keys() if saved.get(key) != restored.get(key)
    )
    if mismatched:
        sys.exit(
            f"restored state differs from the saved state in {len(mismatched)} leaves, "
            f"e.g. {mismatched[:3]}"
        )
    say(
        f"restored state is bit-identical to the saved state: {len(restored)} leaves, "
        f"{tree_nbytes(state) / MIB:.1f} MiB"
    )


def run_reference(out_dir: Path, mesh: jax.sharding.Mesh) -> None:
    """Trains all steps without interruption; writes ``reference.json``.

    Args:
        out_dir: Demo output directory.
        mesh: The 8-device mesh.
    """
    state = _charlm.init_state(CONFIG, mesh)
    losses = train(state, mesh, range(1, TOTAL_STEPS + 1))
    (out_dir / "reference.json").write_text(json.dumps({"losses": losses}))
    say(f"trained steps 1-{TOTAL_STEPS}: loss {losses[1]:.3f} -> {losses[TOTAL_STEPS]:.3f}")


PHASE_RUNNERS = {"phase1": run_phase1, "phase2": run_phase2, "reference": run_reference}


def run_phase_here(name: str, out_dir: Path) -> None:
    """Entry point of a training subprocess.

    Args:
        name: Key of ``PHASES``.
        out_dir: Demo output directory.
    """
    phase = PHASES[name]
    if jax.device_count() != phase.num_devices:
        sys.exit(
            f"{name} expects {phase.num_devices} devices but JAX sees {jax.device_count()}; "
            "XLA_FLAGS must be set before jax is imported"
        )
    PHASE_RUNNERS[name](out_dir, _charlm.make_mesh(phase.data_axis_size, phase.model_axis_size))


# ----------------------------------------------------------------------------
# Code that runs in the parent process: launch the phases, compare, plot.
# ----------------------------------------------------------------------------


def launch_phase(name: str, out_dir: Path) -> None:
    """Runs one phase in a fresh Python process with its own device count.

    Args:
        name: Key of ``PHASES``.
        out_dir: Demo output directory.

    Raises:
        SystemExit: If the subprocess fails (phase 1 is expected to be killed).
    """
    phase = PHASES[name]
    print(f"\n[{name}] {phase.layout}: {phase.description}", flush=True)
    other_xla_flags = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    device_count_flag = f"--xla_force_host_platform_device_count={phase.num_devices}"
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([*other_xla_flags, device_count_flag])
    )
    start_s = time.perf_counter()
    returncode = subprocess.run(
        [sys.executable, __file__, "--phase", name, "--out", str(out_dir)], env=env, check=False
    ).returncode
    wall_s = time.perf_counter() - start_s
    if returncode != (-signal.SIGKILL if name == "phase1" else 0):
        sys.exit(f"FAILED: {name} exited with code {returncode}")
    print(f"  ({name} took {wall_s:.1f} s)", flush=True)


def load_phase_result(out_dir: Path, name: str) -> dict[str, Any]:
    """Reads the JSON a phase wrote, with the ``losses`` keys turned into ints.

    Args:
        out_dir: Demo output directory.
        name: Key of ``PHASES``.

    Returns:
        The phase's result; ``losses`` maps step to loss.
    """
    result = json.loads((out_dir / f"{name}.json").read_text())
    result["losses"] = {int(step): loss for step, loss in result["losses"].items()}
    return result


def max_abs_difference(losses: dict[int, float], reference: dict[int, float]) -> float:
    """Returns the largest ``|losses[s] - reference[s]|`` over the steps of ``losses``."""
    return max(abs(loss - reference[step]) for step, loss in losses.items())


def plot_losses(
    path: Path,
    reference: dict[int, float],
    phase1: dict[int, float],
    phase2: dict[int, float],
    resume_step: int,
) -> None:
    """Writes a PNG of the reference loss curve and the interrupted run's.

    The top panel shows the losses, the bottom one how far the resumed run
    is from the reference.

    Args:
        path: PNG file to write.
        reference: Losses of the uninterrupted run.
        phase1: Losses of phase 1, up to the preemption.
        phase2: Losses of phase 2, after the resume.
        resume_step: Checkpoint step phase 2 resumed from.
    """
    import matplotlib  # Imported here so that the training subprocesses skip it.

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff) = plt.subplots(
        2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax_loss.plot(list(reference), list(reference.values()), color="0.6", lw=5, alpha=0.6,
                 label=f"reference: {PHASES['reference'].layout}, uninterrupted")
    ax_loss.plot(list(phase1), list(phase1.values()), color="tab:blue", lw=1.2,
                 label=f"phase 1: {PHASES['phase1'].layout}")
    ax_loss.plot(list(phase2), list(phase2.values()), color="tab:orange", lw=1.2,
                 label=f"phase 2: {PHASES['phase2'].layout}")
    for ax in (ax_loss, ax_diff):
        ax.axvline(resume_step, color="tab:green", ls="--")
        ax.axvspan(resume_step, max(phase1), color="tab:red", alpha=0.12, lw=0)
        ax.grid(alpha=0.3)
    ax_loss.plot([], [], color="tab:green", ls="--", label=f"resumed from checkpoint {resume_step}")
    ax_loss.fill_between([], [], color="tab:red", alpha=0.12, lw=0,
                         label=f"work lost at the preemption after step {max(phase1)}")
    ax_loss.set_ylabel("cross-entropy (nats / byte)")
    ax_loss.set_title(
        f"Elastic resume: checkpoint on {PHASES['phase1'].num_devices} devices, "
        f"restore and continue on {PHASES['phase2'].num_devices}"
    )
    ax_loss.legend()

    diff = [phase2[step] - reference[step] for step in phase2]
    ax_diff.plot(list(phase2), diff, color="tab:orange", marker=".", lw=1)
    ax_diff.axhline(0, color="0.6", lw=1)
    ax_diff.set_xlabel("training step")
    ax_diff.set_ylabel("phase 2 - reference")
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


def run_demo(out_dir: Path) -> None:
    """Runs all phases in subprocesses, then compares and plots.

    Args:
        out_dir: Demo output directory.

    Raises:
        SystemExit: If a phase fails or the losses do not match.
    """
    start_s = time.perf_counter()
    prepare_output_dir(out_dir)
    print(
        f"Elastic resume demo: {TOTAL_STEPS} training steps of a byte-level transformer on the "
        f"Python docs,\ncheckpointed every {SAVE_INTERVAL_STEPS} steps. Each phase is a fresh "
        f"process with its own number of\nsimulated CPU devices. Output: {out_dir}/"
    )
    for name in PHASES:
        launch_phase(name, out_dir)

    reference = load_phase_result(out_dir, "reference")["losses"]
    phase1 = load_phase_result(out_dir, "phase1")["losses"]
    phase2_result = load_phase_result(out_dir, "phase2")
    phase2, resume_step = phase2_result["losses"], phase2_result["resume_step"]
    phase1_diff = max_abs_difference(phase1, reference)
    phase2_diff = max_abs_difference(phase2, reference)
    passed = max(phase1_diff, phase2_diff) <= LOSS_TOLERANCE

    resumed_devices = PHASES["phase2"].num_devices
    reference_devices = PHASES["reference"].num_devices
    print("\n[compare] per-step losses of the interrupted run vs the reference run")
    print(f"  phase 1, steps 1-{max(phase1)}, same mesh: max |diff| = {phase1_diff:.1e}")
    print(
        f"  phase 2, steps {resume_step + 1}-{TOTAL_STEPS}, {resumed_devices} devices instead of "
        f"{reference_devices}: max |diff| = {phase2_diff:.1e}"
    )
    print(
        f"  tolerance {LOSS_TOLERANCE:.0e}: after the resume the losses are not bit-exact because "
        f"on {resumed_devices} devices\n  XLA adds float32 partial sums in a different order "
        "(float addition is not associative)"
    )
    print(
        f"  final loss: resumed {phase2[TOTAL_STEPS]:.4f}, reference {reference[TOTAL_STEPS]:.4f}"
    )
    if passed:
        print("  OK: the resumed run matches the uninterrupted one")
    else:
        print(f"  FAILED: a loss differs from the reference by more than {LOSS_TOLERANCE:.0e}")

    plot_path = out_dir / PLOT_NAME
    plot_losses(plot_path, reference, phase1, phase2, resume_step)
    print(f"\nTotal wall time {time.perf_counter() - start_s:.1f} s")
    print(f"Loss curves: {plot_path}")
    if not passed:
        sys.exit(1)


def main() -> None:
    """Parses the command line and runs the demo, or one phase of it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("demo_out"),
        help="output directory, recreated on every run (default: demo_out)",
    )
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        run_phase_here(args.phase, args.out)
    else:
        run_demo(args.out)


if __name__ == "__main__":
    main()
