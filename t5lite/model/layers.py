"""Transformer primitives with logical axis annotations (Flax linen).

Every parameter is created with its logical axes (`nn.with_logical_partitioning`) and activations
are constrained with logical names at block boundaries (`t5lite.constraints`, which also types
contractions and lookups on Explicit mesh axes), so the rules table alone decides the layout.
Nothing here names a mesh axis. A dense layer computes its output; how the contraction is
parallelised is the one strategy `t5lite.collectives.select_strategy` picks from the rules and
the mesh. The attention core is `attention.dot_product_attention` (re-exported here).

Shape letters: B=batch, L=query length, S=key length, D=embed, H=heads, G=kv_heads,
R=H // G (query heads per kv head), K=kv (head width), F=mlp, V=vocab, N=relpos_buckets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from t5lite import collectives, constraints, context_parallel
from t5lite.model import ring_attention
from t5lite.model.attention import Mask, dot_product_attention
from t5lite.model.dense import (
    DenseGeneral,
    DenseGroup,
    Initializer,
    Projection,
    default_kernel_init,
)
from t5lite.model.masks import MaskParts
from t5lite.model.positions import NO_ROPE_SCALING, RopeScaling, rotary_embedding

Array = jax.Array
DType = Any


class Embed(nn.Module):
    """Token embedding table [V, D] with logical axes ('vocab', 'embed').

    Attributes:
      num_embeddings: vocabulary size V.
      features: embedding width D.
      one_hot: look up with a one-hot matmul; with the table sharded over `vocab` this is
        Megatron's vocab-parallel embedding (partial sums + one all-reduce, no table gather).
    """

    num_embeddings: int
    features: int
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    one_hot: bool = False
    embedding_init: Initializer = nn.initializers.normal(stddev=1.0)

    def setup(self) -> None:
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(self.embedding_init, ("vocab", "embed")),
            (self.num_embeddings, self.features),
            jnp.dtype(self.param_dtype),
        )

    def __call__(self, tokens_BL: Array) -> Array:
        """Embeds int tokens [B, L] -> [B, L, D] in `dtype`."""
        dtype = jnp.dtype(self.dtype)
        table_VD = jnp.asarray(constraints.weight(self.embedding), dtype)
        if self.one_hot:
            one_hot_BLV = jax.nn.one_hot(tokens_BL, self.num_embeddings, dtype=dtype)
            one_hot_BLV = constraints.constrain(one_hot_BLV, ("batch", "length", "vocab"))
            return constraints.einsum("blv,vd->bld", one_hot_BLV, table_VD)
        return constraints.take(table_VD, tokens_BL)

    def attend(self, query_BLD: Array) -> Array:
        """Tied output projection [B, L, D] -> fp32 logits [B, L, V]."""
        dtype = jnp.dtype(self.dtype)
        table_VD = jnp.asarray(constraints.weight(self.embedding), dtype)
        return constraints.einsum(
            "bld,vd->blv", query_BLD.astype(dtype), table_VD, preferred_element_type=jnp.float32
        )


class RMSNorm(nn.Module):
    """T5 / Llama RMS layer norm: no mean subtraction, no bias; computed in fp32."""

    epsilon: float = 1e-6
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32

    @nn.compact
    def __call__(self, x_BLD: Array) -> Array:
        """Normalizes the last axis; returns `dtype`."""
        x = jnp.asarray(x_BLD, jnp.float32)
        mean2 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        y = x * jax.lax.rsqrt(mean2 + self.epsilon)
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            (x.shape[-1],),
            jnp.dtype(self.param_dtype),
        )
        scale = constraints.weight(scale)
        return (y * jnp.asarray(scale, jnp.float32)).astype(jnp.dtype(self.dtype))


def make_attention_mask(
    query_input: Array, key_input: Array, pairwise_fn: Callable = jnp.multiply
) -> Array:
    """Mask [B, 1, L, S] (bool) from per-position query [B, L] and key [B, S] features."""
    mask = pairwise_fn(query_input[:, :, None], key_input[:, None, :])
    return mask[:, None].astype(jnp.bool_)


def make_causal_mask(batch: int, length: int) -> Array:
    """Lower-triangular mask [B, 1, L, L] (query i sees keys j <= i)."""
    idx = jnp.broadcast_to(jnp.arange(length), (batch, length))
    return make_attention_mask(idx, idx, jnp.greater_equal)


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the masks that are not None (None if all are None)."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    return functools.reduce(jnp.logical_and, masks)


# The collection of keys/values projected once per decode from inputs that do not change
# (cross-attention to the encoder output); not part of the decoding loop's carry.
CROSS_CACHE = "cross_cache"


class MultiHeadAttention(nn.Module):
    """Multi-head / grouped-query attention with optional RoPE.

    Kernels: query [D, H, K] ('embed', 'heads', 'kv'); key/value [D, G, K] ('embed',
    kv_axis, 'kv') where kv_axis is 'heads' for plain MHA (G == H) and 'kv_heads' for GQA;
    out [H, K, D] ('heads', 'kv', 'embed').

    Attributes:
      num_heads: H.
      num_kv_heads: G (divides H).
      head_dim: K.
      scale_logits: multiply logits by 1/sqrt(K) (Llama). When False (T5) the scale is folded into
        the query initializer instead.
      use_rope: rotate q and k by their positions.
      rope_scaling: RoPE frequency scaling for long contexts.
      attention_implementation: the attention core's implementation (`attention.NAMES`);
        decoding through the KV cache always runs `xla`.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    dropout_rate: float = 0.0
    scale_logits: bool = False
    use_rope: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = NO_ROPE_SCALING
    kernel_init: Initializer = default_kernel_init
    attention_implementation: str = "xla"

    @nn.compact
    def __call__(
        self,
        inputs_q_BLD: Array,
        inputs_kv_BSD: Array,
        mask: Mask = None,
        bias_bHLS: Array | None = None,
        positions_q_BL: Array | None = None,
        positions_kv_BS: Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
        fixed_kv: bool = False,
    ) -> Array:
        """Attends queries from `inputs_q` to keys/values from `inputs_kv`; returns [B, L, D].

        With `decode=True` (causal self-attention only) the keys and values go through the KV
        cache of the 'cache' collection (see `_cached_kv`); `mask` and `bias_bHLS` then
        span the cache length S, and a None mask means causal by the cache index.

        `mask` is a boolean [B or 1, 1, L, S] array or the same mask by its parts
        (`MaskParts`, what the network gives): the attention implementation builds from the parts
        what it needs; decoding and context parallelism take the whole mask.

        With `decode=True, fixed_kv=True` (cross-attention to an encoding that does not change
        while decoding) the keys and values are projected once and kept in the 'cross_cache'
        collection (see `_fixed_kv`).
        """
        emb = inputs_q_BLD.shape[-1]
        kv_axis = "heads" if self.num_kv_heads == self.num_heads else "kv_heads"
        q, k, v = self._project(inputs_q_BLD, inputs_kv_BSD, kv_axis)
        if self.use_rope:
            q = rotary_embedding(q, positions_q_BL, self.rope_theta, self.rope_scaling)
            k = rotary_embedding(k, positions_kv_BS, self.rope_theta, self.rope_scaling)
        if self.scale_logits:
            q = q * jnp.asarray(self.head_dim**-0.5, q.dtype)
        axes_BLHK = ("batch", "length", "heads", "kv")
        q = constraints.constrain(q, axes_BLHK)
        mask_B1LS = mask
        if isinstance(mask, MaskParts):
            mask_B1LS = mask.dense(q.shape[1], k.shape[1])
        # Context parallelism attends each device's queries to gathered keys and values; it runs
        # neither the KV cache nor dropout (whose mask would have to be split per device).
        choice = collectives.Choice(collectives.Strategy.PARTITIONER)
        dropout = not deterministic and self.dropout_rate > 0.0
        if not decode:
            choice = context_parallel.select_attention_strategy(q, k, bias_bHLS, mask_B1LS, kv_axis)
            if dropout and choice.strategy is collectives.Strategy.CONTEXT_PARALLEL:
                choice = collectives.Choice(collectives.Strategy.PARTITIONER)
        if choice.strategy is collectives.Strategy.RING_CONTEXT_PARALLEL:
            why = ring_attention.refusal(self.attention_implementation, dropout, mask)
            if why is not None:
                raise ValueError(why)
            parts = None if mask is None or mask.empty else mask
            out_BLHK = ring_attention.ring_attention(
                q, k, v, bias_bHLS, parts, choice.plan, dtype=jnp.dtype(self.dtype)
            )
        elif choice.strategy is collectives.Strategy.CONTEXT_PARALLEL:
            attend = functools.partial(
                dot_product_attention,
                implementation=self.attention_implementation,
                dtype=jnp.dtype(self.dtype),
            )
            out_BLHK = context_parallel.context_parallel_attention(
                attend, q, k, v, bias_bHLS, mask_B1LS, choice.plan
            )
        else:
            out_BLHK = self._attend(
                q,
                k,
                v,
                bias_bHLS,
                mask_B1LS if decode else mask,
                kv_axis,
                deterministic,
                decode,
                fixed_kv,
            )
        out_BLHK = constraints.constrain(out_BLHK, axes_BLHK)
        return DenseGeneral(
            emb,
            ("heads", "kv", "embed"),
            axis=(-2, -1),
            input_axes=axes_BLHK,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="out",
        )(out_BLHK)

    def _project(self, x_q_BLD: Array, x_kv_BSD: Array, kv_axis: str) -> tuple[Array, Array, Array]:
        """q [B, L, H, K], k and v [B, S, G, K]; in self-attention one group of three kernels
        reads the input (gathered once under sequence parallelism)."""
        if self.scale_logits:
            query_init = self.kernel_init
        else:
            # NOTE: T5 does not rescale attention logits by 1/sqrt(K); the factor is folded into
            # the query initializer, so trained T5 weights already include it.
            def query_init(key, shape, dtype):
                kernel = self.kernel_init(key, shape, dtype)
                return (kernel / np.sqrt(self.head_dim)).astype(dtype)

        kv_shape, kv_axes = (self.num_kv_heads, self.head_dim), ("embed", kv_axis, "kv")
        query = Projection(
            "query", (self.num_heads, self.head_dim), ("embed", "heads", "kv"), query_init
        )
        key = Projection("key", kv_shape, kv_axes, self.kernel_init)
        value = Projection("value", kv_shape, kv_axes, self.kernel_init)
        group = functools.partial(
            DenseGroup,
            input_axes=("batch", "length", "embed"),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )
        if x_kv_BSD is x_q_BLD:  # self-attention
            q, k, v = group((query, key, value))(x_q_BLD)
            return q, k, v
        (q,) = group((query,))(x_q_BLD)
        k, v = group((key, value))(x_kv_BSD)
        return q, k, v

    def _attend(self, q, k, v, bias_bHLS, mask_B1LS, kv_axis, deterministic, decode, fixed_kv):
        """Attention with whole keys and values on each device (and the KV cache); the mask is
        whole when decoding, else as the caller gave it."""
        # Key/value positions have a name of their own: context parallelism shards the queries'
        # `length` and keeps every key and value position on each device (all-gathered).
        k = constraints.constrain(k, ("batch", "kv_length", kv_axis, "kv"))
        v = constraints.constrain(v, ("batch", "kv_length", kv_axis, "kv"))
        if decode and fixed_kv:
            # Projected once per decode: the k/v computed above are then dead code (XLA drops
            # them), so a step costs no [B, S, D] x [D, H, K] projections.
            k, v = self._fixed_kv(k, v)
            if k.shape[0] != q.shape[0]:
                return self._shared_kv_attention(q, k, v, bias_bHLS, mask_B1LS)
        elif decode:
            k, v, mask_B1LS = self._cached_kv(k, v, mask_B1LS, kv_axis)

        dropout_rng = None
        if not deterministic and self.dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        return dot_product_attention(
            q,
            k,
            v,
            bias_bHLS,
            mask_B1LS,
            implementation="xla" if decode else self.attention_implementation,
            dropout_rate=self.dropout_rate,
            dropout_rng=dropout_rng,
            deterministic=deterministic,
            dtype=jnp.dtype(self.dtype),
        )

    def _shared_kv_attention(self, q_BLHK, k_bSGK, v_bSGK, bias_bHLS, mask_B1LS):
        """Attention of B = b * n query rows to b fixed key/value rows (n decodes per example).

        NOTE: the n samples / beams of an example attend to one copy of its encoding, as n
        more query positions: repeating the cross-attention cache per decode read n copies of
        the same keys/values at every step. Same numbers, 1/n of the memory traffic.
        """
        bn, length, h, kd = q_BLHK.shape
        b = k_bSGK.shape[0]
        n = bn // b

        def group(x: Array | None) -> Array | None:  # [b * n, c, L, S] -> [b, c, n * L, S]
            if x is None or x.shape[0] == 1:
                return x
            x = x.reshape(b, n, *x.shape[1:]).swapaxes(1, 2)
            return x.reshape(b, x.shape[1], n * length, x.shape[-1])

        out = dot_product_attention(
            q_BLHK.reshape(b, n * length, h, kd),
            k_bSGK,
            v_bSGK,
            group(bias_bHLS),
            group(mask_B1LS),
            implementation="xla",
            dtype=jnp.dtype(self.dtype),
        )
        return out.reshape(bn, length, h, kd)

    def _fixed_kv(self, k_BSGK: Array, v_BSGK: Array) -> tuple[Array, Array]:
        """Keys/values of fixed inputs from the 'cross_cache' collection.

        A call where the collection is mutable stores this call's keys/values there; later
        calls (the collection passed in, immutable) read them back. Without the collection
        they are used as computed, as without `decode`.

        NOTE: they are stored in the layouts the attention matmuls read, keys [B, G, S, K]
        and values [B, G, K, S] (heads as a batch dimension, the contraction last): XLA does
        not hoist loop-invariant transposes out of the decoding loop, so keys/values stored
        as computed ([B, S, G, K]) were transposed again at every step. The transposes back
        below cancel those the attention asks for; the numbers are the same.
        """
        if self.has_variable(CROSS_CACHE, "cached_key"):
            k_BGSK = self.get_variable(CROSS_CACHE, "cached_key")
            v_BGKS = self.get_variable(CROSS_CACHE, "cached_value")
            return k_BGSK.transpose(0, 2, 1, 3), v_BGKS.transpose(0, 3, 1, 2)
        if self.is_mutable_collection(CROSS_CACHE):
            self.put_variable(CROSS_CACHE, "cached_key", k_BSGK.transpose(0, 2, 1, 3))
            self.put_variable(CROSS_CACHE, "cached_value", v_BSGK.transpose(0, 2, 3, 1))
        return k_BSGK, v_BSGK

    def _cached_kv(
        self, k_BLGK: Array, v_BLGK: Array, mask_B1LS: Array | None, kv_axis: str
    ) -> tuple[Array, Array, Array | None]:
        """Writes this call's keys/values into the KV cache; returns (keys, values, mask).

        The 'cache' collection holds `cached_key` [B, G, S, K], `cached_value` [B, G, K, S]
        and `cache_index` [B] (the next position to write, per row), all with logical axes,
        so the cache is sharded like the activations (batch over data, heads over model). The
        first call (the cache does not exist yet) creates it with S = this call's length and
        attends over the inputs as usual. Afterwards a call with one token writes it at each
        row's index and attends over the whole cache (causal by index unless a mask is given);
        a call with L > 1 tokens is a prefill from position 0 (the cache must be fresh).

        NOTE: keys and values are kept in the layouts the attention matmuls read (heads as a
        batch dimension, the contraction last), so a decode step reads the cache as it is;
        kept as computed ([B, S, G, K]), every step transposed each layer's whole cache.
        Keys/values are returned as [B, S, G, K]: those transposes cancel the ones the
        attention asks for, and the numbers are the same.
        """
        k_axes = ("batch", kv_axis, "length", "kv")
        v_axes = ("batch", kv_axis, "kv", "length")
        b, length, g, kd = k_BLGK.shape
        initialized = self.has_variable("cache", "cached_key")
        cached_k = self.variable(
            "cache",
            "cached_key",
            nn.with_logical_partitioning(jnp.zeros, k_axes),
            (b, g, length, kd),
            k_BLGK.dtype,
        )
        cached_v = self.variable(
            "cache",
            "cached_value",
            nn.with_logical_partitioning(jnp.zeros, v_axes),
            (b, g, kd, length),
            v_BLGK.dtype,
        )
        cache_index = self.variable(
            "cache",
            "cache_index",
            nn.with_logical_partitioning(jnp.zeros, ("batch",)),
            (b,),
            jnp.int32,
        )
        if not initialized:
            return k_BLGK, v_BLGK, mask_B1LS
        s = cached_k.value.shape[2]
        index_B = cache_index.value
        positions_BL = index_B[:, None] + jnp.arange(length)[None]
        k_BGLK = k_BLGK.transpose(0, 2, 1, 3).astype(cached_k.value.dtype)
        v_BGKL = v_BLGK.transpose(0, 2, 3, 1).astype(cached_v.value.dtype)
        if length == 1:
            # A per-row scatter of one position, in place in the decoding loop's carry: a
            # select over the whole cache (or a one-hot matmul) would rewrite all S positions
            # at every step. An index past the end (a finished row) writes nothing.
            def write_k(cache_GSK: Array, x_GK: Array, i: Array) -> Array:
                return cache_GSK.at[:, i].set(x_GK, mode="drop")

            def write_v(cache_GKS: Array, x_GK: Array, i: Array) -> Array:
                return cache_GKS.at[:, :, i].set(x_GK, mode="drop")

            new_k = jax.vmap(write_k)(cached_k.value, k_BGLK[:, :, 0], index_B)
            new_v = jax.vmap(write_v)(cached_v.value, v_BGKL[..., 0], index_B)
        else:
            zero = jnp.zeros((), jnp.int32)
            new_k = jax.lax.dynamic_update_slice(cached_k.value, k_BGLK, (zero,) * 4)
            new_v = jax.lax.dynamic_update_slice(cached_v.value, v_BGKL, (zero,) * 4)
        cached_k.value = constraints.constrain(new_k, k_axes)
        cached_v.value = constraints.constrain(new_v, v_axes)
        cache_index.value = constraints.constrain(index_B + length, ("batch",))
        if mask_B1LS is None:
            mask_B1LS = (jnp.arange(s)[None, None] <= positions_BL[:, :, None])[:, None]
        return cached_k.value.transpose(0, 2, 1, 3), cached_v.value.transpose(0, 3, 1, 2), mask_B1LS


