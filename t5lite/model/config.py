"""Network hyper-parameters: `T5Config` (encoder-decoder) and `DecoderOnlyConfig` (LM).

Frozen dataclasses: gin binds them (`network.T5Config.emb_dim = 768`), checkpoints record them
(`extra.json`'s `network_config`), and `hf/` maps them to and from Hugging Face configs.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

RematPolicy = Literal["none", "minimal", "full"]
REMAT_POLICIES: tuple[str, ...] = ("none", "minimal", "full")
"""What `remat_policy` accepts: save everything, save matmul outputs only, save nothing."""


@dataclasses.dataclass(frozen=True)
class T5Config:
    """T5.1.1 encoder-decoder hyper-parameters (defaults: T5.1.1 small)."""

    vocab_size: int = 32128
    """V, vocabulary size (32128 for the T5 SentencePiece model, padded)."""
    emb_dim: int = 512
    """D, model width."""
    num_heads: int = 6
    """H, attention heads."""
    num_encoder_layers: int = 8
    num_decoder_layers: int = 8
    head_dim: int = 64
    """K, width of one head (H * K need not equal D)."""
    mlp_dim: int = 1024
    """F, feed-forward hidden width."""
    variant: Literal["t5.1.1", "t5.1.0"] = "t5.1.1"
    """'t5.1.1': gated GELU, untied logits. 't5.1.0': ReLU, logits tied to the input embedding
    and scaled by 1/sqrt(D)."""
    dropout_rate: float = 0.0
    relpos_num_buckets: int = 32
    relpos_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dtype: str = "float32"
    """Activation dtype ('bfloat16' on accelerators). Logits, softmax and norms are fp32."""
    param_dtype: str = "float32"
    """Parameter storage dtype."""
    one_hot_embedding: bool = False
    """Embed via one-hot matmul (vocab-parallel lookup when the table is vocab-sharded)."""
    scan_layers: bool = False
    remat_policy: RematPolicy = "none"

    # Uniform interface shared with DecoderOnlyConfig, read by the layer classes.
    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def mlp_activations(self) -> tuple[str, ...]:
        return ("relu",) if self.variant == "t5.1.0" else ("gelu", "linear")

    @property
    def logits_via_embedding(self) -> bool:
        return self.variant == "t5.1.0"

    @property
    def scale_tied_logits(self) -> bool:
        return self.variant == "t5.1.0"  # T5.1.0 divides its tied logits by sqrt(D), as HF does

    @property
    def use_rope(self) -> bool:
        return False  # T5 positions are relative-position biases

    @property
    def rope_theta(self) -> float:
        return 10000.0  # unused (no RoPE); read by the shared attention layer

    @property
    def scale_attn_logits(self) -> bool:
        return False  # T5 folds 1/sqrt(K) into the query initialisation

    def __post_init__(self) -> None:
        if self.variant not in ("t5.1.1", "t5.1.0"):
            raise ValueError(f"T5Config.variant must be 't5.1.1' or 't5.1.0', got {self.variant!r}")
        _check_remat(self.remat_policy)


@dataclasses.dataclass(frozen=True)
class DecoderOnlyConfig:
    """Decoder-only LM hyper-parameters (defaults: a Llama-style small model)."""

    vocab_size: int = 32000
    emb_dim: int = 512
    num_heads: int = 8
    num_kv_heads: int | None = None
    """G, key/value heads for grouped-query attention (None: = num_heads)."""
    num_layers: int = 8
    head_dim: int = 64
    mlp_dim: int = 1536
    mlp_activation: Literal["gelu", "silu"] = "silu"
    """Gated MLP activation: 'silu' (SwiGLU, Llama) or 'gelu' (GeGLU, T5.1.1)."""
    position_embedding: Literal["rope", "relative"] = "rope"
    rope_theta: float = 10000.0
    relpos_num_buckets: int = 32
    relpos_max_distance: int = 128
    logits_via_embedding: bool = False
    """Tie the output projection to the input embedding."""
    scale_tied_logits: bool = False
    """With tied logits, divide them by sqrt(D) (T5.1.0 does; HF Llama does not)."""
    scale_attn_logits: bool = True
    """Scale logits by 1/sqrt(K) (Llama). False folds it into the query init (T5)."""
    dropout_rate: float = 0.0
    layer_norm_epsilon: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    one_hot_embedding: bool = False
    scan_layers: bool = False
    remat_policy: RematPolicy = "none"

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.position_embedding not in ("rope", "relative"):
            raise ValueError(
                f"position_embedding must be 'rope' or 'relative', got {self.position_embedding!r}"
            )
        _check_remat(self.remat_policy)

    @property
    def mlp_activations(self) -> tuple[str, ...]:
        return (self.mlp_activation, "linear")

    @property
    def use_rope(self) -> bool:
        return self.position_embedding == "rope"


AnyConfig = T5Config | DecoderOnlyConfig


def _check_remat(policy: str) -> None:
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy must be one of {REMAT_POLICIES}, got {policy!r}")
