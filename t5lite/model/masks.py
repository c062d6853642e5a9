"""An attention mask by its parts, so that each attention implementation builds what it needs.

The network states who attends to whom once per call, by per-position features: padding,
packed segments, causality and a prefix-LM's bidirectional prefix. The `xla` and `cudnn`
implementations take the dense `[B, 1, L, S]` boolean mask (`MaskParts.dense`); the chunked and
splash kernels compute each block's mask from the parts and never build the whole one; cuDNN
skips the blocks above a causal diagonal when told the mask is causal.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

Array = jax.Array

# NOTE: masked logits get this bias (fp32) instead of -inf, so fully masked rows (padding queries)
# give a uniform softmax rather than NaN.
MASK_VALUE = -1e10


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskParts:
    """An attention mask by its parts: key j is seen by query i when every part allows it.

    valid: `valid_q[b, i] and valid_kv[b, j]` (padding); segments: `segment_q[b, i] ==
    segment_kv[b, j]` (packed examples); causal: `j <= i`, or, with a prefix, also both in the
    bidirectional prefix (`prefix_q[b, i] and prefix_kv[b, j]`, the prefix-LM's inputs).
    """

    valid_q: Array | None = None
    valid_kv: Array | None = None
    segment_q: Array | None = None
    segment_kv: Array | None = None
    prefix_q: Array | None = None
    prefix_kv: Array | None = None
    causal: bool = dataclasses.field(default=False, metadata={"static": True})
    whole: Array | None = None
    """The whole mask [B, 1, L, S], built once by the network for all its layers (`with_whole`):
    what `dense` returns. Built where the network builds it, the mask is laid out as it always
    was (a mask built inside each layer took other layouts, and other collectives, under
    sequence and context parallelism); an implementation that reads only the parts leaves it
    unused, and XLA drops it."""

    def block(self, kv_start: Array | int, size: int, length_q: int) -> Array | None:
        """The mask of keys `[kv_start, kv_start + size)` for every query: [B, 1, L, size]."""
        parts = []

        def kv(x: Array) -> Array:
            return jax.lax.dynamic_slice_in_dim(x, kv_start, size, axis=1)

        if self.valid_q is not None:
            parts.append(self.valid_q[:, :, None] & kv(self.valid_kv)[:, None, :])
        if self.segment_q is not None:
            parts.append(self.segment_q[:, :, None] == kv(self.segment_kv)[:, None, :])
        if self.causal:
            q_pos = jnp.arange(length_q)[:, None]
            k_pos = kv_start + jnp.arange(size)[None, :]
            causal = (k_pos <= q_pos)[None]
            if self.prefix_q is not None:
                both = self.prefix_q[:, :, None] & kv(self.prefix_kv)[:, None, :]
                causal = causal | both
            parts.append(causal)
        if not parts:
            return None
        mask = functools.reduce(jnp.logical_and, parts)
        return (mask if mask.ndim == 3 else mask[None])[:, None]

    def dense(self, length_q: int, length_kv: int) -> Array | None:
        """The whole mask, [B, 1, L, S] (what the `xla` implementation takes)."""
        if self.whole is not None:
            return self.whole
        return self.block(0, length_kv, length_q)

    def with_whole(self, length_q: int, length_kv: int) -> MaskParts:
        """These parts with the whole mask built now (see `whole`)."""
        return dataclasses.replace(self, whole=self.block(0, length_kv, length_q))

    @property
    def empty(self) -> bool:
        """Every query sees every key."""
        return not self.causal and self.valid_q is None and self.segment_q is None

    def without_causal(self) -> MaskParts:
        """The same mask without the causal part (a prefix goes with it)."""
        return dataclasses.replace(self, causal=False, prefix_q=None, prefix_kv=None, whole=None)
