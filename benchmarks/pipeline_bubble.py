"""The pipeline bubble as idle time: stage=2 on 2 processes, each pinned to its own CPU core.

benchmarks/pipeline.py puts 8 fake devices on the host's shared cores, so a step's time is the
work of all devices together and the bubble shows only as extra work. Here each of 2 processes
owns one CPU device and one core (`os.sched_setaffinity`, XLA:CPU's Eigen pool off), joined by
`jax.distributed` with gloo collectives into one 2-device mesh: the two stages run truly in
parallel, and a stage waiting on its neighbour is idle time.

On the same 2 processes and the same global batch and model it times, median of `--reps`
rounds (each round one step of every layout, so host load drifts alike over all of them; both
processes start each step together, at a barrier outside the timing):

- the unpipelined step (data=2), against which the losses are checked;
- per pipelined layout (GPipe or 1F1B, stage=2, `m` microbatches):
  - the step, and the share of it process 0 spent off its CPU (`1 - process CPU time /
    wall`: blocked on the other stage) and in the kernel (`os.times().system`: mostly gloo's
    TCP transfers);
  - the stage's program alone: the stage's model (L/2 layers, and the embedding, logits and
    loss every stage computes whole) pipelined with the same schedule and `m` over a `stage`
    axis of one device, this process's (`pipeline.one_stage()`): the same ticks and code
    without the bubble and the transfers (the data=2 step is no stage's work: it runs all
    layers scanned, whose backward costs XLA:CPU more per row than a tick's, and it pays
    gloo gradient all-reduces). 1F1B's drops its schedule's F, whose output goes nowhere at
    one stage: its eval forward less the twin's is added back;
  - the same two programs with the model's twin, whose layers cost next to nothing (one head
    of 8, an MLP of 8) but whose activations, hand-offs, collectives, embedding, logits,
    loss and optimizer are the model's;
  - the bubble of the pipelined layers: `1 - W / S`, `W` the stage's program alone less its
    twin's (the stage's layers alone), `S` the step less the twin's step (the same layers
    pipelined), against the analytic `(p - 1) / (m + p - 1)`. Everything that is not the
    stage's layers (the transfers, the unpipelined embedding, logits and loss, the optimizer,
    the ticks' bookkeeping) cancels. GPipe computes its bubble (stale ticks), so it shows in
    user CPU time too; the idle share of the whole step, transfers in, is beside it.

Every pipelined step's loss is checked against the reference's step for step (same init, same
data, Adam updates): the largest relative difference is a figure whose goal is <= 1e-4.

The workers run with one glibc arena that keeps freed memory (`HOST_MALLOC`): else every step
maps its large temporary buffers afresh and faults them in (`--system_malloc` to see it).

  python benchmarks/pipeline_bubble.py [--smoke] [--reps N] [--microbatches 2 4 8] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _record import write_record  # noqa: E402

PROCESSES = 2  # = stages: one stage (or one data shard) a process, a process a core
BATCH, LENGTH = 32, 64
SMOKE_BATCH, SMOKE_LENGTH = 8, 16
LOSS_RTOL = 1e-4
TOLERANCE = 0.05  # measured idle share within this of the analytic fraction (absolute)
# One thread of compute a process: XLA:CPU's Eigen pool off, so a process's matmuls do not
# spread over threads the pinned core must time-slice anyway.
WORKER_XLA_FLAGS = "--xla_force_host_platform_device_count=1 --xla_cpu_multi_thread_eigen=false"
# glibc serves an allocation above 64 MiB from a thread's own arena with a fresh mmap (an arena
# holds at most 64 MiB), unmapped when freed: XLA:CPU's temporary buffer of a step (199 MiB for
# the reference here) is then faulted in page by page every step, ~51,000 minor faults and about
# a third of the step in the kernel. One arena (the main one, grown by brk) that keeps what is
# freed takes them away; `--system_malloc` measures without (docs/performance.md).
HOST_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
}
# The smoke checks that the benchmark runs and the losses agree, not the times: cheap code
# generation (as `inspect` compiles) keeps its compiles short.
SMOKE_FLAGS = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pinner(core: int):
    """Pins the child (every thread it will start) to `core`, before it execs Python."""
    return lambda: os.sched_setaffinity(0, {core})


def _launch(args: argparse.Namespace, raw: Path) -> tuple[list[int], float]:
    """Runs the 2 worker processes to completion; returns the cores used and the wall time."""
    cores = sorted(os.sched_getaffinity(0))
    picked = [cores[i % len(cores)] for i in range(PROCESSES)]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env.update(
        JAX_PLATFORMS="cpu", XLA_FLAGS=WORKER_XLA_FLAGS + (SMOKE_FLAGS if args.smoke else "")
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if not args.system_malloc:
        env.update(HOST_MALLOC)
    port = _free_port()
    common = [sys.executable, __file__, "--reps", str(args.reps), "--schedules", *args.schedules]
    common += ["--microbatches", *map(str, args.microbatches), "--batch", str(args.batch)] + (
        ["--smoke"] if args.smoke else []
    )
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [*common, "--worker", str(i), "--port", str(port), "--raw", str(raw)],
            env=env,
            preexec_fn=_pinner(picked[i]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    failed = []
    for i, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            sys.exit(f"pipeline_bubble.py: error: worker {i} ran past --timeout={args.timeout} s")
        if p.returncode:
            failed.append((i, p.returncode, err))
    if failed:
        i, rc, err = failed[0]
        sys.stderr.write(err[-3000:])
        sys.exit(f"pipeline_bubble.py: error: worker process {i} exited with {rc} (above)")
    return picked, time.perf_counter() - t0


def _layouts(schedules: list[str], microbatches: list[int]) -> list[tuple[str, int, int]]:
    """(schedule, stages, microbatches): the reference first, then each pipelined layout."""
    pipes = [(s, PROCESSES, m) for s in schedules for m in microbatches]
    return [("none", 1, 1), *pipes]


def _key(schedule: str, m: int) -> str:
    return "reference" if schedule == "none" else f"{schedule}_m{m}"


def _loss(metrics: dict) -> float:
    """The step's mean token loss, from its summable metrics (replicated scalars)."""
    return float(metrics["loss_sum"]) / max(float(metrics["loss_denominator"]), 1.0)


