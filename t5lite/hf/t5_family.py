"""The T5 family's Hugging Face mapping: `T5ForConditionalGeneration` (T5.1.1 gated-GELU, T5.1.0
ReLU) and `SwitchTransformersForConditionalGeneration` (T5.1.0 layers whose every `sparse_step`-th
MLP is a top-1 mixture of experts) <-> `network.T5Config` and its parameter tree."""

from __future__ import annotations

import dataclasses
from typing import Any

from t5lite.hf.layout import Entry, attention_entries, check_moe_export, mlp_entries, moe_entries
from t5lite.model import network
from t5lite.model.config import is_moe_layer

HEAD = "lm_head.weight"
SWITCH = "SwitchTransformersForConditionalGeneration"


def config_from_hf(c: dict[str, Any], where: str, tied: bool) -> network.T5Config:
    proj = c.get("feed_forward_proj", "relu")
    variants = {"relu": "t5.1.0", "gated-gelu": "t5.1.1"}
    if proj not in variants:
        raise ValueError(
            f"{where}: unsupported T5 variant feed_forward_proj={proj!r} (supported: "
            "'relu' = T5 v1.0, 'gated-gelu' = T5.1.1)"
        )
    # transformers 5.x's T5Config: `scale_decoder_outputs` as saved, else (a 4.x file) what 4.x
    # did, scale iff `tie_word_embeddings` is not false. Whether the head is tied follows from
    # the tensors (`_head_is_tied`), not from `tie_word_embeddings`.
    scaled = bool(c.get("scale_decoder_outputs", c.get("tie_word_embeddings", True) is not False))
    if scaled and not tied:
        raise ValueError(
            f"{where}: unsupported T5 variant: untied lm_head with scale_decoder_outputs=true "
            "(lm_head.weight differs from shared.weight while the decoder output is scaled by "
            "d_model**-0.5; supported: tied and scaled = T5 v1.0, tied or untied and unscaled "
            "= T5.1.1)"
        )
    return network.T5Config(
        vocab_size=c["vocab_size"],
        emb_dim=c["d_model"],
        num_heads=c["num_heads"],
        num_encoder_layers=c["num_layers"],
        num_decoder_layers=c.get("num_decoder_layers") or c["num_layers"],
        head_dim=c["d_kv"],
        mlp_dim=c["d_ff"],
        variant=variants[proj],
        tie_logits=tied,
        scale_logits=scaled,
        dropout_rate=c.get("dropout_rate", 0.0),
        relpos_num_buckets=c.get("relative_attention_num_buckets", 32),
        relpos_max_distance=c.get("relative_attention_max_distance", 128),
        layer_norm_epsilon=c.get("layer_norm_epsilon", 1e-6),
    )


def config_to_hf(cfg: network.T5Config) -> dict[str, Any]:
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.emb_dim,
        "d_kv": cfg.head_dim,
        "d_ff": cfg.mlp_dim,
        "num_layers": cfg.num_encoder_layers,
        "num_decoder_layers": cfg.num_decoder_layers,
        "num_heads": cfg.num_heads,
        "relative_attention_num_buckets": cfg.relpos_num_buckets,
        "relative_attention_max_distance": cfg.relpos_max_distance,
        "dropout_rate": cfg.dropout_rate,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "feed_forward_proj": "relu" if cfg.variant == "t5.1.0" else "gated-gelu",
        # NOTE: transformers 4.x ignores `scale_decoder_outputs` and scales iff tied, so a tied
        # unscaled head (5.x's T5.1.1) is written untied, with the embedding as its lm_head:
        # 4.x reads an unscaled untied head, 5.x ties the two (they are equal).
        "tie_word_embeddings": cfg.scale_tied_logits,
        "scale_decoder_outputs": cfg.scale_tied_logits,
        "is_encoder_decoder": True,
        "torch_dtype": cfg.policy.params,
    }


