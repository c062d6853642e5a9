"""Flash-style attention in plain JAX: keys and values in blocks, memory linear in length.

FlashAttention-2's algorithm (Dao 2023) written with `lax.scan` over key/value blocks, so it runs
on every backend (CPU included), where the `xla` implementation materialises the fp32 logits
`[B, G, R, L, S]` and, for the backward pass, keeps them.

- Forward: an online softmax over the blocks. Each step computes one block's logits
  `[B, G, R, L, block]`, rescales the running sum and output by the new running maximum, and
  adds the block's contribution. Only the output and the softmax statistics per query are
  kept for the backward pass (a `jax.custom_vjp`).
- Backward: the same scan again, recomputing each block's probabilities from those statistics:
  `dV_j = Pᵀ dO`, `dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))`, `dQ += dS K_j`, `dK_j = dSᵀ Q`.

Masks are given by their parts (`MaskParts`), so no `[B, 1, L, S]` mask is built either: each
block's mask is computed from per-position features. The numbers are those of the `xla` path:
masked logits get the same finite `-1e10` (a fully masked query row averages every value, as
there), logits, softmax and log-sum-exp are fp32, the probabilities are cast to the compute dtype
before they meet the values. The order of the sums differs, so results agree to rounding, not
bit for bit.

Memory per layer: the scan carries `[B, G, R, L, K]` and per-query statistics, and one block's
logits are live at a time: linear in L for a fixed block. Time is the `xla` path's (the same
FLOPs; fully masked blocks of a causal mask are not skipped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from t5lite.model.masks import MASK_VALUE, MaskParts

Array = jax.Array

DEFAULT_BLOCK = 512
_MIN_BLOCK = 64


def block_size(length_kv: int, block: int = DEFAULT_BLOCK) -> int:
    """The largest divisor of S that is at most `block` (S itself if none reaches 64)."""
    for size in range(min(block, length_kv), _MIN_BLOCK - 1, -1):
        if length_kv % size == 0:
            return size
    return length_kv


def chunked_attention(
    q_BLHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    bias_bHLS: Array | None,
    mask: MaskParts,
    *,
    dtype: jnp.dtype = jnp.float32,
    block: int = DEFAULT_BLOCK,
) -> Array:
    """Grouped-query attention over key/value blocks; the `xla` path's numbers, linear memory.

    Args:
      q_BLHK: queries [B, L, H, K] (no logit scaling applied here, as in the `xla` path).
      k_BSGK, v_BSGK: keys and values [B, S, G, K], G dividing H.
      bias_bHLS: an additive fp32 bias [b, H, L, S] (b = 1 or B), e.g. T5's relative positions,
        or None.
      mask: the mask's parts.
      dtype: the compute dtype of the probabilities-times-values product.
      block: the key/value block size (the largest divisor of S up to it is used).

    Returns:
      [B, L, H, K] in `dtype`.
    """
    b, length, h, kd = q_BLHK.shape
    g = k_BSGK.shape[2]
    if h % g:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {g}")
    size = block_size(k_BSGK.shape[1], block)
    q_BLGRK = q_BLHK.reshape(b, length, g, h // g, kd)
    out = _flash(q_BLGRK, k_BSGK, v_BSGK, bias_bHLS, mask, size, jnp.dtype(dtype))
    return out.reshape(b, length, h, kd)


def _blocks(x: Array, size: int, axis: int) -> Array:
    """Moves blocks of `size` along `axis` to a new leading axis (the scan's)."""
    n = x.shape[axis] // size
    x = x.reshape(*x.shape[:axis], n, size, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x: Array, axis: int) -> Array:
    """Inverse of `_blocks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])


def block_logits(q_BLGRK, k_BsGK, bias_blk, mask_B1Ls):
    """One block's masked fp32 logits [B, G, R, L, s] (bias [b, H, L, s], mask [b, 1, L, s])."""
    g = k_BsGK.shape[2]
    s = jnp.einsum("blgrk,bsgk->bgrls", q_BLGRK, k_BsGK, preferred_element_type=jnp.float32)
    if bias_blk is not None:
        s = s + bias_blk.astype(jnp.float32).reshape(bias_blk.shape[0], g, -1, *bias_blk.shape[2:])
    if mask_B1Ls is not None:
        s = jnp.where(mask_B1Ls[:, :, None], s, MASK_VALUE)
    return s


def online_update(carry, s, v_BsGK, dtype):
    """The running (max, sum, output) [B, G, R, L(, K)] after one more block of logits `s`."""
    m_prev, l_prev, acc = carry
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    scale = jnp.exp(m_prev - m_new)
    l_new = l_prev * scale + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bgrls,bsgk->bgrlk", p.astype(dtype), v_BsGK.astype(dtype))
    return m_new, l_new, acc * scale[..., None] + pv.astype(jnp.float32)


def online_init(q_BLGRK):
    """The online softmax's state before any block: max -inf, sum 0, output 0."""
    b, length, g, r, kd = q_BLGRK.shape
    return (
        jnp.full((b, g, r, length), -jnp.inf, jnp.float32),
        jnp.zeros((b, g, r, length), jnp.float32),
        jnp.zeros((b, g, r, length, kd), jnp.float32),
    )


def online_output(carry, dtype):
    """The attention output [B, L, G, R, K] from the online softmax's final state."""
    _, total, acc = carry
    return jnp.transpose(acc / total[..., None], (0, 3, 1, 2, 4)).astype(dtype)


def block_grads(q, k_blk, v_blk, s, m_max, l_sum, delta, d_out_c, mask_blk, dtype):
    """One block's backward: (dQ [B, L, G, R, K], dK, dV [B, s, G, K], dS [B, G, R, L, s]) in
    fp32, from its logits `s`, the forward's max and sum and `delta` = rowsum(dO ∘ O)."""
    p = jnp.exp(s - m_max[..., None]) / l_sum[..., None]
    dv = jnp.einsum(
        "bgrls,blgrk->bsgk", p.astype(dtype), d_out_c, preferred_element_type=jnp.float32
    )
    dp = jnp.einsum(
        "blgrk,bsgk->bgrls", d_out_c, v_blk.astype(dtype), preferred_element_type=jnp.float32
    )
    ds = p * (dp - delta[..., None])
    if mask_blk is not None:  # masked logits are constants: no gradient reaches q, k or the bias
        ds = jnp.where(mask_blk[:, :, None], ds, 0.0)
    dq = jnp.einsum("bgrls,bsgk->blgrk", ds, k_blk.astype(jnp.float32))
    dk = jnp.einsum("bgrls,blgrk->bsgk", ds, q.astype(jnp.float32))
    return dq, dk, dv, ds


def bias_grad(ds, batch_of_bias: int):
    """dS [B, G, R, L, s] as the bias's gradient [b, H, L, s] (summed over B when b = 1)."""
    d_bias = ds.reshape(ds.shape[0], -1, *ds.shape[3:])
    return jnp.sum(d_bias, axis=0, keepdims=True) if batch_of_bias == 1 else d_bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, bias, mask, size, dtype):
    return _forward(q, k, v, bias, mask, size, dtype)[0]


