"""Unscanned layers at long sequences: what `full` remat saves on XLA:CPU, and the memory
prediction against the compiled step where the [B, H, L, S] attention scores dominate."""

import pytest
from conftest import require_devices

from t5lite.insight import memory
from t5lite.insight.report import compile_train_step
from t5lite.model.models import DecoderOnlyModel
from t5lite.model.network import DecoderOnlyConfig
from t5lite.partitioning import Partitioner, create_mesh, preset_rules
from t5lite.trainer import Trainer

# 2048 positions, batch 2 a device (data=4 x model=2): one layer's fp32 scores are 64 MiB a
# device, a [B, L, F] buffer 4 MiB, the logits 8 MiB.
LENGTH, BATCH, LAYERS = 2048, 8, 2


def _trainer(preset: str, remat: str) -> Trainer:
    cfg = DecoderOnlyConfig(
        vocab_size=1024,
        emb_dim=256,
        num_heads=4,
        head_dim=64,
        mlp_dim=512,
        num_layers=LAYERS,
        remat_policy=remat,
        scan_layers=False,
    )
    part = Partitioner(create_mesh(2), logical_axis_rules=preset_rules(preset))
    model = DecoderOnlyModel(network_config=cfg)
    return Trainer(model, part, batch_size=BATCH, lengths={"targets": LENGTH})


@pytest.mark.parametrize("preset", ["fsdp", "context_parallel"])
def test_unscanned_full_remat_keeps_the_scores_at_long_sequences(preset):
    """Unscanned, XLA:CPU hoists every layer's `full` recomputation ahead of the loss gradient,
    scores included: `full` compiles to within 5% of `none`, and the prediction of each is
    within 10% of the compiled step (docs/performance.md has the figures)."""
    require_devices(8)
    compiled, predicted = {}, {}
    for remat in ("none", "full"):
        tr = _trainer(preset, remat)
        compiled[remat] = memory.memory_report(compile_train_step(tr)).total
        predicted[remat] = memory.predict_memory(tr).total
        assert abs(predicted[remat] / compiled[remat] - 1) < 0.10, (remat, predicted, compiled)
    assert compiled["full"] > 0.95 * compiled["none"], compiled
