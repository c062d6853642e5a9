"""Checkpoint save/restore throughput: t5lite (TensorStore) vs Orbax StandardCheckpointer.

A tree of fp32 arrays (default 1 GiB) sharded over a 2x4 mesh of fake CPU devices is saved and
restored by both libraries in the same run, alternating which goes first. Both saves are timed
from the call to "committed and readable by a new process" (t5lite: `save` + `wait`; Orbax:
`save` + `wait_until_finished`, both with fsync and an atomic rename); both restores from the call
to every shard on device. Raw disk write rate = the same bytes written with plain file writes and
fsync, one array after the other: the reference of the save goal (>= 0.8 of it), since both sides
fsync their files (Orbax through TensorStore's default `file_io_sync`). The blocking part of a
save (the call until it returns, writes still running) is compared with Orbax's; each side keeps
one manager (checkpointer) across repetitions, as a trainer does across saves, and the first
save's blocking time (t5lite: staging into fresh memory) is reported on its own. The blocking
time alone can flatter a save that only defers its copies, so right after each save returns a
jitted step that donates the whole tree (and updates every element, like an optimizer step)
is timed to completion, and compared with the same step with no save in flight (interleaved
in every repetition): "what the train loop loses" is blocking time + the step's extra time.
t5lite is run twice for this: as configured (on CPU `save` dispatches device copies and
returns, see `CheckpointManager(device_copy=...)`) and with `device_copy=False` (`save` copies
to host memory itself), to show whether the cost moved rather than vanished. Page
cache is not dropped (it is shared with other users of the machine): restores read warm files
on both sides alike. After the figures, a table says where t5lite's save spends its time
(staging copies, chunk plans, copies and checksums, writes, fsyncs, commit; medians over
repetitions) with the file and chunk-write counts and the settings that shaped them, and a
second table where its restore does (chunk reads, checksums, copies, device_put, NaN check).

    python benchmarks/checkpoint_io.py [--size_gib 1] [--reps 9] [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import numpy as np
from _record import write_record
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5lite.checkpoint import CheckpointManager, restore_checkpoint

GIB = 1 << 30


def make_tree(size_gib: float) -> dict:
    """fp32 arrays of 64 MiB (or smaller for small sizes), over a 2x4 mesh, mixed layouts."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    total = int(size_gib * GIB)
    cols = 4096 if total >= 16 * 64 * 1024 * 1024 else 512
    rows = 4096 if cols == 4096 else 512
    n = max(1, total // (rows * cols * 4))
    # Fully sharded (2D) params, plus model-sharded ones replicated over `data` as in 1D layouts.
    specs = [P("data", "model"), P("data", "model"), P(None, "model"), P("model", None)]
    tree = {}
    for i in range(n):
        sh = NamedSharding(mesh, specs[i % len(specs)])
        tree[f"layer_{i:02d}"] = {
            "w": jax.make_array_from_callback(
                (rows, cols),
                sh,
                lambda idx, i=i: np.random.default_rng(i).random((rows, cols), np.float32)[idx],
            )
        }
    return tree


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def raw_write(tree, d: Path) -> float:
    """Seconds to write every array's bytes once with plain file I/O and fsync."""
    d.mkdir(parents=True)
    host = [np.asarray(x) for x in jax.tree.leaves(tree)]
    t0 = time.perf_counter()
    for i, a in enumerate(host):
        with open(d / f"{i}.bin", "wb") as f:
            f.write(memoryview(a).cast("B"))
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def make_step(tree):
    """A jitted update of every element that donates the tree, as a train step donates its
    state (its outputs take the inputs' buffers)."""
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    step = jax.jit(
        lambda t: jax.tree.map(lambda x: x * 0.999 + 0.001, t),
        donate_argnums=0,
        out_shardings=shardings,
    )
    return step


def timed_step(step, tree):
    """(seconds until the donating step's outputs are ready, the new tree)."""
    t0 = time.perf_counter()
    out = step(tree)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def snapshot(tree) -> list[np.ndarray]:
    """Host copies of the values a save is expected to hold (the step changes the tree)."""
    return [np.array(x, copy=True) for x in jax.tree.leaves(tree)]


def t5lite_save(mgr: CheckpointManager, tree, step: int, train_step=None):
    """One save of a manager kept across repetitions, as a trainer keeps one across saves;
    with `train_step`, that step runs (donating `tree`) right after `save` returns.

    Returns:
      (save seconds until committed, blocking seconds, step seconds or None, new tree, stats).
    """
    t0 = time.perf_counter()
    mgr.save(step, tree)
    blocking = time.perf_counter() - t0
    step_s = None
    if train_step is not None:
        step_s, tree = timed_step(train_step, tree)
    mgr.wait()
    total = time.perf_counter() - t0
    return total, blocking, step_s, tree, dict(mgr.last_save_stats)


# The save's phases (see `CheckpointManager.last_save_stats`), in the order they happen.
PHASES = [
    ("stage_s", "stage: copies to host, or their dispatch (blocks the trainer)"),
    ("stage_wait_s", "writer waits for the dispatched copies"),
    ("plan_s", "plan: chunk plans, zarr.json files, directories"),
    ("written_s", "chunks copied, checksummed, written, fsynced (wall)"),
    ("prepare_s", "  of which copies + crc32c (thread-summed)"),
    ("write_s", "  of which writev into the page cache (thread-summed)"),
    ("fsync_s", "  of which per-file fsync (thread-summed)"),
    ("dirs_fsync_s", "fsync of the chunk and array directories, parents"),
    ("commit_s", "commit: metadata, COMMIT marker, rename, fsyncs"),
]
COUNTS = ("files", "chunk_writes", "direct_arrays", "tensorstore_arrays", "bytes")


def phase_table(stats: list[dict], size_gib: float) -> dict:
    """Median of each phase over the repetitions, with the counts that explain them."""
    from t5lite.checkpoint import tensorstore_io as tsio

    med = {
        k: statistics.median(s[k] for s in stats) for k, _ in PHASES if all(k in s for s in stats)
    }
    counts = {k: stats[0][k] for k in COUNTS if k in stats[0]}
    print(f"\nt5lite save phases ({size_gib:.3f} GiB, checksums on, medians of {len(stats)}):")
    for k, label in PHASES:
        if k in med:
            print(f"  {label:58s} {med[k]:7.3f} s")
    limits = {
        "chunk_bytes": tsio.DEFAULT_CHUNK_BYTES,
        "writer_threads": tsio.WRITE_THREADS,
        "fsync_order": "each chunk file by the thread that wrote it, then the chunk and array "
        "directories, then their parent, then metadata + COMMIT + rename",
    }
    print(f"  counts {counts}; settings {limits}")
    return {"seconds": {k: round(v, 4) for k, v in med.items()}, **counts, **limits}


# The restore's phases (see `tsio.read_arrays` and `restore_checkpoint`'s `stats`).
RESTORE_PHASES = [
    ("plan_s", "plan: zarr.json files, shard buffers, chunk plans"),
    ("chunks_s", "chunks read in place, checksummed, NaN/Inf-checked (wall)"),
    ("read_s", "  of which preadv from the page cache (thread-summed)"),
    ("crc_s", "  of which crc32c (thread-summed)"),
    ("copy_s", "  of which copies of clipped or padded chunks (thread-summed)"),
    ("finite_s", "  of which NaN/Inf checks of each chunk (thread-summed)"),
    ("cast_s", "cast to the target dtypes"),
    ("device_put_s", "device_put of every shard (one call)"),
    ("finite_check_s", "NaN/Inf verdict (+ jitted check of arrays not checked above)"),
]
RESTORE_COUNTS = ("chunks", "chunks_copied", "direct_arrays", "tensorstore_arrays", "bytes")


def restore_phase_table(stats: list[dict], size_gib: float) -> dict:
    """Median of each restore phase over the repetitions, with the counts."""
    from t5lite.checkpoint import tensorstore_io as tsio

    med = {
        k: statistics.median(s[k] for s in stats)
        for k, _ in RESTORE_PHASES
        if all(k in s for s in stats)
    }
    counts = {k: stats[0][k] for k in RESTORE_COUNTS if k in stats[0]}
    print(f"\nt5lite restore phases ({size_gib:.3f} GiB, checksums on, medians of {len(stats)}):")
    for k, label in RESTORE_PHASES:
        if k in med:
            print(f"  {label:58s} {med[k]:7.3f} s")
    print(f"  counts {counts}; settings {{'reader_threads': {tsio.READ_THREADS}}}")
    return {
        "seconds": {k: round(v, 4) for k, v in med.items()},
        **counts,
        "reader_threads": tsio.READ_THREADS,
    }


def t5lite_restore(target, d: Path, stats: dict | None = None):
    t0 = time.perf_counter()
    out, _ = restore_checkpoint(d, target, with_extra=False, stats=stats)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def orbax_save(ckptr, tree, d: Path, train_step=None):
    """One save of a checkpointer kept across repetitions (like t5lite's manager); with
    `train_step`, that step runs right after `save` returns. Returns (total, blocking, step
    seconds or None, new tree)."""
    t0 = time.perf_counter()
    ckptr.save(d / "1", tree)
    blocking = time.perf_counter() - t0
    step_s = None
    if train_step is not None:
        step_s, tree = timed_step(train_step, tree)
    ckptr.wait_until_finished()
    total = time.perf_counter() - t0
    return total, blocking, step_s, tree


def orbax_restore(target, d: Path):
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    t0 = time.perf_counter()
    out = ckptr.restore(d / "1", target)
    jax.block_until_ready(out)
    elapsed = time.perf_counter() - t0
    ckptr.close()
    return elapsed, out


def readable_by_new_process(d: Path) -> bool:
    """A fresh interpreter opens the committed checkpoint with plain tensorstore."""
    code = (
        "import json,sys,tensorstore as ts;d=sys.argv[1];"
        "m=json.load(open(d+'/metadata.json'));a=next(iter(m['arrays'].values()));"
        "s=ts.open({'driver':'zarr3','kvstore':{'driver':'file','path':d+'/arrays/'+a['dir']}})"
        ".result();print(list(s.shape)==a['shape'])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True)
    return out.stdout.strip() == "True"


def bit_equal(a, expected: list[np.ndarray]) -> bool:
    return all(np.asarray(x).tobytes() == y.tobytes() for x, y in zip(jax.tree.leaves(a), expected))


def figure(name, value, unit, reference=None, goal=None, ratio=None):
    if ratio is None and reference not in (None, 0):
        ratio = value / reference
    met = None
    if goal is not None and ratio is not None:
        met = bool(ratio >= float(goal.split(">=")[1]))
    return {
        "name": name,
        "value": round(value, 4),
        "unit": unit,
        "reference": None if reference is None else round(reference, 4),
        "ratio": None if ratio is None else round(ratio, 3),
        "goal": goal,
        "met": met,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size_gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--smoke", action="store_true", help="tiny tree, 1 repetition (CI)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint_io.json"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_gib, args.reps = 1 / 64, 1
    try:
        import orbax.checkpoint  # noqa: F401

        have_orbax = True
    except ImportError:
        have_orbax = False
        print("orbax-checkpoint not installed (pip install -e .[bench]): t5lite figures only")

    tree = make_tree(args.size_gib)
    size = nbytes(tree) / GIB
    target = abstract(tree)
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_bench_"))
    scratch.mkdir(parents=True, exist_ok=True)
    t: dict[str, list[float]] = {
        k: []
        for k in (
            "raw",
            "ours_save",
            "ours_block",
            "ours_restore",
            "ours_step",
            "host_save",
            "host_block",
            "host_step",
            "nocrc_save",
            "nocrc_block",
            "nocrc_restore",
            "nocrc_step",
            "ob_save",
            "ob_block",
            "ob_restore",
            "ob_step",
            "step_alone",
        )
    }
    checks = {}
    phase_stats: list[dict] = []
    restore_stats: list[dict] = []
    managers = {
        who: CheckpointManager(
            scratch / who, async_save=True, checksum=who != "ours_nocrc", device_copy=who != "host"
        )
        for who in ("ours", "ours_nocrc", "host")
    }
    train_step = make_step(tree)
    # Compile (and warm) the step outside the timed runs.
    tree = jax.block_until_ready(train_step(tree))
    orbax_ckptr = None
    if have_orbax:
        import orbax.checkpoint as ocp

        orbax_ckptr = ocp.StandardCheckpointer()
    try:
        for rep in range(args.reps):
            # Rotate the order so neither side always runs on a warmer (or busier) machine.
            runs = ["ours", "orbax", "alone", "ours_nocrc", "host"]
            runs = runs[rep % 5 :] + runs[: rep % 5]
            for who in runs:
                expected = snapshot(tree) if rep == 0 else None
                if who == "alone":
                    el, tree = timed_step(train_step, tree)
                    t["step_alone"].append(el)
                    continue
                if who in ("ours", "ours_nocrc", "host"):
                    key = {"ours": "ours", "ours_nocrc": "nocrc", "host": "host"}[who]
                    mgr = managers[who]
                    total, block, step_s, tree, stats = t5lite_save(mgr, tree, rep + 1, train_step)
                    d = mgr.step_dir(rep + 1)
                    if who == "ours":
                        phase_stats.append(stats)
                    t[f"{key}_save"].append(total)
                    t[f"{key}_block"].append(block)
                    t[f"{key}_step"].append(step_s)
                    if rep == 0:
                        checks[f"{who}_readable_by_new_process"] = readable_by_new_process(d)
                    if who == "host":  # the same restore code as "ours": not timed again
                        if rep == 0:
                            out, _ = restore_checkpoint(d, target, with_extra=False)
                            checks[f"{who}_bit_exact"] = bit_equal(out, expected)
                            del out
                        shutil.rmtree(d, ignore_errors=True)
                        continue
                    rstats: dict = {}
                    el, out = t5lite_restore(target, d, rstats)
                    if who == "ours":
                        restore_stats.append(rstats)
                    t[f"{key}_restore"].append(el)
                    if rep == 0:
                        checks[f"{who}_bit_exact"] = bit_equal(out, expected)
                    del out
                elif have_orbax:
                    d = scratch / f"orbax_{rep}"
                    total, block, step_s, tree = orbax_save(orbax_ckptr, tree, d, train_step)
                    t["ob_save"].append(total)
                    t["ob_block"].append(block)
                    t["ob_step"].append(step_s)
                    el, out = orbax_restore(target, d)
                    t["ob_restore"].append(el)
                    if rep == 0:
                        checks["orbax_bit_exact"] = bit_equal(out, expected)
                    del out
                else:
                    continue
                shutil.rmtree(d, ignore_errors=True)
            t["raw"].append(raw_write(tree, scratch / f"raw_{rep}"))
            shutil.rmtree(scratch / f"raw_{rep}")
    finally:
        for mgr in managers.values():
            mgr.close()
        if orbax_ckptr is not None:
            orbax_ckptr.close()
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in t.items() if v}
    rate = lambda k: size / med[k]
    ob = have_orbax

    def paired(ours: str, ref: str) -> float | None:
        """Median over repetitions of ref_time / ours_time: robust to load drifting across reps."""
        if not t.get(ref):
            return None
        return statistics.median(r / o for o, r in zip(t[ours], t[ref]))

    def vs_orbax(name: str, key: str, op: str, goal: str | None) -> dict:
        ref = rate(f"ob_{op}") if ob else None
        return figure(
            name, rate(f"{key}_{op}"), "GiB/s", ref, goal, paired(f"{key}_{op}", f"ob_{op}")
        )

    def ratio_of(ours: str, ref: str) -> float | None:
        """Lower is better: median of ref / ours over repetitions (>= 1: not worse)."""
        return statistics.median(r / o for o, r in zip(t[ours], t[ref])) if t[ref] else None

    def lost(key: str) -> float:
        """Median over repetitions of blocking + step after the save - step alone (seconds)."""
        return statistics.median(
            b + s - a for b, s, a in zip(t[f"{key}_block"], t[f"{key}_step"], t["step_alone"])
        )

    def extra(key: str) -> float:
        """Median over repetitions of step after the save - step alone (seconds)."""
        return statistics.median(s - a for s, a in zip(t[f"{key}_step"], t["step_alone"]))

    def loop_ratio(key: str) -> float | None:
        """Orbax's (blocking + step after the save) over `key`'s, median over repetitions: a
        ratio of whole times, not of the differences, which are noisy near zero."""
        if not ob:
            return None
        return statistics.median(
            (rb + rs) / (b + s)
            for b, s, rb, rs in zip(
                t[f"{key}_block"], t[f"{key}_step"], t["ob_block"], t["ob_step"]
            )
        )

    # Blocking time is better when lower: its ratio is Orbax's over ours (>= 1: not worse).
    block_ratio = (
        statistics.median(r / o for o, r in zip(t["ours_block"], t["ob_block"])) if ob else None
    )
    figures = [
        figure(
            "t5lite_save_fraction_of_raw_disk", paired("ours_save", "raw"), "fraction",
            goal=">= 0.8", ratio=paired("ours_save", "raw"),
        ),
        vs_orbax("t5lite_save", "ours", "save", None),
        figure(
            "t5lite_save_blocking", med["ours_block"], "s", med["ob_block"] if ob else None,
            ">= 1.0" if ob else None, block_ratio,
        ),
        # The first save of a manager stages into fresh memory (no buffers to reuse yet).
        figure(
            "t5lite_save_blocking_first", t["ours_block"][0], "s",
            t["ob_block"][0] if ob else None, None,
            t["ob_block"][0] / t["ours_block"][0] if ob else None,
        ),
        # What the train loop loses: from the save call until the donating step after it is
        # done, less the same step with no save in flight (paired within each repetition).
        figure(
            "t5lite_train_loop_loss", lost("ours"), "s", lost("ob") if ob else None,
            ">= 1.0" if ob else None, loop_ratio("ours"),
        ),
        figure("t5lite_step_extra_after_save", extra("ours"), "s", extra("ob") if ob else None),
        figure(
            "t5lite_host_copy_save_blocking", med["host_block"], "s",
            med["ob_block"] if ob else None, None, ratio_of("host_block", "ob_block"),
        ),
        figure(
            "t5lite_host_copy_train_loop_loss", lost("host"), "s", lost("ob") if ob else None,
            None, loop_ratio("host"),
        ),
        figure("step_alone", med["step_alone"], "s"),
        vs_orbax("t5lite_restore", "ours", "restore", ">= 2.0"),
        vs_orbax("t5lite_no_checksum_save", "nocrc", "save", None),
        vs_orbax("t5lite_no_checksum_restore", "nocrc", "restore", None),
        figure("raw_disk_write_fsync", rate("raw"), "GiB/s"),
    ]  # fmt: skip
    if ob:
        figures += [
            figure("orbax_save", rate("ob_save"), "GiB/s", 0.28),
            figure("orbax_restore", rate("ob_restore"), "GiB/s", 0.42),
        ]
    versions = {
        p: importlib.metadata.version(p)
        for p in ("jax", "jaxlib", "tensorstore", "numpy", "orbax-checkpoint")
        if _installed(p)
    }
    record = {
        "benchmark": "checkpoint_io",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"{platform.platform()}; 2x4 mesh of fake CPU devices",
        "versions": versions,
        "notes": "value/reference: medians over repetitions; ratio: median of per-repetition "
        "paired ratios (same repetition, adjacent runs); restores read warm page cache on both "
        "sides; t5lite default stores a crc32c per chunk, Orbax stores none; on CPU Orbax's "
        "blocking part keeps zero-copy np.asarray views of the device buffers, t5lite's "
        "dispatches device copies (host memory on CPU) that the writer waits for, so the next "
        "step may donate the state and waits for the copies instead; train_loop_loss = "
        "blocking + (donating step right after the save - the same step alone), ratio = "
        "Orbax's (blocking + step) over t5lite's; host_copy = t5lite with device_copy=False "
        "(save copies to host itself before returning)",
        "config": {
            "size_gib": round(size, 4),
            "reps": args.reps,
            "arrays": len(jax.tree.leaves(tree)),
        },
        "checks": checks,
        "figures": figures,
    }
    print(f"\ncheckpoint_io: {size:.3f} GiB fp32, {args.reps} reps (medians), checks {checks}")
    print(f"{'name':36s} {'value':>9s} {'unit':8s} {'reference':>9s} {'ratio':>7s} goal")
    for f in figures:
        ref = "" if f["reference"] is None else f"{f['reference']:.3f}"
        ratio = "" if f["ratio"] is None else f"{f['ratio']:.2f}"
        goal = "" if f["goal"] is None else f"{f['goal']} {'met' if f['met'] else 'NOT met'}"
        print(f"{f['name']:36s} {f['value']:9.3f} {f['unit']:8s} {ref:>9s} {ratio:>7s} {goal}")
    record["save_phases"] = phase_table(phase_stats, size)
    record["restore_phases"] = restore_phase_table(restore_stats, size)
    write_record(record, args.out)
    return record


def _installed(p: str) -> bool:
    try:
        importlib.metadata.version(p)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
