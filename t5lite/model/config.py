"""Network hyper-parameters: `T5Config` (encoder-decoder) and `DecoderOnlyConfig` (LM).

Frozen dataclasses: gin binds them (`network.T5Config.emb_dim = 768`), checkpoints record them
(`extra.json`'s `network_config`), and `hf/` maps them to and from Hugging Face configs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from t5lite.model import attention
from t5lite.model.precision import Precision

RematPolicy = Literal["none", "minimal", "full"]
RopeScaling = Literal["none", "linear", "llama3"]
ROPE_SCALINGS: tuple[str, ...] = ("none", "linear", "llama3")
"""What `rope_scaling` accepts (HF `rope_type` 'default', 'linear', 'llama3')."""
REMAT_POLICIES: tuple[str, ...] = ("none", "minimal", "full")
"""What `remat_policy` accepts: save everything, save matmul outputs only, save nothing."""
MOE_DISPATCHES: tuple[str, ...] = ("capacity", "dropless")
"""What `moe_dispatch` accepts (see model/moe.py)."""
MOE_ROUTERS: tuple[str, ...] = ("softmax_then_topk", "topk_then_softmax")
"""What `moe_router` accepts (see model/moe.py)."""


@dataclasses.dataclass(frozen=True)
class MoeFields:
    """The mixture-of-experts fields that `T5Config` and `DecoderOnlyConfig` share (defaults:
    Switch's; `DecoderOnlyConfig` overrides two with Mixtral's). Gin binds them under each
    config's own name (`network.T5Config.moe_top_k`, `network.DecoderOnlyConfig.moe_top_k`).

    NOTE: dataclasses list inherited fields first: these lead `fields()`, `asdict()` (the
    checkpoint record) and reprs; convert's model.gin writes them last.
    """

    num_experts: int = 0
    """E, experts per mixture-of-experts MLP (0: every MLP is dense); see model/moe.py."""
    moe_every: int = 1
    """Every k-th layer's MLP is a mixture of experts: layer i (from 0) when (i + 1) % k == 0,
    in the encoder and the decoder alike (k=2: layers 1, 3, 5, ... as Switch / HF
    `encoder_sparse_step=2`; k=1: every layer)."""
    moe_top_k: int = 1
    """Experts per token (1: Switch; 2: Mixtral)."""
    moe_router: str = "softmax_then_topk"
    """'softmax_then_topk' (Switch, Mixtral) or 'topk_then_softmax'."""
    moe_normalize_top_k: bool = False
    """Rescale the kept top-k router probabilities to sum to 1 (Mixtral: True; Switch: False)."""
    moe_jitter_noise: float = 0.0
    """Training only: the router input is multiplied by U(1 - eps, 1 + eps)."""
    moe_dispatch: str = "capacity"
    """'capacity' (GShard/Switch: fixed slots per expert, overflow dropped, expert parallelism
    by the rules) or 'dropless' (sorted tokens, grouped matmul; no expert parallelism)."""
    moe_capacity_factor: float = 1.25
    """'capacity', training: slots per expert and sequence = ceil(factor * L * top_k / E)."""
    moe_eval_capacity_factor: float = 2.0
    """'capacity': the factor for eval, scoring and decoding."""
    moe_expert_capacity: int = 0
    """'capacity': fixed slots per expert and sequence in training and eval alike (HF Switch's
    `expert_capacity`), clipped to the sequence length; 0: from the capacity factors."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss (mean over MoE layers) in the training loss."""
    moe_z_loss_coef: float = 0.001
    """Weight of ST-MoE's router z-loss (mean over MoE layers) in the training loss."""
    moe_shared_experts: int = 0
    """Dense experts every token also goes through (their MLP is this many times mlp_dim)."""


