"""Analytic FLOPs of the transformer (the numerator of MFU)."""

from __future__ import annotations

from typing import Any


def transformer_train_flops(config: Any, input_len: int, target_len: int) -> float:
    """Analytic FLOPs of one training example (forward + backward = 3 × forward).

    Counts every matmul (2 FLOPs per multiply-add) including attention scores and values and
    the output logits; ignores norms, softmax and element-wise work.
    """
    d, h, k, f, v = (
        config.emb_dim,
        config.num_heads,
        config.head_dim,
        config.mlp_dim,
        config.vocab_size,
    )
    n_mlp_in = len(config.mlp_activations)
    kv_heads = getattr(config, "num_kv_heads", h) or h
    mlp = 2 * (n_mlp_in * d * f + f * d)
    attn_proj = 2 * (d * h * k + 2 * d * kv_heads * k + h * k * d)

    def attn_scores(q_len: int, kv_len: int) -> float:
        return 2 * 2 * q_len * kv_len * h * k  # QK^T and AV

    if hasattr(config, "num_encoder_layers"):
        s, t = input_len, target_len
        enc = config.num_encoder_layers * (s * (mlp + attn_proj) + attn_scores(s, s))
        cross_q_o = 2 * (2 * d * h * k)
        cross_kv = 2 * (2 * d * h * k)
        dec = config.num_decoder_layers * (
            t * (mlp + attn_proj + cross_q_o) + s * cross_kv + attn_scores(t, t) + attn_scores(t, s)
        )
        logits = 2 * t * d * v
        fwd = enc + dec + logits
    else:
        t = input_len + target_len
        fwd = config.num_layers * (t * (mlp + attn_proj) + attn_scores(t, t)) + 2 * t * d * v
    return 3.0 * fwd
