"""TPU splash attention (Pallas) behind t5lite's attention interface.

`jax.experimental.pallas.ops.tpu.splash_attention` is the block-sparse flash attention kernel
MaxText uses by default on TPU: the `[L, S]` logits never reach HBM, and blocks that the mask
removes entirely (above a causal diagonal) are skipped. It takes one example's heads
(`[H, L, K]`); t5lite's attention is batched `[B, L, H, K]` with grouped-query heads, so the
kernel is mapped over the batch, and over the key/value heads with the multi-query kernel (the R
query heads of a group share one key/value head), as MaxText does.

What the kernel can take, and how t5lite's mask parts reach it:
- causal: the kernel's `CausalMask`, whose masked blocks are skipped;
- packed segments and padding: the kernel's segment ids (a position attends to keys of its own
  segment; padding is segment 0). NOTE: a padding query then attends to the padding keys
  instead of to every key (the `xla` path's uniform average); its output is never used (its
  loss weight is 0 and no real query attends to it), so real positions get the same numbers.
- refused, each in one line naming what can: an additive bias (T5's relative positions),
  a prefix-LM's per-row bidirectional prefix, attention dropout, lengths that are not a multiple
  of 128 (the kernel's block granule).

On other backends the kernel runs only in Pallas' interpreter (`interpret=True`: for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from t5lite.model.masks import MaskParts

Array = jax.Array

GRANULE = 128  # the kernel's block sizes and lengths are multiples of this
DEFAULT_BLOCK = 512


def unsupported(bias: bool, length_q: int, length_kv: int, dropout: bool) -> str | None:
    """What of a call splash cannot take (None: it can take it; the prefix-LM's per-row prefix
    is refused by the caller, which knows the mask)."""
    if bias:
        return "an additive attention bias (T5's relative position bias)"
    if dropout:
        return "attention dropout"
    if length_q % GRANULE or length_kv % GRANULE:
        return f"lengths {length_q}/{length_kv} that are not multiples of {GRANULE}"
    return None


def _block(length: int, block: int) -> int:
    size = min(block, length)
    while length % size:
        size -= GRANULE
    return size


def splash_attention(
    q_BLHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    mask: MaskParts,
    *,
    dtype: jnp.dtype = jnp.float32,
    block: int = DEFAULT_BLOCK,
    interpret: bool = False,
) -> Array:
    """Grouped-query attention through the splash kernel; [B, L, H, K] in `dtype`.

    No logit scaling is applied (as in the `xla` path). Call `unsupported` first: this function
    assumes the inputs are within what the kernel takes.
    """
    b, length = q_BLHK.shape[:2]
    segment_q, segment_kv = segments(mask, b, length, k_BSGK.shape[1])
    return splash_kernel(
        q_BLHK,
        k_BSGK,
        v_BSGK,
        segment_q,
        segment_kv,
        causal=mask.causal,
        dtype=dtype,
        block=block,
        interpret=interpret,
    )


def splash_kernel(
    q_BLHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    segment_q_BL: Array | None,
    segment_kv_BS: Array | None,
    *,
    causal: bool,
    dtype: jnp.dtype = jnp.float32,
    block: int = DEFAULT_BLOCK,
    interpret: bool = False,
) -> Array:
    """The kernel on arrays only (segment ids: padding = 0), so that it can run per device."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
    )

    b, length, h, kd = q_BLHK.shape
    s, g = k_BSGK.shape[1], k_BSGK.shape[2]
    r = h // g
    base = mask_lib.CausalMask((length, s)) if causal else mask_lib.FullMask((length, s))
    bq, bkv = _block(length, block), _block(s, block)
    sizes = kernel_lib.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    kernel = kernel_lib.make_splash_mqa_single_device(
        mask_lib.MultiHeadMask([base] * r), block_sizes=sizes, interpret=interpret
    )

    def one_group(q_RLK, k_SK, v_SK, seg):
        return kernel(q_RLK, k_SK, v_SK, seg)

    def one_example(q_GRLK, k_GSK, v_GSK, seg_q, seg_kv):
        seg = None if seg_q is None else kernel_lib.SegmentIds(q=seg_q, kv=seg_kv)
        return jax.vmap(functools.partial(one_group, seg=seg))(q_GRLK, k_GSK, v_GSK)

    dt = jnp.dtype(dtype)
    q_BGRLK = q_BLHK.reshape(b, length, g, r, kd).transpose(0, 2, 3, 1, 4).astype(dt)
    k_BGSK = k_BSGK.transpose(0, 2, 1, 3).astype(dt)
    v_BGSK = v_BSGK.transpose(0, 2, 1, 3).astype(dt)
    out_BGRLK = jax.vmap(one_example)(q_BGRLK, k_BGSK, v_BGSK, segment_q_BL, segment_kv_BS)
    return out_BGRLK.transpose(0, 3, 1, 2, 4).reshape(b, length, h, kd).astype(dt)


def segments(mask: MaskParts, b: int, length: int, s: int):
    """Segment ids [B, L] and [B, S] carrying packing and padding (padding = segment 0)."""
    if mask.segment_q is None and mask.valid_q is None:
        return None, None
    seg_q = np.int32(1) if mask.segment_q is None else mask.segment_q.astype(jnp.int32)
    seg_kv = np.int32(1) if mask.segment_kv is None else mask.segment_kv.astype(jnp.int32)
    if mask.valid_q is not None:
        seg_q = jnp.where(mask.valid_q, seg_q, 0)
        seg_kv = jnp.where(mask.valid_kv, seg_kv, 0)
    return (
        jnp.broadcast_to(seg_q, (b, length)).astype(jnp.int32),
        jnp.broadcast_to(seg_kv, (b, s)).astype(jnp.int32),
    )
