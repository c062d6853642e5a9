"""Tokens per second of tokenize + pack: seqio_lite vs a bare grain pipeline doing the same work.

For an LM task and an encoder-decoder task on the shipped tiny corpus (SentencePiece
tokenisation, trim + EOS, greedy packing, t5x model features), with 0 and 2 grain workers,
each measured beside a hand-written grain pipeline of the same work in the same run (grain's
own `FirstFitPackIterDataset` packs there). Figures are medians over repetitions; a token is a
non-padding id in any model input (encoder + decoder targets).

Goal 1: seqio_lite >= 0.9x bare grain. Goal 2: the quickstart's own pipeline (synthetic_reverse,
lengths 24/24, batch 32, packed) delivers >= 10x the tokens per second that the quickstart's
train step (configs/quickstart.gin: tiny T5 on 8 fake CPU devices, mesh 2x4) consumes, both
measured here in the same run.

    python benchmarks/data_pipeline.py [--smoke] [--out PATH] [--reps 3] [--batches 60]
"""

from __future__ import annotations

import os

# The quickstart figure needs the quickstart's 8 fake CPU devices, set before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import functools
import platform
import statistics
import time

import grain
import numpy as np
from _record import write_record  # benchmarks/, the script's own directory

import seqio_lite as sl
from seqio_lite import preprocessors as prep
from seqio_lite import tasks as embedded

BATCH = 16
LM_LEN = {"targets": 256}
ENCDEC_LEN = {"inputs": 128, "targets": 128}


def _lines() -> list[str]:
    with open(os.path.join(embedded.TINY_CORPUS_DIR, "train.txt")) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def _vocab() -> sl.SentencePieceVocabulary:
    return sl.SentencePieceVocabulary(embedded.SPM_MODEL)


# -- the seqio_lite side -----------------------------------------------------------------------


def _tasks() -> dict[str, sl.Task]:
    lines = _lines()
    vocab = _vocab()
    src = sl.InMemorySource({"train": [{"text": t} for t in lines]}, name="bench_corpus")
    steps = [prep.tokenize, prep.append_eos_after_trim]
    lm = sl.Task(
        "bench_lm",
        src,
        {"targets": sl.Feature(vocab)},
        [functools.partial(prep.rekey, key_map={"targets": "text"}), *steps],
    )
    encdec = sl.Task(
        "bench_encdec",
        src,
        {"inputs": sl.Feature(vocab), "targets": sl.Feature(vocab)},
        [functools.partial(prep.rekey, key_map={"inputs": "text", "targets": "text"}), *steps],
    )
    return {"lm": lm, "encdec": encdec}


def seqio_lite_iter(kind: str, workers: int):
    task = _tasks()[kind]
    lengths = LM_LEN if kind == "lm" else ENCDEC_LEN
    return sl.get_dataset(task, lengths, batch_size=BATCH, seed=0, num_workers=workers)


# -- the bare grain side -----------------------------------------------------------------------


class _Tokenize(grain.transforms.Map):
    """Text -> trimmed ids + EOS for the given features (what the task's preprocessors do)."""

    def __init__(self, features: dict[str, int]):
        self._features = features
        self._vocab = _vocab()

    def map(self, text: str) -> dict[str, np.ndarray]:
        out = {}
        for name, length in self._features.items():
            ids = self._vocab.encode_np(text)[: length - 1]
            out[name] = np.append(ids, np.int32(1)).astype(np.int32)
        return out


def _model_features(batch: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    """grain's packed output -> t5x features: shift targets right within each segment."""
    tgt, seg = batch["targets"], batch["targets_segment_ids"]
    shifted = np.zeros_like(tgt)
    shifted[:, 1:] = tgt[:, :-1]
    shifted[:, 1:][seg[:, 1:] != seg[:, :-1]] = 0
    shifted[batch["targets_positions"] == 0] = 0
    out = {
        "decoder_target_tokens": tgt,
        "decoder_input_tokens": shifted,
        "decoder_loss_weights": (tgt != 0).astype(np.int32),
        "decoder_segment_ids": seg,
        "decoder_positions": batch["targets_positions"],
    }
    if kind == "encdec":
        out["encoder_input_tokens"] = batch["inputs"]
        out["encoder_segment_ids"] = batch["inputs_segment_ids"]
        out["encoder_positions"] = batch["inputs_positions"]
    return out


def bare_grain_iter(kind: str, workers: int):
    lengths = LM_LEN if kind == "lm" else ENCDEC_LEN
    ds = grain.MapDataset.source(_lines()).shuffle(seed=0).repeat(None)
    ds = ds.map(_Tokenize(lengths))
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=256))
    if workers:
        it_ds = it_ds.mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=8)
        )
    it_ds = grain.experimental.FirstFitPackIterDataset(
        it_ds, length_struct=lengths, num_packing_bins=BATCH, shuffle_bins=False
    )
    it_ds = it_ds.batch(BATCH, drop_remainder=True)
    it_ds = it_ds.map(functools.partial(_model_features, kind=kind))
    return iter(it_ds)


