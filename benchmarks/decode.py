"""Greedy decoding throughput: KV cache vs full recomputation, T5.1.1-small, batch 8, 128 tokens.

Goal (issue 7): the KV-cached decoder generates >= 5x more tokens/s than recomputing the whole
decoder over the full length at every step (the loop `predict_batch` used before the cache).
Both run in this process on the same weights (random init, T5.1.1-small: 8+8 layers, D=512,
H=6, F=1024, V=32128), inputs of 64 tokens, 128 new tokens per row, EOS disabled so every row
decodes all 128; the two must produce the same tokens. Each figure is the median of several
timed runs after a compile + warm-up run. Prints a table and writes one JSON record.

Then, unless `--no_hf`: t5lite's `predict_batch` against transformers' `generate()` on the same
weights (a random T5.1.1-small built by transformers, converted with `t5lite.hf.weights`), batch,
inputs and lengths, greedy and beam 4, EOS disabled on both sides, `--threads` cores for XLA and
as many torch threads; rounds alternate which side goes first. The greedy tokens must be
identical (else the run fails); goal >= 1.5x transformers' tokens/s for both.

`--no_recompute` skips the first part (its recomputing baseline is the slow one) to iterate on
the transformers comparison; the default runs both.

  python benchmarks/decode.py [--smoke] [--reps N] [--threads 2] [--no_hf] [--no_recompute]
                              [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark: no accelerator probing

import flax
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_record

from t5lite.model import models, network

SMALL = network.T5Config()  # T5.1.1 small
SMOKE = network.T5Config(
    vocab_size=256, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
    num_encoder_layers=2, num_decoder_layers=2,
)  # fmt: skip
GOAL = 5.0
NO_EOS = -1  # no token equals it: every row decodes the full length


def _decoders(model: models.EncoderDecoderModel, length: int):
    """(cached, recomputing) jitted greedy decoders: (params, inputs [B, S]) -> ids [B, length].

    The cached one is `predict_batch` itself (KV cache, cross-attention keys/values projected
    once); the other runs the whole teacher-forced decoder again at every position.
    """
    module = model.module()
    greedy = dataclasses.replace(model, eos_id=NO_EOS, decoding_method="greedy")

    def cached(params, enc):
        dec = jnp.zeros((enc.shape[0], length), jnp.int32)
        return greedy.predict_batch(
            params, {"encoder_input_tokens": enc, "decoder_input_tokens": dec}
        )

    def recompute(params, enc):
        encoded = module.apply({"params": params}, enc, enable_dropout=False, method=module.encode)
        b = enc.shape[0]

        def step(i, out):
            dec_in = jnp.pad(out[:, :-1], ((0, 0), (1, 0)))
            logits = module.apply(
                {"params": params}, encoded, enc, dec_in, enable_dropout=False,
                method=module.decode,
            )  # fmt: skip
            return out.at[:, i].set(jnp.argmax(logits[:, i], axis=-1).astype(out.dtype))

        return jax.lax.fori_loop(0, length, step, jnp.zeros((b, length), jnp.int32))

    return jax.jit(cached), jax.jit(recompute)


def _time(fn, *args, reps: int) -> tuple[float, np.ndarray]:
    out = jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), np.asarray(out)


def _hf_twin(cfg: network.T5Config, seed: int = 0):
    """A randomly initialised transformers T5 of `cfg`, and the same weights as t5lite params
    (written by `save_pretrained`, read by t5lite's own `import_hf`)."""
    import tempfile

    import torch
    import transformers

    from t5lite.hf import weights as hf_weights

    torch.manual_seed(seed)
    fields = hf_weights._t5_config_to_hf(cfg)
    fields = {k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype")}
    hf_cfg = transformers.T5Config(**fields, decoder_start_token_id=0, pad_token_id=0,
                                   eos_token_id=1)  # fmt: skip
    hf = transformers.T5ForConditionalGeneration(hf_cfg).eval()
    hf.generation_config.eos_token_id = None  # no EOS: every row generates every token
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        t5_cfg, params = hf_weights.import_hf(d)
    return hf, t5_cfg, params


def _vs_transformers(cfg, enc: np.ndarray, new: int, reps: int, threads: int) -> dict:
    """t5lite `predict_batch` vs transformers `generate()`, greedy and beam 4, same weights,
    inputs, lengths and threads; rounds alternate which side goes first."""
    import torch

    torch.set_num_threads(threads)
    hf, cfg, params = _hf_twin(cfg)  # the config as import_hf reads it back
    b, s = enc.shape
    batch = {"encoder_input_tokens": enc, "decoder_input_tokens": np.zeros((b, new), np.int32)}
    enc_t = torch.tensor(enc, dtype=torch.long)
    mask_t = torch.ones((b, s), dtype=torch.long)
    sides, out = {}, {}
    for method, beams in (("greedy", 1), ("beam4", 4)):
        # NO_EOS: t5lite never stops a row either; alpha is moot without finished beams.
        model = models.EncoderDecoderModel(network_config=cfg, eos_id=NO_EOS,
                                           decoding_method="beam" if beams > 1 else "greedy",
                                           beam_size=max(beams, 1))  # fmt: skip
        predict = jax.jit(model.predict_batch)

        def ours(predict=predict):
            return np.asarray(jax.block_until_ready(predict(params, batch)))

        def theirs(beams=beams):
            with torch.no_grad():
                ids = hf.generate(input_ids=enc_t, attention_mask=mask_t, max_new_tokens=new,
                                  do_sample=False, num_beams=beams,
                                  eos_token_id=None, pad_token_id=0)  # fmt: skip
            return ids.numpy()[:, 1:]  # without the decoder start token

        sides[f"t5lite_{method}"], sides[f"hf_{method}"] = ours, theirs
        ours()  # compile + warm-up
        theirs()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(reps):
        for method in ("greedy", "beam4"):
            order = ["t5lite", "hf"] if r % 2 == 0 else ["hf", "t5lite"]
            for who in order:
                key = f"{who}_{method}"
                t0 = time.perf_counter()
                out[key] = sides[key]()
                times[key].append(time.perf_counter() - t0)
    methods = ("greedy", "beam4")
    same = {m: bool(np.array_equal(out[f"t5lite_{m}"], out[f"hf_{m}"])) for m in methods}
    if not same["greedy"]:
        raise SystemExit("t5lite and transformers greedy tokens differ: the comparison is void")
    return {"times": times, "same_tokens": same, "tokens": b * new}


def _vs_recompute(cfg, enc: jax.Array, new: int, reps: int) -> tuple[list[dict], dict]:
    """KV-cached `predict_batch` vs recomputing the decoder at every position (same tokens):
    (figures, settings), and prints its table."""
    model = models.EncoderDecoderModel(network_config=cfg)
    batch = enc.shape[0]
    dummy = {
        "encoder_input_tokens": enc,
        "decoder_input_tokens": jnp.zeros((batch, new), jnp.int32),
    }
    params = jax.jit(lambda r: flax.core.meta.unbox(model.init(r, dummy))["params"])(
        jax.random.PRNGKey(0)
    )
    cached, recompute = _decoders(model, new)
    t_cached, ids_cached = _time(cached, params, enc, reps=reps)
    t_full, ids_full = _time(recompute, params, enc, reps=reps)
    same = bool(np.array_equal(ids_cached, ids_full))
    tokens = batch * new
    tps_cached, tps_full = tokens / t_cached, tokens / t_full
    ratio = tps_cached / tps_full
    figures = [
        {"name": "greedy_tokens_per_s_kv_cache", "value": round(tps_cached, 1), "unit": "tokens/s",
         "reference": round(tps_full, 1), "ratio": round(ratio, 2), "goal": f">= {GOAL}",
         "met": bool(ratio >= GOAL and same)},
        {"name": "greedy_tokens_per_s_recompute", "value": round(tps_full, 1), "unit": "tokens/s",
         "reference": None, "ratio": None, "goal": None, "met": None},
    ]  # fmt: skip
    print(f"{'decoder':<12} {'seconds':>9} {'tokens/s':>10}")
    print(f"{'kv cache':<12} {t_cached:>9.3f} {tps_cached:>10.1f}")
    print(f"{'recompute':<12} {t_full:>9.3f} {tps_full:>10.1f}")
    print(f"speed-up {ratio:.1f}x (goal >= {GOAL}x): met={figures[0]['met']}; same tokens: {same}")
    settings = {"same_tokens": same, "seconds_kv_cache": round(t_cached, 4),
                "seconds_recompute": round(t_full, 4)}  # fmt: skip
    return figures, settings


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 16 tokens, 1 repetition")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per figure (median)")
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    ap.add_argument("--threads", type=int, default=2, help="cores for XLA and torch threads")
    ap.add_argument("--no_hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--no_recompute", action="store_true",
                    help="skip KV cache vs recomputation (its slow baseline), e.g. to iterate on "
                    "the transformers comparison")  # fmt: skip
    args = ap.parse_args(argv)
    # Before JAX starts its CPU backend: XLA's thread pool then spans exactly these cores, and
    # torch gets as many threads.
    cores = sorted(os.sched_getaffinity(0))
    if 0 < args.threads < len(cores):
        os.sched_setaffinity(0, cores[: args.threads])
    cfg = SMOKE if args.smoke else SMALL
    batch, input_len, new = (8, 16, 16) if args.smoke else (8, 64, 128)
    reps = 1 if args.smoke else max(3, args.reps)
    enc = jax.random.randint(jax.random.PRNGKey(1), (batch, input_len), 2, cfg.vocab_size)
    figures, settings = [], {}
    if not args.no_recompute:
        figures, settings = _vs_recompute(cfg, enc, new, reps)
    hf = None
    if not args.no_hf:
        try:
            import torch
            import transformers
        except ImportError:
            print("transformers/torch not installed (pip install -e .[hf]): no HF comparison")
        else:
            hf = _vs_transformers(cfg, np.asarray(enc), new, reps, args.threads)
    device = jax.devices()[0]
    record = {
        "benchmark": "decode",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"{device.platform} ({device.device_kind})".strip(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "flax": flax.__version__},
        "settings": {"reps": reps, "smoke": args.smoke, "batch": batch, "inputs_length": input_len,
                     "new_tokens": new, "config": dataclasses.asdict(cfg), **settings},
        "figures": figures,
    }  # fmt: skip
    if hf is not None:
        import torch
        import transformers

        hf_figures = _hf_figures(hf)
        figures += hf_figures
        record["versions"].update(torch=torch.__version__, transformers=transformers.__version__)
        record["settings"].update(threads=args.threads, torch_threads=torch.get_num_threads(),
                                  same_tokens_as_hf=hf["same_tokens"],
                                  seconds_vs_hf={k: [round(x, 4) for x in v]
                                                 for k, v in hf["times"].items()})  # fmt: skip
        print(f"\nvs transformers generate() ({args.threads} threads, same weights), tokens/s:")
        for f in hf_figures:
            print(f"  {f['name']:<32} {f['value']:>9.1f} vs {f['reference']:>9.1f} "
                  f"= {f['ratio']:.2f}x (goal {f['goal']}: met={f['met']})")  # fmt: skip
        print(f"  same tokens: {hf['same_tokens']}")
    write_record(record, args.out)
    return record


def _hf_figures(hf: dict) -> list[dict]:
    """tokens/s of each side (medians) and the median of per-round speed-ups."""
    figures = []
    for method in ("greedy", "beam4"):
        ours, theirs = hf["times"][f"t5lite_{method}"], hf["times"][f"hf_{method}"]
        ratio = statistics.median(t / o for o, t in zip(ours, theirs))
        same = hf["same_tokens"][method]
        figures.append({
            "name": f"{method}_tokens_per_s_vs_transformers",
            "value": round(hf["tokens"] / statistics.median(ours), 1), "unit": "tokens/s",
            "reference": round(hf["tokens"] / statistics.median(theirs), 1),
            "ratio": round(ratio, 3), "goal": ">= 1.5",
            "met": bool(ratio >= 1.5 and (same or method != "greedy")),
        })  # fmt: skip
    return figures


if __name__ == "__main__":
    main()
