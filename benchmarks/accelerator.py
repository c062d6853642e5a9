"""One accelerator: a ≈1B decoder-only model trained in bf16, per attention implementation.

The model is `configs/models/decoder_only/1b.gin` (TinyLlama-1.1B shape) under the mixed-precision
policy users train with on accelerators (`params=bfloat16,compute=bfloat16,output=float32`, fp32
masters and AdamW state), scanned layers, on a one-device mesh through the framework path
(`Partitioner`, `DecoderOnlyModel`, `Trainer.train_step`). Each attention implementation named in
`--attention` (default: `xla` and, on a GPU, `cudnn`) trains the same random-token batches from
the same initial weights in a process of its own, so each one's peak memory is its own; the first
is the reference the others' ratios are taken against.

Per implementation: median step time over the timed steps (each step synced), tokens/s, MFU
(model FLOPs of the step, `t5lite.insight.flops.batch_train_flops`, over the step time and the
chip's dense bf16 peak from `t5lite.insight.hardware`); the same three for as many steps run back
to back and synced once (`loop`: the host dispatches the next step while the device runs one,
as a training loop does; the batches sit on the device for both), the device's peak memory in use
(`memory_stats()['peak_bytes_in_use']`, where the backend reports it) and the compiled step's
memory (arguments + outputs + temporaries - aliased), and the first step's loss (the
implementations compute the same function, so their losses agree to bf16 rounding).

    python benchmarks/accelerator.py                      # on whatever backend JAX finds
    python benchmarks/accelerator.py --attention xla,cudnn --batch 8 --length 2048 --remat full
    python benchmarks/accelerator.py --attention cudnn --remat full,minimal,none  # one run each
    python benchmarks/accelerator.py --attention cudnn --remat minimal --profile  # time by op
    python benchmarks/accelerator.py --smoke              # tiny model, CPU, 2 steps (CI)
    python benchmarks/accelerator.py --topology v5p:2x2x1 # compiled for a TPU slice, no TPU

`--topology` (the `[tpu]` extra) compiles the same step ahead of time for a TPU slice under the
`fsdp` preset, `--batch` sequences per chip, layers unscanned, and reports an ESTIMATE, not a
measurement: the step time is the roofline of the compiled step's cost analysis (the larger of
its FLOPs over the chip's dense bf16 peak and its bytes accessed over the chip's HBM bandwidth,
from `t5lite.insight.hardware`), the MFU the model FLOPs over that time and the peak;
collectives and overlap are not counted.

Goal (issue 38): MFU >= 50% for the ≈1B model on one H100/H200.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _record import write_record  # noqa: E402

GOAL_MFU = 0.50
BF16 = "params=bfloat16,compute=bfloat16,output=float32"
REMAT_POLICIES = ("none", "minimal", "full")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gin_file", default="models/decoder_only/1b.gin")
    ap.add_argument("--gin", action="append", default=[], help="a gin binding, NAME=VALUE")
    ap.add_argument("--attention", default=None, help="comma-separated implementations")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--length", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the compile step")
    ap.add_argument(
        "--remat", default="full", help="comma-separated remat policies: none, minimal, full"
    )
    ap.add_argument("--precision", default=BF16)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, 2 timed steps")
    ap.add_argument("--unscanned", action="store_true", help="layers unrolled, not scanned")
    ap.add_argument(
        "--profile", action="store_true", help="trace 3 more steps: device time by kind and op"
    )
    ap.add_argument("--no_check", action="store_true", help="skip the attention-only check")
    ap.add_argument("--out", default="benchmarks/results/accelerator.json")
    ap.add_argument("--topology", default=None, help="estimate for a TPU slice, e.g. v5p:2x2x1")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.gin_file, args.batch, args.length = "models/decoder_only/tiny.gin", 2, 64
        args.steps, args.warmup = 2, 1
    for name in ("batch", "length", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    policies = [s.strip() for s in args.remat.split(",") if s.strip()]
    bad = [p for p in policies if p not in REMAT_POLICIES]
    if bad or not policies:
        ap.error(f"--remat {args.remat!r}: each policy must be one of {', '.join(REMAT_POLICIES)}")
    if args.topology and len(policies) > 1:
        ap.error("--topology estimates one remat policy at a time")
    args.remat_policies = policies
    return args


def _child(args: argparse.Namespace) -> dict:
    """Trains `args.child`'s implementation in this process; returns its figures."""
    import dataclasses

    import jax
    import numpy as np

    from t5lite import partitioning, trainer
    from t5lite.cli import gin_config, registry
    from t5lite.insight import flops, hardware
    from t5lite.model import models, optimizers

    gin_config.parse_gin([args.gin_file], args.gin)
    cfg = registry.DecoderOnlyConfig()
    cfg = dataclasses.replace(
        cfg,
        precision=args.precision,
        remat_policy=args.remat,
        scan_layers=not args.unscanned,
        attention_implementation=args.child,
    )
    device = jax.devices()[0]
    mesh = partitioning.create_mesh(1, devices=[device])
    partitioner = partitioning.Partitioner(mesh=mesh)
    opt = optimizers.AdamW(1e-4, 0.9, 0.95, 1e-8, weight_decay=0.1, clip_norm=1.0)
    model = models.DecoderOnlyModel(network_config=cfg, optimizer=opt)
    # One random row per example, unpacked: the attention mask is causal alone.
    tr = trainer.Trainer(
        model, partitioner, batch_size=args.batch, lengths={"targets": args.length}, packed=False
    )

    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        targets = rng.integers(2, cfg.vocab_size, (args.batch, args.length), dtype=np.int32)
        inputs = np.concatenate([np.zeros((args.batch, 1), np.int32), targets[:, :-1]], axis=1)
        batches.append(
            {
                "decoder_input_tokens": inputs,
                "decoder_target_tokens": targets,
                "decoder_loss_weights": np.ones_like(targets),
            }
        )
    step_flops = flops.batch_train_flops(cfg, batches[0])

    state = tr.init_state()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state.params))
    placed = [tr.global_batch(b) for b in batches]  # on the device once, as a loader's prefetch
    t0 = time.perf_counter()
    step = tr.train_step.lower(state, placed[0]).compile()
    compile_s = time.perf_counter() - t0
    mem = step.memory_analysis()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        state, metrics = step(state, placed[i % 2])
        jax.block_until_ready((state, metrics))
        elapsed = time.perf_counter() - start
        losses.append(float(metrics["loss_sum"] / metrics["weight_sum"]))
        if i >= args.warmup:
            times.append(elapsed)
    step_s = statistics.median(times)
    # The same steps back to back, synced once at the end: the host dispatches step i + 1 while
    # the device runs step i, as a training loop does (the synced step above also waits for the
    # host to dispatch it).
    start = time.perf_counter()
    for i in range(args.steps):
        state, metrics = step(state, placed[i % 2])
    jax.block_until_ready((state, metrics))
    loop_s = (time.perf_counter() - start) / args.steps
    profile = None
    if args.profile:
        from _step_profile import profile_steps

        held = [state]

        def one_step():
            held[0], m = step(held[0], placed[0])
            return held[0], m

        profile = profile_steps(one_step)
    tokens = args.batch * args.length
    peak = hardware.peak_flops(device.device_kind)
    stats = device.memory_stats() or {}
    out = {
        "implementation": args.child,
        "device": device.device_kind,
        "platform": device.platform,
        "params": n_params,
        "compile_s": round(compile_s, 1),
        "step_ms": 1e3 * step_s,
        "step_ms_all": [round(1e3 * t, 3) for t in times],
        "tokens_per_s": tokens / step_s,
        "model_tflop_per_step": step_flops / 1e12,
        "model_tflops": step_flops / step_s / 1e12,
        "mfu": step_flops / step_s / peak if peak else None,
        "loop_step_ms": 1e3 * loop_s,
        "loop_tokens_per_s": tokens / loop_s,
        "loop_mfu": step_flops / loop_s / peak if peak else None,
        "peak_flops": peak,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "scan_layers": not args.unscanned,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "profile": profile,
    }
    if mem is not None:
        out["compiled_bytes"] = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes
        )
    return out


