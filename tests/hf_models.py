"""Random tiny Hugging Face models for the interop tests (built here, nothing downloaded).

One size for every family (width 32, 4 heads of 8, MLP 48, 2 layers, vocabulary 96), so that a
test names only what it varies. Import this module after `pytest.importorskip("torch")` and
`pytest.importorskip("transformers")`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

V = 96
"""The default vocabulary size."""


def t5_config(**fields: Any) -> transformers.T5Config:
    """A tiny T5 config (relative positions: 8 buckets up to distance 20); `fields` add to or
    override it (`feed_forward_proj` picks T5.1.0's 'relu' or T5.1.1's 'gated-gelu')."""
    base = dict(
        vocab_size=V,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5Config(**{**base, **fields})


def llama_config(**fields: Any) -> transformers.LlamaConfig:
    """A tiny Llama config (grouped-query attention, 2 key/value heads); `fields` add to or
    override it."""
    base = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
    )
    return transformers.LlamaConfig(**{**base, **fields})


def build(model_cls: type, config: Any, seed: int = 0) -> torch.nn.Module:
    """`model_cls(config)` in eval mode, its weights drawn after `torch.manual_seed(seed)`."""
    torch.manual_seed(seed)
    return model_cls(config).eval()


def share_input_embeddings(model: torch.nn.Module) -> None:
    """Shares the encoder's and decoder's input embeddings again.

    NOTE: with an untied head, transformers 5.x also unties the encoder's and decoder's input
    embeddings, which T5 and Switch always share.
    """
    model.encoder.embed_tokens = model.decoder.embed_tokens = model.shared


def randomize_norms(model: torch.nn.Module) -> None:
    """Norm scales drawn from U(0.5, 1.5) instead of ones, so that a norm lost shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def t5_hf(tmp_path: Path, tied: bool = False, **fields: Any) -> torch.nn.Module:
    """A T5.1.1 (untied, unscaled head) or, `tied`, a T5.1.0 with 3 decoder layers saved to
    `tmp_path / "hf"`; `fields` override its config."""
    proj = "relu" if tied else "gated-gelu"
    cfg = t5_config(
        **{
            "num_decoder_layers": 3,
            "feed_forward_proj": proj,
            "tie_word_embeddings": tied,
            **fields,
        }
    )
    # NOTE: transformers 5.x forces tie_word_embeddings=True in T5Config (the constructor
    # argument only sets `scale_decoder_outputs`); set it after construction to untie lm_head.
    cfg.tie_word_embeddings = tied
    model = build(transformers.T5ForConditionalGeneration, cfg)
    share_input_embeddings(model)
    assert (model.lm_head.weight is model.shared.weight) == tied
    assert getattr(cfg, "scale_decoder_outputs", tied) == tied
    model.save_pretrained(tmp_path / "hf")
    return model


def llama_hf(tmp_path: Path, tied: bool = False) -> torch.nn.Module:
    """A Llama (non-trivial norms) saved to `tmp_path / "hf"`."""
    cfg = llama_config(attention_bias=False)
    cfg.tie_word_embeddings = tied
    model = build(transformers.LlamaForCausalLM, cfg)
    randomize_norms(model)
    model.save_pretrained(tmp_path / "hf")
    return model


def switch_hf(
    path: Path, expert_capacity: int = 64, layers: int = 4, num_experts: int = 4, **fields: Any
) -> torch.nn.Module:
    """A Switch Transformer of T5.1.0 layers, layers 1 (and 3) sparse (sparse step 2), saved
    to `path`."""
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=V,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=4,
        num_experts=num_experts,
        expert_capacity=expert_capacity,
        num_sparse_encoder_layers=layers // 2,
        num_sparse_decoder_layers=layers // 2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        **fields,
    )
    model = build(transformers.SwitchTransformersForConditionalGeneration, cfg)
    share_input_embeddings(model)
    model.save_pretrained(path)
    return model


def mixtral_hf(path: Path, layers: int = 2, num_experts: int = 4, **fields: Any) -> torch.nn.Module:
    """A Mixtral (top-2 of `num_experts`, non-trivial norms) saved to `path`."""
    cfg = transformers.MixtralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        initializer_range=0.1,  # larger router logits: decisive top-2 choices
        **fields,
    )
    model = build(transformers.MixtralForCausalLM, cfg)
    randomize_norms(model)
    model.save_pretrained(path)
    return model
