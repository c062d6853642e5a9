"""1F1B's memory model (insight/pipeline.py) on T5's two stacks, and the pipeline's microbatch
checks running before anything compiles."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_devices
from test_pipeline import _t5_trainer
from test_pipeline import _trainer as _lm_trainer

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
    gradients beside the schedule's accumulator), beside both stacks' relative-position
    one-hots ([32 buckets, 8, 8] fp32 each, whole on every device)."""
    from t5lite.insight.memory import memory_report
    from t5lite.insight.parameter_bytes import layer_gradient_bytes
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
    assert pm.position_bias == 2 * 32 * 8 * 8 * 4
    assert abs(compiled / pm.total - 1) <= 0.10, (compiled, pm)


@pytest.mark.parametrize(
    "family, base, stages, num_partitions, remat",
    [
        ("t5", "megatron", 2, 2, "full"),
        ("t5", "data_parallel", 2, 1, "minimal"),
        ("t5", "fsdp", 4, 1, "full"),
        ("lm", "megatron", 4, 2, "minimal"),
        ("lm", "fsdp", 2, 1, "full"),
        ("lm", "megatron", 2, 2, "minimal"),
    ],
)
def test_1f1b_memory_under_remat_within_10_percent(family, base, stages, num_partitions, remat):
    """1F1B under remat: a B differentiates its stage's layers one at a time, the others
    keeping what the policy saves and the one in hand its values recomputed from its input
    beside their cotangents, so with one layer a stage (4 + 4 layers over 4 stages) the
    prediction is remat 'none''s; within 10% of XLA's memory analysis of the compiled step."""
    from t5lite.insight.memory import memory_report
    from t5lite.insight.report import compile_train_step

    def trainer(policy: str) -> Trainer:
        if family == "t5":
            return _t5_trainer(base, stages, num_partitions, policy, "1f1b")
        return _lm_trainer(base, stages, num_partitions, 4, "1f1b", policy)

    tr = trainer(remat)
    pm, none = (insight_pipeline.pipeline_memory(t) for t in (tr, trainer("none")))
    if stages == 4:
        assert pm == none
    else:
        assert pm.in_flight < none.in_flight and pm.stack_buffers == none.stack_buffers
    if (family, base, remat) == ("lm", "fsdp", "full"):
        # 2 slots and the other layer's input ([1, 8, 16] fp32 on this device), the layer in
        # hand recomputed (16 KiB) with half as much again of cotangents, and the B's stacked
        # gradients of the stage's 2 layers (10368 bytes each, split over the 4 FSDP devices)
        assert pm.in_flight == 2 * 512 + 512 + 16384 * 3 // 2 + 2 * 10368 // 4
    compiled = memory_report(compile_train_step(tr)).total
    assert abs(compiled / pm.total - 1) <= 0.10, (compiled, pm)


@pytest.mark.parametrize(
    "base, num_partitions, remat", [("data_parallel", 1, "minimal"), ("fsdp", 1, "full")]
)
def test_gpipe_two_layers_a_stage_memory_within_10_percent(base, num_partitions, remat):
    """GPipe with two layers a stage (the 4-layer LM over 2 stages), within 10% of XLA's memory
    analysis of the compiled step. Written out (data parallel, `minimal`), the stage's stacked
    weights are split once into its layers, a copy held through the step: 2 layers x (four
    [16, 2, 8] projections, [16, 32] x 2 and [32, 16] MLP kernels, two [16] norm scales) fp32
    = 20736 bytes; Megatron holds half the kernels, one layer a stage splits nothing. In a layer
    scan under remat (FSDP, `full`), a layer's backward holds its values recomputed, 16 KiB at
    one microbatch (1 row of 8 positions on this device), and half as much again of
    cotangents."""
    from t5lite.insight.memory import memory_report
    from t5lite.insight.report import compile_train_step

    tr = _lm_trainer(base, 2, num_partitions, 4, "gpipe", remat)
    pm = insight_pipeline.pipeline_memory(tr)
    if base == "data_parallel":
        assert pm.weight_split == 2 * (4 * 16 * 2 * 8 + 3 * 16 * 32 + 2 * 16) * 4
        assert "+ stage weights split per layer 20.25 KiB" in pm.format()
        megatron = _lm_trainer("megatron", 2, 2, 4, "gpipe", remat)
        assert (
            insight_pipeline.pipeline_memory(megatron).weight_split
            == 2 * ((4 * 16 * 2 * 8 + 3 * 16 * 32) // 2 + 2 * 16) * 4
        )
        one_layer = _lm_trainer(base, 4, num_partitions, 4, "gpipe", remat)
        assert insight_pipeline.pipeline_memory(one_layer).weight_split == 0
    else:
        assert pm.weight_split == 0 and pm.working == 16384 * 3 // 2
    compiled = memory_report(compile_train_step(tr)).total
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
