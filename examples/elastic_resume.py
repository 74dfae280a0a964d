"""Elastic resume: train on 2 processes x 4 devices, get preempted mid-save, resume on 4 devices.

A small byte-level transformer (``_charlm.py``) is trained on the Python
documentation text. Each phase runs in fresh processes that simulate their own
number of CPU devices:

1. ``phase1``: two JAX processes of 4 devices each, joined by ``jax.distributed``,
   with one mesh data=2 x model=4 over all 8 devices. Both save an asynchronous
   checkpoint every ``SAVE_INTERVAL_STEPS`` steps. After ``PREEMPTED_AFTER_STEP``
   they get a preemption notice, start an emergency save and are killed with
   SIGKILL while it is being written.
2. ``phase2``: one process with 4 devices (mesh data=2 x model=2). Opening the
   checkpoint manager removes the crashed save; the latest committed checkpoint
   is restored onto the smaller mesh, checked to be bit-identical to what phase 1
   saved, and training goes on to ``TOTAL_STEPS``.
3. ``reference``: one process with 8 devices trains all steps without interruption.

The parent process compares the loss curves, writes a plot, and draws where each
committed save's time went (``ckpt.timeline``: text here, ``save_timeline.png``). This file holds
the checkpointing; ``_demo_support.py`` holds the plumbing (training loop,
digests, printing, plot) and ``checkpointer.testing`` starts the processes.

Usage::

    python examples/elastic_resume.py [--out demo_out]
"""

import argparse
import signal
import time
from pathlib import Path

import _charlm
import _demo_support as demo
import jax

import checkpointer as ckpt
from checkpointer import testing

TOTAL_STEPS = 150
SAVE_INTERVAL_STEPS = 25
PREEMPTED_AFTER_STEP = 135
KEEP_CHECKPOINTS = 3
# gloo's all-reduce across processes and XLA on fewer devices sum float32 partial
# results in another order than one 8-device process: the losses differ in the
# last bits (a few 1e-6); a difference near this tolerance would be a bug.
LOSS_TOLERANCE = 1e-4
CONFIG = _charlm.Config()
PHASES = {
    "phase1": demo.Phase("phase1", 2, 4, 2, 4, "train, checkpoint, get preempted mid-save"),
    "phase2": demo.Phase("phase2", 1, 4, 2, 2, "resume from the latest committed step on a smaller mesh"),
    "reference": demo.Phase("reference", 1, 8, 2, 4, "train without interruption, for comparison"),
}


def open_manager(checkpoint_dir: str) -> ckpt.CheckpointManager:
    """The manager of both training phases: async saves every 25 steps, keep the newest 3."""
    return ckpt.CheckpointManager(
        checkpoint_dir,
        keep=ckpt.KeepLatest(KEEP_CHECKPOINTS),
        save_interval_steps=SAVE_INTERVAL_STEPS,
        async_save=True,
    )


