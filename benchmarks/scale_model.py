"""A 1,000-host save and restore on paper, computed by the library's own planners.

No devices and no disk: the state is a tree of `jax.ShapeDtypeStruct`s over
`jax.sharding.AbstractMesh`es. The save side is `checkpointer.plan_save` (the planner
every process runs inside `save`); the restore side is the restore planner
(`_restore_plan.plan_leaf`) on the manifest the save would write, for a sample of
processes. Prints the markdown of docs/SCALE.md.

    PYTHONPATH=. python benchmarks/scale_model.py > docs/SCALE.md

State: Llama-2-70B (Hugging Face `LlamaForCausalLM` parameter shapes: 80 layers, hidden
8192, MLP 28672, 64 query / 8 key-value heads of 128, vocabulary 32000) as bfloat16
parameters plus AdamW's two float32 moments and an int32 step count.
"""

from __future__ import annotations

import argparse
import math
import resource
import time

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._format import _json, _layout, _units
from checkpointer._format._box import Box
from checkpointer._format._leaves import ArrayMetadata, SavedSharding
from checkpointer._format._manifest import manifest_json
from checkpointer._format._records import ChunkRecord, ProcessRecord
from checkpointer._format._tree import flatten
from checkpointer._restore._plan import plan_leaf
from checkpointer._restore._targets import named_shard_boxes
from checkpointer._save._plan import LeafAssignment

GiB = 1 << 30
HIDDEN, MLP, LAYERS, VOCAB, KV = 8192, 28672, 80, 32000, 1024


