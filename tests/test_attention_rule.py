"""One attention rule for the loss, scoring and decoding of a decoder-only model.

`DecoderOnlyModel.inputs_bidirectional_attention` decides whether the prompt that a prefix-LM
batch marks (`decoder_causal_attention`) attends bidirectionally. Every model method must read
the same batch the same way: the network receives the same `decoder_causal_attention` from
`loss_fn`, `score_batch` and the prefill of `predict_batch`, and the greedy decode's score
equals the teacher-forced score and loss of the same tokens. An imported Llama (causal) scores
prompts as transformers does.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

from seqio_lite import feature_converters as fc
from t5lite.model import models, network

INPUT_LENGTHS = (4, 7, 13, 1)  # prompts of several lengths, one per row
TARGETS = 6
V = 64


def _examples(seed, targets=None):
    rng = np.random.RandomState(seed)
    out = []
    for i, n in enumerate(INPUT_LENGTHS):
        inputs, t = rng.randint(2, V, n), rng.randint(2, V, TARGETS)
        out.append({"inputs": inputs, "targets": t if targets is None else targets[i]})
    return out


def _prefix_lm_batch(examples, bos_id=0):
    """What the `prefix_lm` feature converter feeds the model (unpacked rows)."""
    conv = fc.PrefixLMFeatureConverter(pack=False, bos_id=bos_id)
    lengths = {"inputs": max(INPUT_LENGTHS), "targets": TARGETS}
    rows = [[conv.convert_example(ex, lengths)] for ex in examples]
    return conv.make_batch(rows, len(rows), conv.group_lengths(lengths))


def _received_prefix(fn):
    """The `decoder_causal_attention` of every eager (untraced) network call made by `fn`."""
    seen = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, network.DecoderOnly) and context.method_name == "__call__":
            tokens = args[0] if args else kwargs["decoder_input_tokens"]
            if not isinstance(tokens, jax.core.Tracer):
                prefix = kwargs.get("decoder_causal_attention")
                seen.append(None if prefix is None else np.asarray(prefix))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        fn()
    return seen


def _model(bidirectional):
    cfg = network.DecoderOnlyConfig(
        vocab_size=V,
        emb_dim=32,
        num_heads=4,
        num_kv_heads=2,
        num_layers=2,
        head_dim=8,
        mlp_dim=48,
    )
    return models.DecoderOnlyModel(
        cfg,
        z_loss=0.0,
        loss_normalization="sum",
        feature_converter="prefix_lm",
        inputs_bidirectional_attention=bidirectional,
    )


@pytest.mark.parametrize("bidirectional", [True, False], ids=["prefix-lm", "causal"])
def test_loss_score_and_decode_see_the_same_attention(bidirectional):
    model = _model(bidirectional)
    batch = _prefix_lm_batch(_examples(0))
    # Seed 2: no row decodes the pad id 0, which teacher forcing would read as padding.
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(2), batch)["params"])

    # The network receives one rule from every method.
    want = batch["decoder_causal_attention"] if bidirectional else None
    got = {
        "loss": _received_prefix(lambda: model.loss_fn(params, batch, None)),
        "score": _received_prefix(lambda: model.score_batch(params, batch)),
        "predict": _received_prefix(
            lambda: model.predict_batch(params, batch, max_decode_length=TARGETS)
        ),
    }
    for method, calls in got.items():
        assert len(calls) == 1, method
        if want is None:
            assert calls[0] is None, method
        else:
            np.testing.assert_array_equal(calls[0], want, err_msg=method)

    # And the same logits: the greedy decode's score is the teacher-forced score (and loss)
    # of the decoded tokens, which the prompt's attention changes.
    decodes, aux = model.predict_batch_with_aux(params, batch, max_decode_length=TARGETS)
    decodes = np.asarray(decodes)
    assert (decodes != model.pad_id).all()
    teacher = _prefix_lm_batch(_examples(0, targets=_until_eos(decodes, model.eos_id)))
    scores = np.asarray(model.score_batch(params, teacher))
    np.testing.assert_allclose(scores, np.asarray(aux["scores"]), atol=1e-4, rtol=0)
    loss, _ = model.loss_fn(params, teacher, None)
    np.testing.assert_allclose(float(loss), -float(np.sum(scores)), atol=1e-4, rtol=0)


def _until_eos(decodes, eos_id):
    out = []
    for row in decodes:
        ends = np.nonzero(row == eos_id)[0]
        out.append(row[: ends[0] + 1] if ends.size else row)
    return out


def test_the_two_settings_differ_on_a_prefix_lm_batch():
    """The check above can tell the rules apart: the same parameters score the same batch
    differently with a bidirectional and a causal prompt."""
    batch = _prefix_lm_batch(_examples(0))
    params = nn.meta.unbox(_model(True).init(jax.random.PRNGKey(0), batch)["params"])
    a = np.asarray(_model(True).score_batch(params, batch))
    b = np.asarray(_model(False).score_batch(params, batch))
    assert np.min(np.abs(a - b)) > 1e-2


def test_imported_llama_scores_prompts_like_transformers(tmp_path):
    """A random small Llama through `t5lite convert` (its model.gin: causal prompts) scores a
    prefix-LM batch's targets as transformers does, and decodes consistently with it."""
    torch = pytest.importorskip("torch", reason="needs the [hf] extra (torch==2.13.0)")
    pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
    from hf_models import llama_hf
    from test_convert import _parse_model_gin

    from t5lite.checkpoint import restore_checkpoint
    from t5lite.hf import convert

    hf = llama_hf(tmp_path)  # vocab 96, bos 1
    out = tmp_path / "imported"
    convert.hf_to_t5lite(tmp_path / "hf", out)
    gin = _parse_model_gin(out / "model.gin")
    try:
        model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    finally:
        gin.clear_config()
    assert model.inputs_bidirectional_attention is False
    params = restore_checkpoint(out / "checkpoint_0", None)[0]["params"]

    batch = _prefix_lm_batch(_examples(1), bos_id=model.decoder_start_token_id)
    assert (batch["decoder_input_tokens"][:, 0] == 1).all()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor(batch["decoder_input_tokens"], dtype=torch.long)).logits
    logp = torch.log_softmax(logits, -1).numpy()
    token_logp = np.take_along_axis(logp, batch["decoder_target_tokens"][..., None], -1)[..., 0]
    want = np.sum(token_logp * batch["decoder_loss_weights"], axis=1)
    got = np.asarray(jax.jit(model.score_batch)(params, batch))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
