"""Predictions you can trust: MFU's model FLOPs, memory and communication against hand-computed
values and the compiler's own figures."""

import numpy as np
import pytest

from t5lite.insight import flops
from t5lite.model.network import DecoderOnlyConfig, T5Config
from t5lite.programs.metrics_writer import Throughput

# --- MFU: model FLOPs per real token ------------------------------------------------------------

LM = DecoderOnlyConfig(
    vocab_size=16, emb_dim=4, num_heads=2, num_kv_heads=1, head_dim=3, mlp_dim=8, num_layers=2
)


def test_decoder_only_flops_per_token_hand_computed():
    # PaLM appendix B: 6N + 12·L·H·K·T, here with the causal half. Layer matmul weights:
    # q 4x2x3=24, k and v 4x1x3=12 each (one kv head), out 2x3x4=24; SwiGLU 2x(4x8) + 8x4 = 96.
    n_layer = 24 + 12 + 12 + 24 + 96
    t = 10
    dense = 6 * n_layer * 2 + 6 * 4 * 16  # two layers, plus the logits (no input embedding)
    attention = 12 * 2 * (2 * 3) * t / 2  # QKᵀ and AV, causal: half the score matrix
    assert flops.flops_per_token(LM, {"decoder": t}) == {"decoder": dense + attention}
    assert (dense, attention) == (2400, 720)


def test_encoder_decoder_flops_per_token_hand_computed():
    cfg = T5Config(
        vocab_size=16, emb_dim=4, num_heads=2, head_dim=3, mlp_dim=8,
        num_encoder_layers=1, num_decoder_layers=2,
    )  # fmt: skip
    s, t = 6, 4
    attn = 4 * 6 + 2 * 4 * 6 + 6 * 4  # q, k+v, out (H*K = 6)
    mlp = 2 * 4 * 8 + 8 * 4  # gated GELU
    # Encoder token: its layer, full attention over S, and each decoder layer's cross k/v.
    enc = 1 * (6 * (attn + mlp) + 12 * 6 * s) + 2 * 6 * (2 * 4 * 6)
    # Decoder token: self-attention (causal), cross q/out, MLP, cross-attention over S, logits.
    dec = 2 * (6 * (attn + 2 * 4 * 6 + mlp) + 12 * 6 * t / 2 + 12 * 6 * s) + 6 * 4 * 16
    assert flops.flops_per_token(cfg, {"encoder": s, "decoder": t}) == {
        "encoder": enc, "decoder": dec,
    }  # fmt: skip
    assert flops.transformer_train_flops(cfg, s, t) == s * enc + t * dec


def test_throughput_counts_real_tokens_and_mfu():
    """Two packed rows of 10 with 7 and 4 real tokens; a fake clock ticks 2 s per step."""
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]])
    batch = {
        "decoder_target_tokens": np.where(seg > 0, 5, 0),
        "decoder_input_tokens": np.where(seg > 0, 5, 0),
        "decoder_segment_ids": seg,
    }
    ticks = iter([100.0, 102.0])
    tp = Throughput(LM, batch_size=2, peak_flops=1e4, clock=lambda: next(ticks))
    m = tp.measure(batch)
    per_token = 2400 + 720  # the hand-computed figure above, for rows of T = 10
    assert m["tokens_per_s"] == 11 / 2
    assert m["padded_tokens_per_s"] == 20 / 2
    assert m["model_flops_per_s"] == 11 * per_token / 2
    assert m["mfu"] == pytest.approx(11 * per_token / 2 / 1e4)
    # A decoder-only batch never counts `inputs` separately: a prefix-LM's are in its row.
    assert flops.real_tokens(batch) == {"decoder": 11}


def test_throughput_without_peak_says_so():
    tp = Throughput(LM, batch_size=1, peak_flops=None)
    m = tp.measure({"decoder_target_tokens": np.ones((1, 4), np.int32)})
    assert m["mfu"].startswith("n/a") and m["padded_tokens_per_s"] > 0
