"""Ring attention: context parallelism with keys and values passed around the context axis.

The `context_parallel_ring` preset splits the queries' `length` and the keys' `kv_length` over
one mesh axis (the context axis, n devices); `context_parallel.select_attention_strategy` then picks
`ring_context_parallel`, and `ring_attention` runs it (Liu et al. 2023, "Ring Attention with
Blockwise Transformers"): each device keeps its own queries, and its keys and values go once
around the ring, one `ppermute` to the next device per step. At each of the n steps a device
adds the chunk it holds to an online softmax (`chunked_attention`'s math), so no device ever
holds more than two chunks of keys and values, where the all-gather form (`context_parallel`)
holds all of them.

Gradients: a `jax.custom_vjp` with a reverse ring. The forward pass keeps its own chunk's
queries, keys, values, output and softmax statistics only; the backward pass sends the keys and
values around again and, with them, fp32 accumulators of their gradients, which make one more
hop to arrive home. Autodiff through the ring would also be correct (the transpose of a
`ppermute` is the reverse `ppermute`), but it keeps every step's residuals: each device would
end up holding every key and value chunk (the all-gather's memory) and, unless each step is
rematerialised, every step's `[L/n, S/n]` probabilities, S/n times the all-gather's.

Causal load balancing (zigzag, as in Megatron-LM's context parallelism, torchtitan and
ring-flash-attention): under a causal mask, device i's queries see no key of devices after it,
so with contiguous chunks device n-1 works n steps and device 0 one. With the sequence cut into
2n chunks, device i holds chunks i and 2n-1-i: at every step after the first, each device does
half a step's work (all its queries against the first chunk it receives, or its second query
chunk against both), and the fully masked half is skipped. Queries, keys and values arrive in
contiguous chunks (the model's layout) and are reordered inside attention: two `ppermute`s per
tensor in (queries, keys, values, the mask's per-position features, the bias's rows) and two for
the output back. Used for a causal self-attention without a prefix whose chunks halve; other
masks (padding, packed segments) combine with it.

Masks come by their parts (`MaskParts`): the per-position features (validity, segment, prefix)
of the keys travel around the ring with them (one int32 per position), and each step's mask is
computed from the two chunks' positions, so no `[L, S]` mask is built. An additive bias
`[b, H, L, S]` (T5's relative positions) is split by query position like the queries; each step
reads the columns of the chunk it holds.

Refused, in one line naming the alternative: dropout on the attention weights, a whole mask
instead of its parts, and the fused kernels (`cudnn`, `splash`), which the ring's blocks do not
call.

Shape letters: B=batch, L=query length, S=key length, H=heads, G=kv_heads, R=H // G, K=kv,
n=devices on the context axis; a `c` suffix is one device's chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from t5lite import collectives, context_parallel
from t5lite.model.chunked_attention import (
    bias_grad,
    block_grads,
    block_logits,
    online_init,
    online_output,
    online_update,
)
from t5lite.model.masks import MASK_VALUE, MaskParts

Array = jax.Array

IMPLEMENTATIONS = ("xla", "chunked", "auto")
"""`attention_implementation` values the ring takes (its blocks are `chunked`'s math)."""


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """What one ring attention call does (static)."""

    cp: tuple[str, ...]  # the context axes
    n: int  # devices on them
    balanced: bool  # zigzag chunks, fully masked half-steps skipped
    causal: bool
    groups: bool  # the features carry validity / segments (key j seen when groups equal)
    prefix: bool  # the features carry a prefix-LM's prefix bit
    dtype: jnp.dtype


def refusal(implementation: str, dropout: bool, mask: object) -> str | None:
    """Why ring attention cannot take this call, as one line naming the alternative."""
    if dropout:
        return (
            "ring context parallelism cannot apply attention dropout (dropout_rate > 0 in "
            "training); set dropout_rate=0 or use the context_parallel preset"
        )
    if mask is not None and not isinstance(mask, MaskParts):
        return (
            "ring context parallelism needs the attention mask by its parts (MaskParts), got a "
            "whole mask; use the context_parallel preset"
        )
    if implementation not in IMPLEMENTATIONS:
        return (
            f"ring context parallelism computes its blocks itself and cannot run "
            f"attention_implementation={implementation!r}; use one of "
            f"{', '.join(IMPLEMENTATIONS)} or the context_parallel preset"
        )
    return None


def is_balanced(mask: MaskParts | None, length_q: int, length_kv: int, n: int) -> bool:
    """Whether a call is load balanced (zigzag): causal self-attention without a prefix whose
    per-device chunk halves."""
    causal = mask is not None and mask.causal and mask.prefix_q is None
    return causal and length_q == length_kv and length_q % (2 * n) == 0


def _features(mask: MaskParts | None) -> tuple[Array | None, Array | None, bool, bool]:
    """(queries' features [B, L], keys' [B, S], groups?, prefix?): int32 `group * 2 + prefix`
    per position, where a query sees a key of the same group (padding gets -1 / -2, so never)."""
    if mask is None:
        return None, None, False, False
    groups = mask.valid_q is not None or mask.segment_q is not None
    prefix = mask.causal and mask.prefix_q is not None
    if not groups and not prefix:
        return None, None, False, False

    def encode(valid, segment, pfx, pad):
        shape = next(x.shape for x in (valid, segment, pfx) if x is not None)
        group = jnp.zeros(shape, jnp.int32) if segment is None else segment.astype(jnp.int32)
        if valid is not None:
            group = jnp.where(valid, group, pad)
        bit = 0 if not prefix else pfx.astype(jnp.int32)
        return group * 2 + bit

    feat_q = encode(mask.valid_q, mask.segment_q, mask.prefix_q, -1)
    feat_kv = encode(mask.valid_kv, mask.segment_kv, mask.prefix_kv, -2)
    return feat_q, feat_kv, groups, prefix


def ring_attention(
    q_BLHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    bias_bHLS: Array | None,
    mask: MaskParts | None,
    plan: context_parallel.ContextPlan,
    *,
    dtype: jnp.dtype,
) -> Array:
    """Attention with queries, keys and values split by position over `plan.cp`, keys and
    values passed around the ring.

    Args:
      q_BLHK: queries [B, L, H, K]; k_BSGK, v_BSGK: keys and values [B, S, G, K]; all split
        by position over `plan.cp` (dims `plan.dims`).
      bias_bHLS: an additive bias [b, H, L, S] split by query position, or None.
      mask: the mask by its parts, or None (`whole` is not read).
      plan: from `context_parallel.select_attention_strategy` (strategy `ring_context_parallel`).
      dtype: the compute dtype of the probabilities-times-values product and the output.

    Returns:
      [B, L, H, K] split like the queries.
    """
    mesh = jax.sharding.get_abstract_mesh()
    n = math.prod(mesh.shape[a] for a in plan.cp)
    length_q, length_kv = q_BLHK.shape[1], k_BSGK.shape[1]
    feat_q, feat_kv, groups, prefix = _features(mask)
    cfg = RingConfig(
        plan.cp,
        n,
        is_balanced(mask, length_q, length_kv, n),
        mask is not None and mask.causal,
        groups,
        prefix,
        jnp.dtype(dtype),
    )
    q_dims, kv_dims = plan.dims[0], plan.dims[1]
    feat_dims = (q_dims[0], plan.cp)
    args = [q_BLHK, k_BSGK, v_BSGK]
    dims = [q_dims, kv_dims, kv_dims]
    for x, d in ((bias_bHLS, plan.dims[3] if bias_bHLS is not None else None),):
        if x is not None:
            args.append(x)
            dims.append(d)
    if feat_q is not None:
        args += [feat_q, feat_kv]
        feat_b = feat_dims if feat_q.shape[0] > 1 else ((), plan.cp)
        dims += [feat_b, feat_b]
    has_bias, has_feat = bias_bHLS is not None, feat_q is not None

    def body(q, k, v, *rest):
        rest = list(rest)
        bias = rest.pop(0) if has_bias else None
        fq, fkv = (rest[0], rest[1]) if has_feat else (None, None)
        if cfg.balanced:
            q, k, v = (_zigzag(x, 1, cfg) for x in (q, k, v))
            bias = None if bias is None else _zigzag(bias, 2, cfg)
            fq, fkv = (None, None) if fq is None else (_zigzag(fq, 1, cfg), _zigzag(fkv, 1, cfg))
        b, lc, h, kd = q.shape
        g = k.shape[2]
        out = _ring(q.reshape(b, lc, g, h // g, kd), k, v, bias, fq, fkv, cfg)
        out = out.reshape(b, lc, h, kd)
        return _unzigzag(out, 1, cfg) if cfg.balanced else out

    # NOTE: check_vma=False: the ring's per-device branches (which half of a step to skip) and
    # its accumulators start unvarying and become varying; the gradients were checked against
    # data parallelism's in tests/test_ring_attention.py.
    specs = tuple(collectives._spec(d) for d in dims)
    fn = jax.shard_map(
        body, mesh=mesh, in_specs=specs, out_specs=collectives._spec(plan.out_dims), check_vma=False
    )
    return fn(*args)


# --- zigzag: contiguous chunks (2i, 2i+1) on device i <-> chunks (i, 2n-1-i) on device i -------


def _home(j: int, n: int) -> int:
    """The device that holds chunk j of 2n in the zigzag order."""
    return j if j < n else 2 * n - 1 - j


def _permute(x: Array, cfg: RingConfig, pairs: list[tuple[int, int]]) -> Array:
    """`ppermute` over the context axes; none where every device keeps its own (n = 2's first
    halves)."""
    if all(a == b for a, b in pairs):
        return x
    return jax.lax.ppermute(x, cfg.cp, pairs)


def _zigzag(x: Array, axis: int, cfg: RingConfig) -> Array:
    """Device i's contiguous chunks (2i, 2i+1) -> its zigzag chunks (i, 2n-1-i) along `axis`."""
    n = cfg.n
    first, second = jnp.split(x, 2, axis=axis)
    got_first = _permute(first, cfg, [(i, _home(2 * i, n)) for i in range(n)])
    got_second = _permute(second, cfg, [(i, _home(2 * i + 1, n)) for i in range(n)])
    # An even device receives its chunk i among the first halves, an odd one among the second.
    even = jax.lax.axis_index(cfg.cp) % 2 == 0
    lo = jnp.where(even, got_first, got_second)
    hi = jnp.where(even, got_second, got_first)
    return jnp.concatenate([lo, hi], axis=axis)


def _unzigzag(x: Array, axis: int, cfg: RingConfig) -> Array:
    """The inverse of `_zigzag`."""
    n = cfg.n
    lo, hi = jnp.split(x, 2, axis=axis)
    even = jax.lax.axis_index(cfg.cp) % 2 == 0
    to_first = jnp.where(even, lo, hi)  # the chunk that is a first half at home
    to_second = jnp.where(even, hi, lo)
    back_first = [(_home(2 * i, n), i) for i in range(n)]
    back_second = [(_home(2 * i + 1, n), i) for i in range(n)]
    first = _permute(to_first, cfg, back_first)
    second = _permute(to_second, cfg, back_second)
    return jnp.concatenate([first, second], axis=axis)


# --- the ring ---------------------------------------------------------------------------------


def _next(x, cfg: RingConfig, step: int = 1):
    """`x` (a tree) sent to the next device of the ring (the previous one: step=-1)."""
    return jax.lax.ppermute(x, cfg.cp, [(i, (i + step) % cfg.n) for i in range(cfg.n)])


def _chunks(device: Array, size: int, cfg: RingConfig) -> list[tuple[Array, int]]:
    """(first position, length) of each piece of the sequence a device holds."""
    if cfg.balanced:
        half = size // 2
        return [(device * half, half), ((2 * cfg.n - 1 - device) * half, half)]
    return [(device * size, size)]


def _positions(device: Array, size: int, cfg: RingConfig) -> Array:
    return jnp.concatenate([s + jnp.arange(m) for s, m in _chunks(device, size, cfg)])


def _columns(bias: Array | None, device: Array, size: int, cfg: RingConfig) -> Array | None:
    """The bias's columns [b, H, Lc, Sc] of the keys `device` holds."""
    if bias is None:
        return None
    parts = [
        jax.lax.dynamic_slice_in_dim(bias, s, m, axis=3) for s, m in _chunks(device, size, cfg)
    ]
    return jnp.concatenate(parts, axis=3)


def _add_columns(acc: Array, x: Array, device: Array, size: int, cfg: RingConfig, row0: int):
    """`acc[:, :, row0:, columns of device] += x` (the inverse of `_columns`)."""
    offset = 0
    for s, m in _chunks(device, size, cfg):
        piece = jax.lax.slice_in_dim(x, offset, offset + m, axis=3)
        start = (0, 0, row0, s)
        old = jax.lax.dynamic_slice(acc, start, piece.shape)
        acc = jax.lax.dynamic_update_slice(acc, old + piece, start)
        offset += m
    return acc


def _mask(fq, fkv, pos_q, pos_k, cfg: RingConfig) -> Array | None:
    """The mask [B or 1, 1, Lq, Sk] of queries at `pos_q` against keys at `pos_k`."""
    mask = None
    if cfg.groups:
        mask = (fq >> 1)[:, :, None] == (fkv >> 1)[:, None, :]
    if cfg.causal:
        causal = (pos_k[None, :] <= pos_q[:, None])[None]
        if cfg.prefix:
            causal = causal | (((fq & 1)[:, :, None] & (fkv & 1)[:, None, :]) == 1)
        mask = causal if mask is None else mask & causal
    return None if mask is None else mask[:, None]


@dataclasses.dataclass(frozen=True)
class _Block:
    """One step's work: queries from row `row0` against keys [0, cols) of the chunk held."""

    row0: int
    cols: int | None  # None: all the keys held


def _step_blocks(t: int, cfg: RingConfig, lc: int, sc: int):
    """The work of step t: one block, or (zigzag, after step 0) a device-dependent choice
    between (all queries x the first key chunk received) and (the second query chunk x all)."""
    if not cfg.balanced or t == 0:
        return _Block(0, None), None
    return _Block(0, sc // 2), _Block(lc // 2, None)


def _slice_kv(kv, block: _Block):
    if block.cols is None:
        return kv
    return tuple(None if x is None else x[:, : block.cols] for x in kv)


def _fully_masked_rows(carry, v_sum: Array, length_kv: int):
    """The state of each fully masked query row (a padding position) set to the mean of all
    `length_kv` values, as the `xla` path gives it (every logit masked to the same finite
    value): the balanced ring skipped half of its blocks, which held no visible key."""
    m, total, acc = carry
    dead = m <= MASK_VALUE / 2  # no visible key: the maximum is the mask value
    acc = jnp.where(dead[..., None], v_sum[:, :, None, None, :], acc)
    return m, jnp.where(dead, float(length_kv), total), acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring(q, k, v, bias, fq, fkv, cfg):
    return _ring_fwd(q, k, v, bias, fq, fkv, cfg)[0]


def _ring_fwd(q, k, v, bias, fq, fkv, cfg: RingConfig):
    me = jax.lax.axis_index(cfg.cp)
    lc, sc = q.shape[1], k.shape[1]
    pos_q = _positions(me, lc, cfg)
    carry = online_init(q)
    v_sum = jnp.zeros((v.shape[0], v.shape[2], v.shape[3]), jnp.float32)  # [B, G, K]
    kv = (k, v, fkv)
    for t in range(cfg.n):
        src = (me - t) % cfg.n
        pos_k = _positions(src, sc, cfg)
        bias_src = _columns(bias, src, sc, cfg)

        def work(carry, block: _Block, kv=kv, pos_k=pos_k, bias_src=bias_src):
            k_b, v_b, fkv_b = _slice_kv(kv, block)
            r, c = block.row0, block.cols or sc
            b_blk = None if bias_src is None else bias_src[:, :, r:, :c]
            fq_b = None if fq is None else fq[:, r:]
            mask = _mask(fq_b, fkv_b, pos_q[r:], pos_k[:c], cfg)
            s = block_logits(q[:, r:], k_b, b_blk, mask)
            rows = tuple(x[..., r:, :] if x.ndim == 5 else x[..., r:] for x in carry)
            new = online_update(rows, s, v_b, cfg.dtype)
            if r == 0:
                return new
            return tuple(
                jnp.concatenate([x[..., :r, :], y], -2)
                if x.ndim == 5
                else jnp.concatenate([x[..., :r], y], -1)
                for x, y in zip(carry, new)
            )

        if cfg.balanced:
            v_sum = v_sum + jnp.sum(kv[1].astype(jnp.float32), axis=1)
        early, late = _step_blocks(t, cfg, lc, sc)
        if late is None:
            carry = work(carry, early)
        else:  # keys from an earlier device: all queries see their first chunk only
            carry = jax.lax.cond(
                src < me,
                functools.partial(work, block=early),
                functools.partial(work, block=late),
                carry,
            )
        if t < cfg.n - 1:
            kv = _next(kv, cfg)
    if cfg.balanced:
        carry = _fully_masked_rows(carry, v_sum, cfg.n * sc)
    out = online_output(carry, cfg.dtype)
    m, total, _ = carry
    return out, (q, k, v, bias, fq, fkv, out, m, total)


def _ring_bwd(cfg: RingConfig, residuals, d_out):
    q, k, v, bias, fq, fkv, out, m_max, l_sum = residuals
    me = jax.lax.axis_index(cfg.cp)
    lc, sc = q.shape[1], k.shape[1]
    pos_q = _positions(me, lc, cfg)
    d_out = d_out.astype(jnp.float32)
    delta = jnp.einsum("blgrk,blgrk->bgrl", d_out, out.astype(jnp.float32))
    d_out_c = d_out.astype(cfg.dtype)
    # A fully masked row's output is the mean of all S values (see `_fully_masked_rows`): the
    # skipped half-blocks' share of its value gradient, d_out / S to each of their keys.
    dead = jnp.transpose(m_max <= MASK_VALUE / 2, (0, 3, 1, 2))[..., None]  # [B, L, G, R, 1]
    d_dead = jnp.where(dead, d_out, 0.0) / (cfg.n * sc)
    dq = jnp.zeros(q.shape, jnp.float32)
    d_bias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    # NOTE: the backward ring sends keys and values stacked, one permute per hop, and runs the
    # other way (chunk me + t at step t): the forward pass's very sends would be merged with
    # them by XLA (common subexpressions), keeping all n received chunks alive until the
    # backward pass, the all-gather's memory. Their gradients travel stacked too.
    kv = (jnp.stack([k, v]), fkv)
    dkv = jnp.zeros((2, *k.shape), jnp.float32)
    for t in range(cfg.n):
        src = (me + t) % cfg.n
        pos_k = _positions(src, sc, cfg)
        bias_src = _columns(bias, src, sc, cfg)

        def work(acc, block: _Block, kv=kv, pos_k=pos_k, bias_src=bias_src, src=src):
            dq, dkv, d_bias = acc
            k_b, v_b, fkv_b = _slice_kv((kv[0][0], kv[0][1], kv[1]), block)
            r, c = block.row0, block.cols or sc
            b_blk = None if bias_src is None else bias_src[:, :, r:, :c]
            fq_b = None if fq is None else fq[:, r:]
            mask = _mask(fq_b, fkv_b, pos_q[r:], pos_k[:c], cfg)
            q_r = q[:, r:]
            s = block_logits(q_r, k_b, b_blk, mask)
            grads = block_grads(
                q_r,
                k_b,
                v_b,
                s,
                m_max[..., r:],
                l_sum[..., r:],
                delta[..., r:],
                d_out_c[:, r:],
                mask,
                cfg.dtype,
            )
            dq_b, dk_b, dv_b, ds = grads
            dq = dq.at[:, r:].add(dq_b)
            dkv = dkv.at[:, :, :c].add(jnp.stack([dk_b, dv_b]))
            if d_bias is not None:
                d_b = bias_grad(ds, bias.shape[0])
                if c < sc:  # the first chunk held only: pad to both chunks' columns
                    d_b = jnp.concatenate([d_b, jnp.zeros_like(d_b)], axis=3)
                d_bias = _add_columns(d_bias, d_b, src, sc, cfg, r)
            if block.cols is not None:  # skipped: every query x the second key chunk
                share = jnp.sum(d_dead, axis=(1, 3))[:, None]
                dkv = dkv.at[1, :, block.cols :].add(share)
            elif block.row0:  # skipped: the first query chunk x every key
                dkv = dkv.at[1].add(jnp.sum(d_dead[:, : block.row0], axis=(1, 3))[:, None])
            return dq, dkv, d_bias

        early, late = _step_blocks(t, cfg, lc, sc)
        acc = (dq, dkv, d_bias)
        if late is None:
            acc = work(acc, early)
        else:
            acc = jax.lax.cond(
                src < me,
                functools.partial(work, block=early),
                functools.partial(work, block=late),
                acc,
            )
        dq, dkv, d_bias = acc
        # The key/value gradients travel with their chunk; after n hops they are home.
        dkv = _next(dkv, cfg, -1)
        if t < cfg.n - 1:
            kv = _next(kv, cfg, -1)
    d_bias = None if bias is None else d_bias.astype(bias.dtype)
    dk, dv = dkv[0], dkv[1]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_bias, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)
