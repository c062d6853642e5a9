"""Ring attention (`context_parallel_ring`): numerics against data parallelism and the
all-gather context parallelism, compiled permutes against the analytic model, refusals.

8 fake CPU devices, data=2 x model=4: the context axis `model` holds n=4 chunks of each
sequence of 16 positions (4 per device; 2 per zigzag chunk for the causal self-attention).
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices
from flax import linen as nn

from t5lite import collectives, context_parallel
from t5lite.insight import context
from t5lite.insight.hlo import parse_collectives
from t5lite.model import layers, network, optimizers
from t5lite.model.masks import MaskParts
from t5lite.model.models import DecoderOnlyModel, EncoderDecoderModel
from t5lite.partitioning import Partitioner, create_mesh, preset_rules
from t5lite.trainer import Trainer, summarize

B, L = 8, 16
PRESETS = ("data_parallel", "context_parallel", "context_parallel_ring")


def _lm_batch():
    """Two packed examples per row (segments 1, 2), row 0's last 3 positions padding."""
    tokens = np.random.default_rng(0).integers(2, 32, size=(B, L)).astype(np.int32)
    segments = np.ones((B, L), np.int32)
    segments[:, 9:] = 2
    segments[0, 13:] = 0
    tokens[segments == 0] = 0
    positions = np.where(segments == 2, np.arange(L) - 9, np.arange(L)).astype(np.int32)
    inputs = np.zeros_like(tokens)
    inputs[:, 1:] = tokens[:, :-1]
    inputs[:, 9] = 0  # each example starts from BOS
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": tokens,
        "decoder_loss_weights": (tokens > 0).astype(np.int32),
        "decoder_segment_ids": segments,
        "decoder_positions": positions,
    }


def _t5_batch():
    rng = np.random.default_rng(1)
    inputs = rng.integers(2, 32, size=(B, L)).astype(np.int32)
    inputs[1, 12:] = 0
    targets = inputs[:, ::-1].copy()
    targets[:, -3:] = 0
    return {
        "encoder_input_tokens": inputs,
        "decoder_input_tokens": np.pad(targets, ((0, 0), (1, 0)))[:, :-1],
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (targets > 0).astype(np.int32),
    }


def _model(kind, **kw):
    if kind == "lm":
        cfg = network.DecoderOnlyConfig(vocab_size=32, emb_dim=16, num_heads=4, num_kv_heads=2,
                                        num_layers=2, head_dim=8, mlp_dim=32, **kw)  # fmt: skip
        return DecoderOnlyModel(cfg, optimizer=optimizers.AdamW(1e-2)), {"targets": L}
    cfg = network.T5Config(vocab_size=32, emb_dim=16, num_heads=4, num_encoder_layers=1,
                           num_decoder_layers=1, head_dim=4, mlp_dim=32, **kw)  # fmt: skip
    return EncoderDecoderModel(cfg, optimizer=optimizers.AdamW(1e-2)), {"inputs": L, "targets": L}


@functools.cache
def _run(kind, preset, remat="none", scan=False):
    """(loss, gradients, compiled HLO of the gradient step, trainer) under `preset`."""
    require_devices(8)
    part = Partitioner(create_mesh(4), logical_axis_rules=preset_rules(preset))
    model, lengths = _model(kind, remat_policy=remat, scan_layers=scan)
    tr = Trainer(model, part, batch_size=B, lengths=lengths)
    data = _lm_batch() if kind == "lm" else _t5_batch()
    batch = tr.global_batch({k: data.get(k, np.zeros((B, L), np.int32)) for k in tr.batch_abstract})
    state = tr.init_state()
    grads = part.partition(
        lambda p, b: tr._grads(p, b, jax.random.PRNGKey(0)),
        (tr.state_shardings.params, tr.batch_shardings),
        (tr.state_shardings.params, None),
    )
    with part.context():
        compiled = grads.lower(state.params, batch).compile()
        g, metrics = compiled(state.params, batch)
    return summarize(metrics)["loss"], jax.tree.map(np.asarray, g), compiled.as_text(), tr


@pytest.mark.parametrize("kind", ["lm", "t5"])
def test_ring_equals_data_parallel_and_all_gather(kind):
    """Decoder-only (causal, packed, padded, GQA: zigzag-balanced) and T5 (relative bias,
    encoder padding, causal decoder balanced, cross-attention plain ring): the loss to 1e-6
    relative and every gradient to 1e-6 of the largest (fp32; sums in another order)."""
    loss_dp, grads_dp, _, _ = _run(kind, "data_parallel")
    for preset in PRESETS[1:]:
        loss, grads, _, _ = _run(kind, preset)
        np.testing.assert_allclose(loss, loss_dp, rtol=1e-6)
        scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads_dp))
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_dp)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * scale)


