"""Pipelined (GPipe) vs unpipelined train step on 8 fake CPU devices: the bubble as step time.

Every fake device shares the host's cores, so a step's time is the work of all devices
together. Unpipelined (data=8), each device runs every layer on its 1/8 of the batch; with p
stages (stage=p x data=8/p) and m microbatches each device runs its L/p layers on one
microbatch's rows for m + p - 1 ticks, computing on a stale buffer in the bubble. The pipelined
step thus does (m + p - 1) / m times the work, and `1 - t_unpipelined / t_pipelined` measures
the bubble, to be compared with GPipe's analytic (p - 1) / (m + p - 1).

With `--schedule=1f1b` (model/schedules.py) the bubble computes nothing, but the stack's
forward runs three times (forward pass through the bubble, the schedule's forward, the
backward's recompute): the pipelined step does about `(T / m + 4) / 3` times the work
(`T = m + p - 1`, a forward a third of a step), which is the reference of its ratio.

  python benchmarks/pipeline.py [--smoke] [--reps N] [--schedule gpipe|1f1b] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA:CPU pool thread per fake device runs dry under pipelined steps (docs/pipeline.md, Limits).
os.environ.setdefault("PJRT_NPROC", "32")

import argparse
import dataclasses
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import flax
import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_record

from t5lite import partitioning
from t5lite.model import network, optimizers
from t5lite.model.models import DecoderOnlyModel
from t5lite.trainer import Trainer

CONFIG = network.DecoderOnlyConfig(
    vocab_size=256,
    emb_dim=128,
    num_heads=4,
    head_dim=32,
    mlp_dim=512,
    num_layers=8,
    scan_layers=True,
)
TOLERANCE = 0.05  # measured bubble within this of the analytic fraction (absolute)


def _trainer(
    stages: int,
    microbatches: int,
    batch: int,
    length: int,
    schedule: str = "gpipe",
    config: network.DecoderOnlyConfig = CONFIG,
) -> Trainer:
    cfg = dataclasses.replace(
        config, pipeline_microbatches=microbatches, pipeline_schedule=schedule
    )
    rules = (
        partitioning.pipeline_rules("megatron")
        if stages > 1
        else partitioning.preset_rules("megatron")
    )
    part = partitioning.Partitioner(num_partitions=1, num_stages=stages, logical_axis_rules=rules)
    model = DecoderOnlyModel(cfg, optimizer=optimizers.AdamW(1e-3))
    return Trainer(model, part, batch_size=batch, lengths={"targets": length})


def _step_seconds(tr: Trainer, reps: int, batch: int, length: int) -> float:
    """The median wall time of `reps` train steps after a compiling one."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CONFIG.vocab_size, (batch, length)).astype(np.int32)
    host = {
        "decoder_input_tokens": tokens,
        "decoder_target_tokens": np.roll(tokens, -1, 1),
        "decoder_loss_weights": np.ones((batch, length), np.float32),
    }
    data = tr.global_batch(host)
    state = tr.init_state()
    state, m = tr.train_step(state, data)
    jax.block_until_ready(m)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state, m = tr.train_step(state, data)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="2 repetitions, one pipelined layout")
    ap.add_argument("--reps", type=int, default=7, help="timed steps per layout (median)")
    ap.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    ap.add_argument("--out", default=None, help="default: benchmarks/results/pipeline[_1f1b].json")
    args = ap.parse_args(argv)
    if args.out is None:
        suffix = "" if args.schedule == "gpipe" else f"_{args.schedule}"
        args.out = f"benchmarks/results/pipeline{suffix}.json"
    reps = 2 if args.smoke else max(3, args.reps)
    batch, length = 32, 64
    layouts = [(2, 4)] if args.smoke else [(2, 4), (2, 8), (4, 8)]

    base = _step_seconds(_trainer(1, 1, batch, length), reps, batch, length)
    figures, rows = [], []
    for p, m in layouts:
        t = _step_seconds(_trainer(p, m, batch, length, args.schedule), reps, batch, length)
        analytic = (p - 1) / (m + p - 1)
        measured = 1 - base / t
        rows.append((p, m, t, measured, analytic))
        if args.schedule == "gpipe":
            figure = {
                "name": f"bubble_stage{p}_m{m}",
                "value": round(measured, 4),
                "unit": "fraction",
                "reference": round(analytic, 4),
                "ratio": round(t / base, 4),
                "goal": f"|value - reference| <= {TOLERANCE}",
                "met": bool(abs(measured - analytic) <= TOLERANCE),
            }
        else:
            work = ((m + p - 1) / m + 4) / 3
            figure = {
                "name": f"1f1b_ratio_stage{p}_m{m}",
                "value": round(t / base, 4),
                "unit": "x unpipelined step",
                "reference": round(work, 4),
                "goal": "within 10% of (T / m + 4) / 3",
                "met": bool(abs(t / base / work - 1) <= 0.10),
            }
        figures.append(figure)
    record = {
        "benchmark": "pipeline",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"8 fake {jax.devices()[0].platform} devices".strip(),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "flax": flax.__version__,
        },
        "settings": {
            "reps": reps,
            "smoke": args.smoke,
            "schedule": args.schedule,
            "batch": batch,
            "length": length,
            "config": dataclasses.asdict(CONFIG),
            "unpipelined_step_s": round(base, 4),
        },
        "figures": figures,
    }
    print(f"unpipelined (data=8): {1e3 * base:.1f} ms/step")
    print(f"{'stages':>6} {'m':>3} {'ms/step':>9} {'x unpiped':>9} {'bubble':>7} {'analytic':>8}")
    for p, m, t, measured, analytic in rows:
        print(f"{p:>6} {m:>3} {1e3 * t:>9.1f} {t / base:>9.2f} {measured:>7.1%} {analytic:>8.1%}")
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
