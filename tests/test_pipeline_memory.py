"""1F1B's memory model (insight/pipeline.py) on T5's two stacks, and the pipeline's microbatch
checks running before anything compiles."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_devices
from test_pipeline import _t5_trainer

from t5lite import partitioning
from t5lite.insight import pipeline as insight_pipeline
from t5lite.model import network, optimizers
from t5lite.model.models import DecoderOnlyModel
from t5lite.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "base, stages, num_partitions", [("megatron", 2, 2), ("fsdp", 4, 1), ("megatron", 4, 2)]
)
def test_t5_1f1b_memory_within_10_percent(base, stages, num_partitions):
    """T5 (4 + 4 layers, 4 microbatches) under 1F1B: the analytic peak per device is within 10%
    of XLA's memory analysis of the compiled step. The decoder's moment is the peak: its B
    recomputes the stage's decoder layers (with two layers a stage, the B's stacked layer
    gradients beside the schedule's accumulator), plus a fitted one encoder layer's residuals."""
    from t5lite.insight.memory import layer_gradient_bytes, memory_report
    from t5lite.insight.report import compile_train_step

    tr = _t5_trainer(base, stages, num_partitions, "none", "1f1b")
    compiled = memory_report(compile_train_step(tr)).total
    pm = insight_pipeline.pipeline_memory(tr)
    f = insight_pipeline.pipeline_figures(tr)
    enc, dec = f.permute_bytes
    assert pm.stack_buffers == 3 * 4 * (enc + dec) + 2 * 4 * enc
    assert f.in_flight_bytes == stages * (enc + dec)  # the p slots of each stack
    (decoder, _), (encoder, _) = (layer_gradient_bytes(tr, 4, s) for s in ("decoder", "encoder"))
    assert decoder + encoder == layer_gradient_bytes(tr, 4)[0] and encoder < decoder
    assert abs(compiled / pm.total - 1) <= 0.10, (compiled, pm)


def _trainer(schedule: str, microbatches: int) -> Trainer:
    require_devices(8)
    cfg = network.DecoderOnlyConfig(
        vocab_size=32,
        emb_dim=16,
        num_heads=2,
        num_layers=4,
        head_dim=8,
        mlp_dim=32,
        scan_layers=True,
        pipeline_microbatches=microbatches,
        pipeline_schedule=schedule,
    )
    part = partitioning.Partitioner(
        num_partitions=1, num_stages=4, logical_axis_rules=partitioning.pipeline_rules("fsdp")
    )
    model = DecoderOnlyModel(cfg, optimizer=optimizers.AdamW(1e-2))
    return Trainer(model, part, batch_size=16, lengths={"targets": 8})


@pytest.mark.parametrize(
    "schedule, microbatches, text",
    [
        (
            "1f1b",
            2,
            "DecoderOnlyConfig.pipeline_microbatches=2: schedule '1f1b' needs at least as many "
            "microbatches as the 4 pipeline stages",
        ),
        (
            "gpipe",
            3,
            "DecoderOnlyConfig.pipeline_microbatches=3: a batch of 16 rows does not cut into 3 "
            "microbatches that divide over the 2 devices splitting the batch (needs a multiple "
            "of 6 rows)",
        ),
    ],
)
def test_microbatch_errors_when_the_trainer_is_built(schedule, microbatches, text):
    """Microbatches too few for 1F1B, or that do not cut the batch, are refused by the Trainer
    itself (nothing traced or compiled yet)."""
    with pytest.raises(ValueError) as e:
        _trainer(schedule, microbatches)
    assert str(e.value) == text


def test_cli_refuses_1f1b_with_too_few_microbatches_before_compiling(tmp_path):
    """`t5lite train` with 1F1B over fewer microbatches than stages: one line naming the
    setting, a non-zero exit, and no "compiling the train step" before it."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "t5lite.cli.main",
            "train",
            "--gin_file=examples/pipeline_lm.gin",
            "--host_device_count=8",
            "--gin.network.DecoderOnlyConfig.pipeline_schedule='1f1b'",
            "--gin.network.DecoderOnlyConfig.pipeline_microbatches=1",
            f"--gin.MODEL_DIR='{tmp_path / 'run'}'",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "t5lite train: error: DecoderOnlyConfig.pipeline_microbatches=1: schedule '1f1b' needs "
        "at least as many microbatches as the 2 pipeline stages"
    ], out.stderr
    assert "compiling" not in out.stdout + out.stderr