def _compiled_permutes(hlo, mesh):
    """(count, bytes) of the compiled permutes over `model`."""
    compiled = collections.Counter()
    for c in parse_collectives(hlo, mesh):
        if c.axes == ("model",):
            compiled[c.kind, "count"] += 1
            compiled[c.kind, "bytes"] += c.bytes
    return compiled["collective-permute", "count"], compiled["collective-permute", "bytes"]


@pytest.mark.parametrize("kind", ["lm", "t5"])
def test_compiled_permutes_equal_the_analytic_model(kind):
    _, _, hlo, tr = _run(kind, "context_parallel_ring")
    rows, masks = context.context_layer_collectives(tr), context.mask_collectives(tr)
    want = context.summary(rows, masks)
    assert set(want) == {"collective-permute"}
    assert _compiled_permutes(hlo, tr.partitioner.mesh) == want["collective-permute"]
    # Independently of the model's code, the per-layer figures for the decoder-only model:
    # n=4, B'=4, a chunk of keys [4, 4, 2, 8] fp32 (1 KiB), of queries [4, 4, 4, 8] (2 KiB).
    # Forward: k, v 3 hops each (6 KiB); backward: k, v stacked 3 hops (6 KiB) and their fp32
    # gradients stacked 4 hops (8 KiB); zigzag: q, k, v, out in and their gradients out, two
    # halves each (16 permutes, 12 KiB).
    if kind == "lm":
        assert sum(r.count for r in rows) == 6 + 3 + 4 + 16
        assert sum(r.bytes for r in rows) == (6 + 6 + 8) * 1024 + 2 * (2048 + 1024 + 1024 + 2048)


def _remat_case(kind, remat, scan):
    """(compiled permutes, the model's, without remat's compiled; the model's remat rows)."""
    loss, grads, hlo, tr = _run(kind, "context_parallel_ring", remat, scan)
    rows, masks = context.context_layer_collectives(tr), context.mask_collectives(tr)
    again = [r for r in rows if r.why.startswith("remat")]
    assert len(again) == len(context.attention_layers(tr, 4))
    # The numerics stay data parallelism's (same parameters: same scan layout, remat none).
    loss_dp, grads_dp, _, _ = _run(kind, "data_parallel", "none", scan)
    np.testing.assert_allclose(loss, loss_dp, rtol=1e-6)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads_dp))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_dp)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * scale)
    _, _, hlo_none, tr_none = _run(kind, "context_parallel_ring", "none", scan)
    return (
        _compiled_permutes(hlo, tr.partitioner.mesh),
        context.summary(rows, masks)["collective-permute"],
        _compiled_permutes(hlo_none, tr_none.partitioner.mesh),
        again,
    )


@pytest.mark.parametrize("remat, scan", [("full", False), ("full", True), ("minimal", True)])
def test_remat_sends_the_forward_ring_again(remat, scan):
    """A rematerialised layer rebuilds its ring's residuals in the backward pass: its forward
    permutes (keys and values around the ring, the zigzag) are sent again, exactly as the
    analytic model's remat row says (the decoder-only model)."""
    compiled, model, _, again = _remat_case("lm", remat, scan)
    assert compiled == model
    # Independently: per layer the forward's 6 key/value hops (1 KiB each) and 8 zigzag
    # halves (q and out 1 KiB, k and v 512 B): 14 permutes, 12 KiB.
    assert [(r.count, r.bytes) for r in again] == [(6 + 8, 6 * 1024 + 6 * 1024)]


@pytest.mark.parametrize("kind, remat", [("lm", "minimal"), ("t5", "full"), ("t5", "minimal")])
def test_remat_sends_at_most_the_model(kind, remat):
    """Unscanned, XLA:CPU reuses some of the forward's sends where the rematerialised values
    equal them (`minimal` saves the projections; T5's full recomputation): more permutes than
    without remat, at most the model's."""
    compiled, model, none, _ = _remat_case(kind, remat, False)
    assert none[0] < compiled[0] <= model[0] and none[1] < compiled[1] <= model[1]


