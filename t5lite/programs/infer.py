"""The `infer` program: a checkpoint's predictions (or scores) for a task split, as JSONL."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax

from t5lite import distributed
from t5lite.model.models import BaseModel
from t5lite.partitioning import Partitioner
from t5lite.programs.configs import DataConfig
from t5lite.programs.evaluate import check_task_and_model, data_evaluator, restored_trainer

MODES = ("predict", "score")


def infer(
    *,
    model_dir: str,
    model: BaseModel,
    data: DataConfig,
    output_file: str,
    mode: str = "predict",
    partitioner: Partitioner | None = None,
    checkpoint_step: int | None = None,
    max_decode_length: int | None = None,
) -> str:
    """Writes one JSONL record per example: task, inputs, targets and the prediction (or score).

    Resumable: records are appended one batch at a time (flushed and fsynced), so a run that
    stops part way leaves a valid prefix; the same command then skips the examples already
    written and appends the rest. A complete output is never overwritten, and an output that
    does not match this task split (or ends mid-batch) is refused or cut back to its last
    whole batch, never rewritten otherwise. Every process runs the same global batches (its
    rows via `global_batch_from_full`); only process 0 reads and writes the file and tells the
    others where to resume.

    Args:
      model_dir, checkpoint_step: the checkpoint (latest by default).
      model, partitioner: what to run on which mesh; decoding as the model's
        `decoding_method` etc. say.
      data: the examples, in order (`split` defaults to 'validation'; `num_examples` the
        first N); `batch_size` global examples per batch.
      output_file: the JSONL file.
      mode: "predict" (decoded text) or "score" (log-likelihood of the targets).
      max_decode_length: decode length (default: the targets length).

    Returns:
      `output_file`.
    """
    if mode not in MODES:
        raise ValueError(f"infer mode must be 'predict' or 'score', got {mode!r}")
    check_task_and_model(data.task, model, data.task_feature_lengths)
    is_chief = jax.process_index() == 0
    batch_size = data.batch_size
    evaluator = data_evaluator(model, data)
    expected = [
        (t.name, _text(ex, "inputs")) for t in evaluator.tasks for ex in evaluator.examples(t.name)
    ]
    # Batch boundaries (global record counts) at which a resumed run can start.
    boundaries, offset = {0}, 0
    for t in evaluator.tasks:
        for _, n in evaluator.batches(t.name):
            offset += n
            boundaries.add(offset)
    done = _resume_point(output_file, expected, boundaries) if is_chief else 0
    if jax.process_count() > 1:
        done = distributed.broadcast_from_chief(done)
    if done < 0:
        raise FileExistsError(
            f"infer: {output_file} is complete ({len(expected)} records); refusing to overwrite it"
        )
    trainer, params, _ = restored_trainer(model, partitioner, data, model_dir, checkpoint_step)
    decode_len = max_decode_length or data.task_feature_lengths["targets"]
    offset = 0
    batch_index = 0
    for t in evaluator.tasks:
        vocab = t.output_features["targets"].vocabulary
        exs = evaluator.examples(t.name)
        for i, (batch, n) in enumerate(evaluator.batches(t.name)):
            batch_index += 1
            lo, offset = offset, offset + n
            if offset <= done:
                continue  # written by an earlier run
            if mode == "predict":
                ids = trainer.predict_fn(params, decode_len)(batch, batch_index)
                outputs: list[Any] = [vocab.decode(r) for r in ids[:n]]
            else:
                outputs = trainer.score_fn(params)(batch)[:n]
            chunk = exs[i * batch_size : i * batch_size + n]
            records = [
                {
                    "task": t.name,
                    "inputs": _text(ex, "inputs"),
                    "targets": _text(ex, "targets"),
                    "prediction" if mode == "predict" else "score": o,
                }
                for ex, o in zip(chunk, outputs)
            ]
            assert len(records) == offset - lo
            if is_chief:
                append_records(output_file, records)
    if is_chief:
        kept = f" after the {done} already there" if done else ""
        print(f"infer: wrote {len(expected) - done} records to {output_file}{kept}", flush=True)
    return output_file


def _resume_point(output_file: str, expected: list[tuple[str, Any]], boundaries: set[int]) -> int:
    """Records of `output_file` to keep (a batch boundary), or -1 when it is complete.

    Raises ValueError (naming the file and line) when the file is not a prefix of this run's
    output. A torn last line or a partial last batch is cut off, atomically.
    """
    if not os.path.exists(output_file):
        return 0
    with open(output_file, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    records: list[dict] = []
    for lineno, line in enumerate(lines[:-1], 1):  # the text after the last newline is torn
        try:
            rec = json.loads(line)
        except ValueError:
            raise ValueError(f"infer: {output_file}:{lineno} is not a JSON record") from None
        if lineno > len(expected) or (rec.get("task"), rec.get("inputs")) != expected[lineno - 1]:
            raise ValueError(
                f"infer: {output_file}:{lineno} does not match example {lineno} of this task "
                "split; use another output_file"
            )
        records.append(rec)
    if len(records) == len(expected):
        return -1
    keep = max(b for b in boundaries if b <= len(records))
    if keep != len(records) or lines[-1]:
        tmp = output_file + ".tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in lines[:keep]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, output_file)
    return keep


def append_records(output_file: str, records: list[dict]) -> None:
    """Appends whole lines in one write, then fsyncs: a crash tears at most the last line."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    fd = os.open(output_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _text(ex: Mapping[str, Any], key: str) -> Any:
    v = ex.get(f"{key}_pretokenized")
    if v is None:
        return None
    return v.decode() if isinstance(v, bytes) else str(v)
