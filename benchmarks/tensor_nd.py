"""1D (Megatron) vs 2D (Optimus / SUMMA) vs 3D (Colossal-AI) tensor parallelism.

Three parts, one record:
- measured: the train step's median wall time of a small decoder on 8 fake CPU devices under
  `megatron` (model = 8), `summa_2d` (data = 2 x 2 x 2) and `tensor_3d` (2 x 2 x 2), and the
  losses of the first step (they agree);
- analytic: `insight.tensor_nd.rank_schemes` for a ≈1B (TinyLlama-1.1B shapes) and a ≈7B
  (Llama-7B shapes) decoder on 8 and 64 chips of `--device`;
- `--topology v5p:4x4x4` (libtpu, the `[tpu]` extra): the 64-chip case compiled by the TPU
  compiler (two layers of the ≈1B decoder), each scheme's collectives per step and the
  compiled step estimate of `insight.report.step_report` (64 heads of 32 so that 1D splits
  them 64 ways), and those bytes part by part (`insight.step_parts`: layers, logits,
  embedding, norms, gradients, rest).

  python benchmarks/tensor_nd.py [--smoke] [--device v5p] [--topology v5p:4x4x4] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _record import write_record  # noqa: E402

MODELS = {  # name: (emb, mlp, heads x head_dim, layers)
    "≈1B": (2048, 5632, 2048, 22),
    "≈7B": (4096, 11008, 4096, 32),
}
_TOPOLOGY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from t5lite.insight import report as rep
    from t5lite.insight.step_parts import step_parts
    from t5lite.insight.topology import get_topology
    from t5lite.model.models import DecoderOnlyModel
    from t5lite.model.network import DecoderOnlyConfig
    from t5lite.partitioning import (Partitioner, create_mesh, preset_rules, tensor_mesh,
                                     tensor_nd_rules)
    from t5lite.trainer import Trainer

    topo = get_topology(sys.argv[1])
    cfg = DecoderOnlyConfig(vocab_size=32768, emb_dim=2048, num_heads=64, head_dim=32,
                            mlp_dim=5632, num_layers=2, precision="bfloat16")
    out = {"devices": len(topo.devices), "kind": topo.spec.device_kind}
    parts = {
        "megatron": Partitioner(create_mesh(64, devices=topo.devices),
                                logical_axis_rules=preset_rules("megatron")),
        "summa_2d": Partitioner(tensor_mesh("summa_2d", 8, devices=topo.devices),
                                logical_axis_rules=tensor_nd_rules("summa_2d")),
        "tensor_3d": Partitioner(tensor_mesh("tensor_3d", 4, devices=topo.devices),
                                 logical_axis_rules=tensor_nd_rules("tensor_3d")),
    }
    for name, part in parts.items():
        tr = Trainer(DecoderOnlyModel(network_config=cfg), part, batch_size=64,
                     lengths={"targets": 2048})
        compiled = rep.compile_train_step(tr)
        s = rep.step_report(tr, device=topo.spec, compiled=compiled)
        by_part = step_parts(compiled.as_text(), part.mesh)
        out[name] = {"step_s": s.step_seconds, "memory": s.memory.total,
                     "collectives": sum(r.count for r in s.collectives),
                     "link_bytes": sum(r.link_bytes for r in s.collectives),
                     "parts": {p: [r.count, r.link_bytes] for p, r in by_part.items()}}
    print("RESULT " + json.dumps(out))
    """
)


def measured(smoke: bool, steps: int) -> dict[str, dict[str, float]]:
    """Median step seconds and first loss of each scheme on the 8 fake devices."""
    import numpy as np

    from t5lite.model import network, optimizers
    from t5lite.model.models import DecoderOnlyModel
    from t5lite.partitioning import (
        Partitioner,
        create_mesh,
        preset_rules,
        tensor_mesh,
        tensor_nd_rules,
    )
    from t5lite.trainer import Trainer, summarize

    width = 64 if smoke else 256
    cfg = network.DecoderOnlyConfig(
        vocab_size=256,
        emb_dim=width,
        num_heads=8,
        head_dim=width // 8,
        mlp_dim=4 * width,
        num_layers=2 if smoke else 4,
    )
    parts = {
        "megatron": Partitioner(create_mesh(8), logical_axis_rules=preset_rules("megatron")),
        "summa_2d": Partitioner(
            tensor_mesh("summa_2d"), logical_axis_rules=tensor_nd_rules("summa_2d")
        ),
        "tensor_3d": Partitioner(
            tensor_mesh("tensor_3d"), logical_axis_rules=tensor_nd_rules("tensor_3d")
        ),
    }
    out = {}
    for name, part in parts.items():
        model = DecoderOnlyModel(network_config=cfg, optimizer=optimizers.AdamW(1e-3))
        tr = Trainer(model, part, batch_size=16, lengths={"targets": 64 if smoke else 256})
        tokens = np.random.default_rng(0).integers(2, 256, size=(16, tr.lengths["targets"]))
        tokens = tokens.astype(np.int32)
        batch = tr.global_batch({"decoder_target_tokens": tokens, "decoder_input_tokens": tokens})
        state = tr.init_state()
        times, first = [], None
        for i in range(steps + 1):
            t0 = time.perf_counter()
            with part.context():
                state, metrics = tr.train_step(state, batch)
            loss = summarize(metrics)["loss"]  # waits for the step
            if i == 0:
                first = loss
            else:
                times.append(time.perf_counter() - t0)
        out[name] = {"step_s": statistics.median(times), "first_loss": first}
    return out


