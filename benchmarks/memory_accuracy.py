"""Predicted vs compiled train-step memory per device: every preset x remat policy x model family.

Goal (issue 19): `predict_memory` (analytic, no compilation) within 10% of XLA's figure
(`memory_report(compiled).total`) on 8 fake CPU devices, for T5.1.1-like and decoder-only models
(`accuracy.accuracy_trainer`, the test's models), layers scanned or (`--unscanned`) unrolled,
two a stack or `--layers N` (the unscanned counts are checked at 2 and 4 for every
combination, and T5 at 8 on five; the `full` counts were fitted on 2, 4 and 6).
`--precision` takes the mixed-precision policies too (`bf16`: bf16 parameters and compute, fp32
masters; `bf16_masters`: bf16 masters as well; `all`: fp32 and both), which XLA:CPU compiles
to fp32 activations (memory.activation_itemsize).
`--topology v5e:2x4` compiles for a TPU slice's compile-only devices instead (libtpu, the `[tpu]`
extra; ahead of time, on this CPU machine) and predicts for XLA:TPU (`tpu_memory`); `--small`
measures models of T5.1.1-small's size (8 layers a stack, D 512, batch 64, 256/64 tokens;
decoder-only 256 tokens) on data=4 x model=2 in place of the test-size ones.
Prints one row per combination with the compiled figure, the prediction and its terms, and
writes one JSON record.

  python benchmarks/memory_accuracy.py [--smoke] [--unscanned] [--layers N] [--remat POLICY]
      [--precision fp32|bf16|bf16_masters|all] [--topology NAME] [--small] [--presets P,...]
      [--out PATH] [--compiled-from JSON]
"""

from __future__ import annotations

import argparse
import datetime
import json
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

from t5lite.insight import accuracy, memory
from t5lite.insight.meshes import partitioner_on
from t5lite.insight.report import compile_train_step
from t5lite.model.config import REMAT_POLICIES
from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
from t5lite.model.network import DecoderOnlyConfig, T5Config
from t5lite.partitioning import PRESETS, Partitioner, create_mesh, preset_rules
from t5lite.trainer import Trainer

GOAL = 0.10
MiB = 2**20
POLICIES = {
    "fp32": "float32",
    "bf16": "params=bfloat16,compute=bfloat16,output=float32",
    "bf16_masters": "params=bfloat16,compute=bfloat16,output=float32,master=bfloat16",
}


# Presets with the same rules table and mesh (fully_sharded and tensor_2d) are one program:
# compiled once.
_COMPILED: dict[tuple, int] = {}


def small_trainer(
    fam: str, preset: str, remat: str, scan: bool, precision: str, devices=None
) -> Trainer:
    """T5.1.1-small (8 + 8 layers, D 512, 6 heads of 64, F 1024 gated, vocab 32128), batch 64,
    256/64 tokens, or a decoder-only model of its size (8 layers, 8 heads, F 2048, 256 tokens),
    on data=4 x model=2 (data=8 without model parallelism)."""
    common = dict(vocab_size=32128, emb_dim=512, head_dim=64, remat_policy=remat)
    common.update(scan_layers=scan, precision=precision)
    if fam == "t5":
        cfg = T5Config(
            num_heads=6, mlp_dim=1024, num_encoder_layers=8, num_decoder_layers=8, **common
        )
        model, lengths = EncoderDecoderModel(network_config=cfg), {"inputs": 256, "targets": 64}
    else:
        cfg = DecoderOnlyConfig(num_heads=8, mlp_dim=2048, num_layers=8, **common)
        model, lengths = DecoderOnlyModel(network_config=cfg), {"targets": 256}
    mesh = create_mesh(1 if PRESETS[preset] is None else 2, devices=devices)
    part = Partitioner(mesh, logical_axis_rules=preset_rules(preset))
    return Trainer(model, part, batch_size=64, lengths=lengths)