@dataclasses.dataclass(frozen=True)
class T5Config(MoeFields):
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
    precision: str = "float32"
    """Mixed precision policy, e.g. 'params=bfloat16,compute=bfloat16,output=float32' (see
    precision.py; the masters default to fp32). Softmax, norms and the loss are fp32."""
    dtype: dataclasses.InitVar[str | None] = None
    """Deprecated spelling of `precision`'s compute dtype (t5x's `T5Config.dtype`)."""
    param_dtype: dataclasses.InitVar[str | None] = None
    """Deprecated spelling of `precision`'s params dtype (the masters stay fp32)."""
    one_hot_embedding: bool = False
    """Embed via one-hot matmul (vocab-parallel lookup when the table is vocab-sharded)."""
    scan_layers: bool = False
    remat_policy: RematPolicy = "none"
    pipeline_microbatches: int = 0
    """Microbatches per step when the rules split `layers` into pipeline stages (0: as many as
    stages); more shrink the bubble `(p - 1) / (m + p - 1)`; divides the batch."""
    pipeline_schedule: str = "gpipe"
    """The pipeline's schedule: 'gpipe' (all forward, then all backward: model/pipeline.py) or
    '1f1b' (forwards and backwards interleaved, `p` microbatches in flight: model/schedules.py)."""
    tie_logits: bool | None = None
    """Logits via the input embedding; None: the variant's choice (tied for 't5.1.0', a separate
    `logits_dense` for 't5.1.1'). transformers 5.x saves T5.1.1 with a tied head."""
    scale_logits: bool | None = None
    """With tied logits, multiply the decoder output by D**-0.5 (HF `scale_decoder_outputs`);
    None: the variant's choice (True for 't5.1.0')."""
    attention_implementation: str = "xla"
    """The attention core's implementation: 'xla', 'cudnn' (NVIDIA GPUs) or 'auto' (see
    model/attention.py); decoding through the KV cache always runs 'xla'."""

    # Uniform interface shared with DecoderOnlyConfig, read by the layer classes.
    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def mlp_activations(self) -> tuple[str, ...]:
        return ("relu",) if self.variant == "t5.1.0" else ("gelu", "linear")

    @property
    def logits_via_embedding(self) -> bool:
        return self.variant == "t5.1.0" if self.tie_logits is None else self.tie_logits

    @property
    def scale_tied_logits(self) -> bool:
        # T5.1.0 divides its tied logits by sqrt(D), as HF does.
        if self.scale_logits is None:
            return self.variant == "t5.1.0" and self.logits_via_embedding
        return self.scale_logits

    @property
    def use_rope(self) -> bool:
        return False  # T5 positions are relative-position biases

    @property
    def rope_theta(self) -> float:
        return 10000.0  # unused (no RoPE); read by the shared attention layer

    @property
    def scale_attn_logits(self) -> bool:
        return False  # T5 folds 1/sqrt(K) into the query initialisation

    @property
    def policy(self) -> Precision:
        return Precision.parse(self.precision)

    def __post_init__(self, dtype: str | None, param_dtype: str | None) -> None:
        _set_precision(self, dtype, param_dtype)
        if self.variant not in ("t5.1.1", "t5.1.0"):
            raise ValueError(f"T5Config.variant must be 't5.1.1' or 't5.1.0', got {self.variant!r}")
        if self.scale_tied_logits and not self.logits_via_embedding:
            # NOTE: HF scales only in front of its tied head; an untied scaled head is not T5.
            raise ValueError("T5Config: scale_logits=True needs tied logits (tie_logits=True)")
        _check_remat(self.remat_policy)
        _check_pipeline(self)
        _check_attention(self, relative_bias=True)
        _check_moe(self, max(self.num_encoder_layers, self.num_decoder_layers))


@dataclasses.dataclass(frozen=True)
class DecoderOnlyConfig(MoeFields):
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
    rope_scaling: RopeScaling = "none"
    """RoPE frequency scaling for long contexts (HF `rope_scaling`): 'linear' divides every
    frequency by `rope_scaling_factor`; 'llama3' (Llama 3.1+) divides the frequencies whose
    wavelength exceeds `rope_original_max_position / rope_low_freq_factor` by it, keeps those
    below `rope_original_max_position / rope_high_freq_factor` and interpolates in between."""
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    """'llama3': the context length (tokens) the model was pre-trained with."""
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
    precision: str = "float32"
    """Mixed precision policy (see T5Config.precision)."""
    dtype: dataclasses.InitVar[str | None] = None
    param_dtype: dataclasses.InitVar[str | None] = None
    one_hot_embedding: bool = False
    scan_layers: bool = False
    remat_policy: RematPolicy = "none"
    pipeline_microbatches: int = 0
    """Microbatches per step when the rules split `layers` into pipeline stages (0: as many as
    stages); more shrink the bubble `(p - 1) / (m + p - 1)`; divides the batch."""
    pipeline_schedule: str = "gpipe"
    """The pipeline's schedule: 'gpipe' (all forward, then all backward: model/pipeline.py) or
    '1f1b' (forwards and backwards interleaved, `p` microbatches in flight: model/schedules.py)."""
    attention_implementation: str = "xla"
    """The attention core's implementation: 'xla', 'cudnn' (NVIDIA GPUs) or 'auto' (see
    model/attention.py); decoding through the KV cache always runs 'xla'."""
    moe_top_k: int = 2
    """Experts per token (Mixtral's 2; see MoeFields)."""
    moe_normalize_top_k: bool = True
    """Rescale the kept top-k router probabilities to sum to 1 (Mixtral's; see MoeFields)."""

    @property
    def policy(self) -> Precision:
        return Precision.parse(self.precision)

    def __post_init__(self, dtype: str | None, param_dtype: str | None) -> None:
        _set_precision(self, dtype, param_dtype)
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
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(
                f"rope_scaling must be one of {ROPE_SCALINGS}, got {self.rope_scaling!r}"
            )
        low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
        if self.rope_scaling == "llama3" and high <= low:
            raise ValueError(
                f"rope_high_freq_factor ({self.rope_high_freq_factor}) must exceed "
                f"rope_low_freq_factor ({self.rope_low_freq_factor})"
            )
        _check_remat(self.remat_policy)
        _check_pipeline(self)
        _check_attention(self, relative_bias=self.position_embedding == "relative")
        _check_moe(self, self.num_layers)

    @property
    def mlp_activations(self) -> tuple[str, ...]:
        return (self.mlp_activation, "linear")

    @property
    def use_rope(self) -> bool:
        return self.position_embedding == "rope"


