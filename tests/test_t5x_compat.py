"""t5x- and seqio-named aliases: a t5x-style gin file trains; t5x arguments map onto t5lite's."""

import json

import gin
import numpy as np
import pytest
from conftest import require_devices, run_cli

import seqio_lite
from t5lite.cli import gin_config
from t5lite.cli import registry as reg
from t5lite.compat import seqio as seqio_compat
from t5lite.compat import t5x
from t5lite.model import decoding, models, network, optimizers

TINY = [
    "--gin.network.T5Config.emb_dim=32", "--gin.network.T5Config.num_heads=2",
    "--gin.network.T5Config.head_dim=16", "--gin.network.T5Config.mlp_dim=64",
    "--gin.network.T5Config.num_encoder_layers=1", "--gin.network.T5Config.num_decoder_layers=1",
    "--gin.BATCH_SIZE=8", "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 16}",
]  # fmt: skip


def test_the_t5x_style_example_trains(tmp_path):
    require_devices(8)
    d = tmp_path / "run"
    argv = ["--gin_file=examples/t5x_t5_1_1_small.gin", f"--gin.MODEL_DIR='{d}'", *TINY]
    assert run_cli("train", *argv, "--gin.TRAIN_STEPS=2") == 0
    with open(d / "metrics.jsonl") as f:
        steps = [r["step"] for r in map(json.loads, f) if r["split"] == "train"]
    assert steps and max(steps) == 2
    assert (d / "checkpoint_2").is_dir()


def _model_from(files, bindings=()):
    with gin.unlock_config():
        gin.clear_config()
    try:
        gin_config.parse_gin(files, list(bindings))
        return reg.EncoderDecoderModel()
    finally:
        with gin.unlock_config():
            gin.clear_config()


def test_t5x_names_in_gin_build_the_t5lite_model():
    model = _model_from(
        ["examples/t5x_t5_1_1_small.gin"],
        ["MODEL_DIR='/tmp/unused'", "LOSS_NORMALIZING_FACTOR=233472", "Z_LOSS=0.0"],
    )
    assert isinstance(model, models.EncoderDecoderModel)
    assert model.loss_normalization == 233472.0 and model.z_loss == 0.0
    cfg = model.network_config
    assert (cfg.emb_dim, cfg.num_heads, cfg.mlp_dim, cfg.num_encoder_layers) == (512, 6, 1024, 8)
    assert cfg.vocab_size == 384 and cfg.policy.compute == "bfloat16" and cfg.variant == "t5.1.1"
    opt = model.optimizer
    assert isinstance(opt, optimizers.Adafactor) and opt.decay_rate == 0.8
    assert opt.factor_rules == optimizers.STANDARD_FACTOR_RULES
    # t5x's default LOSS_NORMALIZING_FACTOR = None is t5x's sum.
    assert _model_from(["t5x/t5_1_1/small.gin"], ["DROPOUT_RATE=0.0"]).loss_normalization == "sum"


def test_t5lite_names_still_resolve_and_typos_still_fail():
    model = _model_from(["quickstart.gin"], ["EncoderDecoderModel.z_loss=0.5"])
    assert model.z_loss == 0.5
    with pytest.raises(gin_config.ConfigError, match="default_decoder_params"):
        _model_from(["quickstart.gin"], ["models.EncoderDecoderModel.default_decoder_params={}"])


def test_t5x_arguments_map_onto_t5lite_fields():
    cfg = network.T5Config(emb_dim=32)
    m = t5x.EncoderDecoderModel(
        module=t5x.Transformer(cfg), optimizer_def=t5x.Adafactor(beta1=0.9),
        loss_normalizing_factor="NUM_TOTAL_TARGET_TOKENS", decode_fn=decoding.beam_search,
        input_vocabulary=object(), output_vocabulary=object(),
    )  # fmt: skip
    assert m.network_config is cfg and m.optimizer.beta1 == 0.9
    assert m.loss_normalization == "per_total_token" and m.decoding_method == "beam"
    lm = t5x.DecoderOnlyModel(
        module=t5x.DecoderWrapper(network.DecoderOnlyConfig()),
        feature_converter_cls=seqio_lite.PrefixLMFeatureConverter,
        decode_fn=decoding.temperature_sample, vocabulary=None,
    )  # fmt: skip
    assert lm.feature_converter == "prefix_lm" and lm.decoding_method == "sample"
    assert t5x.Adafactor(factored=False).factor_rules == {}
    assert t5x.Adafactor(global_norm_clip_threshold=1.0).clip_norm == 1.0
    rules = t5x.standard_logical_factor_rules({"expert": "batch"})
    assert (
        rules["expert"] == optimizers.FactorDim.BATCH and rules["embed"] == optimizers.FactorDim.ROW
    )
    with pytest.raises(ValueError, match="both the t5lite and the t5x name"):
        t5x.EncoderDecoderModel(module=cfg, network_config=cfg)
    with pytest.raises(ValueError, match="name it"):
        t5x.DecoderOnlyModel(feature_converter_cls=type("DecoderFeatureConverter", (), {}))


def test_seqio_named_get_dataset_is_seqio_lites():
    lengths = {"inputs": 16, "targets": 16}
    ours = seqio_compat.get_dataset(
        "synthetic_reverse", lengths, dataset_split="train", num_epochs=None, batch_size=4,
        shard_info=seqio_compat.ShardInfo(index=1, num_shards=2), seed=3,
    )  # fmt: skip
    want = seqio_lite.get_dataset("synthetic_reverse", lengths, "train", 4, shard_id=1,
                                  num_shards=2, seed=3)  # fmt: skip
    for _ in range(2):
        a, b = next(ours), next(want)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    with pytest.raises(ValueError, match="give batch_size"):
        seqio_compat.get_dataset("synthetic_reverse", lengths)
