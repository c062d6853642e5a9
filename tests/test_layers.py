"""Primitives: exact numbers for RMSNorm, buckets, RoPE, grouped-query attention, dense axes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from t5lite.model import layers, positions


def test_rms_norm_is_fp32_with_eps():
    x = jnp.array([[3.0, 4.0]], jnp.bfloat16)
    norm = layers.RMSNorm(epsilon=1e-6, dtype=jnp.float32)
    variables = norm.init(jax.random.PRNGKey(0), x)
    assert variables["params"]["scale"].names == ("embed",)
    y = norm.apply(variables, x)
    rms = np.sqrt((9 + 16) / 2 + 1e-6)
    np.testing.assert_allclose(y, [[3 / rms, 4 / rms]], rtol=1e-6)
    assert y.dtype == jnp.float32


def test_relative_position_buckets_match_t5():
    rel = np.arange(-200, 201)
    bi = positions.relative_position_bucket(rel, True, 32, 128)
    # Bidirectional: 16 buckets per direction, 8 exact offsets, then log-spaced up to 128.
    assert bi[rel == 0] == 0 and bi[rel == 1] == 17 and bi[rel == -1] == 1
    assert bi[rel == 7] == 23 and bi[rel == -7] == 7
    assert bi[rel == 8] == 24 and bi[rel == 200] == 31 and bi[rel == -200] == 15
    causal = positions.relative_position_bucket(rel, False, 32, 128)
    # Causal: future offsets all map to bucket 0; 16 exact past offsets.
    assert set(causal[rel >= 0]) == {0}
    assert causal[rel == -15] == 15 and causal[rel == -16] == 16 and causal[rel == -200] == 31
    assert np.all(np.diff(causal[rel <= 0][::-1]) >= 0)


def test_rope_depends_only_on_offsets():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    q = jax.random.normal(k1, (1, 1, 1, 8))
    k = jax.random.normal(k2, (1, 1, 1, 8))

    def score(pq, pk):
        rq = positions.rotary_embedding(q, jnp.array([[pq]]))
        rk = positions.rotary_embedding(k, jnp.array([[pk]]))
        return float(jnp.sum(rq * rk))

    np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-5)
    np.testing.assert_allclose(score(0, 0), float(jnp.sum(q * k)), rtol=1e-6)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3


def test_grouped_query_attention_equals_repeated_kv():
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (2, 5, 6, 4))  # H = 6
    k = jax.random.normal(ks[1], (2, 7, 2, 4))  # G = 2, R = 3
    v = jax.random.normal(ks[2], (2, 7, 2, 4))
    mask = layers.make_attention_mask(jnp.ones((2, 5)), jnp.arange(7)[None].repeat(2, 0) < 6)
    got = layers.dot_product_attention(q, k, v, None, mask)
    k_rep, v_rep = jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2)
    logits = jnp.einsum("blhk,bshk->bhls", q, k_rep)
    logits = jnp.where(mask, logits, -1e10)
    want = jnp.einsum("bhls,bshk->blhk", jax.nn.softmax(logits, -1), v_rep)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_masks():
    causal = layers.make_causal_mask(1, 3)[0, 0]
    np.testing.assert_array_equal(causal, np.tril(np.ones((3, 3), bool)))
    seg = jnp.array([[1, 1, 2]])
    m = layers.make_attention_mask(seg, seg, jnp.equal)[0, 0]
    np.testing.assert_array_equal(m, [[1, 1, 0], [1, 1, 0], [0, 0, 1]])
    assert layers.combine_masks(None, None) is None


def test_attention_and_mlp_parameter_axes():
    x = jnp.ones((1, 3, 8))
    attn = layers.MultiHeadAttention(num_heads=4, num_kv_heads=2, head_dim=2)
    p = attn.init(jax.random.PRNGKey(0), x, x)["params"]
    assert p["query"]["kernel"].names == ("embed", "heads", "kv")
    assert p["key"]["kernel"].names == ("embed", "kv_heads", "kv")
    assert p["out"]["kernel"].names == ("heads", "kv", "embed")
    assert p["key"]["kernel"].value.shape == (8, 2, 2)
    mlp = layers.MlpBlock(intermediate_dim=16, activations=("silu", "linear"))
    p = mlp.init(jax.random.PRNGKey(0), x)["params"]
    assert p["wi_1"]["kernel"].names == ("embed", "mlp") and p["wo"]["kernel"].names == (
        "mlp",
        "embed",
    )
    # Gated SiLU numerics: wo(silu(x wi_0) * (x wi_1)).
    y = mlp.apply({"params": p}, x)
    u = nn.meta.unbox(p)
    h = jax.nn.silu(x @ u["wi_0"]["kernel"]) * (x @ u["wi_1"]["kernel"])
    np.testing.assert_allclose(y, h @ u["wo"]["kernel"], rtol=1e-5)