AnyConfig = T5Config | DecoderOnlyConfig


PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
"""What `pipeline_schedule` accepts (see model/pipeline.py)."""


def _check_pipeline(cfg: AnyConfig) -> None:
    name = type(cfg).__name__
    if cfg.pipeline_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"{name}.pipeline_schedule must be one of {PIPELINE_SCHEDULES}, got "
            f"{cfg.pipeline_schedule!r}"
        )
    if cfg.pipeline_microbatches < 0:
        raise ValueError(
            f"{name}.pipeline_microbatches must be >= 0 (0: one per stage), got "
            f"{cfg.pipeline_microbatches}"
        )


def _check_remat(policy: str) -> None:
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy must be one of {REMAT_POLICIES}, got {policy!r}")


def _check_attention(cfg: AnyConfig, relative_bias: bool) -> None:
    """One line when `attention_implementation` is unknown or refuses what this network needs
    in every call (each call's shapes are checked when it runs)."""
    features = attention.Features(
        dtype=cfg.policy.compute,
        bias=relative_bias,
        dropout=cfg.dropout_rate > 0.0,
        head_dim=cfg.head_dim,
    )
    setting = f"{type(cfg).__name__}.attention_implementation"
    attention.check_implementation(cfg.attention_implementation, features, setting)


def is_moe_layer(cfg: AnyConfig, index: int) -> bool:
    """Whether layer `index` (from 0, encoder and decoder alike) has a mixture-of-experts MLP."""
    return cfg.num_experts > 0 and (index + 1) % cfg.moe_every == 0


def _check_moe(cfg: AnyConfig, num_layers: int) -> None:
    """One line naming the setting for a mixture-of-experts option out of range."""
    name = type(cfg).__name__
    if cfg.num_experts < 0:
        raise ValueError(f"{name}.num_experts must be >= 0 (0: dense), got {cfg.num_experts}")
    if not cfg.num_experts:
        return
    if not 1 <= cfg.moe_top_k <= cfg.num_experts:
        raise ValueError(
            f"{name}.moe_top_k={cfg.moe_top_k} must be between 1 and num_experts={cfg.num_experts}"
        )
    if not 1 <= cfg.moe_every <= num_layers:
        raise ValueError(
            f"{name}.moe_every={cfg.moe_every} must be between 1 and the number of layers "
            f"({num_layers})"
        )
    for field in ("moe_capacity_factor", "moe_eval_capacity_factor"):
        if getattr(cfg, field) <= 0:
            raise ValueError(f"{name}.{field} must be > 0, got {getattr(cfg, field)}")
    if cfg.moe_expert_capacity < 0:
        raise ValueError(
            f"{name}.moe_expert_capacity must be >= 0 (0: from the capacity factors), got "
            f"{cfg.moe_expert_capacity}"
        )
    if cfg.moe_dispatch not in MOE_DISPATCHES:
        raise ValueError(
            f"{name}.moe_dispatch must be one of {MOE_DISPATCHES}, got {cfg.moe_dispatch!r}"
        )
    if cfg.moe_router not in MOE_ROUTERS:
        raise ValueError(f"{name}.moe_router must be one of {MOE_ROUTERS}, got {cfg.moe_router!r}")
    if not 0.0 <= cfg.moe_jitter_noise < 1.0:
        raise ValueError(f"{name}.moe_jitter_noise must be in [0, 1), got {cfg.moe_jitter_noise}")
    if cfg.moe_shared_experts < 0:
        raise ValueError(f"{name}.moe_shared_experts must be >= 0, got {cfg.moe_shared_experts}")
    if cfg.scan_layers and cfg.moe_every > 1:
        # Scanned layers must be identical; a scanned group of moe_every layers would change
        # the parameter tree that scan_params, checkpoints and hf/ read.
        raise ValueError(
            f"{name}.moe_every={cfg.moe_every} needs scan_layers=False (scanned layers are "
            "identical: use moe_every=1 to scan a mixture-of-experts model)"
        )


def config_record(config: AnyConfig) -> dict[str, Any]:
    """The JSON record of a network config that every checkpoint keeps (`extra.json`)."""
    return {"type": type(config).__name__, **dataclasses.asdict(config)}


def config_from_record(record: dict[str, Any]) -> AnyConfig:
    """The network config of a checkpoint's record (`config_record`)."""
    fields = dict(record)
    kind = fields.pop("type")
    types = {"T5Config": T5Config, "DecoderOnlyConfig": DecoderOnlyConfig}
    if kind not in types:
        raise ValueError(f"unknown network config type {kind!r}")
    return types[kind](**fields)


def _set_precision(cfg: AnyConfig, dtype: str | None, param_dtype: str | None) -> None:
    """Canonical `precision`, with the old `dtype` / `param_dtype` fields folded in."""
    try:
        policy = Precision.parse(cfg.precision).replace(compute=dtype, params=param_dtype)
    except ValueError as e:
        raise ValueError(f"{type(cfg).__name__}: {e}") from None
    object.__setattr__(cfg, "precision", str(policy))
