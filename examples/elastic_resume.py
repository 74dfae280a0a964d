"""Elastic resume: train on 2 processes x 4 devices, get preempted mid-save, resume on 4 devices.

A small byte-level transformer (see ``_charlm.py``) is trained on the Python
documentation text. Every phase runs in fresh processes that simulate their
own number of CPU devices:

1. ``phase1`` is two JAX processes of 4 devices each, joined by
   ``jax.distributed`` (gloo collectives over 127.0.0.1), with one mesh
   data=2 x model=4 over all 8 devices: ``data`` splits across the processes.
   Both train from scratch and save an asynchronous checkpoint every
   ``SAVE_INTERVAL_STEPS`` steps. After step ``PREEMPTED_AFTER_STEP`` they
   get a preemption notice, start an emergency save, and are killed with
   SIGKILL while it is being written: the newest folder on disk is then an
   uncommitted ``<step>.partial-<generation>``.
2. ``phase2`` is one process with 4 devices (mesh data=2 x model=2). Opening
   the checkpoint manager removes the crashed save's folder; the latest
   committed checkpoint is restored onto the smaller mesh, checked to be
   bit-identical to what phase 1 saved, and training goes on to
   ``TOTAL_STEPS``.
3. ``reference`` is one process with 8 devices (the mesh of phase 1) that
   trains all steps without interruption.

The parent process then compares the loss curves, writes a plot and exits
non-zero if anything does not match.

Usage::

    python examples/elastic_resume.py [--out demo_out]
"""

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

import _charlm
import checkpointer as ckpt

TOTAL_STEPS = 150
SAVE_INTERVAL_STEPS = 25
PREEMPTED_AFTER_STEP = 135
KEEP_CHECKPOINTS = 3
# The reference runs in one process, so its all-reduces sum float32 partial
# results in another order than gloo's across the two processes of phase 1;
# phase 2 runs on 4 devices instead of 8, so XLA splits the batch and the
# matrix products differently too. Float addition is not associative, so the
# losses differ in the last bits (a few 1e-6 here); a difference near this
# tolerance would be a bug.
LOSS_TOLERANCE = 1e-4
CHECKPOINT_DIR_NAME = "checkpoints"
# What the commit protocol writes last into a checkpoint folder: a folder
# without it is not a checkpoint (see the README, "What is guaranteed").
COMMITTED_MARKER = "COMMITTED"
PLOT_NAME = "loss_curves.png"
# Marks an output directory as created by this demo, so it may be wiped.
OUTPUT_MARKER_NAME = ".elastic_resume_demo"
# A phase that runs longer than this is killed and the demo fails.
PHASE_TIMEOUT_S = 300
# Once one process of a phase failed, how long the others get before they are
# killed (a peer of a dead process would wait in a collective).
FAILURE_GRACE_S = 10
# How long process 0 of phase 1 waits, after its emergency save started, for
# the save's folder to appear and for the other processes to die.
PREEMPTION_TIMEOUT_S = 60
MIB = 2**20

CONFIG = _charlm.Config()


class Phase(NamedTuple):
    """How one phase of the demo runs: its processes, their devices, the mesh."""

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


PHASES = {
    "phase1": Phase(2, 4, 2, 4, "train, checkpoint, get preempted mid-save"),
    "phase2": Phase(1, 4, 2, 2, "resume from the latest committed step on a smaller mesh"),
    "reference": Phase(1, 8, 2, 4, "train without interruption, for comparison"),
}


# ----------------------------------------------------------------------------
# Code that runs inside the training subprocesses.
# ----------------------------------------------------------------------------


def say(message: str) -> None:
    """Prints one indented line of a phase's report, unbuffered (process 0 only)."""
    if jax.process_index() == 0:
        print(f"  {message}", flush=True)


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


def tree_nbytes(tree: Any) -> int:
    """Returns the total size of a pytree's arrays in bytes."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def checkpoint_bytes(checkpoint_dir: Path, step: int) -> int:
    """Returns the size of a committed checkpoint's arrays, from its metadata."""
    return ckpt.metadata(f"{checkpoint_dir}/{step}").total_bytes


def format_bytes(num_bytes: int) -> str:
    """Formats a byte count in MiB, or KiB / bytes when it is small."""
    if num_bytes >= MIB // 10:
        return f"{num_bytes / MIB:.1f} MiB"
    if num_bytes >= 1024:
        return f"{num_bytes / 1024:.1f} KiB"
    return f"{num_bytes} bytes"


