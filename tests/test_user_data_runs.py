"""A user's own data through the CLI with gin alone: prefix-LM training, the offline cache,
evaluation batch sizes, score metrics and rank classification, end to end."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

import seqio_lite
from seqio_lite import cache_tasks, file_tasks

pytestmark = pytest.mark.slow  # each test trains a tiny model for a few seconds, plus compiles

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _reverse_data(d: Path, n_train: int = 2000, n_valid: int = 48) -> None:
    rng = random.Random(0)
    for split, n in [("train", n_train), ("validation", n_valid)]:
        with open(d / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                s = "".join(rng.choice(LETTERS) for _ in range(3))
                f.write(json.dumps({"prompt": s, "answer": s[::-1]}) + "\n")


def _gin(d: Path, task: str, model: str, extra: str = "") -> Path:
    """A run on the user's JSONL files: a tiny model, data parallel on one CPU device."""
    model_lines = {
        "t5": "include 'models/t5_1_1/tiny.gin'\nMODEL = @EncoderDecoderModel()\n"
              "EncoderDecoderModel.network_config = @network.T5Config()\n"
              "EncoderDecoderModel.optimizer = @AdamW()\n",
        "prefix_lm": "include 'models/decoder_only/tiny.gin'\nMODEL = @DecoderOnlyModel()\n"
                     "DecoderOnlyModel.network_config = @network.DecoderOnlyConfig()\n"
                     "DecoderOnlyModel.feature_converter = 'prefix_lm'\n"
                     "DecoderOnlyModel.optimizer = @AdamW()\n",
    }[model]  # fmt: skip
    text = f"""
include 'runs/pretrain.gin'
include 'partitioning/data_parallel.gin'
{model_lines}
VOCAB_SIZE = 384
AdamW.learning_rate = 3e-3
TASK = @{task}/JsonlTask()
{task}/JsonlTask.name = '{task}'
{task}/JsonlTask.files = {{'train': '{d}/train.jsonl', 'validation': '{d}/validation.jsonl'}}
{task}/JsonlTask.inputs_field = 'prompt'
{task}/JsonlTask.targets_field = 'answer'
{task}/JsonlTask.metrics = ['exact_match', 'log_likelihood', 'perplexity']
TASK_FEATURE_LENGTHS = {{'inputs': 8, 'targets': 8}}
MODEL_DIR = '{d}/run'
TRAIN_STEPS = 150
BATCH_SIZE = 32
CheckpointConfig.period = 1000
DataConfig.cache_dir = '{d}/cache'
train.evaluation = @EvalConfig()
EvalConfig.num_examples = None
{extra}
"""
    path = d / f"{task}.gin"
    path.write_text(text)
    file_tasks._defined.pop(task, None)  # each test defines its task afresh
    return path


def _eval_json(model_dir: Path, step: int) -> dict:
    """The newest evaluation of `step`: its split and each task's metrics."""
    files = sorted((model_dir / "eval").glob("*/*.jsonl"))  # eval/<task>/<split>.jsonl
    records = [json.loads(line) for p in files for line in p.read_text().splitlines()]
    records = [r for r in records if r["step"] == step]
    return {"split": records[-1]["split"], "metrics": {r["task"]: r["metrics"] for r in records}}


