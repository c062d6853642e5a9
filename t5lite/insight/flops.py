"""Model FLOPs of the transformer: the numerator of MFU, counted as PaLM and MaxText count it.

Model FLOPs are what the model needs, not what the hardware ran: matmuls only (2 FLOPs per
multiply-add), training = forward + backward = 3 × forward, no rematerialisation, and only the
*real* tokens of a batch (padding is work the hardware did for nothing, so it earns no MFU).

Per token, with D = emb_dim, H = heads, G = kv heads, K = head_dim, F = mlp_dim, V = vocab,
n = gated MLP inputs (2 for T5.1.1 / Llama, 1 for ReLU):

  dense    6 · N_layer · layers + 6 · D · V           (PaLM appendix B's 6N; N_layer is the
           N_layer = D·H·K + 2·D·G·K + H·K·D + n·D·F + F·D    layer's matmul weights; the
                                                       input embedding is a lookup, not a matmul,
                                                       and is not counted; the logits are)
  attention 12 · layers · H · K · T_kv · c             (PaLM's 12·L·H·Q·T: QKᵀ and AV, 2·2·H·K·T
                                                       per token forward, ×3 for training)

with c = 1/2 for causal self-attention (half of the score matrix is masked: MaxText's
`causal_attention_flops = noncausal_attention_flops / 2`) and c = 1 for bidirectional encoder
self-attention and for cross-attention. PaLM's own formula does not halve; this one does, so a
causal model's MFU here is slightly lower than PaLM's convention would give. A prefix-LM is
counted as causal throughout (its bidirectional prefix is a small undercount).

Encoder-decoder (T5): an encoder token costs the encoder layers, full attention over the
S encoder positions, and the decoder's cross-attention key/value projections (which read encoder
positions); a decoder token costs the decoder layers without those, causal self-attention over
the T decoder positions, full cross-attention over S, and the logits.

A mixture-of-experts layer (model/moe.py) counts its *active* parameters only: the router
(D·E), the k experts a token goes through and the shared experts, so its MLP term is
(k + n_shared) · (n·D·F + F·D) + D·E instead of n·D·F + F·D (the E - k idle experts earn no MFU).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from t5lite.model.config import is_moe_layer

_ENCODER_TOKENS = "encoder_input_tokens"
_DECODER_TOKENS = "decoder_target_tokens"


def _layer_weights(config: Any) -> tuple[int, int, int]:
    """(self-attention, cross-attention key+value, MLP) matmul weights of one layer."""
    d, h, k, f = config.emb_dim, config.num_heads, config.head_dim, config.mlp_dim
    g = getattr(config, "num_kv_heads", h) or h
    attn = d * h * k + 2 * d * g * k + h * k * d
    mlp = len(config.mlp_activations) * d * f + f * d
    return attn, 2 * d * h * k, mlp


def _moe_extra(config: Any, num_layers: int, mlp: int) -> int:
    """Matmul weights a token uses in a stack's MoE layers beyond one dense MLP per layer."""
    experts = getattr(config, "num_experts", 0)
    if not experts:
        return 0
    moe_layers = sum(is_moe_layer(config, i) for i in range(num_layers))
    per_layer = (config.moe_top_k + config.moe_shared_experts - 1) * mlp
    return moe_layers * (per_layer + config.emb_dim * experts)


def flops_per_token(config: Any, lengths: Mapping[str, int]) -> dict[str, float]:
    """Training model FLOPs of one real token, per kind of token.

    Args:
      config: a `T5Config` or `DecoderOnlyConfig`.
      lengths: the row lengths the network sees: `{"encoder": S, "decoder": T}` for an
        encoder-decoder, `{"decoder": T}` for a decoder-only model (T is the whole packed row,
        a prefix-LM's inputs included).

    Returns:
      `{"encoder": FLOPs, "decoder": FLOPs}` (only "decoder" for a decoder-only model).
    """
    attn, cross_kv, mlp = _layer_weights(config)
    hk = config.num_heads * config.head_dim
    logits = 6 * config.emb_dim * config.vocab_size
    t = lengths["decoder"]
    if hasattr(config, "num_encoder_layers"):
        s = lengths["encoder"]
        n_enc, n_dec = config.num_encoder_layers, config.num_decoder_layers
        encoder = n_enc * (6 * (attn + mlp) + 12 * hk * s) + n_dec * 6 * cross_kv
        encoder += 6 * _moe_extra(config, n_enc, mlp)
        cross_q_o = 2 * config.emb_dim * hk
        decoder = n_dec * (6 * (attn + cross_q_o + mlp) + 12 * hk * t / 2 + 12 * hk * s) + logits
        decoder += 6 * _moe_extra(config, n_dec, mlp)
        return {"encoder": float(encoder), "decoder": float(decoder)}
    decoder = config.num_layers * (6 * (attn + mlp) + 12 * hk * t / 2) + logits
    decoder += 6 * _moe_extra(config, config.num_layers, mlp)
    return {"decoder": float(decoder)}


def row_lengths(model_features: Mapping[str, Any]) -> dict[str, int]:
    """{"encoder": S, "decoder": T} from a batch's (or dummy batch's) feature shapes."""
    out = {"decoder": int(np.shape(model_features[_DECODER_TOKENS])[-1])}
    if _ENCODER_TOKENS in model_features:
        out["encoder"] = int(np.shape(model_features[_ENCODER_TOKENS])[-1])
    return out


def real_tokens(batch: Mapping[str, Any]) -> dict[str, int]:
    """Non-padding positions of a batch per kind of token (a packed row's gaps are padding).

    A decoder-only batch has no encoder features, so a task's `inputs` are never counted twice:
    a prefix-LM's inputs are part of its decoder row and are counted there, once.
    """
    out = {}
    for kind, tokens, segments in (
        ("decoder", _DECODER_TOKENS, "decoder_segment_ids"),
        ("encoder", _ENCODER_TOKENS, "encoder_segment_ids"),
    ):
        if tokens in batch:
            # Segment ids mark packed rows exactly (id 0 = padding); without packing, id 0 is
            # the padding token.
            mask = batch[segments] if segments in batch else batch[tokens]
            out[kind] = int(np.count_nonzero(np.asarray(mask)))
    return out


def batch_train_flops(config: Any, batch: Mapping[str, Any]) -> float:
    """Model FLOPs of one training step on `batch`: per-token FLOPs × real tokens."""
    per_token = flops_per_token(config, row_lengths(batch))
    counts = real_tokens(batch)
    return sum(per_token[k] * counts.get(k, 0) for k in per_token)


def transformer_train_flops(config: Any, input_len: int, target_len: int) -> float:
    """Model FLOPs of one full (unpadded) training example.

    `input_len` is the encoder length of an encoder-decoder; for a decoder-only model the row is
    `input_len + target_len` (a prefix-LM's inputs are part of the row; 0 for a plain LM).
    """
    if hasattr(config, "num_encoder_layers"):
        per = flops_per_token(config, {"encoder": input_len, "decoder": target_len})
        return per["encoder"] * input_len + per["decoder"] * target_len
    row = input_len + target_len
    return flops_per_token(config, {"decoder": row})["decoder"] * row