def train(
    state: Any,
    mesh: jax.sharding.Mesh,
    steps: range,
    after_step: Callable[[int, Any, float], None] | None = None,
) -> tuple[Any, dict[int, float]]:
    """Runs training steps on the deterministic batch sequence.

    Every process of the mesh runs the same steps; each builds the global
    batch and places only its own devices' rows.

    Args:
        state: Sharded TrainState; it is donated to the first step.
        mesh: Mesh the state lives on.
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
        batch = _charlm.device_batch(_charlm.batch_for_step(corpus, step, CONFIG), mesh)
        state, loss = train_step(state, batch)
        losses[step] = float(loss)  # replicated on every device, so every process reads it
        if after_step is not None:
            after_step(step, state, losses[step])
    return state, losses


def new_manager(checkpoint_dir: Path) -> ckpt.CheckpointManager:
    """Returns the checkpoint manager both training phases use."""
    return ckpt.CheckpointManager(
        checkpoint_dir,
        keep=ckpt.KeepLatest(KEEP_CHECKPOINTS),
        save_interval_steps=SAVE_INTERVAL_STEPS,
        async_save=True,
    )


def partial_folders(checkpoint_dir: Path, step: int) -> list[str]:
    """Returns the names of the uncommitted ``<step>.partial-*`` folders of a step."""
    return sorted(
        name for name in os.listdir(checkpoint_dir) if name.startswith(f"{step}.partial-")
    )


def run_phase1(out_dir: Path, mesh: jax.sharding.Mesh) -> None:
    """Trains from scratch with periodic async checkpoints, then dies mid-save.

    Runs in every process of the job. Process 0 writes ``phase1.json`` with
    the per-step losses and the leaf digests of every checkpointed state.
    After ``PREEMPTED_AFTER_STEP`` every process starts one more save and
    kills itself with SIGKILL while it is being written (process 0 last), so
    neither ``close()`` nor any other cleanup runs.

    Args:
        out_dir: Demo output directory.
        mesh: The 8-device mesh over both processes.
    """
    if jax.process_index() != 0:
        # Taken before the first collective, so long before process 0 waits on it.
        hold_alive_lock(out_dir, jax.process_index())
    state = _charlm.init_state(CONFIG, mesh)
    num_params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    say(
        f"model: {CONFIG.num_layers}-layer transformer, d_model {CONFIG.d_model}, "
        f"{num_params:,} params; state with AdamW moments: "
        f"{len(jax.tree.leaves(state))} arrays, {tree_nbytes(state) / MIB:.1f} MiB"
    )

    checkpoint_dir = out_dir / CHECKPOINT_DIR_NAME
    # Every process opens the manager and calls save() with the same steps;
    # the commit is coordinated through jax.distributed's key-value store.
    manager = new_manager(checkpoint_dir)
    save_blocked_s = {}
    digests = {}

    def checkpoint(step: int, state: Any, loss: float) -> None:
        start_s = time.perf_counter()
        if manager.save(step, state, metrics={"loss": loss}):
            save_blocked_s[step] = time.perf_counter() - start_s
            digests[step] = leaf_digests(state)  # a collective: every process hashes

    state, losses = train(state, mesh, range(1, PREEMPTED_AFTER_STEP + 1), checkpoint)
    # Let the last regular checkpoint commit first, so that the output is the
    # same on every run: the save in flight at the kill is the emergency one.
    manager.wait_until_finished()
    latest_step = manager.latest_step()
    if jax.process_index() == 0:
        (out_dir / "phase1.json").write_text(json.dumps({"losses": losses, "digests": digests}))

    say(
        f"trained steps 1-{PREEMPTED_AFTER_STEP}: "
        f"loss {losses[1]:.3f} -> {losses[PREEMPTED_AFTER_STEP]:.3f}"
    )
    say(
        f"saved checkpoints at steps {', '.join(map(str, save_blocked_s))}, "
        f"{checkpoint_bytes(checkpoint_dir, latest_step) / MIB:.1f} MiB each; "
        f"step {latest_step} is the last committed one"
    )
    say(
        f"save() blocked training {np.mean(list(save_blocked_s.values())):.3f} s on average; "
        f"writes ran in the background (last: {manager.status().last_commit_s:.2f} s)"
    )

    # The preemption notice: save the current step at once, off the interval.
    start_s = time.perf_counter()
    manager.save(PREEMPTED_AFTER_STEP, state, metrics={"loss": losses[PREEMPTED_AFTER_STEP]},
                 force=True)
    blocked_s = time.perf_counter() - start_s
    if jax.process_index() != 0:
        # The snapshot is taken and the background write has started: die now.
        # This process never reports its shards written, so the save cannot
        # commit any more.
        os.kill(os.getpid(), signal.SIGKILL)
    # Process 0 dies last: it hosts jax.distributed's coordination service,
    # and a process that loses the service aborts itself (SIGABRT). It waits
    # for its background write to create the save's folder, so that the save
    # is visibly in flight, and for the other processes to be dead.
    deadline_s = time.monotonic() + PREEMPTION_TIMEOUT_S
    while not partial_folders(checkpoint_dir, PREEMPTED_AFTER_STEP):
        if time.monotonic() > deadline_s:
            sys.exit(f"the save of step {PREEMPTED_AFTER_STEP} never created its folder")
        time.sleep(0.001)
    for process_id in range(1, jax.process_count()):
        wait_until_dead(out_dir, process_id, deadline_s)
    say(
        f"PREEMPTED after step {PREEMPTED_AFTER_STEP}: both processes started an emergency save "
        f"of step {PREEMPTED_AFTER_STEP}"
    )
    say(
        f"(save() blocked {blocked_s:.3f} s) and were killed with SIGKILL while it was being "
        "written"
    )
    os.kill(os.getpid(), signal.SIGKILL)


def alive_lock_path(out_dir: Path, process_id: int) -> Path:
    """Returns the file a phase-1 process holds locked for as long as it lives."""
    return out_dir / f"phase1-process{process_id}.alive"


def hold_alive_lock(out_dir: Path, process_id: int) -> None:
    """Locks this process's ``alive`` file; the kernel unlocks it when the process dies."""
    lock_fd = os.open(alive_lock_path(out_dir, process_id), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # lock_fd stays open until the process dies


def wait_until_dead(out_dir: Path, process_id: int, deadline_s: float) -> None:
    """Waits until another phase-1 process has died (its ``alive`` lock is free).

    Args:
        out_dir: Demo output directory.
        process_id: The process to wait for; it called :func:`hold_alive_lock`.
        deadline_s: ``time.monotonic()`` value after which to give up.

    Raises:
        SystemExit: If the process is still alive at the deadline.
    """
    lock_fd = os.open(alive_lock_path(out_dir, process_id), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline_s:
                    sys.exit(f"process {process_id} did not die after its emergency save")
                time.sleep(0.001)
    finally:
        os.close(lock_fd)


def run_phase2(out_dir: Path, mesh: jax.sharding.Mesh) -> None:
    """Cleans up the crashed save, restores onto a smaller mesh, trains on.

    Exits non-zero if the crashed save was not removed or the restored state
    differs from what phase 1 saved. Writes ``phase2.json`` with the resume
    step and the per-step losses.

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
    before = set(os.listdir(checkpoint_dir))
    with new_manager(checkpoint_dir) as manager:
        removed = sorted(before - set(os.listdir(checkpoint_dir)))
        if not any(".partial-" in name for name in removed):
            sys.exit(f"opening the manager did not remove the crashed save (removed: {removed})")
        say(
            f"opening the CheckpointManager removed {', '.join(n + '/' for n in removed)}, "
            "the crashed save"
        )
        resume_step = manager.latest_step()
        if resume_step is None:
            sys.exit(f"no committed checkpoint found in {checkpoint_dir}")
        say(f"committed checkpoints on disk: {manager.all_steps()}; resuming from {resume_step}")
        metadata = ckpt.metadata(manager.step_path(resume_step))
        written = ", ".join(
            f"process {i} wrote {format_bytes(num_bytes)}"
            for i, num_bytes in enumerate(metadata.process_bytes_written)
        )
        say(f"checkpoint {resume_step} was saved by {metadata.process_count} processes: {written}")
        if 0 in metadata.process_bytes_written:
            say(
                "(the state is replicated over 'data', i.e. across the processes, and each "
                "shard is\n   written once, by the process whose device holds replica 0)"
            )

        start_s = time.perf_counter()
        state = jax.block_until_ready(manager.restore(resume_step, target=target))
        restore_s = time.perf_counter() - start_s
        restored_bytes = metadata.total_bytes
        say(
            f"restored step {resume_step} onto the new mesh in {restore_s:.2f} s "
            f"({restored_bytes / MIB:.1f} MiB, {restored_bytes / MIB / restore_s:.0f} MiB/s)"
        )
        verify_restored(state, target, resume_step, out_dir)

        def checkpoint(step: int, state: Any, loss: float) -> None:
            manager.save(step, state, metrics={"loss": loss})

        _, losses = train(state, mesh, range(resume_step + 1, TOTAL_STEPS + 1), checkpoint)
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
    _, losses = train(state, mesh, range(1, TOTAL_STEPS + 1))
    (out_dir / "reference.json").write_text(json.dumps({"losses": losses}))
    say(f"trained steps 1-{TOTAL_STEPS}: loss {losses[1]:.3f} -> {losses[TOTAL_STEPS]:.3f}")


PHASE_RUNNERS = {"phase1": run_phase1, "phase2": run_phase2, "reference": run_reference}


def divert_native_stdout(log_path: Path) -> None:
    """Sends what native code prints on stdout to a file; Python's prints stay.

    gloo prints a line for every communicator it connects, straight to file
    descriptor 1. This points descriptor 1 at ``log_path`` and gives
    ``sys.stdout`` a duplicate of the original descriptor.

    Args:
        log_path: File that receives the native output.
    """
    sys.stdout.flush()
    original_stdout = os.dup(1)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)
    os.close(log_fd)
    sys.stdout = os.fdopen(original_stdout, "w", buffering=1)


def run_phase_here(name: str, out_dir: Path, process_id: int, coordinator: str | None) -> None:
    """Entry point of a training subprocess.

    Args:
        name: Key of ``PHASES``.
        out_dir: Demo output directory.
        process_id: This process's index among the phase's processes.
        coordinator: ``host:port`` of the ``jax.distributed`` coordinator
            (process 0 serves it); None for a single-process phase.
    """
    phase = PHASES[name]
    if phase.num_processes > 1:
        divert_native_stdout(out_dir / f"{name}-process{process_id}.log")
        # CPU devices of different processes talk through gloo over TCP.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=phase.num_processes,
            process_id=process_id,
        )
    if (
        jax.local_device_count() != phase.devices_per_process
        or jax.device_count() != phase.num_devices
    ):
        sys.exit(
            f"{name} expects {phase.devices}, but JAX sees {jax.process_count()} x "
            f"{jax.local_device_count()}; XLA_FLAGS must be set before jax is imported"
        )
    PHASE_RUNNERS[name](out_dir, _charlm.make_mesh(phase.data_axis_size, phase.model_axis_size))


# ----------------------------------------------------------------------------
# Code that runs in the parent process: launch the phases, compare, plot.
# ----------------------------------------------------------------------------


def free_port() -> int:
    """Returns a TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_processes(
    processes: list[subprocess.Popen], expected_returncode: int
) -> list[str]:
    """Waits for a phase's processes; kills them if they hang or one failed.

    Args:
        processes: The phase's processes, by process id.
        expected_returncode: The exit status every process should have.

    Returns:
        One line per process that did not end as expected (empty if all did).
    """
    deadline_s = time.monotonic() + PHASE_TIMEOUT_S
    first_failure_s = None
    while any(process.poll() is None for process in processes):
        now_s = time.monotonic()
        if first_failure_s is None and any(
            process.returncode not in (None, expected_returncode) for process in processes
        ):
            first_failure_s = now_s
        if now_s > deadline_s or (
            first_failure_s is not None and now_s > first_failure_s + FAILURE_GRACE_S
        ):
            break
        time.sleep(0.05)
    problems = []
    for process_id, process in enumerate(processes):
        if process.poll() is None:
            process.kill()
            process.wait()
            problems.append(f"process {process_id} did not finish in time and was killed")
        elif process.returncode != expected_returncode:
            problems.append(f"process {process_id} exited with code {process.returncode}")
    return problems


def launch_phase(
    name: str, out_dir: Path, report: Callable[[Path], None] | None = None
) -> None:
    """Runs one phase in fresh Python processes with their own device count.

    Args:
        name: Key of ``PHASES``.
        out_dir: Demo output directory.
        report: Optional ``report(out_dir)``, run once the processes ended.

    Raises:
        SystemExit: If a subprocess fails (those of phase 1 are expected to be
            killed with SIGKILL).
    """
    phase = PHASES[name]
    print(f"\n[{name}] {phase.layout}: {phase.description}", flush=True)
    other_xla_flags = [
        flag
        for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count")
    ]
    device_count_flag = f"--xla_force_host_platform_device_count={phase.devices_per_process}"
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.lower().endswith("_proxy")  # gRPC would send 127.0.0.1 through a proxy
    }
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([*other_xla_flags, device_count_flag]))
    command = [sys.executable, __file__, "--phase", name, "--out", str(out_dir)]
    if phase.num_processes > 1:
        command += ["--coordinator", f"127.0.0.1:{free_port()}"]
    expected_returncode = -signal.SIGKILL if name == "phase1" else 0
    start_s = time.perf_counter()
    processes = []
    try:
        for process_id in range(phase.num_processes):
            processes.append(
                subprocess.Popen([*command, "--process-id", str(process_id)], env=env)
            )
        problems = wait_for_processes(processes, expected_returncode)
    finally:  # never leave a training process behind (e.g. on Ctrl-C)
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    wall_s = time.perf_counter() - start_s
    if problems:
        sys.exit(f"FAILED: {name}: " + "; ".join(problems))
    if report is not None:
        report(out_dir)
    print(f"  ({name} took {wall_s:.1f} s)", flush=True)


