"""Training time lost per checkpoint: a jitted AdamW training step that donates its state,
checkpointing every K steps, against the same loop without checkpoints, in one run.

State: L float32 weight matrices (4096 × 2048 and 2048 × 4096, alternating) sharded
P('data', 'model') on a 2x4 mesh of 8 host (CPU) devices, with optax.adamw's two moment
arrays per matrix and a step counter: about 960 MiB (1/8 with --quick). The step is a real
training step: forward and backward of an L-layer tanh MLP on a fixed batch, AdamW update,
`jax.jit(..., donate_argnums=0)` so the state's device buffers are reused in place.

One loop = C checkpoints, each followed by K training steps (C × K steps). Per run, in an
order rotated from run to run, the loop runs four times:

  no checkpoints   the loop alone: the baseline.
  checkpointer CheckpointManager
                   one ckpt.CheckpointManager(dir, keep=KeepLatest(2)) per method kept for
                   the whole script (its host buffers are pooled between saves);
                   mgr.save(step, state) before each block of K steps.
  checkpointer save_async
                   h = ckpt.save_async(dir/<step>, state); the previous handle is waited
                   for before the next save (as the manager's max_saves_in_flight=1);
                   once it is (that save committed), every step but the newest two is
                   deleted on a background thread (shutil.rmtree), as the managers'
                   retention does after each commit.
  orbax            one ocp.CheckpointManager(dir, CheckpointManagerOptions(
                   enable_async_checkpointing=True, max_to_keep=2)) kept for the script;
                   mgr.save(step, args=StandardSave(state)).

Old steps: all three methods keep the newest two committed steps and delete older ones
as the loop goes, off the training thread (the checkpointer manager's retention after
each commit on its save thread, orbax's max_to_keep after each save, the save_async
saver's background deletion above), so each loop deletes as many steps per method, the
deletions' CPU lands in the method's own window and no method's page cache grows with
the loop. The loop is timed from its first save to the end of its last training step
(block_until_ready of the state); the last save's remaining background work (its
commit and the deletions after it) is awaited untimed afterwards, inside the CPU
window. Training time lost per checkpoint = (loop time − the same run's
baseline loop time) / C; the table gives the median (min–max) over runs. One warm-up round
(compilation, first saves, buffer pools) is not counted.

Besides wall time, each loop records CPU seconds (getrusage; XLA's `tf_XLA*` threads apart,
from /proc/self/task) and page faults: per checkpoint, the saving threads' CPU is what a
checkpoint takes from the cores the training step uses, steadier than wall time when
other jobs share the machine.

Run:  .venv/bin/python benchmarks/train_loss_bench.py [--runs 5] [--quick] [--dir /tmp]
      [--every 10] [--checkpoints 3]   (or `make bench`). Replaces the train_loss_bench
      section of benchmarks/RESULTS.md (--quick: 1/8 of the state, 1 run, RESULTS.md untouched).
"""

import os
import resource

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import concurrent.futures  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import absl.logging  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import checkpointer as ckpt  # noqa: E402

absl.logging.set_verbosity(absl.logging.ERROR)

LAYERS = 10
BATCH = 16
TX = optax.adamw(1e-4)


def _shape(i: int, scale: int) -> tuple[int, int]:
    a, b = (4096, 2048) if scale == 1 else (2048, 512)
    return (a, b) if i % 2 == 0 else (b, a)


def _loss(params, x):
    h = x
    for i in range(LAYERS):
        h = jnp.tanh(h @ params[f"w{i:02d}"])
    return jnp.mean(h * h)


