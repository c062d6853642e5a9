"""`pipeline.one_stage()`: a `stage` axis of one device runs the schedule (a stage's program
alone, benchmarks/pipeline_bubble.py's busy work) and computes the unpipelined step's numbers;
without it one stage is no pipeline."""

import jax
import numpy as np
import pytest

from t5lite import collectives, partitioning
from t5lite.model import network, optimizers, pipeline
from t5lite.model.models import DecoderOnlyModel
from t5lite.trainer import Trainer, summarize

LM = dict(
    vocab_size=32, emb_dim=16, num_heads=2, num_layers=2, head_dim=8, mlp_dim=32, scan_layers=True
)
BATCH, LENGTH = 8, 8


def _trainer(rules, schedule: str = "gpipe") -> Trainer:
    cfg = network.DecoderOnlyConfig(**LM, pipeline_microbatches=4, pipeline_schedule=schedule)
    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh((1, 1, 1), ("stage", "data", "model"), auto, devices=jax.devices()[:1])
    return Trainer(
        DecoderOnlyModel(cfg, optimizer=optimizers.AdamW(1e-2)),
        partitioning.Partitioner(mesh, logical_axis_rules=rules),
        batch_size=BATCH,
        lengths={"targets": LENGTH},
    )


def _batch(tr: Trainer) -> dict:
    tokens = np.random.default_rng(0).integers(1, 32, (BATCH, LENGTH)).astype(np.int32)
    return tr.global_batch(
        {
            "decoder_input_tokens": tokens,
            "decoder_target_tokens": np.roll(tokens, -1, 1),
            "decoder_loss_weights": np.ones((BATCH, LENGTH), np.float32),
        }
    )


def _permutes(tr: Trainer) -> int:
    """The stage-to-stage permutes in the lowered step (the tick loop's, forward and back)."""
    text = tr.train_step.lower(tr.init_state(), _batch(tr)).as_text()
    return text.count("stablehlo.collective_permute")


def _losses(tr: Trainer, steps: int = 3) -> list[float]:
    batch = _batch(tr)
    state, losses = tr.init_state(), []
    for _ in range(steps):
        state, metrics = tr.train_step(state, batch)
        losses.append(summarize(metrics)["loss"])
    return losses


def test_one_stage_selects_the_pipeline_only_within():
    tr = _trainer(partitioning.pipeline_rules("megatron"))
    with tr.partitioner.context():
        assert pipeline.select(2, "x").strategy == collectives.Strategy.PARTITIONER
        with pipeline.one_stage():
            choice = pipeline.select(2, "x")
        assert choice.strategy == collectives.Strategy.PIPELINE
        assert choice.plan == pipeline.PipelinePlan(("stage",), 1)
        assert pipeline.select(2, "x").strategy == collectives.Strategy.PARTITIONER


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_schedule_equals_the_unpipelined_step(schedule):
    plain = _losses(_trainer(partitioning.preset_rules("megatron")))
    # outside `one_stage`: no pipeline (a trainer of its own: jit keeps a step's first trace)
    assert _permutes(_trainer(partitioning.pipeline_rules("megatron"), schedule)) == 0
    staged_tr = _trainer(partitioning.pipeline_rules("megatron"), schedule)
    with pipeline.one_stage():
        assert _permutes(staged_tr) > 0
        staged = _losses(staged_tr)
    np.testing.assert_allclose(staged, plain, rtol=2e-6)