def _twin(config):
    """The same model with layers that cost next to nothing (one head of 8, an MLP of 8): the
    same embedding, logits, loss and activations between the stages, so its pipelined step
    makes the same transfers as the model's."""
    return dataclasses.replace(config, num_heads=1, num_kv_heads=1, head_dim=8, mlp_dim=8)


def _measure(args: argparse.Namespace) -> dict:
    """In each worker: compile every layout, then time `reps` rounds of one step each."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from pipeline import CONFIG, _trainer

    smoke_cfg = dataclasses.replace(
        CONFIG, num_layers=2, emb_dim=32, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64
    )
    config = smoke_cfg if args.smoke else CONFIG
    batch, length = (SMOKE_BATCH, SMOKE_LENGTH) if args.smoke else (args.batch, LENGTH)
    tokens = np.random.default_rng(0).integers(1, config.vocab_size, (batch, length))
    host = {
        "decoder_input_tokens": tokens.astype(np.int32),
        "decoder_target_tokens": np.roll(tokens, -1, 1).astype(np.int32),
        "decoder_loss_weights": np.ones((batch, length), np.float32),
    }
    runs = {}
    for schedule, p, m in _layouts(args.schedules, args.microbatches):
        key = _key(schedule, m)
        for twin in (False, True) if p > 1 else (False,):
            cfg = _twin(config) if twin else config
            tr = _trainer(p, m, batch, length, "gpipe" if p == 1 else schedule, cfg)
            data = tr.global_batch_from_full(host)
            state, met = tr.train_step(tr.init_state(), data)  # compiles
            name = ("twin_" if twin else "") + key
            runs[name] = {"tr": tr, "data": data, "state": state, "loss": [_loss(met)]}
            if p > 1:
                runs[f"alone_{name}"] = _stage_alone(cfg, schedule, m, host)
    # 1F1B's stage alone loses its schedule's F (at one stage its output goes nowhere, and
    # XLA drops it): the stage's forward, its eval forward less the twin's, is added back.
    forwards = [k for k in runs if k.startswith("alone_") and "1f1b" in k]
    times: dict[str, list[float]] = {k: [] for k in (*runs, *(f"forward_{k}" for k in forwards))}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    kernel: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.reps):
        for key, run in runs.items():
            # Both processes start the step together: else a step of process 0 would count
            # process 1 finishing the layout before (a stage alone has no collective to wait on).
            multihost_utils.sync_global_devices(key)
            t0, c0, k0 = time.perf_counter(), time.process_time(), os.times().system
            run["state"], met = run["tr"].train_step(run["state"], run["data"])
            jax.block_until_ready(met)
            times[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
            kernel[key].append(os.times().system - k0)
            run["loss"].append(_loss(met))
        for key in forwards:
            run = runs[key]
            t0 = time.perf_counter()
            jax.block_until_ready(run["tr"].eval_step(run["state"].params, run["data"]))
            times[f"forward_{key}"].append(time.perf_counter() - t0)
    return {
        "times": times,
        "cpu": cpu,
        "kernel": kernel,
        "losses": {
            k: runs[k]["loss"] for k in runs if k.startswith(("reference", "gpipe", "1f1b"))
        },
        "devices": [str(d) for d in jax.devices()],
        "config": dataclasses.asdict(config),
        "batch": batch,
        "length": length,
    }


def _stage_alone(config, schedule: str, m: int, host: dict) -> dict:
    """A stage's busy work: the stage's model (its L/p layers, and the embedding, logits and
    loss every stage computes whole) pipelined over a `stage` axis of one device, this
    process's (`pipeline.one_stage`): the same schedule, `m` microbatches and tick code as the
    stage's, without the other stages, so without bubble or transfers."""
    import jax

    from t5lite import partitioning
    from t5lite.model import optimizers, pipeline
    from t5lite.model.models import DecoderOnlyModel
    from t5lite.trainer import Trainer

    cfg = dataclasses.replace(
        config,
        num_layers=config.num_layers // PROCESSES,
        pipeline_microbatches=m,
        pipeline_schedule=schedule,
    )
    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh((1, 1, 1), ("stage", "data", "model"), auto, devices=jax.local_devices())
    rules = partitioning.pipeline_rules("megatron")  # as benchmarks/pipeline.py's stages
    rows, length = host["decoder_input_tokens"].shape
    tr = Trainer(
        DecoderOnlyModel(cfg, optimizer=optimizers.AdamW(1e-3)),
        partitioning.Partitioner(mesh, logical_axis_rules=rules),
        batch_size=rows,
        lengths={"targets": length},
    )
    data = tr.global_batch(host)  # the mesh is this process's device: every row is its own
    with pipeline.one_stage():
        state, met = tr.train_step(tr.init_state(), data)  # compiles
        jax.block_until_ready(tr.eval_step(state.params, data))  # its forward pass too
    return {"tr": tr, "data": data, "state": state, "loss": [_loss(met)]}


