"""The decoder-only family's Hugging Face mapping: `LlamaForCausalLM` (RoPE, SwiGLU, GQA) and
`MixtralForCausalLM` (Llama layers whose MLP is a top-k dropless mixture of SwiGLU experts) <->
`network.DecoderOnlyConfig` and its parameter tree."""

from __future__ import annotations

import dataclasses
from typing import Any

from t5lite.hf.layout import Entry, attention_entries, check_moe_export, mlp_entries, moe_entries
from t5lite.model import network
from t5lite.model.config import is_moe_layer

HEAD = "lm_head.weight"
MIXTRAL = "MixtralForCausalLM"


def config_from_hf(c: dict[str, Any], where: str, tied: bool) -> network.DecoderOnlyConfig:
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: unsupported Llama hidden_act={c['hidden_act']!r} (want 'silu')")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ValueError(f"{where}: Llama attention_bias/mlp_bias are not supported")
    heads = c["num_attention_heads"]
    return network.DecoderOnlyConfig(
        vocab_size=c["vocab_size"],
        emb_dim=c["hidden_size"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        num_layers=c["num_hidden_layers"],
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        mlp_dim=c["intermediate_size"],
        mlp_activation="silu",
        position_embedding="rope",
        **_rope_from_hf(c, where),
        logits_via_embedding=tied,
        scale_attn_logits=True,
        layer_norm_epsilon=c.get("rms_norm_eps", 1e-6),
    )


def _rope_from_hf(c: dict[str, Any], where: str) -> dict[str, Any]:
    """DecoderOnlyConfig RoPE fields from HF `rope_parameters` (5.x) or `rope_scaling` (4.x)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta") or c.get("rope_theta") or 10000.0  # 5.x: in rope_parameters
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
    if kind == "dynamic":
        # NOTE: transformers recomputes dynamic-NTK frequencies from each call's length and
        # keeps them in module state, so cached decoding depends on the call history.
        raise ValueError(
            f"{where}: unsupported RoPE scaling type 'dynamic' (its frequencies depend on the "
            "length of each call; supported: default, linear, llama3)"
        )
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(
            f"{where}: unsupported RoPE scaling type {kind!r} (supported: default, linear, llama3)"
        )
    if kind == "default":
        return out

    def need(key: str, default: Any = None) -> Any:
        if rope.get(key, default) is None:
            raise ValueError(f"{where}: RoPE scaling type {kind!r} needs {key!r}")
        return rope.get(key, default)

    out.update(rope_scaling=kind, rope_scaling_factor=float(need("factor")))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(need("low_freq_factor")),
            rope_high_freq_factor=float(need("high_freq_factor")),
            rope_original_max_position=int(
                need("original_max_position_embeddings", c.get("max_position_embeddings"))
            ),
        )
    return out


def _rope_to_hf(cfg: network.DecoderOnlyConfig) -> dict[str, Any]:
    kind = "default" if cfg.rope_scaling == "none" else cfg.rope_scaling
    rope: dict[str, Any] = {"rope_type": kind, "rope_theta": cfg.rope_theta}
    if kind != "default":
        rope["factor"] = cfg.rope_scaling_factor
    if kind == "llama3":
        rope.update(
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position,
        )
    # 5.x reads `rope_parameters`, 4.x `rope_scaling` (None when unscaled) and `rope_theta`.
    legacy = None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": cfg.rope_theta, "rope_parameters": rope, "rope_scaling": legacy}


def config_to_hf(cfg: network.DecoderOnlyConfig) -> dict[str, Any]:
    if not (cfg.use_rope and cfg.mlp_activation == "silu" and cfg.scale_attn_logits):
        raise ValueError(
            "export_hf: a DecoderOnlyConfig maps to LlamaForCausalLM only with "
            "position_embedding='rope', mlp_activation='silu', scale_attn_logits=True; got "
            f"{cfg.position_embedding!r}, {cfg.mlp_activation!r}, {cfg.scale_attn_logits}"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.emb_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.layer_norm_epsilon,
        **_rope_to_hf(cfg),
        "tie_word_embeddings": cfg.logits_via_embedding,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 4096,
        "torch_dtype": cfg.policy.params,
    }


def entries(cfg: network.DecoderOnlyConfig) -> list[Entry]:
    """The tensors of Llama (`num_experts == 0`) or Mixtral."""
    d, h, g, k, f = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    e = cfg.num_experts
    out = [
        Entry(
            "model.embed_tokens.weight",
            ("token_embedder", "embedding"),
            (cfg.vocab_size, d),
            "copy",
        )
    ]
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", ("decoder", f"layers_{i}")
        out.append(
            Entry(
                f"{hf}.input_layernorm.weight",
                (*ours, "pre_self_attention_layer_norm", "scale"),
                (d,),
                "copy",
            )
        )
        out += attention_entries(f"{hf}.self_attn", (*ours, "self_attention"), d, h, g, k, names)
        out.append(
            Entry(
                f"{hf}.post_attention_layernorm.weight",
                (*ours, "pre_mlp_layer_norm", "scale"),
                (d,),
                "copy",
            )
        )
        if cfg.num_experts and is_moe_layer(cfg, i):
            moe = f"{hf}.block_sparse_moe"
            # Mixtral's w1 is the gate (SiLU), w3 the linear input, w2 the output.
            w132 = ("w1", "w3", "w2")
            out += moe_entries(f"{moe}.gate.weight", f"{moe}.experts.{{j}}", ours, d, f, e, w132)
        else:
            out += mlp_entries(f"{hf}.mlp", ours, d, f, ("gate_proj", "up_proj", "down_proj"))
    out.append(Entry("model.norm.weight", ("decoder", "decoder_norm", "scale"), (d,), "copy"))
    if not cfg.logits_via_embedding:
        out.append(Entry(HEAD, ("decoder", "logits_dense", "kernel"), (d, cfg.vocab_size), "t"))
    return out


# --- Mixtral ------------------------------------------------------------------------------------


def mixtral_config_from_hf(c: dict[str, Any], where: str, tied: bool) -> network.DecoderOnlyConfig:
    """`MixtralConfig` -> DecoderOnlyConfig (Llama layers, top-k dropless experts everywhere)."""
    if c.get("sliding_window") is not None:
        raise ValueError(
            f"{where}: unsupported Mixtral variant sliding_window={c['sliding_window']} (t5lite "
            "attends to every earlier position: want null)"
        )
    return dataclasses.replace(
        config_from_hf(c, where, tied),
        num_experts=c["num_local_experts"],
        moe_every=1,
        moe_top_k=c["num_experts_per_tok"],
        moe_router="softmax_then_topk",
        moe_normalize_top_k=True,
        moe_jitter_noise=float(c.get("router_jitter_noise", 0.0)),
        moe_dispatch="dropless",
        moe_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        moe_z_loss_coef=0.0,  # NOTE: Mixtral has no router z-loss
    )


def mixtral_config_to_hf(cfg: network.DecoderOnlyConfig) -> dict[str, Any]:
    """DecoderOnlyConfig with experts -> `MixtralConfig` fields (one line if it has none)."""
    want = {
        "moe_every": 1,
        "moe_router": "softmax_then_topk",
        "moe_normalize_top_k": True,
        "moe_dispatch": "dropless",
        "moe_shared_experts": 0,
    }
    check_moe_export(cfg, want, MIXTRAL)
    out = config_to_hf(cfg)
    del out["attention_bias"], out["mlp_bias"]
    out.update(
        architectures=[MIXTRAL],
        model_type="mixtral",
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.moe_top_k,
        router_jitter_noise=cfg.moe_jitter_noise,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
        sliding_window=None,
    )
    return out