def test_prefix_lm_learns_an_answer_that_depends_on_the_prefix(tmp_path, capsys):
    _reverse_data(tmp_path)
    gin_file = _gin(tmp_path, "user_reverse_plm", "prefix_lm")
    assert run_cli("train", f"--gin_file={gin_file}") == 0
    result = _eval_json(tmp_path / "run", 150)
    metrics = result["metrics"]["user_reverse_plm"]
    # Reversing 3 random letters: 1 in 26^3 by chance; the model reads its prefix.
    assert metrics["exact_match"] >= 95, metrics
    assert 1.0 <= metrics["perplexity"] < 1.5 and metrics["log_likelihood"] < 0, metrics
    # Prompted decoding through `t5lite infer` continues each prompt with its reverse.
    out = tmp_path / "predictions.jsonl"
    assert run_cli(
        "infer", "--gin_file=runs/infer.gin", f"--gin_file={gin_file}", f"--gin.OUTPUT_FILE='{out}'"
    ) == 0  # fmt: skip
    records = [json.loads(s) for s in out.read_text().splitlines()]
    assert len(records) == 48
    assert sum(r["prediction"] == r["inputs"][::-1] for r in records) >= 45, records[:3]
    # The loss is on the targets only: the random prompt letters would cap accuracy far below 1.
    records = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
               if s]  # fmt: skip
    assert [r for r in records if r["split"] == "train"][-1]["accuracy"] > 0.99

    # The same task fed to a plain LM is refused: its inputs would be silently dropped.
    capsys.readouterr()
    rc = run_cli(
        "train", f"--gin_file={gin_file}", "--gin.DecoderOnlyModel.feature_converter='lm'",
        f"--gin.MODEL_DIR='{tmp_path / 'lm'}'",
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err == [
        "t5lite train: error: DataConfig.task_feature_lengths = {'inputs': 8, 'targets': 8} has "
        "'inputs' but DecoderOnlyModel.feature_converter = 'lm' reads only 'targets': set "
        "DecoderOnlyModel.feature_converter = 'prefix_lm' to train on inputs and targets, or "
        "drop the 'inputs' length"
    ], err
    rc = run_cli(
        "train", f"--gin_file={gin_file}", "--gin.DecoderOnlyModel.feature_converter='lm'",
        "--gin.TASK_FEATURE_LENGTHS={'targets': 16}", f"--gin.MODEL_DIR='{tmp_path / 'lm'}'",
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err == [
        "t5lite train: error: task 'user_reverse_plm' has features ['inputs', 'targets'] but "
        "DecoderOnlyModel.feature_converter = 'lm' would drop its inputs: set "
        "DecoderOnlyModel.feature_converter = 'prefix_lm' to train on inputs and targets"
    ], err
    assert not (tmp_path / "lm").exists()


def test_training_from_the_cache_sees_the_same_batches(tmp_path, monkeypatch):
    """With a SentencePiece vocabulary trained from the data: the cache, training from it, and
    the vocabulary file copied beside the model."""
    monkeypatch.setenv("SEQIO_LITE_HOME", str(tmp_path / "home"))
    _reverse_data(tmp_path, n_train=300)
    gin_file = _gin(tmp_path, "user_reverse_cached", "t5", """
train.evaluation = None
user_reverse_cached/JsonlTask.vocabulary = @TrainedSentencePiece()
TrainedSentencePiece.vocab_size = 40
""")  # fmt: skip
    # The Beam job, with a pipeline option passed through to Beam.
    assert run_cli("cache", f"--gin_file={gin_file}", "--direct_num_workers=1") == 0
    task_dir = tmp_path / "cache" / "user_reverse_cached"
    assert (task_dir / "COMPLETED").is_file()
    assert sorted(p.name for p in task_dir.glob("train.array_record-*")) == [
        f"train.array_record-{i:05d}-of-00008" for i in range(8)
    ]
    cache_tasks.add_global_cache_dirs([str(tmp_path / "cache")])
    kwargs = dict(batch_size=8, seed=3, pack=True)
    lengths = {"inputs": 8, "targets": 8}
    plain = seqio_lite.get_dataset("user_reverse_cached", lengths, **kwargs)
    cached = seqio_lite.get_dataset("user_reverse_cached", lengths, use_cached=True, **kwargs)
    for _ in range(45):  # past the end of the first epoch (300 examples)
        a, b = next(plain), next(cached)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # ...and resumes exactly from a state taken mid-epoch.
    state = cached.get_state()
    expected = next(cached)
    again = seqio_lite.get_dataset("user_reverse_cached", lengths, use_cached=True, **kwargs)
    again.set_state(state)
    got = next(again)
    assert all(np.array_equal(expected[k], got[k]) for k in expected)

    # Training from the cache: the same losses, step by step, as training from the files.
    steps = ["--gin.TRAIN_STEPS=5"]
    assert run_cli("train", f"--gin_file={gin_file}", *steps) == 0
    assert run_cli(
        "train", f"--gin_file={gin_file}", *steps, "--gin.DataConfig.use_cached=True",
        f"--gin.MODEL_DIR='{tmp_path / 'run_cached'}'",
    ) == 0  # fmt: skip

    def losses(d: str) -> list[float]:
        lines = (tmp_path / d / "metrics.jsonl").read_text().splitlines()
        return [json.loads(s)["loss"] for s in lines if json.loads(s)["split"] == "train"]

    assert losses("run") == losses("run_cached") and len(losses("run")) == 5
    vocab = seqio_lite.get_task_or_mixture("user_reverse_cached").output_features["targets"]
    model_file = vocab.vocabulary.model_file
    beside = tmp_path / "run" / "vocabulary" / Path(model_file).name
    assert beside.read_bytes() == Path(model_file).read_bytes()


def test_eval_batch_size_is_independent_of_the_train_batch(tmp_path):
    _reverse_data(tmp_path, n_valid=21)  # not a multiple of any batch size below
    gin_file = _gin(tmp_path, "user_reverse_eval", "t5", "TRAIN_STEPS = 40\n")
    # Train-time evaluation with a batch twice the train batch (32).
    assert run_cli("train", f"--gin_file={gin_file}", "--gin.EvalConfig.batch_size=64") == 0
    during = _eval_json(tmp_path / "run", 40)
    assert during["split"] == "validation"
    metrics = during["metrics"]["user_reverse_eval"]
    assert set(metrics) == {"exact_match", "log_likelihood", "perplexity"}
    # `t5lite eval` of the same checkpoint with smaller batches (8 data-parallel devices).
    for batch in (8, 16):
        assert run_cli(
            "eval", "--gin_file=runs/eval.gin", f"--gin_file={gin_file}",
            f"--gin.BATCH_SIZE={batch}",
        ) == 0  # fmt: skip
        after = _eval_json(tmp_path / "run", 40)["metrics"]["user_reverse_eval"]
        assert after["exact_match"] == metrics["exact_match"]
        for k in ("log_likelihood", "perplexity"):
            assert after[k] == pytest.approx(metrics[k], rel=1e-5), (batch, k)
    # The TensorBoard events hold the eval scalars too.
    assert list((tmp_path / "run" / "tensorboard").glob("events.*"))


def test_rank_classification_end_to_end(tmp_path):
    """Multiple choice from a JSONL file: train on the correct answers, evaluate by scoring
    each candidate; the accuracy equals an argmax over `t5lite infer`'s scores in numpy."""
    rng = random.Random(1)
    for split, n in [("train", 1000), ("validation", 24)]:
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                s = "".join(rng.choice(LETTERS) for _ in range(3))
                choices = [s[::-1], s, "".join(rng.choice(LETTERS) for _ in range(3))]
                rng.shuffle(choices)
                f.write(json.dumps({"prompt": s, "choices": choices,
                                    "label": choices.index(s[::-1])}) + "\n")  # fmt: skip
    gin_file = _gin(tmp_path, "user_choice", "t5", """
user_choice/JsonlTask.targets_field = None
user_choice/JsonlTask.choices_field = 'choices'
user_choice/JsonlTask.label_field = 'label'
user_choice/JsonlTask.metrics = ['rank_classification']
TRAIN_STEPS = 200
""")  # fmt: skip
    assert run_cli("train", f"--gin_file={gin_file}") == 0
    accuracy = _eval_json(tmp_path / "run", 200)["metrics"]["user_choice"]["accuracy"]
    out = tmp_path / "scores.jsonl"
    assert run_cli(
        "infer", "--gin_file=runs/infer.gin", f"--gin_file={gin_file}",
        f"--gin.OUTPUT_FILE='{out}'", "--gin.infer.mode='score'",
    ) == 0  # fmt: skip
    scores = [json.loads(s)["score"] for s in out.read_text().splitlines()]
    assert len(scores) == 24 * 3  # one row per candidate
    lines = (tmp_path / "validation.jsonl").read_text().splitlines()
    labels = [json.loads(s)["label"] for s in lines]
    picked = np.argmax(np.asarray(scores).reshape(24, 3), axis=1)
    assert accuracy == pytest.approx(100.0 * np.mean(picked == np.asarray(labels)))
    assert accuracy > 80  # far better than the 1-in-3 guess
