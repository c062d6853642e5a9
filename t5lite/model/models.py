"""Model wrappers around the networks: loss, eval metrics, scoring and prediction (t5x BaseModel).

A model owns a network, an optimizer definition and the loss settings. Everything here is a pure
function of (params, batch), so the trainer can partition it; nothing here names a mesh axis.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5lite.model import decoding, layers, losses, moe, network
from t5lite.model.kv_cache import set_cache_index, zero_cache
from t5lite.model.lora import BASE_PATTERN, LoRA, add_adapters, merge
from t5lite.model.optimizers import AdamW, FrozenParams, Optimizer

Array = jax.Array
Batch = Mapping[str, Array]
PyTree = Any

# Logical axes of every model feature (all are [batch, length]).
FEATURE_AXES = ("batch", "length")
DECODING_METHODS = ("greedy", "sample", "beam")


@dataclasses.dataclass(frozen=True)
class BaseModel(abc.ABC):
    """Shared loss/metric logic. Subclasses say how a batch is fed to their network."""

    network_config: Any
    optimizer: Optimizer = AdamW()  # noqa: RUF009 (frozen: safe to share)
    z_loss: float = 1e-4  # T5.1.1's auxiliary z-loss coefficient
    label_smoothing: float = 0.0
    loss_normalization: str | float = "per_real_token"
    """How the summed token loss is normalised: 'per_real_token' (weighted tokens), 'sum',
    'per_total_token' (all target positions, padding included), 'per_sequence', or a constant
    (t5x's numeric `loss_normalizing_factor`, e.g. 233472 for T5.1.1 fine-tuning). t5x's
    `SpecialLossNormalizingFactor` names are accepted too; see `losses.canonical_normalization`."""
    decoding_method: str = "greedy"
    """How `predict_batch` decodes: 'greedy', 'sample' (temperature, top_k, top_p,
    num_decodes, min_log_prob) or 'beam' (beam_size, alpha); see decoding.py."""
    temperature: float = 1.0
    """'sample': logits are divided by it (0: greedy)."""
    top_k: int = 0
    """'sample': keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """'sample': keep the smallest nucleus of this probability mass (1.0: all)."""
    num_decodes: int = 1
    """'sample': samples per example; the most likely is returned unless all are asked for."""
    min_log_prob: float | None = None
    """'sample': a sample stops once its log-probability falls below this; 'beam': a row stops
    once no live beam's log-probability is at or above it (t5x's `min_log_prob`). None: never."""
    beam_size: int = 4
    """'beam': beams per example."""
    alpha: float = 0.6
    """'beam': brevity penalty exponent, ((5 + length) / 6) ** alpha."""
    brevity_counts_prompt: bool = False
    """'beam': the penalty's length counts the prompt too, as t5x's (decoder-only prompts; see
    `decoding.beam_search`); False: the generated tokens only."""
    decode_order: str = "best_first"
    """Order of all decodes (`return_all_decodes`): 'best_first' ([:, 0] is the best, as HF's
    generate) or 'best_last' (t5x's ascending scores, [:, -1] is the best; beam search then
    breaks equal scores as t5x does, see `decoding.beam_search`)."""
    eos_id: int = decoding.EOS_ID
    """The model's end-of-sequence id: a row stops after generating it (t5x/T5: 1)."""
    pad_id: int = decoding.PAD_ID
    """The model's padding id: written after EOS; "no token" in prompts (t5x/T5: 0)."""
    decoder_start_token_id: int = decoding.DECODER_START_ID
    """The first token fed to the decoder (BOS; t5x/T5: 0, the same as padding)."""
    lora: LoRA | None = None
    """Low-rank adapters (see lora.py): only the adapters train; the base is frozen by
    wrapping `optimizer` in `FrozenParams`, so it gets no optimizer state."""

    def __post_init__(self) -> None:
        if self.lora is not None:
            opt = self.optimizer
            if not isinstance(opt, FrozenParams):
                opt = FrozenParams(opt, ())
            if BASE_PATTERN not in opt.patterns:
                opt = FrozenParams(opt.optimizer, (*opt.patterns, BASE_PATTERN))
            object.__setattr__(self, "optimizer", opt)
        # Canonical form up front, so a typo fails at configuration time, not in the jit.
        object.__setattr__(
            self, "loss_normalization", losses.canonical_normalization(self.loss_normalization)
        )
        if self.decoding_method not in DECODING_METHODS:
            raise ValueError(
                f"decoding_method must be one of {DECODING_METHODS}, got {self.decoding_method!r}"
            )
        if self.decode_order not in decoding.ORDERS:
            raise ValueError(
                f"decode_order must be one of {decoding.ORDERS}, got {self.decode_order!r}"
            )
        if self.num_decodes < 1 or self.beam_size < 1:
            raise ValueError(
                f"num_decodes ({self.num_decodes}) and beam_size ({self.beam_size}) must be >= 1"
            )

    # --- to be provided by subclasses -----------------------------------------------------
    FEATURES: ClassVar[tuple[str, ...]] = ()
    FEATURE_CONVERTER: ClassVar[str] = ""
    """The seqio_lite feature converter whose output features this model reads (see
    `feature_converter_name`, which a model field may override)."""

    @property
    def feature_converter_name(self) -> str:
        """The seqio_lite feature converter this model reads: 'enc_dec', 'lm' or 'prefix_lm'."""
        return self.FEATURE_CONVERTER

    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The Flax network."""

    def _logits(self, params: PyTree, batch: Batch, dropout_rng: Array | None) -> Array:
        """Teacher-forced fp32 logits [B, L, V]; dropout on when `dropout_rng` is given."""
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        return self.module().apply(
            {"params": self.forward_params(params)},
            **self._inputs(batch),
            enable_dropout=dropout_rng is not None,
            rngs=rngs,
        )

    def forward_params(self, params: PyTree) -> PyTree:
        """The stored (master) parameters as the network computes with them: cast to the
        precision policy's params dtype, with LoRA factors merged into their kernels. Every
        loss, score and decode goes through here."""
        if self.lora is not None:
            params = merge(self.lora, params)
        return self.network_config.policy.cast_params(params)

    @abc.abstractmethod
    def dummy_batch(self, batch_size: int, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        """Zero features of the right shapes, e.g. for initialisation and AOT compilation."""

    # --- shared -----------------------------------------------------------------------------

    def init(self, rng: Array, batch: Batch) -> PyTree:
        """Flax variables (boxed with logical axes) for batches shaped like `batch`."""
        variables = self.module().init(
            {"params": rng, "dropout": rng}, **self._inputs(batch), enable_dropout=False
        )
        if self.lora is None:
            return variables
        lora_rng = jax.random.fold_in(rng, 0x10A)
        return {**variables, "params": add_adapters(self.lora, variables["params"], lora_rng)}

    def _inputs(self, batch: Batch) -> dict[str, Array]:
        return {k: batch[k] for k in self.FEATURES if k in batch and k in self._INPUT_NAMES}

    _INPUT_NAMES: ClassVar[tuple[str, ...]] = ()

    def loss_terms(
        self, params: PyTree, batch: Batch, dropout_rng: Array | None
    ) -> tuple[Array, dict[str, Array]]:
        """Loss numerator and summable metrics (loss = numerator / loss_denominator).

        With mixture-of-experts layers the weighted load-balancing and router z-losses (means
        over the MoE layers, per batch) are added as `coef * loss * max(loss_denominator, 1)`,
        so they reach the normalised loss unscaled. The metrics `moe_aux_loss_sum`,
        `moe_z_loss_sum`, `moe_dropped_sum`, `moe_load_imbalance_sum` and, per MoE layer,
        `moe/<layer>/load_e<i>_sum` and `moe/<layer>/load_max_over_mean_sum` carry them times
        `weight_sum`, so that they add up over microbatches and batches like `loss_sum`
        (`trainer.summarize` divides by `weight_sum`).
        """
        cfg = self.network_config
        if not getattr(cfg, "num_experts", 0):
            return self._token_loss_terms(self._logits(params, batch, dropout_rng), batch)
        rngs = {"dropout": dropout_rng} if dropout_rng is not None else {}
        logits, state = self.module().apply(
            {"params": self.forward_params(params)},
            **self._inputs(batch),
            enable_dropout=dropout_rng is not None,
            rngs=rngs,
            mutable=["intermediates"],
        )
        numerator, metrics = self._token_loss_terms(logits, batch)
        stats = moe.collect_stats(state.get("intermediates", {}))
        if stats is None:
            return numerator, metrics
        scale = jax.lax.stop_gradient(jnp.maximum(metrics["loss_denominator"], 1.0))
        aux = cfg.moe_aux_loss_coef * stats.aux_loss + cfg.moe_z_loss_coef * stats.z_loss
        moe_metrics = {
            "moe_aux_loss": stats.aux_loss,
            "moe_z_loss": stats.z_loss,
            "moe_dropped": stats.dropped_fraction,
            "moe_load_imbalance": stats.load_imbalance,
            **moe.layer_metrics(stats),
        }
        weight = jax.lax.stop_gradient(metrics["weight_sum"])
        metrics = {**metrics, **{f"{k}_sum": v * weight for k, v in moe_metrics.items()}}
        return numerator + aux * scale, metrics

    def _token_loss_terms(self, logits: Array, batch: Batch) -> tuple[Array, dict[str, Array]]:
        return losses.cross_entropy_terms(
            logits,
            batch["decoder_target_tokens"],
            batch.get("decoder_loss_weights"),
            z_loss=self.z_loss,
            label_smoothing=self.label_smoothing,
            normalization=self.loss_normalization,
            segment_ids=batch.get("decoder_segment_ids"),
        )

    def loss_fn(
        self, params: PyTree, batch: Batch, dropout_rng: Array | None
    ) -> tuple[Array, dict[str, Array]]:
        """Training loss (normalised as configured) and summable metrics."""
        numerator, metrics = self.loss_terms(params, batch, dropout_rng)
        return numerator / jnp.maximum(metrics["loss_denominator"], 1.0), metrics

    def eval_fn(self, params: PyTree, batch: Batch) -> dict[str, Array]:
        """Summable eval metrics (no dropout)."""
        _, metrics = self.loss_fn(params, batch, None)
        return metrics

    def score_batch(self, params: PyTree, batch: Batch) -> Array:
        """Log-likelihood of each example's weighted targets, [B] (per row; unpacked batches)."""
        logits = self._logits(params, batch, None).astype(jnp.float32)
        targets = batch["decoder_target_tokens"]
        weights = batch.get("decoder_loss_weights")
        weights = (targets > 0) if weights is None else weights
        token_loss, _ = losses.cross_entropy_with_logits(logits, targets, 0.0)
        return -jnp.sum(token_loss * weights, axis=-1)

    # --- prediction ---------------------------------------------------------------------------

    def predict_batch(
        self,
        params: PyTree,
        batch: Batch,
        rng: Array | None = None,
        *,
        max_decode_length: int | None = None,
    ) -> Array:
        """Decoded ids [B, max_decode_length] (`pad_id` after EOS); see `predict_batch_with_aux`."""
        decodes, _ = self.predict_batch_with_aux(
            params, batch, rng, max_decode_length=max_decode_length
        )
        return decodes

    @abc.abstractmethod
    def predict_batch_with_aux(
        self,
        params: PyTree,
        batch: Batch,
        rng: Array | None = None,
        *,
        max_decode_length: int | None = None,
        return_all_decodes: bool = False,
        decoder_params: Mapping[str, Any] | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """Decodes with the KV cache by `decoding_method`.

        Args:
          params: the parameters.
          batch: model features (unpacked rows).
          rng: PRNG key for sampling (default PRNGKey(0)).
          max_decode_length: tokens to generate at most per row (and the output length).
          return_all_decodes: return every sample / beam, not just the best.
          decoder_params: per-call overrides of the model's decoding fields (t5x's
            `decoder_params`), which may be traced or per row [B]: 'temperature', 'top_p',
            'top_k' (static), 'min_log_prob' (sampling), 'max_decode_steps_hard_limit' and
            'rescale_log_probs' (greedy and sampling; static), 'alpha' (beam) and
            'max_decode_steps' (any method).

        Returns:
          (decodes, {"scores": ...}): ids [B, T] (or [B, N, T] with all decodes, in
          `decode_order`), and their log-probabilities (sampling) or beam scores (see
          `decoding.beam_search`), [B] or [B, N].
        """

    def _decodes_per_example(self) -> int:
        return {"greedy": 1, "sample": self.num_decodes, "beam": self.beam_size}[
            self.decoding_method
        ]

    def _decode(
        self,
        prompt_BL: Array,
        cache: PyTree,
        tokens_to_logits: decoding.TokensToLogits,
        rng: Array | None,
        initial_index: Array | None,
        max_decode_steps: int | None,
        decoder_params: Mapping[str, Any] | None,
    ) -> tuple[Array, Array]:
        """Runs `decoding_method` with this model's settings and ids, in `decode_order`."""
        method = self.decoding_method
        kwargs: dict[str, Any] = dict(
            initial_index=initial_index,
            max_decode_steps=max_decode_steps,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            decoder_start_token_id=self.decoder_start_token_id,
            order=self.decode_order,
        )
        if method == "beam":
            kwargs.update(
                beam_size=self.beam_size,
                alpha=self.alpha,
                min_log_prob=self.min_log_prob,
                brevity_counts_prompt=self.brevity_counts_prompt,
            )
        elif method == "sample":
            kwargs.update(
                decode_rng=rng,
                num_decodes=self.num_decodes,
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                min_log_prob=self.min_log_prob,
            )
        overrides = dict(decoder_params or {})
        unknown = sorted(set(overrides) - _DECODER_PARAMS[method])
        if unknown:
            raise ValueError(
                f"decoder_params {unknown} do not apply to decoding_method={method!r}; it takes "
                f"{sorted(_DECODER_PARAMS[method])}"
            )
        kwargs.update(overrides)
        fn = {
            "beam": decoding.beam_search,
            "greedy": decoding.greedy,
            "sample": decoding.temperature_sample,
        }[method]
        return fn(prompt_BL, cache, tokens_to_logits, **kwargs)

    def _best_or_all(
        self, sequences_BNL: Array, scores_BN: Array, return_all: bool
    ) -> tuple[Array, dict[str, Array]]:
        """Decodes in `decode_order` -> all of them, or the best alone."""
        if not return_all:
            best = -1 if self.decode_order == "best_last" else 0  # t5x: ascending scores
            return sequences_BNL[:, best], {"scores": scores_BN[:, best]}
        return sequences_BNL, {"scores": scores_BN}


# What `predict_batch_with_aux(decoder_params=...)` may override, per decoding method.
_DECODER_PARAMS = {
    "greedy": {"max_decode_steps", "max_decode_steps_hard_limit", "rescale_log_probs"},
    "sample": {
        "max_decode_steps",
        "max_decode_steps_hard_limit",
        "rescale_log_probs",
        "temperature",
        "top_k",
        "top_p",
        "min_log_prob",
    },
    "beam": {"max_decode_steps", "alpha", "min_log_prob"},
}


@dataclasses.dataclass(frozen=True)
class EncoderDecoderModel(BaseModel):
    """T5-style model; features from seqio_lite's encoder-decoder feature converter."""

    network_config: network.T5Config = network.T5Config()  # noqa: RUF009
    FEATURES: ClassVar[tuple[str, ...]] = (
        "encoder_input_tokens",
        "decoder_input_tokens",
        "decoder_target_tokens",
        "decoder_loss_weights",
        "encoder_segment_ids",
        "decoder_segment_ids",
        "encoder_positions",
        "decoder_positions",
    )
    FEATURE_CONVERTER: ClassVar[str] = "enc_dec"
    _INPUT_NAMES: ClassVar[tuple[str, ...]] = (
        "encoder_input_tokens",
        "decoder_input_tokens",
        "decoder_target_tokens",
        "encoder_segment_ids",
        "decoder_segment_ids",
        "encoder_positions",
        "decoder_positions",
    )

    def module(self) -> network.EncoderDecoder:
        return network.EncoderDecoder(self.network_config)

    def dummy_batch(self, batch_size: int, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        enc, dec = lengths["inputs"], lengths["targets"]
        return {
            k: np.zeros((batch_size, enc if k.startswith("encoder") else dec), np.int32)
            for k in self.FEATURES
        }

    def predict_batch_with_aux(
        self,
        params: PyTree,
        batch: Batch,
        rng: Array | None = None,
        *,
        max_decode_length: int | None = None,
        return_all_decodes: bool = False,
        decoder_params: Mapping[str, Any] | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """See `BaseModel.predict_batch_with_aux`; the encoder runs once, the decoder is cached.

        `max_decode_length` defaults to the batch's decoder length (the targets length).
        """
        module = self.module()
        params = self.forward_params(params)
        enc_BS = batch["encoder_input_tokens"]
        b = enc_BS.shape[0]
        length = max_decode_length or batch["decoder_input_tokens"].shape[1]
        encoded_BSD = module.apply(
            {"params": params}, enc_BS, enable_dropout=False, method=module.encode
        )

        def call(cache: PyTree, enc: Array, tokens: Array, cross: PyTree = None):
            # Without `cross` (the cross-attention keys/values) the call computes and returns
            # them in the CROSS_CACHE collection; with it, they are read, not recomputed.
            variables = {"params": params, **({"cache": cache} if cache is not None else {})}
            if cross is not None:
                variables[layers.CROSS_CACHE] = cross
            mutable = ["cache"] if cross is not None else ["cache", layers.CROSS_CACHE]
            return module.apply(
                variables,
                encoded_BSD,
                enc,
                tokens,
                enable_dropout=False,
                decode=True,
                max_decode_length=length,
                method=module.decode,
                mutable=mutable,
            )

        cache = zero_cache(lambda: call(None, enc_BS, jnp.zeros((b, length), jnp.int32)))
        # The cross-attention keys/values of every decoder layer, projected once before the
        # loop (t5x projects them again at every step): of this step only the projections are
        # used, XLA drops the rest of it.
        cross = call(cache, enc_BS, jnp.zeros((b, 1), jnp.int32))[1][layers.CROSS_CACHE]
        # NOTE: they are stored transposed to the layouts the step's matmuls read; the barrier
        # keeps XLA from cancelling that transpose against the one back in the step, which
        # would move the transposes into the loop (one copy per step and layer).
        cross = jax.lax.optimization_barrier(cross)
        # Samples / beams of one example share its encoding: its tokens (the cross-attention
        # mask) are repeated once, up front; its keys/values are not: the n decodes attend to
        # one copy (see `MultiHeadAttention._shared_kv_attention` in layers.py).
        enc_n = decoding.expand_batch(enc_BS, self._decodes_per_example())

        def tokens_to_logits(state: decoding.DecodingState) -> tuple[Array, PyTree]:
            logits_B1V, variables = call(state.cache, enc_n, state.cur_token, cross)
            return logits_B1V[:, -1], variables["cache"]

        prompt_BL = jnp.full((b, length), self.pad_id, jnp.int32)  # no prompt: BOS only
        sequences, scores = self._decode(
            prompt_BL, cache, tokens_to_logits, rng, None, None, decoder_params
        )
        return self._best_or_all(sequences, scores, return_all_decodes)


@dataclasses.dataclass(frozen=True)
class DecoderOnlyModel(BaseModel):
    """Decoder-only LM (or prefix-LM); features from the LM / prefix-LM feature converters."""

    network_config: network.DecoderOnlyConfig = network.DecoderOnlyConfig()  # noqa: RUF009
    feature_converter: str = "lm"
    """'lm': a language model on `targets` (tasks with `inputs` are refused, not silently
    truncated); 'prefix_lm': `inputs ++ targets` with bidirectional attention over the inputs
    and the loss on the targets (seqio's `PrefixLMFeatureConverter`), so the model is trained
    and prompted with the inputs."""
    inputs_bidirectional_attention: bool = True
    """The inputs part of a row (marked by `decoder_causal_attention`) attends bidirectionally
    within itself (prefix-LM); False: every position attends causally (a causal LM such as
    Llama). One rule for the loss, scoring and decoding (see `_inputs`)."""
    FEATURES: ClassVar[tuple[str, ...]] = (
        "decoder_input_tokens",
        "decoder_target_tokens",
        "decoder_loss_weights",
        "decoder_segment_ids",
        "decoder_positions",
        "decoder_causal_attention",
    )
    FEATURE_CONVERTERS: ClassVar[tuple[str, ...]] = ("lm", "prefix_lm")
    _INPUT_NAMES: ClassVar[tuple[str, ...]] = (
        "decoder_input_tokens",
        "decoder_target_tokens",
        "decoder_segment_ids",
        "decoder_positions",
        "decoder_causal_attention",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_converter not in self.FEATURE_CONVERTERS:
            raise ValueError(
                f"DecoderOnlyModel.feature_converter = {self.feature_converter!r}: must be one "
                f"of {list(self.FEATURE_CONVERTERS)}"
            )

    @property
    def feature_converter_name(self) -> str:
        return self.feature_converter

    def _inputs(self, batch: Batch) -> dict[str, Array]:
        # The one attention rule for the loss, scoring and decoding's prefill: the prompt
        # marked by `decoder_causal_attention` attends bidirectionally only if the model says so.
        inputs = super()._inputs(batch)
        if not self.inputs_bidirectional_attention:
            inputs.pop("decoder_causal_attention", None)
        return inputs

    def module(self) -> network.DecoderOnly:
        return network.DecoderOnly(self.network_config)

    def dummy_batch(self, batch_size: int, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
        length = lengths["targets"] + lengths.get("inputs", 0)
        features = self.FEATURES
        if self.feature_converter == "lm":
            # The LM converter marks no prompt: without the feature the attention is causal by
            # construction (not a causal mask OR an all-false prefix), which the fused kernels
            # can skip blocks for (cuDNN, splash) rather than read as a whole mask.
            features = tuple(k for k in features if k != "decoder_causal_attention")
        return {k: np.zeros((batch_size, length), np.int32) for k in features}

    def predict_batch_with_aux(
        self,
        params: PyTree,
        batch: Batch,
        rng: Array | None = None,
        *,
        max_decode_length: int | None = None,
        return_all_decodes: bool = False,
        decoder_params: Mapping[str, Any] | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """See `BaseModel.predict_batch_with_aux`: continues each row's prompt.

        The prompt is the inputs part of a prefix-LM row, marked by `decoder_causal_attention`
        (1 on `[BOS, inputs...]`); it is prefilled into the KV cache in one pass (attending
        bidirectionally when `inputs_bidirectional_attention`, as in training), then each row
        decodes from its own prompt length. Without `decoder_causal_attention` (plain LM) there
        is no prompt. Decodes are the continuations only, left-aligned; they end at EOS, after
        `max_decode_length` tokens (default: the row length) or at the end of the row.
        """
        module = self.module()
        params = self.forward_params(params)
        tokens_BL = batch["decoder_input_tokens"]
        b, length = tokens_BL.shape
        causal_BL = batch.get("decoder_causal_attention")

        def call(cache: PyTree, tokens: Array, causal: Array | None = None):
            variables = {"params": params, **({"cache": cache} if cache is not None else {})}
            return module.apply(
                variables,
                tokens,
                decoder_causal_attention=causal,
                enable_dropout=False,
                decode=True,
                max_decode_length=length,
                mutable=["cache"],
            )

        cache = zero_cache(lambda: call(None, jnp.zeros((b, length), jnp.int32)))
        if causal_BL is None:
            initial_B = jnp.zeros((b,), jnp.int32)
            prompt_BL = jnp.full_like(tokens_BL, self.pad_id)
        else:
            # `decoder_causal_attention` covers BOS + inputs: the last input is at index n.
            initial_B = jnp.maximum(jnp.sum(causal_BL, axis=1) - 1, 0).astype(jnp.int32)
            prompt_BL = jnp.where(causal_BL > 0, tokens_BL, self.pad_id)
            prompt_BL = prompt_BL.at[:, 0].set(self.decoder_start_token_id)
            bidirectional_BL = self._inputs(batch).get("decoder_causal_attention")
            _, variables = call(cache, prompt_BL, bidirectional_BL)
            # The prefill wrote all L positions; each row resumes at its last prompt token
            # (re-fed, so the first step yields the first target). Later positions are masked
            # until overwritten.
            cache = set_cache_index(variables["cache"], initial_B)

        def tokens_to_logits(state: decoding.DecodingState) -> tuple[Array, PyTree]:
            logits_B1V, variables = call(state.cache, state.cur_token)
            return logits_B1V[:, -1], variables["cache"]

        sequences_BNL, scores_BN = self._decode(
            prompt_BL, cache, tokens_to_logits, rng, initial_B, max_decode_length, decoder_params
        )
        # Drop the prompt: continuation token j of row b sits at target position j + n_b.
        out_len = max_decode_length or length
        src_BT = initial_B[:, None] + jnp.arange(out_len)[None]
        gathered = jnp.take_along_axis(
            sequences_BNL, jnp.clip(src_BT, 0, length - 1)[:, None, :], axis=2
        )
        continuation_BNT = jnp.where((src_BT < length)[:, None, :], gathered, self.pad_id)
        return self._best_or_all(continuation_BNT, scores_BN, return_all_decodes)
