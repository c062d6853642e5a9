"""Compile time of loss-and-grad: 2 vs 24 layers, scanned vs unscanned (decoder-only LM, CPU).

Goal (issue 3): with `scan_layers=True`, 24 layers compile in <= 1.5x the time of 2 layers.
Each figure is the median of several fresh lower+compile runs (a new function object each time, so
no in-memory cache is hit). Prints a table and writes one JSON record.

  python benchmarks/compile_time.py [--smoke] [--reps N] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import flax
import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_record

from t5lite.model import network
from t5lite.model.losses import cross_entropy_with_logits

BASE = network.DecoderOnlyConfig(
    vocab_size=256, emb_dim=64, num_heads=4, head_dim=16, mlp_dim=128, num_layers=2
)
GOAL = 1.5


def _compile_seconds(cfg: network.DecoderOnlyConfig, batch: int, length: int) -> float:
    """One fresh trace + lower + compile of loss-and-grad; returns wall seconds."""
    model = network.DecoderOnly(cfg)
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    params = jax.eval_shape(
        lambda t: flax.core.meta.unbox(model.init(jax.random.PRNGKey(0), t, enable_dropout=False)),
        tokens,
    )["params"]

    def loss_fn(p, inputs, targets):
        logits = model.apply({"params": p}, inputs, targets, enable_dropout=False)
        return jnp.mean(cross_entropy_with_logits(logits, targets)[0])

    fn = jax.jit(jax.value_and_grad(functools.partial(loss_fn)))
    t0 = time.perf_counter()
    fn.lower(params, tokens, tokens).compile()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="1 repetition, 2 vs 6 layers")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per figure (median)")
    ap.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = ap.parse_args(argv)
    reps = 1 if args.smoke else max(3, args.reps)
    deep = 6 if args.smoke else 24

    medians: dict[tuple[bool, int], float] = {}
    for scan in (True, False):
        for n in (2, deep):
            cfg = dataclasses.replace(BASE, num_layers=n, scan_layers=scan)
            _compile_seconds(cfg, 4, 32)  # warm-up: imports, first-trace costs
            times = [_compile_seconds(cfg, 4, 32) for _ in range(reps)]
            medians[(scan, n)] = statistics.median(times)

    figures = []
    for scan in (True, False):
        name = "scanned" if scan else "unscanned"
        shallow, deep_t = medians[(scan, 2)], medians[(scan, deep)]
        ratio = deep_t / shallow
        figures.append(
            {"name": f"{name}_{deep}_layers_compile_s", "value": round(deep_t, 4), "unit": "s",
             "reference": round(shallow, 4), "ratio": round(ratio, 3),
             "goal": f"<= {GOAL}" if scan else None,
             "met": bool(ratio <= GOAL) if scan else None}
        )  # fmt: skip
    record = {
        "benchmark": "compile_time",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"{jax.devices()[0].platform}".strip(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "flax": flax.__version__},
        "settings": {"reps": reps, "smoke": args.smoke, "config": dataclasses.asdict(BASE),
                     "batch": 4, "length": 32},
        "figures": figures,
    }  # fmt: skip

    print(f"{'layout':<10} {'2 layers (s)':>13} {f'{deep} layers (s)':>14} {'ratio':>7}  goal")
    for scan, fig in zip((True, False), figures):
        goal = f"{fig['goal']} met={fig['met']}" if scan else "-"
        print(
            f"{'scanned' if scan else 'unscanned':<10} {fig['reference']:>13.3f} "
            f"{fig['value']:>14.3f} {fig['ratio']:>7.2f}  {goal}"
        )
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
