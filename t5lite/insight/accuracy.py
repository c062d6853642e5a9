"""The models `predict_memory`'s accuracy is stated on (tests/test_insight_accuracy.py,
tests/test_moe_memory.py, tests/test_tpu_memory.py, benchmarks/memory_accuracy.py,
docs/performance.md): small but not tiny, so shapes dominate the compilers' fixed overheads."""

from __future__ import annotations

from t5lite.partitioning import Partitioner
from t5lite.trainer import Trainer

ACCURACY_FAMILIES = ("t5", "lm")


def accuracy_trainer(
    family: str,
    preset: str,
    remat: str,
    scan: bool = True,
    batch_size: int = 16,
    layers: int = 2,
    precision: str = "float32",
    experts: int = 0,
    dispatch: str = "capacity",
    moe_every: int = 1,
) -> Trainer:
    """A trainer of the small-but-not-tiny models `PredictedMemory`'s accuracy is measured on
    (tests/test_insight_accuracy.py, benchmarks/memory_accuracy.py): shapes dominate XLA's
    fixed overheads, `layers` a stack (two by default); `family` is "t5" (T5.1.1-like
    encoder-decoder) or "lm" (decoder-only), on data=2 x model=4 (data=8 for a preset without
    model parallelism), under the mixed-precision `precision` policy (precision.py); `experts`
    > 0 makes every `moe_every`-th layer's MLP a mixture of that many experts (the family's
    default top-k, `dispatch` "capacity" or "dropless").
    """
    # Imported here: the models are only needed by whoever measures accuracy.
    from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
    from t5lite.model.network import DecoderOnlyConfig, T5Config
    from t5lite.partitioning import PRESETS, create_mesh, preset_rules

    # The two families' shared shapes and settings.
    common = dict(
        vocab_size=8192,
        emb_dim=256,
        num_heads=4,
        head_dim=64,
        remat_policy=remat,
        scan_layers=scan,
        precision=precision,
        num_experts=experts,
        moe_dispatch=dispatch,
        moe_every=moe_every,
    )
    if family == "t5":
        cfg = T5Config(**common, mlp_dim=1024, num_encoder_layers=layers, num_decoder_layers=layers)
        model, lengths = EncoderDecoderModel(network_config=cfg), {"inputs": 128, "targets": 64}
    elif family == "lm":
        lm = DecoderOnlyConfig(**common, mlp_dim=768, num_layers=layers)
        model, lengths = DecoderOnlyModel(network_config=lm), {"targets": 128}
    else:
        raise ValueError(f"family {family!r}: one of {ACCURACY_FAMILIES}")
    model_parallel = 1 if PRESETS[preset] is None else 4
    part = Partitioner(create_mesh(model_parallel), logical_axis_rules=preset_rules(preset))
    return Trainer(model, part, batch_size=batch_size, lengths=lengths)
