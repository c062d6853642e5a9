"""Training tokens/s on one CPU device: t5lite vs a bare `jax.jit` step vs PyTorch (Hugging Face).

T5.1.1-small (d_model 512, 6 heads x 64, 8+8 layers, d_ff 1024 gated-GELU, vocab 32128, untied
output layer, one input embedding shared by encoder and decoder: 76,961,152 parameters), batch 8,
128 input and 32 target tokens, AdamW (same hyper-parameters everywhere, no clipping), fp32,
dropout 0. Three sides, in one process, on the same random token batches and the same initial
weights (t5lite's initialisation, copied into the PyTorch model through `hf_convert.export_hf`):

  t5lite  the framework path: `Partitioner` on a 1-device mesh, `EncoderDecoderModel`,
          `Trainer.init_state`, `Trainer.train_step(state, Trainer.global_batch(batch))`.
  bare    a hand-written `jax.jit` step of the same network `apply`: optax.adamw, cross-entropy +
          z-loss 1e-4 normalised per real target token, value_and_grad, donated state.
  torch   transformers' `T5ForConditionalGeneration` + `torch.optim.AdamW`, the same loss
          (cross-entropy + 1e-4 * logsumexp**2, per real token) computed from the logits.

Tokens per step = batch x (input length + target length) = 8 x (128 + 32) = 1280 (the issue's
definition). Each step is timed end to end (host batch -> device, step, block on the result).
The sides are interleaved step by step so that load from other processes falls on all of them
alike: round r runs PyTorch, then the t5lite and bare steps in an order that alternates every round
(running right after PyTorch is slower, so both JAX sides take that place equally often). Figures
are medians over the timed rounds, after one compile step and the warm-up rounds.

Threads: `--threads N` (default 2) sets `torch.set_num_threads(N)`; XLA CPU uses its default
thread pool (all cores the process may run on). When N is below the core count the whole process
is pinned to N cores first (`sched_setaffinity`), so both sides use the same N.

Goals (issue 20): t5lite tokens/s >= 1.0x PyTorch (aim 1.1x); step time <= 1.02x the bare jit step.
Besides the timings, the record holds two deterministic figures: XLA's cost analysis of both JAX
steps (flops and bytes of memory traffic: equal work means equal numbers), and the machine's
peak fp32 matmul rate (XLA and PyTorch, 2048^3) against the rate the speed goal would need for
the step's flop count (`feasibility`).

    python benchmarks/train_throughput.py [--steps 12] [--warmup 2] [--threads 2] [--out PATH]
    python benchmarks/train_throughput.py --smoke   # tiny model, 2 timed steps; torch optional
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_record

GOAL_SPEEDUP = 1.0  # t5lite tokens/s over PyTorch (issue 20: >= 1.0, aim 1.1)
GOAL_OVERHEAD = 1.02  # t5lite step time over the bare jit step
ISSUE_TORCH_TOKENS_PER_S = 672.0  # the issue's PyTorch figure on this kind of machine
LR, B1, B2, EPS, WD, Z_LOSS = 1e-4, 0.9, 0.999, 1e-8, 0.01, 1e-4


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 timed steps (CI)")
    ap.add_argument("--steps", type=int, default=12, help="timed rounds (median; at least 5)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds after the compile step")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (and cores pinned)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    ap.add_argument("--out", default="benchmarks/results/train_throughput.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup = 2, 1
    elif args.steps < 5 or args.warmup < 2:
        ap.error("use --steps >= 5 and --warmup >= 2 (or --smoke)")
    return args


def _pin_threads(threads: int) -> str:
    """Pins the process to `threads` cores when fewer than it may use (before JAX starts)."""
    cores = sorted(os.sched_getaffinity(0))
    if 0 < threads < len(cores):
        os.sched_setaffinity(0, cores[:threads])
        return f"process pinned to cores {cores[:threads]}; XLA CPU default pool on them"
    return f"XLA CPU default thread pool: all {len(cores)} cores of this process"


def _cost(compiled) -> dict[str, float]:
    """XLA's own count of one compiled step's work: flops and bytes of memory traffic."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"gflop": cost["flops"] / 1e9, "gbytes_accessed": cost["bytes accessed"] / 1e9}


