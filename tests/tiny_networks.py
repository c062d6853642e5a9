"""The tiny dense encoder-decoder that the trainer, optimizer, LoRA and loss tests train."""

from __future__ import annotations

from t5lite.model import network

TINY_T5 = network.T5Config(
    vocab_size=32,
    emb_dim=16,
    num_heads=2,
    num_encoder_layers=1,
    num_decoder_layers=1,
    head_dim=8,
    mlp_dim=32,
)
"""T5.1.1, one layer each side, width 16: fits the reversal batches of `conftest.reverse_batch`."""