def estimate(args: argparse.Namespace) -> dict:
    """The step compiled for `args.topology` (FSDP over its chips): a roofline estimate of its
    time and MFU from the compiled cost analysis and the chip's peak figures."""
    import dataclasses

    import jax
    import numpy as np

    from t5lite import partitioning, trainer
    from t5lite.cli import gin_config, registry
    from t5lite.insight import flops, topology
    from t5lite.model import models, optimizers

    topo = topology.get_topology(args.topology)
    gin_config.parse_gin([args.gin_file], args.gin)
    cfg = dataclasses.replace(
        registry.DecoderOnlyConfig(),
        precision=args.precision,
        remat_policy=args.remat,
        # NOTE: unscanned: XLA's cost analysis counts a while loop's body once, not once per
        # layer, so a scanned stack's FLOPs and bytes would be one layer's.
        scan_layers=False,
        attention_implementation=(args.attention or "xla").split(",")[0],
    )
    n = len(topo.devices)
    mesh = partitioning.create_mesh(1, devices=list(topo.devices))
    part = partitioning.Partitioner(mesh=mesh, logical_axis_rules=partitioning.preset_rules("fsdp"))
    model = models.DecoderOnlyModel(network_config=cfg, optimizer=optimizers.AdamW(1e-4))
    batch = args.batch * n
    tr = trainer.Trainer(model, part, batch_size=batch, lengths={"targets": args.length})
    shapes = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=tr.batch_shardings[k])
        for k, v in tr.batch_abstract.items()
    }
    with topology.quiet_stderr():
        compiled = tr.train_step.lower(tr.abstract_state(), shapes).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    spec = topo.spec
    compute_s = float(cost["flops"]) / spec.peak_flops
    memory_s = float(cost["bytes accessed"]) / spec.hbm_bytes_per_s
    step_s = max(compute_s, memory_s)
    ones = {"decoder_target_tokens": np.ones((batch, args.length), np.int32)}
    model_flops = flops.batch_train_flops(cfg, ones) / n  # per chip
    mem = compiled.memory_analysis()
    return {
        "topology": args.topology,
        "device": spec.device_kind,
        "devices": n,
        "estimate": True,
        "compiled_flops": float(cost["flops"]),
        "compiled_bytes_accessed": float(cost["bytes accessed"]),
        "estimated_step_ms": 1e3 * step_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "estimated_tokens_per_s": batch * args.length / step_s,
        "estimated_mfu": model_flops / step_s / spec.peak_flops,
        "compiled_bytes": mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes,
    }


