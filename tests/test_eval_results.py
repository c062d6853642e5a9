"""`t5lite eval` results: one record per task and split per evaluation, appended beside the
checkpoints (`MODEL_DIR/eval/<task>/<split>.jsonl`), never replaced."""

from __future__ import annotations

import json

from conftest import QUICK_TRAIN, require_devices, run_cli

from t5lite.programs.evaluate import read_eval_results

# conftest's quick run (its compiled train step shared with the other files'), 2 steps.
TRAIN = [*QUICK_TRAIN, "--gin.TRAIN_STEPS=2"]


def _eval(model_dir, task: str, split: str = "validation", batch_size: int = 8) -> int:
    return run_cli(
        "eval",
        "--gin_file=runs/eval.gin",
        "--gin_file=models/t5_1_1/tiny.gin",
        "--gin.VOCAB_SIZE=384",
        f"--gin.MODEL_DIR='{model_dir}'",
        f"--gin.TASK='{task}'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
        f"--gin.BATCH_SIZE={batch_size}",
        "--gin.NUM_PARTITIONS=4",
        "--gin.DataConfig.num_examples=8",
        f"--gin.DataConfig.split='{split}'",
    )


def test_evaluations_of_other_tasks_splits_and_reruns_are_all_kept(tmp_path):
    require_devices(8)
    d = tmp_path / "m"
    assert run_cli("train", *TRAIN, f"--gin.MODEL_DIR='{d}'") == 0
    assert _eval(d, "synthetic_reverse") == 0
    assert _eval(d, "synthetic_copy") == 0  # another task on the same checkpoint
    assert _eval(d, "synthetic_reverse", split="train") == 0  # another split
    assert _eval(d, "synthetic_reverse", batch_size=16) == 0  # the first one again
    assert sorted(str(p.relative_to(d / "eval")) for p in (d / "eval").rglob("*.*")) == [
        "synthetic_copy/validation.jsonl",
        "synthetic_reverse/train.jsonl",
        "synthetic_reverse/validation.jsonl",
    ]
    reverse = read_eval_results(d, "synthetic_reverse")
    copy = read_eval_results(d, "synthetic_copy")
    on_train = read_eval_results(d, "synthetic_reverse", "train")
    assert [(r["step"], r["task"], r["split"]) for r in reverse + copy + on_train] == [
        (2, "synthetic_reverse", "validation"),
        (2, "synthetic_reverse", "validation"),
        (2, "synthetic_copy", "validation"),
        (2, "synthetic_reverse", "train"),
    ]
    # Each record holds what that evaluation logged to metrics.jsonl, in the same order.
    with open(d / "metrics.jsonl") as f:
        logged = [r for r in map(json.loads, f) if r["split"] == "eval"]
    recorded = [reverse[0], copy[0], on_train[0], reverse[1]]
    assert len(logged) == 4
    for line, record in zip(logged, recorded):
        prefix = record["task"] + "/"
        assert {k[len(prefix) :]: v for k, v in line.items() if k.startswith(prefix)} == (
            record["metrics"]
        )
    # The same checkpoint and examples with another batch size: the same exact-match.
    assert reverse[0]["metrics"]["exact_match"] == reverse[1]["metrics"]["exact_match"]
    assert read_eval_results(d, "synthetic_arithmetic") == []