def test_all_gather_context_parallel_matches_its_model():
    _, _, hlo, tr = _run("t5", "context_parallel")
    want = context.summary(context.context_layer_collectives(tr), [])
    kv, kv_shard = B // 2 * L * 4 * 4 * 4, B // 2 * L // 4 * 4 * 4 * 4  # [B', S(/n), H, K] fp32
    assert want == {"all-gather": (6, 6 * kv), "reduce-scatter": (6, 6 * kv_shard)}
    compiled = collections.Counter()
    for c in parse_collectives(hlo, tr.partitioner.mesh):
        if c.axes == ("model",) and c.kind in want and c.bytes in (kv, kv_shard):
            compiled[c.kind] += 1
    assert compiled == {"all-gather": 6, "reduce-scatter": 6}


def _attention(**kw):
    return layers.MultiHeadAttention(num_heads=4, num_kv_heads=2, head_dim=8, **kw)


@pytest.mark.parametrize(
    "kw, mask, train, message",
    [
        (dict(dropout_rate=0.1), MaskParts(causal=True), True,
         "ring context parallelism cannot apply attention dropout (dropout_rate > 0 in training); "
         "set dropout_rate=0 or use the context_parallel preset"),
        ({}, layers.make_causal_mask(2, L), False,
         "ring context parallelism needs the attention mask by its parts (MaskParts), got a whole "
         "mask; use the context_parallel preset"),
        (dict(attention_implementation="splash"), MaskParts(causal=True), False,
         "ring context parallelism computes its blocks itself and cannot run "
         "attention_implementation='splash'; use one of xla, chunked, auto or the "
         "context_parallel preset"),
    ],
)  # fmt: skip
def test_what_the_ring_refuses(kw, mask, train, message):
    require_devices(8)
    mha = _attention(**kw)
    x = jnp.ones((2, L, 16))
    params = _attention().init(jax.random.PRNGKey(0), x, x, None)
    rules = preset_rules("context_parallel_ring")
    with jax.set_mesh(create_mesh(4)), nn.logical_axis_rules(rules):
        apply = jax.jit(
            lambda p, x: mha.apply(
                p, x, x, mask, deterministic=not train, rngs={"dropout": jax.random.PRNGKey(1)}
            )
        )
        with pytest.raises(ValueError) as e:
            apply(params, x)
    assert str(e.value) == message


def test_the_preset_selects_the_ring_and_an_unsplit_kv_length_the_all_gather():
    require_devices(8)
    q, k = jnp.zeros((2, L, 4, 8)), jnp.zeros((2, L, 2, 8))
    with jax.set_mesh(create_mesh(4)):
        for preset, want in [
            ("context_parallel_ring", collectives.Strategy.RING_CONTEXT_PARALLEL),
            ("context_parallel", collectives.Strategy.CONTEXT_PARALLEL),
        ]:
            with nn.logical_axis_rules(preset_rules(preset)):
                choice = context_parallel.select_attention_strategy(q, k, None, None, "kv_heads")
                assert choice.strategy is want
                assert choice.plan.cp == ("model",)


@pytest.mark.parametrize(
    "dtype, atol, with_prefix",
    [(jnp.float32, 1e-5, True), (jnp.bfloat16, 3e-2, True), (jnp.float32, 1e-5, False)],
)
def test_masks_against_the_unsharded_layer(dtype, atol, with_prefix):
    """A prefix-LM's bidirectional prefix (per row) with packed segments and padding runs the
    plain ring (keys of later devices are visible to the prefix); without the prefix the
    balanced one, whose padding rows (no visible key) still average every value as `xla` does.
    Output and gradients equal the unsharded layer's (fp32 to 1e-5 of the largest; bf16
    compute to 3e-2)."""
    require_devices(8)
    mha = _attention(dtype=dtype, scale_logits=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, L, 16))
    segments = jnp.array([[1] * 10 + [2] * 4 + [0] * 2, [1] * 16])
    prefix = jnp.array([[1] * 5 + [0] * 11, [1] * 9 + [0] * 7]) == 1
    prefix = prefix if with_prefix else None
    valid = segments > 0
    mask = MaskParts(valid, valid, segments, segments, prefix, prefix, causal=True)
    params = mha.init(jax.random.PRNGKey(1), x, x, mask)

    def loss(p, x):
        return jnp.sum(mha.apply(p, x, x, mask).astype(jnp.float32) ** 2)

    want = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    rules = preset_rules("context_parallel_ring")
    with jax.set_mesh(create_mesh(4)), nn.logical_axis_rules(rules):
        q = jnp.zeros((2, L, 4, 8))
        choice = context_parallel.select_attention_strategy(q, q[:, :, :2], None, None, "kv_heads")
        assert choice.strategy is collectives.Strategy.RING_CONTEXT_PARALLEL
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(
            np.float32(g), np.float32(w), atol=atol * max(1, np.abs(w).max())
        )