def _estimate_main(args: argparse.Namespace) -> dict:
    r = estimate(args)
    print(
        f"{r['device']} x{r['devices']} ({r['topology']}), ESTIMATE from the compiled cost "
        f"analysis ({r['bound']}-bound roofline, collectives not counted): "
        f"{r['estimated_step_ms']:.1f} ms/step, {r['estimated_tokens_per_s']:.0f} tokens/s, "
        f"MFU {100 * r['estimated_mfu']:.1f}%, compiled {r['compiled_bytes'] / 2**30:.2f} GiB/chip",
        flush=True,
    )
    record = {
        "benchmark": "accelerator",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{r['device']} x{r['devices']} ({r['topology']}), compiled ahead of time: "
        f"an estimate; host {platform.node()}",
        "versions": versions(),
        "settings": {k: getattr(args, k) for k in ("gin_file", "gin", "batch", "length", "remat")},
        "results": [r],
        "figures": [
            {
                "name": "estimated MFU (roofline of the compiled step)",
                "value": r["estimated_mfu"],
                "unit": "fraction",
                "reference": None,
                "ratio": None,
                "goal": f">= {GOAL_MFU}",
                "met": r["estimated_mfu"] >= GOAL_MFU,
            }
        ],
    }
    write_record(record, args.out)
    return record


