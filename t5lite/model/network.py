"""Transformer architectures: T5.1.1 encoder-decoder and a decoder-only LM (Flax linen).

Both networks take t5x/seqio feature names, return fp32 logits [B, L, V] and carry logical axes on
every parameter (see layers.py). Layers can be scanned over a stacked 'layers' axis and
rematerialized; `scan_params` / `unscan_params` convert between the two parameter layouts.

Parameter tree (unscanned; scanned replaces `layers_{i}` by one `layers` with a leading axis):
  token_embedder/embedding                               [V, D]
  encoder/relpos_bias/rel_embedding                      [H, N]      (T5 only)
  encoder/layers_{i}/{pre_attention_layer_norm, attention, pre_mlp_layer_norm, mlp}
  encoder/encoder_norm/scale
  decoder/relpos_bias/rel_embedding                      [H, N]      (relative positions only)
  decoder/layers_{i}/{pre_self_attention_layer_norm, self_attention,
                      [pre_cross_attention_layer_norm, encoder_decoder_attention,]
                      pre_mlp_layer_norm, mlp}
  decoder/decoder_norm/scale
  decoder/logits_dense/kernel                            [D, V]      (untied only)
A mixture-of-experts layer's `mlp` is a `moe.MoeBlock` (router/kernel, wi_* [E, D, F], wo).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from t5lite import collectives, constraints
from t5lite.model import layers, moe, pipeline, positions
from t5lite.model.attention import Mask

# The configs are importable from here too: gin names them `network.T5Config` etc.
from t5lite.model.config import AnyConfig, DecoderOnlyConfig, T5Config, is_moe_layer
from t5lite.model.layer_trees import scan_params as scan_params
from t5lite.model.layer_trees import unscan_params as unscan_params
from t5lite.model.masks import MaskParts

Array = jax.Array


def _dropout(cfg: AnyConfig, x: Array, deterministic: bool) -> Array:
    return nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)


def _norm(cfg: AnyConfig, name: str) -> layers.RMSNorm:
    return layers.RMSNorm(
        epsilon=cfg.layer_norm_epsilon,
        dtype=cfg.policy.compute,
        param_dtype=cfg.policy.master,
        name=name,
    )


def _attention(cfg: AnyConfig, name: str) -> layers.MultiHeadAttention:
    return layers.MultiHeadAttention(
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=cfg.policy.compute,
        param_dtype=cfg.policy.master,
        dropout_rate=cfg.dropout_rate,
        scale_logits=cfg.scale_attn_logits,
        use_rope=cfg.use_rope,
        rope_theta=cfg.rope_theta,
        rope_scaling=_rope_scaling(cfg),
        attention_implementation=cfg.attention_implementation,
        name=name,
    )


def _rope_scaling(cfg: AnyConfig) -> positions.RopeScaling:
    if not cfg.use_rope:
        return layers.NO_ROPE_SCALING
    return positions.RopeScaling(
        cfg.rope_scaling,
        cfg.rope_scaling_factor,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_max_position,
    )


def _constrain(x_BLD: Array) -> Array:
    return constraints.constrain(x_BLD, ("batch", "length", "embed"))


def _mlp(cfg: AnyConfig, sparse: bool, y_BLD: Array, mask: Mask, det: bool) -> Array:
    """The layer's feed-forward block; an MoE block gets the real tokens of `mask` (its
    losses and loads leave padding out)."""
    block = moe.mlp_block(cfg, sparse)
    if not sparse:
        return block(y_BLD, deterministic=det)
    valid_BL = mask.valid_q if isinstance(mask, MaskParts) else None
    return block(y_BLD, deterministic=det, valid_BL=valid_BL)


class EncoderLayer(nn.Module):
    """Pre-norm self-attention + MLP block; returns (x, None) so it can be scanned."""

    config: AnyConfig
    deterministic: bool = True
    sparse: bool = False
    """A mixture-of-experts MLP (model/moe.py) instead of the dense one."""

    @nn.compact
    def __call__(self, x_BLD: Array, mask: Mask, bias_1HLS: Array | None):
        cfg, det = self.config, self.deterministic
        x_BLD = _constrain(x_BLD)
        y = _norm(cfg, "pre_attention_layer_norm")(x_BLD)
        y = _attention(cfg, "attention")(y, y, mask, bias_1HLS, deterministic=det)
        x_BLD = _constrain(x_BLD + _dropout(cfg, y, det))
        y = _norm(cfg, "pre_mlp_layer_norm")(x_BLD)
        y = _mlp(cfg, self.sparse, y, mask, det)
        return _constrain(x_BLD + _dropout(cfg, y, det)), None


class DecoderLayer(nn.Module):
    """Pre-norm causal self-attention [+ cross-attention] + MLP; returns (x, None)."""

    config: AnyConfig
    cross_attention: bool = True
    deterministic: bool = True
    decode: bool = False
    """Self-attention through the KV cache (autoregressive decoding, see layers.py)."""
    sparse: bool = False
    """A mixture-of-experts MLP (model/moe.py) instead of the dense one."""

    @nn.compact
    def __call__(
        self,
        x_BLD: Array,
        encoded_BSD: Array | None,
        self_mask: Mask,
        cross_mask: Mask,
        bias_1HLL: Array | None,
        positions_BL: Array | None,
    ):
        cfg, det = self.config, self.deterministic
        x_BLD = _constrain(x_BLD)
        y = _norm(cfg, "pre_self_attention_layer_norm")(x_BLD)
        y = _attention(cfg, "self_attention")(
            y,
            y,
            self_mask,
            bias_1HLL,
            positions_BL,
            positions_BL,
            deterministic=det,
            decode=self.decode,
        )
        x_BLD = _constrain(x_BLD + _dropout(cfg, y, det))
        if self.cross_attention:
            y = _norm(cfg, "pre_cross_attention_layer_norm")(x_BLD)
            # NOTE: T5 cross-attention has no position bias and no RoPE.
            y = layers.MultiHeadAttention(
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                dtype=cfg.policy.compute,
                param_dtype=cfg.policy.master,
                dropout_rate=cfg.dropout_rate,
                scale_logits=cfg.scale_attn_logits,
                attention_implementation=cfg.attention_implementation,
                name="encoder_decoder_attention",
            )(y, encoded_BSD, cross_mask, deterministic=det, decode=self.decode, fixed_kv=True)
            x_BLD = _constrain(x_BLD + _dropout(cfg, y, det))
        y = _norm(cfg, "pre_mlp_layer_norm")(x_BLD)
        y = _mlp(cfg, self.sparse, y, self_mask, det)
        return _constrain(x_BLD + _dropout(cfg, y, det)), None


_REMAT_POLICIES = {
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "full": None,  # save nothing: recompute the whole layer in the backward pass
}


def _layer_stack(
    parent: nn.Module,
    layer_cls: type[nn.Module],
    num_layers: int,
    x_BLD: Array,
    *args: Any,
    **layer_kwargs: Any,
) -> Array:
    """Applies `num_layers` layers, scanned over a 'layers' axis and/or rematerialized, or as
    pipeline stages when the rules split `layers` over a mesh axis (model/pipeline.py)."""
    cfg = layer_kwargs["config"]
    choice = pipeline.select_stack(cfg, parent.name, num_layers)
    if choice.strategy == collectives.Strategy.PIPELINE and not (
        parent.is_initializing() or layer_kwargs.get("decode")
    ):
        policy = _REMAT_POLICIES.get(cfg.remat_policy)
        return pipeline.apply_stack(
            parent, layer_cls, choice.plan, x_BLD, args, layer_kwargs, policy
        )
    if cfg.remat_policy != "none":
        layer_cls = nn.remat(
            layer_cls,
            policy=_REMAT_POLICIES[cfg.remat_policy],
            prevent_cse=not cfg.scan_layers,
        )
    if cfg.scan_layers:
        scanned = nn.scan(
            layer_cls,
            # NOTE: the KV cache is stacked on axis 1 so that every cache array keeps the batch
            # first ([B, layers, ...]); decoding code can then expand / reorder it uniformly.
            variable_axes={"params": 0, "cache": 1, layers.CROSS_CACHE: 1, "intermediates": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast,) * len(args),
            length=num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        # Scanned layers are identical: all sparse or all dense (config: moe_every=1).
        sparse = is_moe_layer(cfg, 0)
        x_BLD, _ = scanned(name="layers", sparse=sparse, **layer_kwargs)(x_BLD, *args)
        return x_BLD
    for i in range(num_layers):
        sparse = is_moe_layer(cfg, i)
        x_BLD, _ = layer_cls(name=f"layers_{i}", sparse=sparse, **layer_kwargs)(x_BLD, *args)
    return x_BLD


def _relpos_bias(
    cfg: AnyConfig,
    bidirectional: bool,
    q_len: int,
    k_len: int,
    query_positions_BL: Array | None = None,
) -> Array:
    return positions.RelativePositionBiases(
        num_buckets=cfg.relpos_num_buckets,
        max_distance=cfg.relpos_max_distance,
        num_heads=cfg.num_heads,
        bidirectional=bidirectional,
        param_dtype=cfg.policy.master,
        name="relpos_bias",
    )(q_len, k_len, query_positions_BL)


def _embedder(cfg: AnyConfig, init_std: float) -> layers.Embed:
    return layers.Embed(
        num_embeddings=cfg.vocab_size,
        features=cfg.emb_dim,
        dtype=cfg.policy.compute,
        param_dtype=cfg.policy.master,
        one_hot=cfg.one_hot_embedding,
        embedding_init=nn.initializers.normal(stddev=init_std),
        name="token_embedder",
    )


class Encoder(nn.Module):
    """T5 encoder stack: embed, bidirectional relative bias, layers, final norm."""

    config: T5Config
    shared_embedding: nn.Module

    @nn.compact
    def __call__(self, tokens_BL: Array, mask: Mask, deterministic: bool) -> Array:
        cfg = self.config
        x_BLD = self.shared_embedding(tokens_BL).astype(cfg.policy.compute)
        x_BLD = _constrain(_dropout(cfg, x_BLD, deterministic))
        length = tokens_BL.shape[1]
        bias_1HLL = _relpos_bias(cfg, True, length, length)
        x_BLD = _layer_stack(
            self,
            EncoderLayer,
            cfg.num_encoder_layers,
            x_BLD,
            mask,
            bias_1HLL,
            config=cfg,
            deterministic=deterministic,
        )
        x_BLD = _norm(cfg, "encoder_norm")(x_BLD)
        return _constrain(_dropout(cfg, x_BLD, deterministic))


class Decoder(nn.Module):
    """Decoder stack (T5 decoder with cross-attention, or decoder-only LM) with output logits."""

    config: AnyConfig
    shared_embedding: nn.Module
    num_layers: int
    cross_attention: bool

    @nn.compact
    def __call__(
        self,
        tokens_BL: Array,
        encoded_BSD: Array | None,
        self_mask: Mask,
        cross_mask: Mask,
        positions_BL: Array | None,
        deterministic: bool,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> Array:
        cfg = self.config
        length = tokens_BL.shape[1]
        decode_positions_BL = None
        if decode:
            # The decoder's own cache index [B]: where this call's tokens sit (RoPE, relpos).
            if max_decode_length is None:
                raise ValueError("decode=True needs max_decode_length (the KV cache length)")
            initialized = self.has_variable("cache", "cache_index")
            index = self.variable(
                "cache",
                "cache_index",
                nn.with_logical_partitioning(jnp.zeros, ("batch",)),
                tokens_BL.shape[:1],
                jnp.int32,
            )
            if initialized:
                decode_positions_BL = index.value[:, None] + jnp.arange(length)[None]
                index.value = index.value + length
            elif length != max_decode_length:
                raise ValueError(
                    f"the KV cache is created by a call with max_decode_length={max_decode_length}"
                    f" tokens, got {length}"
                )
        x_BLD = self.shared_embedding(tokens_BL).astype(cfg.policy.compute)
        if not self.is_initializing():
            # Zero unless a 'perturbations' collection is passed: lets tests take gradients with
            # respect to the embedded inputs (causality).
            x_BLD = self.perturb("embedded_inputs", x_BLD)
        x_BLD = _constrain(_dropout(cfg, x_BLD, deterministic))
        if decode_positions_BL is not None and length == 1:
            # One step: this row's query position against the whole cache (length S).
            bias_1HLL = (
                None
                if cfg.use_rope
                else _relpos_bias(cfg, False, 1, max_decode_length, decode_positions_BL)
            )
            positions_BL = decode_positions_BL
        else:  # teacher forcing, cache creation, or a prefill (from position 0)
            k_len = length if decode_positions_BL is None else max_decode_length
            bias_1HLL = None if cfg.use_rope else _relpos_bias(cfg, False, length, k_len)
        if cfg.use_rope and positions_BL is None:
            positions_BL = jnp.broadcast_to(jnp.arange(length), tokens_BL.shape)
        x_BLD = _layer_stack(
            self,
            DecoderLayer,
            self.num_layers,
            x_BLD,
            encoded_BSD,
            self_mask,
            cross_mask,
            bias_1HLL,
            positions_BL if cfg.use_rope else None,
            config=cfg,
            cross_attention=self.cross_attention,
            deterministic=deterministic,
            decode=decode,
        )
        x_BLD = _norm(cfg, "decoder_norm")(x_BLD)
        x_BLD = _dropout(cfg, x_BLD, deterministic)
        return _output_logits(cfg, self.shared_embedding, x_BLD)


def _output_logits(cfg: AnyConfig, shared_embedding: nn.Module, x_BLD: Array) -> Array:
    """Logits [B, L, V] in the policy's output dtype: tied to the embedding (a compute-dtype
    matmul with an fp32 result), or a `logits_dense` projection computed in the wider of the
    compute and output dtypes: fp32 logits are computed in fp32 as t5x does; bf16 logits in
    bf16 with fp32 accumulation as MaxText does by default (an fp32 product rounded to bf16
    differs only in accumulation order, and on a GPU the fp32 path runs as TF32 matmuls at
    half the bf16 rate)."""
    if cfg.logits_via_embedding:
        logits_BLV = shared_embedding.attend(x_BLD)
        if cfg.scale_tied_logits:
            logits_BLV = logits_BLV / np.sqrt(cfg.emb_dim)
    else:
        kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
        # Vocab-parallel logits: under sequence parallelism the input is gathered by position
        # here and its gradient reduce-scattered, like a block's.
        logits_BLV = layers.DenseGeneral(
            cfg.vocab_size,
            ("embed", "vocab"),
            input_axes=("batch", "length", "embed"),
            dtype=jnp.promote_types(cfg.policy.compute, cfg.policy.output),
            param_dtype=cfg.policy.master,
            kernel_init=kernel_init,
            name="logits_dense",
        )(x_BLD)
    logits_BLV = logits_BLV.astype(cfg.policy.output)
    return constraints.constrain(logits_BLV, ("batch", "length", "vocab"))


def _padding_or_segments(tokens_BL: Array | None, segment_ids_BL: Array | None) -> Array | None:
    """Per-position 'real token' ids: segment ids when packed, else tokens > 0."""
    if segment_ids_BL is not None:
        return segment_ids_BL
    if tokens_BL is not None:
        return (tokens_BL > 0).astype(jnp.int32)
    return None


def _self_mask(
    length: int,
    valid_BL: Array | None,
    segment_ids_BL: Array | None,
    causal: bool,
    prefix_BL: Array | None = None,
) -> MaskParts:
    """Self-attention's mask by its parts (padding, packed segments, causality, a prefix-LM's
    prefix attending bidirectionally within itself) and whole, for every layer."""
    valid = None if valid_BL is None else valid_BL > 0
    prefix = None if prefix_BL is None else prefix_BL != 0
    parts = MaskParts(valid, valid, segment_ids_BL, segment_ids_BL, prefix, prefix, causal=causal)
    return parts.with_whole(length, length)


class EncoderDecoder(nn.Module):
    """T5.1.1 (or T5.1.0) encoder-decoder Transformer.

    Feature names follow t5x/seqio: packed examples carry `*_segment_ids` (1, 2, … per example, 0
    for padding) and `*_positions`; padding is token id 0.
    """

    config: T5Config

    def setup(self) -> None:
        cfg = self.config
        self.token_embedder = _embedder(cfg, init_std=1.0)
        self.encoder = Encoder(cfg, shared_embedding=self.token_embedder)
        self.decoder = Decoder(
            cfg,
            shared_embedding=self.token_embedder,
            num_layers=cfg.num_decoder_layers,
            cross_attention=True,
        )

    def encode(
        self,
        encoder_input_tokens: Array,
        encoder_segment_ids: Array | None = None,
        encoder_positions: Array | None = None,
        enable_dropout: bool = True,
    ) -> Array:
        """Encodes int tokens [B, S] -> [B, S, D] (activation dtype).

        `encoder_positions` is accepted for feature-name compatibility; T5's relative bias only
        needs offsets, which are the same within a contiguous packed segment.
        """
        del encoder_positions
        valid = _padding_or_segments(encoder_input_tokens, None)
        length = encoder_input_tokens.shape[1]
        mask = _self_mask(length, valid, encoder_segment_ids, causal=False)
        return self.encoder(encoder_input_tokens, mask, deterministic=not enable_dropout)

    def decode(
        self,
        encoded: Array,
        encoder_input_tokens: Array,
        decoder_input_tokens: Array,
        decoder_target_tokens: Array | None = None,
        encoder_segment_ids: Array | None = None,
        decoder_segment_ids: Array | None = None,
        decoder_positions: Array | None = None,
        enable_dropout: bool = True,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> Array:
        """Decodes with teacher forcing (or one cached step): returns fp32 logits [B, L, V].

        Args:
          encoded: encoder output [B, S, D].
          encoder_input_tokens: [B, S], for the cross-attention padding mask.
          decoder_input_tokens: [B, L], targets shifted right (0 = BOS per example).
          decoder_target_tokens: [B, L], for the padding mask (None: no padding).
          encoder_segment_ids, decoder_segment_ids: packing ids [B, S] / [B, L].
          decoder_positions: unused by T5 (relative bias); kept for feature compatibility.
          enable_dropout: apply dropout (training).
          decode: autoregressive decoding through the KV cache ('cache' collection, mutable):
            the first call, with `max_decode_length` tokens, creates the cache; later calls
            feed one token per row at the row's cache index ([B, 1] -> logits [B, 1, V]).
          max_decode_length: the KV cache length S (required with `decode`).
        """
        del decoder_positions
        b, length = decoder_input_tokens.shape
        dec_valid = _padding_or_segments(decoder_target_tokens, None)
        causal = not (decode and length == 1)
        self_mask = _self_mask(length, dec_valid, decoder_segment_ids, causal)
        enc_valid = encoder_input_tokens > 0
        dec_valid = jnp.ones((b, length), bool) if dec_valid is None else dec_valid > 0
        packed = decoder_segment_ids is not None and encoder_segment_ids is not None
        cross_mask = MaskParts(
            dec_valid,
            enc_valid,
            decoder_segment_ids if packed else None,
            encoder_segment_ids if packed else None,
        ).with_whole(length, encoder_input_tokens.shape[1])
        return self.decoder(
            decoder_input_tokens,
            encoded,
            self_mask,
            cross_mask,
            None,
            deterministic=not enable_dropout,
            decode=decode,
            max_decode_length=max_decode_length,
        )

    def __call__(
        self,
        encoder_input_tokens: Array,
        decoder_input_tokens: Array,
        decoder_target_tokens: Array | None = None,
        encoder_segment_ids: Array | None = None,
        decoder_segment_ids: Array | None = None,
        encoder_positions: Array | None = None,
        decoder_positions: Array | None = None,
        enable_dropout: bool = True,
    ) -> Array:
        """Teacher-forced forward pass; returns fp32 logits [B, L, V]."""
        encoded = self.encode(
            encoder_input_tokens, encoder_segment_ids, encoder_positions, enable_dropout
        )
        return self.decode(
            encoded,
            encoder_input_tokens,
            decoder_input_tokens,
            decoder_target_tokens,
            encoder_segment_ids,
            decoder_segment_ids,
            decoder_positions,
            enable_dropout,
        )


class DecoderOnly(nn.Module):
    """Decoder-only LM (causal, or prefix-LM via `decoder_causal_attention`)."""

    config: DecoderOnlyConfig

    def setup(self) -> None:
        cfg = self.config
        self.token_embedder = _embedder(cfg, init_std=cfg.emb_dim**-0.5)
        self.decoder = Decoder(
            cfg,
            shared_embedding=self.token_embedder,
            num_layers=cfg.num_layers,
            cross_attention=False,
        )

    def __call__(
        self,
        decoder_input_tokens: Array,
        decoder_target_tokens: Array | None = None,
        decoder_segment_ids: Array | None = None,
        decoder_positions: Array | None = None,
        decoder_causal_attention: Array | None = None,
        enable_dropout: bool = True,
        decode: bool = False,
        max_decode_length: int | None = None,
    ) -> Array:
        """Forward pass; returns fp32 logits [B, L, V].

        Args:
          decoder_input_tokens: [B, L] int tokens (targets shifted right within each example).
          decoder_target_tokens: [B, L], for the padding mask (None: no padding mask).
          decoder_segment_ids: packing ids [B, L] (0 = padding).
          decoder_positions: positions within each packed example [B, L] (RoPE).
          decoder_causal_attention: [B, L], 1 on the inputs part of a prefix-LM example, which
            then attends bidirectionally within itself.
          enable_dropout: apply dropout (training).
          decode: decoding through the KV cache ('cache' collection, mutable). The first call,
            with `max_decode_length` tokens, creates the cache; a second call with that many
            tokens prefills it with a prompt (masks as above); later calls feed one token per
            row [B, 1] at the row's cache index (see `decoding.py`).
          max_decode_length: the KV cache length S (required with `decode`).
        """
        length = decoder_input_tokens.shape[1]
        if decode and length == 1:
            # One cached step: causal by each row's cache index (built in the attention layer).
            return self.decoder(
                decoder_input_tokens,
                None,
                None,
                None,
                None,
                deterministic=not enable_dropout,
                decode=True,
                max_decode_length=max_decode_length,
            )
        valid = _padding_or_segments(decoder_target_tokens, None)
        mask = _self_mask(length, valid, decoder_segment_ids, True, decoder_causal_attention)
        return self.decoder(
            decoder_input_tokens,
            None,
            mask,
            None,
            decoder_positions,
            deterministic=not enable_dropout,
            decode=decode,
            max_decode_length=max_decode_length,
        )