# -- measurement -------------------------------------------------------------------------------


def _tokens(batch: dict[str, np.ndarray]) -> int:
    n = int(np.count_nonzero(batch["decoder_target_tokens"]))
    if "encoder_input_tokens" in batch:
        n += int(np.count_nonzero(batch["encoder_input_tokens"]))
    return n


def tokens_per_second(make_iter, num_batches: int) -> float:
    """Tokens/s over `num_batches`, after one warm-up batch (worker start-up is not counted)."""
    it = make_iter()
    try:
        next(it)
        tokens, t0 = 0, time.perf_counter()
        for _ in range(num_batches):
            tokens += _tokens(next(it))
        return tokens / (time.perf_counter() - t0)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


QUICKSTART_LEN = {"inputs": 24, "targets": 24}
QUICKSTART_BATCH = 32


def quickstart_rates(steps: int) -> tuple[float, float]:
    """(pipeline tokens/s, train-step tokens/s) for the quickstart's task, batch and model."""
    import gin
    import jax

    from t5lite.cli import gin_config as gin_utils
    from t5lite.cli import registry as gin_registry
    from t5lite.trainer import Trainer

    def data_iter():
        return sl.get_dataset("synthetic_reverse", QUICKSTART_LEN, "train", QUICKSTART_BATCH,
                              seed=0, feature_converter="enc_dec", pack=True)  # fmt: skip

    data_rate = tokens_per_second(data_iter, max(steps, 20))
    with gin.unlock_config():
        gin.clear_config()
    gin_utils.parse_gin(["quickstart.gin"], [])
    model = gin.query_parameter("train.model").scoped_configurable_fn()
    trainer = Trainer(model, gin_registry.Partitioner(), batch_size=QUICKSTART_BATCH,
                      lengths=QUICKSTART_LEN)  # fmt: skip
    it = data_iter()
    batches = [next(it) for _ in range(steps + 2)]
    state = trainer.init_state()
    for b in batches[:2]:  # compile and warm up
        state, m = trainer.train_step(state, trainer.global_batch(b))
    jax.block_until_ready(m)
    tokens, t0 = 0, time.perf_counter()
    for b in batches[2:]:
        state, m = trainer.train_step(state, trainer.global_batch(b))
        jax.block_until_ready(m)  # one step at a time, as the train loop consumes data
        tokens += _tokens(b)
    return data_rate, tokens / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/data_pipeline.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--smoke", action="store_true", help="1 rep, few batches (CI)")
    args = parser.parse_args(argv)
    reps, batches = (1, 5) if args.smoke else (args.reps, args.batches)

    figures = []
    print(f"{'pipeline':<28}{'seqio_lite tok/s':>18}{'bare grain tok/s':>18}{'ratio':>8}")
    for kind in ("lm", "encdec"):
        for workers in (0, 2):
            ours, bare = [], []
            for _ in range(reps):  # interleaved so drifts in machine load hit both sides
                ours.append(
                    tokens_per_second(functools.partial(seqio_lite_iter, kind, workers), batches)
                )
                bare.append(
                    tokens_per_second(functools.partial(bare_grain_iter, kind, workers), batches)
                )
            value, ref = statistics.median(ours), statistics.median(bare)
            ratio = value / ref
            name = f"{kind}_tokenize_pack_workers{workers}"
            print(f"{name:<28}{value:>18,.0f}{ref:>18,.0f}{ratio:>8.2f}")
            figures.append(
                {
                    "name": name,
                    "value": round(value, 1),
                    "unit": "tokens/s",
                    "reference": round(ref, 1),
                    "ratio": round(ratio, 3),
                    "goal": ">= 0.9",
                    "met": ratio >= 0.9,
                }
            )
    data_rate, train_rate = quickstart_rates(5 if args.smoke else 30)
    ratio = data_rate / train_rate
    print(
        f"{'quickstart pipeline vs step':<28}{data_rate:>18,.0f}{train_rate:>18,.0f}{ratio:>8.1f}"
    )
    figures.append(
        {
            "name": "quickstart_pipeline_vs_train_step",
            "value": round(data_rate, 1),
            "unit": "tokens/s",
            "reference": round(train_rate, 1),
            "ratio": round(ratio, 2),
            "goal": ">= 10",
            "met": ratio >= 10,
            "note": "reference: tokens/s the quickstart train step consumes (8 fake CPU devices)",
        }
    )
    record = {
        "benchmark": "data_pipeline",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}".strip(),
        "versions": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "grain": _version("grain"),
            "sentencepiece": _version("sentencepiece"),
        },
        "settings": {
            "batch_size": BATCH,
            "lm": LM_LEN,
            "encdec": ENCDEC_LEN,
            "reps": reps,
            "batches": batches,
            "smoke": args.smoke,
        },
        "figures": figures,
    }
    write_record(record, args.out)
    return record


def _version(pkg: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    main()
