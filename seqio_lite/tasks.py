"""Embedded tasks: nothing is downloaded, everything ships with the package or is generated.

Synthetic seq2seq tasks (ByteVocabulary, exact-match metric), generated from a fixed seed so a
small T5 learns them in minutes on a CPU:

| task | inputs | targets |
| --- | --- | --- |
| `synthetic_copy` | `kqzfe` | `kqzfe` |
| `synthetic_reverse` | `kqzfe` | `efzqk` |
| `synthetic_arithmetic` | `123+45` | `168` |

Suggested lengths: `{"inputs": 32, "targets": 32}`. Splits: train (50,000), validation (500),
test (500).

Text tasks on `data/tiny_corpus` (~90 KB of generated fable-style stories, one per line):

| task | vocabulary | features |
| --- | --- | --- |
| `tiny_corpus_lm` | bytes | targets (random window per epoch) |
| `tiny_corpus_lm_sp` | SentencePiece, 256 pieces (`data/tiny_corpus/spm_256.model`) | targets |
| `tiny_corpus_span_corruption` | same + 100 sentinels | inputs, targets (span corruption) |

The mixture `synthetic_all` mixes the three synthetic tasks equally.
"""

from __future__ import annotations

import functools
import os
import random

from seqio_lite import dataset_providers as dp
from seqio_lite import evaluation, sources
from seqio_lite import preprocessors as prep
from seqio_lite.vocabularies import ByteVocabulary, SentencePieceVocabulary

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")
TINY_CORPUS_DIR = os.path.join(DATA_DIR, "tiny_corpus")
SPM_MODEL = os.path.join(TINY_CORPUS_DIR, "spm_256.model")

SYNTHETIC_SIZES = {"train": 50_000, "validation": 500, "test": 500}
_SPLIT_SEEDS = {"train": 1, "validation": 2, "test": 3}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_KIND_IDS = {"copy": 1, "reverse": 2, "arithmetic": 3}


def _rng(kind: str, split: str, index: int) -> random.Random:
    # NOTE: one `random.Random` seeded with an integer per example: deterministic across
    # platforms and ~50x cheaper than a numpy SeedSequence, which dominated the pipeline.
    return random.Random((_KIND_IDS[kind] * 8 + _SPLIT_SEEDS[split]) * 10_000_019 + index)


def _letters(rng: random.Random) -> str:
    return "".join(rng.choices(_LETTERS, k=rng.randint(2, 16)))


def copy_example(split: str, index: int) -> dict:
    """`synthetic_copy` example `index` of `split`."""
    s = _letters(_rng("copy", split, index))
    return {"inputs": s, "targets": s}


def reverse_example(split: str, index: int) -> dict:
    """`synthetic_reverse` example `index` of `split`."""
    s = _letters(_rng("reverse", split, index))
    return {"inputs": s, "targets": s[::-1]}


def arithmetic_example(split: str, index: int) -> dict:
    """`synthetic_arithmetic` example `index` of `split`: sums and differences below 1000."""
    rng = _rng("arithmetic", split, index)
    a, b = rng.randrange(1000), rng.randrange(1000)
    if rng.random() < 0.5:
        return {"inputs": f"{a}+{b}", "targets": str(a + b)}
    return {"inputs": f"{a}-{b}", "targets": str(a - b)}


def strip_text(text: str) -> str:
    """Postprocessing: surrounding whitespace is not part of the answer."""
    return text.strip()


def _byte_features(extra_ids: int = 0) -> dict[str, dp.Feature]:
    vocab = ByteVocabulary(extra_ids=extra_ids)
    return {"inputs": dp.Feature(vocab), "targets": dp.Feature(vocab)}


def _register(task: dp.Task) -> None:
    dp.TaskRegistry.add(task, overwrite=True)


def register_embedded_tasks() -> None:
    """Registers the tasks and mixtures above (idempotent; runs on `import seqio_lite`)."""
    seq2seq = [prep.tokenize, prep.append_eos_after_trim]
    for name, fn in [
        ("synthetic_copy", copy_example),
        ("synthetic_reverse", reverse_example),
        ("synthetic_arithmetic", arithmetic_example),
    ]:
        _register(
            dp.Task(
                name,
                sources.FunctionSource(fn, SYNTHETIC_SIZES, version="2", name=name),
                output_features=_byte_features(),
                preprocessors=seq2seq,
                postprocess_fn=strip_text,
                metric_fns=[evaluation.exact_match],
            )
        )
    dp.MixtureRegistry.add(
        dp.Mixture(
            "synthetic_all",
            ["synthetic_copy", "synthetic_reverse", "synthetic_arithmetic"],
            default_rate=1.0,
        ),
        overwrite=True,
    )

    corpus = {
        "train": os.path.join(TINY_CORPUS_DIR, "train.txt"),
        "validation": os.path.join(TINY_CORPUS_DIR, "validation.txt"),
    }
    to_targets = functools.partial(prep.rekey, key_map={"targets": "text"})
    lm_steps = [
        to_targets,
        prep.tokenize,
        dp.CacheDatasetPlaceholder(),
        prep.random_crop,
        prep.append_eos_after_trim,
    ]
    byte_vocab = ByteVocabulary()
    _register(
        dp.Task(
            "tiny_corpus_lm",
            sources.TextLineSource(corpus, name="tiny_corpus"),
            output_features={"targets": dp.Feature(byte_vocab)},
            preprocessors=lm_steps,
        )
    )
    _register(
        dp.Task(
            "tiny_corpus_lm_sp",
            sources.TextLineSource(corpus, name="tiny_corpus"),
            output_features={"targets": dp.Feature(SentencePieceVocabulary(SPM_MODEL))},
            preprocessors=lm_steps,
        )
    )
    sp_vocab = SentencePieceVocabulary(SPM_MODEL, extra_ids=100)
    _register(
        dp.Task(
            "tiny_corpus_span_corruption",
            sources.TextLineSource(corpus, name="tiny_corpus"),
            output_features={
                "inputs": dp.Feature(sp_vocab),
                "targets": dp.Feature(sp_vocab),
            },
            preprocessors=[
                functools.partial(prep.rekey, key_map={"inputs": None, "targets": "text"}),
                prep.tokenize,
                dp.CacheDatasetPlaceholder(),
                prep.span_corruption,
                prep.append_eos_after_trim,
            ],
        )
    )
