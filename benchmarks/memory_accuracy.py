"""Predicted vs compiled train-step memory per device: every preset x remat policy x model family.

Goal (issue 19): `predict_memory` (analytic, no compilation) within 10% of XLA's figure
(`memory_report(compiled).total`) on 8 fake CPU devices, for scanned T5.1.1-like and decoder-only
models. Prints one row per combination with the compiled figure, the prediction and its terms,
and writes one JSON record.

  python benchmarks/memory_accuracy.py [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax
import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_record

from t5lite.insight import memory
from t5lite.insight.report import compile_train_step
from t5lite.model.config import REMAT_POLICIES
from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
from t5lite.model.network import DecoderOnlyConfig, T5Config
from t5lite.partitioning import PRESETS, Partitioner, create_mesh, preset_rules
from t5lite.trainer import Trainer

GOAL = 0.10
MiB = 2**20


def family(name: str, remat: str):
    """The models of tests/test_insight_accuracy.py: shapes dominate, layers scanned."""
    if name == "t5":
        cfg = T5Config(
            vocab_size=8192, emb_dim=256, num_heads=4, head_dim=64, mlp_dim=1024,
            num_encoder_layers=2, num_decoder_layers=2, remat_policy=remat, scan_layers=True,
        )  # fmt: skip
        return EncoderDecoderModel(network_config=cfg), {"inputs": 128, "targets": 64}
    cfg = DecoderOnlyConfig(
        vocab_size=8192, emb_dim=256, num_heads=4, head_dim=64, mlp_dim=768, num_layers=2,
        remat_policy=remat, scan_layers=True,
    )  # fmt: skip
    return DecoderOnlyModel(network_config=cfg), {"targets": 128}


def measure(fam: str, preset: str, remat: str) -> dict:
    model, lengths = family(fam, remat)
    model_parallel = 1 if PRESETS[preset] is None else 4
    part = Partitioner(create_mesh(model_parallel), logical_axis_rules=preset_rules(preset))
    tr = Trainer(model, part, batch_size=16, lengths=lengths)
    compiled = memory.memory_report(compile_train_step(tr)).total
    p = memory.predict_memory(tr)
    return {"compiled": compiled, "predicted": p.total, "terms": dict(p.terms), "state": p.state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two combinations only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/memory_accuracy.json"))
    args = ap.parse_args()
    combos = [(f, p, r) for f in ("t5", "lm") for p in PRESETS for r in REMAT_POLICIES]
    if args.smoke:
        combos = [("lm", "fsdp", "full"), ("t5", "megatron", "none")]
    figures = []
    print(f"{'model':5} {'preset':15} {'remat':8} {'compiled':>9} {'predicted':>9} {'ratio':>6}"
          "   (MiB per device; terms: state, saved, working set, loss, update)")  # fmt: skip
    for fam, preset, remat in combos:
        m = measure(fam, preset, remat)
        ratio = m["predicted"] / m["compiled"]
        t = m["terms"]
        print(
            f"{fam:5} {preset:15} {remat:8} {m['compiled'] / MiB:9.2f} {m['predicted'] / MiB:9.2f}"
            f" {ratio:6.3f}   {m['state'] / MiB:.2f}, {t['saved activations'] / MiB:.2f}, "
            f"{t['layer working set'] / MiB:.2f}, {t['loss temporaries'] / MiB:.2f}, "
            f"{t['optimizer update'] / MiB:.2f}",
            flush=True,
        )
        figures.append({
            "name": f"predicted_over_compiled/{fam}/{preset}/{remat}", "value": ratio,
            "unit": "ratio", "reference": m["compiled"], "ratio": ratio,
            "goal": f"within {GOAL:.0%}", "met": abs(ratio - 1) <= GOAL,
        })  # fmt: skip
    record = {
        "benchmark": "memory_accuracy",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs",
        "versions": {
            "jax": jax.__version__,
            "flax": flax.__version__,
            "python": platform.python_version(),
        },
        "figures": figures,
    }
    write_record(record, args.out)


if __name__ == "__main__":
    main()
