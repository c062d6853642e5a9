"""Greedy decoding throughput: KV cache vs full recomputation, T5.1.1-small, batch 8, 128 tokens.

Goal (issue 7): the KV-cached decoder generates >= 5x more tokens/s than recomputing the whole
decoder over the full length at every step (the loop `predict_batch` used before the cache).
Both run in this process on the same weights (random init, T5.1.1-small: 8+8 layers, D=512,
H=6, F=1024, V=32128), inputs of 64 tokens, 128 new tokens per row, EOS disabled so every row
decodes all 128; the two must produce the same tokens. Each figure is the median of several
timed runs after a compile + warm-up run. Prints a table and writes one JSON record.

  python benchmarks/decode.py [--smoke] [--reps N] [--out PATH]
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

import flax
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _record import write_record

from t5lite.model import decoding, models, network

SMALL = network.T5Config()  # T5.1.1 small
SMOKE = network.T5Config(
    vocab_size=256, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64,
    num_encoder_layers=2, num_decoder_layers=2,
)  # fmt: skip
GOAL = 5.0
NO_EOS = -1  # no token equals it: every row decodes the full length


def _decoders(model: models.EncoderDecoderModel, length: int):
    """(cached, recomputing) jitted greedy decoders: (params, inputs [B, S]) -> ids [B, length]."""
    module = model.module()

    def encode(params, enc):
        return module.apply({"params": params}, enc, enable_dropout=False, method=module.encode)

    def cached(params, enc):
        encoded = encode(params, enc)
        b = enc.shape[0]

        def call(cache, tokens):
            variables = {"params": params, **({"cache": cache} if cache is not None else {})}
            return module.apply(
                variables, encoded, enc, tokens, enable_dropout=False, decode=True,
                max_decode_length=length, method=module.decode, mutable=["cache"],
            )  # fmt: skip

        cache = models._zero_cache(lambda: call(None, jnp.zeros((b, length), jnp.int32)))

        def tokens_to_logits(state):
            logits, variables = call(state.cache, state.cur_token)
            return logits[:, -1], variables["cache"]

        prompt = jnp.zeros((b, length), jnp.int32)
        seqs, _ = decoding.greedy(prompt, cache, tokens_to_logits, eos_id=NO_EOS)
        return seqs[:, 0]

    def recompute(params, enc):
        encoded = encode(params, enc)
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 16 tokens, 1 repetition")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per figure (median)")
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    args = ap.parse_args(argv)
    cfg = SMOKE if args.smoke else SMALL
    batch, input_len, new = (8, 16, 16) if args.smoke else (8, 64, 128)
    reps = 1 if args.smoke else max(3, args.reps)

    model = models.EncoderDecoderModel(network_config=cfg)
    enc = jax.random.randint(jax.random.PRNGKey(1), (batch, input_len), 2, cfg.vocab_size)
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
    device = jax.devices()[0]
    record = {
        "benchmark": "decode",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"{device.platform} ({device.device_kind})".strip(),
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "flax": flax.__version__},
        "settings": {"reps": reps, "smoke": args.smoke, "batch": batch, "inputs_length": input_len,
                     "new_tokens": new, "config": dataclasses.asdict(cfg),
                     "same_tokens": same, "seconds_kv_cache": round(t_cached, 4),
                     "seconds_recompute": round(t_full, 4)},
        "figures": figures,
    }  # fmt: skip

    print(f"{'decoder':<12} {'seconds':>9} {'tokens/s':>10}")
    print(f"{'kv cache':<12} {t_cached:>9.3f} {tps_cached:>10.1f}")
    print(f"{'recompute':<12} {t_full:>9.3f} {tps_full:>10.1f}")
    print(f"speed-up {ratio:.1f}x (goal >= {GOAL}x): met={figures[0]['met']}; same tokens: {same}")
    write_record(record, args.out)
    return record


if __name__ == "__main__":
    main()