def _train_step(state, x):
    loss, grads = jax.value_and_grad(_loss)(state["params"], x)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}, loss


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _xla_thread_cpu_s() -> float:
    """User + system CPU seconds of XLA's CPU threads (`tf_XLA*`: the training step's work,
    spin-waits included) from /proc/self/task; they live as long as the process."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("tf_XLA"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _TICKS_PER_S


class Trainer:
    """The jitted, donating step and a freshly initialised state."""

    def __init__(self, scale: int):
        m = C.mesh()
        self.mesh = m
        keys = jax.random.split(jax.random.key(0), LAYERS)

        def init():
            params = {f"w{i:02d}": jax.random.normal(keys[i], _shape(i, scale), jnp.float32) * 0.02
                      for i in range(LAYERS)}
            return {"params": params, "opt": TX.init(params), "step": jnp.zeros((), jnp.int32)}

        abstract = jax.eval_shape(init)
        self.shardings = jax.tree.map(
            lambda a: NamedSharding(m, P("data", "model") if a.ndim == 2 else P()), abstract)
        self._init = jax.jit(init, out_shardings=self.shardings)
        self.step = jax.jit(_train_step, donate_argnums=0, out_shardings=(self.shardings, NamedSharding(m, P())))
        self.x = jax.device_put(jax.random.normal(jax.random.key(1), (BATCH, _shape(0, scale)[0]), jnp.float32),
                                NamedSharding(m, P()))

    def fresh_state(self):
        return jax.block_until_ready(self._init())


def _loop(trainer: Trainer, state, every: int, checkpoints: int, save, first_step: int):
    """C × (save, K steps); returns (state, loop seconds, blocking seconds of the saves)."""
    blocked = []
    t0 = time.perf_counter()
    step = first_step
    for _ in range(checkpoints):
        if save is not None:
            b0 = time.perf_counter()
            save(step, state)
            blocked.append(time.perf_counter() - b0)
        for _ in range(every):
            state, _loss_value = trainer.step(state, trainer.x)
            step += 1
    jax.block_until_ready(state)
    return state, time.perf_counter() - t0, blocked


class Manager:
    def __init__(self, parent):
        self.dir = tempfile.mkdtemp(prefix="train_loss_ckpt_mgr_", dir=parent)
        self.mgr = ckpt.CheckpointManager(self.dir, keep=ckpt.KeepLatest(2))

    def save(self, step, state):
        self.mgr.save(step, state)

    def finish(self):
        self.mgr.wait_until_finished()

    def close(self):
        self.mgr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class SaveAsync:
    """Plain `save_async` as a user keeping the newest two steps would run it: each save
    waits for the previous one (committed), then the steps before the newest two are
    deleted on a background thread, as the managers' retention deletes after each commit."""

    KEEP = 2

    def __init__(self, parent):
        self.dir = tempfile.mkdtemp(prefix="train_loss_ckpt_async_", dir=parent)
        self.handle = None
        self.paths: list[str] = []  # saved steps, oldest first; all but the last are committed
        self.deleter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench_delete")
        self.deletions: list[concurrent.futures.Future] = []

    def _delete_old(self):
        while len(self.paths) > self.KEEP:
            self.deletions.append(self.deleter.submit(shutil.rmtree, self.paths.pop(0), ignore_errors=True))

    def save(self, step, state):
        if self.handle is not None:
            self.handle.wait()
            self._delete_old()
        path = f"{self.dir}/{step}"
        self.handle = ckpt.save_async(path, state)
        self.paths.append(path)

    def finish(self):
        if self.handle is not None:
            self.handle.wait()
        self._delete_old()
        for f in self.deletions:
            f.result()
        self.deletions.clear()

    def close(self):
        self.finish()
        self.deleter.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


class Orbax:
    def __init__(self, parent):
        self.dir = tempfile.mkdtemp(prefix="train_loss_orbax_", dir=parent)
        self.mgr = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=2))

    def save(self, step, state):
        self.mgr.save(step, args=ocp.args.StandardSave(state))

    def finish(self):
        self.mgr.wait_until_finished()

    def close(self):
        self.mgr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


BASE, CM, CK, OB = "no checkpoints", "checkpointer CheckpointManager", "checkpointer save_async", "orbax CheckpointManager"