def _peak_sgemm_gflops(n: int, seconds: float = 1.5) -> dict[str, float]:
    """This machine's fp32 matmul rate, n x n x n, on XLA and (if installed) PyTorch/MKL.

    The ceiling for any fp32 training step here: a step is matmuls (at best this fast) plus
    elementwise work, so a step's effective GFLOP/s cannot exceed this.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    flop = 2.0 * n**3
    out = {}

    def rate(fn) -> float:
        fn()
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or reps < 3:
            fn()
            reps += 1
        return flop * reps / (time.perf_counter() - t0) / 1e9

    x = jnp.asarray(a)
    mm = jax.jit(jnp.matmul)
    out["xla"] = rate(lambda: mm(x, x).block_until_ready())
    try:
        import torch
    except ImportError:
        return out
    t = torch.from_numpy(a)
    out["torch"] = rate(lambda: torch.mm(t, t))
    return out


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark: skip probing accelerators
    xla_threads = _pin_threads(args.threads)
    load_before = _load()

    import flax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from t5lite import partitioning, trainer
    from t5lite.hf import weights as hf_convert
    from t5lite.model import models, network, optimizers
    from t5lite.model.losses import cross_entropy_with_logits

    try:
        if args.no_torch:
            raise ImportError("--no-torch")
        import torch
        import transformers
    except ImportError as e:
        if not args.smoke:
            raise SystemExit(f"train_throughput: the PyTorch baseline needs torch and "
                             f"transformers (the [hf] extra): {e}") from None  # fmt: skip
        torch = transformers = None

    if args.smoke:
        cfg = network.T5Config(vocab_size=256, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
                               num_encoder_layers=2, num_decoder_layers=2)  # fmt: skip
        batch_size, lengths = 2, {"inputs": 16, "targets": 8}
    else:
        cfg = network.T5Config()  # T5.1.1 small
        batch_size, lengths = 8, {"inputs": 128, "targets": 32}
    tokens_per_step = batch_size * (lengths["inputs"] + lengths["targets"])

    # --- data: random tokens in [2, V) (no padding, no EOS), the same on every side -----------
    rng = np.random.default_rng(0)
    n_batches = 4
    batches = []
    for _ in range(n_batches):
        inputs = rng.integers(2, cfg.vocab_size, (batch_size, lengths["inputs"]), dtype=np.int32)
        targets = rng.integers(2, cfg.vocab_size, (batch_size, lengths["targets"]), dtype=np.int32)
        dec_in = np.concatenate([np.zeros((batch_size, 1), np.int32), targets[:, :-1]], axis=1)
        batches.append({"encoder_input_tokens": inputs, "decoder_input_tokens": dec_in,
                        "decoder_target_tokens": targets,
                        "decoder_loss_weights": np.ones_like(targets)})  # fmt: skip

    # --- t5lite: the framework path on a 1-device mesh ------------------------------------------
    device = jax.devices()[0]
    mesh = partitioning.create_mesh(1, devices=[device])
    partitioner = partitioning.Partitioner(mesh=mesh)
    opt = optimizers.AdamW(LR, B1, B2, EPS, weight_decay=WD, clip_norm=None)
    model = models.EncoderDecoderModel(cfg, optimizer=opt, z_loss=Z_LOSS)
    tr = trainer.Trainer(model, partitioner, batch_size=batch_size, lengths=lengths)
    state = tr.init_state()
    params0 = jax.device_get(state.params)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params0))

    def t5lite_step() -> float:
        nonlocal state
        state, metrics = tr.train_step(state, tr.global_batch(batches[t5lite_step.i % n_batches]))
        jax.block_until_ready((state, metrics))
        t5lite_step.i += 1
        return float(metrics["loss_sum"] / metrics["weight_sum"])

    t5lite_step.i = 0

    # --- bare jax.jit step of the same network --------------------------------------------------
    module = network.EncoderDecoder(cfg)
    tx = optax.adamw(LR, B1, B2, EPS, weight_decay=WD)

    def bare_loss(params, b):
        logits = module.apply({"params": params}, b["encoder_input_tokens"],
                              b["decoder_input_tokens"], b["decoder_target_tokens"],
                              enable_dropout=False)  # fmt: skip
        tok, _ = cross_entropy_with_logits(logits, b["decoder_target_tokens"], Z_LOSS)
        w = b["decoder_loss_weights"].astype(jnp.float32)
        return jnp.sum(tok * w) / jnp.maximum(jnp.sum(w), 1.0)

    @jax.jit
    def bare_init(params):
        return params, tx.init(params)

    def _bare_train(params, opt_state, b):
        loss, grads = jax.value_and_grad(bare_loss)(params, b)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    bare_train = jax.jit(_bare_train, donate_argnums=(0, 1))
    bare_params, bare_opt = bare_init(jax.device_put(params0, device))

    def bare_step() -> float:
        nonlocal bare_params, bare_opt
        b = jax.device_put(batches[bare_step.i % n_batches], device)
        bare_params, bare_opt, loss = bare_train(bare_params, bare_opt, b)
        jax.block_until_ready((bare_params, bare_opt, loss))
        bare_step.i += 1
        return float(loss)

    bare_step.i = 0

    sides = {"t5lite": t5lite_step, "bare_jit": bare_step}

    # --- PyTorch: transformers T5ForConditionalGeneration, same weights ------------------------
    hf_params = None
    if torch is not None:
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        hf_cfg = transformers.T5Config(
            vocab_size=cfg.vocab_size, d_model=cfg.emb_dim, d_kv=cfg.head_dim, d_ff=cfg.mlp_dim,
            num_layers=cfg.num_encoder_layers, num_decoder_layers=cfg.num_decoder_layers,
            num_heads=cfg.num_heads, relative_attention_num_buckets=cfg.relpos_num_buckets,
            relative_attention_max_distance=cfg.relpos_max_distance, dropout_rate=0.0,
            layer_norm_epsilon=cfg.layer_norm_epsilon, feed_forward_proj="gated-gelu",
            decoder_start_token_id=0, pad_token_id=0, use_cache=False,
            tie_word_embeddings=False,
        )  # fmt: skip
        # NOTE: transformers 5.x keeps tie_word_embeddings=True from the constructor; untie the
        # lm_head after construction, and re-share the encoder/decoder input embeddings (T5).
        hf_cfg.tie_word_embeddings = False
        hf = transformers.T5ForConditionalGeneration(hf_cfg)
        hf.encoder.embed_tokens = hf.decoder.embed_tokens = hf.shared
        assert hf.lm_head.weight is not hf.shared.weight, "lm_head must be untied"
        assert getattr(hf_cfg, "scale_decoder_outputs", False) is False
        with tempfile.TemporaryDirectory() as tmp:  # t5lite's initial weights -> HF layout
            from safetensors.torch import load_file

            hf_convert.export_hf(cfg, params0, tmp)
            sd = load_file(os.path.join(tmp, "model.safetensors"))
        missing, unexpected = hf.load_state_dict(sd, strict=False)
        assert not unexpected and not [m for m in missing if "embed_tokens" not in m], (
            missing, unexpected)  # fmt: skip
        assert hf.encoder.embed_tokens.weight is hf.shared.weight
        hf.train()
        hf_params = sum(p.numel() for p in hf.parameters())  # shared tensors counted once
        torch_opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(B1, B2), eps=EPS,
                                      weight_decay=WD)  # fmt: skip

        def torch_step() -> float:
            b = batches[torch_step.i % n_batches]
            inp = torch.from_numpy(b["encoder_input_tokens"]).long()
            dec = torch.from_numpy(b["decoder_input_tokens"]).long()
            tgt = torch.from_numpy(b["decoder_target_tokens"]).long()
            w = torch.from_numpy(b["decoder_loss_weights"]).float()
            torch_opt.zero_grad(set_to_none=True)
            logits = hf(input_ids=inp, decoder_input_ids=dec, use_cache=False).logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            tok = lse - logits.gather(-1, tgt[..., None])[..., 0] + Z_LOSS * lse.square()
            loss = (tok * w).sum() / w.sum().clamp(min=1.0)
            loss.backward()
            torch_opt.step()
            torch_step.i += 1
            return float(loss.detach())

        torch_step.i = 0
        sides["torch"] = torch_step

    hf_note = f", transformers {hf_params:,}" if hf_params else ""
    print(f"parameters: t5lite {n_params:,}{hf_note}")
    if hf_params is not None and hf_params != n_params:
        raise SystemExit(f"parameter counts differ: t5lite {n_params:,} vs HF {hf_params:,}")

    # --- compile (untimed beyond its own figure), warm-up, interleaved timed rounds ------------
    names = list(sides)
    compile_s, first_loss = {}, {}
    for n in names:
        t0 = time.perf_counter()
        first_loss[n] = sides[n]()
        compile_s[n] = time.perf_counter() - t0
    print("step-0 loss (same weights, same batch): "
          + ", ".join(f"{n} {first_loss[n]:.6f}" for n in names))  # fmt: skip
    # Same work on both JAX sides, by XLA's own count (flops and memory traffic per step).
    cost = {
        "t5lite": _cost(tr.train_step.lower(state, tr.global_batch(batches[0])).compile()),
        "bare_jit": _cost(
            bare_train.lower(bare_params, bare_opt, jax.device_put(batches[0], device)).compile()
        ),
    }
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.warmup + args.steps):
        # PyTorch first, then the two JAX sides in alternating order, so that each of them
        # follows PyTorch (whose threads and freed memory perturb the next step) equally often.
        jax_sides = ["t5lite", "bare_jit"] if r % 2 == 0 else ["bare_jit", "t5lite"]
        order = [n for n in names if n not in jax_sides] + jax_sides
        for n in order:
            t0 = time.perf_counter()
            loss = sides[n]()
            dt = time.perf_counter() - t0
            losses[n].append(loss)
            if r >= args.warmup:
                times[n].append(dt)
    load_after = _load()
    peak = _peak_sgemm_gflops(256 if args.smoke else 2048)

    med = {n: statistics.median(times[n]) for n in names}
    tps = {n: tokens_per_step / med[n] for n in names}
    overhead = med["t5lite"] / med["bare_jit"]
    paired = statistics.median(a / b for a, b in zip(times["t5lite"], times["bare_jit"]))
    figures = []
    if "torch" in names:
        speedup = tps["t5lite"] / tps["torch"]
        figures.append(
            {"name": "t5lite_train_tokens_per_s", "value": round(tps["t5lite"], 1),
             "unit": "tokens/s", "reference": round(tps["torch"], 1),
             "ratio": round(speedup, 3), "goal": f">= {GOAL_SPEEDUP}",
             "met": bool(speedup >= GOAL_SPEEDUP)}
        )  # fmt: skip
    else:
        figures.append(
            {"name": "t5lite_train_tokens_per_s", "value": round(tps["t5lite"], 1),
             "unit": "tokens/s", "reference": None, "ratio": None, "goal": f">= {GOAL_SPEEDUP}",
             "met": None}
        )  # fmt: skip
    figures.append(
        {"name": "t5lite_step_s_vs_bare_jit", "value": round(med["t5lite"], 4), "unit": "s",
         "reference": round(med["bare_jit"], 4), "ratio": round(overhead, 4),
         "goal": f"<= {GOAL_OVERHEAD}", "met": bool(overhead <= GOAL_OVERHEAD)}
    )  # fmt: skip
    if "torch" in names:
        ratio = tps["torch"] / ISSUE_TORCH_TOKENS_PER_S
        figures.append(
            {"name": "torch_train_tokens_per_s", "value": round(tps["torch"], 1),
             "unit": "tokens/s", "reference": ISSUE_TORCH_TOKENS_PER_S if not args.smoke else None,
             "ratio": round(ratio, 3) if not args.smoke else None, "goal": None, "met": None}
        )  # fmt: skip

    # Feasibility of the speed goal: the GFLOP/s that GOAL_SPEEDUP x PyTorch's step rate would
    # take, for the step's own flop count, against this machine's matmul peak.
    step_gflop = cost["bare_jit"]["gflop"]
    effective = {n: step_gflop / med[n] for n in names}
    best_peak = max(peak.values())
    feasibility = {
        "step_gflop": round(step_gflop, 2),
        "effective_gflops": {n: round(v, 1) for n, v in effective.items()},
        "peak_sgemm_gflops": {k: round(v, 1) for k, v in peak.items()},
        "fraction_of_peak": {n: round(v / best_peak, 3) for n, v in effective.items()},
    }
    if "torch" in names:
        need = GOAL_SPEEDUP * effective["torch"]
        feasibility["goal_needs_gflops"] = round(need, 1)
        feasibility["goal_needs_fraction_of_peak"] = round(need / best_peak, 3)

    record = {
        "benchmark": "train_throughput",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"{jax.devices()[0].platform}".replace("  ", " "),
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "flax": flax.__version__, "optax": optax.__version__,
                     **({"torch": torch.__version__, "transformers": transformers.__version__}
                        if torch is not None else {})},
        "settings": {
            "smoke": args.smoke, "config": dataclasses.asdict(cfg), "batch": batch_size,
            "lengths": lengths, "parameters": n_params, "hf_parameters": hf_params,
            "tokens_per_step": tokens_per_step,
            "tokens_definition": "batch x (input length + target length) per step",
            "optimizer": {"name": "AdamW", "lr": LR, "b1": B1, "b2": B2, "eps": EPS,
                          "weight_decay": WD, "clip_norm": None},
            "loss": f"cross-entropy + {Z_LOSS} * logsumexp^2, per real target token",
            "threads": {"torch": args.threads if torch is not None else None,
                        "xla": xla_threads},
            "timing": "one step of each side per round: torch, then t5lite and bare_jit in an "
            "order alternating every round; wall time of host batch -> step -> "
            "block_until_ready; medians over timed rounds",
            "warmup_rounds": args.warmup, "timed_rounds": args.steps,
            "load_avg_1_5_15": {"before": load_before, "after": load_after},
        },
        "results": {
            n: {"median_step_s": round(med[n], 4), "min_step_s": round(min(times[n]), 4),
                "tokens_per_s": round(tps[n], 1),
                "compile_and_first_step_s": round(compile_s[n], 2),
                "step_s": [round(t, 4) for t in times[n]],
                "first_loss": first_loss[n], "last_loss": losses[n][-1]}
            for n in names
        },
        "framework_overhead_pct": {"ratio_of_medians": round(100 * (overhead - 1), 2),
                                   "median_of_paired_ratios": round(100 * (paired - 1), 2)},
        "step_cost": {n: {k: round(v, 4) for k, v in c.items()} for n, c in cost.items()},
        "feasibility": feasibility,
        "figures": figures,
    }  # fmt: skip

    if max(load_before[0], load_after[0]) > (os.cpu_count() or 1):
        warning = (
            f"machine loaded (1-min load above {os.cpu_count()} cpus): the sides share it "
            "alike, but PyTorch's threads suffer most; treat the ratio with care"
        )
        record["settings"]["load_warning"] = warning
        print("WARNING:", warning)
    print(f"load average (1/5/15 min): before {load_before}, after {load_after}; "
          f"{os.cpu_count()} cpus; {xla_threads}; torch threads {args.threads}")  # fmt: skip
    print(f"tokens/step = {batch_size} x ({lengths['inputs']} + {lengths['targets']}) = "
          f"{tokens_per_step}; medians of {args.steps} interleaved rounds after "
          f"{args.warmup} warm-up rounds")  # fmt: skip
    print(f"{'side':<9} {'step s (median)':>16} {'tokens/s':>9} {'compile+1st s':>14} "
          f"{'loss 0 -> last':>22}")  # fmt: skip
    for n in names:
        print(f"{n:<9} {med[n]:>16.4f} {tps[n]:>9.1f} {compile_s[n]:>14.2f} "
              f"{first_loss[n]:>10.5f} -> {losses[n][-1]:<10.5f}")  # fmt: skip
    for f in figures:
        print(f"{f['name']:<28} value={f['value']} {f['unit']} reference={f['reference']} "
              f"ratio={f['ratio']} goal={f['goal']} met={f['met']}")  # fmt: skip
    print(f"framework overhead: {100 * (overhead - 1):+.2f}% (ratio of medians), "
          f"{100 * (paired - 1):+.2f}% (median of per-round ratios)")  # fmt: skip
    print(
        "XLA step cost: "
        + ", ".join(
            f"{n} {c['gflop']:.2f} GFLOP {c['gbytes_accessed']:.3f} GB" for n, c in cost.items()
        )
    )
    print(
        f"peak fp32 matmul (GFLOP/s): {feasibility['peak_sgemm_gflops']}; effective: "
        f"{feasibility['effective_gflops']}; fraction of peak {feasibility['fraction_of_peak']}"
    )
    if "goal_needs_gflops" in feasibility:
        print(
            f"{GOAL_SPEEDUP}x PyTorch needs {feasibility['goal_needs_gflops']} GFLOP/s = "
            f"{feasibility['goal_needs_fraction_of_peak']:.0%} of the peak matmul rate"
        )
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
