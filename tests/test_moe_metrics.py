"""Mixture-of-experts losses and metrics leave padding out (against numpy on the real tokens
only), reach the summarised step metrics per layer, and MFU counts active parameters only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from moe_fixtures import LM_MOE

from t5lite.insight import flops
from t5lite.model import moe
from t5lite.model.models import DecoderOnlyModel
from t5lite.trainer import summarize

B, L, D, F, E = 3, 8, 8, 16, 4


def _numpy_routing(kernel_DE, x_TD, top_k):
    logits = x_TD.astype(np.float64) @ np.asarray(kernel_DE, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return logits, probs, np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]


def _numpy_kept(experts_BLK, capacity):
    """Capacity queues per sequence (padding takes slots too: the dispatch is unchanged)."""
    b, length, k = experts_BLK.shape
    kept = np.zeros_like(experts_BLK, bool)
    for g in range(b):
        counts = np.zeros(E, int)
        for j in range(k):
            for s in range(length):
                e = experts_BLK[g, s, j]
                kept[g, s, j] = counts[e] < capacity
                counts[e] += kept[g, s, j]
    return kept


@pytest.mark.parametrize("top_k", [1, 2])
def test_losses_load_and_drops_of_a_padded_batch_count_real_tokens_only(top_k):
    x = jax.random.normal(jax.random.PRNGKey(0), (B, L, D))
    valid = np.ones((B, L), bool)
    valid[0, 5:] = False
    valid[2, 2:] = False
    block = moe.MoeBlock(E, F, top_k=top_k, eval_capacity_factor=0.5)
    params = nn.unbox(block.init(jax.random.PRNGKey(1), x))["params"]
    y, state = block.apply({"params": params}, x, valid_BL=jnp.asarray(valid), mutable=True)
    y_all, _ = block.apply({"params": params}, x, mutable=True)
    np.testing.assert_array_equal(y, y_all)  # the mask changes statistics, not outputs
    got = {k: float(np.asarray(v[0]).sum()) for k, v in state["intermediates"].items()}
    load = np.asarray(state["intermediates"][moe.EXPERT_LOAD][0])

    x_TD = np.asarray(x).reshape(-1, D)
    logits, probs, experts = _numpy_routing(params["router"]["kernel"], x_TD, top_k)
    real = valid.reshape(-1)
    f = np.array([(experts[real] == e).sum() / real.sum() for e in range(E)])
    p = probs[real].mean(0)
    z = np.log(np.exp(logits[real]).sum(-1)) ** 2
    kept = _numpy_kept(experts.reshape(B, L, top_k), moe.expert_capacity(L, E, top_k, 0.5))
    np.testing.assert_allclose(got[moe.AUX_LOSS], E * np.sum(f * p), rtol=1e-5)
    np.testing.assert_allclose(got[moe.Z_LOSS], z.mean(), rtol=1e-5)
    np.testing.assert_allclose(load, f / top_k, rtol=1e-6)
    dropped = 1.0 - kept[valid].mean()
    assert dropped != 1.0 - kept.mean()  # padding changes the unmasked figure: the case bites
    np.testing.assert_allclose(got[moe.DROPPED], dropped, rtol=1e-6)


LM = dataclasses.replace(LM_MOE, moe_dispatch="dropless")


def _batch(length: int) -> dict[str, jax.Array]:
    rng = np.random.RandomState(0)
    targets = rng.randint(1, 64, (4, 8)).astype(np.int32)
    targets[1, 5:] = 0
    targets = np.pad(targets, ((0, 0), (0, length - 8)))
    inputs = np.pad(targets[:, :-1], ((0, 0), (1, 0)))
    return {
        "decoder_input_tokens": jnp.asarray(inputs),
        "decoder_target_tokens": jnp.asarray(targets),
        "decoder_loss_weights": jnp.asarray((targets > 0).astype(np.float32)),
    }


@pytest.mark.parametrize("scan", [False, True])
def test_padding_columns_change_no_moe_metric(scan):
    """Causal attention: appended padding leaves every real token's router input as it was, so
    the means over the real tokens stay as they were (the block-level test above shows the
    unmasked figures differ)."""
    cfg = dataclasses.replace(LM, scan_layers=scan)
    model = DecoderOnlyModel(network_config=cfg)
    params = nn.unbox(model.init(jax.random.PRNGKey(0), _batch(8)))["params"]
    _, short = model.loss_terms(params, _batch(8), None)
    _, long = model.loss_terms(params, _batch(16), None)
    s, lg = summarize(short), summarize(long)
    keys = [k for k in s if k.startswith("moe")]
    layers = [f"moe/decoder/layers_{i}/load_e{e}" for i in range(2) for e in range(4)]
    assert set(layers) | {"moe_aux_loss", "moe_z_loss", "moe_dropped"} <= set(keys)
    assert "moe/decoder/layers_1/load_max_over_mean" in keys
    for k in keys:
        np.testing.assert_allclose(lg[k], s[k], rtol=2e-5, err_msg=k)
    for i in range(2):  # each layer's load is a distribution over the experts
        total = sum(s[f"moe/decoder/layers_{i}/load_e{e}"] for e in range(4))
        np.testing.assert_allclose(total, 1.0, rtol=1e-6)
        peak = max(s[f"moe/decoder/layers_{i}/load_e{e}"] for e in range(4))
        np.testing.assert_allclose(s[f"moe/decoder/layers_{i}/load_max_over_mean"], 4 * peak)


def test_mfu_counts_the_active_experts_only():
    """Hand formula: per token 6 x (matmul weights a token touches) + attention + logits."""
    d, h, g, kd, f, v, length = 16, 4, 2, 4, 32, 64, 8
    cfg = dataclasses.replace(LM, moe_shared_experts=1, num_layers=3, moe_every=2)
    attn = d * h * kd + 2 * d * g * kd + h * kd * d
    expert = 2 * d * f + f * d  # gated (silu, linear) MLP
    dense_layer = attn + expert
    moe_layer = attn + (2 + 1) * expert + d * 4  # top-2 + one shared expert + the router
    want = 6 * (2 * dense_layer + moe_layer) + 3 * 12 * h * kd * length / 2 + 6 * d * v
    got = flops.flops_per_token(cfg, {"decoder": length})["decoder"]
    assert got == want
    # The 4 experts' parameters are not all active: a dense model of k + shared experts' width
    # has the same count, router aside.
    every = dataclasses.replace(cfg, moe_every=1)
    dense = dataclasses.replace(every, num_experts=0, mlp_dim=3 * f)
    got_every = flops.flops_per_token(every, {"decoder": length})["decoder"]
    assert got_every - flops.flops_per_token(dense, {"decoder": length})["decoder"] == 3 * 6 * d * 4