def measure(
    fam: str,
    preset: str,
    remat: str,
    scan: bool = True,
    layers: int = 2,
    compiled: int = 0,
    precision: str = "fp32",
    topology=None,
    small: bool = False,
) -> dict:
    devices = topology.devices if topology else None
    if small:
        tr = small_trainer(fam, preset, remat, scan, POLICIES[precision], devices)
    else:
        tr = accuracy.accuracy_trainer(
            fam, preset, remat, scan=scan, layers=layers, precision=POLICIES[precision]
        )
        if topology:  # the same layout over the slice's chips
            part = partitioner_on(tr.partitioner, devices)
            tr = Trainer(tr.model, part, batch_size=tr.batch_size, lengths=tr.lengths)
    key = (fam, preset_rules(preset), PRESETS[preset] is None, remat, precision, small)
    if not compiled:
        if key not in _COMPILED:
            _COMPILED[key] = memory.memory_report(compile_train_step(tr)).total
        compiled = _COMPILED[key]
    p = memory.predict_memory(tr)
    return {"compiled": compiled, "predicted": p.total, "terms": dict(p.terms), "state": p.state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two combinations only")
    ap.add_argument("--unscanned", action="store_true", help="layers unrolled (scan_layers=False)")
    ap.add_argument("--layers", type=int, default=2, help="layers a stack (default 2)")
    ap.add_argument("--remat", choices=REMAT_POLICIES, help="this remat policy only")
    ap.add_argument(
        "--precision",
        choices=[*POLICIES, "all"],
        default="fp32",
        help="mixed-precision policy (default fp32; all: fp32, bf16 and bf16_masters)",
    )
    ap.add_argument(
        "--topology", help="compile for this TPU slice ahead of time (libtpu), e.g. v5e:2x4"
    )
    ap.add_argument("--small", action="store_true", help="T5.1.1-small-size models")
    ap.add_argument("--presets", help="these presets only (comma-separated)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/memory_accuracy.json"))
    ap.add_argument(
        "--compiled-from",
        metavar="JSON",
        help="take the compiled figures from this earlier record of the same matrix (its "
        "`reference`s) and only predict again: the compiler's figures do not change with the "
        "analytic model, and a deep matrix takes most of an hour to compile on busy cores",
    )
    args = ap.parse_args()
    recorded: dict[str, int] = {}
    if args.compiled_from:
        old = json.loads(Path(args.compiled_from).read_text())
        recorded = {f["name"]: f["reference"] for f in old["figures"]}
    remats = [args.remat] if args.remat else REMAT_POLICIES
    policies = list(POLICIES) if args.precision == "all" else [args.precision]
    presets = args.presets.split(",") if args.presets else list(PRESETS)
    combos = [
        (f, p, r, pol)
        for pol in policies
        for f in accuracy.ACCURACY_FAMILIES
        for p in presets
        for r in remats
    ]
    topology = None
    if args.topology:
        from t5lite.insight.topology import get_topology

        topology = get_topology(args.topology)
    if args.smoke:
        combos = [("lm", "fsdp", "full", policies[0]), ("t5", "megatron", "none", policies[0])]
    figures: list[dict] = []
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
    layers = ("/unscanned" if args.unscanned else "") + (
        f"/{args.layers}_layers" if args.layers != 2 else ""
    )
    layers += ("/small" if args.small else "") + (f"/{args.topology}" if args.topology else "")
    print(
        f"{'policy':12} {'model':5} {'preset':17} {'remat':8} {'compiled':>9} {'predicted':>9} "
        f"{'ratio':>6}   (MiB per device; terms: state, saved, working set, loss, update[, code])"
    )
    for fam, preset, remat, pol in combos:
        # fp32 keeps the names of the records before the policies were measured
        policy = "" if pol == "fp32" else f"/{pol}"
        name = f"predicted_over_compiled/{fam}/{preset}/{remat}{layers}{policy}"
        if args.compiled_from and name not in recorded:
            continue  # not in the earlier record (a cut-short run): nothing to compare with
        m = measure(
            fam,
            preset,
            remat,
            scan=not args.unscanned,
            layers=args.layers,
            compiled=recorded.get(name, 0),
            precision=pol,
            topology=topology,
            small=args.small,
        )
        ratio = m["predicted"] / m["compiled"]
        t = m["terms"]
        print(
            f"{pol:12} {fam:5} {preset:17} {remat:8} {m['compiled'] / MiB:9.2f} "
            f"{m['predicted'] / MiB:9.2f}"
            f" {ratio:6.3f}   {m['state'] / MiB:.2f}, {t['saved activations'] / MiB:.2f}, "
            f"{t['layer working set'] / MiB:.2f}, {t['loss temporaries'] / MiB:.2f}, "
            f"{t['optimizer update'] / MiB:.2f}"
            + (f", {t['generated code'] / MiB:.2f}" if "generated code" in t else ""),
            flush=True,
        )
        figures.append({
            "name": name, "value": ratio,
            "unit": "ratio", "reference": m["compiled"], "ratio": ratio,
            "goal": f"within {GOAL:.0%}", "met": abs(ratio - 1) <= GOAL,
        })  # fmt: skip
        # Written after every row: a matrix of compiles takes long, and a partial one is
        # still a record of what was measured.
        write_record(record, args.out)


if __name__ == "__main__":
    main()