VOCAB = 32000  # both models' vocabulary (Llama's tokenizer)


def whole_step(device: str) -> list[dict]:
    """`insight.tensor_nd.step_terms`: the step as t5lite compiles it (its 2D, the logits and
    the data-parallel gradients included), for the same models and chips as `analytic`."""
    from t5lite.insight.hardware import device_spec_named
    from t5lite.insight.tensor_nd import SCHEME_DIMS, step_terms

    spec = device_spec_named(device)
    rows = []
    for model, (emb, mlp, att, layers) in MODELS.items():
        for chips in (8, 64):
            tokens = chips * 4096
            for scheme in SCHEME_DIMS:
                r = step_terms(scheme, emb, mlp, att, VOCAB, layers, tokens, chips, spec.peak_flops)
                comm = r.link_bytes / spec.link_bytes_per_s
                rows.append(
                    {
                        "model": model,
                        "chips": chips,
                        "scheme": scheme,
                        "step_s": r.compute_s + comm,
                        "communication_s": comm,
                        "layers_bytes": r.layers,
                        "logits_bytes": r.logits,
                        "gradient_bytes": r.gradients,
                    }
                )
    return sorted(rows, key=lambda r: (r["model"], r["chips"], r["step_s"]))


def analytic(device: str) -> list[dict]:
    from t5lite.insight.hardware import device_spec_named
    from t5lite.insight.tensor_nd import rank_schemes

    spec = device_spec_named(device)
    rows = []
    for model, (emb, mlp, att, layers) in MODELS.items():
        for chips in (8, 64):
            tokens = chips * 4096  # 4096 tokens a chip: one 4k sequence each
            ranked = rank_schemes(
                emb, mlp, att, layers, tokens, chips, spec.peak_flops, spec.link_bytes_per_s
            )
            for rank, e in enumerate(ranked, 1):
                rows.append(
                    {
                        "model": model,
                        "chips": chips,
                        "rank": rank,
                        "scheme": e.scheme,
                        "tensor_devices": e.tensor_devices,
                        "step_s": e.step_s,
                        "communication_s": e.communication_s,
                        "collectives": e.collectives,
                        "params_per_device": e.param_fraction,
                        "activations_per_device": e.activation_fraction,
                    }
                )
    return rows


def topology(name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _TOPOLOGY_SCRIPT, name],
        capture_output=True,
        text=True,
        env=env,
        timeout=3000,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"topology compile failed:\n{out.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a 2-layer width-64 decoder, 2 steps")
    p.add_argument("--device", default="v5p", help="hardware table name for the analytic part")
    p.add_argument("--topology", default=None, help="e.g. v5p:4x4x4 (needs libtpu)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/tensor_nd.json"))
    args = p.parse_args(argv)
    import jax

    steps = 2 if args.smoke else 5
    m = measured(args.smoke, steps)
    print(f"{'scheme (8 fake CPU devices)':<30}{'step (s)':>10}{'vs 1D':>8}{'loss':>10}")
    for name, r in m.items():
        ratio = r["step_s"] / m["megatron"]["step_s"]
        print(f"{name:<30}{r['step_s']:>10.3f}{ratio:>8.2f}{r['first_loss']:>10.4f}")
    rows = analytic(args.device)
    print(
        f"\nanalytic ({args.device}, bf16, 4096 tokens a chip): dense layers' step, fastest first"
    )
    print(f"{'model':<6}{'chips':>6}  {'scheme':<10}{'group':>6}{'step (s)':>10}{'comm (s)':>10}")
    for r in rows:
        print(
            f"{r['model']:<6}{r['chips']:>6}  {r['scheme']:<10}{r['tensor_devices']:>6}"
            f"{r['step_s']:>10.3f}{r['communication_s']:>10.3f}"
        )
    whole = whole_step(args.device)
    print("\nwhole step as t5lite compiles it (its 2D, logits and gradients included)")
    print(f"{'model':<6}{'chips':>6}  {'scheme':<10}{'step (s)':>10}{'comm (s)':>10}")
    for r in whole:
        print(
            f"{r['model']:<6}{r['chips']:>6}  {r['scheme']:<10}{r['step_s']:>10.3f}"
            f"{r['communication_s']:>10.3f}"
        )
    figures = [
        {
            "name": f"{n} step on 8 fake CPU devices",
            "value": round(r["step_s"], 4),
            "unit": "s",
            "reference": round(m["megatron"]["step_s"], 4),
            "ratio": round(r["step_s"] / m["megatron"]["step_s"], 3),
            "goal": None,
            "met": None,
        }
        for n, r in m.items()
    ]
    record = {
        "benchmark": "tensor_nd",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, load average "
        f"{os.getloadavg()[0]:.1f}",
        "versions": {"python": platform.python_version(), "jax": jax.__version__},
        "settings": {"smoke": args.smoke, "steps": steps, "device": args.device},
        "figures": figures,
        "first_loss": {n: r["first_loss"] for n, r in m.items()},
        "analytic": rows,
        "whole_step": whole,
    }
    if args.topology:
        record["topology"] = {args.topology: topology(args.topology)}
        print(json.dumps(record["topology"], indent=1))
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
