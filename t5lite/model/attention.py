"""The attention core: `dot_product_attention`, one function with named implementations.

Every attention layer (`layers.MultiHeadAttention`, also inside context parallelism's
shard_map, `context_parallel.context_parallel_attention`) reaches the core through this function;
the network config's `attention_implementation` names which implementation runs it.

- `xla`: two einsums around a materialised fp32 `[B, G, R, L, S]` score tensor; takes every
  feature (additive bias, any boolean mask, grouped-query heads, dropout, any dtype).
- `cudnn`: cuDNN's fused (flash) attention on NVIDIA GPUs, through
  `jax.nn.dot_product_attention(..., implementation='cudnn')`. Takes causal masks (as
  `is_causal`), padding (as row lengths: padding at the end of a row), packed segments and
  prefix-LM masks (cuDNN adds those as a bias in the inputs' dtype) and grouped-query heads.
  Refuses, in one line naming the feature and `xla`: an additive bias
  (T5's relative positions), dropout, inputs that are not bfloat16 / float16, a head width
  that is not a multiple of 8 or above 256, a mask over an odd query or key length (cuDNN
  trains with a bias only over even lengths). A query that may attend to no key (a padding
  position) gets the mean of all values from `xla`; `cudnn` need not agree there, and no loss
  reads such a position.
- `auto`: `cudnn` when the default backend is a CUDA GPU and the call has nothing `cudnn`
  refuses, else `xla`.

Decoding through the KV cache (and the shared cross-attention cache) always runs `xla`.

Shape letters: B=batch, L=query length, S=key length, H=heads, G=kv_heads, R=H // G,
K=kv (head width).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from t5lite import collectives
from t5lite.model import splash
from t5lite.model.chunked_attention import chunked_attention
from t5lite.model.masks import MASK_VALUE, MaskParts

Array = jax.Array
DType = Any

Mask = Array | MaskParts | None
"""A boolean mask [B or 1, 1, L, S] (True: attend), the same mask by its parts, or none."""


@dataclasses.dataclass(frozen=True)
class Features:
    """What one attention call asks of an implementation (None: not known yet, e.g. from a
    config before any call)."""

    dtype: np.dtype
    """Of the queries, keys and values (the precision policy's compute dtype)."""
    bias: bool = False
    """An additive logit bias (T5's relative position bias)."""
    dropout: bool = False
    """Dropout on the attention weights (training with `dropout_rate > 0`)."""
    head_dim: int | None = None
    lengths: tuple[int, int] | None = None
    """(L, S) of a call with a mask."""
    mask: str | None = None
    """'none', 'dense' (a boolean array: the KV cache's decode steps) or 'parts' (`MaskParts`)."""
    prefix: bool = False
    """A prefix-LM's bidirectional prefix (a per-row mask)."""


def _dense(mask: Mask, length_q: int, length_kv: int) -> Array | None:
    return mask.dense(length_q, length_kv) if isinstance(mask, MaskParts) else mask


def _xla(
    q_BLHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    bias_bHLS: Array | None,
    mask: Mask,
    *,
    dropout_rate: float,
    dropout_rng: Array | None,
    dtype: DType,
) -> Array:
    """Einsum attention: logits, bias, masking and softmax in fp32, no logit scaling."""
    b, length, h, kd = q_BLHK.shape
    mask_B1LS = _dense(mask, length, k_BSGK.shape[1])
    g = k_BSGK.shape[2]
    r = h // g
    # Query head index h = g_idx * R + r_idx, as in HF `repeat_kv`.
    q_BLGRK = q_BLHK.reshape(b, length, g, r, kd)
    logits = jnp.einsum("blgrk,bsgk->bgrls", q_BLGRK, k_BSGK, preferred_element_type=jnp.float32)
    if bias_bHLS is not None:
        bias = bias_bHLS.astype(jnp.float32)
        logits = logits + bias.reshape(bias.shape[0], g, r, *bias.shape[2:])
    if mask_B1LS is not None:
        logits = jnp.where(mask_B1LS[:, :, None], logits, MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1)
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("bgrls,bsgk->blgrk", weights.astype(dtype), v_BSGK.astype(dtype))
    return out.reshape(b, length, h, kd)


def fused_attention(
    q_BLHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    bias_bHLS: Array | None,
    mask: Mask,
    *,
    implementation: str | None,
) -> Array:
    """`jax.nn.dot_product_attention` on t5lite's conventions: queries come scaled (scale 1),
    query head h reads key/value head h // R, masks are boolean [B or 1, 1, L, S] or by parts.

    A causal mask without a prefix is passed as `is_causal` (cuDNN then skips the blocks above
    the diagonal). Padding without packed segments is passed as each row's length, the count of
    its valid positions (t5lite's pipelines pad at the end of a row: `trim_and_pad`), and only
    what remains (segments, a prefix) as a boolean mask: cuDNN adds a boolean mask to the scores
    as a bias tensor it reads in every block, which made its kernels 2x slower on an H200
    (docs/performance.md).

    `cudnn` calls this with `implementation='cudnn'`; with `None` or `'xla'` it is JAX's own
    einsum path, which the tests compare with `_xla` on CPU."""
    length_q, length_kv = q_BLHK.shape[1], k_BSGK.shape[1]
    is_causal = isinstance(mask, MaskParts) and mask.causal and mask.prefix_q is None
    if is_causal:
        mask = mask.without_causal()
    q_lengths = kv_lengths = None
    if isinstance(mask, MaskParts) and mask.valid_q is not None and mask.segment_q is None:
        q_lengths = jnp.sum(mask.valid_q, axis=1, dtype=jnp.int32)
        kv_lengths = jnp.sum(mask.valid_kv, axis=1, dtype=jnp.int32)
        mask = dataclasses.replace(mask, valid_q=None, valid_kv=None, whole=None)
    return jax.nn.dot_product_attention(
        q_BLHK,
        k_BSGK,
        v_BSGK,
        bias_bHLS,
        _dense(mask, length_q, length_kv),
        scale=1.0,
        is_causal=is_causal,
        query_seq_lengths=q_lengths,
        key_value_seq_lengths=kv_lengths,
        implementation=implementation,
    )


def _cudnn(
    q_BLHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    bias_bHLS: Array | None,
    mask: Mask,
    *,
    dropout_rate: float,
    dropout_rng: Array | None,
    dtype: DType,
) -> Array:
    """cuDNN's fused attention (`_cudnn_refuses` has ruled out bias and dropout)."""
    del bias_bHLS, dropout_rate, dropout_rng
    out = fused_attention(q_BLHK, k_BSGK, v_BSGK, None, mask, implementation="cudnn")
    return out.astype(dtype)


def _chunked(q_BLHK, k_BSGK, v_BSGK, bias_bHLS, mask: Mask, *, dropout_rate, dropout_rng, dtype):
    """Flash-style attention in plain JAX (`chunked_attention.py`)."""
    del dropout_rate, dropout_rng
    parts = MaskParts() if mask is None else mask
    return chunked_attention(q_BLHK, k_BSGK, v_BSGK, bias_bHLS, parts, dtype=dtype)


def _splash(q_BLHK, k_BSGK, v_BSGK, bias_bHLS, mask: Mask, *, dropout_rate, dropout_rng, dtype):
    """TPU splash attention (`splash.py`), on each device's examples and heads (the
    partitioner cannot split a Pallas call)."""
    del bias_bHLS, dropout_rate, dropout_rng
    parts = MaskParts() if mask is None else mask
    (b, length, h, _), (s, g) = q_BLHK.shape, k_BSGK.shape[1:3]
    segment_q, segment_kv = splash.segments(parts, b, length, s)
    kernel = functools.partial(splash.splash_kernel, causal=parts.causal, dtype=dtype)
    q_axes = ("batch", "length", "heads", "kv")
    kv_axes = ("batch", "kv_length", "heads" if g == h else "kv_heads", "kv")
    return collectives.per_shard(
        kernel,
        (q_BLHK, k_BSGK, v_BSGK, segment_q, segment_kv),
        (q_axes, kv_axes, kv_axes, ("batch", "length"), ("batch", "kv_length")),
        q_axes,
        independent=("batch", "heads", "kv_heads"),
        aligned=(("heads", "kv_heads"),),
    )


def _xla_refuses(features: Features) -> str | None:
    del features
    return None


def _cudnn_refuses(f: Features) -> str | None:
    """Why cuDNN cannot run a call with these features (None: it can)."""
    if f.bias:
        return "cannot take an additive attention bias (T5's relative position bias)"
    if f.dropout:
        return "cannot apply attention dropout (dropout_rate > 0 in training)"
    if jnp.dtype(f.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"needs bfloat16 or float16 inputs (the compute dtype), got {jnp.dtype(f.dtype)}"
    if f.head_dim is not None and (f.head_dim % 8 or f.head_dim > 256):
        return f"needs a head_dim that is a multiple of 8 and at most 256, got {f.head_dim}"
    if f.lengths is not None and (f.lengths[0] % 2 or f.lengths[1] % 2):
        q_len, kv_len = f.lengths
        return f"cannot take a mask over an odd query or key length (L={q_len}, S={kv_len})"
    return None


def _needs_parts(f: Features, name: str) -> str | None:
    if f.mask == "dense":
        return (
            f"needs the mask by its parts, but got a whole one, as the KV cache's decode steps "
            f"and context parallelism (attention inside its shard_map) give ({name} is for "
            f"training, scoring and prefill without context parallelism)"
        )
    return None


def _chunked_refuses(f: Features) -> str | None:
    if f.dropout:
        return "cannot apply attention dropout (dropout_rate > 0 in training)"
    return _needs_parts(f, "chunked")


def _splash_refuses(f: Features) -> str | None:
    if f.prefix:
        return "cannot take a prefix-LM's bidirectional prefix (a per-row mask)"
    length_q, length_kv = f.lengths or (splash.GRANULE, splash.GRANULE)
    why = splash.unsupported(f.bias, length_q, length_kv, f.dropout)
    return f"cannot take {why}" if why else _needs_parts(f, "splash")


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def _on_cuda() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return "cuda" in jax.extend.backend.get_backend().platform_version.lower()


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute the attention core."""

    attend: Callable[..., Array]
    """`(q, k, v, bias, mask, *, dropout_rate, dropout_rng, dtype) -> out [B, L, H, K]`."""
    refuses: Callable[[Features], str | None]
    """Why it cannot take a call with these features, as a phrase (None: it can)."""
    runs_here: Callable[[], bool]
    """Whether the default backend can run it (what `auto` asks)."""


IMPLEMENTATIONS: dict[str, Implementation] = {
    "xla": Implementation(_xla, _xla_refuses, lambda: True),
    "cudnn": Implementation(_cudnn, _cudnn_refuses, _on_cuda),
    "chunked": Implementation(_chunked, _chunked_refuses, lambda: True),
    "splash": Implementation(_splash, _splash_refuses, _on_tpu),
}
"""The implementations by name (`auto` is not one: it picks one of them per call)."""
NAMES: tuple[str, ...] = ("xla", "cudnn", "chunked", "splash", "auto")
"""What `attention_implementation` accepts."""
_AUTO_ORDER = ("splash", "cudnn", "xla")
"""`auto` picks the first of these that runs here and takes the call."""


def check_implementation(
    name: str, features: Features, setting: str = "attention_implementation"
) -> None:
    """Raises one line when `name` is unknown or refuses `features`.

    Args:
      name: an `attention_implementation` value.
      features: what the calls will ask for (from a config, or one call).
      setting: what set it, for the message (e.g. 'DecoderOnlyConfig.attention_implementation').
    """
    if name not in NAMES:
        raise ValueError(f"{setting}={name!r} is not one of {', '.join(NAMES)}")
    if name == "auto":
        return
    why = IMPLEMENTATIONS[name].refuses(features)
    if why is not None:
        raise ValueError(f"{setting}={name!r} {why}; use 'xla'")


def resolve(name: str, features: Features) -> str:
    """The implementation that runs a call: `name` itself, or `auto`'s pick."""
    if name != "auto":
        return name
    for candidate in _AUTO_ORDER:
        impl = IMPLEMENTATIONS[candidate]
        if impl.runs_here() and impl.refuses(features) is None:
            return candidate
    return "xla"


def dot_product_attention(
    q_BLHK: Array,
    k_BSGK: Array,
    v_BSGK: Array,
    bias_bHLS: Array | None = None,
    mask: Mask = None,
    *,
    implementation: str = "xla",
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    dtype: DType = jnp.float32,
) -> Array:
    """Grouped-query dot-product attention (H = G * R; MHA when G == H).

    No logit scaling is applied here (Llama's 1/sqrt(K) is folded into the queries, T5's into
    the query initializer).

    Args:
      q_BLHK: queries [B, L, H, K]; k_BSGK, v_BSGK: keys and values [B, S, G, K].
      bias_bHLS: additive logit bias [1 or B, H, L, S] or None.
      mask: a boolean mask [B or 1, 1, L, S] (True: attend), the mask by its parts
        (`MaskParts`: what the network gives; the fused kernels need it), or None.
      implementation: a name in `NAMES` (see the module docstring).
      dropout_rate, dropout_rng, deterministic: dropout on the attention weights.
      dtype: the dtype of the weights x values product and of the output.

    Returns:
      [B, L, H, K] in `dtype`.
    """
    h, g = q_BLHK.shape[2], k_BSGK.shape[2]
    if h % g:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {g}")
    dropout = not deterministic and dropout_rate > 0.0
    if isinstance(mask, MaskParts) and mask.empty:
        mask = None
    features = Features(
        dtype=q_BLHK.dtype,
        bias=bias_bHLS is not None,
        dropout=dropout,
        head_dim=q_BLHK.shape[-1],
        lengths=None if mask is None else (q_BLHK.shape[1], k_BSGK.shape[1]),
        mask="none" if mask is None else "parts" if isinstance(mask, MaskParts) else "dense",
        prefix=isinstance(mask, MaskParts) and mask.prefix_q is not None,
    )
    check_implementation(implementation, features)
    name = resolve(implementation, features)
    return IMPLEMENTATIONS[name].attend(
        q_BLHK,
        k_BSGK,
        v_BSGK,
        bias_bHLS,
        mask,
        dropout_rate=dropout_rate if dropout else 0.0,
        dropout_rng=dropout_rng,
        dtype=dtype,
    )
