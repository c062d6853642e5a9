"""`t5lite inspect`: how a configured model is split over the mesh, computed abstractly."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import TextIO

import jax

from t5lite.insight.sharding import ShardingReport, _fmt_bytes, sharding_report
from t5lite.models import BaseModel
from t5lite.partitioning import Partitioner
from t5lite.trainer import Trainer


def inspect(
    *,
    model: BaseModel,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    partitioner: Partitioner | None = None,
    output_json: str | None = None,
    stream: TextIO | None = None,
) -> ShardingReport:
    """Prints the per-parameter sharding report and the train state's bytes per device.

    Nothing is allocated: shapes come from `jax.eval_shape`, so full-size models can be
    inspected on a laptop with fake devices.
    """
    stream = stream or sys.stdout
    partitioner = partitioner or Partitioner()
    trainer = Trainer(model, partitioner, batch_size=batch_size, lengths=task_feature_lengths)
    state = trainer.abstract_state()
    report = sharding_report(partitioner, state.params, trainer.params_axes)
    opt = sharding_report(partitioner, state.opt_state, trainer.state_axes.opt_state)
    rules = ", ".join(f"{n}->{a}" for n, a in partitioner.rules)
    stream.write(f"rules: {rules}\n\n{report.format()}\n")
    stream.write(
        f"optimizer state ({type(model.optimizer).__name__}): {_fmt_bytes(opt.bytes_total)} in "
        f"all, {_fmt_bytes(opt.bytes_per_device)} per device\n"
        f"train state per device: {_fmt_bytes(report.bytes_per_device + opt.bytes_per_device)} "
        f"on {jax.device_count()} devices\n"
    )
    if output_json:
        with open(output_json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return report