def entries(cfg: network.T5Config) -> list[Entry]:
    """The tensors of T5 (`num_experts == 0`) or Switch Transformers."""
    d, h, k, n = cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.relpos_num_buckets
    qkvo = ("q", "k", "v", "o")
    out = [Entry("shared.weight", ("token_embedder", "embedding"), (cfg.vocab_size, d), "copy")]
    for stack, n_layers in (
        ("encoder", cfg.num_encoder_layers),
        ("decoder", cfg.num_decoder_layers),
    ):
        out.append(
            Entry(
                f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                (stack, "relpos_bias", "rel_embedding"),
                (h, n),
                "t",
            )
        )
        for i in range(n_layers):
            hf, ours = f"{stack}.block.{i}.layer", (stack, f"layers_{i}")
            self_attn = "attention" if stack == "encoder" else "self_attention"
            self_norm = f"pre_{self_attn}_layer_norm"
            out.append(
                Entry(f"{hf}.0.layer_norm.weight", (*ours, self_norm, "scale"), (d,), "copy")
            )
            out += attention_entries(f"{hf}.0.SelfAttention", (*ours, self_attn), d, h, h, k, qkvo)
            m = 1
            if stack == "decoder":
                out.append(
                    Entry(
                        f"{hf}.1.layer_norm.weight",
                        (*ours, "pre_cross_attention_layer_norm", "scale"),
                        (d,),
                        "copy",
                    )
                )
                out += attention_entries(
                    f"{hf}.1.EncDecAttention",
                    (*ours, "encoder_decoder_attention"),
                    d,
                    h,
                    h,
                    k,
                    qkvo,
                )
                m = 2
            out.append(
                Entry(
                    f"{hf}.{m}.layer_norm.weight",
                    (*ours, "pre_mlp_layer_norm", "scale"),
                    (d,),
                    "copy",
                )
            )
            out += _feed_forward_entries(cfg, i, f"{hf}.{m}", ours)
        norm = f"{stack}_norm"
        out.append(Entry(f"{stack}.final_layer_norm.weight", (stack, norm, "scale"), (d,), "copy"))
    if not cfg.logits_via_embedding:
        out.append(Entry(HEAD, ("decoder", "logits_dense", "kernel"), (d, cfg.vocab_size), "t"))
    return out


def _feed_forward_entries(
    cfg: network.T5Config, i: int, hf: str, ours: tuple[str, ...]
) -> list[Entry]:
    """Layer i's MLP: T5's `DenseReluDense`, Switch's dense `mlp` or its experts."""
    d, f = cfg.emb_dim, cfg.mlp_dim
    if not cfg.num_experts:
        mlp = ("wi", "wo") if cfg.variant == "t5.1.0" else ("wi_0", "wi_1", "wo")
        return list(mlp_entries(f"{hf}.DenseReluDense", ours, d, f, mlp))
    if not is_moe_layer(cfg, i):
        return list(mlp_entries(f"{hf}.mlp", ours, d, f, ("wi", "wo")))
    router, expert = f"{hf}.mlp.router.classifier.weight", f"{hf}.mlp.experts.expert_{{j}}"
    return list(moe_entries(router, expert, ours, d, f, cfg.num_experts, ("wi", "wo")))


# --- Switch Transformers ------------------------------------------------------------------------


def _sparse_step(c: dict[str, Any], stack: str, num_layers: int) -> int:
    """transformers' `{stack}_sparse_step`: as saved, else from `num_sparse_{stack}_layers`."""
    step = c.get(f"{stack}_sparse_step")
    if step is None:
        sparse = c.get(f"num_sparse_{stack}_layers", 3)
        step = num_layers // sparse if sparse > 0 else num_layers
    return int(step)