def main() -> None:
    def own(ap):
        ap.add_argument("--every", type=int, default=10, metavar="K", help="training steps per checkpoint (default 10)")
        ap.add_argument("--checkpoints", type=int, default=3, metavar="C", help="checkpoints per loop (default 3)")

    args = C.parse_args(__doc__, own)
    every, checkpoints = args.every, args.checkpoints
    t0, load = time.perf_counter(), C.OtherLoad()
    trainer = Trainer(args.scale)
    state = trainer.fresh_state()
    nbytes = C.logical_bytes(state)
    print(f"devices: {jax.device_count()} × {jax.devices()[0].platform}; state {nbytes / 2**20:.0f} MiB; "
          f"{checkpoints} checkpoints every {every} steps per loop; runs: {args.runs}; warm-up round first", flush=True)
    savers = {BASE: None, CM: Manager(args.dir), CK: SaveAsync(args.dir), OB: Orbax(args.dir)}
    results: dict[str, list[dict]] = {name: [] for name in savers}
    step = 0
    try:
        for run in range(-1, args.runs):  # run -1: warm-up
            names = list(savers)
            k = run % len(names)
            for name in names[k:] + names[:k]:
                saver = savers[name]
                ru0, xla0 = resource.getrusage(resource.RUSAGE_SELF), _xla_thread_cpu_s()
                state, loop_s, blocked = _loop(trainer, state, every, checkpoints,
                                               saver.save if saver is not None else None, step)
                step += every * checkpoints
                if saver is not None:
                    f0 = time.perf_counter()
                    saver.finish()
                    tail_s = time.perf_counter() - f0
                else:
                    tail_s = 0.0
                ru1, xla1 = resource.getrusage(resource.RUSAGE_SELF), _xla_thread_cpu_s()
                xla_s = xla1 - xla0
                other_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime) - xla_s
                faults = ru1.ru_minflt - ru0.ru_minflt
                if run >= 0:
                    results[name].append({"loop": loop_s, "blocked": blocked, "tail": tail_s, "other_cpu": other_s,
                                          "xla_cpu": xla_s, "faults": faults})
                print(f"  run {run if run >= 0 else 'warm-up'}: {name:32s} loop {loop_s:.3f} s, saves blocked "
                      f"{sum(blocked):.3f} s, after the loop {tail_s:.3f} s, CPU: XLA threads {xla_s:.2f} s, "
                      f"other threads {other_s:.2f} s ({ru1.ru_stime - ru0.ru_stime:.2f} s system in all), "
                      f"{faults} page faults", flush=True)
        timeline = _manager_timeline(savers[CM])
    finally:
        for saver in savers.values():
            if saver is not None:
                saver.close()
    text = report(args, results, nbytes, every, checkpoints, time.perf_counter() - t0, load, timeline)
    print("\n" + text)
    C.write_section(args.results, "train_loss_bench", text)


def _manager_timeline(saver) -> str:
    """The manager's last committed saves, summarised from `ckpt.timeline`'s records."""
    from checkpointer._tools import _timeline

    saver.finish()
    phases = _timeline.read_timeline(saver.dir)
    lines = []
    for step in sorted({p.step for p in phases}):
        mine = [p for p in phases if p.step == step]
        s = _timeline.step_summary(mine)
        ph = ", ".join(f"{n} {s.phase_s[n]:.3f} s" for n in _timeline.PHASES if n in s.phase_s)
        lag = "-" if s.commit_lag_s is None else f"{s.commit_lag_s:.3f} s"
        lines.append(f"step {step}: {ph}; commit lag {lag}")
    return "; ".join(lines)


