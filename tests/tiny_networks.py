"""The tiny dense encoder-decoder that the trainer, optimizer, LoRA and loss tests train."""

from __future__ import annotations

import numpy as np

from t5lite.model import network
from t5lite.trainer import Trainer

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


def full_reversal_batch(tr: Trainer) -> dict:
    """`tr`'s global batch of 8 reversal rows of 8 tokens, no padding."""
    tokens = np.random.default_rng(0).integers(2, 32, (8, 8)).astype(np.int32)
    targets = tokens[:, ::-1].copy()
    return tr.global_batch(
        {
            "encoder_input_tokens": tokens,
            "decoder_target_tokens": targets,
            "decoder_input_tokens": np.pad(targets, ((0, 0), (1, 0)))[:, :-1],
        }
    )
