"""The chunked (flash-style) attention against the `xla` einsum path: numbers and memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.model import layers
from t5lite.model.chunked_attention import block_size, chunked_attention
from t5lite.model.masks import MaskParts

B, L, H, G, K = 2, 256, 4, 2, 16


def _inputs(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, L, H, K)), dtype)
    k = jnp.asarray(rng.standard_normal((B, L, G, K)), dtype)
    v = jnp.asarray(rng.standard_normal((B, L, G, K)), dtype)
    bias = jnp.asarray(rng.standard_normal((1, H, L, L)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((B, L, H, K)), jnp.float32)
    return q, k, v, bias, cotangent


# Row 0 is padded after 200 positions (its padding queries see no key at all: a uniform
# softmax, as in the xla path); row 1 is unpadded. Two packed segments per row, prefixes of 30
# and 10 positions.
_VALID = np.arange(L)[None] < np.array([[200], [256]])
_SEGMENTS = np.where(np.arange(L)[None] < np.array([[100], [50]]), 1, 2) * _VALID
_PREFIX = np.arange(L)[None] < np.array([[30], [10]])


def _parts(name: str) -> MaskParts:
    valid, seg, prefix = (jnp.asarray(x) for x in (_VALID, _SEGMENTS, _PREFIX))
    return {
        "none": MaskParts(),
        "causal": MaskParts(causal=True),
        "padding": MaskParts(valid_q=valid, valid_kv=valid),
        "packed causal": MaskParts(valid, valid, seg, seg, causal=True),
        "prefix-lm packed": MaskParts(valid, valid, seg, seg, prefix, prefix, causal=True),
    }[name]


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("case", ["none", "causal", "padding", "packed causal", "prefix-lm packed"])
def test_equals_xla_forward_and_gradients(case, bias):
    q, k, v, b, cot = _inputs()
    parts = _parts(case)
    b = b if bias else None
    dense = parts.dense(L, L)

    def ref(q, k, v, b):
        return layers.dot_product_attention(q, k, v, b, dense)

    def new(q, k, v, b):
        return chunked_attention(q, k, v, b, parts, block=64)

    argnums = (0, 1, 2, 3) if bias else (0, 1, 2)
    out_ref, out_new = jax.jit(ref)(q, k, v, b), jax.jit(new)(q, k, v, b)
    np.testing.assert_allclose(out_new, out_ref, atol=1e-5, rtol=1e-5)
    grads_ref = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * cot), argnums))(q, k, v, b)
    grads_new = jax.jit(jax.grad(lambda *a: jnp.sum(new(*a) * cot), argnums))(q, k, v, b)
    for name, g_new, g_ref in zip("qkvb", grads_new, grads_ref):
        # fp32 sums in another order: 1e-5 of values of order 10.
        np.testing.assert_allclose(g_new, g_ref, atol=5e-5, rtol=1e-4, err_msg=name)


def test_bf16_compute_equals_xla_to_bf16_rounding():
    q, k, v, _, _ = _inputs(jnp.bfloat16)
    parts = _parts("packed causal")
    ref = layers.dot_product_attention(q, k, v, None, parts.dense(L, L), dtype=jnp.bfloat16)
    new = chunked_attention(q, k, v, None, parts, dtype=jnp.bfloat16, block=64)
    assert new.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(new, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2
    )


def test_block_size_divides_the_key_length():
    assert block_size(2048) == 512
    assert block_size(384) == 384
    assert block_size(600) == 300
    assert block_size(127) == 127  # no divisor from 64 up: one block


def _temp_bytes(fn, length: int) -> int:
    shape = jax.ShapeDtypeStruct((1, length, 8, 64), jnp.float32)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, length)), (0, 1, 2)))
    return grad.lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes


def test_compiled_memory_is_linear_in_length_where_xla_is_quadratic():
    parts = MaskParts(causal=True)

    def xla(q, k, v, length):
        return layers.dot_product_attention(q, k, v, None, parts.dense(length, length))

    def chunked(q, k, v, length):
        return chunked_attention(q, k, v, None, parts)

    xla_ratio = _temp_bytes(xla, 2048) / _temp_bytes(xla, 1024)
    chunked_ratio = _temp_bytes(chunked, 2048) / _temp_bytes(chunked, 1024)
    assert xla_ratio > 3.5, xla_ratio  # [L, L] logits and weights: 4x for 2x the length
    assert chunked_ratio < 2.2, chunked_ratio  # one [L, block] block at a time: 2x
