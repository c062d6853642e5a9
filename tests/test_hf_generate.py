"""With the same weights, KV-cached greedy decoding equals transformers' `generate()` greedy output
(T5 encoder-decoder, Llama with prompts of different lengths)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.hf import weights as hf_convert
from t5lite.model import models

torch = pytest.importorskip("torch", reason="needs the [hf] extra (torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
pytest.importorskip("safetensors", reason="needs the [hf] extra (safetensors)")

import hf_models  # noqa: E402

NEW = 10  # new tokens


def _hf_greedy(model, use_cache=True, **inputs):
    with torch.no_grad():
        return model.generate(
            **{k: torch.tensor(v) for k, v in inputs.items()}, max_new_tokens=NEW,
            do_sample=False, num_beams=1, eos_token_id=1, pad_token_id=0, use_cache=use_cache,
        ).numpy()  # fmt: skip


def _pad(rows, length):
    return np.array([list(r) + [0] * (length - len(r)) for r in rows], np.int32)


def _bias_eos(hf_model, lm_head):
    """Makes EOS (id 1) likely after some tokens so that EOS stopping is exercised too."""
    with torch.no_grad():
        lm_head.weight[1] = lm_head.weight[5] + 0.01


def test_t5_greedy_equals_hf_generate(tmp_path):
    hf = hf_models.t5_hf(tmp_path)
    _bias_eos(hf, hf.lm_head)
    hf.save_pretrained(tmp_path / "hf")
    cfg, params = hf_convert.import_hf(tmp_path / "hf")
    enc = np.random.RandomState(0).randint(2, 96, size=(4, 12)).astype(np.int32)
    enc[1, 7:] = 0  # padding, masked as HF's attention_mask does
    # NOTE: HF's T5 cache is sized by the encoder's layer count (2 < 3 decoder layers here), so
    # HF decodes without its cache: the same greedy tokens, recomputed.
    mask = (enc > 0).astype(np.int64)
    want = _hf_greedy(hf, use_cache=False, input_ids=enc, attention_mask=mask)
    assert want[:, 0].tolist() == [0] * 4  # decoder start token
    model = models.EncoderDecoderModel(network_config=cfg)
    batch = {"encoder_input_tokens": enc, "decoder_input_tokens": np.zeros((4, NEW), np.int32)}
    got = np.asarray(jax.jit(model.predict_batch)(params, batch))
    np.testing.assert_array_equal(got, _pad(want[:, 1:], NEW))
    assert (got == 1).any()  # some row stopped at EOS


def test_llama_greedy_with_prompts_equals_hf_generate(tmp_path):
    hf = hf_models.llama_hf(tmp_path)
    _bias_eos(hf, hf.lm_head)
    hf.save_pretrained(tmp_path / "hf")
    cfg, params = hf_convert.import_hf(tmp_path / "hf", scan_layers=True)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(2, 96, n).tolist() for n in (1, 3, 5, 2)]
    length = 5 + 1 + NEW  # longest prompt, BOS, new tokens
    # Prefix-LM layout: decoder inputs [BOS=0, prompt..., 0...], causal attention on BOS+prompt.
    dec_in = _pad([[0, *p] for p in prompts], length)
    causal = _pad([[1] * (len(p) + 1) for p in prompts], length)
    # A causal LM: the prompt is not attended bidirectionally.
    model = models.DecoderOnlyModel(network_config=cfg, inputs_bidirectional_attention=False)
    batch = {"decoder_input_tokens": dec_in, "decoder_causal_attention": causal}
    decode = jax.jit(lambda p, b: model.predict_batch(p, b, max_decode_length=NEW))
    got = np.asarray(decode(params, batch))
    # HF, one row at a time (no left padding needed), on the same [BOS, prompt] tokens.
    want = []
    for p in prompts:
        out = _hf_greedy(hf, input_ids=np.array([[0, *p]]), attention_mask=np.ones((1, len(p) + 1)))
        want.append(out[0, len(p) + 1 :].tolist())
    np.testing.assert_array_equal(got, _pad(want, NEW))
    assert jnp.asarray(got).shape == (4, NEW)
