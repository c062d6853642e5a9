"""Mixture-of-experts train step time on 8 fake CPU devices (data=4 x model=2), same run.

Three comparisons, each a ratio of medians over interleaved rounds (every variant steps once
per round, so a host's load drifts over all of them alike):

  * MoE (capacity dispatch, `megatron` rules) vs the dense LM with the same *active*
    parameters: its MLP is k experts wide (mlp_dim = k * expert mlp_dim), so both do the same
    model FLOPs per token (`t5lite.insight.flops`, the router's D x E aside);
  * dropless (`jax.lax.ragged_dot`; on CPU a masked dense matmul over every expert) vs capacity;
  * expert parallelism (`expert_parallel`: experts over data, the dispatch and combine as
    all-to-alls) vs replicated experts (`megatron` with `expert` -> replicated and
    `expert_group` -> data: every device holds every expert, split like Megatron over model,
    and routes its own sequences; no all-to-all).

No goal: the figures say what each choice costs on the machine at hand (docs/moe.md quotes
them). Prints a table and writes one JSON record.

  python benchmarks/moe.py [--smoke] [--rounds N] [--steps N] [--out PATH]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
from t5lite.insight.flops import flops_per_token
from t5lite.model import network
from t5lite.model.models import DecoderOnlyModel
from t5lite.partitioning import Partitioner
from t5lite.trainer import Trainer

MOE = network.DecoderOnlyConfig(
    vocab_size=512,
    emb_dim=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=256,
    num_layers=2,
    num_experts=8,
    moe_top_k=2,
)
SMOKE = dataclasses.replace(MOE, emb_dim=32, head_dim=8, mlp_dim=64, vocab_size=128, num_layers=1)


def _rules(name: str) -> list:
    if name == "replicated_experts":
        # Every device holds every expert (Megatron inside each, over model) and dispatches its
        # own sequences locally: the groups of the dispatched activations stay on data.
        return [("expert", None), ("expert_group", "data"), *partitioning.preset_rules("megatron")]
    return partitioning.preset_rules(name)


def _variants(cfg: network.DecoderOnlyConfig) -> dict[str, tuple[network.DecoderOnlyConfig, str]]:
    dense = dataclasses.replace(cfg, num_experts=0, mlp_dim=cfg.moe_top_k * cfg.mlp_dim)
    return {
        "moe_capacity": (cfg, "megatron"),
        "dense_same_active": (dense, "megatron"),
        "moe_dropless": (dataclasses.replace(cfg, moe_dispatch="dropless"), "megatron"),
        "moe_expert_parallel": (cfg, "expert_parallel"),
        "moe_replicated_experts": (cfg, "replicated_experts"),
    }


def _batch(batch: int, length: int, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.RandomState(0)
    targets = rng.randint(1, vocab, (batch, length)).astype(np.int32)
    return {
        "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones_like(targets, np.float32),
    }


class _Stepper:
    """One variant's trainer, state and batch; `time(n)` runs n steps and returns s/step."""

    def __init__(self, cfg, rules, batch: int, length: int):
        part = Partitioner(partitioning.create_mesh(2), logical_axis_rules=rules)
        model = DecoderOnlyModel(network_config=cfg)
        self.tr = Trainer(model, part, batch_size=batch, lengths={"targets": length})
        self.state = self.tr.init_state()
        self.batch = self.tr.global_batch_from_full(_batch(batch, length, cfg.vocab_size))
        self.time(1)  # compile

    def time(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            self.state, metrics = self.tr.train_step(self.state, self.batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - t0) / n


PAIRS = [  # (figure, variant, reference)
    ("moe_vs_dense_same_active_step_time", "moe_capacity", "dense_same_active"),
    ("dropless_vs_capacity_step_time", "moe_dropless", "moe_capacity"),
    (
        "expert_parallel_vs_replicated_experts_step_time",
        "moe_expert_parallel",
        "moe_replicated_experts",
    ),
]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a 1-layer model, 2 rounds of 1 step")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians)")
    ap.add_argument("--steps", type=int, default=5, help="steps per variant and round")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/moe.json")
    args = ap.parse_args(argv)
    cfg = SMOKE if args.smoke else MOE
    rounds, steps = (2, 1) if args.smoke else (args.rounds, args.steps)
    batch, length = (8, 16) if args.smoke else (args.batch, args.length)
    if jax.device_count() < 8:
        sys.exit("benchmarks/moe.py: needs 8 devices (XLA_FLAGS sets 8 fake CPU devices)")
    variants = _variants(cfg)
    steppers = {n: _Stepper(c, _rules(r), batch, length) for n, (c, r) in variants.items()}
    times: dict[str, list[float]] = {n: [] for n in steppers}
    for _ in range(rounds):
        for name, stepper in steppers.items():
            times[name].append(stepper.time(steps))
    medians = {n: statistics.median(t) for n, t in times.items()}
    active = {
        n: flops_per_token(c, {"decoder": length})["decoder"] for n, (c, _) in variants.items()
    }
    figures = [
        {
            "name": name,
            "value": round(medians[a], 6),
            "unit": "s/step",
            "reference": round(medians[b], 6),
            "ratio": round(medians[a] / medians[b], 3),
            "goal": None,
            "met": None,
            "variant": a,
            "reference_variant": b,
        }
        for name, a, b in PAIRS
    ]
    record = {
        "benchmark": "moe",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"{jax.devices()[0].platform} x {jax.device_count()} (data=4 x model=2)".strip(),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "flax": flax.__version__,
        },
        "settings": {
            "smoke": args.smoke,
            "rounds": rounds,
            "steps_per_round": steps,
            "batch": batch,
            "length": length,
            "config": dataclasses.asdict(cfg),
            "train_flops_per_token": active,
        },
        "medians_s_per_step": {n: round(v, 6) for n, v in medians.items()},
        "figures": figures,
    }
    print(f"{'variant':<24} {'median s/step':>14}  {'model FLOPs/token':>18}")
    for n, v in medians.items():
        print(f"{n:<24} {v:>14.5f}  {active[n]:>18,.0f}")
    print()
    for f in figures:
        print(f"{f['name']:<48} ratio {f['ratio']:.3f}")
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