def _worker(args: argparse.Namespace) -> None:
    from t5lite import distributed

    distributed.initialize(f"127.0.0.1:{args.port}", PROCESSES, args.worker)
    raw = _measure(args)
    raw["affinity"] = sorted(os.sched_getaffinity(0))
    if args.worker == 0:
        Path(args.raw).write_text(json.dumps(raw))


def _figures(raw: dict) -> tuple[list[dict], list[tuple]]:
    """Bubbles against the analytic fraction, and the losses against the reference's."""
    med = {k: statistics.median(v) for k, v in raw["times"].items()}
    ref_loss = raw["losses"]["reference"]
    figures, rows, worst = [], [], 0.0
    for key, losses in raw["losses"].items():
        if key == "reference":
            continue
        schedule, m = key.split("_m")[0], int(key.split("_m")[1])
        p = PROCESSES
        analytic = (p - 1) / (m + p - 1)
        # The stage's layers alone (its program less its twin's: the embedding, logits, loss,
        # optimizer and tick bookkeeping cancel), pipelined and not; the rest is neither
        # pipelined nor the bubble's.
        work = med[f"alone_{key}"] - med[f"alone_twin_{key}"]
        if schedule == "1f1b":
            forward = med[f"forward_alone_{key}"] - med[f"forward_alone_twin_{key}"]
            work += forward
            # At p = 2 the last stage's schedule F feeds nothing (no permute on odd half-ticks;
            # the loss came from the forward pass) and XLA drops it: the schedule's first and
            # last pairs of half-ticks lose a microbatch's forward each (docs/pipeline.md).
            # The stage time is then T/m W - 2 F/m, whose idle share is the schedule's own.
            T = m + p - 1
            analytic = 1 - work / (T / m * work - 2 * forward / m)
        staged = med[key] - med[f"twin_{key}"]
        transfers = med[f"twin_{key}"] - med[f"alone_twin_{key}"]
        idle = 1 - med[f"alone_{key}"] / med[key]
        bubble = 1 - work / staged
        waiting, kernel = _waiting(raw, key), _kernel(raw, key)
        # GPipe computes its bubble (stale ticks): in user CPU time it is the analytic share
        # of the stage's own, transfers or not. 1F1B idles in it, off the CPU.
        computed = None
        if schedule == "gpipe":
            user_work = _user(raw, f"alone_{key}") - _user(raw, f"alone_twin_{key}")
            computed = 1 - user_work / (_user(raw, key) - _user(raw, f"twin_{key}"))
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_loss))
        worst = max(worst, diff)
        row = (schedule, m, med[key], work, staged, transfers, idle, bubble, computed, waiting)
        rows.append((*row, kernel, analytic, diff))
        figures.append(
            {
                "name": f"{schedule}_idle_share_stage{p}_m{m}",
                "value": round(bubble, 4),
                "unit": "fraction of the stage's layers' time",
                "reference": round(analytic, 4),
                "textbook_reference": round((p - 1) / (m + p - 1), 4),
                "ratio": round(staged / work, 4),
                "goal": f"|value - reference| <= {TOLERANCE}",
                "met": bool(abs(bubble - analytic) <= TOLERANCE),
                # Microseconds: a smoke run's steps take milliseconds, where 4 decimals of a
                # second would leave the ratio 1% from its own figures.
                "step_s": round(med[key], 6),
                "busy_work_s": round(work, 6),
                "pipelined_layers_s": round(staged, 6),
                "transfers_s": round(transfers, 6),
                "idle_share_with_transfers": round(idle, 4),
                "bubble_in_user_cpu_time": None if computed is None else round(computed, 4),
                "waiting_share": round(waiting, 4),
                "kernel_share": round(kernel, 4),
            }
        )
    figures.append(
        {
            "name": "loss_max_relative_difference",
            "value": float(f"{worst:.3g}"),
            "unit": "relative",
            "reference": 0.0,
            "ratio": None,
            "goal": f"<= {LOSS_RTOL}",
            "met": bool(worst <= LOSS_RTOL),
        }
    )
    return figures, rows