def phase1(checkpoint_dir: str) -> None:
    """Runs in each of the 2 processes: train with periodic checkpoints, die mid-save."""
    mesh = PHASES["phase1"].mesh()
    state = _charlm.init_state(CONFIG, mesh)
    demo.say(demo.describe_state(state, CONFIG))
    # Every process opens the manager and calls save() with the same steps; the
    # commit is coordinated through jax.distributed's key-value store.
    manager = open_manager(checkpoint_dir)
    save_blocked_s, digests = {}, {}

    def checkpoint(step, state, loss):
        start_s = time.perf_counter()
        if manager.save(step, state, metrics={"loss": loss}):  # False off the interval
            save_blocked_s[step] = time.perf_counter() - start_s
            digests[step] = demo.leaf_digests(state)  # to check the restore against later

    state, losses = demo.train(state, mesh, CONFIG, range(1, PREEMPTED_AFTER_STEP + 1), checkpoint)
    # Let the last regular save commit, so that the save the kill interrupts is the emergency one.
    manager.wait_until_finished()
    latest_step = manager.latest_step()
    testing.emit(event="phase1", losses=losses, digests=digests)
    demo.say(f"trained steps 1-{PREEMPTED_AFTER_STEP}: "
             f"loss {losses[1]:.3f} -> {losses[PREEMPTED_AFTER_STEP]:.3f}")
    checkpoint_mib = ckpt.metadata(manager.step_path(latest_step)).total_bytes / demo.MIB
    demo.say(f"saved checkpoints at steps {', '.join(map(str, save_blocked_s))}, "
             f"{checkpoint_mib:.1f} MiB each; step {latest_step} is the last committed one")
    demo.say(f"save() blocked training {sum(save_blocked_s.values()) / len(save_blocked_s):.3f} s "
             f"on average; writes ran in the background (last: {manager.status().last_commit_s:.2f} s)")

    # The preemption notice: save the current step at once, off the interval.
    folders_before = demo.list_folders(checkpoint_dir)
    start_s = time.perf_counter()
    manager.save(PREEMPTED_AFTER_STEP, state, metrics={"loss": losses[PREEMPTED_AFTER_STEP]}, force=True)
    blocked_s = time.perf_counter() - start_s
    if jax.process_index() == 0:
        demo.wait_for_new_folder(checkpoint_dir, folders_before)  # the save's folder: it is in flight
        demo.say(f"PREEMPTED after step {PREEMPTED_AFTER_STEP}: both processes started an emergency "
                 f"save of step {PREEMPTED_AFTER_STEP}")
        demo.say(f"(save() blocked {blocked_s:.3f} s) and were killed with SIGKILL while it was "
                 "being written")
    # SIGKILL, now: process 1 has not reported its shards written, so the save cannot
    # commit; no close() or other cleanup runs.
    testing.kill_job()


def committed_step(path: Path) -> int | None:
    """The step of the checkpoint at ``path``, or None if the folder is not a committed one."""
    try:
        return ckpt.metadata(path).step
    except ckpt.CheckpointNotFoundError:  # e.g. a save that was in flight when it crashed
        return None


def report_crashed_save(checkpoint_dir: Path) -> list[str]:
    """Lists what phase 1 left on disk; returns the folders that are not checkpoints."""
    folders = demo.list_folders(checkpoint_dir)
    steps = {name: committed_step(checkpoint_dir / name) for name in folders}
    crashed = [name for name, step in steps.items() if step is None]
    if folders[-1] not in crashed:
        demo.fail(f"the newest folder {folders[-1]}/ is a committed checkpoint, not a save in flight")
    last_step = max(step for step in steps.values() if step is not None)
    print("  both processes died by SIGKILL; checkpoint folders on disk:")
    print(f"    {'  '.join(name + '/' for name in folders)}")
    print("  the newest is not a committed checkpoint: it is the save in flight; the last")
    print(f"  committed one is step {last_step}, so {PREEMPTED_AFTER_STEP - last_step} steps of "
          "work are lost")
    return crashed


def phase2(checkpoint_dir: str, crashed: list[str], digests: dict[str, dict[str, str]]) -> None:
    """Runs in one process of 4 devices: clean up, restore onto a smaller mesh, train on."""
    mesh = PHASES["phase2"].mesh()
    # The restore target: the model's shapes and dtypes with shardings for the new mesh.
    abstract_state = jax.eval_shape(_charlm.make_init_fn(CONFIG))
    target = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_state,
        _charlm.state_shardings(abstract_state, mesh),
    )
    folders_before = demo.list_folders(checkpoint_dir)
    with open_manager(checkpoint_dir) as manager:
        # Opening a manager only reads; the writer cleans up crashed saves at its first
        # save, or now with recover() (it takes the directory's writer lock).
        manager.recover()
        removed = sorted(set(folders_before) - set(demo.list_folders(checkpoint_dir)))
        if removed != sorted(crashed):
            demo.fail(f"recover() removed {removed}, expected the crashed save {crashed}")
        demo.say(f"the resuming writer's recover() removed {', '.join(n + '/' for n in removed)}, "
                 "the crashed save")
        resume_step = manager.latest_step()
        demo.say(f"committed checkpoints on disk: {manager.all_steps()}; resuming from {resume_step}")
        metadata = ckpt.metadata(manager.step_path(resume_step))
        written = ", ".join(f"process {i} wrote {demo.format_bytes(num_bytes)}"
                            for i, num_bytes in enumerate(metadata.process_bytes_written))
        demo.say(f"checkpoint {resume_step} was saved by {metadata.process_count} processes: {written}")

        start_s = time.perf_counter()
        state = jax.block_until_ready(manager.restore(resume_step, target=target))
        restore_s = time.perf_counter() - start_s
        restored_mib = metadata.total_bytes / demo.MIB
        demo.say(f"restored step {resume_step} onto the new mesh in {restore_s:.2f} s "
                 f"({restored_mib:.1f} MiB, {restored_mib / restore_s:.0f} MiB/s)")
        demo.check_restored(state, target, resume_step, digests[str(resume_step)])

        def checkpoint(step, state, loss):
            manager.save(step, state, metrics={"loss": loss})

        _, losses = demo.train(state, mesh, CONFIG, range(resume_step + 1, TOTAL_STEPS + 1), checkpoint)
        manager.wait_until_finished()
        status = manager.status()
    testing.emit(event="phase2", resume_step=resume_step, losses=losses)
    demo.say(f"trained steps {resume_step + 1}-{TOTAL_STEPS}: "
             f"loss {losses[resume_step + 1]:.3f} -> {losses[TOTAL_STEPS]:.3f}")
    demo.say(f"last checkpoint (step {status.latest_committed_step}): save() blocked "
             f"{status.last_wait_s + status.last_snapshot_s:.3f} s, committed "
             f"{status.last_commit_s:.2f} s later")


