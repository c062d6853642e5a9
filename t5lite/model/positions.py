"""Position information: T5's relative position buckets and bias, and rotary embeddings (RoPE,
with Llama 3 / linear frequency scaling), with logical axis annotations (Flax linen).

Shape letters as in `layers`: B=batch, L=query length, S=key length, H=heads, K=kv (head
width), N=relpos_buckets.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from t5lite import constraints

Array = jax.Array
DType = Any
Initializer = Callable[..., Array]


def relative_position_bucket(
    relative_position: np.ndarray, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
    """T5 relative-position bucketing (static numpy; matches mesh-tf / HF `T5Attention`).

    Args:
      relative_position: int array, memory_position - query_position.
      bidirectional: whether positive and negative offsets get separate buckets.
      num_buckets: total number of buckets N.
      max_distance: offsets at or beyond this share the last bucket.

    Returns:
      int32 array of bucket ids in [0, N), same shape as `relative_position`.
    """
    ret = np.zeros_like(relative_position, dtype=np.int32)
    n = relative_position.astype(np.int64)
    if bidirectional:
        num_buckets //= 2
        ret += (n > 0).astype(np.int32) * num_buckets
        n = np.abs(n)
    else:
        n = -np.minimum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # NOTE: computed in float32 exactly like the PyTorch reference so bucket edges agree.
    with np.errstate(divide="ignore"):
        scaled = (
            np.log(n.astype(np.float32) / np.float32(max_exact))
            / np.float32(np.log(max_distance / max_exact))
            * np.float32(num_buckets - max_exact)
        ).astype(np.float32)
    large = max_exact + np.where(is_small, 0, scaled).astype(np.int32)
    large = np.minimum(large, num_buckets - 1)
    return ret + np.where(is_small, n, large).astype(np.int32)


class RelativePositionBiases(nn.Module):
    """T5 relative position bias, shared by all layers of a stack.

    Attributes:
      num_buckets: N (32 for T5).
      max_distance: 128 for T5.
      num_heads: H.
      bidirectional: True in the encoder, False (causal) in the decoder.
    """

    num_buckets: int
    max_distance: int
    num_heads: int
    bidirectional: bool
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    embedding_init: Initializer = nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")

    @nn.compact
    def __call__(self, q_len: int, k_len: int, query_positions_BL: Array | None = None) -> Array:
        """Returns the bias [1, H, L, S] (fp32) added to attention logits.

        With `query_positions_BL` (int [B, L], decoding at a per-row cache index) the queries sit
        at those positions instead of 0..L-1 and the bias is [B, H, L, S].
        """
        rel_HN = self.param(
            "rel_embedding",
            nn.with_logical_partitioning(self.embedding_init, ("heads", "relpos_buckets")),
            (self.num_heads, self.num_buckets),
            jnp.dtype(self.param_dtype),
        )
        rel_HN = jnp.asarray(constraints.weight(rel_HN), jnp.float32)
        memory = np.arange(k_len)[None, :]
        if query_positions_BL is not None:
            # Buckets of every offset memory - query in (-S, S) from the same static numpy
            # bucketing, looked up at the traced positions: identical to the full-length bias.
            table = relative_position_bucket(
                np.arange(-(k_len - 1), k_len),
                self.bidirectional,
                self.num_buckets,
                self.max_distance,
            )
            offset_BLS = memory[None] - query_positions_BL[:, :, None] + (k_len - 1)
            buckets_BLS = jnp.asarray(table)[jnp.clip(offset_BLS, 0, 2 * k_len - 2)]
            one_hot_BLSN = jax.nn.one_hot(buckets_BLS, self.num_buckets, dtype=jnp.float32)
            return jnp.einsum("hn,blsn->bhls", rel_HN, one_hot_BLSN)
        context = np.arange(q_len)[:, None]
        buckets_LS = relative_position_bucket(
            memory - context, self.bidirectional, self.num_buckets, self.max_distance
        )
        # Gather as a one-hot contraction: stays sharded over heads and is cheap (N=32). The
        # one-hot is [N, L, S], so the gradient contracts the gradient's trailing (L, S) with the
        # one-hot's: a plain [H, L*S] x [N, L*S]^T matmul, where [L, S, N] made XLA:CPU
        # transpose the [H, L, S] gradient first (3% of the T5.1.1-small train step).
        one_hot_NLS = jax.nn.one_hot(buckets_LS, self.num_buckets, dtype=jnp.float32, axis=0)
        bias_HLS = jax.lax.dot_general(rel_HN, one_hot_NLS, (((1,), (0,)), ((), ())))
        return bias_HLS[None]


class RopeScaling(NamedTuple):
    """RoPE frequency scaling (HF `rope_scaling`); hashable, so a module attribute."""

    kind: str = "none"  # 'none' | 'linear' | 'llama3'
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


NO_ROPE_SCALING = RopeScaling()


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling = NO_ROPE_SCALING
) -> Array:
    """fp32 inverse frequencies [K/2] of RoPE, scaled as HF's `ROPE_INIT_FUNCTIONS` do."""
    # NOTE: computed in fp32 in the same order as transformers, so that logits agree to ~1e-6.
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling.kind == "none":
        return inv_freq
    if scaling.kind == "linear":  # positions / factor, i.e. frequencies / factor
        return inv_freq / scaling.factor
    if scaling.kind != "llama3":
        raise ValueError(f"unknown RoPE scaling {scaling.kind!r} (want 'none', 'linear', 'llama3')")
    # Llama 3.1: long wavelengths (beyond what pre-training saw) are interpolated by `factor`,
    # short ones are kept, and the band in between is blended smoothly.
    old_len = scaling.original_max_position
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rotary_embedding(
    x_BLHK: Array,
    positions_BL: Array,
    theta: float = 10000.0,
    scaling: RopeScaling = NO_ROPE_SCALING,
) -> Array:
    """Applies RoPE in the 'rotate half' layout of HF Llama (pairs (i, i + K/2)).

    Args:
      x_BLHK: queries or keys [B, L, H, K], K even.
      positions_BL: int positions [B, L].
      theta: RoPE base frequency.
      scaling: long-context frequency scaling ('linear', 'llama3'; default none).

    Returns:
      Rotated array, same shape and dtype; the rotation is computed in fp32.
    """
    k = x_BLHK.shape[-1]
    inv_freq = rope_inverse_frequencies(k, theta, scaling)
    freqs_BLk = positions_BL.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.cos(freqs_BLk)[:, :, None, :]
    sin = jnp.sin(freqs_BLk)[:, :, None, :]
    x = x_BLHK.astype(jnp.float32)
    x1, x2 = x[..., : k // 2], x[..., k // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)
