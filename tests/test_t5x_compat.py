"""t5x- and seqio-named aliases: a t5x-style gin file trains; t5x arguments map onto t5lite's."""

import json
import os
import subprocess
import sys

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
    small = _model_from(["t5x/examples/t5/t5_1_1/small.gin"], ["DROPOUT_RATE=0.0"])
    assert small.loss_normalization == "sum"


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


# t5x's t5x/examples/t5/t5_1_1/base.gin and small.gin as a t5x user has them (their own copy,
# under their own directory): dynamic registration, t5x's imports, seqio's gs:// vocabulary.
T5X_BASE = """\
from __gin__ import dynamic_registration

import seqio
from t5x import adafactor
from t5x import models
from t5x.examples.t5 import network

Z_LOSS = 0.0001
LABEL_SMOOTHING = 0.0
LOSS_NORMALIZING_FACTOR = None
DROPOUT_RATE = %gin.REQUIRED

VOCABULARY = @seqio.SentencePieceVocabulary()
seqio.SentencePieceVocabulary.sentencepiece_model_file = "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"

OPTIMIZER = @adafactor.Adafactor()
adafactor.Adafactor:
  decay_rate = 0.8
  step_offset = 0
  logical_factor_rules = @adafactor.standard_logical_factor_rules()

MODEL = @models.EncoderDecoderModel()
models.EncoderDecoderModel:
  module = @network.Transformer()
  input_vocabulary = %VOCABULARY
  output_vocabulary = %VOCABULARY
  optimizer_def = %OPTIMIZER
  z_loss = %Z_LOSS
  label_smoothing = %LABEL_SMOOTHING
  loss_normalizing_factor = %LOSS_NORMALIZING_FACTOR

network.Transformer.config = @network.T5Config()
network.T5Config:
  vocab_size = 32128
  dtype = 'bfloat16'
  emb_dim = 768
  num_heads = 12
  num_encoder_layers = 12
  num_decoder_layers = 12
  head_dim = 64
  mlp_dim = 2048
  mlp_activations = ('gelu', 'linear')
  dropout_rate = %DROPOUT_RATE
  logits_via_embedding = False
"""
T5X_SMALL = """\
include 'my_t5x/base.gin'

network.Transformer.config = @network.T5Config()
network.T5Config:
  emb_dim = 512
  num_heads = 6
  num_encoder_layers = 8
  num_decoder_layers = 8
  head_dim = 64
  mlp_dim = 1024
"""


def test_a_t5x_model_file_as_t5x_writes_it_builds_the_shipped_model(tmp_path):
    (tmp_path / "my_t5x").mkdir()
    (tmp_path / "my_t5x" / "base.gin").write_text(T5X_BASE)
    (tmp_path / "my_t5x" / "small.gin").write_text(T5X_SMALL)
    with gin.unlock_config():
        gin.clear_config()
    try:
        gin_config.parse_gin(["my_t5x/small.gin"], ["DROPOUT_RATE=0.0"], [str(tmp_path)])
        theirs = reg.EncoderDecoderModel()
        vocabulary = gin.query_parameter("%VOCABULARY")
    finally:
        with gin.unlock_config():
            gin.clear_config()
    ours = _model_from(["t5x/examples/t5/t5_1_1/small.gin"], ["DROPOUT_RATE=0.0"])
    assert theirs == ours
    cfg = theirs.network_config
    assert (cfg.emb_dim, cfg.num_encoder_layers, cfg.mlp_dim) == (512, 8, 1024)
    assert cfg.variant == "t5.1.1" and cfg.tie_logits is False and not cfg.logits_via_embedding
    assert theirs.loss_normalization == "sum" and theirs.optimizer.decay_rate == 0.8
    # The model decodes with the task's vocabulary: the gs:// file is bound, never opened.
    assert isinstance(vocabulary, gin.config.ConfigurableReference)


def test_t5x_mlp_activations_and_logits_via_embedding_name_the_variant():
    t5_1_0 = t5x.T5Config(mlp_activations=("relu",), logits_via_embedding=True)
    assert t5_1_0 == network.T5Config(variant="t5.1.0", tie_logits=True)
    assert t5_1_0.scale_tied_logits and t5_1_0.mlp_activations == ("relu",)
    untied = t5x.T5Config(mlp_activations=["gelu", "linear"], logits_via_embedding=False)
    assert untied == network.T5Config(variant="t5.1.1", tie_logits=False)
    with pytest.raises(ValueError, match=r"\['variant'\] given under both the t5lite and the t5x"):
        t5x.T5Config(mlp_activations=("relu",), variant="t5.1.1")
    with pytest.raises(ValueError, match=r"mlp_activations=\('silu', 'linear'\): t5lite's T5"):
        t5x.T5Config(mlp_activations=("silu", "linear"))


def test_a_t5x_module_t5lite_does_not_stand_in_for_is_one_line(tmp_path):
    (tmp_path / "run.gin").write_text(
        "from __gin__ import dynamic_registration\nfrom t5x import utils\n"
    )
    with pytest.raises(gin_config.ConfigError) as e:
        _model_from([str(tmp_path / "run.gin")])
    assert "No module named 't5x.utils'" in str(e.value) and "line 2" in str(e.value)
    assert "t5lite stands in for seqio, t5x.adafactor" in str(e.value)
    assert "\n" not in str(e.value)


def test_an_installed_t5x_is_never_shadowed(tmp_path):
    (tmp_path / "t5x").mkdir()
    (tmp_path / "t5x" / "__init__.py").write_text("REAL = True\n")
    code = (
        "import sys\n"
        "from t5lite.cli import gin_config, registry\n"
        "gin_config._stand_in_for_t5x(registry.T5X_MODULES)\n"
        "import t5x, seqio\n"
        "print(getattr(t5x, 'REAL', False), seqio.__doc__ == gin_config._STAND_IN_DOC)\n"
        # Imported before the stand-ins are made: its submodules are not invented either.
        "gin_config._stand_in_for_t5x(registry.T5X_MODULES)\n"
        "print('t5x.models' not in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr[-2000:]
