"""The tiny mixture-of-experts networks and the trainer that the MoE tests share."""

from __future__ import annotations

from t5lite import partitioning
from t5lite.model import network
from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
from t5lite.partitioning import Partitioner
from t5lite.trainer import Trainer

LM_MOE = network.DecoderOnlyConfig(
    vocab_size=64,
    emb_dim=16,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    mlp_dim=32,
    num_layers=2,
    num_experts=4,
    moe_top_k=2,
)
"""A Mixtral-style LM: every layer's MLP 4 experts, top-2, capacity dispatch."""

T5_MOE = network.T5Config(
    vocab_size=64,
    emb_dim=16,
    num_heads=4,
    head_dim=4,
    mlp_dim=32,
    num_encoder_layers=2,
    num_decoder_layers=2,
    num_experts=4,
    moe_every=2,
    variant="t5.1.0",
)
"""A Switch-style T5.1.0: layer 1 of the encoder and of the decoder 4 experts, top-1."""


def moe_trainer(
    cfg: network.T5Config | network.DecoderOnlyConfig,
    preset: str = "expert_parallel",
    num_partitions: int = 2,
    lengths: dict[str, int] | None = None,
) -> Trainer:
    """A Trainer of `cfg` (batch 8, targets of 8 unless `lengths`) on a mesh of
    `model=num_partitions` under the rules preset `preset`."""
    part = Partitioner(
        partitioning.create_mesh(num_partitions),
        logical_axis_rules=partitioning.preset_rules(preset),
    )
    model_cls = EncoderDecoderModel if isinstance(cfg, network.T5Config) else DecoderOnlyModel
    lengths = lengths or {"targets": 8}
    return Trainer(model_cls(network_config=cfg), part, batch_size=8, lengths=lengths)