def report_killed_save(out_dir: Path) -> None:
    """Lists the checkpoint folders phase 1 left; fails unless the newest is uncommitted.

    Args:
        out_dir: Demo output directory.

    Raises:
        SystemExit: If the newest folder is a committed checkpoint, i.e. the
            kill did not land while a save was in flight.
    """
    checkpoint_dir = out_dir / CHECKPOINT_DIR_NAME
    folders = sorted(
        (name for name in os.listdir(checkpoint_dir) if name.split(".")[0].isdigit()),
        key=lambda name: (int(name.split(".")[0]), name),
    )
    committed = [name for name in folders if (checkpoint_dir / name / COMMITTED_MARKER).exists()]
    newest = folders[-1]
    if newest in committed or ".partial-" not in newest:
        sys.exit(f"FAILED: the newest folder {newest}/ is not an uncommitted save in flight")
    last_step = int(committed[-1])
    print("  both processes died by SIGKILL; checkpoint folders on disk:")
    print(f"    {'  '.join(name + '/' for name in folders)}")
    print(
        f"  the newest has no {COMMITTED_MARKER} marker: it is the save in flight, not a "
        "checkpoint; the last"
    )
    print(
        f"  committed one is step {last_step}, so {PREEMPTED_AFTER_STEP - last_step} steps of "
        "work are lost"
    )


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

    The top panel shows the losses, the bottom one how far each phase of the
    interrupted run is from the reference.

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
        f"Elastic resume: checkpoint on {PHASES['phase1'].devices}, killed mid-save,\n"
        f"restore and continue on {PHASES['phase2'].devices}"
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
        f"Python docs,\ncheckpointed every {SAVE_INTERVAL_STEPS} steps. Each phase runs in fresh "
        f"processes with their own number\nof simulated CPU devices; phase 1 is 2 JAX processes "
        f"under jax.distributed. Output: {out_dir}/"
    )
    for name in PHASES:
        launch_phase(name, out_dir, report_killed_save if name == "phase1" else None)

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
    print(
        f"  phase 1, steps 1-{max(phase1)}, same mesh on {PHASES['phase1'].num_processes} "
        f"processes instead of 1: max |diff| = {phase1_diff:.1e}"
    )
    print(
        f"  phase 2, steps {resume_step + 1}-{TOTAL_STEPS}, {resumed_devices} devices instead of "
        f"{reference_devices}: max |diff| = {phase2_diff:.1e}"
    )
    print(
        f"  tolerance {LOSS_TOLERANCE:.0e}: the losses are not bit-exact because gloo's all-reduce "
        f"across processes and XLA\n  on {resumed_devices} devices add float32 partial sums in "
        "another order than one 8-device process does\n  (float addition is not associative)"
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
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        run_phase_here(args.phase, args.out, args.process_id, args.coordinator)
    else:
        run_demo(args.out)


if __name__ == "__main__":
    main()