def reference() -> None:
    """Runs in one process of 8 devices: train all steps without interruption."""
    mesh = PHASES["reference"].mesh()
    _, losses = demo.train(_charlm.init_state(CONFIG, mesh), mesh, CONFIG, range(1, TOTAL_STEPS + 1))
    testing.emit(event="reference", losses=losses)
    demo.say(f"trained steps 1-{TOTAL_STEPS}: loss {losses[1]:.3f} -> {losses[TOTAL_STEPS]:.3f}")


def main() -> None:
    """Runs the phases in fresh processes, then compares and plots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("demo_out"),
                        help="output directory, recreated on every run (default: demo_out)")
    out_dir = parser.parse_args().out
    checkpoint_dir = out_dir / "checkpoints"
    start_s = time.perf_counter()
    demo.prepare_output_dir(out_dir)
    print(f"Elastic resume demo: {TOTAL_STEPS} training steps of a byte-level transformer on the "
          f"Python docs,\ncheckpointed every {SAVE_INTERVAL_STEPS} steps. Each phase runs in fresh "
          "processes with their own number\nof simulated CPU devices; phase 1 is 2 JAX processes "
          f"under jax.distributed. Output: {out_dir}/")

    with demo.phase_report(PHASES["phase1"]):
        saved = demo.run_phase(PHASES["phase1"], phase1, expected_returncode=-signal.SIGKILL,
                               checkpoint_dir=str(checkpoint_dir)).record("phase1")
        crashed = report_crashed_save(checkpoint_dir)
    with demo.phase_report(PHASES["phase2"]):
        resumed = demo.run_phase(PHASES["phase2"], phase2, checkpoint_dir=str(checkpoint_dir),
                                 crashed=crashed, digests=saved["digests"]).record("phase2")
    with demo.phase_report(PHASES["reference"]):
        reference_losses = demo.losses_of(demo.run_phase(PHASES["reference"], reference).record("reference"))

    curves = (reference_losses, demo.losses_of(saved), demo.losses_of(resumed), resumed["resume_step"])
    passed = demo.report_comparison(PHASES, *curves, LOSS_TOLERANCE)
    plot_path = out_dir / "loss_curves.png"
    demo.plot_losses(plot_path, PHASES, *curves)
    print("\n[timeline] where each committed save's time went, per process (`checkpointer timeline`)")
    ckpt.timeline(checkpoint_dir, png=out_dir / "save_timeline.png")
    print(f"\nTotal wall time {time.perf_counter() - start_s:.1f} s")
    print(f"Loss curves: {plot_path}")
    print(f"Save timeline: {out_dir / 'save_timeline.png'}")
    if not passed:
        demo.fail("the resumed run does not match the uninterrupted one")


if __name__ == "__main__":
    main()