def report(args, results, nbytes, every, checkpoints, wall_s, load, timeline) -> str:
    gib = nbytes / 2**30
    base = [r["loop"] for r in results[BASE]]
    lost = {name: [(r["loop"] - b) / checkpoints for r, b in zip(results[name], base)] for name in (CM, CK, OB)}
    base_other = [r["other_cpu"] for r in results[BASE]]
    base_xla = [r["xla_cpu"] for r in results[BASE]]
    base_faults = [r["faults"] for r in results[BASE]]
    rows = [[BASE, C.fmt(base), "—", "—", "—", f"{statistics.median(base) / (every * checkpoints):.3f} s",
             f"{statistics.median(base_other):.2f} s (loop)", f"{statistics.median(base_xla):.2f} s (loop)",
             f"{statistics.median(base_faults):.0f} (loop)"]]

    def per_ckpt(name, key, base_values):
        return [(r[key] - b) / checkpoints for r, b in zip(results[name], base_values)]

    for name in (CM, CK, OB):
        blocked = [statistics.median(r["blocked"]) for r in results[name]]
        loops = [r["loop"] for r in results[name]]
        rows.append([name, C.fmt(loops), C.fmt(blocked), C.fmt(lost[name]),
                     f"{statistics.median(lost[name]) / gib:.3f} s/GiB", "—",
                     C.fmt(per_ckpt(name, "other_cpu", base_other), digits=2),
                     C.fmt(per_ckpt(name, "xla_cpu", base_xla), digits=2),
                     f"{statistics.median(per_ckpt(name, 'faults', base_faults)):.0f}"])
    main = C.table(["", "loop time", "save() call (per save)", "training time lost per checkpoint",
                    "lost per GiB of state", "step time", "CPU per checkpoint, saving threads",
                    "CPU per checkpoint, XLA threads", "page faults per checkpoint"], rows)
    ob = statistics.median(lost[OB])
    target_rows = []
    for name, short in ((CM, "manager"), (CK, "save_async")):
        med = statistics.median(lost[name])
        r = med / ob if ob > 0 else float("inf")
        target_rows.append([f"checkpointer {short}: lost / orbax lost", f"{r:.2f}×", "≤ 0.5×",
                            "met" if r <= 0.5 else f"missed ({r / 0.5:.2f}× the target)"])
        per_gib = med / gib
        target_rows.append([f"checkpointer {short}: lost per GiB", f"{per_gib:.3f} s", "≤ 0.5 s",
                            "met" if per_gib <= 0.5 else f"missed ({per_gib / 0.5:.2f}× the target)"])
    # CPU per GiB saved above the loop without checkpoints: the saving threads', and the
    # whole process's (saving + XLA threads), each against orbax's measured the same way.
    cpu = {name: {"saving threads": per_ckpt(name, "other_cpu", base_other),
                  "process": [o + x for o, x in zip(per_ckpt(name, "other_cpu", base_other), per_ckpt(name, "xla_cpu", base_xla))]}
           for name in (CM, CK, OB)}
    for name, short in ((CM, "manager"), (CK, "save_async")):
        for what in ("saving threads", "process"):
            mine, theirs = statistics.median(cpu[name][what]) / gib, statistics.median(cpu[OB][what]) / gib
            r = mine / theirs if theirs > 0 else float("inf")
            target_rows.append([f"checkpointer {short}: CPU per GiB saved, {what} / orbax's", f"{r:.2f}×", "≤ 0.3×",
                                ("met" if r <= 0.3 else f"missed ({r / 0.3:.2f}× the target)") + f" ({mine:.2f} vs {theirs:.2f} s/GiB)"])
    targets = C.table(["ratio of medians", "value", "target", ""], target_rows)
    desc = (f"State: {LAYERS} float32 matrices {_shape(0, args.scale)} / {_shape(1, args.scale)} P('data','model') "
            f"on a 2x4 mesh + AdamW moments (optax.adamw) + step: {nbytes / 2**20:.0f} MiB. Training step: "
            f"forward/backward of a {LAYERS}-layer tanh MLP on a batch of {BATCH}, AdamW update, jitted with "
            f"donate_argnums=0. Loop: {checkpoints} × (checkpoint, {every} steps); lost per checkpoint = (loop − "
            "the same run's loop without checkpoints) / "
            f"{checkpoints}. Methods rotated per run, 1 warm-up round. The save() call's time includes waiting for "
            "the training steps dispatched before it (JAX dispatches asynchronously; the snapshot needs their "
            "result) and, when the previous save is still in flight, for that save: the loop time is the figure. "
            "CPU and page faults per checkpoint: user + system CPU seconds (getrusage, and /proc/self/task for "
            "XLA's `tf_XLA*` threads) and minor page faults over the loop and the last save's remaining work, "
            "minus the same run's loop without checkpoints, / the checkpoints. Saving threads: every thread but "
            "XLA's (the saves' snapshot copies, TensorStore's or orbax's writers, Python): what a checkpoint "
            "takes from the 2 cores the training step uses, steadier than wall time on a shared machine. XLA "
            "threads: extra CPU of the training step's threads (spin-waits when they are slowed down).")
    return "\n".join([C.header_lines("Training time lost per checkpoint (`benchmarks/train_loss_bench.py`)", args,
                                     wall_s, load), desc, "", main, "", targets, "",
                      f"The manager's last saves, from `checkpointer timeline` (longest per phase over processes; "
                      "`wait_for_arrays`: the save call waiting for the training steps dispatched before it, which "
                      "run meanwhile; `snapshot`: the host copy that blocks them; commit lag from the copy's end): "
                      f"{timeline}."])


if __name__ == "__main__":
    main()