def switch_config_from_hf(c: dict[str, Any], where: str, tied: bool) -> network.T5Config:
    """`SwitchTransformersConfig` -> T5Config (T5.1.0 layers, top-1 capacity-based experts)."""
    act = c.get("dense_act_fn", "relu")
    if act != "relu":
        raise ValueError(f"{where}: unsupported Switch variant dense_act_fn={act!r} (want 'relu')")
    if c.get("router_bias", False):
        raise ValueError(f"{where}: unsupported Switch variant router_bias=true (no router bias)")
    if c.get("router_dtype", "float32") != "float32":
        raise ValueError(
            f"{where}: unsupported Switch variant router_dtype={c['router_dtype']!r} (t5lite "
            "routes in float32)"
        )
    layers = c["num_layers"], c.get("num_decoder_layers") or c["num_layers"]
    steps = _sparse_step(c, "encoder", layers[0]), _sparse_step(c, "decoder", layers[1])
    # NOTE: transformers makes layer i sparse when i % step == 1 (or step == 1); t5lite's
    # moe_every=k when i % k == k - 1 in both stacks: the same layers for steps 1 and 2.
    if steps[0] != steps[1] or steps[0] not in (1, 2):
        raise ValueError(
            f"{where}: unsupported Switch variant encoder_sparse_step={steps[0]}, "
            f"decoder_sparse_step={steps[1]} (t5lite's moe_every=k makes layers k-1, 2k-1, ... "
            "of both stacks sparse, Switch's step s layers 1, s+1, 2s+1, ...: supported steps "
            "1 and 2, equal in encoder and decoder)"
        )
    # Switch scales the decoder output iff tie_word_embeddings (T5 v1.0's tied head).
    scaled = bool(c.get("tie_word_embeddings", True))
    t5 = {**c, "feed_forward_proj": "relu", "scale_decoder_outputs": scaled}
    return dataclasses.replace(
        config_from_hf(t5, where, tied),
        num_experts=c["num_experts"],
        moe_every=steps[0],
        moe_top_k=1,
        moe_router="softmax_then_topk",
        moe_normalize_top_k=False,
        moe_jitter_noise=float(c.get("router_jitter_noise", 0.0)),
        moe_dispatch="capacity",
        moe_expert_capacity=int(c["expert_capacity"]),
        moe_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        moe_z_loss_coef=float(c.get("router_z_loss_coef", 0.001)),
    )


def switch_config_to_hf(cfg: network.T5Config) -> dict[str, Any]:
    """T5Config with experts -> `SwitchTransformersConfig` fields (one line if it has none)."""
    want = {
        "variant": "t5.1.0",
        "moe_top_k": 1,
        "moe_router": "softmax_then_topk",
        "moe_normalize_top_k": False,
        "moe_dispatch": "capacity",
        "moe_shared_experts": 0,
    }
    check_moe_export(cfg, want, SWITCH)
    if cfg.moe_every not in (1, 2):
        raise ValueError(
            f"export_hf: T5Config.moe_every={cfg.moe_every} has no {SWITCH} equivalent (its "
            "sparse layers are 1, s+1, 2s+1, ...: moe_every 1 or 2)"
        )
    if cfg.moe_expert_capacity <= 0:
        raise ValueError(
            f"export_hf: {SWITCH} has a fixed expert_capacity: set T5Config.moe_expert_capacity "
            "(> 0, slots per expert and sequence) instead of capacity factors"
        )
    out = config_to_hf(cfg)
    # transformers recomputes each step as num_layers // num_sparse_layers: with moe_every=2
    # and n layers, n // (n // 2) makes the same layers sparse (1, 3, ...; layer 1 when n = 3).
    out.update(
        architectures=[SWITCH],
        model_type="switch_transformers",
        dense_act_fn="relu",
        num_experts=cfg.num_experts,
        expert_capacity=cfg.moe_expert_capacity,
        num_sparse_encoder_layers=cfg.num_encoder_layers // cfg.moe_every,
        num_sparse_decoder_layers=cfg.num_decoder_layers // cfg.moe_every,
        encoder_sparse_step=cfg.moe_every,
        decoder_sparse_step=cfg.moe_every,
        router_bias=False,
        router_dtype="float32",
        router_jitter_noise=cfg.moe_jitter_noise,
        router_aux_loss_coef=cfg.moe_aux_loss_coef,
        router_z_loss_coef=cfg.moe_z_loss_coef,
    )
    del out["feed_forward_proj"], out["scale_decoder_outputs"]
    return out