def _forward(q, k, v, bias, mask, size, dtype):
    ks, vs = _blocks(k, size, 1), _blocks(v, size, 1)
    biases = None if bias is None else _blocks(bias.astype(jnp.float32), size, 3)
    starts = jnp.arange(ks.shape[0]) * size

    def step(carry, xs):
        k_blk, v_blk, start, bias_blk = xs
        s = block_logits(q, k_blk, bias_blk, mask.block(start, size, q.shape[1]))
        return online_update(carry, s, v_blk, dtype), None

    (m, total, acc), _ = jax.lax.scan(step, online_init(q), (ks, vs, starts, biases))
    out = online_output((m, total, acc), dtype)  # [B, L, G, R, K]
    # NOTE: the maximum and the sum are kept apart, not as log-sum-exp `m + log(l)`: next to a
    # fully masked row's maximum (-1e10) the fp32 log-sum-exp loses `log(l)` entirely.
    return out, (q, k, v, bias, mask, out, m, total)


def _flash_fwd(q, k, v, bias, mask, size, dtype):
    return _forward(q, k, v, bias, mask, size, dtype)


def _flash_bwd(size, dtype, residuals, d_out):
    q, k, v, bias, mask, out, m_max, l_sum = residuals
    d_out = d_out.astype(jnp.float32)
    # rowsum(dO ∘ O) per query, [B, G, R, L].
    delta = jnp.einsum("blgrk,blgrk->bgrl", d_out, out.astype(jnp.float32))
    ks, vs = _blocks(k, size, 1), _blocks(v, size, 1)
    biases = None if bias is None else _blocks(bias.astype(jnp.float32), size, 3)
    starts = jnp.arange(ks.shape[0]) * size
    d_out_c = d_out.astype(dtype)

    def step(dq, xs):
        k_blk, v_blk, start, bias_blk = xs
        m = mask.block(start, size, q.shape[1])
        s = block_logits(q, k_blk, bias_blk, m)
        dq_blk, dk, dv, ds = block_grads(q, k_blk, v_blk, s, m_max, l_sum, delta, d_out_c, m, dtype)
        d_bias = None if bias_blk is None else bias_grad(ds, bias_blk.shape[0])
        return dq + dq_blk, (dk, dv, d_bias)

    dq0 = jnp.zeros(q.shape, jnp.float32)
    dq, (dks, dvs, d_biases) = jax.lax.scan(step, dq0, (ks, vs, starts, biases))
    dk, dv = _unblocks(dks, 1), _unblocks(dvs, 1)
    d_bias = None if bias is None else _unblocks(d_biases, 3).astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_bias, None


_flash.defvjp(_flash_fwd, _flash_bwd)
