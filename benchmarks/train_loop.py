"""Train-loop overhead: `t5lite train` on the quickstart model vs its bare jitted step.

`loop`  `t5lite train --gin_file=quickstart.gin` run in this process (the CLI's own `main`), on
        8 fake CPU devices (data=2 x model=4, Megatron rules): data pipeline, metrics read
        back, checks, logs, watchdog. Timed from the report of step `--warmup` to the report
        of the last step, from the loop's own `step_time_s` in `metrics.jsonl` (the final
        checkpoint and the evaluation come after the last report and are left out; periodic
        saves are off).
`bare`  the same compiled `train_step` (the very function the loop ran) over the same global
        batches, already on the devices, dispatched back to back (waiting only for step N-1
        once step N is queued): what the device needs, with nothing of the host's in between.
`sync`  (for reference) the bare step with every step's metrics fetched to the host before the
        next dispatch: what a loop that reads each step's metrics at once costs.

Rounds alternate which side runs first; figures are medians over rounds, the ratio the median of
per-round ratios. Goal (issue 20): loop step time <= 1.03x the bare step.

`host ms/step` is the CPU time of the Python thread that dispatches the steps, per timed step
(`time.thread_time` between the dispatches of step `--warmup + 1` and of the last step; around
the timed steps for `bare` / `sync`). On a CPU host the devices run on the same cores, so the
loop's extra host time is its overhead; unlike step times it barely moves when other processes
load the machine. `process ms/step` is the CPU time of all the process's threads over the same
steps (the devices' compute, the data pipeline's and the log writer's included): the loop's
overhead on every thread, where the bare step's figure is what the devices need.

    python benchmarks/train_loop.py [--steps 200] [--reps 5] [--quick] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
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
from _record import write_record

import t5lite.programs.train as train_program
from t5lite.cli import main as cli
from t5lite.trainer import Trainer

GOAL = 1.03  # loop step time over the bare step


class _RecordingTrainer(Trainer):
    """The loop's own Trainer, remembered with the global batches it built, so the bare side runs
    the same compiled step on the same batches."""

    last: _RecordingTrainer | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[dict[str, jax.Array]] = []
        self.train_step = _ThreadTimed(self.train_step)
        _RecordingTrainer.last = self

    def global_batch(self, local_batch):
        out = super().global_batch(local_batch)
        self.batches.append(out)
        return out


class _ThreadTimed:
    """The train step, noting this thread's and the process's CPU time at every dispatch."""

    def __init__(self, fn):
        self._fn = fn
        self.cpu: list[float] = []
        self.process_cpu: list[float] = []

    def __call__(self, *args):
        self.cpu.append(time.thread_time())
        self.process_cpu.append(time.process_time())
        return self._fn(*args)

    def __getattr__(self, name):  # lower / compile, as the partitioned function has them
        return getattr(self._fn, name)


def run_loop(steps: int, warmup: int, scratch: Path, run: int) -> tuple[float, float, float]:
    """Seconds per step of `t5lite train` after `warmup` steps (a fresh model directory), and
    the dispatching thread's and the process's CPU seconds per step over the same steps."""
    import gin

    model_dir = scratch / f"loop_{run}"
    with gin.unlock_config():
        gin.clear_config()
    rc = cli.main([
        "train", "--gin_file=quickstart.gin", f"--gin.MODEL_DIR='{model_dir}'",
        f"--gin.TRAIN_STEPS={steps}", "--gin.CheckpointConfig.period=0",
        "--gin.train.evaluation=None",
        # The quickstart's schedule, fitted to a short run (its warm-up is 50 steps).
        f"--gin.warmup_cosine_schedule.warmup_steps={min(50, steps // 2)}",
    ])  # fmt: skip
    if rc != 0:
        raise SystemExit(f"t5lite train failed with exit code {rc}")
    with open(model_dir / "metrics.jsonl") as f:
        times = {r["step"]: r["step_time_s"] for r in map(json.loads, f) if r["split"] == "train"}
    assert sorted(times) == list(range(1, steps + 1)), sorted(times)[:5]
    timed = _RecordingTrainer.last.train_step  # type: ignore[union-attr]
    cpu, process_cpu = timed.cpu, timed.process_cpu
    assert len(cpu) == steps, len(cpu)
    seconds = sum(times[s] for s in range(warmup + 1, steps + 1)) / (steps - warmup)
    n = steps - 1 - warmup
    return seconds, (cpu[-1] - cpu[warmup]) / n, (process_cpu[-1] - process_cpu[warmup]) / n


def run_bare(trainer: Trainer, warmup: int, sync: bool) -> tuple[float, float, float]:
    """Seconds per step of the loop's compiled step over its batches `warmup + 1` onwards, and
    this thread's and the process's CPU seconds per step."""
    state = trainer.init_state()
    batches = trainer.batches[: len(trainer.batches)]
    for b in batches[:warmup]:
        state, m = trainer.train_step(state, b)
    jax.block_until_ready((state, m))
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    for b in batches[warmup:]:
        prev = m
        state, m = trainer.train_step(state, b)
        # At most two steps in flight, as in the loop: the next one always queued behind the
        # running one. (Hundreds queued on 8 fake CPU devices of a starved host have tripped
        # XLA's 40 s collective rendezvous timeout.)
        jax.device_get(m) if sync else jax.block_until_ready(prev)
    jax.block_until_ready((state, m))
    n = len(batches) - warmup
    return (
        (time.perf_counter() - t0) / n,
        (time.thread_time() - c0) / n,
        (time.process_time() - p0) / n,
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per loop run")
    ap.add_argument("--warmup", type=int, default=20, help="leading steps left out of timings")
    ap.add_argument("--reps", type=int, default=5, help="rounds (loop, bare, sync each)")
    ap.add_argument("--quick", action="store_true", help="30 steps, 2 rounds (smoke test)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_loop.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.reps = 30, 10, 2
    train_program.Trainer = _RecordingTrainer  # the loop builds its Trainer through this name
    times: dict[str, list[float]] = {"loop": [], "bare": [], "sync": []}
    host: dict[str, list[float]] = {"loop": [], "bare": [], "sync": []}
    process: dict[str, list[float]] = {"loop": [], "bare": [], "sync": []}
    with tempfile.TemporaryDirectory(prefix="train_loop_") as tmp:
        scratch = Path(tmp)
        # Every loop run builds a new Trainer, hence new jitted functions: later runs load the
        # first run's executables from disk instead of compiling them again (a minute each on
        # a busy 2-core host). Outside the timed steps either way.
        jax.config.update("jax_compilation_cache_dir", str(scratch / "xla_cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        run_loop(args.steps, args.warmup, scratch, -1)  # compiles; records trainer and batches
        for r in range(args.reps):
            order = ["loop", "bare", "sync"] if r % 2 == 0 else ["sync", "bare", "loop"]
            for side in order:
                trainer = _RecordingTrainer.last
                assert trainer is not None and len(trainer.batches) == args.steps
                if side == "loop":
                    seconds, cpu, pcpu = run_loop(args.steps, args.warmup, scratch, r)
                else:
                    seconds, cpu, pcpu = run_bare(trainer, args.warmup, sync=side == "sync")
                times[side].append(seconds)
                host[side].append(cpu)
                process[side].append(pcpu)
    med = {k: statistics.median(v) for k, v in times.items()}
    host_med = {k: statistics.median(v) for k, v in host.items()}
    process_med = {k: statistics.median(v) for k, v in process.items()}
    paired = statistics.median(a / b for a, b in zip(times["loop"], times["bare"]))
    paired_sync = statistics.median(a / b for a, b in zip(times["sync"], times["bare"]))
    figures = [
        {"name": "train_loop_steps_per_s", "value": round(1 / med["loop"], 2), "unit": "steps/s",
         "reference": round(1 / med["bare"], 2), "ratio": round(paired, 4),
         "goal": f"<= {GOAL}", "met": bool(paired <= GOAL)},
        {"name": "bare_step_with_per_step_metrics_fetch", "value": round(1 / med["sync"], 2),
         "unit": "steps/s", "reference": round(1 / med["bare"], 2),
         "ratio": round(paired_sync, 4), "goal": None, "met": None},
        # The dispatching thread's CPU per step: what the loop adds to the bare step's host work.
        {"name": "train_loop_host_cpu_per_step", "value": round(1e3 * host_med["loop"], 2),
         "unit": "ms", "reference": round(1e3 * host_med["bare"], 2),
         "ratio": round(host_med["loop"] / host_med["bare"], 3), "goal": None, "met": None},
        # Every thread's CPU per step, the devices' compute included: what the loop adds in all.
        {"name": "train_loop_process_cpu_per_step", "value": round(1e3 * process_med["loop"], 2),
         "unit": "ms", "reference": round(1e3 * process_med["bare"], 2),
         "ratio": round(process_med["loop"] / process_med["bare"], 3), "goal": None, "met": None},
    ]  # fmt: skip
    versions = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "flax", "numpy")}
    record = {
        "benchmark": "train_loop",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
        f"{platform.platform()}; 8 fake CPU devices (data=2 x model=4)",
        "versions": {"python": platform.python_version(), **versions},
        "notes": "ratio: median over rounds of (seconds per step) / (bare seconds per step), "
        "so above 1 is overhead; value/reference: steps/s from median seconds per step",
        "config": {"steps": args.steps, "warmup": args.warmup, "reps": args.reps,
                   "gin": "quickstart.gin, CheckpointConfig.period=0, train.evaluation=None"},
        "seconds_per_step": {k: [round(x, 5) for x in v] for k, v in times.items()},
        "host_cpu_ms_per_step": {k: [round(1e3 * x, 3) for x in v] for k, v in host.items()},
        "process_cpu_ms_per_step": {
            k: [round(1e3 * x, 3) for x in v] for k, v in process.items()
        },
        "figures": figures,
    }  # fmt: skip
    print(
        f"\ntrain_loop: quickstart, {args.steps} steps ({args.warmup} untimed), {args.reps} rounds"
    )
    print(f"{'side':6s} {'ms/step':>9s} {'steps/s':>9s} {'vs bare':>8s} {'spread':>13s} "
          f"{'host ms/step':>13s} {'process ms/step':>16s}")  # fmt: skip
    for side in ("loop", "bare", "sync"):
        ratios = [a / b for a, b in zip(times[side], times["bare"])]
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(f"{side:6s} {1e3 * med[side]:9.2f} {1 / med[side]:9.2f} "
              f"{statistics.median(ratios):8.4f} {spread:>13s} "
              f"{1e3 * statistics.median(host[side]):13.2f} "
              f"{1e3 * process_med[side]:16.2f}")  # fmt: skip
    print(f"loop overhead {100 * (paired - 1):+.1f}% (goal <= {100 * (GOAL - 1):.0f}%): "
          f"{'met' if paired <= GOAL else 'NOT met'}")  # fmt: skip
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
