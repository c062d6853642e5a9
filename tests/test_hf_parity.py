"""Hugging Face interop: logits parity with transformers (PyTorch, fp32) and round trips."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.hf import weights as hf_convert
from t5lite.model import network

torch = pytest.importorskip("torch", reason="needs the [hf] extra (torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
pytest.importorskip("safetensors", reason="needs the [hf] extra (safetensors)")

import hf_models  # noqa: E402

TOL = 1e-4  # max |logits_t5lite - logits_transformers|, fp32


def _tokens(shape, seed=0):
    return np.random.RandomState(seed).randint(1, 96, size=shape).astype(np.int64)


def _torch_t5_logits(model, enc, dec):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec))
    return out.logits.numpy()


def _torch_llama_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens)).logits.numpy()


def _t5lite_logits(cfg, params, *tokens):
    model = network.EncoderDecoder(cfg) if len(tokens) == 2 else network.DecoderOnly(cfg)
    fn = jax.jit(functools.partial(model.apply, enable_dropout=False))
    return np.asarray(fn({"params": params}, *(jnp.asarray(t, jnp.int32) for t in tokens)))


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("tied", [False, True], ids=["t5.1.1", "t5.1.0"])
def test_t5_parity_and_round_trip(tmp_path, scan, tied):
    model = hf_models.t5_hf(tmp_path, tied=tied)
    cfg, params = hf_convert.import_hf(tmp_path / "hf", scan_layers=scan)
    assert cfg.variant == ("t5.1.0" if tied else "t5.1.1")
    assert (cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.scan_layers) == (2, 3, scan)
    # Length 24 > max_distance 20: exact and log-spaced buckets and the clipped last one.
    enc, dec = _tokens((2, 24)), _tokens((2, 23), seed=1)
    dec[:, 0] = 0
    want = _torch_t5_logits(model, enc, dec)
    got = _t5lite_logits(cfg, params, enc, dec)
    assert np.max(np.abs(got - want)) <= TOL

    hf_convert.export_hf(cfg, params, tmp_path / "out")
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    assert getattr(reloaded.config, "scale_decoder_outputs", tied) == tied
    assert (reloaded.lm_head.weight.data_ptr() == reloaded.shared.weight.data_ptr()) == tied
    assert np.max(np.abs(_torch_t5_logits(reloaded, enc, dec) - want)) <= TOL
    want_sd = model.state_dict()
    for k, v in reloaded.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want_sd[k].numpy(), err_msg=k)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_parity_and_round_trip(tmp_path, scan, tied):
    model = hf_models.llama_hf(tmp_path, tied=tied)
    cfg, params = hf_convert.import_hf(tmp_path / "hf", scan_layers=scan)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 8)
    assert cfg.logits_via_embedding == tied and cfg.layer_norm_epsilon == 1e-5
    tokens = _tokens((2, 16))
    want = _torch_llama_logits(model, tokens)
    got = _t5lite_logits(cfg, params, tokens)
    assert np.max(np.abs(got - want)) <= TOL

    hf_convert.export_hf(cfg, params, tmp_path / "out")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert np.max(np.abs(_torch_llama_logits(reloaded, tokens) - want)) <= TOL
    want_sd = model.state_dict()
    for k, v in reloaded.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want_sd[k].numpy(), err_msg=k)


def test_errors_name_the_culprit(tmp_path):
    with pytest.raises(ValueError, match=r"config.json: not found"):
        hf_convert.import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architectures \['GPT2LMHeadModel'\]"):
        hf_convert.import_hf(tmp_path)

    hf_models.llama_hf(tmp_path)
    hf = tmp_path / "hf"
    raw = json.loads((hf / "config.json").read_text())
    raw["intermediate_size"] = 40
    (hf / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape"):
        hf_convert.import_hf(hf)
    raw["intermediate_size"] = 48
    raw["num_hidden_layers"] = 3
    (hf / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"'model.layers.2.input_layernorm.weight' missing"):
        hf_convert.import_hf(hf)

    cfg = network.DecoderOnlyConfig(position_embedding="relative")
    with pytest.raises(ValueError, match="LlamaForCausalLM only with"):
        hf_convert.export_hf(cfg, {}, tmp_path / "x")


# --- T5 variants as transformers 4.x and 5.x save them -------------------------------------------


def _t5_variant(tmp_path, proj, tied, scaled, legacy_json=False):
    """A tiny T5 with the given head; `legacy_json` drops `scale_decoder_outputs` (4.x files)."""
    cfg = hf_models.t5_config(feed_forward_proj=proj)
    cfg.tie_word_embeddings, cfg.scale_decoder_outputs = tied, scaled
    model = hf_models.build(transformers.T5ForConditionalGeneration, cfg)
    hf_models.share_input_embeddings(model)
    model.save_pretrained(tmp_path / "hf")
    if legacy_json:
        path = tmp_path / "hf" / "config.json"
        raw = json.loads(path.read_text())
        del raw["scale_decoder_outputs"]
        path.write_text(json.dumps(raw))
    return model


def _head_keys(hf_dir):
    from safetensors.numpy import load_file

    return {k for k in load_file(hf_dir / "model.safetensors") if k == "lm_head.weight"}


T5_VARIANTS = [  # (feed_forward_proj, tie_word_embeddings, scale_decoder_outputs, 4.x json)
    pytest.param("gated-gelu", False, False, True, id="t5.1.1-4.x-untied"),
    pytest.param("relu", True, True, True, id="t5.1.0-4.x"),
    pytest.param("gated-gelu", True, True, True, id="gated-4.x-tied-scaled"),
    pytest.param("relu", False, False, False, id="relu-untied"),
    pytest.param("gated-gelu", True, True, False, id="gated-5.x-tied-scaled"),
]


@pytest.mark.parametrize(("proj", "tied", "scaled", "legacy"), T5_VARIANTS)
def test_t5_variants_parity_and_round_trip(tmp_path, proj, tied, scaled, legacy):
    model = _t5_variant(tmp_path, proj, tied, scaled, legacy)
    assert bool(_head_keys(tmp_path / "hf")) == (not tied)
    cfg, params = hf_convert.import_hf(tmp_path / "hf")
    assert (cfg.logits_via_embedding, cfg.scale_tied_logits) == (tied, scaled)
    enc, dec = _tokens((2, 12)), _tokens((2, 9), seed=1)
    want = _torch_t5_logits(model, enc, dec)
    assert np.max(np.abs(_t5lite_logits(cfg, params, enc, dec) - want)) <= TOL
    hf_convert.export_hf(cfg, params, tmp_path / "out")
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    assert np.max(np.abs(_torch_t5_logits(reloaded, enc, dec) - want)) <= TOL


@pytest.mark.parametrize("proj", ["gated-gelu", "relu"], ids=["t5.1.1", "t5.1.0"])
def test_t5_saved_the_usual_way_by_transformers_5(tmp_path, proj):
    """T5.1.1 is built with tie_word_embeddings=False; 5.x ties its head anyway and saves no
    lm_head.weight (scale_decoder_outputs=False); T5 v1.0 keeps the default (tied, scaled)."""
    kw = {"tie_word_embeddings": False} if proj == "gated-gelu" else {}
    model = hf_models.build(
        transformers.T5ForConditionalGeneration, hf_models.t5_config(feed_forward_proj=proj, **kw)
    )
    model.save_pretrained(tmp_path / "hf")
    assert not _head_keys(tmp_path / "hf")
    cfg, params = hf_convert.import_hf(tmp_path / "hf")
    assert cfg.logits_via_embedding and cfg.scale_tied_logits == (proj == "relu")
    enc, dec = _tokens((2, 12)), _tokens((2, 9), seed=1)
    got = _t5lite_logits(cfg, params, enc, dec)
    assert np.max(np.abs(got - _torch_t5_logits(model, enc, dec))) <= TOL


def test_t5_unsupported_variants_are_refused_naming_them(tmp_path):
    _t5_variant(tmp_path, "gated-gelu", tied=False, scaled=True)
    with pytest.raises(ValueError, match="untied lm_head with scale_decoder_outputs=true"):
        hf_convert.import_hf(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "feed_forward_proj": "gated-silu"}))
    with pytest.raises(ValueError, match=r"unsupported T5 variant feed_forward_proj='gated-silu'"):
        hf_convert.import_hf(tmp_path / "hf")


# --- Llama RoPE scaling --------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8, "rope_theta": 10000.0}  # fmt: skip
LINEAR = {"rope_type": "linear", "factor": 3.0, "rope_theta": 500.0}


def _llama_rope_hf(tmp_path, rope, legacy_json=False):
    cfg = hf_models.llama_config(
        max_position_embeddings=16,
        rope_parameters=dict(rope),
        initializer_range=0.2,  # large weights: positions matter
    )
    model = hf_models.build(transformers.LlamaForCausalLM, cfg)
    model.save_pretrained(tmp_path / "hf")
    if legacy_json:  # transformers 4.x: `rope_scaling` (with "type") and a top-level rope_theta
        path = tmp_path / "hf" / "config.json"
        raw = json.loads(path.read_text())
        params = raw.pop("rope_parameters")
        raw["rope_theta"] = params.pop("rope_theta")
        raw["rope_scaling"] = {"type": params.pop("rope_type"), **params}
        path.write_text(json.dumps(raw))
    return model


@pytest.mark.parametrize("legacy", [False, True], ids=["5.x", "4.x"])
@pytest.mark.parametrize("rope", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_llama_rope_scaling_parity(tmp_path, rope, legacy):
    model = _llama_rope_hf(tmp_path, rope, legacy)
    cfg, params = hf_convert.import_hf(tmp_path / "hf")
    assert (cfg.rope_scaling, cfg.rope_scaling_factor) == (rope["rope_type"], rope["factor"])
    assert cfg.rope_theta == rope["rope_theta"]
    tokens = _tokens((2, 40))  # well past original_max_position_embeddings (8)
    want = _torch_llama_logits(model, tokens)
    assert np.max(np.abs(_t5lite_logits(cfg, params, tokens) - want)) <= TOL
    # The scaling matters at this length: without it the logits differ by far more than TOL.
    unscaled = dataclasses.replace(cfg, rope_scaling="none")
    assert np.max(np.abs(_t5lite_logits(unscaled, params, tokens) - want)) > 100 * TOL

    hf_convert.export_hf(cfg, params, tmp_path / "out")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert np.max(np.abs(_torch_llama_logits(reloaded, tokens) - want)) <= TOL


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_unsupported_rope_scaling_is_refused_naming_the_type(tmp_path, kind):
    _llama_rope_hf(tmp_path, LINEAR)
    path = tmp_path / "hf" / "config.json"
    raw = json.loads(path.read_text())
    raw["rope_parameters"]["rope_type"] = kind
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"unsupported RoPE scaling type '{kind}'") as e:
        hf_convert.import_hf(tmp_path / "hf")
    assert "\n" not in str(e.value)