def kernel_check(implementations: list[str]) -> list[dict]:
    """Each implementation against `xla` on one attention call per mask kind, in bf16 on the
    default device: the largest difference of the output and of each gradient, relative to the
    largest magnitude of `xla`'s."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from t5lite.model import attention
    from t5lite.model.masks import MaskParts

    b, length, h, g, k = 2, 1024, 8, 2, 64
    rng = np.random.default_rng(0)
    q, key, v, cot = (
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        for shape in ((b, length, h, k), (b, length, g, k), (b, length, g, k), (b, length, h, k))
    )
    valid = jnp.arange(length)[None] < jnp.array([[length], [length - 256]])
    segments = jnp.where(jnp.arange(length)[None] < 300, 1, 2) * valid
    masks = {
        "causal": MaskParts(causal=True),
        "packed causal + padding": MaskParts(valid, valid, segments, segments, causal=True),
    }
    weight = valid[:, :, None, None].astype(jnp.bfloat16)  # splash: padding rows differ

    def run(impl, mask):
        def f(q, key, v):
            out = attention.dot_product_attention(
                q, key, v, None, mask, implementation=impl, dtype=jnp.bfloat16
            )
            return jnp.sum((out * weight * cot).astype(jnp.float32)), out * weight

        (_, out), grads = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(q, key, v)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    rows = []
    for name, mask in masks.items():
        want = run("xla", mask)
        for impl in implementations:
            if impl == "xla":
                continue
            try:
                got = run(impl, mask)
            except Exception as e:  # a refusal or a kernel the backend lacks: say which
                rows.append({"implementation": impl, "mask": name, "error": str(e)[:200]})
                continue
            # Relative to the reference's largest magnitude: bf16 keeps ~3 significant digits.
            diffs = [
                float(np.max(np.abs(a - w)) / max(np.max(np.abs(w)), 1e-30))
                for a, w in zip(got, want)
            ]
            rows.append({"implementation": impl, "mask": name, "max_abs_diff": diffs})
            print(
                f"  check {impl:>7} vs xla, {name}: out/dq/dk/dv max |diff| / max |xla| "
                + " ".join(f"{d:.3g}" for d in diffs),
                flush=True,
            )
    return rows


def versions() -> dict[str, str]:
    import flax
    import jax
    import jaxlib

    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
    }


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.child:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return {}
    if args.topology:
        return _estimate_main(args)

    # This process only looks at the device and runs the small attention check: it must not
    # take the accelerator's memory from the training processes it starts (JAX preallocates
    # 75% of a GPU's memory by default).
    child_env = dict(os.environ)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    backend = jax.default_backend()
    impls = args.attention or ("xla,cudnn,chunked" if backend == "gpu" else "xla,chunked")
    impls = [s.strip() for s in impls.split(",") if s.strip()]
    device_kind = jax.devices()[0].device_kind
    checks = kernel_check(impls) if not args.smoke and not args.no_check else []
    print(
        f"{device_kind} ({backend}), {args.gin_file}, batch {args.batch} x {args.length}, "
        f"remat {args.remat}, {args.precision}",
        flush=True,
    )
    results = []
    # Each (implementation, remat policy) pair trains in a process of its own; the first pair is
    # the reference. Several policies in one run: a lent accelerator's minutes go to one command.
    runs = [(impl, remat) for remat in args.remat_policies for impl in impls]
    for impl, remat in runs:
        label = impl if len(args.remat_policies) == 1 else f"{impl}/remat={remat}"
        cmd = [sys.executable, __file__, "--child", impl, *_forwarded(args, remat)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=child_env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            lines = (proc.stderr or proc.stdout).strip().splitlines() or ["(no output)"]
            # The reason is the last line of a Python error, or above a native stack trace.
            native = [i for i, x in enumerate(lines) if x.lstrip().startswith("@ ")]
            reason = lines[native[0] - 1] if native and native[0] > 0 else lines[-1]
            log = Path(args.out).with_suffix(f".{impl}.{remat}.log")
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(proc.stdout + proc.stderr)
            print(f"  {label}: failed: {reason} (whole output: {log})", flush=True)
            results.append({"implementation": impl, "remat": remat, "error": reason})
            continue
        r = json.loads(line[len("RESULT ") :])
        r["remat"], r["label"] = remat, label
        results.append(r)
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        peak = r["peak_bytes_in_use"]
        peak_s = f"{peak / 2**30:.2f} GiB" if peak else "n/a"
        loop_mfu = f"{100 * r['loop_mfu']:.1f}%" if r["loop_mfu"] is not None else "n/a"
        print(
            f"  {label:>6}: {r['step_ms']:9.1f} ms/step  {r['tokens_per_s']:10.0f} tokens/s  "
            f"MFU {mfu:>6}  (loop {r['loop_step_ms']:.1f} ms/step, MFU {loop_mfu})  "
            f"peak {peak_s}  compile {r['compile_s']} s  "
            f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}",
            flush=True,
        )
        if r.get("profile"):
            from _step_profile import print_profile

            print_profile(label, r["profile"])

    ok = [r for r in results if "error" not in r]
    figures = []
    ref = ok[0] if ok else None
    for r in ok:
        ratio = ref["step_ms"] / r["step_ms"] if ref else None
        figures.append(
            {
                "name": f"{r['label']} tokens/s",
                "value": r["tokens_per_s"],
                "unit": "tokens/s",
                "reference": ref["tokens_per_s"],
                "ratio": ratio,
                "goal": None,
                "met": None,
            }
        )
        for key, name in (("mfu", "MFU"), ("loop_mfu", "MFU, steps back to back")):
            if r[key] is not None:
                figures.append(
                    {
                        "name": f"{r['label']} {name}",
                        "value": r[key],
                        "unit": "fraction",
                        "reference": None,
                        "ratio": None,
                        "goal": f">= {GOAL_MFU}",
                        "met": r[key] >= GOAL_MFU,
                    }
                )
    record = {
        "benchmark": "accelerator",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{device_kind} ({backend}); host {platform.node()}",
        "versions": versions(),
        "settings": {
            k: getattr(args, k)
            for k in (
                "gin_file",
                "gin",
                "batch",
                "length",
                "steps",
                "warmup",
                "remat",
                "precision",
                "unscanned",
            )
        },
        "results": results,
        "kernel_check": checks,
        "figures": figures,
    }
    write_record(record, args.out)
    return record


def _forwarded(args: argparse.Namespace, remat: str) -> list[str]:
    """The child's command line: the parent's settings (the smoke preset already applied) with
    one remat policy."""
    out = ["--remat", remat]
    for k in ("gin_file", "batch", "length", "steps", "warmup", "precision"):
        out += [f"--{k}", str(getattr(args, k))]
    for binding in args.gin:
        out += ["--gin", binding]
    return out + [f"--{k}" for k in ("unscanned", "profile") if getattr(args, k)]


if __name__ == "__main__":
    main()