def llama70b_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, as in the Hugging Face checkpoint of Llama-2-70B."""
    shapes: dict[str, tuple[int, ...]] = {"model/embed_tokens/weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model/layers/{i}"
        shapes.update({
            f"{p}/self_attn/q_proj/weight": (HIDDEN, HIDDEN),
            f"{p}/self_attn/k_proj/weight": (KV, HIDDEN),
            f"{p}/self_attn/v_proj/weight": (KV, HIDDEN),
            f"{p}/self_attn/o_proj/weight": (HIDDEN, HIDDEN),
            f"{p}/mlp/gate_proj/weight": (MLP, HIDDEN),
            f"{p}/mlp/up_proj/weight": (MLP, HIDDEN),
            f"{p}/mlp/down_proj/weight": (HIDDEN, MLP),
            f"{p}/input_layernorm/weight": (HIDDEN,),
            f"{p}/post_attention_layernorm/weight": (HIDDEN,),
        })
    shapes["model/norm/weight"] = (HIDDEN,)
    shapes["lm_head/weight"] = (VOCAB, HIDDEN)
    return shapes


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """FSDP: the first dimension the fsdp axis divides is sharded; the data axis replicates."""
    for d, n in enumerate(shape):
        if n % fsdp == 0:
            return P(*([None] * d + ["fsdp"]))
    return P()


def state(mesh: AbstractMesh) -> dict:
    fsdp = mesh.shape["fsdp"]

    def leaf(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, fsdp_spec(shape, fsdp)))

    shapes = llama70b_shapes()
    return {
        "params": {k: leaf(s, jax.numpy.bfloat16) for k, s in shapes.items()},
        "opt": {
            "mu": {k: leaf(s, np.float32) for k, s in shapes.items()},
            "nu": {k: leaf(s, np.float32) for k, s in shapes.items()},
            "count": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P())),
        },
    }


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fmt(n: float) -> str:
    return _units.format_bytes(int(n))


def save_side(mesh: AbstractMesh, processes: int):
    tree = state(mesh)
    rss0 = _rss_mib()
    t0 = time.perf_counter()
    plan = ckpt.plan_save(tree, processes=processes)
    plan_s = time.perf_counter() - t0
    return tree, plan, plan_s, _rss_mib() - rss0


def manifest_bytes(plan: ckpt.SavePlan, tree: dict, mesh: AbstractMesh) -> tuple[int, dict[str, ArrayMetadata]]:
    dtypes = {path: np.dtype(leaf.dtype) for path, leaf in flatten(tree)}
    metas = {}
    for a in plan.leaves:
        saved = SavedSharding("named", tuple(mesh.axis_names), tuple(mesh.axis_sizes), (), a.chunk_shape, math.prod(mesh.axis_sizes))
        dtype = dtypes[a.leaf_path]
        metas[a.leaf_path] = ArrayMetadata(a.leaf_path, a.shape, dtype, a.chunk_shape, a.inner_chunk_shape, saved, None, "jax")
    doc = manifest_json(
        step=100000, generation="20261130T000000Z-0000000000000000", process_count=plan.process_count,
        process_bytes_written=[p.bytes_written for p in plan.processes], structure={}, arrays=list(metas.values()),
        values={}, user_metadata={},
    )
    return len(_json.dumps(doc)), metas


def record_bytes(plan: ckpt.SavePlan, metas: dict[str, ArrayMetadata], pidx: int) -> int:
    chunks = []
    for a in plan.leaves:
        m = metas[a.leaf_path]
        for p, w in a.writes:
            if p == pidx:
                chunks.append(ChunkRecord(
                    leaf=a.leaf_path, key=_layout.chunk_key(a.leaf_path, w.chunk_index), box=w.box,
                    file_bytes=m.layout.file_bytes,
                    data_bytes=w.box.size * m.dtype.itemsize, data_crc32c=0xFFFFFFFF,
                ))
    rec = ProcessRecord(process_index=pidx, generation="g", chunks=tuple(chunks), bytes_written=0, snapshot_s=0.0, write_s=0.0)
    return len(_json.dumps(rec.to_json()))


def restore_side(plan: ckpt.SavePlan, metas: dict[str, ArrayMetadata], target_mesh: AbstractMesh, processes: int, sample: list[int]):
    """Per sampled process: bytes needed, bytes read from storage, files opened (real planner)."""
    n = math.prod(target_mesh.axis_sizes)
    per = n // processes
    fsdp = target_mesh.shape["fsdp"]
    out = {}
    t0 = time.perf_counter()
    for pidx in sample:
        positions = range(pidx * per, (pidx + 1) * per)
        needed = read = files = 0
        cache: dict = {}
        for m in metas.values():
            spec = fsdp_spec(m.shape, fsdp) if m.shape else P()
            key = (m.shape, m.dtype, m.chunk_shape, m.inner_chunk_shape, spec)
            if key not in cache:
                boxes = named_shard_boxes(m.shape, target_mesh.shape, spec, positions)
                lp = plan_leaf(m, list(zip(positions, boxes)))
                cache[key] = (lp.bytes_needed, lp.bytes_read, sum(len(b.reads) for b in lp.boxes))
            nd, rd, fl = cache[key]
            needed, read, files = needed + nd, read + rd, files + fl
        out[pidx] = (needed, read, files)
    return out, (time.perf_counter() - t0) / len(sample)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write-gbps", type=float, default=2.0, help="per-host storage write bandwidth, GB/s")
    ap.add_argument("--read-gbps", type=float, default=4.0, help="per-host storage read bandwidth, GB/s")
    ap.add_argument("--storage-tbps", type=float, default=1.0, help="the storage's aggregate bandwidth, TB/s")
    ap.add_argument("--net-gbps", type=float, default=25.0, help="per-host interconnect bandwidth for the exchange, GB/s")
    args = ap.parse_args()
    save_procs, dp, fsdp = 1024, 32, 256
    save_mesh = AbstractMesh((dp, fsdp), ("data", "fsdp"))
    tree, plan, plan_s, plan_mib = save_side(save_mesh, save_procs)
    leaves = len(plan.leaves)
    state_bytes = plan.data_bytes
    written = [p.bytes_written for p in plan.processes]
    files = [p.files for p in plan.processes]
    mbytes, metas = manifest_bytes(plan, tree, save_mesh)
    sample = [0, 1, 511, 1023]
    rec = {p: record_bytes(plan, metas, p) for p in sample}
    splits: dict[str, int] = {}
    for a in plan.leaves:
        k = f"split x{a.split_factor}" if a.split_factor > 1 else "whole boxes"
        splits[k] = splits.get(k, 0) + 1
    mean = sum(written) / save_procs
    one_writer = _one_writer_bytes(plan)

    L = []
    w = L.append
    w("# A 70B model on 1,024 hosts, computed by the planners\n")
    w("Produced by `benchmarks/scale_model.py` (no devices, no disk): the save side is")
    w("`checkpointer.plan_save`, the planner every process runs inside `save`; the restore side")
    w("is the restore planner (`_restore_plan.plan_leaf`) run on the chunk grid that save writes.\n")
    w("## The state and the meshes\n")
    w(f"- Llama-2-70B parameter shapes (Hugging Face `LlamaForCausalLM`: {LAYERS} layers, hidden {HIDDEN}, MLP {MLP},")
    w(f"  8 KV heads, vocabulary {VOCAB}): {sum(math.prod(s) for s in llama70b_shapes().values()) / 1e9:.2f} B parameters;")
    w("  bfloat16 parameters + float32 AdamW `mu` and `nu` + an int32 count:")
    w(f"  {leaves} array leaves, {state_bytes / 1e9:.1f} GB ({_fmt(state_bytes)}).")
    w(f"- Save: {save_procs} processes x 8 devices, mesh `data={dp} x fsdp={fsdp}` (FSDP over 32 hosts, data")
    w("  parallel over 32 such groups); each leaf `P('fsdp')` on its first dimension 256 divides,")
    w("  so each saved shard is held by the 32 processes of its data-parallel group (R = 32).")
    w("- Restore onto 512 x 8 (`data=16 x fsdp=256`) and 2,048 x 8 (`data=64 x fsdp=256`), same specs.")
    w("- Devices belong to processes in mesh order, 8 consecutive devices each (the rule of")
    w("  `plan_save`/`plan_restore` with `processes=P`).\n")
    w("## Save (exact, every process)\n")
    w("| quantity | value |")
    w("|---|---|")
    w(f"| bytes written per process: min / mean / max | {_fmt(min(written))} / {_fmt(mean)} / {_fmt(max(written))} |")
    w(f"| largest process over the mean | {max(written) / mean:.4f} |")
    w(f"| without replica-parallel writes (replica 0 writes): max per process | {_fmt(max(one_writer))} on {sum(1 for b in one_writer if b)} of {save_procs} processes |")
    w(f"| chunk files per process: min / max | {min(files)} / {max(files)} |")
    w(f"| chunk files in the checkpoint | {sum(files):,} |")
    w(f"| leaves by split rule | {', '.join(f'{v} {k}' for k, v in sorted(splits.items()))} |")
    w(f"| sum of bytes written / state bytes | {sum(written) / state_bytes:.5f} (zarr shard indexes) |")
    w(f"| manifest.json | {_fmt(mbytes)} |")
    w(f"| processes/<i>.json (processes {', '.join(map(str, sample))}) | {', '.join(_fmt(rec[p]) for p in sample)} |")
    w(f"| planner time per process (the whole tree, every process's chunks) | {plan_s:.1f} s |")
    w(f"| planner memory (peak RSS growth) | {plan_mib:.0f} MiB |")
    w("")
    w("Coordination-service keys per save (`_agreement`, `_distributed`): one proposal per process")
    w("and a verdict (agreement), one done report per process and one commit announcement:")
    w(f"2P + 2 = {2 * save_procs + 2:,} keys. Round trips: each process sets 2 keys and blocks on 3")
    w("(verdict, process 0's report, the announcement); process 0 polls the done directory")
    w(f"(`key_value_dir_get`, up to {save_procs} entries per poll, backing off to 0.1 s) and then stats")
    w(f"{save_procs} `processes/<i>.json` files one after another before it writes the manifest.\n")

    w("## Restore (exact for processes 0, 1, P/2 and P-1; the others are identical by symmetry)\n")
    w("| target | process | bytes needed | read from storage (today: every process reads its boxes) | files opened | cooperative restore (item 2, by formula: 1/P of the state read): read / received from peers |")
    w("|---|---|---|---|---|---|")
    restore_rows = {}
    for procs, data in ((512, 16), (2048, 64)):
        mesh = AbstractMesh((data, fsdp), ("data", "fsdp"))
        samp = [0, 1, procs // 2, procs - 1]
        res, per_s = restore_side(plan, metas, mesh, procs, samp)
        restore_rows[procs] = (res, per_s)
        for p in samp:
            needed, read, fl = res[p]
            coop_read = state_bytes / procs
            w(f"| {procs} x 8 | {p} | {_fmt(needed)} | {_fmt(read)} | {fl:,} | {_fmt(coop_read)} / {_fmt(max(0, needed - coop_read))} |")
    w("")
    w("Totals by formula: without cooperation every process of a data-parallel group reads the")
    w(f"group's {_fmt(state_bytes / (fsdp // 8))} (1/{fsdp // 8} of the state), so the job reads `data` x the state:")
    for procs, data in ((512, 16), (2048, 64)):
        w(f"{data} x {state_bytes / 1e9:.0f} GB = {data * state_bytes / 1e12:.1f} TB onto {procs} x 8;")
    w("with the cooperative restore of issue 12 item 2 it reads the state once and the rest moves over the interconnect.")
    w(f"Restore planning per process took {restore_rows[512][1]:.2f} s (512 x 8) and {restore_rows[2048][1]:.2f} s (2,048 x 8).\n")

    agg = args.storage_tbps * 1e12
    w(f"## Projected times (per host: write {args.write_gbps:g} GB/s, read {args.read_gbps:g} GB/s; storage aggregate {args.storage_tbps:g} TB/s; interconnect {args.net_gbps:g} GB/s per host)\n")
    w("Each time is the larger of the busiest host's bytes over its bandwidth and the job's bytes over")
    w("the storage's aggregate bandwidth (the exchange of a cooperative restore runs at interconnect speed).\n")
    save_s = max(max(written) / (args.write_gbps * 1e9), sum(written) / agg)
    old_s = max(max(one_writer) / (args.write_gbps * 1e9), sum(one_writer) / agg)
    w(f"- Save: the busiest process writes {_fmt(max(written))}, the job {sum(written) / 1e12:.2f} TB: **{save_s:.1f} s**.")
    w(f"  With replica 0 writing alone: {_fmt(max(one_writer))} on one process of each group: {old_s:.1f} s.")
    for procs in (512, 2048):
        res, _ = restore_rows[procs]
        needed, read, _ = res[0]
        alone = max(read / (args.read_gbps * 1e9), read * procs / agg)
        coop = max(state_bytes / procs / (args.read_gbps * 1e9), state_bytes / agg) + max(0, needed - state_bytes / procs) / (args.net_gbps * 1e9)
        w(f"- Restore onto {procs} x 8: every process reads {_fmt(read)}, the job {read * procs / 1e12:.1f} TB: **{alone:.1f} s**;")
        w(f"  cooperative: {_fmt(state_bytes / procs)} read per process ({state_bytes / 1e12:.2f} TB in all) + {_fmt(needed - state_bytes / procs)} received: **{coop:.1f} s**.")
    w("")
    w("## Where the design stops scaling, and the next step\n")
    w("- **The save planner on every process.** Each process plans every process's chunks of the whole")
    w(f"  tree ({plan_s:.1f} s, {plan_mib:.0f} MiB here, in Python): it grows with leaves x boxes x split factor.")
    w("  `save` keeps the plan while the tree's shardings stay the same, so a training loop pays it at")
    w("  its first save only (in the blocking snapshot phase). Next: plan only the boxes of this")
    w("  process's holder sets (the greedy is independent per disjoint holder set), or in C++/numpy.")
    w(f"- **Process 0's commit.** It polls {save_procs} done keys and stats {save_procs} record files one by one,")
    w("  then writes one manifest: at ~5 ms per stat on a parallel file system (more on an object store)")
    w(f"  that is ~{save_procs * 0.005:.0f} s of serial work per save. Next: let each done report carry its record's")
    w("  size and crc32c, and check the record files in parallel, or only at `verify`.")
    w(f"- **File count.** {sum(files):,} chunk files per checkpoint: small per-shard files (FSDP over {fsdp} devices")
    w("  makes 0.5-4 MiB shards) stress metadata servers and object-store request rates more than bytes.")
    w("  Chunks of at most 256 KiB (the norms' shards) are already packed, one `packed/process-<i>` file")
    w("  per process. Next: a coarser chunk grid than the saved shard (several shards of one leaf per")
    w("  file, when one process holds them), or a higher packing threshold for object stores.")
    w(f"- **The manifest** ({_fmt(mbytes)}) and the per-process records scale with leaves and chunks, not hosts;")
    w("  every restoring process reads the manifest: 2,048 reads of one object at start-up.")
    w("  Next: read it on one process and broadcast it over the coordination service or the interconnect.")
    w("- **Restore without cooperation** reads `data` x the state from storage; that is the")
    w("  bottleneck at this scale, which item 2 (cooperative restore) removes.")
    w("")
    w("---")
    w("Regenerate: `PYTHONPATH=. python benchmarks/scale_model.py > docs/SCALE.md` (options: `--write-gbps`,")
    w("`--read-gbps`, `--storage-tbps`, `--net-gbps`). Planner times are of one Python process on a")
    w("2-core machine shared with other jobs; between runs they varied from 11 to 31 s with the load.")
    print("\n".join(L))


def _one_writer_bytes(plan: ckpt.SavePlan) -> list[int]:
    """Bytes per process if every box were written by its lowest holder (release 0.1):
    the same plan with the split floor above every leaf and only the lowest holder."""
    out = [0] * plan.process_count
    for a in plan.leaves:
        for box in {wr.shard_box or wr.box for _, wr in a.writes}:
            out[_lowest_holder(a, box)] += box.size * a.itemsize
    return out


def _lowest_holder(a: LeafAssignment, box: Box) -> int:
    # Boxes are held by the processes of one data-parallel group; the data axis is the
    # outer mesh axis, so its lowest member is the process with data coordinate 0:
    # the fsdp block of the box (origin / shard length) over 8 devices per process.
    dim = next((d for d, (c, s) in enumerate(zip(box.shape, a.shape)) if c < s), None)
    if dim is None:
        return 0
    shard = box.shape[dim]
    return (box.origin[dim] // shard) // 8


if __name__ == "__main__":
    main()
