"""`Trainer(packed=False)`: one example per row, so the model reads no segment ids or positions.

Its padding is then the only mask beside causality, and cuDNN gets it as row lengths with
`is_causal` (no [L, L] array); with segment ids (completed as `tokens != 0` for an unpacked
batch) the same rows reach cuDNN as a whole mask, which its kernels read in every block (1.5x
the attention time of the 1B decoder's step on an H200, docs/performance.md). Both give the same
loss and gradients on an unpacked batch (fp32, `xla` attention: atol 1e-6); a batch that packs
several examples a row is refused by an unpacked Trainer in one line.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from t5lite import partitioning, trainer
from t5lite.model import models, network, optimizers

B, L = 2, 16
LM = dict(vocab_size=32, emb_dim=16, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)


def _trainer(packed: bool, **cfg) -> trainer.Trainer:
    config = network.DecoderOnlyConfig(**{**LM, "num_layers": 2, **cfg})
    model = models.DecoderOnlyModel(network_config=config, optimizer=optimizers.AdamW(1e-3))
    mesh = partitioning.create_mesh(1, devices=jax.devices()[:1])
    return trainer.Trainer(
        model,
        partitioning.Partitioner(mesh=mesh),
        batch_size=B,
        lengths={"targets": L},
        packed=packed,
    )


def _batch() -> dict[str, np.ndarray]:
    targets = np.random.default_rng(0).integers(2, 32, (B, L), dtype=np.int32)
    targets[1, -5:] = 0  # the second row is padded at its end
    inputs = np.concatenate([np.zeros((B, 1), np.int32), targets[:, :-1]], axis=1)
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (targets > 0).astype(np.int32),
    }


def test_an_unpacked_trainer_reads_no_segment_ids_or_positions():
    assert set(_trainer(True).batch_abstract) >= {"decoder_segment_ids", "decoder_positions"}
    assert set(_trainer(False).batch_abstract) == {
        "decoder_input_tokens",
        "decoder_target_tokens",
        "decoder_loss_weights",
    }


def test_unpacked_and_packed_trainers_agree_on_an_unpacked_batch():
    results = []
    for packed in (True, False):
        tr = _trainer(packed, precision="float32")
        state = tr.init_state()
        state, metrics = tr.train_step(state, tr.global_batch(_batch()))
        results.append((jax.device_get(state.params), jax.device_get(metrics)))
    (params_p, m_p), (params_u, m_u) = results
    assert float(m_u["loss_sum"]) == pytest.approx(float(m_p["loss_sum"]), rel=1e-6)
    for got, want in zip(jax.tree.leaves(params_u), jax.tree.leaves(params_p)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "packed, want", [(False, (True, None, [L, L - 5])), (True, (True, (B, 1, L, L), None))]
)
def test_cudnn_gets_row_lengths_only_from_an_unpacked_trainer(monkeypatch, packed, want):
    calls = []
    real = jax.nn.dot_product_attention

    def recording(q, k, v, bias=None, mask=None, *, implementation=None, is_causal=False, **kw):
        lengths = kw.get("key_value_seq_lengths")
        if lengths is not None and not isinstance(lengths, jax.core.Tracer):
            lengths = np.asarray(lengths).tolist()
        calls.append((is_causal, None if mask is None else mask.shape, lengths))
        return real(q, k, v, bias, mask, implementation="xla", is_causal=is_causal, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    bf16 = "params=bfloat16,compute=bfloat16,output=float32"
    tr = _trainer(packed, attention_implementation="cudnn", precision=bf16)
    params = tr.init_state().params
    batch = {k: jax.numpy.asarray(v) for k, v in tr.global_batch(_batch()).items()}
    calls.clear()
    # Not jitted, so the recorded lengths are values: each layer's call, forward only.
    with tr.partitioner.context():
        tr.model.loss_fn(params, batch, None)
    assert calls == [want, want]


def test_an_unpacked_trainer_refuses_a_packed_batch():
    batch = _batch()
    batch["decoder_segment_ids"] = np.array([[1] * 8 + [2] * 8, [1] * 11 + [0] * 5])
    with pytest.raises(ValueError) as err:
        _trainer(False).global_batch(batch)
    assert str(err.value) == (
        "decoder_segment_ids packs up to 2 examples a row, but this Trainer was built with "
        "packed=False, which reads no segment ids: build it with packed=True (DataConfig.pack)"
    )
    batch["decoder_segment_ids"] = (batch["decoder_target_tokens"] > 0).astype(np.int32)
    assert "decoder_segment_ids" not in _trainer(False).global_batch(batch)  # one a row: fine