def _waiting(raw: dict, key: str) -> float:
    """The share of a step process 0 spent off the CPU (median over the steps): waiting on its
    neighbour's collectives. What its stage computes in the bubble (GPipe's ticks on a stale
    buffer, the forward pass of 1F1B) is on the CPU, so this is not the idle share."""
    pairs = zip(raw["cpu"][key], raw["times"][key])
    return 1 - statistics.median(c / t for c, t in pairs)


def _user(raw: dict, key: str) -> float:
    """Process 0's user CPU time a step (median): its computation (gloo's copies included)."""
    return statistics.median(c - k for c, k in zip(raw["cpu"][key], raw["kernel"][key]))


def _kernel(raw: dict, key: str) -> float:
    """The share of a step process 0 spent in the kernel (median over the steps): on CPU, gloo's
    TCP transfers of the collectives (the busy work, which has none, spends about 0)."""
    return statistics.median(k / t for k, t in zip(raw["kernel"][key], raw["times"][key]))


def _print(raw: dict, rows: list[tuple]) -> None:
    med = {k: statistics.median(v) for k, v in raw["times"].items()}
    print(f"unpipelined (data=2): {1e3 * med['reference']:.1f} ms/step")
    print(
        f"{'schedule':>8} {'m':>3} {'ms/step':>9} {'layers':>7} {'staged':>7} {'transfers':>9}"
        f" {'idle':>7} {'bubble':>7} {'user CPU':>8} {'analytic':>8} {'waiting':>7} {'kernel':>7}"
        f" {'loss rel diff':>13}"
    )
    for row in rows:
        schedule, m, t, work, staged, xfer, idle, bubble, computed, waiting = row[:10]
        kernel, analytic, diff = row[10:]
        cpu = "-" if computed is None else f"{computed:.1%}"
        print(
            f"{schedule:>8} {m:>3} {1e3 * t:>9.1f} {1e3 * work:>7.1f} {1e3 * staged:>7.1f}"
            f" {1e3 * xfer:>9.1f}"
            f" {idle:>7.1%} {bubble:>7.1%} {cpu:>8} {analytic:>8.1%} {waiting:>7.1%}"
            f" {kernel:>7.1%} {diff:>13.2e}"
        )


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, GPipe m=2, 2 repetitions")
    ap.add_argument("--schedules", nargs="+", choices=["gpipe", "1f1b"], default=None)
    ap.add_argument("--reps", type=int, default=11, help="timed rounds (median)")
    ap.add_argument("--microbatches", type=int, nargs="+", default=None, help="default 2 4 8")
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch (rows of 64 tokens)")
    ap.add_argument(
        "--timeout", type=int, default=600, help="seconds before the workers are killed"
    )
    ap.add_argument(
        "--system_malloc",
        action="store_true",
        help="leave glibc's allocator as it is (each step's large buffers mmapped afresh)",
    )
    ap.add_argument("--out", default="benchmarks/results/pipeline_bubble.json")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--raw", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.schedules is None:
        args.schedules = ["gpipe"] if args.smoke else ["gpipe", "1f1b"]
    if args.microbatches is None:
        args.microbatches = [2] if args.smoke else [2, 4, 8]
    if args.smoke:
        args.reps = min(args.reps, 2)
    if args.worker is not None:
        _worker(args)
        return None
    bad = [m for m in args.microbatches if m < PROCESSES or args.batch % m]
    if bad or args.reps < 1 or args.batch % PROCESSES:
        what = f"--microbatches {bad[0]}" if bad else f"--reps {args.reps}"
        what = what if bad or args.reps < 1 else f"--batch {args.batch}"
        sys.exit(
            f"pipeline_bubble.py: error: {what}: need microbatches >= {PROCESSES} that divide"
            f" --batch {args.batch}, a batch even, reps >= 1"
        )
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        cores, wall = _launch(args, raw_path)
        raw = json.loads(raw_path.read_text())
    return _record(args, raw, cores, wall)


def _record(args: argparse.Namespace, raw: dict, cores: list[int], wall: float) -> dict:
    import flax
    import jax

    figures, rows = _figures(raw)
    record = {
        "benchmark": "pipeline_bubble",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"{PROCESSES} processes x 1 CPU device, pinned to cores {cores}",
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "flax": flax.__version__,
        },
        "settings": {
            "reps": args.reps,
            "smoke": args.smoke,
            "schedules": args.schedules,
            "microbatches": args.microbatches,
            "batch": raw["batch"],
            "length": raw["length"],
            "config": raw["config"],
            "malloc": "system" if args.system_malloc else HOST_MALLOC,
            "load_average_after": list(os.getloadavg()),
            "wall_s": round(wall, 1),
            "xla_flags": WORKER_XLA_FLAGS,
        },
        "seconds": raw["times"],
        "cpu_seconds": raw["cpu"],
        "kernel_seconds": raw["kernel"],
        "losses": raw["losses"],
        "figures": figures,
    }
    _print(raw, rows)
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