_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    # NOTE: approximate=True is the tanh form, HF's "gelu_new" used by T5.1.1 gated-gelu.
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "linear": lambda x: x,
}


class MlpBlock(nn.Module):
    """(Gated) feed-forward block: wi_i [D, F] per activation, product, then wo [F, D].

    With one activation the input kernel is named `wi` (T5.1.0); with several, `wi_0`, `wi_1`, …
    (T5.1.1 gated GELU: ('gelu', 'linear'); Llama SwiGLU: ('silu', 'linear')).
    """

    intermediate_dim: int
    activations: Sequence[str] = ("gelu", "linear")
    dropout_rate: float = 0.0
    dtype: DType = jnp.float32
    param_dtype: DType = jnp.float32
    kernel_init: Initializer = default_kernel_init

    @nn.compact
    def __call__(self, x_BLD: Array, deterministic: bool = True) -> Array:
        """[B, L, D] -> [B, L, D]."""
        for act in self.activations:
            if act not in _ACTIVATIONS:
                raise ValueError(f"unknown activation {act!r}; known: {sorted(_ACTIVATIONS)}")
        names = (
            ["wi"]
            if len(self.activations) == 1
            else [f"wi_{i}" for i in range(len(self.activations))]
        )
        wi = [
            Projection(n, self.intermediate_dim, ("embed", "mlp"), self.kernel_init) for n in names
        ]
        # Every wi reads the input: gathered once under sequence parallelism.
        ys = DenseGroup(
            tuple(wi),
            input_axes=("batch", "length", "embed"),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
        )(x_BLD)
        h_BLF = functools.reduce(
            jnp.multiply, [_ACTIVATIONS[a](y) for a, y in zip(self.activations, ys)]
        )
        h_BLF = nn.Dropout(rate=self.dropout_rate, broadcast_dims=(-2,))(
            h_BLF, deterministic=deterministic
        )
        axes_BLF = ("batch", "length", "mlp")
        h_BLF = constraints.constrain(h_BLF, axes_BLF)
        return DenseGeneral(
            x_BLD.shape[-1],
            ("mlp", "embed"),
            input_axes=axes_BLF,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            name="wo",
        )(h_BLF)
